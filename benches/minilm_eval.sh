#!/bin/bash
# MiniLM: packed variants against f32 on held-out sentences (needs `cargo build --release -p compressme`
# and `cargo xtask fixtures`). Prints: variant, stored bytes, dense bytes, `compressme evaluate` JSON.
set -e
B=target/release/compressme
D=${1:-target/minilm-eval}
mkdir -p $D
H=fixtures/eval/heldout_sentences.txt
$B profile cache/minilm --data fixtures/calibration/docs_128.txt -o $D/profile.json >/dev/null
$B plan $D/profile.json --budget-bpw 4.5 -o $D/plan45.json >/dev/null
$B plan $D/profile.json --thresholds -o $D/plant.json >/dev/null
for s in 1 2 3; do
  $B plan $D/profile.json --budget-bpw 4.5 --shuffle-seed $s -o $D/plan45-s$s.json >/dev/null
  $B plan $D/profile.json --thresholds --shuffle-seed $s -o $D/plant-s$s.json >/dev/null
done
$B pack cache/minilm --format int8 --keep embeddings -o $D/int8.cma >/dev/null
$B pack cache/minilm --format nf4 --keep embeddings -o $D/nf4.cma >/dev/null
$B pack cache/minilm --format nf4-g64 --keep embeddings -o $D/nf4g64.cma >/dev/null
for p in plan45 plan45-s1 plan45-s2 plan45-s3 plant plant-s1 plant-s2 plant-s3; do
  $B pack cache/minilm --plan $D/$p.json --profile $D/profile.json -o $D/$p.cma >/dev/null
done
for v in int8 nf4 nf4g64 plan45 plan45-s1 plan45-s2 plan45-s3 plant plant-s1 plant-s2 plant-s3; do
  bytes=$($B inspect $D/$v.cma --json | python3 -c "import json,sys; j=json.load(sys.stdin); print(j['stored_bytes'], j['dense_bytes'])")
  echo "$v $bytes $($B evaluate $D/$v.cma --reference cache/minilm --data $H --json | tr -d '\n ')"
done
