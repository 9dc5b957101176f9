#!/usr/bin/env bash
# Issue 16's peer table: every format of ours against candle's nearest, `peer_probe` at
# batch 1 (in cache: 1 matrix; from memory: 8) and batch 32, on one thread (pinned to CPU 1)
# and on two. Prints one line a cell: the median ratio of our time to candle's, quartiles,
# medians. Usage: benches/peer_table.sh [PAIRS] (default 20). Build first:
#   cargo build --release -p compressme-benches --example peer_probe
set -euo pipefail
cd "$(dirname "$0")/.."
pairs=${1:-20}
probe=target/release/examples/peer_probe
for f in "nf4-g64 q4k" "nf4-g128 q4k" "int4-g64 q4k" "nf4 q4k" "int8 q8_0"; do
  # THREADS BATCH MATRICES RUN
  for cfg in "1 1 1 20" "2 1 1 20" "1 1 8 20" "2 1 8 20" "1 32 1 5" "2 32 1 5"; do
    read -r threads batch matrices run <<< "$cfg"
    pin=()
    if [ "$threads" = 1 ]; then pin=(taskset -c 1); fi
    echo -n "$f threads=$threads batch=$batch matrices=$matrices: "
    # shellcheck disable=SC2086
    RAYON_NUM_THREADS=$threads "${pin[@]}" $probe $f "$pairs" "$batch" "$matrices" best "$run" 2>&1 \
      | tail -1 | sed 's/.*median ratio//'
  done
done
