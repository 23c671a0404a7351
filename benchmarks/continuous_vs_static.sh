#!/usr/bin/env bash
# Continuous vs static batching where it matters on a CPU: tail TTFT under Poisson
# arrivals (issue 13, target 5). Mixed output lengths (AlpacaEval's reference answers:
# 9-897 tokens), --max-num-seqs 8 so that requests queue.
#
#   bash benchmarks/continuous_vs_static.sh [NUM_PROMPTS] [LOAD]
#
# 1. capacity: all requests at once against a continuous server (requests/s);
# 2. Poisson arrivals at LOAD x capacity (default 0.7), the same seed, first against a
#    continuous server, then against a `--scheduling static` one;
# then one line per run: output tok/s, mean and p99 TTFT, and the ratios.
# Run it on a quiet machine; the JSON files go to $OUT (default /tmp/pagedserve_cvs).
set -euo pipefail
cd "$(dirname "$0")/.."
NUM_PROMPTS=${1:-32}
LOAD=${2:-0.7}
OUT=${OUT:-/tmp/pagedserve_cvs}
PS=${PAGEDSERVE:-.venv/bin/pagedserve}
PY=${PYTHON:-.venv/bin/python}
PORT=${PORT:-8765}
mkdir -p "$OUT"
. benchmarks/machine.sh
machine_line

serve() {  # $1: scheduling
    $PS serve --port "$PORT" --dtype float32 --max-num-seqs 8 --scheduling "$1" \
        > "$OUT/server_$1.log" 2>&1 &
    SERVER=$!
    trap 'kill $SERVER 2>/dev/null || true' EXIT
}

bench() {  # $1: name, $2: request rate
    $PS bench serve --port "$PORT" --dataset-name alpaca-eval --num-prompts "$NUM_PROMPTS" \
        --request-rate "$2" --ready-timeout 120 --disable-tqdm --output-json "$OUT/$1.json" \
        > "$OUT/$1.txt"
}

serve continuous
bench capacity inf
rate=$($PY -c "import json,sys; r=json.load(open('$OUT/capacity.json')); print(round($LOAD * r['metrics']['request_throughput'], 4))")
echo "capacity: $($PY -c "import json; print(json.load(open('$OUT/capacity.json'))['metrics']['request_throughput'])") requests/s; Poisson rate $rate"
bench continuous "$rate"
kill $SERVER; wait $SERVER 2>/dev/null || true
serve static
bench static "$rate"
kill $SERVER; wait $SERVER 2>/dev/null || true

$PY - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
runs = {name: json.loads((out / f"{name}.json").read_text())["metrics"] for name in ("continuous", "static")}
print(f"\n{'scheduling':<12}{'output tok/s':>14}{'mean TTFT ms':>14}{'p99 TTFT ms':>14}")
for name, r in runs.items():
    print(f"{name:<12}{r['output_throughput']:>14.1f}{r['mean_ttft_ms']:>14.0f}{r['p99_ttft_ms']:>14.0f}")
c, s = runs["continuous"], runs["static"]
print(f"static / continuous p99 TTFT: {s['p99_ttft_ms'] / c['p99_ttft_ms']:.1f}x (target >= 5x); "
      f"continuous / static output tok/s: {c['output_throughput'] / s['output_throughput']:.2f}")
EOF
