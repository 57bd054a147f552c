#!/usr/bin/env bash
# Image entrypoint: preflight checks (train/tools/preflight.py), a cache fallback, then exec the command.
# DMP_PREFLIGHT=0 skips the checks.
set -euo pipefail
cache=${TORCHINDUCTOR_CACHE_DIR:-/cache/inductor}
if ! mkdir -p "$cache" 2>/dev/null || ! touch "$cache/.writable" 2>/dev/null; then
  fallback=$(mktemp -d /tmp/dmp-cache.XXXXXX)
  echo "preflight: warning: $cache is not writable by uid $(id -u); using $fallback (not shared, lost on exit)." \
       "Fix: make clean-cache, or docker volume rm the cache volume" >&2
  export TORCHINDUCTOR_CACHE_DIR=$fallback/inductor TRITON_CACHE_DIR=$fallback/triton \
         HYPOTHESIS_STORAGE_DIRECTORY=$fallback/hypothesis
fi
if [ "${DMP_PREFLIGHT:-1}" != "0" ]; then
  python -m train.tools.preflight "$@"
fi
exec "$@"
