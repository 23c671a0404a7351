#!/usr/bin/env bash
# The CPU figures of benchmarks/README.md, side by side in one run (about 30 minutes on
# 2 cores). Run it on a quiet machine: two processes that both use every core slow each
# other down many times over (OpenMP threads spin while they wait).
#
#   bash benchmarks/cpu_suite.sh [OUT_DIR]      (default /tmp/pagedserve_cpu_suite)
#
# Needs the test extras (transformers' GGUF loading for the baseline, httpx for the
# serving client): `bash setup.sh test` installs them.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/pagedserve_cpu_suite}
mkdir -p "$OUT"
PS=${PAGEDSERVE:-.venv/bin/pagedserve}
PY=${PYTHON:-.venv/bin/python}
PORT=${PORT:-8011}
step() { echo; echo "== $*"; }

step "1. throughput: the 64-request workload, continuous batching (float32)"
$PS bench throughput --dataset-name workload --dtype float32 --disable-tqdm \
    --output-json "$OUT/throughput.json"

step "2. throughput: transformers generate, static batches of 16 (float32)"
$PY benchmarks/hf_baseline.py --dataset-name workload --dtype float32 --batch-size 16 --disable-tqdm \
    --output-json "$OUT/hf_baseline.json"

step "3. continuous vs static batching, mixed output lengths (AlpacaEval reference answers)"
for scheduling in continuous static; do
    $PS bench throughput --dataset-name alpaca-eval --num-prompts 32 --max-num-seqs 8 \
        --dtype float32 --scheduling $scheduling --disable-tqdm \
        --output-json "$OUT/alpaca_$scheduling.json"
done

step "4. full batch: achieved FLOP rate vs the GEMM rate"
$PS bench latency --batch-size 64 --input-len 32 --output-len 128 --num-iters-warmup 1 \
    --num-iters 3 --dtype float32 --disable-tqdm --output-json "$OUT/latency_64.json"

step "4b. the same at the default full batch (--max-num-seqs 256)"
$PS bench latency --batch-size 256 --input-len 32 --output-len 128 --num-iters-warmup 0 \
    --num-iters 1 --dtype float32 --disable-tqdm --output-json "$OUT/latency_256.json"

step "5. one request alone (decode tokens/s = output_len / latency)"
$PS bench latency --batch-size 1 --input-len 32 --output-len 128 --num-iters-warmup 1 \
    --num-iters 5 --dtype float32 --disable-tqdm --output-json "$OUT/latency_1.json"

step "6. serve: start-up to first answer, then Poisson arrivals at 4 requests/s"
start=$(date +%s.%N)
$PS serve --port "$PORT" --dtype float32 > "$OUT/serve.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
until curl -s -o /dev/null "localhost:$PORT/health"; do sleep 0.1; done
curl -s "localhost:$PORT/v1/completions" -H 'content-type: application/json' \
    -d '{"model":"SmolLM2-135M-Instruct","prompt":"Hello","max_tokens":4}' > /dev/null
echo "first answer $(echo "$(date +%s.%N) - $start" | bc) s after start"
$PS bench serve --port "$PORT" --dataset-name workload --request-rate 4 --disable-tqdm \
    --output-json "$OUT/serve_rate4.json"
$PS bench serve --port "$PORT" --dataset-name workload --num-prompts 8 --max-concurrency 1 \
    --disable-tqdm --output-json "$OUT/serve_single.json"
