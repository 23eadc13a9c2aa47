#!/bin/bash
# One run.sh per test file (a fresh torchrun each), sequentially, into <run_dir>/<file stem>/;
# compare.py reads the whole tree. A file's crash or hang then costs that file only.
# Usage: run-files.sh <baseline|dropin> <world_size> <run_dir> <test files...>
set -u
MODE=$1; WS=$2; RUN=$(realpath -m "$3"); shift 3
D="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$RUN"
for f in "$@"; do
  stem=$(basename "$f" .py)
  start=$(date +%s)
  "$D/run.sh" "$MODE" "$WS" "$RUN/$stem" "$f"
  log=$([ "$WS" = 1 ] && echo log_r0.txt || echo torchrun.txt)
  echo "$stem $(( $(date +%s) - start )) s $(tail -1 "$RUN/$stem/$log")" >> "$RUN/times.txt"
done
