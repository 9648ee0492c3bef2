#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment. Idempotent; used by the Makefile.
#   scripts/bootstrap.sh [VENV] [EXTRA]     EXTRA: "" (lessons: `make lessons`), lab, dev (`make test`)
#
# Which torch: the one you already have, whatever kind of environment holds it; never a different one
# over it unless you ask (TORCH_SPEC):
#   - the invoking Python (PYTHON, default python3) is a virtual environment with torch >= 2.8 (most GPU
#     images; a laptop venv): VENV is created with --system-site-packages AND a .pth file listing that
#     environment's package folders. (--system-site-packages alone exposes only the *base* interpreter's
#     site-packages, so a venv made from a venv would not see its parent's torch.)
#   - a system or conda Python with torch >= 2.8: VENV is created with --system-site-packages.
#   - no torch anywhere: torch==2.13.0 is installed into VENV *before* the project. From pip's default
#     index that is the CUDA build on Linux x86-64; on a CPU-only machine add PyTorch's CPU wheel index:
#     PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu (its 2.13.0+cpu sorts above 2.13.0).
#   - TORCH_SPEC=... (e.g. "torch==2.13.0" or a wheel path): that torch is installed into VENV, shadowing
#     any torch the invoking Python has.
# Offline machines: point pip at a wheelhouse with pip's own variables, e.g.
#   PIP_NO_INDEX=1 PIP_FIND_LINKS=/path/to/wheels make lessons
set -euo pipefail
VENV="${1:-.venv}"
EXTRA="${2:-}"
PY="${PYTHON:-python3}"
DEFAULT_TORCH="torch==2.13.0"
cd "$(dirname "$0")/.."

torch_of() {  # "<version> <cuda build or cpu> <folder>" of the torch an interpreter imports; fails without one
  "$1" - <<'PY' 2>/dev/null
import os, sys
import torch
v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
if v < (2, 8):
    sys.exit(1)
print(torch.__version__, f"cuda-{torch.version.cuda}" if torch.version.cuda else "cpu-only",
      os.path.dirname(os.path.dirname(torch.__file__)))
PY
}

is_venv() { "$1" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; }

package_folders() {  # the folders an interpreter imports packages from (not its standard library)
  "$1" - <<'PY'
import os, sys, sysconfig
std = [os.path.realpath(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib")]
for p in sys.path:
    if not p or not os.path.isdir(p):
        continue
    rp = os.path.realpath(p)
    if rp == os.path.realpath(os.getcwd()):
        continue
    in_std = any(rp == s or rp.startswith(s + os.sep) for s in std)
    if in_std and "site-packages" not in rp and "dist-packages" not in rp:
        continue
    print(p)
PY
}

if [ ! -x "$VENV/bin/python" ]; then
  if [ -n "${TORCH_SPEC:-}" ]; then
    echo "bootstrap: TORCH_SPEC=$TORCH_SPEC given: creating $VENV with its own torch"
    "$PY" -m venv "$VENV"
  elif info=$(torch_of "$PY"); then
    read -r version build where <<<"$info"
    if is_venv "$PY"; then
      echo "bootstrap: reusing torch $version ($build) of the virtual environment $("$PY" -c 'import sys; print(sys.prefix)')"
      echo "bootstrap:   (found at $where; $VENV will see that environment's packages through a .pth file)"
      "$PY" -m venv --system-site-packages "$VENV"
      site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
      package_folders "$PY" > "$site/_parent_environment.pth"
    else
      echo "bootstrap: reusing the system torch $version ($build) found at $where"
      "$PY" -m venv --system-site-packages "$VENV"
    fi
  else
    "$PY" -m venv "$VENV"
  fi
fi

if [ -n "${TORCH_SPEC:-}" ]; then
  if [ ! -f "$VENV/.torch_spec" ] || [ "$(cat "$VENV/.torch_spec")" != "$TORCH_SPEC" ]; then
    echo "bootstrap: installing $TORCH_SPEC (asked for by TORCH_SPEC)"
    "$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
    echo "$TORCH_SPEC" > "$VENV/.torch_spec"
  fi
elif ! torch_of "$VENV/bin/python" >/dev/null; then
  echo "bootstrap: no torch >= 2.8 in reach: installing $DEFAULT_TORCH (set TORCH_SPEC to choose another build)"
  "$VENV/bin/python" -m pip install -q "$DEFAULT_TORCH"
fi
read -r version build where <<<"$(torch_of "$VENV/bin/python")"
echo "bootstrap: torch $version ($build) from $where"

# the project: reinstalled when pyproject.toml changed or a larger set of extras is asked for
stamp="$VENV/.installed"
have=$(cat "$stamp" 2>/dev/null || true)
[ -n "$have" ] || have=none
covers() {  # does the installed set ($1) include what is asked ($2)? dev includes lab
  case "$1:$2" in
    none:*) return 1 ;;
    *:|dev:*|lab:lab) return 0 ;;
    *) return 1 ;;
  esac
}
want="${EXTRA:-base}"
covers "$have" "$EXTRA" && want="$have"   # refreshing after a pyproject change keeps the larger set
if ! covers "$have" "$EXTRA" || [ pyproject.toml -nt "$stamp" ]; then
  target="."; [ "$want" != base ] && target=".[$want]"
  echo "bootstrap: installing the project ($target) and its dependencies"
  "$VENV/bin/python" -m pip install -q -e "$target"
  echo "$want" > "$stamp"
fi
