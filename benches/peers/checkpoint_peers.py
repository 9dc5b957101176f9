"""Whole checkpoints: our CLI against zstd, zstandard and zipnn on the same safetensors files.

Run by `cargo xtask bench-checkpoint` (which builds `compressme` in release, makes the
peers' venv, the bf16 copy of MiniLM and, with --big, the 4 GiB sharded checkpoint):
    python checkpoint_peers.py COMPRESSME OUT.json CHECKPOINT [CHECKPOINT ...]

A CHECKPOINT is a .safetensors file or a folder of shards with its index JSON. For each,
in interleaved rounds (default 3; ROUNDS in the environment), on both cores, every process
reading from the page cache:
  - ours: the wall time of the `compressme pack --lossless`, `verify`, `verify --stored`
    and `unpack` processes and the peak resident memory of pack and unpack (from
    /usr/bin/time), the artifact's size over the dense bytes, and whether every unpacked
    tensor is byte-identical to the original (compared by SHA-256, a tensor at a time);
    then the same with `pack --coder huffman --tables 4` (Huffman tables only: the
    default until 2026-12-02, larger files, faster to decode);
  - the zstd command line: `zstd -3 -T2 -c` of every file (shard) into one file, and
    `zstd -d -c` of that into one file, as `pack` and `unpack` read and write;
  - zstandard (Python): level 3 with 2 threads over each whole file, and decompression,
    timed in this process from reading the input file to writing the output file;
  - zipnn 0.5.4 (single files only): its byte interface over the whole file (dtype from
    the file's largest tensor), compress and decompress, timed the same way, with the
    round trip checked.
Speeds are dense bytes (the tensors' bytes) over the median wall time; the JSON's `best`
and the last table give them over the best time as well (best of the rounds, the
statistic issue 14's own table used: on a shared machine the slowest runs measure the
neighbours, the fastest the program), with ours over the peer's in each statistic.
"""

import hashlib
import importlib.metadata
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import zstandard


def shards(path):
    """The safetensors files of a checkpoint (a file, or a folder with an index)."""
    if os.path.isdir(path):
        index = os.path.join(path, "model.safetensors.index.json")
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, f) for f in files]
    return [path]


def header(path):
    """The safetensors header's tensor entries, by name, and where the data starts."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        h = json.loads(f.read(n))
    h.pop("__metadata__", None)
    return h, 8 + n


def dense_bytes(path):
    return sum(v["data_offsets"][1] - v["data_offsets"][0]
               for s in shards(path) for v in header(s)[0].values())


def tensor_digests(path):
    """Every tensor's (dtype, shape, SHA-256), by name, reading one tensor at a time."""
    out = {}
    for s in shards(path):
        h, start = header(s)
        with open(s, "rb") as f:
            for k, v in h.items():
                a, b = v["data_offsets"]
                f.seek(start + a)
                out[k] = (v["dtype"], v["shape"], hashlib.sha256(f.read(b - a)).hexdigest())
    return out


def timed(fn):
    # the page cache is written back first (outside the timing), so that no command pays
    # for the writeback of the one before it (a 4 GiB `pack` leaves 2.9 GB of dirty pages)
    os.sync()
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def run(cmd, stdout=None, rss=False):
    """Wall time and, with `rss`, peak resident memory (bytes) of a process (its standard
    output written to the file `stdout`, if given). Only with `rss` does /usr/bin/time
    wrap the command: its own start is a millisecond of a 20 ms `verify`."""
    timer = rss and os.path.exists("/usr/bin/time")
    full = (["/usr/bin/time", "-f", "maxrss_kb=%M"] + cmd) if timer else cmd

    def go():
        if stdout is None:
            return subprocess.run(full, capture_output=True)
        with open(stdout, "wb") as out:
            return subprocess.run(full, stdout=out, stderr=subprocess.PIPE)

    t, p = timed(go)
    if p.returncode != 0:
        sys.exit(f"{cmd} failed: {p.stderr.decode()[-2000:]}")
    m = re.search(rb"maxrss_kb=(\d+)", p.stderr)
    return t, (int(m.group(1)) * 1024 if m else None)


def main():
    binary, out, paths = sys.argv[1], sys.argv[2], sys.argv[3:]
    rounds = int(os.environ.get("ROUNDS", "3"))
    work = tempfile.mkdtemp(prefix="cm-checkpoint-peers-", dir=os.environ.get("WORK_DIR"))
    results = []
    for path in paths:
        files = shards(path)
        dense = dense_bytes(path)
        size = sum(os.path.getsize(f) for f in files)
        largest = max((v for f in files for v in header(f)[0].values()),
                      key=lambda v: v["data_offsets"][1] - v["data_offsets"][0])
        largest_bytes = largest["data_offsets"][1] - largest["data_offsets"][0]
        dtype = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}.get(largest["dtype"], "float32")
        single = len(files) == 1 and not os.path.isdir(path)
        art = os.path.join(work, "a.cma")
        back = os.path.join(work, "back.safetensors")
        keys = ["pack", "verify", "verify_stored", "unpack", "pack_h", "verify_h", "unpack_h", "zstd_cli_c", "zstd_cli_d", "zstd_c", "zstd_d"]
        if single:
            keys += ["zipnn_c", "zipnn_d"]
        times = {k: [] for k in keys}
        rss = {"pack": [], "unpack": []}
        znn = os.path.join(work, "z.znn")
        nback = os.path.join(work, "z.znn.back")
        if single:
            from zipnn import ZipNN
            z = ZipNN(input_format="byte", bytearray_dtype=dtype, threads=2)
        ours_exact = None
        art_size = None
        zstd_exact = True
        cli_size = 0
        zst_size = 0
        for rnd in range(rounds):
            for key, cmd in [("pack", [binary, "pack", path, "--lossless", "-o", art]),
                             ("verify", [binary, "verify", art]),
                             ("verify_stored", [binary, "verify", "--stored", art]),
                             ("unpack", [binary, "unpack", art, "-o", back])]:
                t, m = run(cmd, rss=key in rss)
                times[key].append(t)
                if key in rss:
                    rss[key].append(m)
            art_size = os.path.getsize(art)
            if rnd == rounds - 1:
                ours_exact = tensor_digests(path) == tensor_digests(back)
            # outputs go as soon as they are measured: the 4 GiB checkpoint's fill the disk
            os.remove(back)
            os.remove(art)
            for key, cmd in [("pack_h", [binary, "pack", path, "--lossless", "--coder", "huffman",
                                          "--tables", "4", "-o", art]),
                             ("verify_h", [binary, "verify", art]),
                             ("unpack_h", [binary, "unpack", art, "-o", back])]:
                times[key].append(run(cmd)[0])
            art_size_h = os.path.getsize(art)
            if rnd == rounds - 1:
                ours_exact = ours_exact and tensor_digests(path) == tensor_digests(back)
            os.remove(back)
            os.remove(art)

            # every shard into one file and back into one file, as `pack` and `unpack` do:
            # shard by shard with a sync between, zstd -d wrote 2.15 GB at a time where
            # `unpack` writes 4.3 GB, past the kernel's dirty limit (BENCHMARKS, stop 52)
            zf = os.path.join(work, "cli.zst")
            # under /usr/bin/time as `pack` and `unpack` are, so both pay its start
            cli_c = run(["zstd", "-q", "-3", "-T2", "-c"] + files, stdout=zf, rss=True)[0]
            cli_size = os.path.getsize(zf)
            cli_d = run(["zstd", "-q", "-d", "-c", zf], stdout=zf + ".back", rss=True)[0]
            os.remove(zf + ".back")
            os.remove(zf)
            times["zstd_cli_c"].append(cli_c)
            times["zstd_cli_d"].append(cli_d)

            py_c = py_d = 0.0
            zst_size = 0
            for f in files:
                zf = os.path.join(work, "z.zst")

                def zc():
                    with open(f, "rb") as fh:
                        data = fh.read()
                    comp = zstandard.ZstdCompressor(level=3, threads=2).compress(data)
                    del data
                    with open(zf, "wb") as fh:
                        fh.write(comp)

                def zd():
                    with open(zf, "rb") as fh:
                        comp = fh.read()
                    data = zstandard.ZstdDecompressor().decompress(comp)
                    with open(zf + ".back", "wb") as fh:
                        fh.write(data)

                py_c += timed(zc)[0]
                zst_size += os.path.getsize(zf)
                py_d += timed(zd)[0]
                with open(zf + ".back", "rb") as a, open(f, "rb") as b:
                    zstd_exact = zstd_exact and hashlib.sha256(a.read()).digest() == hashlib.sha256(b.read()).digest()
                os.remove(zf + ".back")
                os.remove(zf)
            times["zstd_c"].append(py_c)
            times["zstd_d"].append(py_d)

            if single:
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
        med = {k: statistics.median(v) for k, v in times.items()}
        best = {k: min(v) for k, v in times.items()}
        r = {
            "checkpoint": path, "shards": len(files), "file_bytes": size, "dense_bytes": dense,
            "largest_tensor_bytes": largest_bytes, "rounds": rounds,
            "ours": {"file_over_dense": art_size / dense, "exact": ours_exact,
                     "pack_mb_s": dense / med["pack"] / 1e6, "verify_mb_s": dense / med["verify"] / 1e6,
                     "verify_stored_mb_s": dense / med["verify_stored"] / 1e6,
                     "unpack_mb_s": dense / med["unpack"] / 1e6,
                     "pack_peak_rss_bytes": max(rss["pack"]) if None not in rss["pack"] else None,
                     "unpack_peak_rss_bytes": max(rss["unpack"]) if None not in rss["unpack"] else None},
            "ours_huffman": {"file_over_dense": art_size_h / dense,
                             "pack_mb_s": dense / med["pack_h"] / 1e6,
                             "verify_mb_s": dense / med["verify_h"] / 1e6,
                             "unpack_mb_s": dense / med["unpack_h"] / 1e6},
            "zstd_cli_3_t2": {"file_over_dense": cli_size / dense,
                              "compress_mb_s": dense / med["zstd_cli_c"] / 1e6,
                              "decompress_mb_s": dense / med["zstd_cli_d"] / 1e6},
            "zstandard_3_t2": {"file_over_dense": zst_size / dense, "exact": zstd_exact,
                               "compress_mb_s": dense / med["zstd_c"] / 1e6,
                               "decompress_mb_s": dense / med["zstd_d"] / 1e6},
            "best": {"pack_mb_s": dense / best["pack"] / 1e6, "verify_mb_s": dense / best["verify"] / 1e6,
                     "unpack_mb_s": dense / best["unpack"] / 1e6,
                     "zstd_cli_compress_mb_s": dense / best["zstd_cli_c"] / 1e6,
                     "zstd_cli_decompress_mb_s": dense / best["zstd_cli_d"] / 1e6},
            "seconds": times,
        }
        if single:
            r["zipnn"] = {"file_over_dense": os.path.getsize(znn) / dense,
                          "exact": open(nback, "rb").read() == open(path, "rb").read(),
                          "compress_mb_s": dense / med["zipnn_c"] / 1e6,
                          "decompress_mb_s": dense / med["zipnn_d"] / 1e6}
            os.remove(nback)
        print(json.dumps(r), file=sys.stderr, flush=True)
        results.append(r)
        for f in os.listdir(work):
            os.remove(os.path.join(work, f))
    with open(out, "w") as f:
        json.dump({"versions": {"zstandard": zstandard.__version__, "zipnn": importlib.metadata.version("zipnn"),
                                "numpy": np.__version__,
                                "zstd": subprocess.run(["zstd", "-V"], capture_output=True, text=True).stdout.strip()},
                   "results": results}, f, indent=2)
    print("| checkpoint | ours: file / dense | pack | verify | verify --stored | unpack | pack / unpack peak RSS "
          "| zstd -3 -T2: size | compress | zstd -d | zipnn: size | compress | decompress |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        o, c = r["ours"], r["zstd_cli_3_t2"]
        n = r.get("zipnn")
        mark = lambda d: "" if d["exact"] else " (not exact)"
        mb = lambda b: f"{b / 1e6:.0f} MB" if b else "n/a"
        zipnn = (f"{n['file_over_dense']:.4f}{mark(n)} | {n['compress_mb_s']:.0f} MB/s | {n['decompress_mb_s']:.0f} MB/s"
                 if n else "not run | | ")
        print(f"| {os.path.basename(r['checkpoint'].rstrip('/'))} | {o['file_over_dense']:.4f}{mark(o)} "
              f"| {o['pack_mb_s']:.0f} MB/s | {o['verify_mb_s']:.0f} MB/s | {o['verify_stored_mb_s']:.0f} MB/s "
              f"| {o['unpack_mb_s']:.0f} MB/s | {mb(o['pack_peak_rss_bytes'])} / {mb(o['unpack_peak_rss_bytes'])} "
              f"| {c['file_over_dense']:.4f} | {c['compress_mb_s']:.0f} MB/s | {c['decompress_mb_s']:.0f} MB/s "
              f"| {zipnn} |")
    print()
    print("| checkpoint | `--coder huffman --tables 4`: file / dense | pack | verify | unpack |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in results:
        h = r["ours_huffman"]
        print(f"| {os.path.basename(r['checkpoint'].rstrip('/'))} | {h['file_over_dense']:.4f} "
              f"| {h['pack_mb_s']:.0f} MB/s | {h['verify_mb_s']:.0f} MB/s | {h['unpack_mb_s']:.0f} MB/s |")
    print()
    print("| checkpoint | pack / zstd -3 -T2: median, best | unpack / zstd -d: median, best "
          "| verify: median, best |")
    print("| --- | ---: | ---: | ---: |")
    for r in results:
        o, c, b = r["ours"], r["zstd_cli_3_t2"], r["best"]
        print(f"| {os.path.basename(r['checkpoint'].rstrip('/'))} "
              f"| {o['pack_mb_s'] / c['compress_mb_s']:.2f}x, {b['pack_mb_s'] / b['zstd_cli_compress_mb_s']:.2f}x "
              f"| {o['unpack_mb_s'] / c['decompress_mb_s']:.2f}x, "
              f"{b['unpack_mb_s'] / b['zstd_cli_decompress_mb_s']:.2f}x "
              f"| {o['verify_mb_s']:.0f}, {b['verify_mb_s']:.0f} MB/s |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
