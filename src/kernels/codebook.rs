//! Fused kernels of the codebook formats ([`Levels`](crate::Levels)):
//! `x̂ = scale·level[code]`, read straight from packed codes.
//!
//! Each token's row is decoded once — codes looked up in the table held in
//! registers (`vpermps`, see `x86_64/codebook.rs`), times the group's
//! scale — and shared by every query of the KV head: scores are
//! `q_i·row`, the weighted sum adds `p_it·row` to each output. With one
//! query at head_dim 128 the row stays in registers; otherwise it goes
//! through an L1 scratch of `head_dim` floats per token of a 16-token
//! tile. Rows of 2, 3 and 4 bits (and fp8) whose planes are whole
//! vectors (every such width at head_dim 128 and 256) take the SIMD path;
//! every other row, and [`Backend::Portable`], the scalar one here, which
//! unpacks with [`pack::unpack`](crate::pack::unpack).
//!
//! Numerics as the uniform kernels': `f32` from the stored scales, FMA on
//! the SIMD backends, agreeing with the oracle (decode, then `f64` math) to
//! about `1e-6` of `Σ|q·k̂|`.

use super::{axpy, check_queries, dot};
use crate::quant::fp8::Fp8;

/// How a code decodes, before the group's scale: an fp8 byte (`fp8`:
/// [`Fp8::decode`]'s sign, `magnitude << shift`, times `factor`) or
/// `table[code]` (padded to 16 entries). Plain fields, no enum or
/// `Option`: every byte is initialized, so code that reads the fields of
/// both cases before choosing (as the optimizer may) reads no undefined
/// bytes, and memcheck can check the decode.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Book<'a> {
    pub(crate) table: &'a [f32; 16],
    pub(crate) fp8: bool,
    pub(crate) shift: u32,
    pub(crate) factor: f32,
}

impl<'a> Book<'a> {
    /// The book of `fp8` (if set) or `table`; a table book has shift and
    /// factor zero, which the SIMD kernels pass to their fp8 decode as is.
    pub(crate) fn new(table: &'a [f32; 16], fp8: Option<Fp8>) -> Book<'a> {
        Book {
            table,
            fp8: fp8.is_some(),
            shift: fp8.map_or(0, |f| f.shift()),
            factor: fp8.map_or(0.0, |f| f.factor()),
        }
    }

    #[inline]
    fn value(self, c: u8) -> f32 {
        if self.fp8 {
            Fp8::decode_with(c, self.shift, self.factor)
        } else {
            self.table[usize::from(c & 15)]
        }
    }
}
use crate::error::Result;
use crate::simd::{Backend, Kernel};
use crate::store::PackedHead;

/// Scores `out[i·T + t] = q_i·k̂_t` of a codebook head (`table` padded to 16).
///
/// # Errors
/// [`Error::Length`](crate::Error::Length) as [`scores_on`](super::scores_on).
pub(crate) fn scores_on(
    backend: Backend,
    head: &PackedHead<'_>,
    table: Book<'_>,
    q: &[f32],
    out: &mut [f32],
) -> Result<()> {
    let nq = check_queries("scores", head.layout().head_dim(), q.len())?;
    crate::quant::check_len("scores", "output logits", nq * head.tokens(), out.len())?;
    backend.dispatch(Args {
        head,
        table,
        x: q,
        out,
        sum: false,
    });
    Ok(())
}

/// The weighted sum `out[i] += Σ_t p[i·T + t]·v̂_t` of a codebook head.
///
/// # Errors
/// [`Error::Length`](crate::Error::Length) as [`weighted_sum_on`](super::weighted_sum_on).
pub(crate) fn weighted_sum_on(
    backend: Backend,
    head: &PackedHead<'_>,
    table: Book<'_>,
    p: &[f32],
    out: &mut [f32],
) -> Result<()> {
    let nq = check_queries("weighted_sum", head.layout().head_dim(), out.len())?;
    crate::quant::check_len("weighted_sum", "probabilities", nq * head.tokens(), p.len())?;
    backend.dispatch(Args {
        head,
        table,
        x: p,
        out,
        sum: true,
    });
    Ok(())
}

/// The head's tokens as f32 rows `[tokens, head_dim]`.
///
/// # Panics
/// If `out` is not `tokens·head_dim` long.
pub(crate) fn decode(head: &PackedHead<'_>, table: Book<'_>, out: &mut [f32]) {
    let hd = head.layout().head_dim();
    assert_eq!(out.len(), head.tokens() * hd, "decode: output length");
    let mut codes = vec![0u8; hd];
    for (t, row) in out.chunks_exact_mut(hd).enumerate() {
        decode_row(head, table, t, &mut codes, row);
    }
}

/// Token `t`'s row, decoded and scaled (scalar).
fn decode_row(head: &PackedHead<'_>, table: Book<'_>, t: usize, codes: &mut [u8], row: &mut [f32]) {
    let l = head.layout();
    let (rb, cpg) = (l.row_bytes(), l.channels_per_group());
    crate::pack::unpack(
        &head.codes()[t * rb..(t + 1) * rb],
        l.scheme().bits(),
        codes,
    );
    for (g, (r, c)) in row
        .chunks_exact_mut(cpg)
        .zip(codes.chunks_exact(cpg))
        .enumerate()
    {
        let scale = head.param(t, g).0;
        for (r, &c) in r.iter_mut().zip(c) {
            *r = scale * table.value(c);
        }
    }
}

/// A kernel's arguments, lengths checked: `x` the queries (scores) or the
/// probabilities (weighted sum).
struct Args<'a, 'h> {
    head: &'a PackedHead<'h>,
    table: Book<'a>,
    x: &'a [f32],
    out: &'a mut [f32],
    sum: bool,
}

impl Args<'_, '_> {
    fn scalar(self) {
        let hd = self.head.layout().head_dim();
        let tokens = self.head.tokens();
        let mut codes = vec![0u8; hd];
        let mut row = vec![0f32; hd];
        for t in 0..tokens {
            decode_row(self.head, self.table, t, &mut codes, &mut row);
            if self.sum {
                for (i, o) in self.out.chunks_exact_mut(hd).enumerate() {
                    axpy(self.x[i * tokens + t], &row, o);
                }
            } else {
                for (i, q) in self.x.chunks_exact(hd).enumerate() {
                    self.out[i * tokens + t] = dot(q, &row);
                }
            }
        }
    }
}

impl Kernel for Args<'_, '_> {
    type Output = ();

    fn portable(self) {
        self.scalar()
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn simd<S: crate::simd::x86_64::Simd>(self, s: S) {
        use super::x86_64::codebook;
        if !codebook::takes::<S>(self.head.layout(), self.table) {
            // Rows whose planes are a whole number of AVX2 vectors but not
            // of AVX-512's (4-bit codes at head_dim 48: a 24-byte plane;
            // 3-bit at 32: an 8-byte plane and a 4-byte one, half an AVX2
            // vector) take that kernel, not the scalar loop (8–10x slower).
            if S::L > 8
                && codebook::takes::<crate::simd::x86_64::Avx2>(self.head.layout(), self.table)
            {
                return Backend::Avx2.dispatch(self);
            }
            return self.scalar();
        }
        let Args {
            head,
            table,
            x,
            out,
            sum,
        } = self;
        codebook::check(head, x.len(), out.len(), sum);
        // SAFETY: `check` asserted the lengths the loops rely on, `takes`
        // the row shape; `HD` is the head's; `s` proves the features this
        // body is compiled with.
        unsafe {
            match head.layout().head_dim() {
                128 => codebook::run::<S, 128>(s, head, table, x, out, sum),
                64 => codebook::run::<S, 64>(s, head, table, x, out, sum),
                256 => codebook::run::<S, 256>(s, head, table, x, out, sum),
                _ => codebook::run::<S, 0>(s, head, table, x, out, sum),
            }
        }
    }
}
