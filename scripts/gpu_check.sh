#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: the CUDA tests (two or more worker
# processes on one device pool) and the GPU benchmark. Writes its report to $OUT when
# set (else ./gpu_check_out). Budget: well under 8 minutes.
#
# It fails unless torch sees a GPU: without one every CUDA test would skip and pytest
# would pass, which proves nothing. Where `nvidia-smi` finds a GPU and the torch of
# .venv is a CPU build (scripts/setup.sh pins a CPU build for every other machine), a
# CUDA build is installed into .venv first: $SHMKV_CUDA_TORCH, default torch==2.14.1
# (PyPI's Linux wheels of torch are CUDA builds).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_check_out}"
mkdir -p "$out"
./scripts/setup.sh test >"$out/setup.log" 2>&1 || { cat "$out/setup.log"; exit 1; }
nvidia-smi >"$out/nvidia-smi.txt" 2>&1
smi_rc=$?
torch_cuda() {   # the CUDA version torch was built for, or "None"
    .venv/bin/python -c "import torch; print(torch.version.cuda)" 2>/dev/null || echo None
}
if [ "$smi_rc" = 0 ] && [ "$(torch_cuda)" = None ]; then
    spec="${SHMKV_CUDA_TORCH:-torch==2.14.1}"
    echo "gpu_check: a GPU is present and .venv's torch is a CPU build: installing $spec" \
        | tee -a "$out/setup.log"
    if ! .venv/bin/pip install --quiet --disable-pip-version-check "$spec" \
            >>"$out/setup.log" 2>&1; then
        tail -n 30 "$out/setup.log"
        echo "gpu_check: FAILED: could not install a CUDA build of torch ($spec)" \
            | tee "$out/summary.txt"
        exit 1
    fi
fi
if ! .venv/bin/python - >"$out/torch_cuda.txt" 2>&1 <<'EOF'
import sys
import torch
print(f"torch {torch.__version__}, built for CUDA {torch.version.cuda}, "
      f"cuda.is_available()={torch.cuda.is_available()}")
if not torch.cuda.is_available():
    sys.exit(1)
print(f"{torch.cuda.device_count()} device(s): {torch.cuda.get_device_name(0)}")
EOF
then
    cat "$out/torch_cuda.txt"
    [ "$smi_rc" = 0 ] || echo "nvidia-smi: $(head -n 3 "$out/nvidia-smi.txt")"
    echo "gpu_check: FAILED: torch.cuda.is_available() is False; the CUDA tests would" \
         "only skip" | tee "$out/summary.txt"
    exit 1
fi
cat "$out/torch_cuda.txt"
timeout 240 .venv/bin/python -m pytest -q -rs -m cuda tests/test_cuda.py tests/test_attention.py \
    2>&1 | tee "$out/cuda_tests.txt"
tests_rc=${PIPESTATUS[0]}
timeout 240 .venv/bin/python scripts/gpu_bench.py --json "$out/gpu_bench.json" \
    2>&1 | tee "$out/gpu_bench.txt"
bench_rc=${PIPESTATUS[0]}
echo "cuda tests rc=$tests_rc, gpu bench rc=$bench_rc" | tee "$out/summary.txt"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
