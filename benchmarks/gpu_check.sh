#!/usr/bin/env bash
# The GPU check of the CUDA path, in one call on a machine with an NVIDIA GPU
# (see benchmarks/README.md for how to run it through the device tool):
#   1. the CUDA-marked tests: Triton kernels vs the PyTorch reference (float32, bfloat16,
#      float16), the engine on CUDA vs the CPU torch path and transformers on a tiny random
#      Llama, CUDA graphs vs --enforce-eager, CUDA memory sizing;
#   2. decode throughput of a Llama-3-8B-shaped random-weight model (--load-format dummy,
#      bfloat16) at batch 1, 16, 64, 256, with CUDA graphs and eagerly, and the decode
#      attention's HBM bandwidth (benchmarks/gpu_decode.py).
# Logs and JSON go to $OUT (the device tool sets it; default /tmp/gpu_check).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# Packages the GPU image lacks (gguf) travel as wheels in .whl/ (README.md says how).
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__,
'| cuda', torch.cuda.is_available())" || exit 1
$PY -c "import pagedserve" || { echo "pagedserve does not import (gguf missing? carry .whl)"; exit 1; }

echo "== 1. CUDA-marked tests"
# Other test files may need packages the image lacks: their collection errors are listed
# but do not stop the CUDA tests.
timeout 240 $PY -m pytest -q -m cuda --continue-on-collection-errors -p no:cacheprovider \
    --durations=10 tests 2>&1 | tee "$OUT/cuda_tests.log"
tests_rc=${PIPESTATUS[0]}

echo "== 2. decode throughput (Llama-3-8B shapes, random weights, bfloat16)"
timeout 300 $PY benchmarks/gpu_decode.py --out "$OUT/gpu_decode.json" 2>&1 \
    | tee "$OUT/gpu_decode.log"
bench_rc=${PIPESTATUS[0]}

echo "== done: tests rc=$tests_rc, benchmark rc=$bench_rc"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
