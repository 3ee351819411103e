#!/usr/bin/env bash
# TorchServe 0.12's frontend is Java: it needs a JDK/JRE 17 (11 works, 17 is tested).
set -euo pipefail
if ! command -v java >/dev/null 2>&1; then
  cat >&2 <<'MSG'
error: Java not found. TorchServe 0.12 needs Java 17.
  Debian/Ubuntu:  sudo apt-get install -y openjdk-17-jdk-headless
  Fedora/RHEL:    sudo dnf install -y java-17-openjdk-devel
  (a JDK: its javac builds the /packrat plugin for the management port)
  Then run the command again.
MSG
  exit 1
fi
major=$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1)
if [ "${major:-0}" -lt 11 ]; then
  echo "error: Java ${major} found; TorchServe 0.12 needs Java 17 (install openjdk-17-jdk-headless)." >&2
  exit 1
fi
