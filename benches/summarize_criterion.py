"""Prints a markdown table of criterion's median estimates (target/criterion/**/new/).

    python3 benches/summarize_criterion.py [target/criterion]
"""
import json
import pathlib
import sys

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "target/criterion")
print("| benchmark | median | throughput |")
print("| --- | --- | --- |")
for bench in sorted(root.glob("**/new/benchmark.json")):
    meta = json.loads(bench.read_text())
    est = json.loads((bench.parent / "estimates.json").read_text())
    ns = est["median"]["point_estimate"]
    tp = meta.get("throughput") or {}
    thr = ""
    if "Bytes" in tp:
        thr = f"{tp['Bytes'] / ns:.2f} GB/s"
    t = f"{ns / 1e6:.3f} ms" if ns >= 1e5 else f"{ns / 1e3:.1f} µs"
    print(f"| {meta['full_id']} | {t} | {thr} |")
