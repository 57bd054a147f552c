#!/usr/bin/env bash
# Image entrypoint: the shared cache volume must be writable, preflight checks (train/tools/preflight.py),
# then exec the command. DMP_PREFLIGHT=0 skips the preflight.
set -euo pipefail
# Files on the shared /cache volume stay writable by the volume's group (dmp-cache, which `make` adds every
# container to), so host users with different UIDs share it.
umask 0002
cache=${TORCHINDUCTOR_CACHE_DIR:-/cache/inductor}
for dir in "$cache" "${TRITON_CACHE_DIR:-/cache/triton}" "${DMP_DATA_CACHE:-/cache/deep-model-perf}"; do
  probe="$dir/.write-test-$$"  # the prefix the compile cache ignores when it decides cold or warm
  if ! mkdir -p "$dir" 2>/dev/null || ! touch "$probe" 2>/dev/null || ! rm -f "$probe"; then
    echo "error: the cache volume is not writable by uid $(id -u) gid $(id -g) (groups: $(id -G)) at $dir:" \
         "make clean-cache removes the volume (the next run creates it writable); run containers with" \
         "--group-add ${DMP_CACHE_GID:-47474} as make does" >&2
    exit 2
  fi
done
if [ "${DMP_PREFLIGHT:-1}" != "0" ]; then
  python -m train.tools.preflight "$@"
fi
exec "$@"
