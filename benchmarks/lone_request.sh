#!/usr/bin/env bash
# One request alone (32 prompt ids, 128 greedy tokens, ignore_eos): decode tokens/s of
# pagedserve with default settings, of its exact path (--dtype float32 --quantization none),
# of self-speculative decoding (the default path drafts SPEC_K tokens, default 8, the exact
# path verifies them: the exact path's output), and, when its binary is given, of llama.cpp's llama-server on the same bundled Q4_1 GGUF
# (../shared/peers/README.md says how to build it), one after the other. Run it on a quiet
# machine; only figures from one run compare.
#
#   [QUANTS="mxfp4 nvfp4"] bash benchmarks/lone_request.sh [PATH/TO/llama-server]
#
# QUANTS: also the default path with each of these --quantization methods, after it.
#
# Ours: `pagedserve bench latency --batch-size 1 --input-len 32` with 1 and with 129 output
# tokens; decode tok/s = 128 / (difference of the median latencies). llama-server's:
# timings.predicted_per_second of a /completion (-t <cores> -np 1, cache_prompt off).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
PS=${PAGEDSERVE:-.venv/bin/pagedserve}
OUT=${OUT:-/tmp/pagedserve_lone}
mkdir -p "$OUT"
. benchmarks/machine.sh
machine_line
GGUF=$($PY -c "from pagedserve.model_loader.files import resolve_model_path; print(resolve_model_path(None))")

if [ $# -ge 1 ]; then
    "$1" -m "$GGUF" -t "$(nproc)" -np 1 -c 4096 --port 8190 > "$OUT/llama_server.log" 2>&1 &
    server=$!
    trap 'kill $server 2>/dev/null || true' EXIT  # (already gone after the timings)
    for _ in $(seq 120); do curl -s localhost:8190/health | grep -q ok && break; sleep 1; done
    prompt=$($PY -c 'print(",".join(str(100 + i) for i in range(32)))')
    for _ in 1 2 3; do
        curl -s localhost:8190/completion -d "{\"prompt\": [$prompt], \"n_predict\": 128, \
\"temperature\": 0, \"ignore_eos\": true, \"cache_prompt\": false}" | $PY -c "
import json, sys
t = json.load(sys.stdin)['timings']
print(f\"llama-server Q4_1: decode {t['predicted_per_second']:.1f} tok/s\")"
    done
    kill $server
fi

decode_rate() {  # $1: label, rest: extra flags
    local label=$1; shift
    for n in 1 129; do
        $PS bench latency --batch-size 1 --input-len 32 --output-len $n --num-iters 5 \
            --disable-tqdm --output-json "$OUT/ours_$n.json" "$@" > /dev/null 2>&1
    done
    $PY - "$label" "$OUT" <<'PY'
import json, statistics, sys
label, out = sys.argv[1], sys.argv[2]
med = [statistics.median(json.load(open(f"{out}/ours_{n}.json"))["latencies"]) for n in (1, 129)]
print(f"pagedserve {label}: decode {128 / (med[1] - med[0]):.1f} tok/s "
      f"(32 + 128 tokens in {med[1]:.2f} s)")
PY
}
decode_rate "default"
for q in ${QUANTS:-}; do
    decode_rate "--quantization $q" --quantization "$q"
done
decode_rate "exact (--dtype float32 --quantization none)" --dtype float32 --quantization none
decode_rate "self-speculative, k=${SPEC_K:-8} (output = the exact path's)" --dtype float32 \
    --speculative-config "{\"method\": \"self\", \"num_speculative_tokens\": ${SPEC_K:-8}}"
