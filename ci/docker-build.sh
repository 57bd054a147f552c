#!/usr/bin/env bash
# Build the image (make build), lint its Dockerfile (hadolint via make lint's tool), run `pip check` and the
# preflight inside it, print its size. STACK=cpu (the GitHub docker job) builds the CPU stack. Extra `docker build` flags (e.g. layer cache) go in BUILD_ARGS.
# Exit 77 (skipped) when no Docker engine answers, 1 on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
DOCKER=${DOCKER:-docker}
make setup >/dev/null
.venv/bin/hadolint docker/Dockerfile
if ! timeout 20 "$DOCKER" info >/dev/null 2>&1; then
  echo "SKIP: no Docker engine reachable ('$DOCKER info' failed); hadolint passed, the image was not built" >&2
  exit 77
fi
make build
img=$(make -s --no-print-directory print-image)
"$DOCKER" run --rm --entrypoint python "$img" -m pip check
"$DOCKER" run --rm --entrypoint python "$img" -m train.tools.preflight
if [ "${STACK:-torch21}" != cpu ]; then "$DOCKER" run --rm --entrypoint nsys "$img" --version; fi  # the cpu stack has no nsys
size=$("$DOCKER" image inspect -f '{{.Size}}' "$img")
echo "image $img: $((size / 1024 / 1024)) MiB"
