//! Pages of packed tokens, and the pool that can supply them.
//!
//! Every packed token of a tensor lives in a page: per head codes and the
//! params for a fixed number of tokens. Pages are reference-counted and
//! written only while one cache holds them, so a fork shares every page,
//! the one being filled included, and the first write to a shared page
//! copies it (copy on write).

use super::*;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Mutex;

/// Packed tokens per page of a cache outside a pool. A page is one kernel
/// call per head when attending, and each call starts its prefetching
/// cold: at 1024 tokens that cost 12 % of a GQA-4 decode step at 32k
/// tokens, at 4096 it is within the noise. Outside a pool a page's buffers
/// grow by doubling, so what they hold beyond [`LayerCache::bytes`] is
/// under a page whatever the length.
pub(super) const PAGE_TOKENS: usize = 4096;

/// Most tokens a pool's page may hold (a page is allocated whole).
pub const MAX_PAGE_TOKENS: usize = 1 << 20;

/// One page's buffers: codes per head, params per head (or one buffer
/// for schemes that share them across heads), and outlier entries per
/// head (none for formats without).
#[derive(Debug)]
pub(super) struct Page {
    pub(super) codes: Vec<Vec<u8>>,
    pub(super) params: Vec<Vec<u8>>,
    pub(super) outliers: Vec<Vec<u8>>,
    /// The pool the buffers belong to, the bytes of them it was last told
    /// are filled, and each code, param and outlier buffer's size.
    home: Option<Arc<PoolInner>>,
    counted: usize,
    sizes: [usize; 3],
}

/// Byte ranges of a page's three kinds of buffers.
pub(super) type Ranges = [std::ops::Range<usize>; 3];

impl Page {
    /// Bytes filled.
    fn filled(&self) -> usize {
        self.codes
            .iter()
            .chain(&self.params)
            .chain(&self.outliers)
            .map(Vec::len)
            .sum()
    }

    /// Tell the pool how many bytes are filled now (after a write).
    pub(super) fn sync(&mut self) {
        if let Some(p) = &self.home {
            let now = self.filled();
            if now >= self.counted {
                p.stored.fetch_add(now - self.counted, Relaxed);
            } else {
                p.stored.fetch_sub(self.counted - now, Relaxed);
            }
            self.counted = now;
        }
    }

    /// Append range `r[0]` of each of `src[0]` to the code buffers, `r[1]`
    /// of each of `src[1]` to the param buffers and `r[2]` of each of
    /// `src[2]` to the outlier buffers.
    pub(super) fn extend_from(&mut self, src: [&[Vec<u8>]; 3], r: &Ranges) {
        let dst = [&mut self.codes, &mut self.params, &mut self.outliers];
        for ((d, s), r) in dst.into_iter().zip(src).zip(r) {
            for (d, s) in d.iter_mut().zip(s) {
                d.extend_from_slice(&s[r.clone()]);
            }
        }
        self.sync();
    }

    /// Keep the first `n[0]` code bytes of every head, `n[1]` bytes of
    /// every param buffer and `n[2]` of every outlier buffer.
    pub(super) fn truncate(&mut self, n: [usize; 3]) {
        self.codes.iter_mut().for_each(|c| c.truncate(n[0]));
        self.params.iter_mut().for_each(|p| p.truncate(n[1]));
        self.outliers.iter_mut().for_each(|p| p.truncate(n[2]));
        self.sync();
    }

    /// The three kinds of buffers, for copying from.
    pub(super) fn bufs(&self) -> [&[Vec<u8>]; 3] {
        [&self.codes, &self.params, &self.outliers]
    }

    /// Whether the pool supplied it (its buffers are a whole page).
    pub(super) fn pooled(&self) -> bool {
        self.home.is_some()
    }
}

impl Drop for Page {
    fn drop(&mut self) {
        let Some(p) = self.home.take() else { return };
        p.stored.fetch_sub(self.counted, Relaxed);
        p.pages.fetch_sub(1, Relaxed);
        let [cb, pb, ob] = self.sizes;
        let bufs = std::mem::take(&mut self.codes)
            .into_iter()
            .map(|b| (b, cb))
            .chain(
                std::mem::take(&mut self.params)
                    .into_iter()
                    .map(|b| (b, pb)),
            )
            .chain(
                std::mem::take(&mut self.outliers)
                    .into_iter()
                    .map(|b| (b, ob)),
            );
        let mut free = p.free.lock().unwrap_or_else(|e| e.into_inner());
        for (mut b, cap) in bufs {
            p.used.fetch_sub(cap, Relaxed);
            // Kept for the next page while what the pool holds stays within
            // its capacity; given back to the allocator otherwise.
            let held = p.used.load(Relaxed).saturating_add(free.bytes);
            if held.saturating_add(cap) <= p.capacity {
                b.clear();
                free.bytes += cap;
                free.bufs.entry(cap).or_default().push(b);
            }
        }
    }
}

/// Part of a page a cache holds: its first `tokens` tokens (another cache
/// sharing the page may hold more of it).
#[derive(Debug, Clone)]
pub(super) struct Segment {
    pub(super) data: Arc<Page>,
    pub(super) tokens: usize,
}

/// Page bytes set aside for the pages one call will take, so the call
/// either gets every page it needs or fails before changing anything.
#[derive(Debug)]
pub(super) struct Ticket {
    pool: Option<Arc<PoolInner>>,
    bytes: usize,
}

impl Ticket {
    /// A ticket of a cache outside any pool: pages come from the allocator.
    pub(super) fn none() -> Self {
        Ticket {
            pool: None,
            bytes: 0,
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(p) = &self.pool {
            p.used.fetch_sub(self.bytes, Relaxed);
        }
    }
}

/// A shared supply of pages for the caches of many sequences, with an
/// optional limit on the bytes their packed tokens may take.
///
/// Caches made with [`LayerCache::new_in`] take every page from their
/// pool and give it back when no cache holds it any more (a sequence
/// dropped, truncated, or a fork's copy-on-write page replaced). Pages of
/// one pool share one size in tokens, rounded up per tensor to whole
/// quantized units (a per-channel key block never spans two pages). A
/// pool may serve every layer of a model, or one pool per layer.
///
/// With a capacity, an `append` or `extend` that needs pages beyond it
/// fails with [`Error::PoolExhausted`] and changes nothing:
/// the engine then frees or preempts a sequence, as a paged serving
/// engine does. The capacity counts packed pages only; each cache's
/// sinks and residual window (full precision, bounded by the
/// configuration) are its own.
///
/// Freed pages' buffers are kept for the next page while the pool's
/// pages and kept buffers stay within the capacity (all of them, for a
/// pool without one); [`trim`](Self::trim) gives them back to the
/// allocator. A `PagePool` is a handle: clones share one pool.
///
/// # Example
/// ```
/// use kvq::{cache::PagePool, presets, CacheConfig, Error, LayerCache};
/// let (keys, values) = presets::kivi(4)?;
/// let cfg = CacheConfig::new(2, 64).keys(keys).values(values);
/// // Pages of 256 tokens; room for 16 pages of this layer's keys and values.
/// let page = cfg.page_bytes(256)?;
/// let pool = PagePool::new(256, Some(16 * page))?;
/// let row: Vec<f32> = (0..128).map(|c| (c % 7) as f32 / 7.0).collect();
/// let mut seqs = Vec::new();
/// for _ in 0..4 {
///     let mut s = LayerCache::new_in(cfg, &pool)?;
///     for _ in 0..1000 {
///         s.append(&row, &row)?;
///     }
///     seqs.push(s);
/// }
/// // 4 sequences × 4 pages each of K and V: the pool is full.
/// let mut fifth = LayerCache::new_in(cfg, &pool)?;
/// assert!(matches!(fifth.append(&row, &row), Err(Error::PoolExhausted { .. })));
/// assert!(fifth.is_empty());
/// // Freeing a sequence returns its pages. (The fifth's first key waits
/// // in full precision for its block of 32: one page, of values.)
/// seqs.pop();
/// fifth.append(&row, &row)?;
/// let s = pool.stats();
/// assert_eq!(s.pages, 3 * 8 + 1);
/// assert!(s.fragmentation() < 0.1);
/// # Ok::<(), kvq::Error>(())
/// ```
#[derive(Clone)]
pub struct PagePool {
    inner: Arc<PoolInner>,
}

#[derive(Debug)]
pub(super) struct PoolInner {
    page_tokens: usize,
    capacity: usize,
    /// Bytes of buffers held by pages, and of tickets' reservations.
    used: AtomicUsize,
    /// Bytes of packed tokens written into held pages.
    stored: AtomicUsize,
    pages: AtomicUsize,
    free: Mutex<Free>,
}

/// Buffers of freed pages, by capacity.
#[derive(Debug, Default)]
struct Free {
    bufs: HashMap<usize, Vec<Vec<u8>>>,
    bytes: usize,
}

/// What a [`PagePool`] holds at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolStats {
    /// Tokens per page (before rounding to a tensor's quantized unit).
    pub page_tokens: usize,
    /// The limit on `used` (`None`: unlimited).
    pub capacity: Option<usize>,
    /// Pages held by caches (a page shared by forks counts once).
    pub pages: usize,
    /// Bytes of the held pages (whole pages) and of pages set aside for a
    /// call in progress.
    pub used: usize,
    /// Bytes of packed tokens in the held pages.
    pub stored: usize,
    /// Bytes of freed pages' buffers kept for reuse.
    pub kept: usize,
}

impl PoolStats {
    /// Bytes that may still be taken (`usize::MAX` when unlimited).
    pub fn free(&self) -> usize {
        self.capacity
            .map_or(usize::MAX, |c| c.saturating_sub(self.used))
    }

    /// The share of the held pages' bytes that holds no token: the
    /// partly filled last page of each sequence (0 when no page is held).
    pub fn fragmentation(&self) -> f64 {
        if self.used == 0 {
            0.0
        } else {
            1.0 - self.stored as f64 / self.used as f64
        }
    }
}

impl std::fmt::Debug for PagePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PagePool")
            .field("stats", &self.stats())
            .finish()
    }
}

impl PagePool {
    /// A pool of pages of `page_tokens` tokens, limited to `capacity`
    /// bytes of pages (`None`: unlimited).
    ///
    /// Small pages waste less of each sequence's last page; large pages
    /// attend faster (one kernel call per page and head).
    /// `docs/PERFORMANCE.md` has the measured cost.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `page_tokens` is 0 or more than
    /// [`MAX_PAGE_TOKENS`].
    pub fn new(page_tokens: usize, capacity: Option<usize>) -> Result<Self> {
        if page_tokens == 0 || page_tokens > MAX_PAGE_TOKENS {
            return Err(Error::InvalidArgument {
                op: "PagePool::new",
                what: format!("pages hold 1 to {MAX_PAGE_TOKENS} tokens, not {page_tokens}"),
            });
        }
        Ok(PagePool {
            inner: Arc::new(PoolInner {
                page_tokens,
                capacity: capacity.unwrap_or(usize::MAX),
                used: AtomicUsize::new(0),
                stored: AtomicUsize::new(0),
                pages: AtomicUsize::new(0),
                free: Mutex::new(Free::default()),
            }),
        })
    }

    /// Tokens per page, as asked for.
    pub fn page_tokens(&self) -> usize {
        self.inner.page_tokens
    }

    /// What the pool holds now.
    pub fn stats(&self) -> PoolStats {
        let p = &self.inner;
        let kept = p.free.lock().unwrap_or_else(|e| e.into_inner()).bytes;
        PoolStats {
            page_tokens: p.page_tokens,
            capacity: (p.capacity != usize::MAX).then_some(p.capacity),
            pages: p.pages.load(Relaxed),
            used: p.used.load(Relaxed),
            stored: p.stored.load(Relaxed),
            kept,
        }
    }

    /// Give the kept buffers of freed pages back to the allocator.
    pub fn trim(&self) {
        let mut free = self.inner.free.lock().unwrap_or_else(|e| e.into_inner());
        *free = Free::default();
    }

    /// Whether `a` and `b` are handles of one pool.
    pub fn same(a: &PagePool, b: &PagePool) -> bool {
        Arc::ptr_eq(&a.inner, &b.inner)
    }

    pub(super) fn handle(&self) -> Arc<PoolInner> {
        self.inner.clone()
    }
}

/// Set aside `bytes` of `pool` for a call (`op`), or fail.
pub(super) fn reserve(
    op: &'static str,
    pool: Option<&Arc<PoolInner>>,
    bytes: usize,
) -> Result<Ticket> {
    let Some(p) = pool else {
        return Ok(Ticket::none());
    };
    if bytes == 0 {
        // Nothing to set aside: a call that takes no page never fails.
        return Ok(Ticket {
            pool: Some(p.clone()),
            bytes: 0,
        });
    }
    let mut now = p.used.load(Relaxed);
    loop {
        let after = now.checked_add(bytes).filter(|&a| a <= p.capacity);
        let Some(after) = after else {
            return Err(Error::PoolExhausted {
                op,
                need: bytes,
                free: p.capacity.saturating_sub(now),
            });
        };
        match p.used.compare_exchange_weak(now, after, Relaxed, Relaxed) {
            Ok(_) => break,
            Err(x) => now = x,
        }
    }
    Ok(Ticket {
        pool: Some(p.clone()),
        bytes,
    })
}

/// The page size in tokens of a tensor quantized `unit` tokens at a time.
pub(super) fn page_tokens(pool: Option<&Arc<PoolInner>>, unit: usize) -> usize {
    let want = pool.map_or(PAGE_TOKENS, |p| p.page_tokens);
    want.div_ceil(unit).saturating_mul(unit)
}

/// A new empty page with `n[i]` buffers of `size[i]` bytes each for codes,
/// params and outlier entries: whole, from the ticket's pool, or empty
/// (grown as filled) outside a pool.
pub(super) fn new_page(ticket: &mut Ticket, n: [usize; 3], size: [usize; 3]) -> Page {
    let Some(p) = ticket.pool.clone() else {
        return Page {
            codes: vec![Vec::new(); n[0]],
            params: vec![Vec::new(); n[1]],
            outliers: vec![Vec::new(); n[2]],
            home: None,
            counted: 0,
            sizes: [0; 3],
        };
    };
    let bytes = n[0] * size[0] + n[1] * size[1] + n[2] * size[2];
    // The reservation covers the page; a ticket short of it (a count
    // that missed a page) takes the bytes beyond it anyway rather than
    // fail half way through a write.
    let from_ticket = bytes.min(ticket.bytes);
    ticket.bytes -= from_ticket;
    p.used.fetch_add(bytes - from_ticket, Relaxed);
    debug_assert_eq!(from_ticket, bytes, "a call took a page it did not reserve");
    p.pages.fetch_add(1, Relaxed);
    let mut free = p.free.lock().unwrap_or_else(|e| e.into_inner());
    let mut take = |cap: usize| match free.bufs.get_mut(&cap).and_then(Vec::pop) {
        Some(b) => {
            free.bytes -= cap;
            b
        }
        None => Vec::with_capacity(cap),
    };
    let codes = (0..n[0]).map(|_| take(size[0])).collect();
    let params = (0..n[1]).map(|_| take(size[1])).collect();
    let outliers = (0..n[2]).map(|_| take(size[2])).collect();
    // Keep what the pool holds within its capacity: kept buffers are let
    // go until it fits.
    let over = (p.used.load(Relaxed).saturating_add(free.bytes)).saturating_sub(p.capacity);
    if over > 0 {
        let mut left = over;
        free.bufs.retain(|cap, v| {
            while left > 0 && v.pop().is_some() {
                left = left.saturating_sub(*cap);
            }
            !v.is_empty()
        });
        free.bytes = free.bufs.iter().map(|(c, v)| c * v.len()).sum();
    }
    drop(free);
    Page {
        codes,
        params,
        outliers,
        home: Some(p),
        counted: 0,
        sizes: size,
    }
}
