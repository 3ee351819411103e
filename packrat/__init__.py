"""Packrat for TorchServe: profile -> plan -> apply -> observe.

    packrat.profile   isolated single-instance timing runs, profile files
    packrat.plan      the optimiser (pure functions, no torch, no HTTP)
    packrat.apply     the only code that talks to TorchServe
    packrat.observe   metrics -> load estimate
    packrat.control   the controller loop
"""

__version__ = "0.1.0"
