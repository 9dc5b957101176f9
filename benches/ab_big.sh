#!/usr/bin/env bash
# One round of pack, verify and unpack of the 4 GiB checkpoint (`cargo xtask bigcheckpoint`
# writes it) with the compressme binary BINARY, each command's wall time in seconds and the
# page cache's dirty bytes after `unpack`; outputs removed after. Alternate two builds:
#   for i in 1 2 3; do benches/ab_big.sh /tmp/cm_old; benches/ab_big.sh target/release/compressme; done
set -euo pipefail
cd "$(dirname "$0")/.."
b=$1
w=target/abw
mkdir -p "$w"
now() { date +%s.%N; }
t0=$(now); "$b" pack target/bench/big/model.safetensors.index.json --lossless -o "$w/a.cma" > /dev/null
t1=$(now); "$b" verify "$w/a.cma" > /dev/null
t2=$(now); "$b" unpack "$w/a.cma" -o "$w/back.safetensors" > /dev/null
t3=$(now); dirty=$(awk '/^Dirty:/ {print $2}' /proc/meminfo)
rm -f "$w/a.cma" "$w/back.safetensors"
python3 -c "import sys; t=[float(v) for v in sys.argv[1:5]]; print(f'{sys.argv[5]}: pack {t[1]-t[0]:.2f} s, verify {t[2]-t[1]:.2f} s, unpack {t[3]-t[2]:.2f} s, dirty after unpack {int(sys.argv[6]) // 1024} MB')" \
  "$t0" "$t1" "$t2" "$t3" "$b" "$dirty"
