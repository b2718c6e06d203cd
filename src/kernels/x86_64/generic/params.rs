//! Stored scales and zeros: widened per tile (per-token) or per block (per-channel), and folded into the queries.

use super::*;

/// Widen stored scales/zeros: `dst[i]` from bytes `i·fb..` of `src`.
#[inline(always)]
pub(crate) fn cvt_params<S: Simd>(s: S, fmt: ScaleFormat, src: &[u8], dst: &mut [f32]) {
    let fb = fmt.bytes();
    let n = dst.len();
    assert!(src.len() >= n * fb, "kernels: params shorter than expected");
    let mut i = 0;
    while i + S::L <= n {
        // SAFETY: `i + L ≤ n`: `src` holds `(i+L)·fb` bytes, `dst` `i+L` floats.
        unsafe {
            let p = src.as_ptr().add(i * fb);
            let v = match fmt {
                ScaleFormat::F16 => s.load_f16(p),
                ScaleFormat::Bf16 => s.load_bf16(p),
                ScaleFormat::F32 => s.load_f32_bytes(p),
            };
            s.store(dst.as_mut_ptr().add(i), v);
        }
        i += S::L;
    }
    for (k, d) in dst.iter_mut().enumerate().skip(i) {
        *d = fmt.read(&src[k * fb..]);
    }
}

/// `dst = src·k`, elementwise.
#[inline(always)]
pub(crate) fn scale_into<S: Simd>(s: S, src: &[f32], k: f32, dst: &mut [f32]) {
    assert!(dst.len() >= src.len());
    let n = src.len();
    let mut i = 0;
    while i + S::L <= n {
        // SAFETY: `i + L ≤ n ≤ dst.len()`.
        unsafe {
            s.store(
                dst.as_mut_ptr().add(i),
                s.mul(s.load(src.as_ptr().add(i)), s.splat(k)),
            )
        };
        i += S::L;
    }
    for c in i..n {
        dst[c] = src[c] * k;
    }
}

/// The scheme as the kernels need it.
#[derive(Clone, Copy)]
pub(crate) struct Plan {
    pub(crate) tokens: usize,
    pub(crate) fmt: ScaleFormat,
    pub(crate) sym: bool,
    /// `2^(bits-1)`: a symmetric group's implied zero is `-scale·half`.
    pub(crate) half: f32,
}

impl Plan {
    /// The params' stored format.
    #[inline(always)]
    pub(crate) fn fmt(&self) -> ScaleFormat {
        self.fmt
    }

    /// Symmetric groups (no stored zeros).
    #[inline(always)]
    pub(crate) fn sym(&self) -> bool {
        self.sym
    }

    /// `2^(bits-1)`: a symmetric group's implied zero is `-scale·half`.
    #[inline(always)]
    pub(crate) fn half(&self) -> f32 {
        self.half
    }

    #[inline(always)]
    pub(crate) fn new(head: &PackedHead<'_>) -> Plan {
        let sc = head.layout().scheme();
        Plan {
            tokens: head.tokens(),
            fmt: sc.scale_format(),
            sym: sc.mode() == Mode::Symmetric,
            half: (1u32 << (sc.bits() - 1)) as f32,
        }
    }
}

/// Per-token params of one tile, widened to `f32` in place of the stored
/// layout (`[s_0 … s_{g-1}][z_0 … z_{g-1}]` per token; symmetric zeros
/// computed into `zs`), plus, for groups that do not line up with whole
/// vectors, the same expanded to one scale and zero per channel.
pub(crate) struct TileParams {
    /// Numbers per token as stored (`gpr` or `2·gpr`).
    pub(crate) vals: usize,
    pub(crate) gpr: usize,
    /// Channels per group.
    pub(crate) cpg: usize,
    pub(crate) p: Plan,
    pub(crate) conv: Buf,
    pub(crate) zs: Buf,
    pub(crate) goff: [u32; MAX_NCH],
    /// Expanded `(scales, zeros)`, `T` rows of `hdp`, when groups do not
    /// line up with vectors.
    pub(crate) rows: Option<(Buf, Buf)>,
    pub(crate) hd: usize,
    pub(crate) hdp: usize,
    /// The kernel prefetches per token ([`TileParams::ahead`]), not
    /// [`TileParams::load`].
    pub(crate) spread: bool,
}

impl TileParams {
    #[inline(always)]
    pub(crate) fn new<S: Simd>(head: &PackedHead<'_>, g: Geo, p: Plan) -> TileParams {
        let l = head.layout();
        let gpr = l.groups_per_row();
        let cpg = l.channels_per_group();
        let vals = gpr * if p.sym { 1 } else { 2 };
        let aligned = cpg.is_multiple_of(S::L) && g.nch <= MAX_NCH;
        let mut goff = [0u32; MAX_NCH];
        if aligned {
            for (j, o) in goff.iter_mut().enumerate().take(g.nch) {
                *o = (j * S::L / cpg) as u32;
            }
        }
        TileParams {
            vals,
            gpr,
            cpg,
            p,
            conv: Buf::new(S::T * vals + PAD),
            zs: Buf::new(if p.sym { S::T * gpr + PAD } else { 0 }),
            goff,
            rows: (!aligned).then(|| (Buf::new(S::T * g.hdp), Buf::new(S::T * g.hdp))),
            hd: g.hd,
            hdp: g.hdp,
            spread: false,
        }
    }

    /// The param and code streams of the tile at `t0`, for a kernel that
    /// prefetches per token.
    #[inline(always)]
    pub(crate) fn ahead(&self, head: &PackedHead<'_>, t0: usize) -> [Ahead; 2] {
        if !self.spread {
            return [Ahead::NONE; 2];
        }
        [
            Ahead::new(
                head.codes().as_ptr(),
                head.layout().row_bytes(),
                t0,
                head.tokens(),
            ),
            Ahead::new(
                head.params().as_ptr(),
                self.vals * self.p.fmt.bytes(),
                t0,
                head.tokens(),
            ),
        ]
    }

    /// Load the params of tokens `t0..t0+n`.
    #[inline(always)]
    pub(crate) fn load<S: Simd>(&mut self, s: S, head: &PackedHead<'_>, t0: usize, n: usize) {
        let fb = self.p.fmt.bytes();
        let src = &head.params()[t0 * self.vals * fb..(t0 + n) * self.vals * fb];
        // Every per-token path loads a tile's params here: prefetch both
        // of its streams, params and codes (unless the kernel spreads them).
        if !self.spread {
            let t = head.tokens();
            prefetch_ahead(head.params().as_ptr(), self.vals * fb, t0, n, t);
            prefetch_ahead(head.codes().as_ptr(), head.layout().row_bytes(), t0, n, t);
        }
        cvt_params(s, self.p.fmt, src, &mut self.conv.m()[..n * self.vals]);
        if self.p.sym {
            scale_into(s, &self.conv.s()[..n * self.gpr], -self.p.half, self.zs.m());
        }
        if let Some((rs, rz)) = &mut self.rows {
            let (hd, hdp, gpr, vals, cpg) = (self.hd, self.hdp, self.gpr, self.vals, self.cpg);
            for tt in 0..n {
                // Group by group (no division per channel).
                for k in 0..hd.div_ceil(cpg) {
                    let sc = self.conv.s()[tt * vals + k];
                    let z = if self.p.sym {
                        self.zs.s()[tt * gpr + k]
                    } else {
                        self.conv.s()[tt * vals + gpr + k]
                    };
                    let (c0, c1) = (tt * hdp + k * cpg, tt * hdp + ((k + 1) * cpg).min(hd));
                    rs.m()[c0..c1].fill(sc);
                    rz.m()[c0..c1].fill(z);
                }
            }
        }
    }

    #[inline(always)]
    pub(crate) fn deq(&self) -> PerToken {
        let sc = self.conv.s().as_ptr();
        PerToken {
            sc,
            ze: if self.p.sym {
                self.zs.s().as_ptr()
            } else {
                sc.wrapping_add(self.gpr)
            },
            stride: if self.p.sym { self.gpr } else { self.vals },
            goff: self.goff,
        }
    }

    #[inline(always)]
    pub(crate) fn deq_rows(&self) -> Option<Rows> {
        self.rows.as_ref().map(|(rs, rz)| Rows {
            sc: rs.s().as_ptr(),
            ze: rz.s().as_ptr(),
            stride: self.hdp,
        })
    }
}

/// Per-channel params of block `k` into `sc`/`ze` (`hd` each; the padding
/// up to `hdp` stays zero).
#[inline(always)]
pub(crate) fn block_params<S: Simd>(
    s: S,
    head: &PackedHead<'_>,
    p: &Plan,
    hd: usize,
    k: usize,
    sc: &mut [f32],
    ze: &mut [f32],
) {
    let fb = p.fmt.bytes();
    let set = hd * fb * if p.sym { 1 } else { 2 };
    let src = &head.params()[k * set..(k + 1) * set];
    cvt_params(s, p.fmt, &src[..hd * fb], &mut sc[..hd]);
    if p.sym {
        scale_into(s, &sc[..hd], -p.half, ze);
    } else {
        cvt_params(s, p.fmt, &src[hd * fb..], &mut ze[..hd]);
    }
}

/// A per-channel block's folded queries `qs_i = q_i·scale` (rewritten as
/// [`nibble_queries`] does for `nib` = `Some(bits)`, 2 or 4) and biases
/// `q_i·zero`, straight from the block's stored `f16` params at `src`
/// (scales, then zeros unless symmetric): the same products and sums, in
/// the same order, as [`block_params`], the bias loop and
/// [`nibble_queries`], without the widened copies in between.
///
/// # Safety
/// `src` valid for the block's `nch·L` scales (and as many zeros unless
/// symmetric) as `f16`; `qp` and `qs` for `bias.len()` queries of `hdp ≥
/// nch·L` floats; `nch ≤ MAX_NCH`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) unsafe fn block_queries_f16<S: Simd>(
    s: S,
    src: *const u8,
    p: &Plan,
    nch: usize,
    qp: *const f32,
    hdp: usize,
    qs: *mut f32,
    bias: &mut [f32],
    nib: Option<u32>,
) {
    let hd = nch * S::L;
    for (i, bias) in bias.iter_mut().enumerate() {
        let mut x = [s.zero(); MAX_NCH];
        let mut b = s.zero();
        // SAFETY: the caller's contract; vectors `j < nch`.
        unsafe {
            unroll!(32; j in 0, nch => {
                let sc = s.load_f16(src.add(j * S::L * 2));
                let ze = if p.sym {
                    s.mul(sc, s.splat(-p.half))
                } else {
                    s.load_f16(src.add((hd + j * S::L) * 2))
                };
                let qv = s.load(qp.add(i * hdp + j * S::L));
                x[j] = s.mul(qv, sc);
                b = s.fma(qv, ze, b);
            });
        }
        *bias = s.hsum(b);
        if let Some(bits) = nib {
            // As `nibble_queries`: scale field `f` by 2^−bits·f, then
            // (prefixes) subtract the next field.
            let nf = (8 / bits) as usize;
            let h = nch / nf;
            for f in 1..nf {
                let k = s.splat(1.0 / (1u32 << (bits as usize * f)) as f32);
                for v in &mut x[f * h..(f + 1) * h] {
                    *v = s.mul(*v, k);
                }
            }
            for f in 0..if telescoped(bits) { nf - 1 } else { 0 } {
                for jj in 0..h {
                    x[f * h + jj] = s.sub(x[f * h + jj], x[(f + 1) * h + jj]);
                }
            }
        }
        // SAFETY: vectors `j < nch` of query `i` of `qs`.
        unsafe {
            unroll!(32; j in 0, nch => {
                s.store(qs.add(i * hdp + j * S::L), x[j]);
            });
        }
    }
}
