#!/usr/bin/env python
"""Fuzz campaign: >= 10,000 fuzzed inputs across every task through a real TorchServe.

    .venv/bin/python scripts/fuzz_inputs.py [--inputs 10000] [--seed 0] \\
        [--out docs/benchmarks/fuzz-inputs-defaults.json]

Builds the tiny archives with the shipped default limits into a scratch store
(bench-out/fuzz; refused if one overrides an image limit), starts TorchServe on
free loopback ports (token auth on) with config.properties, as `make run` does
(TorchServe's default max_request_size, 6,553,500 bytes; refused if it sets
one), and registers one batching version (batch 4) per task. Each hypothesis example
draws a task and one fuzzed request from packrat/bench/fuzz.py's strategies
(the ones tests/test_fuzz_inputs.py uses, with larger real images and, for half
of the image requests, images at and past the default limits: up to 8000x8000,
bodies padded to TorchServe's request limit and to 10 MiB; one draw
per example, since several draws per example made hypothesis skew away from
images). Three fuzzed requests of a task are sent at once with one good
request, so fuzz shares batches with good input; two such groups are in
flight at a time.

Counted: every fuzzed answer by task, input class and status; answers outside
200 and the documented 4xx (docs/handler.md), 5xx above all, with examples;
good requests that did not get 200; worker restarts (pid changes, checked
every 100 groups and at the end); answer latency per input class; the large
images by their header's size and format, with who refused them (TorchServe or
the handler, its first message); the limits in force; each worker's resident
and peak resident memory before and after; the load average.

Then, outside the 10,000 and counted apart, `--frontend-probes` arbitrary
bodies declared as form data (x-www-form-urlencoded, multipart without a
boundary): TorchServe's frontend decodes those itself, before any worker, and
its answers to them are TorchServe's, not the handler's.

The JSON (docs/benchmarks/fuzz-inputs-defaults.json; fuzz-inputs.json is the
earlier run, images up to 1,000,000 pixels) and a markdown table on stdout feed
docs/reliability.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from packrat.bench.fuzz_campaign import report, run_campaign
from packrat.bench.paths import BENCH_OUT, RESULTS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inputs", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--frontend-probes", type=int, default=300)
    parser.add_argument("--workdir", type=Path, default=BENCH_OUT / "fuzz")
    parser.add_argument("--out", type=Path, default=RESULTS / "fuzz-inputs-defaults.json")
    args = parser.parse_args()
    result = run_campaign(args.inputs, args.seed, args.frontend_probes, args.workdir, args.out,
                          "scripts/fuzz_inputs.py " + " ".join(sys.argv[1:]))
    print(report(result))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
