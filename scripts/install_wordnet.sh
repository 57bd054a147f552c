#!/usr/bin/env bash
# Make the WordNet 3.0 database available (Debian/Ubuntu package wordnet-base → /usr/share/wordnet).
# Installs it when missing and running as root with apt-get; otherwise prints exactly what to do.
set -euo pipefail
PY=${PY:-python3}
if "$PY" -c "from train.data.wordnet import find_wordnet_dir; print(find_wordnet_dir())" 2>/dev/null; then
  exit 0
fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "WordNet not found: installing wordnet-base with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends wordnet-base >/dev/null
  "$PY" -c "from train.data.wordnet import find_wordnet_dir; print(find_wordnet_dir())"
  exit 0
fi
cat >&2 <<'MSG'
error: WordNet database not found, and this shell cannot install it (needs root and apt-get).
Do one of:
  sudo apt-get install wordnet-base          # Debian/Ubuntu: installs /usr/share/wordnet
  export WNHOME=/path/to/WordNet-3.0         # a WordNet 3.0 install with dict/data.noun etc.
  make train ARGS="data.wordnet_dir=/path/to/dict"
MSG
exit 2
