#!/usr/bin/env bash
# .ci/run's container part: start the Docker engine (../shared/tools/docker-sandbox.sh, as root), then run
# ci/container-smoke.sh as a non-root user. If the engine cannot start, print ONE loud line
# `CONTAINER SMOKE SKIPPED: <reason>` and exit 0, so everything else still gates.
# Root callers run the smoke as the user dmp-ci (created, in the docker group) on a copy of the work tree.
set -euo pipefail
cd "$(dirname "$0")/.."
DOCKER=${DOCKER:-docker}
SANDBOX=${SANDBOX:-../shared/tools/docker-sandbox.sh}
skip() { echo "CONTAINER SMOKE SKIPPED: $*" >&2; exit 0; }

if ! timeout 20 "$DOCKER" info >/dev/null 2>&1; then
  [ -f "$SANDBOX" ] || skip "no Docker engine answers and $SANDBOX is missing"
  [ "$(id -u)" = 0 ] || skip "no Docker engine answers and starting one ($SANDBOX) needs root"
  log=$(mktemp)
  bash "$SANDBOX" >"$log" 2>&1 || skip "$SANDBOX failed: $(tail -1 "$log")"
  timeout 20 "$DOCKER" info >/dev/null 2>&1 || skip "$SANDBOX ran but '$DOCKER info' still fails"
fi

# A cold STACK=cpu build (torch 2.1.0's CUDA wheels: a ~6 GiB image, its layer written twice) needs ~12 GiB.
need_gib=${CONTAINER_SMOKE_MIN_FREE_GIB:-12}
docker_root=$("$DOCKER" info -f '{{.DockerRootDir}}' 2>/dev/null || echo /var/lib/docker)
free=$(df -P -BG "$docker_root" 2>/dev/null | awk 'NR==2 {sub("G", "", $4); print $4}')
if [ -n "$free" ] && [ "$free" -lt "$need_gib" ] \
   && ! "$DOCKER" image inspect "$(IMAGE=${IMAGE:-deep-model-perf-ci} STACK=cpu make -s --no-print-directory print-image)" >/dev/null 2>&1; then
  skip "only ${free} GiB free under $docker_root; a cold STACK=cpu image build needs ~${need_gib} GiB (free space, or set CONTAINER_SMOKE_MIN_FREE_GIB)"
fi

if [ "$(id -u)" != 0 ]; then
  exec bash ci/container-smoke.sh
fi
user=dmp-ci
id "$user" >/dev/null 2>&1 || useradd --create-home --uid 2001 --user-group "$user"
getent group docker >/dev/null && usermod -aG docker "$user"
work=$(mktemp -d /tmp/dmp-container-smoke.XXXXXX)
# The tree as git sees it (tracked + untracked, not ignored): what a fresh clone plus local edits holds.
git ls-files -co --exclude-standard -z | tar --null -T - -cf - | tar -xf - -C "$work"
cp -a .git "$work/.git" 2>/dev/null || true
chown -R "$user:" "$work"
echo "container smoke as $user (uid $(id -u "$user")) in $work"
rc=0
su "$user" -c "cd '$work' && bash ci/container-smoke.sh" || rc=$?
mkdir -p runs/ci && cp -r "$work/runs/ci/." runs/ci/ 2>/dev/null || true
[ "$rc" = 0 ] && rm -rf "$work"
exit "$rc"
