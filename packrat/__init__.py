"""Packrat for TorchServe: profile -> plan -> apply -> observe, and the controller that loops.

    packrat.types     frozen values that cross stages (Profile, Plan, SwapRecord, TickContext, Policy,
                      Estimate, Decision, TuneRecord)
    packrat.errors    the exception tree
    packrat.slots     the worker side: pin a process to its slot (TorchServe's worker, the profiler's)
    packrat.profile   1. isolated timing runs, profile files
    packrat.plan      2. the optimiser and candidate plans (pure: no torch, no HTTP, no files)
    packrat.apply     3. the only code that talks to TorchServe's REST API (client, versions, swaps)
    packrat.observe   4. metrics -> load estimate -> re-plan decision
    packrat.tune      guard + profile every execution mode, choose (mode, plan)
    packrat.control   the controller: state, clock, the loop over the four stages; tunes each model by itself
    packrat.jobs      background jobs the controller runs (profiling)
    packrat.api       REST: parse -> call the controller -> render
    packrat.server    start/stop a TorchServe process (CLI, bench, tests)
    packrat.bench     load generation and the side-by-side benchmark
    packrat.commands  the `packrat` CLI (packrat.cli)

Imports point down this list (tests/test_layout.py keeps it so).
"""

__version__ = "0.1.0"
