//! The packed scores driver.

use super::*;

/// Packed scores: `out[i·tokens + t] = q_i · k̂_t`.
///
/// Per-channel keys: the block's scales are folded into the queries
/// (`q'_c = q_c·scale_c`, once per block) and its zeros into one bias per
/// query, so the tile holds raw codes. Per-token keys are dequantized into
/// the tile.
///
/// # Safety
/// [`super::check_head`]`(head, q.len(), out.len())` passed; `HD` is 0 or
/// the head's `head_dim`.
#[inline(always)]
pub(crate) unsafe fn scores<S: Simd, const B: u8, const HD: usize>(
    s: S,
    head: &PackedHead<'_>,
    q: &[f32],
    out: &mut [f32],
) {
    let p = Plan::new(head);
    let g = Geo::new::<S, B, HD>(head.layout().head_dim(), head.layout().scheme().bits());
    let (hd, hdp, t_all) = (g.hd, g.hdp, p.tokens);
    let nq = q.len() / hd;
    if t_all == 0 {
        return;
    }
    // The unpacked tile, for the paths that do not unpack into registers
    // (allocated by those only: a small page is a call of its own).
    let mut scr = Buf::new(0);
    let mut u8buf = vec![0u8; hdp];
    let mut qp = Buf::new(nq * hdp);
    for i in 0..nq {
        qp.m()[i * hdp..i * hdp + hd].copy_from_slice(&q[i * hd..(i + 1) * hd]);
    }
    // Unpack into registers (no scratch) when the shape is a compile-time
    // constant and the unpacked row fits the register file.
    let fused = HD > 0 && g.fast && g.nch <= MAX_NCH && (nq == 1 || g.nch <= S::REGS / 2);
    let mut accbuf = Buf::new(nq * S::T * S::L);
    let codes = head.codes().as_ptr();
    // One query only: with several, the transcoded 8-bit rows were slower
    // (four queries: 20.0 → 22.8 ns per token,
    // `docs/perf/records/2026-11-30-icelake.md`).
    let mut t3 = if fused && nq == 1 {
        Tile3::new::<B>(s, hd)
    } else {
        None
    };
    match head.layout().scheme().axis() {
        Axis::PerChannel => {
            let gl = head.layout().group_len();
            let (mut sc, mut ze, mut qs) = (Buf::new(hdp), Buf::new(hdp), Buf::new(nq * hdp));
            let mut bias = vec![0f32; nq];
            // 2- and 4-bit rows whose field vectors come from the same
            // bytes: one widening per byte vector (see `nibble_queries`).
            let nib = matches!(B, 2 | 4) && fused && (hd * B as usize / 8).is_multiple_of(S::L);
            // The fused kernel prefetches per token.
            let pf = BlockAhead::new(head, fused);
            // `f16` params and whole vectors: each block's folded queries
            // and biases straight from the stored bytes, in registers.
            let direct = p.fmt == ScaleFormat::F16 && hd == hdp && g.nch <= MAX_NCH;
            let set = hd * 2 * if p.sym { 1 } else { 2 };
            if !fused {
                scr = Buf::new(S::T * hdp);
            }
            for k in 0..t_all.div_ceil(gl) {
                pf.block(k);
                if direct {
                    let src = &head.params()[k * set..(k + 1) * set];
                    // SAFETY: `src` holds the block's `set` bytes; `qp`/`qs`
                    // `hdp = nch·L` floats per query, `bias` `nq` floats.
                    unsafe {
                        block_queries_f16(
                            s,
                            src.as_ptr(),
                            &p,
                            g.nch,
                            qp.s().as_ptr(),
                            hdp,
                            qs.m().as_mut_ptr(),
                            &mut bias,
                            nib.then_some(B as u32),
                        )
                    };
                } else {
                    block_params(s, head, &p, hd, k, sc.m(), ze.m());
                    for (i, bias) in bias.iter_mut().enumerate() {
                        let mut b = s.zero();
                        for j in 0..g.nch {
                            let o = i * hdp + j * S::L;
                            // SAFETY: vector `j < nch` of buffers of `hdp`
                            // floats per query (`qp`, `qs`) or of `hdp` (`sc`, `ze`).
                            unsafe {
                                let qv = s.load(qp.s().as_ptr().add(o));
                                let sv = s.load(sc.s().as_ptr().add(j * S::L));
                                s.store(qs.m().as_mut_ptr().add(o), s.mul(qv, sv));
                                b = s.fma(qv, s.load(ze.s().as_ptr().add(j * S::L)), b);
                            }
                        }
                        *bias = s.hsum(b);
                    }
                }
                if nib && !direct {
                    nibble_queries(qs.m(), nq, hd, hdp, B as u32);
                }
                let t_end = ((k + 1) * gl).min(t_all);
                let mut t0 = k * gl;
                while t0 < t_end {
                    let n = S::T.min(t_end - t0);
                    let rows = codes.wrapping_add(t0 * g.rb);
                    let ah = pf.tile(t0, n);
                    for i in 0..nq {
                        // SAFETY: rows `t0..t0+n ≤ tokens` are in `codes`
                        // (check_head); the scratch holds `T` rows of `hdp`,
                        // `accbuf` `T` vectors per query, `qs` `hdp` floats
                        // per query.
                        let r = unsafe {
                            if const { HD > 0 } && fused {
                                let (qp, ap) = (qs.s().as_ptr(), accbuf.m().as_mut_ptr());
                                match (i, nib, &mut t3) {
                                    (0, true, _) => fused_scores_tile::<S, B, Raw, true, HD>(
                                        s, g, rows, n, Raw, qp, nq, ap, ah,
                                    ),
                                    (0, false, Some(t3)) => {
                                        let r8 = t3.load(s, rows, g.rb, n);
                                        fused_scores_tile::<S, 8, Raw, false, HD>(
                                            s,
                                            t3.geo(g),
                                            r8,
                                            n,
                                            Raw,
                                            qp,
                                            nq,
                                            ap,
                                            ah,
                                        )
                                    }
                                    (0, false, None) => fused_scores_tile::<S, B, Raw, false, HD>(
                                        s, g, rows, n, Raw, qp, nq, ap, ah,
                                    ),
                                    _ => {}
                                }
                                reduce_query(s, accbuf.s().as_ptr(), i)
                            } else {
                                if i == 0 {
                                    unpack_tile::<S, B, Raw>(
                                        s,
                                        g,
                                        rows,
                                        n,
                                        scr.m().as_mut_ptr(),
                                        u8buf.as_mut_ptr(),
                                        Raw,
                                    );
                                }
                                dot_tile(s, scr.s().as_ptr(), g.nch, qs.s().as_ptr().add(i * hdp))
                            }
                        };
                        let r = s.add(r, s.splat(bias[i]));
                        store_lanes(s, r, &mut out[i * t_all + t0..i * t_all + t0 + n]);
                    }
                    t0 += n;
                }
            }
        }
        Axis::PerToken => {
            let mut tp = TileParams::new::<S>(head, g, p);
            let mut t0 = 0;
            let fused = fused && tp.rows.is_none();
            tp.spread = fused;
            if !fused {
                scr = Buf::new(S::T * hdp);
            }
            while t0 < t_all {
                let n = S::T.min(t_all - t0);
                tp.load(s, head, t0, n);
                // SAFETY: as in the per-channel arm; `tp` holds this tile's params.
                unsafe {
                    let (rows, sp, u8b) = (
                        codes.add(t0 * g.rb),
                        scr.m().as_mut_ptr(),
                        u8buf.as_mut_ptr(),
                    );
                    match tp.deq_rows() {
                        _ if const { HD > 0 } && fused => match &mut t3 {
                            Some(t3) => {
                                let r8 = t3.load(s, rows, g.rb, n);
                                fused_scores_tile::<S, 8, PerToken, false, HD>(
                                    s,
                                    t3.geo(g),
                                    r8,
                                    n,
                                    tp.deq(),
                                    qp.s().as_ptr(),
                                    nq,
                                    accbuf.m().as_mut_ptr(),
                                    tp.ahead(head, t0),
                                )
                            }
                            None => fused_scores_tile::<S, B, PerToken, false, HD>(
                                s,
                                g,
                                rows,
                                n,
                                tp.deq(),
                                qp.s().as_ptr(),
                                nq,
                                accbuf.m().as_mut_ptr(),
                                tp.ahead(head, t0),
                            ),
                        },
                        None => unpack_tile::<S, B, PerToken>(s, g, rows, n, sp, u8b, tp.deq()),
                        Some(d) => unpack_tile::<S, B, Rows>(s, g, rows, n, sp, u8b, d),
                    }
                }
                for i in 0..nq {
                    // SAFETY: `qp` holds `hdp` floats per query, `accbuf`
                    // `T` vectors per query.
                    let r = unsafe {
                        if fused {
                            reduce_query(s, accbuf.s().as_ptr(), i)
                        } else {
                            dot_tile(s, scr.s().as_ptr(), g.nch, qp.s().as_ptr().add(i * hdp))
                        }
                    };
                    store_lanes(s, r, &mut out[i * t_all + t0..i * t_all + t0 + n]);
                }
                t0 += n;
            }
        }
    }
}
