"""The only code that talks to TorchServe's REST API: management calls and metrics scrapes.

`scrape_metrics(url)` reads the metrics port (Prometheus text, no token).
Every management call goes through `ManagementClient._request`, which
- sends `Authorization: Bearer <management key>` read from key_file.json,
- retries connection failures a few times (tenacity; TorchServe may be busy
  starting workers on a 2-core box),
- on TorchServe's "Token Authorization failed" answer (HTTP 400 in 0.12, for
  a wrong *or expired* key) re-reads the key file, regenerates the management
  key through the token API if the file's key is expired too, and retries once,
- translates every error answer into `TorchServeError(method, url, status, body)`
  here and nowhere else (`raise ... from exc`); so does scrape_metrics.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential

from packrat.apply.keys import Keys, read_keys
from packrat.errors import TorchServeError
from packrat.listener import loopback

# TorchServe 0.12 answers a missing, wrong or expired key with HTTP 400 and this text.
_TOKEN_FAILED = "Token Authorization failed"
# Refresh a key this long before its stated expiry, so a call rarely races the clock.
# Small: refreshing rotates the key for every other user of it too.
DEFAULT_EXPIRY_MARGIN_S = 2.0


def session_for(url: str) -> requests.Session:
    """A kept-alive session for calls to `url`. To a loopback address without requests'
    look-ups of the proxy variables and ~/.netrc (trust_env off): a proxy named in the
    environment would receive TorchServe's keys with every call, and the look-ups cost
    ~0.3 ms of CPU a call where the controller makes a few calls a second (issue 35 item 4)."""
    session = requests.Session()
    session.trust_env = not loopback(url)
    return session


def scrape_metrics(metrics_url: str, *, timeout_s: float = 5.0,
                   session: requests.Session | None = None, query: str = "") -> str:
    """GET `<metrics_url>/metrics[?query]`: TorchServe's Prometheus text (the metrics port has no
    token); `query` e.g. "name[]=a&name[]=b" asks for those series only."""
    url = f"{metrics_url.rstrip('/')}/metrics" + (f"?{query}" if query else "")
    try:
        resp = (session or requests).get(url, timeout=timeout_s)
    except requests.RequestException as exc:
        raise TorchServeError.unreachable("GET", url, exc) from exc
    if resp.status_code >= 400:
        raise TorchServeError("GET", url, resp.status_code, resp.text)
    return resp.text


@dataclass(frozen=True)
class WorkerDescription:
    """One worker in TorchServe's describe answer."""

    id: str
    pid: int  # -1 while TorchServe has not started its process
    status: str  # READY, UNLOADING, ...
    raw: Mapping[str, Any]  # every field as TorchServe answered (memoryUsage, gpu, ...)

    @property
    def ready(self) -> bool:
        return self.status == "READY"

    @classmethod
    def parse(cls, w: Mapping[str, Any]) -> WorkerDescription:
        return cls(str(w.get("id", "")), int(w.get("pid", -1) or -1), str(w.get("status", "")), dict(w))


@dataclass(frozen=True)
class ModelDescription:
    """One version of a model as TorchServe describes it (GET /models/{m}[/{v}|/all]), parsed once."""

    name: str
    version: str
    url: str  # the directory in the model store it was registered from
    batch_size: int
    max_batch_delay_ms: int
    pending_requests: int  # jobs in its queue (TorchServe counts only its default data queue)
    workers: tuple[WorkerDescription, ...]

    @classmethod
    def parse(cls, d: Any) -> ModelDescription:
        """One entry of TorchServe's describe answer; ValueError naming what is wrong when it is
        not one (not an object, no name, version or URL, a count that is not a number, workers
        that are not a list of objects): a swap must not act on a half-read answer."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a model description is a JSON object, got {type(d).__name__}: {str(d)[:200]}")
        missing = [k for k in ("modelName", "modelVersion", "modelUrl") if not d.get(k)]
        if missing:
            raise ValueError(f"a model description without {', '.join(missing)}: {str(dict(d))[:200]}")
        workers = d.get("workers") or []
        if not isinstance(workers, list) or not all(isinstance(w, Mapping) for w in workers):
            raise ValueError(f"{d['modelName']} version {d['modelVersion']}: workers are not a list of objects")
        try:
            return cls(
                name=str(d["modelName"]),
                version=str(d["modelVersion"]),
                url=str(d["modelUrl"]),
                batch_size=int(d.get("batchSize", 1) or 1),
                max_batch_delay_ms=int(d.get("maxBatchDelay", 0) or 0),
                pending_requests=int((d.get("jobQueueStatus") or {}).get("pendingRequests", 0)),
                workers=tuple(WorkerDescription.parse(w) for w in workers),
            )
        except (AttributeError, TypeError, ValueError) as exc:
            raise ValueError(f"{d['modelName']} version {d['modelVersion']}: a field is not what TorchServe "
                             f"sends ({type(exc).__name__}: {exc})") from exc

    @classmethod
    def of(cls, d: ModelDescription | Mapping[str, Any]) -> ModelDescription:
        """`d` itself, or TorchServe's raw answer parsed (callers holding a describe() dict)."""
        return d if isinstance(d, ModelDescription) else cls.parse(d)

    def worker_pids(self) -> list[int]:
        return [w.pid for w in self.workers if w.pid > 0]

    def ready_workers(self) -> tuple[WorkerDescription, ...]:
        return tuple(w for w in self.workers if w.ready)


class _Unreachable(Exception):
    """Connection-level failure, retried by tenacity before it is translated."""


class ManagementClient:
    """Typed calls to TorchServe's management API (one instance per TorchServe)."""

    def __init__(
        self,
        management_url: str,
        key_file: str | Path | None,
        *,
        timeout_s: float = 30.0,  # plain calls; register/scale pass their own, longer one
        session: requests.Session | None = None,
        expiry_margin_s: float = DEFAULT_EXPIRY_MARGIN_S,
    ) -> None:
        self.expiry_margin_s = expiry_margin_s
        self.base = management_url.rstrip("/")
        self.key_file = Path(key_file) if key_file else None
        self.timeout_s = timeout_s
        self.session = session or session_for(self.base)
        self._keys: Keys | None = None
        self._keys_mtime: float | None = None

    # -- keys -----------------------------------------------------------------
    def keys(self) -> Keys | None:
        """Current keys, re-read whenever key_file.json changed on disk."""
        if self.key_file is None:
            return None
        try:
            mtime = self.key_file.stat().st_mtime
        except FileNotFoundError as exc:
            raise TorchServeError("READ", str(self.key_file), 0, "key file not found") from exc
        if self._keys is None or mtime != self._keys_mtime:
            self._keys = read_keys(self.key_file)
            self._keys_mtime = mtime
        return self._keys

    def management_key(self) -> str | None:
        keys = self.keys()
        if keys is None:
            return None
        expires = keys.management.expires
        if expires is not None and expires.timestamp() - time.time() < self.expiry_margin_s:
            keys = self.refresh_management_key()
        return keys.management.key

    def refresh_management_key(self) -> Keys:
        return self.refresh_key("management")

    def refresh_key(self, kind: str) -> Keys:
        """Ask TorchServe for a new `kind` key, management or inference (token API, authorised
        by the API key, which does not expire). The old key stops working at once.

        TorchServe rewrites key_file.json itself; we re-read it from there.
        """
        keys = self.keys()
        if keys is None:
            raise TorchServeError("POST", f"{self.base}/token", 0, f"no key file to refresh the {kind} key from")
        url = f"{self.base}/token"
        try:
            resp = self.session.post(
                url,
                params={"type": kind},
                headers=keys.api.bearer(),
                timeout=self.timeout_s,
            )
        except requests.RequestException as exc:
            raise TorchServeError.unreachable("POST", url, exc) from exc
        if resp.status_code >= 400:
            raise TorchServeError("POST", url, resp.status_code, resp.text)
        self._keys = None  # force a re-read of the file TorchServe just rewrote
        new = self.keys()
        assert new is not None
        return new

    # -- transport ------------------------------------------------------------
    @retry(
        retry=retry_if_exception_type(_Unreachable),
        stop=stop_after_attempt(3),
        wait=wait_exponential(multiplier=0.2, max=2.0),
        reraise=True,
    )
    def _send(self, method: str, url: str, params: dict[str, Any] | None, timeout: float) -> requests.Response:
        headers = {}
        key = self.management_key()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        try:
            return self.session.request(method, url, params=params, headers=headers, timeout=timeout)
        except (requests.ConnectionError, requests.Timeout) as exc:
            raise _Unreachable(str(exc)) from exc

    def _request(
        self, method: str, path: str, params: dict[str, Any] | None = None, timeout: float | None = None
    ) -> Any:
        url = f"{self.base}{path}"
        timeout = timeout or self.timeout_s
        try:
            resp = self._send(method, url, params, timeout)
            if resp.status_code == 400 and _TOKEN_FAILED in resp.text and self.key_file is not None:
                # Someone may have rotated the key (file changed), or it expired: refresh, retry once.
                before = self._keys
                self._keys = None
                after = self.keys()
                if before is not None and after is not None and after.management.key == before.management.key:
                    self.refresh_management_key()
                resp = self._send(method, url, params, timeout)
        except _Unreachable as exc:
            raise TorchServeError.unreachable(method, url, exc) from exc
        except requests.RequestException as exc:
            raise TorchServeError(method, url, 0, f"request failed: {exc}") from exc
        return self._decode(method, url, resp)

    @staticmethod
    def _decode(method: str, url: str, resp: requests.Response) -> Any:
        if resp.status_code >= 400:
            # TorchServe's error body is {"code": n, "type": "...", "message": "..."}.
            body = resp.text
            try:
                body = json.loads(body).get("message", body)
            except (ValueError, AttributeError):
                pass
            raise TorchServeError(method, url, resp.status_code, str(body))
        if not resp.content:
            return None
        try:
            return resp.json()
        except ValueError:
            return resp.text

    # -- management API ---------------------------------------------------------
    def list_models(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            params: dict[str, Any] = {"limit": 1000}
            if token:
                params["next_page_token"] = token
            page = self._request("GET", "/models", params)
            out.extend(page.get("models", []))
            token = page.get("nextPageToken")
            if not token:
                return out

    def describe(self, model: str, version: str | None = None) -> dict[str, Any]:
        """Describe one version (the default one when `version` is None)."""
        path = f"/models/{model}" + (f"/{version}" if version else "")
        return self._request("GET", path)[0]

    def describe_all(self, model: str) -> list[dict[str, Any]]:
        """Every loaded version of `model`, with workers (id, pid, status) and queue."""
        return self._request("GET", f"/models/{model}/all")

    # The same two answers, parsed: what Packrat's own code reads (the raw ones stay for tools).
    # A malformed answer is TorchServe's error (TorchServeError, the API's 502), said once here.
    def describe_model(self, model: str, version: str | None = None) -> ModelDescription:
        path = f"/models/{model}" + (f"/{version}" if version else "")
        return self._descriptions(path)[0]

    def describe_versions(self, model: str) -> tuple[ModelDescription, ...]:
        return self._descriptions(f"/models/{model}/all")

    def _descriptions(self, path: str) -> tuple[ModelDescription, ...]:
        answer = self._request("GET", path)
        try:
            if not isinstance(answer, list) or not answer:
                raise ValueError(f"a describe answer is a non-empty JSON list, got {str(answer)[:200]}")
            return tuple(ModelDescription.parse(d) for d in answer)
        except ValueError as exc:
            raise TorchServeError("GET", f"{self.base}{path}", 200, f"malformed describe answer: {exc}") from exc

    def register(
        self,
        url: str,
        model_name: str,
        initial_workers: int,
        *,
        synchronous: bool = False,
        timeout_s: float = 300.0,
    ) -> Any:
        """Register a model directory by its name in the model store and start workers.

        Asynchronous by default: TorchServe 0.12 serves a synchronous register
        on a Netty I/O thread that inference connections share, and blocks that
        thread until every worker has loaded, so requests on those connections
        stall for the whole worker start-up (measured: 85 s). The caller polls
        describe() instead. batch_size is not sent: model_config.yaml carries it.
        """
        params = {
            "url": url,
            "model_name": model_name,
            "initial_workers": initial_workers,
            "synchronous": "true" if synchronous else "false",
        }
        return self._request("POST", "/models", params, timeout=timeout_s)

    def scale(
        self, model: str, version: str, workers: int, *, synchronous: bool = True, timeout_s: float = 300.0
    ) -> Any:
        """Set a version's worker count. Synchronous suits scaling down (it returns once the
        workers are shut down); scale up asynchronously and poll describe() (see register())."""
        params = {"min_worker": workers, "max_worker": workers, "synchronous": "true" if synchronous else "false"}
        return self._request("PUT", f"/models/{model}/{version}", params, timeout=timeout_s)

    def set_default(self, model: str, version: str) -> Any:
        return self._request("PUT", f"/models/{model}/{version}/set-default")

    def unregister(self, model: str, version: str, *, timeout_s: float = 120.0) -> Any:
        return self._request("DELETE", f"/models/{model}/{version}", timeout=timeout_s)
