"""TorchServe's token keys, read from `key_file.json`.

TorchServe 0.12 (token authorisation is on by default) writes `key_file.json`
into the frontend's working directory (`user.dir`) at start-up:

    {"management": {"key": "...", "expiration time": "2026-12-02T13:50:20.1Z"},
     "inference":  {"key": "...", "expiration time": "..."},
     "API":        {"key": "..."}}

Clients send `Authorization: Bearer <key>`. The management and inference keys
expire (default 60 min, `token_expiration_min`); the API key does not and is
used to mint new ones (`POST /token?type=management|inference` on the
management port). The file is rewritten when a key is regenerated, so callers
that run for long re-read it rather than caching keys forever.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from packrat.errors import TorchServeError

KEY_FILE_NAME = "key_file.json"


@dataclass(frozen=True)
class Key:
    key: str
    expires: datetime | None  # None: the key does not expire (the API key)

    def bearer(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def expired(self, now: float | None = None) -> bool:
        """Past its expiration time (`now`: time.time()); TorchServe refuses it from then on."""
        return self.expires is not None and self.expires.timestamp() <= (time.time() if now is None else now)


@dataclass(frozen=True)
class Keys:
    management: Key
    inference: Key
    api: Key

    def management_headers(self) -> dict[str, str]:
        return self.management.bearer()

    def inference_headers(self) -> dict[str, str]:
        return self.inference.bearer()


def _parse_time(raw: object) -> datetime | None:
    if not isinstance(raw, str) or not raw:
        return None
    try:
        # TorchServe writes java.time.Instant.toString(): "2026-12-02T13:50:20.123Z"
        return datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        return None


def parse_keys(data: dict) -> Keys:
    def key(section: str) -> Key:
        entry = data.get(section)
        if not isinstance(entry, dict) or not isinstance(entry.get("key"), str):
            raise ValueError(f"key_file.json has no {section!r} key")
        return Key(key=entry["key"], expires=_parse_time(entry.get("expiration time")))

    return Keys(management=key("management"), inference=key("inference"), api=key("API"))


# TorchServe rewrites key_file.json in place (truncate, then write) at every start and key
# regeneration: a read in between sees an empty or half-written file for a few milliseconds.
REWRITE_GRACE_S = 2.0


def read_keys(key_file: str | Path, grace_s: float = REWRITE_GRACE_S) -> Keys:
    """Read a key_file.json (TorchServe writes it as `<frontend workdir>/key_file.json`);
    the one place anything in Packrat reads it. A file that is not JSON is read again for up
    to `grace_s` (TorchServe may be rewriting it) before it is an error; a missing file, or
    JSON without the keys, is one at once."""
    path = Path(key_file)
    deadline = time.monotonic() + grace_s
    while True:
        try:
            return parse_keys(json.loads(path.read_text()))
        except json.JSONDecodeError as exc:  # empty or half-written: being rewritten
            if time.monotonic() >= deadline:
                raise TorchServeError("READ", str(path), 0, f"cannot read TorchServe keys: {exc}") from exc
            time.sleep(0.02)
        except (OSError, ValueError) as exc:
            raise TorchServeError("READ", str(path), 0, f"cannot read TorchServe keys: {exc}") from exc
