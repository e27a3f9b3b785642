#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: the CUDA tests (two or more worker
# processes on one device pool) and the GPU benchmark. Writes its report to $OUT when
# set (else ./gpu_check_out). Budget: well under 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_check_out}"
mkdir -p "$out"
./scripts/setup.sh test >"$out/setup.log" 2>&1 || { cat "$out/setup.log"; exit 1; }
nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true
timeout 240 .venv/bin/python -m pytest -q -m cuda tests/test_cuda.py tests/test_attention.py \
    2>&1 | tee "$out/cuda_tests.txt"
tests_rc=${PIPESTATUS[0]}
timeout 240 .venv/bin/python scripts/gpu_bench.py --json "$out/gpu_bench.json" \
    2>&1 | tee "$out/gpu_bench.txt"
bench_rc=${PIPESTATUS[0]}
echo "cuda tests rc=$tests_rc, gpu bench rc=$bench_rc" | tee "$out/summary.txt"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
