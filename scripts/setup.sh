#!/usr/bin/env bash
# Creates .venv and installs splitserve with its test and bench extras. Idempotent and quick when
# nothing changed. torch is pinned to 2.13.0 on the first install because that CPU wheel
# is on local disk here (seconds); pyproject itself accepts any torch >= 2.4.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.splitserve-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/python -m pip install -q "torch==2.13.0" || .venv/bin/python -m pip install -q "torch>=2.4"
  fi
  .venv/bin/python -m pip install -q -e ".[test,bench]"
  touch "$stamp"
fi
