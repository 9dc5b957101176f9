#!/usr/bin/env bash
# Two builds of the CLI against each other and against zstd, interleaved:
#   benches/ab_rounds.sh OLD_BIN NEW_BIN ARTIFACT.cma[,NEW_ARTIFACT.cma] FILE.zst[,FILE2.zst...] ROUNDS
# (with two artifacts, OLD_BIN reads the first and NEW_BIN the second: one file written by
# each build, when the format changed between them)
# Each round runs, in this order, with the output removed and `sync` before each command:
# OLD unpack, NEW unpack, zstd -d (of each .zst in turn: a sharded checkpoint's shards),
# OLD verify, NEW verify. Prints every wall time, then
# the median and range of each command in seconds.
set -euo pipefail
old=$1 new=$2 zst=$4 rounds=${5:-7}
IFS=, read -r art new_art <<<"$3"
new_art=${new_art:-$art}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
t() { # LABEL CMD...: the wall time of CMD, appended to $out/LABEL
  local label=$1
  shift
  rm -rf "$out/w" && mkdir "$out/w"
  sync
  local t0=$EPOCHREALTIME
  "$@" >/dev/null 2>&1
  local t1=$EPOCHREALTIME
  awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.4f\n", b - a}' >>"$out/$label"
}
unzstd_all() {
  local i=0 z
  IFS=, read -ra zs <<<"$zst"
  for z in "${zs[@]}"; do
    i=$((i + 1))
    zstd -d -q -f "$z" -o "$out/w/o$i"
  done
}
for _ in $(seq "$rounds"); do
  t old-unpack "$old" unpack "$art" -o "$out/w/o"
  t new-unpack "$new" unpack "$new_art" -o "$out/w/o"
  t zstd-d unzstd_all
  t old-verify "$old" verify "$art"
  t new-verify "$new" verify "$new_art"
done
for label in old-unpack new-unpack zstd-d old-verify new-verify; do
  sort -n "$out/$label" | awk -v l="$label" '{v[NR]=$1} END {printf "%-11s median %.3f s (%.3f-%.3f):", l, v[int((NR+1)/2)], v[1], v[NR]; for (i=1;i<=NR;i++) printf " %.3f", v[i]; print ""}'
done
