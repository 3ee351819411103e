"""Keep the controller running: run it as a child process, start it again when it crashes.

`packrat controller --restart-on-crash` (what `make run` and the pod's entrypoint use).
The controller can be killed and started again at any time without serving noticing
(on start it reads the live versions and finishes what a killed one left half done,
docs/live-plans.md), so a crash (an OOM kill, a segfault in a runtime, an unexpected
exit after it ran a while) need not leave the models unmanaged until someone notices.

What counts as a crash: the child killed by a signal nobody sent through this process
(SIGKILL, SIGSEGV, SIGABRT, ...), or a non-zero exit after it ran at least
`min_uptime_s`. A non-zero exit sooner is a start-up refusal (a port taken, another
controller on the same TorchServe, a bad flag): it is this process's exit too, so
whatever started it sees the error. SIGTERM, SIGINT and SIGHUP are passed to the child
and end both, unless ignored when it started (nohup).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from packrat.backoff import STOP_SIGNALS, Backoff, crashed, how_it_ended

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class RestartPolicy:
    min_uptime_s: float = 10.0  # a non-zero exit sooner is a start-up refusal, not a crash
    delay_s: float = 1.0  # before the first restart; doubled while restarts come quickly
    max_delay_s: float = 60.0
    stable_s: float = 60.0  # a child that ran this long resets the delay


def _die_with_parent() -> None:
    # In the child before exec: a supervisor killed with SIGKILL leaves no controller behind.
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def supervise(command: Sequence[str], policy: RestartPolicy = RestartPolicy(),
              say: Callable[[str], None] = lambda text: print(text, file=sys.stderr, flush=True)) -> int:
    """Run `command` until it ends other than by a crash; its exit status (128 + signal for a signal)."""
    stopping = threading.Event()
    stopped_by: list[int] = []
    child: subprocess.Popen | None = None

    def stop(signum: int, _frame: object) -> None:
        stopped_by.append(signum)
        stopping.set()
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    # A signal ignored here stays ignored, in the child too (nohup's SIGHUP, a background
    # job's SIGINT: closing make run's terminal must not stop the controller).
    previous = {signum: signal.signal(signum, stop) for signum in STOP_SIGNALS
                if signal.getsignal(signum) is not signal.SIG_IGN}
    backoff = Backoff(policy.delay_s, policy.max_delay_s, policy.stable_s)
    try:
        while True:
            started = time.monotonic()
            child = subprocess.Popen(list(command), preexec_fn=_die_with_parent)
            code = child.wait()
            lived = time.monotonic() - started
            if stopping.is_set() or not crashed(code, lived, policy.min_uptime_s):
                return 128 - code if code < 0 else code
            delay = backoff.after(lived)
            say(f"packrat: the controller (pid {child.pid}) {how_it_ended(code)} after {lived:.0f} s; "
                f"starting it again in {delay:g} s")
            if stopping.wait(delay):
                return 128 + stopped_by[0]
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
