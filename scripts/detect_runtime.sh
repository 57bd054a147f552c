#!/usr/bin/env bash
# Decide where container-aware make targets run. Prints one line: "<docker|local> <reason...>".
#   RUNTIME=docker|local  → that, as asked.
#   RUNTIME=auto (default) → docker when a Docker engine answers AND it can give containers a GPU
#                            (nvidia runtime registered, or the NVIDIA container toolkit installed, and
#                            nvidia-smi sees a GPU); otherwise local (.venv, on whatever device exists).
set -uo pipefail
RUNTIME=${RUNTIME:-auto}
DOCKER=${DOCKER:-docker}
case "$RUNTIME" in
  docker) echo "docker RUNTIME=docker"; exit 0 ;;
  local)  echo "local RUNTIME=local"; exit 0 ;;
  auto) ;;
  *) echo "error: RUNTIME=$RUNTIME is not one of auto, docker, local" >&2; echo "invalid"; exit 0 ;;
esac
if ! command -v "$DOCKER" >/dev/null 2>&1; then
  echo "local no '$DOCKER' command"; exit 0
fi
if ! runtimes=$(timeout 10 "$DOCKER" info --format '{{json .Runtimes}}' 2>/dev/null); then
  echo "local no Docker engine reachable ('$DOCKER info' failed)"; exit 0
fi
if ! grep -q '"nvidia"' <<<"$runtimes" && ! command -v nvidia-container-cli >/dev/null 2>&1 \
   && ! command -v nvidia-ctk >/dev/null 2>&1; then
  echo "local Docker engine has no GPU support (no nvidia runtime, no NVIDIA container toolkit)"; exit 0
fi
if ! timeout 20 nvidia-smi -L >/dev/null 2>&1; then
  echo "local Docker engine present but nvidia-smi sees no GPU"; exit 0
fi
echo "docker Docker engine with GPU support"
