"""Accuracy guard: a mode may serve only if it agrees with fp32 eager on fixed inputs.

Before a worker reports READY, its task runs a fixed set of inputs through
fp32 eager (the reference) and through the configured mode, and compares:

    classification   top-1 agreement on the rows where the reference is decisive
                     (its best class leads the second by >= tie_margin in
                     probability: a near-tie may flip on rounding noise alone),
                     max |Δ probability| over all rows and classes, and the
                     cosine of the whole logit matrix.
    embeddings       the smallest per-row cosine similarity.
    generation       greedy tokens: the first `gen_tokens` new tokens must be
                     identical for at least `min_exact_fraction` of the prompts;
                     the first position where each prompt diverges is reported.

Thresholds come from `packrat.guard` in model_config.yaml (defaults below).
A failing mode raises AccuracyGuardError carrying every number, so TorchServe
logs it and the worker never becomes READY: the mode is refused, never served
silently. fp32 eager is the reference itself and is not compared.

The verdict is kept in the build cache (build_cache.py) per archive content,
mode, config, library versions and CPU: the next worker of the same archive
and mode takes it from there (a pass: no guard run; a refusal: refused at
once with the same numbers, before its mode is built). A changed archive has
another key and is guarded again.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

DEFAULTS: dict[str, float] = {
    "samples": 8,               # inputs compared (texts / images / prompts)
    "min_top1_agreement": 1.0,  # classification: fraction of decisive rows that must agree
    "tie_margin": 0.02,         # classification: a row is decisive when p1 - p2 >= this
    "max_prob_diff": 0.05,      # classification: max |p_mode - p_fp32|
    "min_cosine": 0.99,         # embeddings: min row cosine; classification: logit cosine
    "gen_tokens": 8,            # generation: compare the first N greedy tokens
    "min_exact_fraction": 1.0,  # generation: prompts whose first N tokens must match
}

GUARD_TEXTS = (
    "The film was a delight from the first scene to the last.",
    "I waited two hours for a cold meal and a rude waiter.",
    "Stock markets closed slightly higher on Tuesday after a quiet session.",
    "The new firmware update fixed the battery drain on most phones.",
    "Heavy rain is expected across the north of the country this weekend.",
    "She finished the marathon in under three hours despite the heat.",
    "This is the worst customer service I have ever experienced.",
    "The committee approved the budget for the new library building.",
    "Our team shipped the release on time and the users loved it.",
    "The museum reopened its east wing after a year of restoration.",
    "A quiet, well-written novel about memory and loss.",
    "The battery died after an hour and the screen cracked on day two.",
)

GUARD_PROMPTS = (
    "The engineers measured the latency of every server and",
    "Once upon a time in a small village by the sea",
    "The most important lesson I learned at school was",
    "Breaking news: the city council announced today that",
    "To install the package, first open a terminal and",
    "The recipe calls for two cups of flour, one egg and",
    "In the year 2050, most people will travel to work by",
    "The weather forecast for tomorrow says",
)


class AccuracyGuardError(RuntimeError):
    """A mode disagreed with fp32 eager beyond the configured thresholds."""

    def __init__(self, report: "GuardReport") -> None:
        super().__init__(report.message)
        self.report = report


@dataclass
class GuardReport:
    mode: str
    kind: str  # classification | embedding | generation
    ok: bool
    metrics: dict[str, Any]
    thresholds: dict[str, float]
    message: str = ""
    details: list[Any] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def thresholds(config: dict[str, Any]) -> dict[str, float]:
    """DEFAULTS overridden by model_config.yaml's `packrat.guard` mapping."""
    raw = (config.get("packrat") or {}).get("guard") or {}
    if not isinstance(raw, dict):
        raise ValueError(f"packrat.guard must be a mapping of thresholds, got {raw!r}")
    unknown = set(raw) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"packrat.guard: unknown keys {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    out = dict(DEFAULTS)
    out.update({k: float(v) for k, v in raw.items()})
    return out


def guard_requests(task: Any, th: dict[str, float]) -> list[dict]:
    """th["samples"] fixed, varied request items for a task (what both paths are compared on)."""
    n = int(th["samples"])
    if task.name in ("text-classification", "feature-extraction"):
        texts = [_fit(task, GUARD_TEXTS[i % len(GUARD_TEXTS)]) for i in range(n)]
        return [{"body": t.encode("utf-8")} for t in texts]
    if task.name == "image-classification":
        from packrat_tasks.samples import sample_jpeg

        sizes = ((320, 240), (256, 256), (400, 300), (240, 320))
        return [{"body": sample_jpeg(*sizes[i % len(sizes)], seed=100 + i)} for i in range(n)]
    if task.name == "text-generation":
        import json

        new = max(1, min(int(th["gen_tokens"]), task.cap))
        prompts = [GUARD_PROMPTS[i % len(GUARD_PROMPTS)] for i in range(n)]
        return [{"body": json.dumps({"text": p, "max_new_tokens": new}).encode("utf-8")}
                for p in prompts]
    raise ValueError(f"no guard inputs for task {task.name!r}")


def _fit(task: Any, text: str) -> str:
    """The longest word prefix of `text` the task accepts (archives may have a short max_length)."""
    words = text.split()
    while len(words) > 1 and len(task.tokenizer(" ".join(words)).input_ids) > task.max_length:
        words.pop()
    return " ".join(words)


def _fmt(ok: bool) -> str:
    return "ok" if ok else "FAIL"


def compare_classification(mode: str, ref: torch.Tensor, cand: torch.Tensor,
                           th: dict[str, float]) -> GuardReport:
    import torch

    ref, cand = ref.float(), cand.float()
    p_ref, p_cand = torch.softmax(ref, -1), torch.softmax(cand, -1)
    top2 = torch.topk(p_ref, min(2, p_ref.shape[-1]), dim=-1).values
    margin = top2[:, 0] - (top2[:, 1] if top2.shape[1] > 1 else 0)
    agree = p_ref.argmax(-1) == p_cand.argmax(-1)
    decisive = margin >= th["tie_margin"]
    n_dec = int(decisive.sum())
    dec_agree = int((agree & decisive).sum())
    frac = 1.0 if n_dec == 0 else dec_agree / n_dec
    max_diff = float((p_ref - p_cand).abs().max())
    cos = float(torch.nn.functional.cosine_similarity(ref.flatten(), cand.flatten(), dim=0))
    checks = {
        "top1": frac >= th["min_top1_agreement"],
        "prob": max_diff <= th["max_prob_diff"],
        "cosine": cos >= th["min_cosine"],
    }
    ok = all(checks.values())
    metrics = {
        "rows": int(ref.shape[0]), "top1_agreement_all": float(agree.float().mean()),
        "decisive_rows": n_dec, "decisive_agreeing": dec_agree, "top1_agreement_decisive": frac,
        "max_prob_diff": max_diff, "logit_cosine": cos,
    }
    message = (
        f"accuracy guard {'passed' if ok else 'REFUSED'} {mode} (classification, {ref.shape[0]} inputs "
        f"vs fp32 eager): top-1 agreement {dec_agree}/{n_dec} decisive rows = {frac:.3f} "
        f"(>= {th['min_top1_agreement']}: {_fmt(checks['top1'])}; all rows "
        f"{int(agree.sum())}/{ref.shape[0]}), max prob diff {max_diff:.4g} "
        f"(<= {th['max_prob_diff']}: {_fmt(checks['prob'])}), logit cosine {cos:.6f} "
        f"(>= {th['min_cosine']}: {_fmt(checks['cosine'])})"
    )
    return GuardReport(mode, "classification", ok, metrics, th, message)


def compare_embedding(mode: str, ref: torch.Tensor, cand: torch.Tensor,
                      th: dict[str, float]) -> GuardReport:
    import torch

    cos = torch.nn.functional.cosine_similarity(ref.float(), cand.float(), dim=-1)
    worst, mean = float(cos.min()), float(cos.mean())
    ok = worst >= th["min_cosine"]
    message = (
        f"accuracy guard {'passed' if ok else 'REFUSED'} {mode} (embedding, {ref.shape[0]} inputs vs "
        f"fp32 eager): min cosine {worst:.6f} (>= {th['min_cosine']}: {_fmt(ok)}), mean {mean:.6f}"
    )
    return GuardReport(mode, "embedding", ok, {"rows": int(ref.shape[0]), "min_cosine": worst,
                                               "mean_cosine": mean}, th, message)


def compare_generation(mode: str, ref: list[list[int]], cand: list[list[int]],
                       th: dict[str, float]) -> GuardReport:
    n = int(th["gen_tokens"])
    diverge: list[int | None] = []  # first differing position per prompt (None: identical)
    for r, c in zip(ref, cand):
        r, c = r[:n], c[:n]
        pos = next((i for i, (a, b) in enumerate(zip(r, c)) if a != b), None)
        if pos is None and len(r) != len(c):
            pos = min(len(r), len(c))
        diverge.append(pos)
    exact = sum(d is None for d in diverge)
    frac = exact / max(1, len(diverge))
    ok = frac >= th["min_exact_fraction"]
    where = ", ".join(f"prompt {i}: token {d}" for i, d in enumerate(diverge) if d is not None)
    message = (
        f"accuracy guard {'passed' if ok else 'REFUSED'} {mode} (generation, {len(diverge)} prompts "
        f"vs fp32 eager greedy): first {n} tokens identical for {exact}/{len(diverge)} prompts = "
        f"{frac:.3f} (>= {th['min_exact_fraction']}: {_fmt(ok)})"
        + (f"; diverges at {where}" if where else "")
    )
    return GuardReport(mode, "generation", ok, {"prompts": len(diverge), "exact_prompts": exact,
                                                "exact_fraction": frac, "first_divergence": diverge},
                       th, message, details=[{"reference": r[:n], "mode": c[:n]} for r, c in zip(ref, cand)])


# -- the verdict, once per (archive, mode) ------------------------------------------

VERDICT_FILE = "verdict.json"


def _verdict_key(mode: str, kind: str, config: dict[str, Any]) -> dict[str, Any]:
    from packrat_tasks.build_cache import config_digest

    # Thresholds are in the config; named too so a reader of key.json sees them.
    return {"what": "guard", "kind": kind, "thresholds": thresholds(config),
            "config": config_digest(config)}


def cached_verdict(model_dir: str | None, mode: str, kind: str,
                   config: dict[str, Any]) -> dict[str, Any] | None:
    """The GuardReport dict this archive's `mode` got before, or None (never guarded,
    no model_dir, or the cache is unusable). Keyed by build_cache: a changed
    archive, config, library version or CPU has no verdict yet. Under "artefacts":
    the build ids of the cached files it judged (report_of() drops it)."""
    if model_dir is None:
        return None
    import json

    from packrat_tasks import build_cache

    try:
        key_dir = build_cache.artifact_dir(model_dir, mode, None, _verdict_key(mode, kind, config))
        if not build_cache.use(key_dir):  # missing, or damaged (then removed)
            return None
        verdict = json.loads((key_dir / VERDICT_FILE).read_text())
    except (OSError, ValueError) as exc:
        log.warning("accuracy guard: cached verdict unreadable (%s); guarding", exc)
        return None
    fields = set(GuardReport.__dataclass_fields__)
    if not isinstance(verdict, dict) or not fields <= set(verdict) or verdict.get("mode") != mode:
        return None
    return {**{k: verdict[k] for k in fields}, "artefacts": verdict.get("artefacts")}


def report_of(verdict: dict[str, Any]) -> GuardReport:
    return GuardReport(**{k: verdict[k] for k in GuardReport.__dataclass_fields__})


def store_verdict(model_dir: str | None, mode: str, kind: str, config: dict[str, Any],
                  report: GuardReport, artefacts: dict[str, str] | None = None) -> str:
    """Keep `report` for the next worker of this archive and mode, naming the builds it
    judged (`artefacts`: what -> build id; a rebuilt file is judged again); "built",
    or "off" when there is no cache (no model_dir, or it cannot be written: the worker
    goes on). Replaces the verdict on earlier builds."""
    if model_dir is None:
        return "off"
    import json

    from packrat_tasks import build_cache

    data = json.dumps({**report.as_dict(), "artefacts": artefacts or {}}, default=float)
    try:
        key_dir = build_cache.artifact_dir(model_dir, mode, None, _verdict_key(mode, kind, config))
        build_cache.build_once(key_dir, lambda tmp: (tmp / VERDICT_FILE).write_text(data), replace=True)
    except OSError as exc:
        log.warning("accuracy guard: verdict not cached (%s)", exc)
        return "off"
    return "built"


def enforce(report: GuardReport) -> GuardReport:
    if not report.ok:
        raise AccuracyGuardError(report)
    return report
