#!/usr/bin/env python3
"""Deterministic test vectors for the ggml `iq4_nl` block quantizer.

What it is
    An independent numpy re-implementation, in float32 arithmetic as ggml does
    it, of llama.cpp's reference quantizer for one IQ4_NL block (32 floats ->
    fp16 d + 16 bytes of 4-bit codes):

        quantize_row_iq4_nl_ref(x, y, k)
          -> quantize_row_iq4_nl_impl(super_block_size = 32, block_size = 32, ...,
                                      values = kvalues_iq4nl,
                                      quant_weights = NULL, ntry = -1)

    in ggml/src/ggml-quants.c (ggml-org/llama.cpp; read at commits 36491e40 and
    01243c58). It prints a Rust literal (`IQ4NL_VECTORS`) with, per block, the
    32 inputs as f32 bit patterns, the expected fp16 bits of d, the 32 codes
    L[j] in element order, the 16 packed qs bytes, and the dequantized values
    d*kvalues[L] as f32 bits. The dequantized values are cross-checked bit for
    bit against `gguf.quants.dequantize(..., IQ4_NL)` fed the block bytes.

Algorithm followed (for one block, ntry = -1, no quant weights):
    weight[j] = x[j]*x[j]
    amax/max  = |x| / x of the FIRST element with the largest |x| (strict >)
    if amax < 1e-15f: d = 0, all codes 0          (GROUP_MAX_EPS early exit)
    d0 = max / values[0]   (values[0] = -127)     ntry <= 0, so no minus sign
    id = 1/d0
    L[j] = best_index_int8(16, values, id*x[j])   multiply by 1/d0, not x/d0
    sumqx += w*q*x, sumq2 += w*q*q  (q = values[L[j]], left to right, f32)
    d = sumq2 > 0 ? sumqx/sumq2 : 0               least-squares refit
    the itry loop runs from 1 to -1, i.e. not at all, and with ntry <= 0 the
    codes are NOT recomputed with the refit d.
    y.d = GGML_FP32_TO_FP16(d) (round to nearest even), qs[j] = L[j] | L[j+16]<<4

    best_index_int8 picks the nearest level; an exact midpoint goes to the
    UPPER level. Both source variants are implemented and checked to agree:
    the older binary search ending in `x - val[mu-1] < val[mu] - x ? mu-1 : mu`
    and the newer branchless `x+x >= val[j-1]+val[j]` search.

The f32 sums are evaluated without FMA contraction (as an x86-64 baseline build
does). Each vector's comment says whether fp16(d) would change if the sums were
done in float64 instead, a rough test of whether summation order or FMA could
matter.

Run (prints the Rust literal on stdout, exits non-zero if a check fails):
    python3 scripts/iq4nl_vectors.py
    python3 scripts/iq4nl_vectors.py > iq4nl_vectors.rs

One-off requirement:
    pip install numpy gguf
"""

from __future__ import annotations

import sys
from fractions import Fraction

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

F32 = np.float32
QK = 32
KVALUES_INT = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
KVALUES_F32 = [F32(v) for v in KVALUES_INT]
GROUP_MAX_EPS = F32(1e-15)  # 1e-15f


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise SystemExit(f"iq4nl_vectors.py: check failed: {msg}")


def f32_bits(v) -> int:
    return int(np.array(v, dtype=np.float32).view(np.uint32))


def f32_from_bits(b: int) -> np.float32:
    return np.array(b & 0xFFFFFFFF, dtype=np.uint32).view(np.float32)[()]


# ---------------------------------------------------------------- best index

def best_index_binary(x: np.float32) -> int:
    """Older source: binary search, then `x - lo < hi - x ? lo : hi` in f32."""
    v = KVALUES_F32
    if x <= v[0]:
        return 0
    if x >= v[15]:
        return 15
    ml, mu = 0, 15
    while mu - ml > 1:
        mav = (ml + mu) // 2
        if x < v[mav]:
            mu = mav
        else:
            ml = mav
    return mu - 1 if F32(x - v[mu - 1]) < F32(v[mu] - x) else mu


def best_index_midpoint(x: np.float32) -> int:
    """Newer source: branchless search on 2x against (exact) sums of neighbours."""
    x2 = F32(x + x)
    idx = 0
    step = 16 >> 1
    while step > 0:
        j = idx + step
        if x2 >= F32(KVALUES_INT[j - 1] + KVALUES_INT[j]):
            idx = j
        step >>= 1
    return idx


def best_index_exact(x: np.float32) -> int:
    """Oracle in exact rationals: nearest level, exact ties to the upper one."""
    fx = Fraction(float(x))
    best = 0
    for i in range(1, 16):
        if abs(fx - KVALUES_INT[i]) <= abs(fx - KVALUES_INT[best]):
            best = i
    return best


def best_index(x: np.float32) -> int:
    a, b, c = best_index_binary(x), best_index_midpoint(x), best_index_exact(x)
    check(a == b == c, f"best_index disagree at {float(x)!r} ({f32_bits(x):#010x}): {a} {b} {c}")
    return a


def self_test_best_index() -> None:
    pts = []
    for lo, hi in zip(KVALUES_INT, KVALUES_INT[1:]):
        mid = F32((lo + hi) / 2)  # exact: half-integers are representable
        pts += [mid, np.nextafter(mid, F32(-np.inf)), np.nextafter(mid, F32(np.inf)), F32(lo), F32(hi)]
    pts += [F32(-1e30), F32(1e30), F32(-127.5), F32(113.5), F32(0.0), F32(-0.0)]
    rng = np.random.default_rng(12345)
    pts += list(rng.uniform(-140, 130, 2000).astype(np.float32))
    for p in pts:
        best_index(F32(p))


# ---------------------------------------------------------------- fp16

def fp16_bits_numpy(f: np.float32) -> int:
    with np.errstate(over="ignore"):
        return int(np.array(f, dtype=np.float32).astype(np.float16).view(np.uint16))


def fp16_bits_ggml_soft(f: np.float32) -> int:
    """ggml_compute_fp32_to_fp16 software path (FP16 library bit trick)."""
    with np.errstate(over="ignore"):
        base = F32(F32(abs(f) * F32(2.0 ** 112)) * F32(2.0 ** -110))
    w = f32_bits(f)
    shl1_w = (w + w) & 0xFFFFFFFF
    sign = w & 0x80000000
    bias = shl1_w & 0xFF000000
    if bias < 0x71000000:
        bias = 0x71000000
    base = F32(f32_from_bits((bias >> 1) + 0x07800000) + base)
    bits = f32_bits(base)
    exp_bits = (bits >> 13) & 0x00007C00
    mantissa_bits = bits & 0x00000FFF
    nonsign = exp_bits + mantissa_bits
    return (sign >> 16) | (0x7E00 if shl1_w > 0xFF000000 else nonsign)


def fp16_bits(f: np.float32) -> int:
    a, b = fp16_bits_numpy(f), fp16_bits_ggml_soft(f)
    check(a == b, f"fp16 conversions disagree for {float(f)!r}: {a:#06x} {b:#06x}")
    return a


def fp16_to_f32(h: int) -> np.float32:
    return np.array(h, dtype=np.uint16).view(np.float16).astype(np.float32)[()]


# ---------------------------------------------------------------- quantizer

def quantize_block(x: np.ndarray) -> dict:
    """One IQ4_NL block as quantize_row_iq4_nl_impl(32, 32, ..., NULL, -1)."""
    check(x.dtype == np.float32 and x.shape == (QK,), "block must be 32 float32")
    xs = [F32(v) for v in x]
    weight = [F32(v * v) for v in xs]

    amax, mx = F32(0), F32(0)
    for v in xs:
        ax = F32(abs(v))
        if ax > amax:
            amax, mx = ax, v

    info = {"amax": amax, "max": mx, "early_exit": bool(amax < GROUP_MAX_EPS)}
    if info["early_exit"]:
        d = F32(0)
        codes = [0] * QK
        d64 = 0.0
        div_diff = 0
    else:
        d0 = F32(mx / KVALUES_F32[0])        # ntry <= 0: max/values[0]
        inv = F32(F32(1) / d0)                # id = 1/d
        codes = []
        sumqx, sumq2 = F32(0), F32(0)
        sumqx64, sumq264 = 0.0, 0.0
        div_diff = 0
        for v, w in zip(xs, weight):
            al = F32(inv * v)                 # ggml multiplies by 1/d0
            l = best_index(al)
            if best_index(F32(v / d0)) != l:  # what x/d0 would have given
                div_diff += 1
            codes.append(l)
            q = KVALUES_F32[l]
            sumqx = F32(sumqx + F32(F32(w * q) * v))
            sumq2 = F32(sumq2 + F32(F32(w * q) * q))
            sumqx64 += float(w) * float(q) * float(v)
            sumq264 += float(w) * float(q) * float(q)
        d = F32(sumqx / sumq2) if sumq2 > 0 else F32(0)
        d64 = sumqx64 / sumq264 if sumq264 > 0 else 0.0
        # ntry = -1: `for (itry = 1; itry <= -1; ...)` never runs, and the
        # `if (ntry > 0)` recomputation of L with 1/d is skipped.
        info["d0"] = d0
    d16 = fp16_bits(d)
    info["d_f32"] = d
    info["d16_from_f64_sums"] = fp16_bits_numpy(F32(d64))
    info["div_diff"] = div_diff

    qs = [codes[j] | (codes[j + 16] << 4) for j in range(16)]
    block = d16.to_bytes(2, "little") + bytes(qs)

    dd = fp16_to_f32(d16)
    with np.errstate(over="ignore", invalid="ignore"):
        deq = np.array([F32(dd * KVALUES_F32[l]) for l in codes], dtype=np.float32)
        ref = np.asarray(
            gguf_dequantize(np.frombuffer(block, dtype=np.uint8), GGMLQuantizationType.IQ4_NL),
            dtype=np.float32,
        ).reshape(-1)
    check(ref.shape == (QK,), f"gguf dequantize shape {ref.shape}")
    check(np.array_equal(deq.view(np.uint32), ref.view(np.uint32)),
          "dequantized values differ from gguf.quants.dequantize")
    return {"x": x, "d16": d16, "codes": codes, "qs": qs, "deq": deq, "info": info}


# ---------------------------------------------------------------- vectors

def midpoints() -> list:
    return [F32((lo + hi) / 2) for lo, hi in zip(KVALUES_INT, KVALUES_INT[1:])]


def make_blocks() -> list:
    blocks = []

    def add(name, arr, note):
        a = np.asarray(arr, dtype=np.float32)
        check(a.shape == (QK,), f"{name}: shape {a.shape}")
        blocks.append((name, a, note))

    for seed in (0, 1, 2):
        rng = np.random.default_rng(seed)
        add(f"normal_s{seed}", rng.standard_normal(QK, dtype=np.float32), f"N(0,1), seed {seed}")
        rng = np.random.default_rng(seed)
        add(f"normal_x1000_s{seed}", rng.standard_normal(QK, dtype=np.float32) * F32(1000),
            f"N(0,1)*1000, seed {seed}")
        rng = np.random.default_rng(seed)
        add(f"uniform_s{seed}", rng.uniform(-1.0, 1.0, QK).astype(np.float32), f"U[-1,1], seed {seed}")

    x = np.random.default_rng(3).standard_normal(QK, dtype=np.float32)
    x[5] = 50.0
    add("outlier_50", x, "N(0,1) seed 3 with x[5] = 50")

    x = np.random.default_rng(4).standard_normal(QK, dtype=np.float32)
    x[20] = -6.5
    add("max_negative", x, "N(0,1) seed 4 with x[20] = -6.5 (largest |x| negative)")

    x = np.random.default_rng(5).standard_normal(QK, dtype=np.float32) * F32(0.5)
    x[3], x[17] = 4.0, -4.0
    add("amax_tie_pos_first", x, "|x| tie 4 at x[3]=+4, x[17]=-4: first wins, max=+4")
    x = x.copy()
    x[3], x[17] = -4.0, 4.0
    add("amax_tie_neg_first", x, "|x| tie 4 at x[3]=-4, x[17]=+4: first wins, max=-4")

    add("all_equal_pos", np.full(QK, 0.75, dtype=np.float32), "all 0.75")

    # max = -127 -> d0 = 1, id = 1 exactly, so id*x == x: exact midpoints
    # (ties -> upper level) and their f32 neighbours.
    mids = midpoints()
    below = [np.nextafter(m, F32(-np.inf)) for m in mids]
    above = [np.nextafter(m, F32(np.inf)) for m in mids]
    add("midpoint_ties_below", [F32(-127)] + mids + below + [F32(1)],
        "x[0]=-127 so d0=1; x[1..=15] exact midpoints (tie -> upper), x[16..=30] one ulp below, x[31]=1")
    add("midpoint_ties_above", [F32(-127)] + mids + above + [F32(-10)],
        "x[0]=-127 so d0=1; x[1..=15] exact midpoints (tie -> upper), x[16..=30] one ulp above, x[31]=-10")
    # max = -100 -> d0 = 100/127 (inexact) and id = 1/d0: search, around each
    # d0*midpoint, for inputs where id*x and x/d0 pick different levels; the
    # check in main() asserts at least one was found.
    mx = F32(-100)
    d0 = F32(mx / KVALUES_F32[0])
    inv = F32(F32(1) / d0)
    hits = []
    for m in mids:
        c = F32(d0 * m)
        cands = [c]
        for direction in (F32(-np.inf), F32(np.inf)):
            y = c
            for _ in range(2):
                y = np.nextafter(y, direction)
                cands.append(y)
        hits += [y for y in cands if best_index(F32(inv * y)) != best_index(F32(y / d0))]
    fill = [F32(d0 * m) for m in mids] + [F32(d0 * F32(k)) for k in KVALUES_INT]
    add("mul_vs_div", ([mx] + hits + fill)[:QK],
        f"x[0]=-100 so d0=100/127; x[1..={len(hits)}] found by search where x*(1/d0) and x/d0 "
        f"pick different levels, then d0*midpoints and d0*kvalues")

    add("zeros", np.zeros(QK, dtype=np.float32), "all zero: early exit, d=0, codes 0")
    x = np.random.default_rng(6).standard_normal(QK, dtype=np.float32) * F32(1e-20)
    add("tiny_1e-20", x, "N(0,1)*1e-20: amax < 1e-15f early exit, d=0, codes 0")
    x = np.random.default_rng(7).standard_normal(QK, dtype=np.float32) * F32(1e-16)
    x[0] = GROUP_MAX_EPS
    add("eps_boundary_at", x, "max|x| == 1e-15f exactly: not < eps, codes computed, fp16 d underflows to 0")
    x = x.copy()
    x[0] = np.nextafter(GROUP_MAX_EPS, F32(0))
    add("eps_boundary_below", x, "max|x| one ulp below 1e-15f: early exit")
    x = np.random.default_rng(8).standard_normal(QK, dtype=np.float32) * F32(1e-4)
    add("fp16_subnormal_d", x, "N(0,1)*1e-4: d is an fp16 subnormal")
    x = np.random.default_rng(9).standard_normal(QK, dtype=np.float32) * F32(1e7)
    add("fp16_overflow_d", x, "N(0,1)*1e7: |d| > 65504, fp16 d = inf")
    return blocks


# ---------------------------------------------------------------- output

def hex_rows(words, width, per_line, indent):
    out = []
    for i in range(0, len(words), per_line):
        out.append(indent + " ".join(f"0x{w:0{width}x}," for w in words[i:i + per_line]))
    return out


def emit(name, note, r) -> list:
    info = r["info"]
    xb = [f32_bits(v) for v in r["x"]]
    db = [int(b) for b in r["deq"].view(np.uint32)]
    if info["early_exit"]:
        how = f"early exit (amax {float(info['amax']):.3e} < 1e-15)"
    else:
        how = (f"max {float(info['max']):.9g}, d0 {float(info['d0']):.9g}, "
               f"refit d {float(info['d_f32']):.9g} (f32 0x{f32_bits(info['d_f32']):08x})")
    robust = "yes" if info["d16_from_f64_sums"] == r["d16"] else (
        f"NO (f64 sums give 0x{info['d16_from_f64_sums']:04x})")
    lines = [
        f"    // {note}",
        f"    // {how}",
        f"    // stored d = {float(fp16_to_f32(r['d16'])):.9g}; fp16(d) same with f64 sums: {robust}; "
        f"codes x/d0 would change: {info['div_diff']}",
        "    Iq4NlVector {",
        f"        name: \"{name}\",",
        "        x: [",
        *hex_rows(xb, 8, 8, "            "),
        "        ],",
        f"        d: 0x{r['d16']:04x},",
        "        codes: [" + ", ".join(str(c) for c in r["codes"]) + "],",
        "        qs: [",
        *hex_rows(r["qs"], 2, 16, "            "),
        "        ],",
        "        deq: [",
        *hex_rows(db, 8, 8, "            "),
        "        ],",
        "    },",
    ]
    return lines


HEADER = """\
// Generated by scripts/iq4nl_vectors.py (numpy re-implementation of ggml's
// quantize_row_iq4_nl_ref, ggml/src/ggml-quants.c). Do not edit by hand.
// kvalues = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]
// Block bytes: d (fp16, little endian) then qs[j] = codes[j] | codes[j + 16] << 4.
// deq[j] = f32(d) * kvalues[codes[j]], checked against gguf.quants.dequantize.

pub struct Iq4NlVector {
    pub name: &'static str,
    /// Input, f32 bit patterns.
    pub x: [u32; 32],
    /// fp16 bits of the block scale d.
    pub d: u16,
    /// Code (0..15) of each element, in element order.
    pub codes: [u8; 32],
    /// Packed block bytes after d.
    pub qs: [u8; 16],
    /// Dequantized values, f32 bit patterns.
    pub deq: [u32; 32],
}

pub const IQ4NL_VECTORS: &[Iq4NlVector] = &["""


def main() -> int:
    self_test_best_index()
    out = [HEADER]
    for name, x, note in make_blocks():
        r = quantize_block(x)
        if name == "mul_vs_div":
            check(r["info"]["div_diff"] > 0, "mul_vs_div does not separate x*(1/d0) from x/d0")
        if name in ("zeros", "tiny_1e-20", "eps_boundary_below"):
            check(r["info"]["early_exit"] and r["d16"] == 0 and not any(r["codes"]), f"{name}: early exit")
        if name == "eps_boundary_at":
            check(not r["info"]["early_exit"] and any(r["codes"]), "eps_boundary_at must not exit early")
        out.extend(emit(name, note, r))
    out.append("];")
    sys.stdout.write("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
