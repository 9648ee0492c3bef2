#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment. Idempotent; used by `make lessons`/`make test`.
#   - reuses a system torch >= 2.8 when there is one (GPU images ship a CUDA build): venv with
#     --system-site-packages;
#   - otherwise installs $TORCH_SPEC (default torch==2.13.0) BEFORE the project, so pip does not
#     resolve `torch>=2.8` to a multi-GB CUDA build on a CPU-only machine (point pip at a CPU wheel
#     index or file through pip's own configuration if yours is not local);
#   - then `pip install -e ".[dev]"`.
set -euo pipefail
VENV="${1:-.venv}"
PY="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
cd "$(dirname "$0")/.."

has_torch() { "$1" -c 'import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 8))' 2>/dev/null; }

if [ ! -x "$VENV/bin/python" ]; then
  if has_torch "$PY"; then
    echo "bootstrap: reusing the system torch ($("$PY" -c 'import torch; print(torch.__version__)'))"
    "$PY" -m venv --system-site-packages "$VENV"
  else
    "$PY" -m venv "$VENV"
  fi
fi
if ! has_torch "$VENV/bin/python"; then
  echo "bootstrap: installing $TORCH_SPEC"
  "$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
fi
stamp="$VENV/.installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "bootstrap: installing the project and its dependencies"
  "$VENV/bin/python" -m pip install -q -e ".[dev]"
  touch "$stamp"
fi
