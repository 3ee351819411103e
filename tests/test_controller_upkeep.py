"""What the controller's tick and its status answers cost stays small (issue 35 item 4):
the decision log writes what changed, loopback calls skip requests' proxy look-ups, the
division parses a fallback profile once per change, and a status answer (and the
re-profiler's check) takes a fresh tick's list of models, readings and scrape instead of
asking TorchServe again; the REST server's housekeeping wakes once a second.

Nothing here times anything: the checks count lines, calls and parses.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest
import requests

from packrat.api.requests import model_reading
from packrat.api.server import HOUSEKEEPING_S, QuietServer, api_config
from packrat.apply.client import session_for
from packrat.bench.adapt_rig import sleep_table, table_profile
from packrat.control import Controller, ControllerSettings, division
from packrat.control.live import read_model_state
from packrat.observe import loop as adapt
from packrat.observe import metrics
from packrat.observe.loop import AdaptiveLoop, adapt_settings, log_decisions_to
from packrat.plan import realizable_plan
from packrat.profile.store import save_profile
from packrat.types import Observation, TickContext
from reliability_support import copy_sleep_model
from serving_support import start_server, stop_in_background, usable_cores

SLEEP_MODEL = Path(__file__).parent / "data" / "observe" / "sleepmodel"
PROFILE = table_profile("sleepy", sleep_table(SLEEP_MODEL))


@pytest.fixture
def decision_log(tmp_path: Path) -> Iterator[Path]:
    """logger packrat.adapt written to a file, as `packrat controller` does; undone after."""
    logger = logging.getLogger("packrat.adapt")
    before = (list(logger.handlers), logger.level, logger.propagate)
    path = tmp_path / "decisions.jsonl"
    log_decisions_to(path)
    try:
        yield path
    finally:
        for h in logger.handlers:
            if h not in before[0]:
                h.close()
        logger.handlers[:], logger.level, logger.propagate = before


def _tick(loop: AdaptiveLoop, state: dict, now: float, requests_total: float, profile: Path) -> dict:
    obs = Observation(now, "sleepy", requests_total, requests_total * 1e5, 0.0)
    ctx = TickContext(now=now, model="sleepy", version="p1", plan=realizable_plan(PROFILE, 2, 1),
                      observation=obs, cores=2, profile_path=profile)
    return loop(ctx, state)[1]


def test_the_decision_log_writes_a_decision_when_it_changed(tmp_path: Path, decision_log: Path) -> None:
    profile = tmp_path / "sleepy.json"
    save_profile(PROFILE, profile)
    loop, every = AdaptiveLoop(adapt_settings()), []
    told = AdaptiveLoop(adapt_settings(), emit=every.append)  # an emit given: every decision

    def lines() -> list[dict]:
        return [json.loads(x) for x in decision_log.read_text().splitlines()]

    state, state2, t = {}, {}, 1000.0
    for _ in range(20):  # idle: the estimate settles within the window, then repeats itself
        t += 1.0
        state, state2 = _tick(loop, state, t, 0.0, profile), _tick(told, state2, t, 0.0, profile)
    settled = len(lines())
    assert len(every) == 20 and 1 <= settled < 20
    for _ in range(30):  # unchanged but for time and estimate_stable_s: nothing written
        t += 1.0
        state = _tick(loop, state, t, 0.0, profile)
    assert len(lines()) == settled
    t += adapt.REPEAT_LOG_S  # a minute later the same decision is written once more
    state = _tick(loop, state, t, 0.0, profile)
    assert len(lines()) == settled + 1 and lines()[-1]["time_s"] == t
    served = 0.0
    for _ in range(3):  # load: the estimate moves, each decision is a line
        t += 1.0
        served += 20.0
        state = _tick(loop, state, t, served, profile)
    assert len(lines()) == settled + 4
    assert loop.last_decisions("sleepy", last=1)[0].to_dict() == lines()[-1]  # the line is the decision


class _Hello(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: object) -> None:
        pass


def test_loopback_calls_skip_the_proxy_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/"
    try:
        monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # nothing listens there
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        with pytest.raises(requests.ConnectionError):  # what a session trusting the variables does
            requests.Session().get(url, timeout=5)
        assert session_for(url).get(url, timeout=5).text == "ok"
    finally:
        httpd.shutdown()
    assert not session_for("http://localhost:8081").trust_env
    assert not session_for("http://[::1]:8082").trust_env
    assert session_for("http://torchserve.example:8081").trust_env  # a remote one may need its proxy
    assert session_for("http://10.1.2.3:8081").trust_env


def test_the_fallback_profile_is_parsed_again_only_when_it_changes(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.json"
    save_profile(PROFILE, path)
    parsed: list[Path] = []
    real = division.load_profile

    def counted(p: Path):  # the real parse, counted
        parsed.append(p)
        return real(p)

    monkeypatch.setattr(division, "load_profile", counted)
    first = [division.predictor((), path, 2)(c) for _ in range(5) for c in (1, 2)]
    assert parsed == [path] and len(set(first)) == 2
    slower = table_profile("sleepy", {t: {b: 3 * ms for b, ms in row.items()}
                                      for t, row in sleep_table(SLEEP_MODEL).items()})
    save_profile(slower, path)
    again = division.predictor((), path, 2)
    assert parsed == [path, path] and again(2) == pytest.approx(3 * first[1])
    path.write_text("not a profile")
    assert division.predictor((), path, 2) is None


def test_the_rest_server_wakes_once_a_second_and_still_stops_and_dates() -> None:
    from email.utils import parsedate_to_datetime

    from fastapi import FastAPI

    app = FastAPI()
    app.get("/x")(lambda: {"ok": True})
    server = QuietServer(api_config(app, "127.0.0.1", 0))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    # The controller's parser is h11 even where httptools is installed (LitServe brings it).
    assert server.config.http_protocol_class.__name__ == "H11Protocol"
    before, t0 = server.ticks, time.monotonic()
    time.sleep(3.0)
    woken, held = server.ticks - before, time.monotonic() - t0
    assert woken <= held / HOUSEKEEPING_S + 1  # uvicorn's own loop: 10 a second (30 here)
    port = server.servers[0].sockets[0].getsockname()[1]
    answer = requests.get(f"http://127.0.0.1:{port}/x", timeout=10)
    assert answer.json() == {"ok": True}
    sent = parsedate_to_datetime(answer.headers["date"]).timestamp()
    assert abs(sent - time.time()) <= HOUSEKEEPING_S + 2  # the Date header is kept current
    server.should_exit = True
    thread.join(timeout=HOUSEKEEPING_S + 10)
    assert not thread.is_alive()


@pytest.mark.torchserve
@pytest.mark.slow
def test_a_status_after_a_fresh_tick_asks_torchserve_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = tmp_path / "store"
    store.mkdir()
    models = ["m0", "m1"]
    for m in models:
        copy_sleep_model(store, m)
    server = start_server(store, tmp_path / "ts", models=models)
    try:
        monkeypatch.setenv("PACKRAT_SLOT_DIR", str(server.slot_dir))
        settings = ControllerSettings(management_url=server.management_url, key_file=server.key_file,
                                      metrics_url=server.metrics_url, model_store=store,
                                      state_dir=tmp_path / "state", cores=usable_cores(2), tick_s=60.0)
        c = Controller(settings, policy=AdaptiveLoop(adapt_settings(), emit=[].append))
        calls: list[str] = []
        send = c.client._request

        def counted(method: str, path: str, params=None, timeout=None):  # the real call, counted
            calls.append(path)
            return send(method, path, params, timeout)

        monkeypatch.setattr(c.client, "_request", counted)
        assert c.fresh_models() is None  # no tick yet: a status asks TorchServe for all of it
        requests.post(f"{server.inference_url}/predictions/m1", data=b"x", headers=server.inference_headers(),
                      timeout=60).raise_for_status()
        c.tick()
        listed, scrapes = c.fresh_models(), c.observer.scrapes
        assert listed is not None and set(listed) == set(models)
        calls.clear()
        kept = c.tick_reading("m1")  # what the tick read (the re-profiler's check takes it): no call
        assert kept is not None and calls == []
        status = c.status("m1", st=model_reading(c, "m1", c.fresh_models()))  # as the route asks
        assert calls == ["/models/m1/all"] and c.observer.scrapes == scrapes  # one call, the tick's scrape
        full = read_model_state(c.client, store, "m1")  # what a list and two describes say
        st = status.state
        assert (st.version, st.url, st.plan, st.other_versions, st.mode, st.cores) == (
            full.version, full.url, full.plan, full.other_versions, full.mode, full.cores)
        assert [w.described["pid"] for w in st.workers] == [w.described["pid"] for w in full.workers]
        assert status.observed is not None and (kept.version, kept.url, kept.plan) == (st.version, st.url, st.plan)
        # the tick scrapes the three request counters only (name[]=...): what the whole text says
        whole = requests.get(f"{server.metrics_url}/metrics", timeout=10).text
        assert status.observed.requests_total == 1 == metrics.observation(whole, "m1", 0.0).requests_total
    finally:
        stop_in_background(server)


def test_the_restart_watch_applies_last_plans_again_busiest_model_first() -> None:
    """After a TorchServe restart every model's last plan is applied again, one swap at a time:
    the model with traffic first (its requests since the new frontend started), ties in the
    order TorchServe listed them, and only models with a last plan whose version is not live."""
    from packrat.control.loop import busiest_first
    from packrat.control.swaps import Swaps

    counts = {"a-idle": 0.0, "b-busy": 120.0, "c-idle": 0.0, "d-some": 3.0}
    order = busiest_first({m: "" for m in counts}, counts.__getitem__)
    assert order == ["b-busy", "d-some", "a-idle", "c-idle"]

    class Files:
        def last_plans(self) -> dict:  # insertion order: as last-plans.json was written
            return {m: {"version": "p1", "url": f"{m}.p1"} for m in ("c-idle", "a-idle", "d-some", "b-busy")}

    swaps = Swaps(None, None, Files(), None, None, time.monotonic, 0.0, (), lambda m: ())  # type: ignore[arg-type]
    live = {"d-some": "d-some.p1"}  # its last swap's version is still the default: not lost
    assert [m for m, _ in swaps._unsure(order, live)] == ["b-busy", "a-idle", "c-idle"]

    # watch() asks for the traffic only when more than one model may be lost, and looks at
    # them busiest first (each _lost() call is a describe of that model).
    looked: list[str] = []
    swaps._lost = lambda model, entry: looked.append(model) and False  # type: ignore[method-assign]
    asked: list[list[str]] = []

    def busiest(lost: list[str]) -> list[str]:
        asked.append(lost)
        return busiest_first(lost, counts.__getitem__)

    listed = ["a-idle", "b-busy", "c-idle", "d-some"]  # TorchServe's order
    assert swaps.watch(listed, live, busiest=busiest) == []
    assert asked == [["a-idle", "b-busy", "c-idle"]] and looked == ["b-busy", "a-idle", "c-idle"]
    asked.clear()
    assert swaps.watch(listed, {**live, "a-idle": "a-idle.p1", "c-idle": "c-idle.p1"}, busiest=busiest) == []
    assert asked == []  # one candidate: no order to find
