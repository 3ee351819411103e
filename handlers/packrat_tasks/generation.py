"""`text-generation`: GPT-2-family greedy decoding.

Input per request: raw UTF-8 prompt, or JSON {"text": "...", "max_new_tokens": n}
with 1 <= n <= `packrat.max_new_tokens_cap` (default `packrat.default_max_new_tokens`).
Prompts of different lengths share one batch: left padding plus an attention
mask, so every row's last real token sits at the end and generate() derives
position ids from the mask. The batch generates the largest n asked for; each
row is then cut to its own n (greedy rows are independent, so this equals
generating that row alone) and after its first end-of-text token, which is
where generate() on that row alone would have stopped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from typing import Any

import torch

from packrat_tasks import guard
from packrat_tasks.base import (
    TEXT_CHARS_PER_TOKEN, Batch, RequestError, Task, check_text, get_field, parse_json_or_text,
)
from packrat_tasks.precision import PrecisionError, bf16_weights_info, precision_name, prepare_torch
from packrat_tasks.quantize_static import generation_refusal
from packrat_tasks.runner import Runner, memory_mb, mode_name, runtime_name
from packrat_tasks.samples import sample_text

log = logging.getLogger(__name__)

SAMPLE_PROMPT = (
    "The engineers measured the latency of every server in the rack and wrote down "
    "what they saw, because the next step of the plan depended on"
)


class TextGenerationTask(Task):
    name = "text-generation"

    def __init__(self, model_dir: str, config: dict[str, Any]) -> None:
        super().__init__(model_dir, config)
        import transformers

        section = config.get("packrat") or {}
        path = os.path.join(model_dir, section.get("model_dir", "model"))
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        self.tokenizer.padding_side = "left"
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        self.eos = self.tokenizer.eos_token_id
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos
        self.max_length = int(section.get("max_length", 128))
        self.max_text_chars = int(section.get("max_text_chars", TEXT_CHARS_PER_TOKEN * self.max_length))
        self.cap = int(section.get("max_new_tokens_cap", 32))
        self.default_new = min(int(section.get("default_max_new_tokens", 16)), self.cap)
        self.positions = int(getattr(self.model.config, "n_positions", 1024))
        # packrat.precision (eager only): sets self.model/self.autocast, warms up, guards.
        self.runner = build_generation(self, config)

    def parse(self, request: dict) -> tuple[list[int], int]:
        obj = parse_json_or_text(request, self.max_body_bytes, self.max_json_depth)
        if isinstance(obj, dict):
            text = get_field(obj, "text", str, required=True)
            new = get_field(obj, "max_new_tokens", int, default=self.default_new)
        else:
            text, new = obj, self.default_new
        if not 1 <= new <= self.cap:
            raise RequestError(400, f"max_new_tokens must be between 1 and {self.cap}, got {new}")
        check_text(text, self.max_text_chars)
        ids = self.tokenizer(text).input_ids
        if len(ids) > self.max_length:
            raise RequestError(
                413, f"prompt is {len(ids)} tokens long; this model accepts at most {self.max_length}"
            )
        if len(ids) + new > self.positions:
            raise RequestError(400, f"prompt ({len(ids)} tokens) + max_new_tokens ({new}) "
                                    f"exceeds the model's {self.positions} positions")
        return ids, new

    def collate(self, batch: Batch) -> None:
        rows = [batch.items[i][0] for i in batch.valid]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, row in enumerate(rows):
            ids[r, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[r, width - len(row):] = 1
        batch.inputs = {"input_ids": ids, "attention_mask": mask,
                        "max_new_tokens": max(batch.items[i][1] for i in batch.valid)}

    def forward(self, batch: Batch) -> Batch:
        with torch.inference_mode(), self.autocast():
            out = self.model.generate(
                input_ids=batch.inputs["input_ids"],
                attention_mask=batch.inputs["attention_mask"],
                max_new_tokens=batch.inputs["max_new_tokens"],
                do_sample=False,
                num_beams=1,
                pad_token_id=self.pad,
                eos_token_id=self.eos,
            )
        batch.outputs = out[:, batch.inputs["input_ids"].shape[1]:]
        return batch

    def respond(self, batch: Batch) -> list[Any]:
        out = []
        for row, i in zip(batch.outputs.tolist(), batch.valid):
            prompt, new = batch.items[i]
            tokens = row[:new]
            if self.eos in tokens:
                tokens = tokens[: tokens.index(self.eos) + 1]
            out.append({
                "generated_text": self.tokenizer.decode(tokens, skip_special_tokens=True),
                "token_ids": tokens,
                "prompt_tokens": len(prompt),
            })
        return out

    def served_sizes(self, batch: Batch, responses: list[Any]) -> dict[str, list[int]]:
        return {"tokens": [len(batch.items[i][0]) for i in batch.valid],
                "generated": [len(responses[i]["token_ids"]) for i in batch.valid]}

    def sample_requests(self, n: int, sizes: dict[str, int] | None = None) -> list[dict]:
        if not sizes or not {"tokens", "generated"} & set(sizes):
            return [{"body": SAMPLE_PROMPT.encode("utf-8")} for _ in range(n)]
        prompt = SAMPLE_PROMPT
        if "tokens" in sizes:  # a prompt of that many tokens (at least 1, at most max_length)
            prompt = sample_text(self.tokenizer, max(1, min(self.max_length, int(sizes["tokens"]))))
        new = max(1, min(self.cap, int(sizes.get("generated", self.default_new))))
        body = json.dumps({"text": prompt, "max_new_tokens": new}).encode("utf-8")
        return [{"body": body, "content_type": "application/json"} for _ in range(n)]


def build_generation(task: TextGenerationTask, config: dict[str, Any]) -> Runner:
    """Precision for text-generation (greedy decoding runs eager): sets task.model and
    task.autocast, warms up, and guards the first greedy tokens against fp32.

    The task's forward() must run `task.model.generate` inside `task.autocast()`.
    """
    if precision_name(config) == "int8s":
        raise PrecisionError(generation_refusal())
    if runtime_name(config) != "eager":
        raise ValueError("text-generation supports packrat.runtime: eager only "
                         "(the decoding loop is not traced or exported)")
    mode = mode_name(config)
    th = guard.thresholds(config)
    fp32_model = task.model
    task.autocast = contextlib.nullcontext
    tg = time.perf_counter()
    batch = task.preprocess(guard.guard_requests(task, th))
    reference = None
    if mode != "fp32-eager":
        reference = task.forward(batch).outputs.tolist()
    rss0, _ = memory_mb()
    t0 = time.perf_counter()
    # bf16w: a bf16 copy; the fp32 model is dropped when this returns (half the memory).
    task.model, task.autocast = prepare_torch(fp32_model, precision_name(config))
    task.model.eval()
    t1 = time.perf_counter()
    candidate = task.forward(batch).outputs.tolist()  # also the warm-up
    task.forward(batch)
    rss, peak = memory_mb()
    runner = Runner(fn=task.model.generate, mode=mode, threads=torch.get_num_threads(),
                    build_s=round(time.perf_counter() - t0, 3), rss_mb=round(rss, 1),
                    rss_delta_mb=round(rss - rss0, 1), peak_rss_mb=round(peak, 1))
    if precision_name(config) == "bf16w":
        runner.info["bf16w"] = bf16_weights_info(task.model)
    # The greedy runs are both the warm-up and the guard's candidate: counted as warm-up.
    runner.phases_s = {"guard": round(t0 - tg, 3), "mode_build": round(t1 - t0, 3),
                       "warmup": round(time.perf_counter() - t1, 3)}
    if reference is not None:
        report = guard.compare_generation(mode, reference, candidate, th)
        runner.guard = report.as_dict()
        log.info("%s", report.message)
        guard.enforce(report)
    log.info("packrat mode %s ready: %s", mode, runner.summary())
    return runner
