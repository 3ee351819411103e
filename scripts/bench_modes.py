#!/usr/bin/env python
"""Execution modes side by side, in one run (issue 7).

Per model (resnet50, bert-base at sequence length 128, gpt2 with 16 new
tokens) and batch B:

  1. in-process: every Packrat mode (packrat_handler.load_task with
     packrat.precision/runtime set; forward() only = the model path), with
     all usable cores as threads;
  2. the peers' floor: ONNX Runtime and OpenVINO called directly on the same
     tensors with their own best settings (ORT: all graph optimisations,
     intra-op = cores; OpenVINO: LATENCY hint with its default precision,
     which is bf16 on a CPU with avx512_bf16, and f32 explicitly);
  3. through TorchServe: the best in-process mode of the model, archived by
     `packrat archive` and served with the two realisable shapes on this
     machine's cores (fat: 1 worker x all threads, batch cap B; thin: one
     pinned 1-thread worker per core, batch cap B / cores), B closed-loop
     clients; p50 request latency ~ time to finish a batch.

Then DistilBERT, 8-token input, batch 1, one client: p50 through TorchServe
for the fastest modes (target <= 4 ms).

`--int8s` runs only the int8-static comparison (issue 17) instead: per model
(resnet50, bert-base), the best bf16 mode against int8-static, in process
(build time incl. calibration and quantisation, memory, guard numbers; timed
calls interleaved round by round) and through TorchServe at B = 8, fat and
thin, both modes registered side by side and measured alternately.

    python scripts/bench_modes.py --int8s --models resnet50,bert-base --out bench-out/int8s.jsonl
    python scripts/bench_modes.py --report-int8s bench-out/int8s.jsonl

Every measurement is appended to a JSONL file the moment it lands
(--out, default bench-out/modes.jsonl); --report renders the markdown table
from that file only. Timings on a shared 2-core machine are noisy: read the
ratios within one run.

    python scripts/bench_modes.py --out bench-out/modes.jsonl
    python scripts/bench_modes.py --report bench-out/modes.jsonl > section.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from packrat.bench.mode_compare import measure, measure_int8s, render, render_int8s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet50,bert-base,gpt2")
    parser.add_argument("--batches", default="1,4,8,16")
    parser.add_argument("--ts-batches", default="1,4,8,16", help="B through TorchServe")
    parser.add_argument("--budget", type=float, default=3.0, help="seconds of timed calls per point")
    parser.add_argument("--modes", default=None, help="comma list: only these in-process modes")
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--no-torchserve", action="store_true")
    parser.add_argument("--no-distilbert", action="store_true")
    parser.add_argument("--distil-modes", default="fp32-onnxruntime,bf16-openvino,fp32-eager")
    parser.add_argument("--requests", type=int, default=24, help="measured requests per TorchServe point")
    parser.add_argument("--out", type=Path, default=Path("bench-out/modes.jsonl"))
    parser.add_argument("--report", type=Path, default=None, help="render markdown from a JSONL file")
    parser.add_argument("--int8s", action="store_true", help="only int8-static vs the best bf16 mode")
    parser.add_argument("--int8s-batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6, help="--int8s: interleaved rounds in process")
    parser.add_argument("--ts-rounds", type=int, default=2, help="--int8s: alternating TorchServe rounds")
    parser.add_argument("--report-int8s", type=Path, default=None, help="render the --int8s tables")
    args = parser.parse_args()
    if args.report:
        print(render(args.report))
    elif args.report_int8s:
        print(render_int8s(args.report_int8s))
    elif args.int8s:
        measure_int8s([m for m in args.models.split(",") if m], args.int8s_batch, args.rounds,
                      not args.no_torchserve, args.requests, args.ts_rounds, args.out)
    else:
        measure([m for m in args.models.split(",") if m], [int(b) for b in args.batches.split(",")],
                [int(b) for b in args.ts_batches.split(",")], args.budget,
                args.modes.split(",") if args.modes else None, not args.no_peers, not args.no_torchserve,
                [] if args.no_distilbert else args.distil_modes.split(","), args.requests, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
