#!/usr/bin/env bash
# Output tok/s on the shared workload for the default path and each --quantization method
# given, alternated round after round (default, mxfp4, nvfp4, ..., default, ...) so that
# the machine's drift hits every path alike; run it on a quiet machine, beside the peer
# (../shared/peers/bench_vllm.py) in the same session. Prints one line per run, then the
# median per path and its ratio to the default path's.
#
#   REPS=3 bash benchmarks/quant_speed.sh mxfp4 nvfp4 int8
set -euo pipefail
cd "$(dirname "$0")/.."
PS=${PAGEDSERVE:-.venv/bin/pagedserve}
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-/tmp/pagedserve_quant_speed}
mkdir -p "$OUT"
. benchmarks/machine.sh
machine_line
for i in $(seq 1 "${REPS:-3}"); do
    for q in default "$@"; do
        extra=()
        [ "$q" = default ] || extra=(--quantization "$q")
        $PS bench throughput --dataset-name workload --disable-tqdm "${extra[@]}" \
            --output-json "$OUT/${q}_$i.json" > /dev/null 2>&1
        $PY -c "import json, sys; r = json.load(open(sys.argv[1]))['result']; print(sys.argv[2], \
'%.1f output tok/s' % r['output_tokens_per_second'])" "$OUT/${q}_$i.json" "$q"
    done
done
$PY - "$OUT" "${REPS:-3}" default "$@" <<'PY'
import json, statistics, sys
out, reps, paths = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def rate(p, i):
    return json.load(open(f"{out}/{p}_{i}.json"))["result"]["output_tokens_per_second"]
med = {p: statistics.median(rate(p, i) for i in range(1, reps + 1)) for p in paths}
for p in paths:
    print(f"{p:8s} median {med[p]:.1f} output tok/s, {med[p] / med['default']:.2f}x default")
PY
