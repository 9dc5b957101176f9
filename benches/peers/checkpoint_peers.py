"""Whole checkpoints: our CLI against zstandard and zipnn on the same safetensors files.

Run by `cargo xtask bench-checkpoint` (which builds `compressme` in release, makes the
peers' venv and the bf16 copy of MiniLM):
    python checkpoint_peers.py COMPRESSME OUT.json FILE.safetensors [FILE ...]

For each file, in interleaved rounds (default 3), on both cores:
  - ours: the wall time of the `compressme pack --lossless`, `verify` and `unpack`
    processes (reading from the page cache), the artifact's size over the dense bytes,
    and whether every unpacked tensor is byte-identical to the original;
  - zstandard: level 3 with 2 threads over the whole file, and decompression, timed in
    this process from reading the input file to writing the output file;
  - zipnn 0.5.4: its byte interface over the whole file (dtype from the file's largest
    tensor), compress and decompress, timed the same way, with the round trip checked.
Speeds are dense bytes (the tensors' bytes) over the median wall time.
"""

import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import zstandard


def header(path):
    """The safetensors header's tensor entries, by name."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        h = json.loads(f.read(n))
    h.pop("__metadata__", None)
    return h


def dense_bytes(path):
    return sum(v["data_offsets"][1] - v["data_offsets"][0] for v in header(path).values())


def tensors(path):
    """Every tensor's (dtype, shape, bytes), by name."""
    with open(path, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    data = raw[8 + n:]
    return {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in header(path).items()}


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def run(cmd):
    t, p = timed(lambda: subprocess.run(cmd, capture_output=True))
    if p.returncode != 0:
        sys.exit(f"{cmd} failed: {p.stderr.decode()[-2000:]}")
    return t


def main():
    binary, out, files = sys.argv[1], sys.argv[2], sys.argv[3:]
    rounds = int(os.environ.get("ROUNDS", "3"))
    work = tempfile.mkdtemp(prefix="cm-checkpoint-peers-")
    results = []
    for path in files:
        dense = dense_bytes(path)
        size = os.path.getsize(path)
        largest = max(header(path).values(), key=lambda v: v["data_offsets"][1] - v["data_offsets"][0])
        dtype = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}.get(largest["dtype"], "float32")
        art = os.path.join(work, "a.cma")
        back = os.path.join(work, "back.safetensors")
        zst = os.path.join(work, "z.zst")
        zback = os.path.join(work, "z.back")
        znn = os.path.join(work, "z.znn")
        nback = os.path.join(work, "z.znn.back")
        times = {k: [] for k in ["pack", "verify", "unpack", "zstd_c", "zstd_d", "zipnn_c", "zipnn_d"]}
        from zipnn import ZipNN
        z = ZipNN(input_format="byte", bytearray_dtype=dtype, threads=2)
        for _ in range(rounds):
            times["pack"].append(run([binary, "pack", path, "--lossless", "-o", art]))
            times["verify"].append(run([binary, "verify", art]))
            times["unpack"].append(run([binary, "unpack", art, "-o", back]))

            def zc():
                with open(path, "rb") as f:
                    data = f.read()
                comp = zstandard.ZstdCompressor(level=3, threads=2).compress(data)
                with open(zst, "wb") as f:
                    f.write(comp)

            def zd():
                with open(zst, "rb") as f:
                    comp = f.read()
                data = zstandard.ZstdDecompressor().decompress(comp)
                with open(zback, "wb") as f:
                    f.write(data)

            times["zstd_c"].append(timed(zc)[0])
            times["zstd_d"].append(timed(zd)[0])

            def nc():
                with open(path, "rb") as f:
                    data = f.read()
                comp = z.compress(data)
                with open(znn, "wb") as f:
                    f.write(comp)

            def nd():
                with open(znn, "rb") as f:
                    comp = f.read()
                data = z.decompress(comp)
                with open(nback, "wb") as f:
                    f.write(bytes(data))

            times["zipnn_c"].append(timed(nc)[0])
            times["zipnn_d"].append(timed(nd)[0])
        original = open(path, "rb").read()
        ours_exact = tensors(path) == tensors(back)
        zstd_exact = open(zback, "rb").read() == original
        zipnn_exact = open(nback, "rb").read() == original
        med = {k: statistics.median(v) for k, v in times.items()}
        r = {
            "file": path, "file_bytes": size, "dense_bytes": dense, "rounds": rounds,
            "ours": {"file_over_dense": os.path.getsize(art) / dense, "exact": ours_exact,
                     "pack_mb_s": dense / med["pack"] / 1e6, "verify_mb_s": dense / med["verify"] / 1e6,
                     "unpack_mb_s": dense / med["unpack"] / 1e6},
            "zstd_3_t2": {"file_over_dense": os.path.getsize(zst) / dense, "exact": zstd_exact,
                          "compress_mb_s": dense / med["zstd_c"] / 1e6,
                          "decompress_mb_s": dense / med["zstd_d"] / 1e6},
            "zipnn": {"file_over_dense": os.path.getsize(znn) / dense, "exact": zipnn_exact,
                      "compress_mb_s": dense / med["zipnn_c"] / 1e6,
                      "decompress_mb_s": dense / med["zipnn_d"] / 1e6},
            "seconds": times,
        }
        print(json.dumps(r), file=sys.stderr, flush=True)
        results.append(r)
    with open(out, "w") as f:
        json.dump({"versions": {"zstandard": zstandard.__version__, "zipnn": importlib.metadata.version("zipnn"),
                                "numpy": np.__version__},
                   "results": results}, f, indent=2)
    print("| file | ours: file / dense | pack | verify | unpack | zstd -3 T2: size | compress | decompress "
          "| zipnn: size | compress | decompress |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        o, s, n = r["ours"], r["zstd_3_t2"], r["zipnn"]
        mark = lambda d: "" if d["exact"] else " (not exact)"
        print(f"| {os.path.basename(r['file'])} | {o['file_over_dense']:.4f}{mark(o)} | {o['pack_mb_s']:.0f} MB/s "
              f"| {o['verify_mb_s']:.0f} MB/s | {o['unpack_mb_s']:.0f} MB/s | {s['file_over_dense']:.4f}{mark(s)} "
              f"| {s['compress_mb_s']:.0f} MB/s | {s['decompress_mb_s']:.0f} MB/s | {n['file_over_dense']:.4f}{mark(n)} "
              f"| {n['compress_mb_s']:.0f} MB/s | {n['decompress_mb_s']:.0f} MB/s |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
