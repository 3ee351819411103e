"""The controller's own Prometheus series (beside the re-plan loop's) for GET /metrics."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from packrat.control.live import served_mode
from packrat.types import Plan, SwapRecord


class ControllerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.tick_errors = Counter("packrat_controller_tick_errors",
                                   "Exceptions caught in the controller's tick (logged; the loop goes on)",
                                   registry=registry)
        # packrat_swaps_total and packrat_swap_phase_seconds: names a dashboard relies on.
        self.swaps = Counter("packrat_swaps", "Swaps run by the controller, by outcome",
                             ["model", "outcome"], registry=registry)
        self.swap_phases = Histogram(
            "packrat_swap_phase_seconds",
            "Seconds per swap phase (docs/live-plans.md: the ready phase split into worker_start, "
            "model_load, mode_build, guard, warmup, ready_check)",
            ["model", "phase"], registry=registry,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 8, 13, 20, 30, 60, 120, 300))
        self.swap_running = Gauge("packrat_controller_swap_running", "1 while a swap runs", registry=registry)
        self.lost_versions = Counter(
            "packrat_controller_lost_versions",
            "Times the version of a model's last swap was no longer loaded (TorchServe restarted)",
            ["model"], registry=registry)
        self.reapplies = Counter("packrat_controller_reapplies",
                                 "Last plans applied again after their version was lost", ["model"],
                                 registry=registry)
        self.unreachable = Gauge("packrat_controller_torchserve_unreachable",
                                 "1 while TorchServe's management API does not answer the tick",
                                 registry=registry)
        # Cores among models (packrat.plan.share): how many cores each model may use now.
        self.model_cores = Gauge("packrat_model_cores", "Cores the model may use now (its share, the "
                                 "shared core when idle, else every usable core)", ["model"], registry=registry)
        self.redivisions = Counter("packrat_core_divisions", "Times the division of cores among models "
                                   "changed, by why", ["why"], registry=registry)

    def observe_phases(self, record: SwapRecord) -> None:
        """Every phase of the record, "ready" replaced by its breakdown when the workers gave one."""
        breakdown = dict(record.ready_phases_s)
        for name, seconds in record.phases_s:
            for leaf, s in (breakdown.items() if name == "ready" and breakdown else [(name, seconds)]):
                self.swap_phases.labels(record.model, leaf).observe(s)


class LivePlans:
    """Collector: the plan each model's last swap made live (last-plans.json), read at
    scrape time, so GET /metrics never calls TorchServe (dashboards: docs/grafana/); a
    directory's model_config.yaml is parsed again only when it changes (live.served_mode)."""

    def __init__(self, last_plans: Callable[[], dict[str, dict[str, Any]]], model_store: Path) -> None:
        self.last_plans = last_plans
        self.model_store = model_store

    def describe(self) -> list[Any]:
        return []  # registering must not read the state dir; the names are not checked for clashes

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily

        info = InfoMetricFamily("packrat_live_plan", "The live version, mode and shape of each model "
                                "(the plan the controller keeps live)", labels=["model"])
        workers = GaugeMetricFamily("packrat_live_plan_workers", "Workers of the live plan", labels=["model"])
        batch = GaugeMetricFamily("packrat_live_plan_batch", "Load batch B the live plan was made for",
                                  labels=["model"])
        predicted = GaugeMetricFamily("packrat_live_plan_predicted_latency_ms",
                                      "Predicted latency of the live plan (absent: not predicted)",
                                      labels=["model"])
        # Beside packrat_traffic_size{model, kind}: the input the prediction is for.
        sizes = GaugeMetricFamily("packrat_prediction_size", "Request size the live plan's predicted latency "
                                  "is for: the timed size of the profile it was made from (kind: tokens, "
                                  "pixels, generated; absent: not known)", labels=["model", "kind"])
        for model, entry in sorted(self.last_plans().items()):
            try:
                plan = Plan.from_dict(entry["plan"])
            except (KeyError, TypeError, ValueError):
                continue
            mode = plan.mode or served_mode(self.model_store / str(entry.get("url", ""))) or ""
            counts: dict[tuple[int, int], int] = {}
            for tb in plan.shape:
                counts[tb] = counts.get(tb, 0) + 1
            shape = " + ".join(f"{n}x {t}t/b{b}" for (t, b), n in counts.items())
            info.add_metric([model], {"version": str(entry.get("version")), "mode": mode, "shape": shape})
            workers.add_metric([model], len(plan.instances))
            batch.add_metric([model], plan.batch)
            if plan.predicted_latency_ms:
                predicted.add_metric([model], plan.predicted_latency_ms)
                for kind, size in plan.sizes:
                    sizes.add_metric([model, kind], size)
        return [info, workers, batch, predicted, sizes]
