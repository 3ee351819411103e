"""On attach, finish what a killed controller left half done.

A Packrat version that is loaded but not the default is retired
(Swapper.retire: drained, scaled to 0, queue confirmed empty, unregistered),
version directories no version was registered from are deleted, and what is
live and Packrat's becomes the plan to keep live (last-plans.json).

One model's broken files (a version's model_config.yaml that does not parse,
say) are logged and that model is left as it is: the controller starts and
serves the others (an exit here is a crash loop under Kubernetes). Its status
names the broken file (packrat.api.requests.model_reading).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from packrat.apply import versions
from packrat.apply.client import ManagementClient, ModelDescription
from packrat.apply.swap import Swapper
from packrat.control.statefiles import StateFiles
from packrat.errors import SwapError, TorchServeError

log = logging.getLogger("packrat.controller")


def _packrat_version(path: Path) -> bool:
    return (path / versions.MANIFEST).exists() and versions.load_version(path) is not None


def _retire_leftovers(swapper: Swapper, model_store: Path, name: str, default_version: str,
                      described: tuple[ModelDescription, ...]) -> tuple[list[str], set[str]]:
    """Retire the Packrat versions of `name` that are not the default; returns (what was
    cleaned, the urls still registered)."""
    cleaned: list[str] = []
    registered_urls = {d.url for d in described}
    for d in described:
        if d.version == default_version or not _packrat_version(model_store / d.url):
            continue
        # Left over by a killed swap: new-but-not-default, or old-not-yet-retired
        # (possibly already scaled to 0 with jobs back in its queue: retire serves them).
        try:
            swapper.retire(name, d.version)
        except (SwapError, TorchServeError) as exc:
            log.warning("could not retire %s %s left by a killed swap: %s", name, d.version, exc)
            continue  # still registered: its directory stays
        swapper.retire_dir(d.url)
        registered_urls.discard(d.url)
        cleaned.append(f"{name} {d.version}: retired (loaded beside the default version: a swap was cut short)")
    return cleaned, registered_urls


def attach(client: ManagementClient, swapper: Swapper, model_store: Path, files: StateFiles) -> list[str]:
    """Read what is live and finish half-done swaps; returns what was cleaned up."""
    cleaned: list[str] = []
    last = files.last_plans()
    for m in client.list_models():
        name = m["modelName"]
        try:
            cleaned += _attach_model(client, swapper, model_store, name, last)
        except Exception as exc:  # whatever one model's files hold, the others are served
            log.error("%s: left as it is at attach, its files are broken: %s", name, exc)
    files.save_last_plans(last)
    return cleaned


def _attach_model(client: ManagementClient, swapper: Swapper, model_store: Path, name: str,
                  last: dict[str, dict[str, Any]]) -> list[str]:
    """Finish `name`'s half-done swap and note its live plan in `last`; returns what was cleaned up."""
    cleaned: list[str] = []
    default_version, default_url = swapper.current(name)
    done, registered_urls = _retire_leftovers(swapper, model_store, name, default_version,
                                              client.describe_versions(name))
    cleaned += done
    # Version dirs of this model that nothing is registered from: a swap died before register.
    for path in model_store.glob(f"{name}.p*"):
        if path.name not in registered_urls and _packrat_version(path):
            versions.remove_version(path)
            # Either a swap died before registering it, or TorchServe restarted without it
            # (the restart watch then applies the last plan again: a new version, not this one).
            cleaned.append(f"{path.name}: version directory removed (not registered: a swap was cut short "
                           "before registering it, or TorchServe restarted since)")
    # What is live and Packrat's is the plan to keep live (a newer controller's view wins).
    live = model_store / default_url
    vdir = versions.load_version(live) if (live / versions.MANIFEST).exists() else None
    if vdir is not None:
        last[name] = {"version": default_version, "url": default_url, "plan": vdir.plan.to_dict()}
    return cleaned
