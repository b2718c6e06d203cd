//! Bit packing of codes of every width 1–8.
//!
//! # Layout (normative; `docs/FORMAT.md` has byte-by-byte examples)
//!
//! A *row* of `n` codes (`n` a multiple of 8) of width `b` is stored in
//! `n·b/8` bytes as one or more **planes**. `b` is split into power-of-two
//! plane widths, widest first, each plane holding the next-higher bits of
//! every code:
//!
//! | bits | planes (width: code bits) |
//! |------|---------------------------|
//! | 1 | 1: bit 0 |
//! | 2 | 2: bits 0–1 |
//! | 3 | 2: bits 0–1, then 1: bit 2 |
//! | 4 | 4: bits 0–3 |
//! | 5 | 4: bits 0–3, then 1: bit 4 |
//! | 6 | 4: bits 0–3, then 2: bits 4–5 |
//! | 7 | 4: bits 0–3, then 2: bits 4–5, then 1: bit 6 |
//! | 8 | 8: bits 0–7 |
//!
//! A plane of width `p` packs `k = 8/p` fields per byte into `m = n/k`
//! bytes: **element `i` sits in byte `i mod m`, field `i div m`**, field `f`
//! being bits `p·f .. p·f+p` of the byte (field 0 is the least significant).
//! For 4 bits this is llama.cpp's q4_0 nibble split stretched over the whole
//! row: element `j` is the low nibble of byte `j` and element `j + n/2` the
//! high nibble.
//!
//! Why: unpacking field `f` of `m` consecutive bytes is one shift and one
//! mask over a vector register and yields `m` *consecutive* elements, so a
//! SIMD kernel never shuffles codes back into order, and the odd widths are
//! the same unpack plus an OR of the higher plane.

/// Bytes that `n` codes of width `bits` occupy (`n` a multiple of 8).
#[inline]
pub const fn packed_len(n: usize, bits: u8) -> usize {
    n * bits as usize / 8
}

/// The planes of a width: `(plane width, bit offset in the code)`, widest
/// first. Returns the planes in a fixed array and how many are used.
#[inline]
pub const fn planes(bits: u8) -> ([(u8, u8); 3], usize) {
    match bits {
        8 => ([(8, 0), (0, 0), (0, 0)], 1),
        _ => {
            let mut out = [(0u8, 0u8); 3];
            let mut k = 0;
            let mut shift = 0u8;
            let mut p = 4u8;
            while p > 0 {
                if bits & p != 0 {
                    out[k] = (p, shift);
                    k += 1;
                    shift += p;
                }
                p /= 2;
            }
            (out, k)
        }
    }
}

#[track_caller]
fn check(n: usize, bits: u8, packed: usize) {
    assert!(
        (1..=8).contains(&bits),
        "pack: bits must be 1..=8, got {bits}"
    );
    assert!(
        n.is_multiple_of(8),
        "pack: row length must be a multiple of 8, got {n}"
    );
    assert_eq!(
        packed,
        packed_len(n, bits),
        "pack: {n} codes of {bits} bits need {} bytes",
        packed_len(n, bits)
    );
}

/// Pack `codes` (each `< 2^bits`) into `out`.
///
/// # Panics
/// If `bits` is not in `1..=8`, `codes.len()` is not a multiple of 8,
/// `out.len() != packed_len(codes.len(), bits)`, or a code does not fit in
/// `bits` bits (these are internal invariants: the quantizer never makes
/// such codes).
#[track_caller]
#[inline(always)]
pub fn pack(codes: &[u8], bits: u8, out: &mut [u8]) {
    let n = codes.len();
    check(n, bits, out.len());
    let (pl, np) = planes(bits);
    let mut off = 0;
    let mut all = 0u8;
    for &(p, shift) in &pl[..np] {
        let m = n * p as usize / 8;
        let dst = &mut out[off..off + m];
        // One monomorphized loop per plane width: constant shifts and
        // field counts, so it vectorizes.
        all |= match p {
            1 => pack_plane::<1>(codes, shift, dst),
            2 => pack_plane::<2>(codes, shift, dst),
            4 => pack_plane::<4>(codes, shift, dst),
            _ => pack_plane::<8>(codes, shift, dst),
        };
        off += m;
    }
    assert!(
        bits == 8 || all >> bits == 0,
        "pack: a code does not fit in {bits} bits"
    );
}

/// Pack bits `shift..shift+P` of every code into the plane `dst`
/// (`codes.len()·P/8` bytes); returns the OR of all codes (for the
/// width check).
///
/// Sixteen plane bytes at a time: fixed-length inner loops that compile
/// to whole-register byte operations even when the plane is short (16 or
/// 32 bytes for a 128-channel row), where a loop over the whole plane
/// would run its scalar remainder.
#[inline(always)]
fn pack_plane<const P: usize>(codes: &[u8], shift: u8, dst: &mut [u8]) -> u8 {
    const W: usize = 16;
    let k = 8 / P;
    let m = dst.len();
    let mask = ((1u16 << P) - 1) as u8;
    let mut all = [0u8; W];
    let mw = m / W * W;
    for (o, d) in (0..mw).step_by(W).zip(dst.chunks_exact_mut(W)) {
        let mut acc = [0u8; W];
        for f in 0..k {
            let src = &codes[f * m + o..f * m + o + W];
            for i in 0..W {
                all[i] |= src[i];
                acc[i] |= ((src[i] >> shift) & mask) << (P * f);
            }
        }
        d.copy_from_slice(&acc);
    }
    let mut rest = 0u8;
    for o in mw..m {
        let mut b = 0u8;
        for f in 0..k {
            let c = codes[f * m + o];
            rest |= c;
            b |= ((c >> shift) & mask) << (P * f);
        }
        dst[o] = b;
    }
    all.iter().fold(rest, |a, &b| a | b)
}

/// Unpack a row packed by [`pack`] into `out` (`out.len()` codes).
///
/// # Panics
/// If `bits` is not in `1..=8`, `out.len()` is not a multiple of 8, or
/// `packed.len() != packed_len(out.len(), bits)`.
#[track_caller]
pub fn unpack(packed: &[u8], bits: u8, out: &mut [u8]) {
    let n = out.len();
    check(n, bits, packed.len());
    let (pl, np) = planes(bits);
    let mut off = 0;
    for (idx, &(p, shift)) in pl[..np].iter().enumerate() {
        let k = 8 / p as usize;
        let m = n / k;
        let mask = ((1u16 << p) - 1) as u8;
        let src = &packed[off..off + m];
        for f in 0..k {
            let o = &mut out[f * m..(f + 1) * m];
            let sh = p as usize * f;
            if idx == 0 {
                for (d, &s) in o.iter_mut().zip(src) {
                    *d = ((s >> sh) & mask) << shift;
                }
            } else {
                for (d, &s) in o.iter_mut().zip(src) {
                    *d |= ((s >> sh) & mask) << shift;
                }
            }
        }
        off += m;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plane_tables() {
        assert_eq!(planes(7).1, 3);
        assert_eq!(planes(7).0, [(4, 0), (2, 4), (1, 6)]);
        assert_eq!(&planes(3).0[..2], &[(2, 0), (1, 2)]);
        assert_eq!(&planes(8).0[..1], &[(8, 0)]);
        for b in 1..=8u8 {
            let (pl, n) = planes(b);
            assert_eq!(pl[..n].iter().map(|p| p.0).sum::<u8>(), b);
        }
    }

    #[test]
    fn four_bit_is_nibble_split() {
        let codes: Vec<u8> = (0..16).collect();
        let mut out = vec![0; 8];
        pack(&codes, 4, &mut out);
        // element j low nibble of byte j, element j+8 high nibble
        assert_eq!(out[0], 0x80);
        assert_eq!(out[7], 0xF7);
    }

    #[test]
    fn round_trip_every_width() {
        for bits in 1..=8u8 {
            for n in [8usize, 16, 64, 200] {
                let codes: Vec<u8> = (0..n)
                    .map(|i| ((i * 37 + 11) % (1usize << bits)) as u8)
                    .collect();
                let mut p = vec![0; packed_len(n, bits)];
                pack(&codes, bits, &mut p);
                let mut back = vec![0; n];
                unpack(&p, bits, &mut back);
                assert_eq!(codes, back, "bits {bits} n {n}");
            }
        }
    }
}
