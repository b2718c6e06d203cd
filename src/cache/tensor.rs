//! One of K or V of a layer: the sink, packed and residual regions and their appends.

use super::*;

/// One of K or V of a layer.
#[derive(Debug)]
pub(super) struct Tensor {
    /// The stored format (`None`: full precision).
    pub(super) codec: Option<Arc<dyn KvCodec>>,
    pub(super) width: usize,
    pub(super) sinks: usize,
    pub(super) residual: usize,
    /// Sink rows, `[≤ sinks, width]`.
    pub(super) sink: Vec<f32>,
    /// Full-precision tail rows; live rows start at `tail_start`.
    pub(super) tail: Vec<f32>,
    pub(super) tail_start: usize,
    /// Packed tokens, in `pages`.
    pub(super) packed: usize,
    /// Packed tokens per page: the pool's page size (or [`PAGE_TOKENS`])
    /// rounded up to whole quantized units.
    pub(super) page: usize,
    /// The pages of packed tokens, oldest first; all but the last full.
    pub(super) pages: Vec<Segment>,
    /// Code buffers (one per head) and param buffers per page.
    pub(super) n_codes: usize,
    pub(super) n_params: usize,
    /// Where pages come from (`None`: the allocator).
    pub(super) pool: Option<Arc<PoolInner>>,
    /// Per-channel: running min/max of the block being filled.
    pub(super) pend: Pending,
}

impl Clone for Tensor {
    /// Shares every page; copies the sink and the live tail rows only.
    fn clone(&self) -> Self {
        Tensor {
            codec: self.codec.clone(),
            width: self.width,
            sinks: self.sinks,
            residual: self.residual,
            sink: self.sink.clone(),
            tail: self.tail_slice().to_vec(),
            tail_start: 0,
            packed: self.packed,
            page: self.page,
            pages: self.pages.clone(),
            n_codes: self.n_codes,
            n_params: self.n_params,
            pool: self.pool.clone(),
            pend: self.pend.clone(),
        }
    }
}

impl PartialEq for Tensor {
    /// Equal when every stored number agrees (ignoring spare capacity and
    /// the dead prefix of the tail).
    fn eq(&self, o: &Self) -> bool {
        self.codec.as_ref().map(|c| c.spec()) == o.codec.as_ref().map(|c| c.spec())
            && self.sink == o.sink
            && self.tail_slice() == o.tail_slice()
            && self.packed == o.packed
            && [self.n_codes, self.n_params, self.n_codes]
                .into_iter()
                .enumerate()
                .all(|(kind, n)| (0..n).all(|i| self.buf(kind, i) == o.buf(kind, i)))
            && (!self.pending_live() || self.pend == o.pend)
    }
}

impl Tensor {
    pub(super) fn new(
        codec: Option<Arc<dyn KvCodec>>,
        n_kv: usize,
        hd: usize,
        sinks: usize,
        residual: usize,
        pool: Option<Arc<PoolInner>>,
    ) -> Self {
        let layout = codec.as_ref().map(|c| *c.layout());
        let np = match layout {
            Some(l) if l.shared_params() => 1,
            _ => n_kv,
        };
        let pc = matches!(layout, Some(l) if l.scheme().axis() == Axis::PerChannel);
        let unit = layout.map_or(1, |l| l.block_tokens());
        Tensor {
            codec,
            width: n_kv * hd,
            sinks,
            residual,
            sink: Vec::new(),
            tail: Vec::new(),
            tail_start: 0,
            packed: 0,
            page: page_tokens(pool.as_ref(), unit),
            pages: Vec::new(),
            n_codes: n_kv,
            n_params: np,
            pool,
            pend: Pending::new(if pc { n_kv * hd } else { 0 }),
        }
    }

    /// Whether the per-channel running range describes a block still
    /// being filled (once a block completes, the next row resets it, so
    /// its value is then of no consequence).
    pub(super) fn pending_live(&self) -> bool {
        match self.layout() {
            Some(l) if !self.pend.min.is_empty() => {
                !(self.packed + self.tail_rows()).is_multiple_of(l.block_tokens())
            }
            _ => false,
        }
    }

    /// The per-channel running range of `tail`, the full-precision rows
    /// after `packed` packed tokens, checked as an append of them would be
    /// (so a later append never meets a block it cannot quantize).
    pub(super) fn tail_pending(
        &self,
        op: &'static str,
        tail: &[f32],
        packed: usize,
    ) -> Result<Pending> {
        let mut p = Pending::new(self.pend.min.len());
        // A non-empty tail follows every sink position.
        self.check(
            op,
            tail,
            abs_max_finite(tail).0,
            self.sinks + packed,
            &mut p,
        )?;
        Ok(p)
    }

    /// Whether the codec maps rows into another space.
    pub(super) fn transforms(&self) -> bool {
        self.codec.as_ref().is_some_and(|c| c.transforms())
    }

    /// The codec's layout (`None`: full precision).
    pub(super) fn layout(&self) -> Option<Layout> {
        self.codec.as_ref().map(|c| *c.layout())
    }

    /// `rows` in the codec's stored space: a transformed copy, or `rows`
    /// itself when the codec stores them as given.
    pub(super) fn stored_rows<'a>(&self, rows: &'a [f32]) -> std::borrow::Cow<'a, [f32]> {
        match self.codec.as_ref().filter(|c| c.transforms()) {
            Some(c) => {
                let mut out = rows.to_vec();
                c.transform_in(&mut out);
                out.into()
            }
            None => rows.into(),
        }
    }

    pub(super) fn tail_rows(&self) -> usize {
        (self.tail.len() / self.width) - self.tail_start
    }

    pub(super) fn tail_slice(&self) -> &[f32] {
        &self.tail[self.tail_start * self.width..]
    }

    /// Tokens quantized at a time.
    pub(super) fn unit(&self) -> usize {
        self.layout().map_or(usize::MAX, |l| l.block_tokens())
    }

    /// Check that `rows` (tokens at positions `pos0..`, in the stored
    /// space) can be stored, and advance the per-channel pending state in
    /// `pend` accordingly. `abs_max` is the largest `|x|` of `rows` (all
    /// finite). Sink positions are stored exact and need no check.
    pub(super) fn check(
        &self,
        what: &'static str,
        rows: &[f32],
        abs_max: f32,
        pos0: usize,
        pend: &mut Pending,
    ) -> Result<()> {
        let Some(c) = &self.codec else { return Ok(()) };
        let n_sink = self.sinks.saturating_sub(pos0).min(rows.len() / self.width);
        let first = (pos0 + n_sink).saturating_sub(self.sinks);
        c.check(
            what,
            &rows[n_sink * self.width..],
            abs_max,
            first,
            n_sink,
            pend,
        )
    }

    /// Store checked rows at positions `pos0..`: sink positions first,
    /// then the tail; every unit of rows that leaves the residual window is
    /// quantized, straight from `rows` when none of its rows is in the tail
    /// yet (so prefill copies only the rows that stay full precision). The
    /// same bytes as storing the rows one at a time: units are always the
    /// oldest `unit` unquantized rows.
    pub(super) fn push_rows(
        &mut self,
        rows: &[f32],
        pos0: usize,
        backend: Backend,
        scratch: &mut Scratch,
        ticket: &mut Ticket,
    ) {
        let w = self.width;
        let n_sink = self.sinks.saturating_sub(pos0).min(rows.len() / w);
        self.sink.extend_from_slice(&rows[..n_sink * w]);
        let rows = &rows[n_sink * w..];
        let m = rows.len() / w;
        let unit = self.unit();
        if m == 0 || unit == usize::MAX {
            self.tail.extend_from_slice(rows);
            return;
        }
        let live = self.tail_rows();
        let total = live + m;
        // (`residual` may be `usize::MAX`: keep everything exact.)
        let units = total.saturating_sub(self.residual) / unit;
        // Units that start in the tail are completed and quantized there.
        let mixed = units.min(live.div_ceil(unit));
        let need = (mixed * unit).saturating_sub(live);
        self.tail.extend_from_slice(&rows[..need * w]);
        for _ in 0..mixed {
            self.flush(unit, backend, scratch, ticket);
        }
        let mut i = need;
        for _ in mixed..units {
            self.store_unit(&rows[i * w..(i + unit) * w], unit, backend, scratch, ticket);
            i += unit;
        }
        self.tail.extend_from_slice(&rows[i * w..]);
    }

    /// Quantize the oldest `unit` tail rows.
    pub(super) fn flush(
        &mut self,
        unit: usize,
        backend: Backend,
        scratch: &mut Scratch,
        ticket: &mut Ticket,
    ) {
        let w = self.width;
        let tail = std::mem::take(&mut self.tail);
        self.store_unit(
            &tail[self.tail_start * w..(self.tail_start + unit) * w],
            unit,
            backend,
            scratch,
            ticket,
        );
        self.tail = tail;
        self.tail_start += unit;
    }

    /// Drop the tail's dead prefix once it outweighs the live rows (after
    /// an append has succeeded: until then [`rollback`](Self::rollback)
    /// may revive those rows).
    pub(super) fn compact(&mut self) {
        let w = self.width;
        if self.tail_start * w == self.tail.len() {
            self.tail.clear();
            self.tail_start = 0;
        } else if self.tail_start > 64 && self.tail_start * 2 > self.tail.len() / w {
            self.tail.drain(..self.tail_start * w);
            self.tail_start = 0;
        }
    }

    /// [`compact`](Self::compact) in the middle of an append: drop only
    /// dead rows added since `m`, so a rollback still finds the rows it
    /// revives. Keeps the tail bounded during a long `extend`.
    pub(super) fn compact_since(&mut self, m: &Mark) {
        let w = self.width;
        let keep = m.tail / w;
        let rows = self.tail.len() / w;
        if self.tail_start > keep + 64 && (self.tail_start - keep) * 2 > rows - keep {
            self.tail.drain(keep * w..self.tail_start * w);
            self.tail_start = keep;
        }
    }

    /// Where every growing buffer ends, for [`rollback`](Self::rollback).
    pub(super) fn mark(&self) -> Mark {
        Mark {
            sink: self.sink.len(),
            tail: self.tail.len(),
            tail_start: self.tail_start,
            packed: self.packed,
        }
    }

    /// Undo everything stored since `m` was taken (no compaction may have
    /// run in between).
    pub(super) fn rollback(&mut self, m: &Mark) {
        self.sink.truncate(m.sink);
        self.tail.truncate(m.tail);
        self.tail_start = m.tail_start;
        self.drop_packed(m.packed);
    }

    /// Keep the first `packed` packed tokens (a multiple of the unit).
    /// Pages past the cut are let go; a page the cut lands in is cut in
    /// place when no fork holds it, and otherwise only this tensor's share
    /// of it shrinks (the copy waits for the next write).
    fn drop_packed(&mut self, packed: usize) {
        let mut left = packed;
        self.pages.retain_mut(|seg| {
            seg.tokens = seg.tokens.min(left);
            left -= seg.tokens;
            seg.tokens > 0
        });
        self.packed = packed;
        let np = self.n_params;
        if let (Some(l), Some(seg)) = (self.layout(), self.pages.last_mut()) {
            if let Some(p) = Arc::get_mut(&mut seg.data) {
                p.truncate(buf_lens(&l, np, seg.tokens));
            }
        }
    }

    /// Bytes of the pages an append of `n` rows at position `pos0` takes:
    /// a copy of a shared last page it writes into, and the new pages
    /// after it.
    pub(super) fn page_bytes_for(&self, n: usize, pos0: usize) -> usize {
        let added = self.packs(n, pos0);
        let pages = match self.pages.last() {
            _ if added == 0 => 0,
            Some(s) if s.tokens < self.page => {
                let copy = Arc::strong_count(&s.data) > 1;
                usize::from(copy) + (s.tokens + added).div_ceil(self.page) - 1
            }
            _ => added.div_ceil(self.page),
        };
        pages.saturating_mul(self.page_bytes())
    }

    /// Packed tokens an append of `n` rows at position `pos0` stores (what
    /// [`push_rows`](Self::push_rows) quantizes).
    fn packs(&self, n: usize, pos0: usize) -> usize {
        let m = n - self.sinks.saturating_sub(pos0).min(n);
        let unit = self.unit();
        if m == 0 || unit == usize::MAX {
            return 0;
        }
        (self.tail_rows() + m).saturating_sub(self.residual) / unit * unit
    }

    /// Bytes of one whole page.
    pub(super) fn page_bytes(&self) -> usize {
        self.layout().map_or(0, |l| l.bytes(self.page))
    }

    /// Make the last page writable with room for the next unit: the last
    /// page when it has room (copied first if a fork shares it), else a
    /// new one.
    fn writable_page(&mut self, l: &Layout, ticket: &mut Ticket) {
        let np = self.n_params;
        let (n, size) = (self.buf_counts(l), buf_lens(l, np, self.page));
        if self.pages.last().is_none_or(|s| s.tokens == self.page) {
            let data = Arc::new(new_page(ticket, n, size));
            self.pages.push(Segment { data, tokens: 0 });
        }
        let seg = self.pages.last_mut().expect("a page was just ensured");
        let now = buf_lens(l, np, seg.tokens);
        match Arc::get_mut(&mut seg.data) {
            // Bytes past this tensor's share are from before a truncate.
            Some(p) => p.truncate(now),
            None => {
                let mut p = new_page(ticket, n, size);
                p.extend_from(seg.data.bufs(), &now.map(|b| 0..b));
                seg.data = Arc::new(p);
            }
        }
    }

    /// Give each buffer of an allocator page room for one more unit:
    /// doubling, as a `Vec` grows, but never past a whole page, so a
    /// short cache holds at most twice its bytes and a long one at most a
    /// page more. (A pool's pages are whole from the start.)
    fn reserve_unit(p: &mut Page, l: &Layout, unit: usize, live: usize, page: usize, np: usize) {
        if p.pooled() {
            return;
        }
        let grow = |v: &mut Vec<u8>, now: usize, page: usize| {
            if v.capacity() < v.len() + now {
                let cap = (2 * v.capacity())
                    .max(v.len() + now)
                    .min(page.max(v.len() + now));
                v.reserve_exact(cap - v.len());
            }
        };
        let (a, b, whole) = (
            buf_lens(l, np, live),
            buf_lens(l, np, live + unit),
            buf_lens(l, np, page),
        );
        for (i, bufs) in [&mut p.codes, &mut p.params, &mut p.outliers]
            .into_iter()
            .enumerate()
        {
            for v in bufs {
                grow(v, b[i] - a[i], whole[i]);
            }
        }
    }

    /// Set the packed tokens to `packed`, whose codes, param and outlier
    /// buffers are given whole (as a load reads them), split into pages.
    pub(super) fn set_packed(&mut self, bufs: [&[Vec<u8>]; 3], packed: usize, ticket: &mut Ticket) {
        self.pages.clear();
        self.packed = packed;
        let Some(l) = self.layout() else { return };
        let np = self.n_params;
        let (n, size) = (self.buf_counts(&l), buf_lens(&l, np, self.page));
        let mut t0 = 0;
        while t0 < packed {
            let t = self.page.min(packed - t0);
            let mut p = new_page(ticket, n, size);
            let (a, b) = (buf_lens(&l, np, t0), buf_lens(&l, np, t0 + t));
            p.extend_from(bufs, &[a[0]..b[0], a[1]..b[1], a[2]..b[2]]);
            self.pages.push(Segment {
                data: Arc::new(p),
                tokens: t,
            });
            t0 += t;
        }
    }

    /// Bytes of param buffer `i` for `t` tokens.
    fn param_len(&self, l: &Layout, t: usize) -> usize {
        param_len(l, self.n_params, t)
    }

    /// How many code, param and outlier buffers a page holds.
    pub(super) fn buf_counts(&self, l: &Layout) -> [usize; 3] {
        let no = if l.outliers() > 0 { self.n_codes } else { 0 };
        [self.n_codes, self.n_params, no]
    }

    /// Head `h`'s packed tokens as views, one per page, each with its
    /// first packed position.
    pub(super) fn views(&self, h: usize) -> Vec<(usize, PackedHead<'_>)> {
        self.views_in(h, 0, self.packed).collect()
    }

    /// [`views`](Self::views) of the pages that hold packed positions in
    /// `a..b` (each view whole).
    fn views_in(
        &self,
        h: usize,
        a: usize,
        b: usize,
    ) -> impl Iterator<Item = (usize, PackedHead<'_>)> + '_ {
        let l = self.layout();
        let pi = match l {
            Some(l) if l.shared_params() => 0,
            _ => h,
        };
        // Every page but the last is full.
        let first = a.checked_div(self.page).unwrap_or(0);
        let pages = if l.is_some() {
            &self.pages[first.min(self.pages.len())..]
        } else {
            &[]
        };
        pages
            .iter()
            .scan(first * self.page, |start, seg| {
                let s0 = *start;
                *start += seg.tokens;
                Some((s0, seg))
            })
            .take_while(move |(s0, _)| *s0 < b)
            .map(move |(s0, seg)| {
                let l = l.expect("pages hold packed tokens of a codec");
                let t = seg.tokens;
                let codes = &seg.data.codes[h][..l.head_code_bytes(t)];
                let params = &seg.data.params[pi][..self.param_len(&l, t)];
                let outliers = match seg.data.outliers.get(h) {
                    Some(o) => &o[..l.head_outlier_bytes(t)],
                    None => &[],
                };
                let v = PackedHead::with_outliers(l, t, codes, params, outliers)
                    .expect("cache keeps consistent buffers");
                (s0, v)
            })
    }

    /// Buffer `i` of kind `kind` (0 codes per head, 1 params, 2 outlier
    /// entries per head), all pages in order; empty for a kind the format
    /// does not have.
    pub(super) fn buf(&self, kind: usize, i: usize) -> Vec<u8> {
        let Some(l) = self.layout() else {
            return Vec::new();
        };
        if self.buf_counts(&l)[kind] == 0 {
            return Vec::new();
        }
        let np = self.n_params;
        let mut out = Vec::with_capacity(buf_lens(&l, np, self.packed)[kind]);
        for seg in &self.pages {
            out.extend_from_slice(&seg.data.bufs()[kind][i][..buf_lens(&l, np, seg.tokens)[kind]]);
        }
        out
    }

    /// Bytes this tensor holds alone: its sink and residual rows (pages
    /// are in [`segments`](Self::segments)).
    pub(super) fn own_bytes(&self) -> CacheBytes {
        CacheBytes {
            codes: 0,
            params: 0,
            full_precision: (self.sink.len() + self.tail_rows() * self.width) * 4,
        }
    }

    /// Each page's buffers (an identity for counting a shared one once)
    /// and the codes and param bytes written into them.
    pub(super) fn segments(&self) -> impl Iterator<Item = (*const Page, CacheBytes)> + '_ {
        self.pages.iter().map(|seg| {
            let d = &seg.data;
            let bytes = CacheBytes {
                codes: d.codes.iter().map(Vec::len).sum(),
                params: d.params.iter().chain(&d.outliers).map(Vec::len).sum(),
                full_precision: 0,
            };
            (Arc::as_ptr(d), bytes)
        })
    }

    /// The rows that positions `..n` leave after the packed region once
    /// the cache is cut to `n` tokens, in the stored space, and how many
    /// packed tokens stay. A cut inside a quantized unit (a per-channel
    /// block) keeps the whole units before it packed and returns the cut
    /// unit's surviving tokens decoded, so they rejoin the full-precision
    /// tail (and are quantized again when their unit fills).
    pub(super) fn cut(&self, n: usize) -> (usize, Vec<f32>) {
        let w = self.width;
        let n_sink = self.sink.len() / w;
        let m = n.saturating_sub(n_sink);
        if m >= self.packed {
            let live = self.tail_slice();
            return (self.packed, live[..(m - self.packed) * w].to_vec());
        }
        let unit = self.unit_or_1();
        let keep = m / unit * unit;
        let mut rows = vec![0f32; (m - keep) * w];
        if let (Some(c), Some(l)) = (&self.codec, self.layout()) {
            let hd = l.head_dim();
            let mut tmp = vec![0f32; unit * hd];
            for h in 0..w / hd {
                let (s0, view) = self
                    .views(h)
                    .into_iter()
                    .rfind(|(s0, _)| *s0 <= keep)
                    .expect("packed tokens exist");
                c.decode(&sub_view(view, keep - s0, keep - s0 + unit), &mut tmp);
                for t in 0..m - keep {
                    rows[t * w + h * hd..][..hd].copy_from_slice(&tmp[t * hd..(t + 1) * hd]);
                }
            }
        }
        (keep, rows)
    }

    /// Cut to `n` positions: the sinks before `n`, `packed` packed tokens
    /// and then `tail` (from [`cut`](Self::cut)), with the per-channel
    /// running range `pend` of those rows.
    pub(super) fn apply_cut(&mut self, n: usize, packed: usize, tail: &[f32], pend: Pending) {
        let w = self.width;
        self.sink.truncate(n.min(self.sink.len() / w) * w);
        self.drop_packed(packed);
        self.tail.clear();
        self.tail.extend_from_slice(tail);
        self.tail_start = 0;
        if !self.pend.min.is_empty() {
            self.pend = pend;
        }
    }

    /// Quantize `unit` rows (the next positions after the packed ones)
    /// into packed storage.
    pub(super) fn store_unit(
        &mut self,
        rows: &[f32],
        unit: usize,
        backend: Backend,
        scratch: &mut Scratch,
        ticket: &mut Ticket,
    ) {
        let Some(l) = self.layout() else {
            unreachable!("only a tensor with a codec quantizes");
        };
        let token = self.sinks + self.packed;
        let (page, np) = (self.page, self.n_params);
        self.writable_page(&l, ticket);
        let c = self.codec.as_ref().expect("a layout comes from a codec");
        let seg = self.pages.last_mut().expect("a writable page exists");
        let p = Arc::get_mut(&mut seg.data).expect("a writable page is not shared");
        Self::reserve_unit(p, &l, unit, seg.tokens, page, np);
        let rb = l.row_bytes();
        match l.scheme().axis() {
            Axis::PerToken => {
                scratch.codes.resize(l.n_kv_heads() * rb, 0);
                scratch.params.resize(l.param_bytes(1), 0);
                scratch.outliers.resize(l.outlier_bytes(1), 0);
                c.encode_token(
                    backend,
                    rows,
                    token,
                    &mut scratch.codes,
                    &mut scratch.params,
                    &mut scratch.outliers,
                )
                .expect("scales were checked when the token was appended");
                for (h, c) in p.codes.iter_mut().enumerate() {
                    c.extend_from_slice(&scratch.codes[h * rb..(h + 1) * rb]);
                }
                let per = scratch.params.len() / np;
                for (h, b) in p.params.iter_mut().enumerate() {
                    b.extend_from_slice(&scratch.params[h * per..(h + 1) * per]);
                }
                let ob = l.head_outlier_bytes(1);
                for (h, b) in p.outliers.iter_mut().enumerate() {
                    b.extend_from_slice(&scratch.outliers[h * ob..(h + 1) * ob]);
                }
            }
            Axis::PerChannel => {
                scratch.codes.resize(unit * rb, 0);
                scratch.params.resize(l.head_param_bytes(unit), 0);
                scratch.outliers.resize(l.head_outlier_bytes(unit), 0);
                for h in 0..l.n_kv_heads() {
                    c.encode_block(
                        backend,
                        rows,
                        unit,
                        h,
                        token,
                        &mut scratch.codes,
                        &mut scratch.params,
                        &mut scratch.outliers,
                    )
                    .expect("scales were checked when the tokens were appended");
                    p.codes[h].extend_from_slice(&scratch.codes);
                    p.params[h].extend_from_slice(&scratch.params);
                    if let Some(o) = p.outliers.get_mut(h) {
                        o.extend_from_slice(&scratch.outliers);
                    }
                }
            }
        }
        p.sync();
        seg.tokens += unit;
        self.packed += unit;
    }

    /// Tokens quantized at a time, 1 when full precision.
    pub(super) fn unit_or_1(&self) -> usize {
        self.layout().map_or(1, |l| l.block_tokens())
    }

    /// The stored runs of positions `a..b` for head `h`, in order.
    pub(super) fn sections(&self, h: usize, a: usize, b: usize) -> Vec<Section<'_>> {
        let n_sink = self.sink.len() / self.width;
        let p_end = n_sink + self.packed;
        let t_end = p_end + self.tail_rows();
        let mut out = Vec::with_capacity(3);
        let clip = |s0: usize, s1: usize| (a.max(s0), b.min(s1));
        let (x0, x1) = clip(0, n_sink);
        if x0 < x1 {
            out.push(Section {
                start: x0,
                len: x1 - x0,
                data: SectionData::Dense(&self.sink[x0 * self.width..]),
            });
        }
        let (x0, x1) = clip(n_sink, p_end);
        if x0 < x1 {
            for (s0, view) in self.views_in(h, x0 - n_sink, x1 - n_sink) {
                // The page's positions, clipped to `x0..x1`.
                let (v0, v1) = (n_sink + s0, n_sink + s0 + view.tokens());
                let (y0, y1) = (x0.max(v0), x1.min(v1));
                if y0 < y1 {
                    out.push(Section {
                        start: y0,
                        len: y1 - y0,
                        data: SectionData::Packed(sub_view(view, y0 - v0, y1 - v0)),
                    });
                }
            }
        }
        let (x0, x1) = clip(p_end, t_end);
        if x0 < x1 {
            out.push(Section {
                start: x0,
                len: x1 - x0,
                data: SectionData::Dense(&self.tail_slice()[(x0 - p_end) * self.width..]),
            });
        }
        out
    }

    pub(super) fn bytes(&self) -> CacheBytes {
        let l = self.layout();
        CacheBytes {
            codes: l.map_or(0, |l| l.code_bytes(self.packed)),
            params: l.map_or(0, |l| {
                l.param_bytes(self.packed) + l.outlier_bytes(self.packed)
            }) + self.codec.as_ref().map_or(0, |c| c.spec().table_bytes()),
            full_precision: (self.sink.len() + self.tail_rows() * self.width) * 4,
        }
    }

    pub(super) fn clear(&mut self) {
        self.sink.clear();
        self.tail.clear();
        self.tail_start = 0;
        self.packed = 0;
        self.pages.clear();
    }

    /// Everything as f32 rows `[len, width]`: what attention sees, mapped
    /// back from the codec's stored space.
    pub(super) fn to_f32(&self) -> Vec<f32> {
        let mut out = self.sink.clone();
        if let (Some(c), Some(l)) = (&self.codec, self.layout()) {
            let hd = l.head_dim();
            let n_kv = self.width / hd;
            let base = out.len();
            out.resize(base + self.packed * self.width, 0.0);
            let mut tmp = Vec::new();
            for h in 0..n_kv {
                for (s0, view) in self.views(h) {
                    tmp.resize(view.tokens() * hd, 0.0);
                    c.decode(&view, &mut tmp);
                    for t in 0..view.tokens() {
                        let o = base + (s0 + t) * self.width + h * hd;
                        out[o..o + hd].copy_from_slice(&tmp[t * hd..(t + 1) * hd]);
                    }
                }
            }
        }
        out.extend_from_slice(self.tail_slice());
        if let Some(c) = self.codec.as_ref().filter(|c| c.transforms()) {
            c.transform_out(&mut out);
        }
        out
    }
}

/// Bytes of each of `np` param buffers for `t` tokens of layout `l`.
fn param_len(l: &Layout, np: usize, t: usize) -> usize {
    l.param_bytes(t) / np
}

/// Bytes of each code, param and outlier buffer for `t` tokens.
fn buf_lens(l: &Layout, np: usize, t: usize) -> [usize; 3] {
    [
        l.head_code_bytes(t),
        param_len(l, np, t),
        l.head_outlier_bytes(t),
    ]
}
