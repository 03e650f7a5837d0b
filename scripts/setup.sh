#!/usr/bin/env bash
# Sets up ./.venv with torch, kasoku (editable) and, with --test, the test tools.
# A torch >= 2.4 that is already installed is reused, never reinstalled: the venv then sees the
# system's packages. Otherwise torch comes from $KASOKU_TORCH (default torch==2.13.0, which on
# the project's CPU machines is a local CPU-only wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"

has_torch() {
  "$1" - <<'PYEOF' 2>/dev/null
import sys
import torch
major, minor = (int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 4) else 1)
PYEOF
}

if [ ! -x .venv/bin/python ]; then
  if has_torch "$PY"; then
    echo "setup: reusing the torch installed for $PY" >&2
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
if ! has_torch .venv/bin/python; then
  echo "setup: installing ${KASOKU_TORCH:-torch==2.13.0}" >&2
  .venv/bin/python -m pip install -q "${KASOKU_TORCH:-torch==2.13.0}"
fi
.venv/bin/python -m pip install -q -e ".${extras}"
echo "setup: ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))" >&2
