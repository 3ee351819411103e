"""One TorchServe shared by the bench and rig modules (test_bench_e2e, test_bench_step_reaction,
test_observe_adapt): their runs attach to it instead of starting one each (a JVM start and
stop, ~5 s, and the fork server's first worker, ~5 s, per run).

`shared_torchserve` is a session fixture that each module imports; pytest keeps one instance
per importing module, so the server itself is a process-wide singleton, started by the first
module that asks and stopped when the last instance is torn down at the end of the session.
Its model store and workdir are its own (not tiny_store), and its workers use the session's
slot directory (PACKRAT_SLOT_DIR, set by conftest's session_slot_dir), the one the in-process
controllers read. Each run removes every model it registered (packrat.bench.adapt_rig.
remove_model; packrat bench's unregister_all), so the next one finds the server empty:
`no_models_left` checks that.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from packrat.server import RunningServer, start_torchserve
from serving_support import stop_in_background

_server: RunningServer | None = None
_users = 0


@pytest.fixture(scope="session")
def shared_torchserve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    global _server, _users
    if _server is None or not _server.is_running():
        root = tmp_path_factory.mktemp("bench-shared")  # pytest's: removed with old sessions
        (root / "store").mkdir()
        # slot_dir None: the session's PACKRAT_SLOT_DIR, which the in-process controllers read.
        # Keys that outlive the session (TorchServe's default is 60 min).
        _server = start_torchserve(root / "store", root / "ts", extra_properties={"token_expiration_min": "480"})
    _users += 1
    try:
        yield _server
    finally:
        _users -= 1
        if _users == 0 and _server is not None:
            server, _server = _server, None
            # Off the tests' path: conftest's session fixture joins it (and checks its group
            # is gone); its directory goes with the session's temp files.
            stop_in_background(server)


def no_models_left(server: RunningServer) -> list[str]:
    """The models still registered (a run that left one would change the next one's)."""
    return [m["modelName"] for m in server.management_client().list_models()]


def archives_left(server: RunningServer) -> list[str]:
    """Archives and version directories left in the server's store; the controllers' own
    dot files (its lock, the build cache of tuned modes) stay, as they do beside a user's."""
    return sorted(p.name for p in server.model_store.iterdir() if not p.name.startswith("."))
