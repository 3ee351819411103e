#!/usr/bin/env bash
# `make stop`: stop the TorchServe that scripts/run_demo.sh started (and all its workers).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/packrat torchserve stop --workdir .packrat/torchserve
