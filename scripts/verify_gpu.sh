#!/usr/bin/env bash
# make verify-gpu (local runtime): the pass/fail table of train/tools/verify_gpu.py with the project's Python.
# Exit: 0 ready, 1 a hard check failed, 77 no GPU on this host (see train/tools/verify_gpu.py).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PY:-.venv/bin/python}
echo "host: $(uname -n), $(nproc) CPU cores; python: $PY"
exec "$PY" -m train.tools.verify_gpu "$@"
