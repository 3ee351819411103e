#!/usr/bin/env python
"""Account for every millisecond (issue 35, item 1): one model, mode, plan and payload,
measured in one run, interleaved over --rounds rounds:

- raw: the mode's runtime alone (the handler's own runner, forward on inputs preprocessed
  once), the plan's workers as pinned profiler workers on the plan's cores, all at once;
- handler: the handler path in process (decode, preprocess, forward, postprocess) on the
  same payload, the same workers;
- served: through TorchServe with the plan live (the controller's live-plan swap), C
  closed-loop clients (default: the plan's load batch; --client lean, one thread over raw
  keep-alive sockets at ~0.03 ms of CPU a request, or urllib3, a thread per client), and the CPU time per request of
  every process (each worker, the frontend JVM, the rest of TorchServe's process group,
  the controller when --controller-pid names one, this client) read from /proc;
- peer: the same clients and windows against the same archive served by LitServe (the
  bench-only extra: pip install -e '.[peer]'), one pinned worker per plan worker, and
  the CPU per request of its processes; skipped, with a line saying so, without litserve
  or with --no-peer.

Prints served/handler, handler/raw and served/peer, p50/p99 at each, and the per-process
CPU tables;
writes <out>/results.jsonl (rows as they land) and <out>/summary.md (the machine named).

    python scripts/bench_efficiency.py --model resnet50 --mode fp32-eager --plan '2x(t1,b4)' \\
        --out bench-out/efficiency-resnet50
    python scripts/bench_efficiency.py --report bench-out/efficiency-resnet50/results.jsonl
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from packrat.bench.efficiency import EfficiencySettings, run_efficiency
from packrat.bench.loadgen import CLIENTS
from packrat.bench.efficiency_report import last_run, render


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50", help="named architecture or archive directory")
    parser.add_argument("--mode", default="fp32-eager", help="execution mode, <precision>-<runtime>")
    parser.add_argument("--plan", default="2x(t1,b4)", help="workers: n x (threads, batch cap), '+'-joined")
    parser.add_argument("--clients", type=int, default=None, help="closed-loop clients (default: sum of caps)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0, help="each raw and handler point")
    parser.add_argument("--served-s", type=float, default=20.0, help="each served (and peer) window")
    parser.add_argument("--warm-s", type=float, default=60.0, help="served (and peer) load before the first round")
    parser.add_argument("--warm-max-s", type=float, default=240.0,
                        help="served load goes on after --warm-s until the JVM's JIT compilers are quiet, at most this")
    parser.add_argument("--rewarm-s", type=float, default=3.0, help="served (and peer) load before each window")
    parser.add_argument("--client", choices=CLIENTS, default="lean",
                        help="the served and peer levels' closed loop (default lean: the least client CPU)")
    parser.add_argument("--no-peer", action="store_true", help="leave out the peer level (LitServe)")
    parser.add_argument("--max-length", type=int, default=None, help="text models: payload tokens")
    parser.add_argument("--controller-pid", type=int, default=None, help="a running controller to read too")
    parser.add_argument("--out", type=Path, default=Path("bench-out/efficiency"))
    parser.add_argument("--report", type=Path, default=None, help="render a results.jsonl and exit")
    args = parser.parse_args()
    if args.report:
        print(render(last_run(args.report)), end="")
        return 0
    settings = EfficiencySettings(
        model=args.model, out=args.out, mode=args.mode, plan=args.plan, clients=args.clients, rounds=args.rounds,
        seconds=args.seconds, served_s=args.served_s, warm_s=args.warm_s, warm_max_s=args.warm_max_s,
        rewarm_s=args.rewarm_s,
        max_length=args.max_length, controller_pid=args.controller_pid, peer=not args.no_peer,
        client=args.client, command=" ".join(sys.argv))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run_efficiency's finally stops its servers
    print(run_efficiency(settings).read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
