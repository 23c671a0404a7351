#!/usr/bin/env bash
# Old vs new pagedserve on the shared workload (benchmarks/workload_ids.py), alternating
# runs (old, new, old, new, ...) so that load drifting on the machine hits both alike: the
# check that a refactor kept every path's token ids and throughput.
#   git worktree add /tmp/old <commit>   (its C++ kernels build on first use, ~6 min)
#   OLD_PYTHONPATH=/tmp/old bash benchmarks/before_after.sh [path ...]   (default: all four)
# Env: NEW_REPO (this checkout), PY (the new repo's .venv python), REPS (3), OUT (/tmp/alt).
# Writes $OUT/{path}_{old|new}_{i}.json; prints per path whether the ids are identical
# old vs new (every run) and the median of the new/old output tok/s ratios (run i
# paired); where the engine fails to start (or a run crashes), whether old and new fail alike.
set -euo pipefail
: "${OLD_PYTHONPATH:?set OLD_PYTHONPATH to the old checkout, e.g. /tmp/old}"
NEW_REPO=${NEW_REPO:-$(cd "$(dirname "$0")/.." && pwd)}
PY=${PY:-$NEW_REPO/.venv/bin/python}
REPS=${REPS:-3}
OUT=${OUT:-/tmp/alt}
SCRIPT=$NEW_REPO/benchmarks/workload_ids.py   # the same script runs both
PATHS=("$@")
[ ${#PATHS[@]} -gt 0 ] || PATHS=(default none int8 tp3)
mkdir -p "$OUT"

for p in "${PATHS[@]}"; do
  for i in $(seq 1 "$REPS"); do
    # exit status 1 = the engine failed to start; the JSON records the error (compared below)
    rm -f "$OUT/${p}_old_$i.json" "$OUT/${p}_new_$i.json"   # no stale result
    PYTHONPATH=$OLD_PYTHONPATH "$PY" "$SCRIPT" --path "$p" --out "$OUT/${p}_old_$i.json" || true
    PYTHONPATH=$NEW_REPO "$PY" "$SCRIPT" --path "$p" --out "$OUT/${p}_new_$i.json" || true
  done
done

"$PY" - "$OUT" "$REPS" "$OLD_PYTHONPATH" "$NEW_REPO" "${PATHS[@]}" <<'EOF'
import json, os, statistics, sys
out, reps, old_root, new_root, paths = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:]
def load(p, w, i):
    f = os.path.join(out, f"{p}_{w}_{i}.json")
    return json.load(open(f)) if os.path.exists(f) else {"error": "crashed: no JSON written"}
for p in paths:
    old = [load(p, "old", i) for i in range(1, reps + 1)]
    new = [load(p, "new", i) for i in range(1, reps + 1)]
    for w, runs, root in (("old", old, old_root), ("new", new, new_root)):
        for r in runs:  # the code that ran must be the one meant
            if "pagedserve_file" in r:
                assert os.path.realpath(r["pagedserve_file"]).startswith(os.path.realpath(root) + "/"), (w, r["pagedserve_file"])
    errors = {w: [r.get("error") for r in runs] for w, runs in (("old", old), ("new", new))}
    if any(e for es in errors.values() for e in es):
        same = len(set(errors["old"] + errors["new"])) == 1
        print(f"{p:8s} engine failed or a run crashed; same error in every run: {'yes' if same else 'no'}: {errors}")
        continue
    same = all(r["token_ids"] == old[0]["token_ids"] for r in old + new)
    ratios = [n["output_tokens_per_s"] / o["output_tokens_per_s"] for o, n in zip(old, new)]
    tps = lambda runs: ", ".join("%.1f" % r["output_tokens_per_s"] for r in runs)
    print(f"{p:8s} ids identical old vs new: {'yes' if same else 'no'}; "
          f"new/old throughput median {statistics.median(ratios):.3f} "
          f"(ratios {', '.join('%.3f' % x for x in ratios)}; old tok/s {tps(old)}; "
          f"new tok/s {tps(new)}); dtype old {old[0]['resolved_dtype']} "
          f"new {new[0]['resolved_dtype']}")
EOF
