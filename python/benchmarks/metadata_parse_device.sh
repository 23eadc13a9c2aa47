#!/bin/bash
# Issue 27 item 1 on the GPU host: `.metadata` parse, shardwise against pickle.load, at 1M chunks
# (grid and moe layouts) and 4M chunks (grid 2,000 keys x 2,000 ranks), files made there by real
# torch (2.11 pickles TensorProperties as the 5-tuple its __setstate__ takes, so no patching).
#
# Usage, from the repository root on the device, in two calls (each under the 10-minute limit):
#   SHARDWISE_PKG=/path/to/dir-holding-shardwise bash python/benchmarks/metadata_parse_device.sh make    # ~5 min, the three at once
#   SHARDWISE_PKG=/path/to/dir-holding-shardwise bash python/benchmarks/metadata_parse_device.sh bench   # ~2 + 2 + 4 min
# SHARDWISE_PKG: the directory that holds the built `shardwise` package (added to PYTHONPATH);
# PYTHON (default python3) must have torch. Files go to $MD_DIR (default /tmp/md27).
# `bench` prints one JSON line per file and a table; `all` runs both (about 12 min: too long for
# one call).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
DIR=${MD_DIR:-/tmp/md27}
export PYTHONPATH="${SHARDWISE_PKG:-}${PYTHONPATH:+:$PYTHONPATH}"
BENCH=python/benchmarks/metadata_parse.py

make() {
    "$PY" -c 'import torch; print("torch", torch.__version__)'
    mkdir -p "$DIR"
    local t pids=()
    t=$(date +%s)
    # one core each, all three at once (the 4M file takes ~13 GB of memory and ~5 min)
    for spec in "grid1m --layout grid --tensors 1000 --chunks 1000" \
                "moe1m --layout moe" \
                "grid4m --layout grid --tensors 2000 --chunks 2000"; do
        set -- $spec
        local name=$1
        shift
        if [ -s "$DIR/$name/.metadata" ]; then
            echo "$name: already made"
            continue
        fi
        ( "$PY" "$BENCH" make "$@" --out "$DIR/$name" && echo "$name: made in $(( $(date +%s) - t )) s" ) &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid"; done
}

bench() {
    "$PY" -c 'import shardwise, torch; print("shardwise", shardwise.__file__, "torch", torch.__version__)'
    nproc
    uptime
    "$PY" "$BENCH" bench "$DIR/grid1m" "$DIR/moe1m" --reps 3 | tee "$DIR/bench1m.jsonl"
    uptime
    "$PY" "$BENCH" bench "$DIR/grid4m" --reps 2 | tee "$DIR/bench4m.jsonl"
    uptime
    "$PY" - "$DIR"/bench1m.jsonl "$DIR"/bench4m.jsonl <<'EOF'
import json, sys
print("| file | MiB | pickle.load s (runs) | shardwise s (runs) | speed-up | peak RSS pickle / shardwise MiB (rise) | rise ratio | load |")
print("|---|---:|---|---|---:|---|---:|---:|")
for path in sys.argv[1:]:
    for line in open(path):
        r = json.loads(line)
        p, s = r["pickle"], r["shardwise"]
        print(f"| {r['dir'].rsplit('/', 1)[-1]} ({p['n']:,} chunks) | {r['mib']} | {p['s_median']} ({', '.join(map(str, p['s_all']))}) "
              f"| {s['s_median']} ({', '.join(map(str, s['s_all']))}) | {r['speedup']}x "
              f"| {p['peak_mib']:,} / {s['peak_mib']:,} ({p['rise_mib']:,} / {s['rise_mib']:,}) | {r['rise_ratio']} | {r['load']:.1f} |")
EOF
}

case "${1:-}" in
    make) make ;;
    bench) bench ;;
    all) make; bench ;;
    *) echo "usage: $0 make|bench|all" >&2; exit 2 ;;
esac
