"""The one load generator: every benchmark, swap measurement, test and script sends through it.

Three shapes of load over one client (connection.py: a keep-alive urllib3
connection per sending thread, loopback only):

* counted.py: closed loop (B clients, one request outstanding each) and open
  loop (Poisson arrivals), a fixed number of measured requests -> LoadResult;
* continuous.py: ContinuousLoad, closed loop until stopped, every answer
  checked and every request accounted for (swap tests and measurements);
* arrivals.py: PoissonLoad, an open loop until stopped, every answer checked
  (soak runs);
* stepped.py: StepLoad, a closed loop whose concurrency follows a schedule
  (adaptation tests and traces);
* lean.py: a closed loop for a timed window from one thread over raw sockets, at
  a tenth of the client CPU a request (the efficiency bench, where the client
  shares the 2 cores with what it measures).

Latency percentiles everywhere come from packrat.bench.stats.percentile.
"""

from packrat.bench.loadgen.arrivals import PoissonLoad
from packrat.bench.loadgen.connection import Connection, check_loopback
from packrat.bench.loadgen.continuous import (
    STOP_GRACE_S, Check, ContinuousLoad, Sample, in_windows, latency_summary,
)
from packrat.bench.loadgen.counted import (
    BATCH_SIZE_HEADER,
    LoadResult,
    RequestRecord,
    Target,
    closed_loop,
    format_capacity,
    measure_capacity,
    open_loop,
    poisson_schedule,
    summarise,
)
from packrat.bench.loadgen.lean import CLIENTS, lean_closed_loop, window_closed_loop
from packrat.bench.loadgen.stepped import Sent, Step, StepLoad
from packrat.bench.stats import percentile

__all__ = [
    "BATCH_SIZE_HEADER", "CLIENTS", "Check", "Connection", "ContinuousLoad", "LoadResult", "PoissonLoad", "RequestRecord",
    "STOP_GRACE_S", "Sample", "Sent", "Step", "StepLoad", "Target", "check_loopback", "closed_loop",
    "format_capacity", "in_windows", "latency_summary", "lean_closed_loop", "measure_capacity", "open_loop", "percentile", "poisson_schedule",
    "summarise", "window_closed_loop",
]
