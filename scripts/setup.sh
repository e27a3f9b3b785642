#!/usr/bin/env bash
# Creates .venv with shmkv installed (editable) and the extras named as arguments.
# Prefers a torch that is already installed (in .venv or the system Python); installs
# torch==2.13.0 (the CPU build) only where none is present.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    if "$PY" -c "import torch" >/dev/null 2>&1; then
        "$PY" -m venv --system-site-packages .venv   # reuse the system's torch
    else
        "$PY" -m venv .venv
    fi
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    .venv/bin/pip install --quiet "torch==2.13.0"
fi
extras="${1:-}"
spec="."
[ -n "$extras" ] && spec=".[${extras}]"
stamp=".venv/.shmkv-installed-${extras:-base}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/pip install --quiet --disable-pip-version-check -e "$spec"
    touch "$stamp"
fi
