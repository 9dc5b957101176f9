"""Renders the lossless tables of docs/BENCHMARKS.md from one run's JSON reports.

    python3 benches/peers/lossless_tables.py target/bench/lossless-ours.json target/bench/lossless-peers.json

Standard library only, so it runs with any python3.
"""

import json
import sys


def f(x, nd=4):
    return f"{x:.{nd}f}"


def coder_name(r):
    c = r["coder"]
    name = (c.replace("SharedHuffman { max_tables: ", "Huffman, ")
            .replace("SharedRans { max_tables: ", "rANS or Huffman, ")
            .replace("Zstd { level: ", "zstd ").rstrip(" }"))
    if "Huffman" in name:
        name += " table" if name.endswith(" 1") else " tables"
    return name + (", row index" if r.get("row_index") else "")


def main():
    ours = json.load(open(sys.argv[1]))
    peers = json.load(open(sys.argv[2])) if len(sys.argv) > 2 else None
    kinds = {"F32": "f32", "Bf16": "bf16"}

    print("### Ours: stored / dense, and one-thread speeds\n")
    print("Stored bytes count everything kept: payload, block lengths, SHA-256 digests, code tables, header.")
    print("Encode includes planes, clustering, coding and SHA-256 of every block, and the round-trip check; decode excludes hashing.\n")
    print("| table | block rows | coder | stored / dense | encode MB/s | decode MB/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in ours["ours"]:
        print(f"| {kinds[r['kind']]} | {r['block_rows']} | {coder_name(r)} | {f(r['ratio'])} | "
              f"{r['encode_mb_s_1t']:.0f} | {r['decode_mb_s_1t']:.0f} |")

    print("\n### The seed's recipe (shuffle a 16-row block, one zstd frame over it)\n")
    print("| table | zstd level | payload / dense | with 8-byte offsets and 32-byte digests | encode MB/s |")
    print("| --- | --- | --- | --- | --- |")
    for s in ours["seed_recipe"]:
        r = s["result"]
        print(f"| {kinds[s['kind']]} | {r['level']} | {f(r['ratio_payload_only'])} | "
              f"{f(r['ratio_with_offsets_and_digests'])} | {r['encode_mb_s_1t']:.0f} |")

    if peers:
        print("\n### Peers on the same bytes, same run, one thread\n")
        print("| table | peer | setting | compressed / dense | compress MB/s | decompress MB/s | exact round trip |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for kind, rs in peers["results"].items():
            for r in rs:
                setting = ", ".join(f"{k} {r[k]}" for k in ("level", "clevel", "block_rows") if k in r)
                exact = "yes" if r["roundtrip_exact"] else f"**no**: {r['differing_bytes']:,} bytes differ"
                print(f"| {kind} | {r['peer']} | {setting} | {f(r['ratio'])} | {r['compress_mb_s']:.0f} | "
                      f"{r['decompress_mb_s']:.0f} | {exact} |")
        print(f"\nVersions: {peers['versions']}.")

    print("\n### Lookups: 32 x 128 ids, time relative to candle's `index_select` in the same loop (one thread)\n")
    print("| table | ids | layout | packed ms | index_select ms | packed / index_select |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in ours["lookups"]:
        layout = "row index" if r["row_index"] else "compact"
        print(f"| {r['dtype'].lower()} | {r['ids']} | {layout} | {r['packed_ms']:.2f} | {r['index_select_ms']:.2f} | "
              f"{r['ratio']:.1f}x |")

    print(f"\nHashing (SHA-256 of every stored block, MB/s of stored bytes, best of 3): `verify_all` on one thread "
          f"{ours['sha256_mb_s_1t']:.0f} MB/s, on both cores {ours['verify_all_mb_s_all_cores']:.0f} MB/s.")


if __name__ == "__main__":
    main()
