#!/usr/bin/env python3
"""Extract character vectors from an R lazy-load database (.rdb/.rdx).

A small, self-contained decoder of R's serialization format (XDR, versions 2
and 3), written against the Python standard library only. It exists so that
the evaluation corpus can be rebuilt from the Debian package
``r-cran-janeaustenr`` without installing R.

Layout of a lazy-load database:

* ``NAME.rdx`` is an ``saveRDS`` file (gzip-, bzip2-, xz-compressed or plain)
  holding ``list(variables = <named list of c(offset, length)>,
  references = ..., compressed = TRUE|2|3)``.
* ``NAME.rdb`` is the concatenation of the serialized objects. The bytes at
  ``[offset, offset + length)`` are: a 4-byte big-endian uncompressed length,
  then (for ``compressed = TRUE``) a zlib stream, or (for ``2``/``3``) a
  one-byte type tag (``'0'`` none, ``'2'`` bzip2, ``'Z'`` xz, ``'1'`` zlib)
  followed by the payload.

Only what is needed for data sets is supported: vectors (logical, integer,
double, complex, character, raw, list), pairlists, symbols, attributes,
references and the ``NULL``/global-environment specials. Closures, byte code,
environments other than the specials, and ALTREP objects other than the
``wrap_*``/``compact_*seq``/``deferred_string`` classes raise ``RDecodeError``.

Usage::

    rdb_extract.py DB_PREFIX NAME [NAME ...] > out.txt

writes each named character vector's elements joined with ``"\\n"`` (one
element per line, vectors in the given order, ``NA`` elements as empty
lines). ``DB_PREFIX`` is the path without ``.rdb``/``.rdx``.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import struct
import sys
import zlib

# SEXP types (Rinternals.h) and serialization pseudo-types (serialize.c).
NILSXP, SYMSXP, LISTSXP, CLOSXP, ENVSXP, PROMSXP, LANGSXP = 0, 1, 2, 3, 4, 5, 6
CHARSXP, LGLSXP, INTSXP, REALSXP, CPLXSXP, STRSXP = 9, 10, 13, 14, 15, 16
DOTSXP, VECSXP, EXPRSXP, RAWSXP, S4SXP = 17, 19, 20, 24, 25
REFSXP, NILVALUE_SXP, GLOBALENV_SXP, UNBOUNDVALUE_SXP = 255, 254, 253, 252
MISSINGARG_SXP, BASENAMESPACE_SXP, NAMESPACESXP, PACKAGESXP = 251, 250, 249, 248
PERSISTSXP, EMPTYENV_SXP, BASEENV_SXP = 247, 242, 241
ATTRLANGSXP, ATTRLISTSXP, ALTREP_SXP = 240, 239, 238

NA_INTEGER = -(2**31)
# CHARSXP encoding bits (in the "levels" field of the flags word).
LATIN1_MASK, UTF8_MASK, BYTES_MASK, ASCII_MASK = 1 << 2, 1 << 3, 1 << 1, 1 << 6


class RDecodeError(Exception):
    """The input is not R serialization this decoder understands."""


class Special:
    """A serialization special value such as ``R_GlobalEnv``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


NULL = None


class RObject:
    """A decoded R object: ``kind`` (SEXP type), ``value`` and ``attrs``."""

    def __init__(self, kind: int, value, attrs: dict | None = None) -> None:
        self.kind = kind
        self.value = value
        self.attrs = attrs or {}

    def __repr__(self) -> str:
        return f"RObject(kind={self.kind}, len={len(self.value) if hasattr(self.value, '__len__') else '-'})"

    def names(self) -> list | None:
        """The ``names`` attribute as a list of str, if present."""
        n = self.attrs.get("names")
        return n.value if isinstance(n, RObject) else None


class Reader:
    """Decoder over one serialized stream (XDR format only)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0
        self.refs: list = []

    # ---- primitives -------------------------------------------------------
    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise RDecodeError(f"truncated input: need {n} bytes at offset {self.pos}")
        b = self.data[self.pos : self.pos + n]
        self.pos += n
        return b

    def int(self) -> int:
        return struct.unpack(">i", self.take(4))[0]

    def length(self) -> int:
        n = self.int()
        if n == -1:  # long vector: two more ints, upper then lower 32 bits
            hi, lo = self.int(), self.int()
            n = (hi << 32) + (lo & 0xFFFFFFFF)
        if n < 0:
            raise RDecodeError(f"negative length {n}")
        # Every element needs at least one byte; reject absurd lengths early.
        if n > len(self.data) - self.pos:
            raise RDecodeError(f"length {n} exceeds remaining input")
        return n

    # ---- header -----------------------------------------------------------
    def header(self) -> None:
        fmt = self.take(2)
        if fmt != b"X\n":
            raise RDecodeError(f"unsupported serialization format {fmt!r} (only XDR 'X\\n')")
        version = self.int()
        self.int()  # writer R version
        self.int()  # minimal reader R version
        if version == 3:
            nelen = self.int()
            self.take(nelen)  # native encoding name
        elif version != 2:
            raise RDecodeError(f"unsupported serialization version {version}")

    # ---- items ------------------------------------------------------------
    def string_vec(self) -> list:
        """InStringVec: used by PERSISTSXP, PACKAGESXP and NAMESPACESXP."""
        if self.int() != 0:
            raise RDecodeError("names in persistent strings are not supported")
        n = self.length()
        return [self.item() for _ in range(n)]

    def attributes(self) -> dict:
        """Read a pairlist of attributes into a dict keyed by tag name."""
        pl = self.item()
        out = {}
        while isinstance(pl, RObject) and pl.kind == LISTSXP:
            tag, car, cdr = pl.value
            out[tag if isinstance(tag, str) else repr(tag)] = car
            pl = cdr
        return out

    def item(self):
        flags = self.int()
        typ = flags & 0xFF
        levels = flags >> 12
        has_attr = bool(flags & (1 << 9))
        has_tag = bool(flags & (1 << 10))

        if typ == NILVALUE_SXP:
            return NULL
        if typ in (EMPTYENV_SXP, BASEENV_SXP, GLOBALENV_SXP, UNBOUNDVALUE_SXP,
                   MISSINGARG_SXP, BASENAMESPACE_SXP):
            return Special({EMPTYENV_SXP: "emptyenv", BASEENV_SXP: "baseenv",
                            GLOBALENV_SXP: "globalenv", UNBOUNDVALUE_SXP: "unbound",
                            MISSINGARG_SXP: "missingarg",
                            BASENAMESPACE_SXP: "basenamespace"}[typ])
        if typ == REFSXP:
            idx = flags >> 8
            if idx == 0:
                idx = self.int()
            if not 1 <= idx <= len(self.refs):
                raise RDecodeError(f"bad reference index {idx}")
            return self.refs[idx - 1]
        if typ == PERSISTSXP:
            obj = Special("persist:" + ",".join(map(str, self.string_vec())))
            self.refs.append(obj)
            return obj
        if typ == SYMSXP:
            name = self.item()  # a CHARSXP, decoded to str
            self.refs.append(name)
            return name
        if typ in (PACKAGESXP, NAMESPACESXP):
            obj = Special(("package:" if typ == PACKAGESXP else "namespace:")
                          + ",".join(map(str, self.string_vec())))
            self.refs.append(obj)
            return obj
        if typ == ENVSXP:
            raise RDecodeError("environments are not supported")
        if typ in (LISTSXP, LANGSXP, CLOSXP, PROMSXP, DOTSXP, ATTRLANGSXP, ATTRLISTSXP):
            attrs = self.attributes() if has_attr else {}
            tag = self.item() if has_tag else None
            car = self.item()
            cdr = self.item()
            kind = LISTSXP if typ in (LISTSXP, ATTRLISTSXP) else typ
            return RObject(kind, (tag, car, cdr), attrs)
        if typ == ALTREP_SXP:
            return self.altrep()

        if typ == CHARSXP:
            n = self.int()
            if n == -1:
                return None  # NA_STRING
            if n < 0:
                raise RDecodeError(f"negative CHARSXP length {n}")
            raw = self.take(n)
            if levels & LATIN1_MASK:
                return raw.decode("latin-1")
            if levels & BYTES_MASK:
                return raw.decode("latin-1")  # bytes: no declared encoding
            # UTF-8, ASCII or native (the stream declares UTF-8 here).
            return raw.decode("utf-8")
        if typ in (LGLSXP, INTSXP):
            n = self.length()
            vals = list(struct.unpack(f">{n}i", self.take(4 * n)))
            val = [None if v == NA_INTEGER else v for v in vals]
        elif typ == REALSXP:
            n = self.length()
            val = list(struct.unpack(f">{n}d", self.take(8 * n)))
        elif typ == CPLXSXP:
            n = self.length()
            d = struct.unpack(f">{2 * n}d", self.take(16 * n))
            val = [complex(d[2 * i], d[2 * i + 1]) for i in range(n)]
        elif typ == STRSXP:
            n = self.length()
            val = [self.item() for _ in range(n)]
        elif typ in (VECSXP, EXPRSXP):
            n = self.length()
            val = [self.item() for _ in range(n)]
        elif typ == RAWSXP:
            n = self.length()
            val = self.take(n)
        elif typ == S4SXP:
            val = None
        else:
            raise RDecodeError(f"unsupported SEXP type {typ}")
        attrs = self.attributes() if has_attr else {}
        return RObject(typ, val, attrs)

    def altrep(self) -> RObject:
        info = self.item()
        state = self.item()
        attr = self.item()
        cls = None
        if isinstance(info, RObject) and info.kind == LISTSXP:
            cls = info.value[1]  # class symbol name
        attrs = {}
        while isinstance(attr, RObject) and attr.kind == LISTSXP:
            tag, car, cdr = attr.value
            attrs[tag] = car
            attr = cdr
        if cls in ("compact_intseq", "compact_realseq"):
            n, start, step = (int(x) if cls == "compact_intseq" else x for x in state.value)
            n = int(n)
            kind = INTSXP if cls == "compact_intseq" else REALSXP
            return RObject(kind, [start + i * step for i in range(n)], attrs)
        if isinstance(cls, str) and cls.startswith("wrap_"):
            inner = state.value[0]
            return RObject(inner.kind, inner.value, attrs or inner.attrs)
        if cls == "deferred_string":
            arg = state.value[1] if isinstance(state.value, tuple) else state
            inner = arg.value[1] if isinstance(arg, RObject) and arg.kind == LISTSXP else arg
            vals = inner.value if isinstance(inner, RObject) else []
            return RObject(STRSXP, [_num_to_str(v) for v in vals], attrs)
        raise RDecodeError(f"unsupported ALTREP class {cls!r}")


def _num_to_str(v) -> str | None:
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def unserialize(data: bytes):
    """Decode one serialized R object (after any outer compression)."""
    r = Reader(data)
    r.header()
    return r.item()


def read_rds(path: str):
    """Read an ``.rds``-style file, sniffing gzip/bzip2/xz/plain."""
    raw = open(path, "rb").read()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    elif raw[:3] == b"BZh":
        raw = bz2.decompress(raw)
    elif raw[:6] == b"\xfd7zXZ\x00":
        raw = lzma.decompress(raw)
    return unserialize(raw)


def _decompress_entry(blob: bytes, compressed) -> bytes:
    if len(blob) < 4:
        raise RDecodeError("database entry shorter than its length header")
    outlen = struct.unpack(">I", blob[:4])[0]
    if compressed in (2, 3):
        tag, payload = blob[4:5], blob[5:]
        if tag == b"0":
            out = payload
        elif tag == b"2":
            out = bz2.decompress(payload)
        elif tag == b"Z":
            out = lzma.decompress(payload)
        elif tag == b"1":
            out = zlib.decompress(payload)
        else:
            raise RDecodeError(f"unknown compression tag {tag!r}")
    elif compressed:
        out = zlib.decompress(blob[4:])
    else:
        out = blob[4:]
    if len(out) != outlen:
        raise RDecodeError(f"entry decompressed to {len(out)} bytes, header says {outlen}")
    return out


def read_lazyload(prefix: str) -> dict:
    """Map each variable of the database ``prefix.rdb/.rdx`` to its object."""
    index = read_rds(prefix + ".rdx")
    fields = dict(zip(index.names(), index.value))
    variables = fields["variables"]
    comp = fields.get("compressed")
    compressed = comp.value[0] if isinstance(comp, RObject) else True
    if compressed is True or compressed is None:
        compressed = 1
    db = open(prefix + ".rdb", "rb").read()
    out = {}
    for name, loc in zip(variables.names(), variables.value):
        off, length = (int(x) for x in loc.value)
        if off < 0 or length < 0 or off + length > len(db):
            raise RDecodeError(f"entry {name!r} lies outside the database")
        out[name] = unserialize(_decompress_entry(db[off : off + length], compressed))
    return out


def main(argv: list) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    objs = read_lazyload(argv[1])
    lines: list = []
    for name in argv[2:]:
        obj = objs.get(name)
        if not isinstance(obj, RObject) or obj.kind != STRSXP:
            print(f"rdb_extract: {name!r} is not a character vector in {argv[1]}", file=sys.stderr)
            return 1
        lines.extend("" if s is None else s for s in obj.value)
    sys.stdout.buffer.write(("\n".join(lines) + "\n").encode("utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
