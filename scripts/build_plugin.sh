#!/usr/bin/env bash
# Build the Packrat endpoint plugin for TorchServe (plugin/, docs/live-plans.md):
# plain javac + jar against the torchserve wheel's model-server.jar, which ships
# the serving SDK; no Maven or Gradle. Output: plugin/build/packrat-plugin.jar,
# the directory config.properties names in plugins_path.
#
# Rebuilds only when a source is newer than the jar (make calls it on the same
# rule; tests call it directly). Without a JDK it says so and exits 0:
# TorchServe then starts without the plugin and the controller's own port works.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=(plugin/src plugin/resources scripts/build_plugin.sh)
OUT=plugin/build
JAR=$OUT/packrat-plugin.jar
PY=${PACKRAT_PYTHON:-.venv/bin/python}

if [ -f "$JAR" ] && [ -z "$(find "${SRC[@]}" -newer "$JAR" -print -quit)" ]; then
  exit 0  # up to date
fi
if ! command -v javac >/dev/null 2>&1 || ! command -v jar >/dev/null 2>&1; then
  cat >&2 <<'MSG'
warning: javac not found (a Java runtime alone cannot compile): the Packrat
  plugin for TorchServe's management port (/packrat/...) is not built.
  TorchServe runs without it; use the controller's own port (127.0.0.1:8085/v1/...).
  To get it, install a JDK and run `make setup` again:
    Debian/Ubuntu:  sudo apt-get install -y openjdk-17-jdk-headless
    Fedora/RHEL:    sudo dnf install -y java-17-openjdk-devel
MSG
  exit 0
fi
# find_spec locates the wheel without importing it.
TS_JAR=$("$PY" -c 'import importlib.util, pathlib; s = importlib.util.find_spec("ts"); print(pathlib.Path(s.origin).parent / "frontend" / "model-server.jar")')
[ -f "$TS_JAR" ] || { echo "error: $TS_JAR not found (is torchserve installed in the venv?)" >&2; exit 1; }

mkdir -p "$OUT"
tmp=$(mktemp -d "$OUT/.tmp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
# --release 11: TorchServe 0.12 runs on Java 11 too.
javac --release 11 -Xlint:all,-processing -Werror -proc:none -encoding UTF-8 -cp "$TS_JAR" -d "$tmp/classes" \
  $(find plugin/src -name '*.java')
cp -r plugin/resources/. "$tmp/classes/"
jar --create --file "$tmp/packrat-plugin.jar" -C "$tmp/classes" .
# Renamed into place: a TorchServe starting meanwhile never sees half a jar.
mv -f "$tmp/packrat-plugin.jar" "$JAR"
echo "built $JAR"
