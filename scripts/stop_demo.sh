#!/usr/bin/env bash
# `make stop`: stop what scripts/run_demo.sh started: the controller, TorchServe and all its workers.
set -euo pipefail
cd "$(dirname "$0")/.."
# The controller first (scripts/run_demo.sh saved its pid), then TorchServe.
if [ -f .packrat/controller.pid ]; then
  kill "$(cat .packrat/controller.pid)" 2>/dev/null || true
  rm -f .packrat/controller.pid
fi
rm -f .packrat/controller.url  # the port the next make run chooses anew
.venv/bin/packrat torchserve stop --workdir .packrat/torchserve
