"""Draw a profile (latency against threads, one line per batch) with a plan marked."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from packrat.types import Plan, Profile


def plot_plan(profile: Profile, plan: Plan, path: str | Path) -> None:
    """Write a PNG (or any format matplotlib infers from the suffix) to `path`."""
    import matplotlib

    # A file is all we want: never touch a display, even if one is set.
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_batch: dict[int, list[tuple[int, float]]] = {}
    for p in profile.points:
        if p.threads <= plan.cores:
            by_batch.setdefault(p.batch, []).append((p.threads, p.mean_ms))
    fig, ax = plt.subplots(figsize=(8, 5.5))
    try:
        cmap = plt.get_cmap("viridis", max(len(by_batch), 2))
        for k, (b, pts) in enumerate(sorted(by_batch.items())):
            pts.sort()
            ax.plot([t for t, _ in pts], [ms for _, ms in pts], marker=".",
                    color=cmap(k), linewidth=1, label=f"b={b}")
        counts = Counter((i.threads, i.batch, i.latency_ms) for i in plan.instances)
        for (t, b, ms), n in counts.items():
            ax.scatter([t], [ms], s=160, facecolors="none", edgecolors="red", linewidths=2,
                       zorder=5)
            ax.annotate(f"{n}×(t={t}, b={b})", (t, ms), textcoords="offset points",
                        xytext=(8, 6), color="red", fontsize=8)
        ax.axhline(plan.predicted_latency_ms, color="red", linestyle=":", linewidth=1,
                   label=f"plan {plan.predicted_latency_ms:.1f} ms")
        if plan.fat_latency_ms is not None:
            ax.axhline(plan.fat_latency_ms, color="grey", linestyle="--", linewidth=1,
                       label=f"fat {plan.fat_latency_ms:.1f} ms")
        ax.set_yscale("log")
        ax.set_xlabel("threads (cores) per instance")
        ax.set_ylabel("latency of one instance (ms)")
        ax.set_title(f"{profile.model_id}: T={plan.cores}, B={plan.batch}, "
                     f"{len(plan.instances)} instance(s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2, loc="upper right")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
