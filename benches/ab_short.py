"""Short commands (tens of milliseconds) against each other, interleaved many times:

    python3 benches/ab_short.py ROUNDS CMD1 ';;' CMD2 [';;' CMD3 ...]

Each round runs every command once, in order (no shell: each is split on spaces), output
discarded. Prints each command's minimum, 10th and 25th percentiles and median wall time,
measured around the child process (a Python `subprocess.run`, whose own start adds about
half a millisecond to every command alike). On a noisy machine the low percentiles move
less than the median: compare commands within one run.
"""

import subprocess
import sys
import time


def main():
    rounds = int(sys.argv[1])
    cmds = [c.split() for c in " ".join(sys.argv[2:]).split(";;")]
    times = [[] for _ in cmds]
    for _ in range(rounds):
        for cmd, ts in zip(cmds, times):
            t0 = time.perf_counter()
            subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
            ts.append(time.perf_counter() - t0)
    for cmd, ts in zip(cmds, times):
        ts.sort()
        q = lambda p: ts[int(p * (len(ts) - 1))] * 1e3  # noqa: E731
        print(f"{' '.join(cmd)[:60]:60s} min {q(0):.2f}  p10 {q(.1):.2f}  p25 {q(.25):.2f}  median {q(.5):.2f} ms")


if __name__ == "__main__":
    main()
