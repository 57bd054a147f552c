#!/usr/bin/env bash
# The unit tests against the image's torch 2.1.0 (CPU), in .venv-torch21 (~2.5 GB of wheels, once).
set -euo pipefail
cd "$(dirname "$0")/.."
make test-torch21
