"""Markdown summary of saved profiles (scripts/profile_summary.py, for docs/profiler.md): run
time, points, latency table. Reads only the saved files; measures nothing.
"""

from __future__ import annotations

from pathlib import Path

from packrat.profile import load_profile


def summarize(path: Path) -> str:
    profile = load_profile(path)
    x = profile.extra
    fp = profile.fingerprint
    points = sorted(profile.points, key=lambda p: (p.threads, p.batch))
    converged = sum(1 for p in points if p.meta.get("converged"))
    workers = x.get("workers", [])
    load = ", ".join(f"t={w['threads']}: {w.get('load_s', '?')} s" for w in workers)
    lines = [
        f"### {x.get('model_name') or profile.model_id} (`{path.name}`)",
        "",
        f"- model_id `{profile.model_id[:23]}…`, scope `{profile.scope}`, "
        f"fingerprint {fp.cpu_model} / {fp.usable_cores} cores / {fp.allocator} / torch {fp.torch_version} / {fp.mode}",
        f"- created {x.get('created')}, **wall time {x.get('duration_s')} s**; "
        f"{len(points)} points ({converged} converged to ±5 %), {len(x.get('omitted', []))} omitted; "
        f"model load per worker: {load}",
        "",
        "| threads | batch | mean ms | p50 ms | p99 ms | std ms | count | converged | point s |",
        "|---:|---:|---:|---:|---:|---:|---:|:---:|---:|",
    ]
    for p in points:
        std = f"{p.std_ms:.1f}" if p.std_ms is not None else "—"
        lines.append(
            f"| {p.threads} | {p.batch} | {p.mean_ms:.1f} | {p.p50_ms:.1f} | {p.p99_ms:.1f} | {std} | "
            f"{p.count} | {'yes' if p.meta.get('converged') else 'no'} | {p.meta.get('elapsed_s', '?')} |"
        )
    for o in x.get("omitted", []):
        lines.append(f"| {o['threads']} | {o['batch']} | omitted: {o['reason']} | | | | | | |")
    return "\n".join(lines) + "\n"
