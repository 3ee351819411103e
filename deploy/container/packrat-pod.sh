#!/usr/bin/env bash
# The serving container's entrypoint: TorchServe 0.12 and the Packrat controller
# as two processes of ONE container.
#
# Why one container and not a controller container beside a TorchServe one: the
# kubelet's static CPU manager gives exclusive cores per container, not per pod.
# The controller plans core ids that TorchServe's workers pin to, and it runs its
# profiling workers itself; both must pin inside the same cpuset, so both
# processes live in the container that holds the exclusive cores.
#
# Token keys: TorchServe 0.12 makes its own random keys at every start (no
# setting takes them from outside), so every replica would have different ones.
# Here TorchServe runs with its token check off, bound to loopback only, and the
# pod's auth proxy checks the keys of Secret packrat-keys at the pod boundary.
# The controller checks the same management key: this script writes them into
# a key_file.json in TorchServe's format for it. The keys come as files (the
# Secret mounted at $PACKRAT_KEYS_DIR), never as environment variables, which
# TorchServe's JVM, the fork server and every worker would inherit: keys in the
# environment are refused.
#
# The controller listens on loopback only by default: the pod's auth proxy
# reaches it there, no other pod does.
#
# Exits (and so the kubelet restarts the container) when either process exits.
# Every path and URL can be overridden from the environment (tests run this
# script on loopback with temporary directories).
set -euo pipefail

TS_CONFIG=${TS_CONFIG:-/etc/torchserve/config.properties}
MODEL_STORE=${PACKRAT_MODEL_STORE:-/models}
TS_WORKDIR=${PACKRAT_TS_WORKDIR:-/var/lib/torchserve}
STATE_DIR=${PACKRAT_STATE_DIR:-/var/lib/packrat}
RUN_DIR=${PACKRAT_RUN_DIR:-/var/run/packrat}
KEY_FILE=${PACKRAT_KEY_FILE:-$RUN_DIR/keys/key_file.json}
KEYS_DIR=${PACKRAT_KEYS_DIR:-/etc/packrat/keys}
MANAGEMENT_URL=${PACKRAT_MANAGEMENT_URL:-http://127.0.0.1:18081}
METRICS_URL=${PACKRAT_METRICS_URL:-http://127.0.0.1:8082}
API_HOST=${PACKRAT_API_HOST:-127.0.0.1}
API_PORT=${PACKRAT_API_PORT:-8085}
# Where workers claim their slots and write status files (packrat/slots.py): a
# private subdirectory, created 0700 by the first worker.
export PACKRAT_SLOT_DIR=${PACKRAT_SLOT_DIR:-$RUN_DIR/slots}

log() { echo "packrat-pod: $*" >&2; }

# -- the key file the controller reads (TorchServe's format, keys from the Secret)
for var in PACKRAT_INFERENCE_KEY PACKRAT_MANAGEMENT_KEY; do
  if [ -n "${!var+set}" ]; then
    log "$var is set: every process of this container would inherit it; mount Secret" \
        "packrat-keys as files at $KEYS_DIR instead (deploy/kubernetes/base/deployment.yaml)"
    exit 1
  fi
done
mkdir -p "$(dirname "$KEY_FILE")" "$TS_WORKDIR" "$STATE_DIR"
chmod 0700 "$(dirname "$KEY_FILE")"
python - "$KEY_FILE" "$KEYS_DIR" <<'PY'
import json, os, re, secrets, sys

keys = {}
for kind in ("inference", "management"):
    path = os.path.join(sys.argv[2], kind)
    try:
        with open(path) as f:
            key = f.readline().rstrip("\n")
    except OSError as exc:
        sys.exit(f"packrat-pod: cannot read the {kind} key: {exc} (Secret packrat-keys, mounted as files)")
    # The auth proxy matches keys inside a regular expression: only URL-safe
    # base64 characters are safe there (and TorchServe's own keys use them).
    if not re.fullmatch(r"[A-Za-z0-9_-]{16,}", key):
        sys.exit(f"packrat-pod: {path} (Secret packrat-keys, key {kind!r}) must be 16 or more "
                 "characters of A-Z a-z 0-9 _ -")
    keys[kind] = {"key": key}
if keys["inference"]["key"] == keys["management"]["key"]:
    sys.exit("packrat-pod: the inference and management keys must differ")
# TorchServe's token-API key: never used here (these keys do not expire, and
# TorchServe's own check is off), but the key file format has one.
keys["API"] = {"key": secrets.token_urlsafe(24)}
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
with os.fdopen(fd, "w") as f:
    json.dump(keys, f)
PY

# -- TorchServe in the foreground of a child process ------------------------------
# A restarted container keeps its emptyDirs: drop the previous run's pid file
# and worker sockets (TorchServe would refuse to start or fail to bind).
tmp=${TEMP:-${TMPDIR:-/tmp}}
rm -f "$tmp/.model_server.pid" "$tmp"/.ts.sock.*
models=()
if [ -n "${PACKRAT_MODELS:-}" ]; then
  read -r -a names <<<"$PACKRAT_MODELS"
  models=(--models "${names[@]}")
fi
# Its own process group (setsid): the launcher, the fork server, the Java frontend
# and the Python workers are stopped together, as packrat/server.py does.
# packrat-torchserve is `torchserve` with workers forked warm (docs/live-plans.md).
(
  cd "$TS_WORKDIR"  # logs/ land here
  exec setsid packrat-torchserve --start --foreground --ncs --ts-config "$TS_CONFIG" \
    --model-store "$MODEL_STORE" "${models[@]}"
) &
ts_pid=$!
ctl_pid=""

stop() {
  # The controller first: it must not start a swap while TorchServe shuts down.
  if [ -n "$ctl_pid" ]; then kill -TERM "$ctl_pid" 2>/dev/null || true; wait "$ctl_pid" 2>/dev/null || true; fi
  # SIGTERM lets the JVM's shutdown hook stop the workers; SIGKILL what is left
  # after the grace period (keep it below terminationGracePeriodSeconds).
  kill -TERM -- "-$ts_pid" 2>/dev/null || true
  for _ in $(seq "${PACKRAT_STOP_GRACE_S:-45}"); do
    kill -0 -- "-$ts_pid" 2>/dev/null || break
    sleep 1
  done
  kill -KILL -- "-$ts_pid" 2>/dev/null || true
  wait "$ts_pid" 2>/dev/null || true
}
trap 'log "SIGTERM: stopping"; stop; exit 0' TERM INT

log "waiting for TorchServe's management API at $MANAGEMENT_URL"
until curl -fsS -o /dev/null --max-time 2 "$MANAGEMENT_URL/models"; do
  if ! kill -0 "$ts_pid" 2>/dev/null; then
    wait "$ts_pid" || true
    log "TorchServe exited during start-up"
    exit 1
  fi
  sleep 1
done

# -- the controller ---------------------------------------------------------------
# PACKRAT_CONTROLLER_ARGS: extra flags, e.g. "--no-tune --min-dwell 120".
read -r -a extra <<<"${PACKRAT_CONTROLLER_ARGS:-}"
packrat controller \
  --management-url "$MANAGEMENT_URL" --metrics-url "$METRICS_URL" \
  --key-file "$KEY_FILE" --model-store "$MODEL_STORE" --state-dir "$STATE_DIR" \
  --host "$API_HOST" --port "$API_PORT" --restart-on-crash "${extra[@]}" &
ctl_pid=$!
log "TorchServe pid $ts_pid, controller pid $ctl_pid"

# Whichever exits first ends the container; the kubelet restarts it. (A controller that
# crashes after its start is started again by --restart-on-crash, serving untouched; a
# TorchServe frontend that crashes is started again by packrat-torchserve with $PACKRAT_MODELS.)
set +e
wait -n "$ts_pid" "$ctl_pid"
code=$?
set -e
if kill -0 "$ts_pid" 2>/dev/null; then who=controller; else who=TorchServe; fi
log "$who exited ($code); stopping the other"
stop
exit $(( code == 0 ? 1 : code ))
