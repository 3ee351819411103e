"""The REST API's HTTP server: uvicorn, its housekeeping woken once a second.

uvicorn's Server.main_loop wakes ten times a second to see whether it should stop and,
every tenth time, to refresh the Date header it sends. An idle controller spent 0.15 %
of a core on those wake-ups alone on the 2-core EPYC VM (issue 35 item 4: the
controller's whole budget is 1 %). Once a second does the same work; a stop (the
controller's stop event, SIGTERM) is then seen within a second, not a tenth.
"""

from __future__ import annotations

import asyncio

import uvicorn

HOUSEKEEPING_S = 1.0  # how often the loop looks for a stop and refreshes the Date header
# uvicorn's on_tick refreshes the headers when its counter is a multiple of this (once
# every ten of its 0.1 s ticks), and wraps the counter here.
_ON_TICK_EVERY, _ON_TICK_WRAP = 10, 864000


def api_config(app: object, host: str, port: int) -> uvicorn.Config:
    """uvicorn's settings for the controller's API.

    The event loop and HTTP parser are named, not left to uvicorn's "auto": that picks
    uvloop and httptools whenever they are installed (the peer extra's LitServe brings
    them), and the controller should not change underneath its tests with what else
    shares the environment.
    """
    return uvicorn.Config(app, host=host, port=port, log_level="warning", loop="asyncio", http="h11")


class QuietServer(uvicorn.Server):
    """uvicorn.Server whose main loop calls on_tick once every HOUSEKEEPING_S."""

    ticks = 0  # how many times on_tick ran (tests)

    async def main_loop(self) -> None:
        counter = 0
        should_exit = await self._tick(counter)
        while not should_exit:
            counter = (counter + _ON_TICK_EVERY) % _ON_TICK_WRAP  # the header's turn every time
            await asyncio.sleep(HOUSEKEEPING_S)
            should_exit = await self._tick(counter)

    async def _tick(self, counter: int) -> bool:
        self.ticks += 1
        return await self.on_tick(counter)
