#!/usr/bin/env bash
# Tokens a second of `compressme generate` on SmolLM2-135M-Instruct (the GGUF's weights
# dequantized to f32, and the same packed to INT8 per row), one thread and two, the
# variants interleaved round by round; prints a Markdown table of medians and every raw
# sample. Run from the repository root after `cargo xtask fixtures`:
#   bash benches/decoders/generate.sh [ROUNDS] [MAX_NEW]
set -euo pipefail
rounds=${1:-5}
max_new=${2:-64}
gguf=cache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
work=target/decoders
mkdir -p "$work"
cargo build --release --quiet -p compressme
bin=target/release/compressme
[ -f "$work/smollm2-int8.cma" ] || "$bin" pack "$gguf" --format int8 -o "$work/smollm2-int8.cma" >/dev/null
prompt="It was a fine morning in Bath, and Anne Elliot"
declare -A samples
for r in $(seq "$rounds"); do
  for threads in 1 2; do
    for variant in f32 int8; do
      model=$gguf; [ "$variant" = int8 ] && model=$work/smollm2-int8.cma
      rate=$(RAYON_NUM_THREADS=$threads "$bin" generate "$model" --prompt "$prompt" --max-new "$max_new" --json 2>&1 >/dev/null \
        | tail -n 1 | python3 -c 'import json,sys; print(json.load(sys.stdin)["tokens_per_second"])')
      samples[$variant,$threads]="${samples[$variant,$threads]:-} $rate"
    done
  done
done
echo "| model | threads | tokens/s (median of $rounds) | samples |"
echo "| --- | ---: | ---: | --- |"
for variant in f32 int8; do
  for threads in 1 2; do
    python3 - "$variant" "$threads" ${samples[$variant,$threads]} <<'PY'
import statistics, sys
v, t, *xs = sys.argv[1:]
xs = [float(x) for x in xs]
print(f"| {v} | {t} | {statistics.median(xs):.1f} | {', '.join(f'{x:.1f}' for x in xs)} |")
PY
  done
done
