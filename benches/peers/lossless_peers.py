"""Lossless peers on the same bytes as our lossless-report, one thread each.

Run by `cargo xtask bench-lossless` (which makes a venv with the pinned peers):
    python lossless_peers.py MODEL.safetensors OUT.json

Measures, on all-MiniLM-L6-v2's word-embedding table (f32, and rounded to bf16 with
round-to-nearest-even, the same rounding as the Rust report):
  - zstandard: plain zstd over the whole tensor (no shuffle), levels 3 and 19;
  - blosc2: shuffle + zstd, split streams, 16-row blocks (our default), clevel 5 and 9; and
    clevel 9 at 4-, 64- and 256-row blocks (our other sizes);
  - zipnn: whole tensor (its default 256 KiB chunks, no random access), and called once
    per 16-row block (what row-block granularity would cost it).
Ratios are compressed bytes / dense bytes; speeds are MB/s of dense bytes, best of 3.
Every round trip is checked: `roundtrip_exact` says whether the original bytes came back,
`differing_bytes` how many did not (zipnn 0.5.4 fails this on this table).
"""

import importlib.metadata
import json
import sys
import time

import blosc2
import numpy as np
import zstandard
from safetensors.numpy import load_file

BLOCK_ROWS = 16


def exactness(back, data):
    """Whether the round trip returned the original bytes, and how many differ."""
    back = bytes(back)
    if back == data:
        return {"roundtrip_exact": True, "differing_bytes": 0}
    a = np.frombuffer(back, np.uint8)
    b = np.frombuffer(data, np.uint8)
    n = min(len(a), len(b))
    return {"roundtrip_exact": False, "differing_bytes": int((a[:n] != b[:n]).sum()) + abs(len(a) - len(b))}


def best_time(fn, reps=3):
    best = float("inf")
    out = None
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def mbps(n, secs):
    return n / secs / 1e6


def zstd_plain(data, level):
    c = zstandard.ZstdCompressor(level=level, threads=0)
    d = zstandard.ZstdDecompressor()
    tc, comp = best_time(lambda: c.compress(data), reps=1 if level > 9 else 3)
    td, back = best_time(lambda: d.decompress(comp))
    return {"peer": "zstandard (no shuffle, whole tensor)", "level": level, "ratio": len(comp) / len(data),
            "compress_mb_s": mbps(len(data), tc), "decompress_mb_s": mbps(len(data), td), **exactness(back, data)}


def blosc(data, typesize, row_bytes, clevel, block_rows=BLOCK_ROWS):
    blosc2.set_nthreads(1)
    blocksize = block_rows * row_bytes
    kw = dict(typesize=typesize, clevel=clevel, codec=blosc2.Codec.ZSTD, filters=[blosc2.Filter.SHUFFLE],
              splitmode=blosc2.SplitMode.ALWAYS_SPLIT, blocksize=blocksize)
    # one chunk holds at most 2 GiB; this table fits
    tc, comp = best_time(lambda: blosc2.compress2(data, **kw), reps=1 if clevel > 5 else 3)
    td, back = best_time(lambda: blosc2.decompress2(comp))
    return {"peer": "blosc2 (shuffle + zstd, split streams)", "clevel": clevel, "block_rows": block_rows,
            "ratio": len(comp) / len(data), "compress_mb_s": mbps(len(data), tc),
            "decompress_mb_s": mbps(len(data), td), **exactness(back, data)}


def zipnn_whole(data, dtype):
    from zipnn import ZipNN
    z = ZipNN(input_format="byte", bytearray_dtype=dtype, threads=1)
    tc, comp = best_time(lambda: z.compress(data))
    td, back = best_time(lambda: z.decompress(comp))
    return {"peer": "zipnn (whole tensor)", "ratio": len(comp) / len(data), "compress_mb_s": mbps(len(data), tc),
            "decompress_mb_s": mbps(len(data), td), **exactness(back, data)}


def zipnn_blocks(data, dtype, row_bytes):
    from zipnn import ZipNN
    z = ZipNN(input_format="byte", bytearray_dtype=dtype, threads=1)
    step = BLOCK_ROWS * row_bytes
    blocks = [data[i:i + step] for i in range(0, len(data), step)]
    tc, comp = best_time(lambda: [z.compress(b) for b in blocks], reps=1)
    td, back = best_time(lambda: [z.decompress(c) for c in comp], reps=1)
    return {"peer": "zipnn (one call per 16-row block)", "ratio": sum(map(len, comp)) / len(data),
            "compress_mb_s": mbps(len(data), tc), "decompress_mb_s": mbps(len(data), td),
            **exactness(b"".join(bytes(b) for b in back), data)}


def main():
    model, out = sys.argv[1], sys.argv[2]
    w = load_file(model)["embeddings.word_embeddings.weight"]
    u = np.ascontiguousarray(w).view(np.uint32)
    bf16 = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    rows, cols = w.shape
    results = {}
    for name, arr, typesize, dtype in [("f32", u, 4, "float32"), ("bf16", bf16, 2, "bfloat16")]:
        data = arr.tobytes()
        row_bytes = cols * typesize
        rs = []
        for level in (3, 19):
            rs.append(zstd_plain(data, level))
        for clevel in (5, 9):
            rs.append(blosc(data, typesize, row_bytes, clevel))
        for block_rows in (4, 64, 256):
            rs.append(blosc(data, typesize, row_bytes, 9, block_rows))
        rs.append(zipnn_whole(data, dtype))
        rs.append(zipnn_blocks(data, dtype, row_bytes))
        for r in rs:
            print(name, json.dumps(r), file=sys.stderr, flush=True)
        results[name] = rs
    with open(out, "w") as f:
        json.dump({"table": "embeddings.word_embeddings.weight", "rows": rows, "cols": cols,
                   "versions": {"zstandard": zstandard.__version__, "blosc2": blosc2.__version__,
                                "zipnn": importlib.metadata.version("zipnn"), "numpy": np.__version__},
                   "results": results}, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
