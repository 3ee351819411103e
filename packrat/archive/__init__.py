"""Model archives: TorchServe no-archive directories built from local HF dirs or named architectures."""

from packrat.archive.builder import (
    ArchiveOptions,
    build_from_dir,
    build_named,
    build_noop,
    handler_is_current,
    infer_task,
)

__all__ = ["ArchiveOptions", "build_from_dir", "build_named", "build_noop", "handler_is_current",
           "infer_task"]
