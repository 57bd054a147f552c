#!/usr/bin/env bash
# Lint + unit tests on CPU: the same thing as the README's `make test`, plus `make lint`.
set -euo pipefail
cd "$(dirname "$0")/.."
make lint
make test
