"""Extract Jane Austen's six novels from Debian's r-cran-janeaustenr package, without R.

usage: austen.py DATA_DIR OUT_DIR

DATA_DIR is usr/lib/R/site-library/janeaustenr/data of the unpacked package. R keeps the
novels in a lazy-load database: Rdata.rdx (gzip, R's XDR serialization) maps each
variable name to (offset, length) in Rdata.rdb, where each record is a 4-byte
big-endian length followed by a zlib stream of one serialized character vector (one
string a line of the novel). Each novel is written to OUT_DIR/NAME.txt, its lines joined
by "\n" with a final newline. Only the standard library is used.
"""
import gzip
import struct
import sys
import zlib
from pathlib import Path


class Xdr:
    """The subset of R's XDR serialization these files use."""

    def __init__(self, data):
        self.d = data
        self.i = 0
        self.refs = []

    def int(self):
        (v,) = struct.unpack_from(">i", self.d, self.i)
        self.i += 4
        return v

    def header(self):
        if self.d[:2] != b"X\n":
            raise ValueError("not an XDR serialization")
        self.i = 2
        version = self.int()
        self.int()  # writer's R version
        self.int()  # minimal reader version
        if version == 3:
            n = self.int()
            self.i += n  # native encoding
        return self.item()

    def item(self):
        flags = self.int()
        kind = flags & 0xFF
        has_attr = bool(flags & (1 << 9))
        has_tag = bool(flags & (1 << 10))
        if kind == 254:  # NILVALUE_SXP
            return None
        if kind == 255:  # REFSXP
            return self.refs[(flags >> 8) - 1]
        if kind == 1:  # SYMSXP
            name = self.item()
            self.refs.append(name)
            return name
        if kind == 9:  # CHARSXP
            n = self.int()
            if n == -1:
                return None
            s = self.d[self.i : self.i + n].decode("utf-8")
            self.i += n
            return s
        if kind == 2:  # LISTSXP (pairlist): attributes, tag, value, rest
            out = []
            while True:
                attr = self.item() if has_attr else None
                tag = self.item() if has_tag else None
                out.append((tag, self.item()))
                flags = self.int()
                if flags & 0xFF == 254:
                    return out
                if flags & 0xFF != 2:
                    raise ValueError(f"pairlist continues with type {flags & 0xFF}")
                has_attr = bool(flags & (1 << 9))
                has_tag = bool(flags & (1 << 10))
        if kind in (10, 13):  # LGLSXP, INTSXP
            n = self.int()
            v = [self.int() for _ in range(n)]
        elif kind in (16, 19):  # STRSXP, VECSXP
            n = self.int()
            v = [self.item() for _ in range(n)]
        else:
            raise ValueError(f"unsupported R type {kind} at byte {self.i}")
        if has_attr:
            attrs = dict(self.item())
            if "names" in attrs:
                return dict(zip(attrs["names"], v))
        return v


def main():
    data, out = Path(sys.argv[1]), Path(sys.argv[2])
    index = Xdr(gzip.decompress((data / "Rdata.rdx").read_bytes())).header()
    variables = dict(index)["variables"] if isinstance(index, list) else index["variables"]
    rdb = (data / "Rdata.rdb").read_bytes()
    out.mkdir(parents=True, exist_ok=True)
    for name, (offset, length) in sorted(variables.items()):
        record = rdb[offset : offset + length]
        (size,) = struct.unpack_from(">I", record, 0)
        raw = zlib.decompress(record[4:])
        if len(raw) != size:
            raise ValueError(f"{name}: {len(raw)} bytes decompressed, record says {size}")
        lines = Xdr(raw).header()
        text = "\n".join(l if l is not None else "" for l in lines) + "\n"
        (out / f"{name}.txt").write_text(text, encoding="utf-8")
        print(f"{name}: {len(lines)} lines, {len(text.encode())} bytes")


if __name__ == "__main__":
    main()
