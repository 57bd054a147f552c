#!/usr/bin/env bash
# The Makefile's checks around the image (docker/README.md). Each problem is ONE line saying what is wrong
# and the command that fixes it, exit 2 — never a wall of Docker output.
#
#   scripts/docker_image.sh source-hash [STACK]   # hash of what the image bakes in (label io.deep-model-perf.source-hash)
#   scripts/docker_image.sh pre-build             # STACK known, engine answers, base image present or pullable
#   scripts/docker_image.sh pre-run               # engine, NVIDIA runtime when GPUS is set, image present and current
#
# pre-run exits 3 when the image must be built (missing, or stale with AUTO_BUILD=1); the Makefile builds it.
# Environment (set by the Makefile): DOCKER IMG STACK GPUS BASE_IMAGE AUTO_BUILD.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
DOCKER=${DOCKER:-docker}
STACK=${STACK:-torch21}
STACKS="torch21 torch2x cpu"

die() { echo "error: $*" >&2; exit 2; }

lock_of() {
  case "$1" in
    torch21) echo docker/requirements.lock ;;
    torch2x) echo docker/requirements-torch2x.lock ;;
    cpu) echo docker/requirements-cpu.lock ;;
    *) return 1 ;;
  esac
}

# What the image bakes in and what changes its behaviour (README.md, copied only as package metadata, is left
# out so a doc edit does not make the image stale). Paths + contents, sorted; untracked files count, ignored
# ones (__pycache__, .venv) do not.
source_hash() {
  local lock; lock=$(lock_of "$1") || die "STACK=$1 is not one of $STACKS"
  local paths=(train configs tests scripts pyproject.toml docker/Dockerfile docker/entrypoint.sh "$lock")
  {
    if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
      git ls-files -co --exclude-standard -z -- "${paths[@]}"
    else
      find "${paths[@]}" -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0
    fi
  } | sort -zu | while IFS= read -r -d '' f; do
    [ -f "$f" ] && printf '%s  %s\n' "$(sha256sum <"$f" | cut -c1-64)" "$f"
  done | sha256sum | cut -c1-64
}

engine() {
  command -v "$DOCKER" >/dev/null 2>&1 \
    || die "no '$DOCKER' command: install Docker (on a machine like the CI one: sudo ../shared/tools/docker-sandbox.sh), or run with RUNTIME=local"
  timeout 20 "$DOCKER" info >/dev/null 2>&1 \
    || die "the Docker engine does not answer ('$DOCKER info' failed): start it (sudo ../shared/tools/docker-sandbox.sh here; sudo systemctl start docker elsewhere), or run with RUNTIME=local"
}

known_stack() {
  case " $STACKS " in *" $STACK "*) ;; *) die "STACK=$STACK is not one of $STACKS" ;; esac
}

pre_build() {
  known_stack
  engine
  [ -n "${BASE_IMAGE:-}" ] || die "no base image for STACK=$STACK (BASE_IMAGE is empty)"
  "$DOCKER" image inspect "$BASE_IMAGE" >/dev/null 2>&1 && return 0
  echo "pulling the base image $BASE_IMAGE ..."
  timeout 900 "$DOCKER" pull -q "$BASE_IMAGE" >/dev/null 2>&1 \
    || die "cannot pull the base image $BASE_IMAGE (no registry reachable?): build STACK=cpu (its base debian:bookworm-slim is created locally by sudo ../shared/tools/docker-sandbox.sh), or docker load the base image and retry"
}

pre_run() {
  known_stack
  engine
  if [ -n "${GPUS:-}" ] && ! timeout 20 "$DOCKER" info --format '{{json .Runtimes}}' 2>/dev/null | grep -q '"nvidia"' \
     && ! command -v nvidia-container-cli >/dev/null 2>&1 && ! command -v nvidia-ctk >/dev/null 2>&1; then
    die "RUNTIME=docker with GPUS=$GPUS, but this Docker engine has no NVIDIA runtime: install the NVIDIA container toolkit (then sudo nvidia-ctk runtime configure --runtime=docker), or run without a GPU: make <target> RUNTIME=docker STACK=cpu"
  fi
  local labels
  if ! labels=$("$DOCKER" image inspect -f '{{index .Config.Labels "io.deep-model-perf.source-hash"}} {{index .Config.Labels "org.opencontainers.image.revision"}}' "$IMG" 2>/dev/null); then
    echo "image $IMG not found: building it (make build STACK=$STACK)"
    exit 3
  fi
  local built rev want
  read -r built rev <<<"$labels"
  want=$(source_hash "$STACK")
  [ "$built" = "$want" ] && return 0
  if [ "${AUTO_BUILD:-0}" = 1 ]; then
    echo "image $IMG is stale (the working tree changed since it was built): rebuilding it (AUTO_BUILD=1)"
    exit 3
  fi
  die "image is stale: make build STACK=$STACK ($IMG was built from revision ${rev:0:12} with source hash ${built:0:12}; the working tree's is ${want:0:12} at $(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown); AUTO_BUILD=1 rebuilds automatically)"
}

case "${1:-}" in
  source-hash) source_hash "${2:-$STACK}" ;;
  pre-build) pre_build ;;
  pre-run) pre_run ;;
  *) echo "usage: $0 source-hash [STACK] | pre-build | pre-run" >&2; exit 2 ;;
esac
