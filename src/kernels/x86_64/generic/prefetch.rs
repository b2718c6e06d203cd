//! Software prefetch of the code and parameter streams.

use super::*;

/// How many tokens ahead of the tile being computed the kernels ask for
/// the code and parameter streams. Decode streams the cache from DRAM and
/// the hardware prefetchers stop at every 4 KiB page; a software prefetch
/// this far ahead (4 KiB of codes for 4-bit rows of 128) keeps the next
/// pages in flight while the current tile is computed (measured in
/// `docs/PERFORMANCE.md`).
pub(crate) const PREFETCH_TOKENS: usize = 64;

/// How far ahead the dense baselines ask for their rows, into L2
/// (`prefetcht1`). The dense kernels' compute per byte is light, so they
/// need more bytes in flight than the packed ones: on the AMD EPYC (Zen 4)
/// development VM this is ≈1.2x faster than [`PREFETCH_TOKENS`] into L1,
/// and on an Ice Lake VM an L2 hint and twice the distance each
/// measured the same (`docs/perf/records/2026-11-30-zen4.md`). A
/// baseline that streams slower than it could would flatter the packed
/// kernels.
pub(crate) const DENSE_PREFETCH_TOKENS: usize = 128;

/// Hint the cache lines covering `len` bytes from `p` into L1/L2.
///
/// A prefetch never faults, so `p` may point anywhere (the address is
/// formed with `wrapping_add` and only used as a hint).
#[inline(always)]
pub(crate) fn prefetch(p: *const u8, len: usize) {
    prefetch_to::<{ core::arch::x86_64::_MM_HINT_T0 }>(p, len);
}

/// [`prefetch`] with the hint `H` (`_MM_HINT_T0` into L1, `_MM_HINT_T1`
/// into L2).
#[inline(always)]
pub(crate) fn prefetch_to<const H: i32>(p: *const u8, len: usize) {
    let mut o = 0;
    while o < len + 63 {
        // SAFETY: a prefetch is a hint: it reads nothing into the program
        // and never faults, whatever the address (SSE, baseline on x86-64).
        unsafe { core::arch::x86_64::_mm_prefetch::<H>(p.wrapping_add(o) as *const i8) };
        o += 64;
    }
}

/// Prefetch the stream `base` of `per` bytes per token for the `n` tokens
/// [`PREFETCH_TOKENS`] after token `t0`, those of them before token
/// `tokens` (the stream's end: past it lies other memory, and asking for
/// it only takes bandwidth from the stream, which a buffer of a few dozen
/// tokens, a small page, would otherwise pay several times over).
#[inline(always)]
pub(crate) fn prefetch_ahead(base: *const u8, per: usize, t0: usize, n: usize, tokens: usize) {
    let a = t0 + PREFETCH_TOKENS;
    let n = n.min(tokens.saturating_sub(a));
    if n > 0 {
        prefetch(base.wrapping_add(a * per), n * per);
    }
}

/// Ask for the first [`PREFETCH_TOKENS`] tokens of a stream of `per`
/// bytes per token and `tokens` tokens, ahead of the call that reads it
/// (the next page of a cache, while the current one is computed).
#[inline(always)]
pub(crate) fn prefetch_start(base: *const u8, per: usize, tokens: usize) {
    prefetch(base, PREFETCH_TOKENS.min(tokens) * per);
}

/// One stream's prefetch spread over a tile's tokens: token `tt` asks for
/// the lines that start within its bytes [`PREFETCH_TOKENS`] ahead (each
/// line once), so the requests go out between the vector work instead
/// of as a burst at the tile's start (measured faster, most for the dense
/// f16 kernels: `docs/perf/records/2026-11-30-icelake.md`).
#[derive(Clone, Copy)]
pub(crate) struct Ahead {
    pub(crate) p: *const u8,
    pub(crate) per: usize,
    /// The stream's end (nothing at or past it is asked for).
    pub(crate) end: usize,
}

impl Ahead {
    /// No stream.
    pub(crate) const NONE: Ahead = Ahead {
        p: core::ptr::null(),
        per: 0,
        end: 0,
    };

    /// The stream `base` of `per` bytes per token and `tokens` tokens, for
    /// the tile at `t0`.
    #[inline(always)]
    pub(crate) fn new(base: *const u8, per: usize, t0: usize, tokens: usize) -> Ahead {
        Ahead {
            p: base.wrapping_add((t0 + PREFETCH_TOKENS) * per),
            per,
            end: (base as usize).wrapping_add(tokens * per),
        }
    }

    /// Prefetch the lines that start within token `tt`'s bytes: each line
    /// once, by the token it starts in, so a stream of 4 bytes per token
    /// (a row's f16 scales) asks once per 16 tokens, not once per token.
    /// Asking for every token's line measured up to a fifth slower on the
    /// Zen 5 VM at head_dim 64 (`docs/PERFORMANCE.md`, "Prefetch once per
    /// line").
    #[inline(always)]
    pub(crate) fn token(self, tt: usize) {
        self.token_to::<{ core::arch::x86_64::_MM_HINT_T0 }>(tt);
    }

    /// [`Ahead::token`] with the hint `H`.
    #[inline(always)]
    pub(crate) fn token_to<const H: i32>(self, tt: usize) {
        let a = self.p.wrapping_add(tt * self.per);
        if a as usize >= self.end {
            return;
        }
        let end = a as usize + self.per;
        let mut l = (a as usize).next_multiple_of(64);
        while l < end {
            // SAFETY: a prefetch is a hint: it reads nothing into the
            // program and never faults, whatever the address.
            unsafe {
                core::arch::x86_64::_mm_prefetch::<H>(a.wrapping_add(l - a as usize) as *const i8)
            };
            l += 64;
        }
    }
}

/// The prefetch of a per-channel kernel, whose params come as one set per
/// block of `gl` tokens: spread over the tokens like the codes (the params
/// as `set/gl` bytes per token) when the set divides evenly and the kernel
/// calls [`Ahead::token`], otherwise one set per block and each tile's
/// codes as a burst.
#[derive(Clone, Copy)]
pub(crate) struct BlockAhead {
    pub(crate) codes: *const u8,
    pub(crate) rb: usize,
    pub(crate) params: *const u8,
    pub(crate) set: usize,
    pub(crate) gl: usize,
    pub(crate) spread: bool,
    pub(crate) tokens: usize,
}

impl BlockAhead {
    /// For `head`; `per_token`: the kernel calls [`Ahead::token`].
    #[inline(always)]
    pub(crate) fn new(head: &PackedHead<'_>, per_token: bool) -> BlockAhead {
        let l = head.layout();
        let (set, gl) = (head.set_len() * l.scheme().param_bytes(), l.group_len());
        BlockAhead {
            codes: head.codes().as_ptr(),
            rb: l.row_bytes(),
            params: head.params().as_ptr(),
            set,
            gl,
            spread: per_token && set.is_multiple_of(gl),
            tokens: head.tokens(),
        }
    }

    /// At the start of block `k`.
    #[inline(always)]
    pub(crate) fn block(&self, k: usize) {
        let ahead = k + PREFETCH_TOKENS.div_ceil(self.gl);
        if !self.spread && ahead < self.tokens.div_ceil(self.gl) {
            prefetch(self.params.wrapping_add(ahead * self.set), self.set);
        }
    }

    /// For the tile of `n` tokens at `t0`: the per-token streams, or
    /// (after a burst of the codes) none.
    #[inline(always)]
    pub(crate) fn tile(&self, t0: usize, n: usize) -> [Ahead; 2] {
        if self.spread {
            [
                Ahead::new(self.codes, self.rb, t0, self.tokens),
                Ahead::new(self.params, self.set / self.gl, t0, self.tokens),
            ]
        } else {
            prefetch_ahead(self.codes, self.rb, t0, n, self.tokens);
            [Ahead::NONE; 2]
        }
    }
}
