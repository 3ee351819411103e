"""Packrat's task implementations, shipped inside every archive beside packrat_handler.py.

One module per task; build_task() picks one from model_config.yaml's
`packrat.task`. Nothing here runs at import time: torch and transformers are
imported when a task is built.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from packrat_tasks.base import Task

# task name -> (module, class)
TASKS = {
    "noop": ("packrat_tasks.noop", "NoopTask"),
    "text-classification": ("packrat_tasks.text", "TextClassificationTask"),
    "feature-extraction": ("packrat_tasks.text", "FeatureExtractionTask"),
    "text-generation": ("packrat_tasks.generation", "TextGenerationTask"),
    "image-classification": ("packrat_tasks.image", "ImageClassificationTask"),
}


def build_task(model_dir: str, config: dict[str, Any]) -> Task:
    name = (config.get("packrat") or {}).get("task")
    if name not in TASKS:
        raise ValueError(f"model_config.yaml packrat.task must be one of {sorted(TASKS)}, got {name!r}")
    module_name, class_name = TASKS[name]
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(model_dir, config)
