//! The codebook kernels' vector loops (see `kernels/codebook.rs`): decode a
//! row with [`Simd::lut16`] into an L1 scratch, scale it per group, then
//! dot it with every query or add it into every output.

use super::Simd;
use crate::kernels::codebook::Book;
use crate::scheme::Layout;
use crate::store::PackedHead;

/// Whether rows of this layout decode a whole vector per load: every
/// plane's bytes a multiple of `L` (4 bits: `head_dim/2`; 2 bits:
/// `head_dim/4`; 3 bits: the 1-bit plane's `head_dim/8`).
#[inline(always)]
pub(crate) fn takes<S: Simd>(l: &Layout, book: Book<'_>) -> bool {
    let hd = l.head_dim();
    let plane = match (l.scheme().bits(), book) {
        (8, Book::Fp8(_)) => hd,
        (4, Book::Table(_)) => hd / 2,
        (2, Book::Table(_)) => hd / 4,
        (3, Book::Table(_)) => hd / 8,
        _ => return false,
    };
    plane > 0 && plane.is_multiple_of(S::L)
}

/// Assert every length [`run`] relies on.
#[inline(always)]
pub(crate) fn check(head: &PackedHead<'_>, x: usize, out: usize, sum: bool) {
    let l = head.layout();
    let (hd, t) = (l.head_dim(), head.tokens());
    assert!(
        head.codes().len() >= t * l.row_bytes(),
        "codebook: code rows"
    );
    let nq = if sum { out / hd } else { x / hd };
    let (xs, os) = if sum {
        (nq * t, nq * hd)
    } else {
        (nq * hd, nq * t)
    };
    assert!(x == xs && out == os, "codebook: lengths");
}

/// Decode the `hd` codes of `row` ([`takes`] true: 2, 3 or 4 bits with a
/// table, 8 for fp8) to their values at `scr`, times their group's scale
/// from `sc` when `cpg` (channels per group) is a multiple of `L` (else
/// unscaled: the caller scales).
///
/// # Safety
/// `row` valid for `hd·bits/8` bytes, `scr` for `hd` floats.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn decode_codes<S: Simd>(
    s: S,
    tbl: S::T16,
    fp8: Option<(u32, f32)>,
    row: *const u8,
    bits: u8,
    hd: usize,
    (sc, cpg): (&[f32], usize),
    scr: *mut f32,
) {
    let whole = cpg.is_multiple_of(S::L);
    // Group of element `e`: a shift for the usual power-of-two groups.
    let shift = if cpg.is_power_of_two() {
        cpg.trailing_zeros()
    } else {
        u32::MAX
    };
    // A macro, not a closure: a closure's body is compiled without the
    // trampoline's target features, so the vector calls in it would not
    // inline. Every use stores `L` floats at `e + L <= hd` (`scr` holds
    // `hd`), and `e / cpg` is a group of the row (`sc` has one per group).
    macro_rules! put {
        ($e:expr, $v:expr) => {{
            let (e, v) = ($e, $v);
            let v = if whole {
                let g = if shift != u32::MAX {
                    e >> shift
                } else {
                    e / cpg
                };
                s.mul(v, s.splat(sc[g]))
            } else {
                v
            };
            s.store(scr.add(e), v)
        }};
    }
    // SAFETY: every load reads `L` bytes inside the row's planes and every
    // store writes `L` floats inside `scr`, by `takes` and the caller's
    // contract (see `crate::pack` for the plane layout).
    unsafe {
        if let Some((shift, factor)) = fp8 {
            let (sh, f) = (shift as i32, s.splat(factor));
            for j in (0..hd).step_by(S::L) {
                let v = s.load_u8(row.add(j));
                let sign = s.shr_mask(v, -24, 0x8000_0000);
                let mag = s.shr_mask(v, -sh, 0x7f << shift);
                put!(j, s.mul(s.bits_f32(s.or(sign, mag)), f));
            }
            return;
        }
        match bits {
            4 => {
                let m = hd / 2;
                for j in (0..m).step_by(S::L) {
                    let v = s.load_u8(row.add(j));
                    put!(j, s.lut16(tbl, s.shr_mask(v, 0, 15)));
                    put!(j + m, s.lut16(tbl, s.shr_mask(v, 4, 15)));
                }
            }
            2 => {
                let m = hd / 4;
                for j in (0..m).step_by(S::L) {
                    let v = s.load_u8(row.add(j));
                    for f in 0..4 {
                        let idx = s.shr_mask(v, 2 * f as i32, 3);
                        put!(j + f * m, s.lut16(tbl, idx));
                    }
                }
            }
            _ => {
                // Two planes: bits 0–1 in `m2` bytes, then bit 2 in `m1`.
                let (m2, m1) = (hd / 4, hd / 8);
                for j in (0..m2).step_by(S::L) {
                    let lo = s.load_u8(row.add(j));
                    let hb = j / m1;
                    let hi = s.load_u8(row.add(m2 + j % m1));
                    for f in 0..4 {
                        let k = (2 * f + hb) as i32;
                        let idx = s.or(s.shr_mask(lo, 2 * f as i32, 3), s.shr_mask(hi, k - 2, 4));
                        put!(j + f * m2, s.lut16(tbl, idx));
                    }
                }
            }
        }
    }
}

/// Scores (`sum` false: `out[i·T + t] = x_i·k̂_t`) or the weighted sum
/// (`out_i += Σ_t x[i·T + t]·v̂_t`) of one codebook head.
///
/// # Safety
/// [`check`] and [`takes`] hold for these arguments, and `s` is a token
/// of this CPU.
#[inline(always)]
pub(crate) unsafe fn run<S: Simd>(
    s: S,
    head: &PackedHead<'_>,
    book: Book<'_>,
    x: &[f32],
    out: &mut [f32],
    sum: bool,
) {
    let l = head.layout();
    let (hd, rb, cpg, bits) = (
        l.head_dim(),
        l.row_bytes(),
        l.channels_per_group(),
        l.scheme().bits(),
    );
    let tokens = head.tokens();
    let nq = if sum { out.len() / hd } else { x.len() / hd };
    let (tbl, fp8) = match book {
        Book::Table(t) => (s.table16(t), None),
        Book::Fp8(f) => (s.table16(&[0.0; 16]), Some((f.shift(), f.factor()))),
    };
    // Every access to the scratch goes through `scr`.
    let mut buf = vec![0f32; hd];
    let scr = buf.as_mut_ptr();
    let whole = cpg.is_multiple_of(S::L);
    let gpr = hd / cpg;
    // f16 scales of a block of tokens widened at once (`L` per load): the
    // per-group reads cost more than the row's decode otherwise.
    const BLOCK: usize = 256;
    let f16 = l.scheme().scale_format() == crate::scheme::ScaleFormat::F16 && !l.shared_params();
    let mut scales = vec![0f32; BLOCK * gpr];
    for t in 0..tokens {
        if t % BLOCK == 0 {
            let n = (tokens - t).min(BLOCK) * gpr;
            if f16 {
                let p = &head.params()[t * gpr * 2..(t * gpr + n) * 2];
                let whole_l = n / S::L * S::L;
                for k in (0..whole_l).step_by(S::L) {
                    // SAFETY: `2·L` bytes at `2k` lie inside `p` (`k + L <=
                    // n`, `p` holds `2n`), and `scales` holds `n` floats.
                    unsafe {
                        let v = s.load_f16(p.as_ptr().add(2 * k));
                        s.store(scales.as_mut_ptr().add(k), v);
                    }
                }
                for (k, v) in scales.iter_mut().enumerate().take(n).skip(whole_l) {
                    *v =
                        half::f16::from_bits(u16::from_le_bytes([p[2 * k], p[2 * k + 1]])).to_f32();
                }
            } else {
                for (k, v) in scales[..n].iter_mut().enumerate() {
                    *v = head.param(t + k / gpr, k % gpr).0;
                }
            }
        }
        let sc = &scales[(t % BLOCK) * gpr..][..gpr];
        // SAFETY: row `t` lies in the codes (checked), `scr` holds `hd`
        // floats, and every vector access below stays inside `scr`, the
        // query row `i` (`hd` floats of `x`) or the output row `i` (`hd`
        // of `out`): `hd` is a multiple of `L` by `takes`.
        unsafe {
            let row = head.codes().as_ptr().add(t * rb);
            decode_codes(s, tbl, fp8, row, bits, hd, (sc, cpg), scr);
            if !whole {
                for (g, &v) in sc.iter().enumerate() {
                    for j in g * cpg..(g + 1) * cpg {
                        *scr.add(j) *= v;
                    }
                }
            }
            if sum {
                for i in 0..nq {
                    let w = x[i * tokens + t];
                    if w == 0.0 {
                        continue;
                    }
                    let (wv, o) = (s.splat(w), out.as_mut_ptr().add(i * hd));
                    for j in (0..hd).step_by(S::L) {
                        s.store(o.add(j), s.fma(wv, s.load(scr.add(j)), s.load(o.add(j))));
                    }
                }
            } else {
                for i in 0..nq {
                    let q = x.as_ptr().add(i * hd);
                    // Four accumulators: one would chain every FMA's
                    // latency through the row.
                    let mut acc = [s.zero(); 4];
                    for (k, j) in (0..hd).step_by(S::L).enumerate() {
                        acc[k % 4] = s.fma(s.load(q.add(j)), s.load(scr.add(j)), acc[k % 4]);
                    }
                    let sum = s.add(s.add(acc[0], acc[1]), s.add(acc[2], acc[3]));
                    out[i * tokens + t] = s.hsum(sum);
                }
            }
        }
    }
}
