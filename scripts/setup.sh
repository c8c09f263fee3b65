#!/usr/bin/env bash
# Creates .venv and installs splitserve with its test, bench and cluster (Ray) extras, then trains and caches the
# digits model. Idempotent and quick when nothing changed. torch is pinned to 2.13.0 on the first
# install because that CPU wheel is on local disk here (seconds); pyproject itself accepts any torch >= 2.4.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.splitserve-installed
# the editable install also compiles splitserve/_fastwire.c and _directlane.c in place (optional:
# skipped without a compiler), so a change to either installs again too
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ splitserve/_fastwire.c -nt "$stamp" ] \
    || [ splitserve/_directlane.c -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/python -m pip install -q "torch==2.13.0" || .venv/bin/python -m pip install -q "torch>=2.4"
  fi
  .venv/bin/python -m pip install -q -e ".[test,bench,cluster]"
  touch "$stamp"
fi
# digits trains on first use (~20 s on a small machine): do it here, once, for the server's default
# weight cache and the tests' shared one, so that no first request waits for it. A file test when
# the caches are full, so this stays quick.
need=()
for d in "${SPLITSERVE_CACHE_DIR:-${SPLITSERVE_DATA_DIR:-.splitserve}/cache}" .pytest_cache/splitserve-cache; do
  [ -f "$d/digits.safetensors" ] || need+=(--cache-dir "$d")
done
if [ ${#need[@]} -gt 0 ]; then
  .venv/bin/python -m splitserve prepare "${need[@]}"
fi
