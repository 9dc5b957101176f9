//! Random-access decoding: ids -> blocks needed -> planes -> rows, in request order.
//!
//! Block bytes are parsed here: every position and length comes from them, so every
//! operation on one is checked or saturating (`arithmetic_side_effects` is denied). A
//! block holds at most `MAX_BLOCK_BYTES` decoded bytes (checked when the store was parsed),
//! so offsets within it never saturate; a range that would is refused by the `get` it
//! feeds.
#![deny(
    clippy::indexing_slicing,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::arithmetic_side_effects
)]

use rayon::prelude::*;

use crate::format::{
    MODE_CONST, MODE_HUFFMAN, MODE_HUFFMAN_ROWS, MODE_RANS, MODE_RAW, MODE_ZSTD, get_varint,
};
use crate::{BlockStore, Error, Result};

/// `len` bytes from `start` (saturating, so an overflowing range is empty-or-refused by the
/// `get` it feeds, never wrapped into range).
const fn at(start: usize, len: usize) -> std::ops::Range<usize> {
    start..start.saturating_add(len)
}

/// Row `r` of rows of `n` bytes.
const fn row(r: usize, n: usize) -> std::ops::Range<usize> {
    at(r.saturating_mul(n), n)
}

/// Where one plane of the current block comes from.
#[derive(Debug, Clone, Copy)]
enum Src {
    /// Bytes in place in the payload, starting here (raw planes are never copied).
    Payload(usize),
    /// Decoded into the scratch buffer, starting here.
    Scratch(usize),
    /// Every byte equals this one (materialised once per row width in `const_row`).
    Const(usize),
}

/// A reusable decoding context: holds one block of scratch space and the request order,
/// so a request makes no allocation per block. Cheap to create; not shared across threads.
pub struct Decoder<'s> {
    store: &'s BlockStore,
    scratch: Vec<u8>,
    const_row: Vec<u8>,
    order: Vec<(u64, usize)>,
    /// Rows of the current block that a request wants (row-indexed planes decode only these).
    want: Vec<bool>,
    zstd: Option<zstd::bulk::Decompressor<'static>>,
    /// Which region of `scratch` and `const_row` the block being prepared puts its planes
    /// in (0 but in [`Decoder::decode_blocks`], which prepares several blocks side by side).
    slot: usize,
    /// While [`Decoder::decode_blocks`] prepares a group, the rANS planes it leaves to
    /// be decoded together.
    deferred: Option<Vec<Deferred>>,
}

/// A whole rANS plane left for [`crate::rans::decode_many`].
#[derive(Debug, Clone, Copy)]
struct Deferred {
    block: usize,
    /// Plane and table.
    plane: usize,
    table: usize,
    /// The stream's place in the payload.
    stream: (usize, usize),
    /// Where its symbols go in the scratch.
    dst: (usize, usize),
}

/// Blocks [`Decoder::decode_blocks`] prepares side by side, so that their rANS planes
/// decode together (six, the rANS decoder's `TOGETHER`); ranges of a multiple of this many
/// blocks make the best tasks.
pub const BLOCKS_TOGETHER: usize = crate::rans::TOGETHER;

impl std::fmt::Debug for Decoder<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Decoder")
            .field("scratch_bytes", &self.scratch.len())
            .finish_non_exhaustive()
    }
}

impl<'s> Decoder<'s> {
    /// A decoder for `store`.
    #[must_use]
    pub fn new(store: &'s BlockStore) -> Self {
        Self {
            store,
            scratch: Vec::new(),
            const_row: Vec::new(),
            order: Vec::new(),
            want: Vec::new(),
            zstd: None,
            slot: 0,
            deferred: None,
        }
    }

    /// A decoder for `store` that works in `scratch` (what [`Decoder::take_scratch`] gave
    /// back, from any store): a fresh decoder's scratch is zeroed as it grows, a block's
    /// worth for each of [`BLOCKS_TOGETHER`] blocks, which a caller decoding a few blocks
    /// at a time pays again and again. Its contents do not matter.
    #[must_use]
    pub fn with_scratch(store: &'s BlockStore, scratch: Vec<u8>) -> Self {
        Self {
            scratch,
            ..Self::new(store)
        }
    }

    /// The scratch space, for [`Decoder::with_scratch`]; this decoder goes on with none.
    pub fn take_scratch(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.scratch)
    }

    /// Decodes rows `ids` (any order, repeats allowed, empty allowed) into `out`, one row
    /// after another in request order. Each needed block is decoded once; coded planes
    /// only up to the last requested row of the block, raw planes are read in place.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] if `out` is not `ids.len() * row_bytes` long,
    /// [`Error::RowOutOfRange`] for the first id past the end (before anything is written),
    /// and block errors ([`Error::ChecksumMismatch`] when verifying on decode,
    /// [`Error::BadBlock`]).
    pub fn decode_rows(&mut self, ids: &[u64], out: &mut [u8]) -> Result<()> {
        let s = self.store;
        let rb = s.row_bytes;
        if ids.len().checked_mul(rb) != Some(out.len()) {
            return Err(Error::InvalidInput(format!(
                "output has {} bytes, {} rows of {rb} bytes need {}",
                out.len(),
                ids.len(),
                ids.len().saturating_mul(rb)
            )));
        }
        if let Some(&id) = ids.iter().find(|&&id| id >= s.rows) {
            return Err(Error::RowOutOfRange { id, rows: s.rows });
        }
        if rb == 0 {
            return Ok(());
        }
        let mut order = std::mem::take(&mut self.order);
        order.clear();
        order.extend(ids.iter().enumerate().map(|(pos, &id)| (id, pos)));
        order.sort_unstable();
        // at least 1 (checked when parsed)
        let br = (s.block_rows as u64).max(1);
        let result = (|| {
            let mut rest = order.as_slice();
            while let Some(&(first, _)) = rest.first() {
                let block = first.checked_div(br).unwrap_or(0);
                let len = rest
                    .iter()
                    .take_while(|(id, _)| id.checked_div(br) == Some(block))
                    .count();
                let (group, tail) = rest.split_at(len);
                rest = tail;
                let in_block = |id: u64| id.checked_rem(br).unwrap_or(0) as usize;
                let last = group.last().map_or(0, |&(id, _)| in_block(id));
                let block = usize::try_from(block)
                    .map_err(|_| Error::Malformed("block index overflows".into()))?;
                self.want.clear();
                self.want.resize(last.saturating_add(1), false);
                for &(id, _) in group {
                    if let Some(w) = self.want.get_mut(in_block(id)) {
                        *w = true;
                    }
                }
                let srcs = self.prepare(block, last.saturating_add(1))?;
                for &(id, pos) in group {
                    let dst = out
                        .get_mut(row(pos, rb))
                        .ok_or_else(|| Error::Malformed("row outside output".into()))?;
                    self.gather(&srcs, in_block(id), dst)?;
                }
            }
            Ok(())
        })();
        self.order = order;
        result
    }

    /// Decodes every row of `block` into `out` (`rows_in_block * row_bytes` bytes);
    /// returns the number of rows.
    ///
    /// # Errors
    /// As [`Decoder::decode_rows`].
    pub fn decode_block(&mut self, block: usize, out: &mut [u8]) -> Result<usize> {
        let rows = self.rows_in_block(block)?;
        let rb = self.store.row_bytes;
        if rows.checked_mul(rb) != Some(out.len()) {
            return Err(Error::InvalidInput(format!(
                "block {block} needs {} output bytes, got {}",
                rows.saturating_mul(rb),
                out.len()
            )));
        }
        if rb == 0 {
            return Ok(rows);
        }
        self.want.clear();
        self.want.resize(rows, true);
        let srcs = self.prepare(block, rows)?;
        for (r, dst) in out.chunks_exact_mut(rb).enumerate() {
            self.gather(&srcs, r, dst)?;
        }
        Ok(rows)
    }

    /// Decodes every row of blocks `blocks` into `out` (their rows one after another),
    /// with the same bytes and the same first error as [`Decoder::decode_block`] on each
    /// in turn. [`BLOCKS_TOGETHER`] blocks at a time are prepared side by side and their
    /// whole rANS planes decoded together, which is faster than one stream after another.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a range past the end or an `out` of the wrong length
    /// (before anything is decoded); then as [`Decoder::decode_rows`].
    pub fn decode_blocks(&mut self, blocks: std::ops::Range<usize>, out: &mut [u8]) -> Result<()> {
        let s = self.store;
        let rb = s.row_bytes;
        if blocks.end > s.num_blocks() || blocks.start > blocks.end {
            return Err(Error::InvalidInput(format!(
                "blocks {blocks:?} out of range ({} blocks)",
                s.num_blocks()
            )));
        }
        let mut sizes = Vec::with_capacity(blocks.len());
        let mut total = 0usize;
        for b in blocks.clone() {
            let bytes = self.rows_in_block(b)?.saturating_mul(rb);
            sizes.push(bytes);
            total = total.saturating_add(bytes);
        }
        if total != out.len() {
            return Err(Error::InvalidInput(format!(
                "blocks {blocks:?} need {total} output bytes, got {}",
                out.len()
            )));
        }
        if rb == 0 {
            return Ok(());
        }
        let mut out = out;
        let mut sizes = sizes.as_slice();
        let mut first = blocks.start;
        while first < blocks.end {
            let count = blocks.end.saturating_sub(first).min(BLOCKS_TOGETHER);
            let (group_sizes, rest) = sizes.split_at_checked(count).unwrap_or((sizes, &[]));
            sizes = rest;
            let (head, tail) = std::mem::take(&mut out)
                .split_at_mut_checked(group_sizes.iter().sum())
                .ok_or_else(|| Error::Malformed("output shorter than its blocks".into()))?;
            out = tail;
            self.decode_group(first, group_sizes, head)?;
            first = first.saturating_add(count);
        }
        Ok(())
    }

    /// Blocks `first..` (one per entry of `sizes`, their output bytes) into the front of
    /// `out`: each prepared in its own scratch region with its whole rANS planes left
    /// aside, those decoded together, then each block's rows gathered. The first error in
    /// block order, as one block after another would give it.
    fn decode_group(&mut self, first: usize, sizes: &[usize], out: &mut [u8]) -> Result<()> {
        let s = self.store;
        let rb = s.row_bytes;
        // every slot's region at once, in fresh zeroed space rather than grown slot by slot
        // with zeros written: the allocator's pages are only faulted in where a coded plane
        // is decoded (a raw plane is read in place and never touches its region)
        let need = sizes.len().saturating_mul(s.block_rows.saturating_mul(rb));
        if self.scratch.len() < need {
            self.scratch = vec![0; need];
        }
        let mut srcs = Vec::with_capacity(sizes.len());
        let mut failed = None;
        self.deferred = Some(Vec::new());
        for (j, &bytes) in sizes.iter().enumerate() {
            let block = first.saturating_add(j);
            let rows = bytes.checked_div(rb).unwrap_or(0);
            self.slot = j;
            self.want.clear();
            self.want.resize(rows, true);
            match self.prepare(block, rows) {
                Ok(src) => srcs.push(src),
                Err(err) => {
                    failed = Some(err);
                    break;
                }
            }
        }
        self.slot = 0;
        let deferred = self.deferred.take().unwrap_or_default();
        // the planes' streams, each with its own part of the scratch (the parts follow
        // one another in the order they were left)
        let mut jobs = Vec::with_capacity(deferred.len());
        let mut rest = self.scratch.as_mut_slice();
        let mut at_ = 0usize;
        for d in &deferred {
            let table = s
                .rans
                .get(d.plane)
                .and_then(|ts| ts.get(d.table))
                .ok_or_else(|| Error::Malformed("deferred plane's table".into()))?;
            let stream = s
                .payload
                .as_slice()
                .get(at(d.stream.0, d.stream.1))
                .ok_or_else(|| Error::Malformed("deferred plane's stream".into()))?;
            let skip = d
                .dst
                .0
                .checked_sub(at_)
                .ok_or_else(|| Error::Malformed("deferred planes out of order".into()))?;
            let (_, tail) = std::mem::take(&mut rest)
                .split_at_mut_checked(skip)
                .ok_or_else(|| Error::Malformed("scratch".into()))?;
            let (dst, tail) = tail
                .split_at_mut_checked(d.dst.1)
                .ok_or_else(|| Error::Malformed("scratch".into()))?;
            rest = tail;
            at_ = d.dst.0.saturating_add(d.dst.1);
            jobs.push(crate::rans::Job {
                table,
                stream,
                out: dst,
                exact: true,
            });
        }
        let results = crate::rans::decode_many(&mut jobs);
        drop(jobs);
        // a plane's error comes before anything later in its block and after it
        for (d, r) in deferred.iter().zip(results) {
            r.map_err(|e| e.in_block(d.block))?;
        }
        if let Some(err) = failed {
            // the blocks before the failing one are still written, as one by one would
            self.gather_group(&srcs, sizes, out)?;
            return Err(err);
        }
        self.gather_group(&srcs, sizes, out)
    }

    /// Each prepared block's rows into `out`, one block after another.
    fn gather_group(&self, srcs: &[[Src; 8]], sizes: &[usize], out: &mut [u8]) -> Result<()> {
        let rb = self.store.row_bytes;
        let mut off = 0usize;
        for (src, &bytes) in srcs.iter().zip(sizes) {
            let dst = out
                .get_mut(at(off, bytes))
                .ok_or_else(|| Error::Malformed("block outside output".into()))?;
            for (r, d) in dst.chunks_exact_mut(rb.max(1)).enumerate() {
                self.gather(src, r, d)?;
            }
            off = off.saturating_add(bytes);
        }
        Ok(())
    }

    fn rows_in_block(&self, block: usize) -> Result<usize> {
        let s = self.store;
        if block >= s.num_blocks() {
            return Err(Error::InvalidInput(format!(
                "block {block} out of range ({} blocks)",
                s.num_blocks()
            )));
        }
        let start = (block as u64).saturating_mul(s.block_rows as u64);
        Ok(usize::try_from(s.rows.saturating_sub(start).min(s.block_rows as u64)).unwrap_or(0))
    }

    /// Parses `block`, decodes its coded planes for the first `need` rows into scratch
    /// (row-indexed planes: only the rows marked in `self.want`), and says where each
    /// plane's bytes are.
    fn prepare(&mut self, block: usize, need: usize) -> Result<[Src; 8]> {
        let s = self.store;
        if s.verify_on_decode || s.lazy {
            s.verify_block(block)?;
        }
        let rows = self.rows_in_block(block)?;
        let e = s.kind.element_size().bytes();
        // rows x row_bytes <= MAX_BLOCK_BYTES: none of these saturate
        let re = s.row_bytes.checked_div(e).unwrap_or(0); // elements = bytes per plane row
        let n = rows.saturating_mul(re); // bytes per plane in this block
        let bytes = s.block_bytes(block)?;
        let base = s.offsets.get(block).copied().unwrap_or(0);
        // each slot's planes: a block's worth of scratch and a row's worth of constants
        let region = self
            .slot
            .saturating_mul(s.block_rows.saturating_mul(s.row_bytes));
        let plane_at = |k: usize| region.saturating_add(k.saturating_mul(n));
        let consts = self.slot.saturating_mul(s.row_bytes);
        if self.scratch.len() < plane_at(e) {
            self.scratch.resize(plane_at(e), 0);
        }
        if self.const_row.len() < consts.saturating_add(e.saturating_mul(re)) {
            self.const_row
                .resize(consts.saturating_add(e.saturating_mul(re)), 0);
        }
        let mut srcs = [Src::Const(0); 8];
        let mut pos = 0usize;
        let bad = |reason: &str| Error::BadBlock {
            block,
            reason: reason.to_string(),
        };
        for (k, src) in srcs.iter_mut().take(e).enumerate() {
            let mode = *bytes.get(pos).ok_or_else(|| bad("plane record missing"))?;
            pos = pos.saturating_add(1); // pos < bytes.len()
            match mode {
                MODE_RAW => {
                    if bytes.get(at(pos, n)).is_none() {
                        return Err(bad("raw plane runs past the block"));
                    }
                    *src = Src::Payload(base.saturating_add(pos));
                    pos = pos.saturating_add(n);
                }
                MODE_CONST => {
                    let v = *bytes
                        .get(pos)
                        .ok_or_else(|| bad("constant plane has no value"))?;
                    pos = pos.saturating_add(1);
                    let c = consts.saturating_add(k.saturating_mul(re));
                    if let Some(r) = self.const_row.get_mut(at(c, re)) {
                        r.fill(v);
                    }
                    *src = Src::Const(c);
                }
                MODE_ZSTD => {
                    let len = get_varint(bytes, &mut pos).map_err(|e| e.in_block(block))?;
                    let frame = bytes
                        .get(at(pos, len))
                        .ok_or_else(|| bad("zstd frame runs past the block"))?;
                    pos = pos.saturating_add(len);
                    let dst = self
                        .scratch
                        .get_mut(at(plane_at(k), n))
                        .ok_or_else(|| bad("scratch"))?;
                    let dec = match &mut self.zstd {
                        Some(d) => d,
                        none => none.insert(
                            zstd::bulk::Decompressor::new()
                                .map_err(|e| Error::Malformed(format!("zstd context: {e}")))?,
                        ),
                    };
                    let got = dec
                        .decompress_to_buffer(frame, dst)
                        .map_err(|e| bad(&format!("zstd: {e}")))?;
                    if got != n {
                        return Err(bad(&format!("zstd plane holds {got} bytes, expected {n}")));
                    }
                    *src = Src::Scratch(plane_at(k));
                }
                m if (MODE_RANS..MODE_RANS.saturating_add(16)).contains(&m) => {
                    let t = usize::from(m.saturating_sub(MODE_RANS));
                    let len = get_varint(bytes, &mut pos).map_err(|e| e.in_block(block))?;
                    let stream = bytes
                        .get(at(pos, len))
                        .ok_or_else(|| bad("rANS plane runs past the block"))?;
                    pos = pos.saturating_add(len);
                    let table = s.rans.get(k).and_then(|ts| ts.get(t)).ok_or_else(|| {
                        bad(&format!(
                            "plane {k} names rANS table {t}, which does not exist"
                        ))
                    })?;
                    // one stream over the plane: decoded up to the last row needed, or
                    // left for later with the other blocks' planes
                    let upto = need.min(rows).saturating_mul(re);
                    if let Some(jobs) = self.deferred.as_mut().filter(|_| upto == n) {
                        jobs.push(Deferred {
                            block,
                            plane: k,
                            table: t,
                            stream: (base.saturating_add(pos.saturating_sub(len)), len),
                            dst: (plane_at(k), n),
                        });
                        *src = Src::Scratch(plane_at(k));
                        continue;
                    }
                    let dst = self
                        .scratch
                        .get_mut(at(plane_at(k), upto))
                        .ok_or_else(|| bad("scratch"))?;
                    table
                        .decode(stream, dst, upto == n)
                        .map_err(|e| e.in_block(block))?;
                    *src = Src::Scratch(plane_at(k));
                }
                m if (MODE_HUFFMAN_ROWS..MODE_RANS).contains(&m) => {
                    let t = m.saturating_sub(MODE_HUFFMAN_ROWS);
                    let (body, dec) =
                        coded_plane(s, bytes, &mut pos, k, t).map_err(|e| e.in_block(block))?;
                    let index_len = rows.saturating_sub(1).saturating_mul(2);
                    let (index, segs) = body
                        .split_at_checked(index_len)
                        .ok_or_else(|| bad("row index runs past the plane"))?;
                    // the wanted rows' segments, decoded two at a time
                    let plane = self
                        .scratch
                        .get_mut(at(plane_at(k), n))
                        .ok_or_else(|| bad("scratch"))?;
                    let mut start = 0usize;
                    let mut pending: Option<(usize, &[u8])> = None;
                    for r in 0..need.min(rows) {
                        let end = match index.get(row(r, 2)) {
                            Some(&[lo, hi]) => {
                                start.saturating_add(usize::from(u16::from_le_bytes([lo, hi])))
                            }
                            _ => segs.len(), // the last row takes the rest
                        };
                        let seg = segs
                            .get(start..end)
                            .ok_or_else(|| bad("row segment runs past the plane"))?;
                        start = end;
                        if !self.want.get(r).copied().unwrap_or(false) {
                            continue;
                        }
                        match pending.take() {
                            None => pending = Some((r, seg)),
                            Some((r0, seg0)) => {
                                let (left, right) = plane
                                    .split_at_mut_checked(r.saturating_mul(re))
                                    .ok_or_else(|| bad("scratch"))?;
                                let a = left.get_mut(row(r0, re)).ok_or_else(|| bad("scratch"))?;
                                let b = right.get_mut(..re).ok_or_else(|| bad("scratch"))?;
                                dec.decode_pair((seg0, a, true), (seg, b, true))
                                    .map_err(|e| e.in_block(block))?;
                            }
                        }
                    }
                    if let Some((r0, seg0)) = pending {
                        let a = plane.get_mut(row(r0, re)).ok_or_else(|| bad("scratch"))?;
                        dec.decode(seg0, a, true).map_err(|e| e.in_block(block))?;
                    }
                    *src = Src::Scratch(plane_at(k));
                }
                m if (MODE_HUFFMAN..MODE_HUFFMAN_ROWS).contains(&m) => {
                    let t = m.saturating_sub(MODE_HUFFMAN);
                    let (stream, dec) =
                        coded_plane(s, bytes, &mut pos, k, t).map_err(|e| e.in_block(block))?;
                    // two streams: rows [0, h) and [h, rows); each decoded only as far as
                    // the last wanted row in it, both at once when both are needed
                    let mut sp = 0usize;
                    let len_a = get_varint(stream, &mut sp).map_err(|e| e.in_block(block))?;
                    let a = stream
                        .get(at(sp, len_a))
                        .ok_or_else(|| bad("first half runs past the plane"))?;
                    let b = stream.get(sp.saturating_add(len_a)..).unwrap_or(&[]);
                    let h = rows.div_ceil(2);
                    let last = |range: std::ops::Range<usize>| {
                        range
                            .rev()
                            .find(|&r| self.want.get(r).copied().unwrap_or(false))
                    };
                    let need_a = last(0..h.min(need)).map_or(0, |r| r.saturating_add(1));
                    let need_b = last(h..need.min(rows))
                        .map_or(0, |r| r.saturating_add(1).saturating_sub(h));
                    let plane = self
                        .scratch
                        .get_mut(at(plane_at(k), n))
                        .ok_or_else(|| bad("scratch"))?;
                    let (pa, pb) = plane.split_at_mut(h.saturating_mul(re).min(n));
                    let oa = pa
                        .get_mut(row(0, need_a.saturating_mul(re)))
                        .ok_or_else(|| bad("scratch"))?;
                    let ob = pb
                        .get_mut(row(0, need_b.saturating_mul(re)))
                        .ok_or_else(|| bad("scratch"))?;
                    let (full_a, full_b) = (need_a == h, need_b == rows.saturating_sub(h));
                    let done = match (need_a > 0, need_b > 0) {
                        (true, true) => dec.decode_pair((a, oa, full_a), (b, ob, full_b)),
                        (true, false) => dec.decode(a, oa, full_a),
                        (false, true) => dec.decode(b, ob, full_b),
                        (false, false) => Ok(()),
                    };
                    done.map_err(|e| e.in_block(block))?;
                    *src = Src::Scratch(plane_at(k));
                }
                other => return Err(bad(&format!("unknown plane mode {other}"))),
            }
        }
        if pos != bytes.len() {
            return Err(bad(&format!(
                "{} trailing bytes after the last plane",
                bytes.len().saturating_sub(pos)
            )));
        }
        Ok(srcs)
    }

    /// Interleaves row `r` of each plane back into elements and undoes the sign rotation.
    fn gather(&self, srcs: &[Src; 8], r: usize, dst: &mut [u8]) -> Result<()> {
        let s = self.store;
        let e = s.kind.element_size().bytes();
        let re = s.row_bytes.checked_div(e).unwrap_or(0);
        let slice = |src: &Src| -> Result<&[u8]> {
            let in_plane = r.saturating_mul(re);
            let (buf, start) = match *src {
                Src::Payload(o) => (s.payload.as_slice(), o.saturating_add(in_plane)),
                Src::Scratch(o) => (self.scratch.as_slice(), o.saturating_add(in_plane)),
                Src::Const(o) => (self.const_row.as_slice(), o),
            };
            buf.get(at(start, re))
                .ok_or_else(|| Error::Malformed("plane row outside its buffer".into()))
        };
        let rot = s.kind.rotates_sign();
        match e {
            1 => dst.copy_from_slice(slice(&srcs[0])?),
            2 => gather2(slice(&srcs[0])?, slice(&srcs[1])?, dst, rot),
            4 => gather4(
                [
                    slice(&srcs[0])?,
                    slice(&srcs[1])?,
                    slice(&srcs[2])?,
                    slice(&srcs[3])?,
                ],
                dst,
                rot,
            ),
            _ => {
                let mut planes: [&[u8]; 8] = [&[]; 8];
                for (p, src) in planes.iter_mut().zip(srcs.iter()) {
                    *p = slice(src)?;
                }
                gather8(&planes, dst, rot);
            }
        }
        Ok(())
    }
}

/// A Huffman-coded plane record after its mode byte: the LEB128 body length, the body,
/// and the decoder of the plane's table `t`.
fn coded_plane<'b, 's>(
    store: &'s BlockStore,
    bytes: &'b [u8],
    pos: &mut usize,
    plane: usize,
    t: u8,
) -> Result<(&'b [u8], &'s crate::huffman::Decoder)> {
    let len = get_varint(bytes, pos)?;
    let body = bytes
        .get(at(*pos, len))
        .ok_or_else(|| Error::Malformed("coded plane runs past the block".into()))?;
    *pos = pos.saturating_add(len);
    let dec = store
        .decoders
        .get(plane)
        .and_then(|ts| ts.get(usize::from(t)))
        .ok_or_else(|| {
            Error::Malformed(format!(
                "plane {plane} names code table {t}, which does not exist"
            ))
        })?;
    Ok((body, dec))
}

/// Interleaves two planes into 2-byte elements: on AVX-512 BW or AVX2 where the CPU has
/// them (the same code, which the compiler vectorizes at the tier's width: three times as
/// many bytes a step as SSE2's), else as compiled.
fn gather2(a: &[u8], b: &[u8], dst: &mut [u8], rot: bool) {
    #[cfg(target_arch = "x86_64")]
    match wide::tier() {
        wide::Tier::Avx512 => return wide::gather2_avx512(a, b, dst, rot),
        wide::Tier::Avx2 => return wide::gather2_avx2(a, b, dst, rot),
        wide::Tier::Base => {}
    }
    gather2_body(a, b, dst, rot);
}

/// Interleaves four planes into 4-byte elements, as [`gather2`].
fn gather4(p: [&[u8]; 4], dst: &mut [u8], rot: bool) {
    #[cfg(target_arch = "x86_64")]
    match wide::tier() {
        wide::Tier::Avx512 => return wide::gather4_avx512(p, dst, rot),
        wide::Tier::Avx2 => return wide::gather4_avx2(p, dst, rot),
        wide::Tier::Base => {}
    }
    gather4_body(p, dst, rot);
}

#[inline(always)]
fn gather2_body(a: &[u8], b: &[u8], dst: &mut [u8], rot: bool) {
    let it = dst.chunks_exact_mut(2).zip(a.iter().zip(b.iter()));
    if rot {
        it.for_each(|(o, (&x, &y))| {
            o.copy_from_slice(&u16::from_le_bytes([x, y]).rotate_right(1).to_le_bytes())
        });
    } else {
        it.for_each(|(o, (&x, &y))| o.copy_from_slice(&[x, y]));
    }
}

#[inline(always)]
fn gather4_body(p: [&[u8]; 4], dst: &mut [u8], rot: bool) {
    let [a, b, c, d] = p;
    let it = dst
        .chunks_exact_mut(4)
        .zip(a.iter().zip(b.iter()).zip(c.iter().zip(d.iter())));
    if rot {
        it.for_each(|(o, ((&w, &x), (&y, &z)))| {
            o.copy_from_slice(
                &u32::from_le_bytes([w, x, y, z])
                    .rotate_right(1)
                    .to_le_bytes(),
            );
        });
    } else {
        it.for_each(|(o, ((&w, &x), (&y, &z)))| o.copy_from_slice(&[w, x, y, z]));
    }
}

/// The gathers compiled for wider vectors, chosen once per process.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)] // calls of `target_feature` functions, each after detection
mod wide {
    #[derive(Clone, Copy, PartialEq, Eq)]
    pub(super) enum Tier {
        Base,
        Avx2,
        Avx512,
    }

    pub(super) fn tier() -> Tier {
        static TIER: std::sync::OnceLock<Tier> = std::sync::OnceLock::new();
        *TIER.get_or_init(|| {
            if std::arch::is_x86_feature_detected!("avx512bw") {
                Tier::Avx512
            } else if std::arch::is_x86_feature_detected!("avx2") {
                Tier::Avx2
            } else {
                Tier::Base
            }
        })
    }

    macro_rules! tiered {
        ($name:ident, $feature:literal, $body:ident, ($($arg:ident: $ty:ty),*)) => {
            pub(super) fn $name($($arg: $ty),*) {
                #[target_feature(enable = $feature)]
                fn imp($($arg: $ty),*) {
                    super::$body($($arg),*);
                }
                // SAFETY: `tier` found the feature on this CPU before this is called
                unsafe { imp($($arg),*) }
            }
        };
    }

    tiered!(gather2_avx2, "avx2", gather2_body, (a: &[u8], b: &[u8], dst: &mut [u8], rot: bool));
    tiered!(gather2_avx512, "avx512bw,avx512f,avx2", gather2_body, (a: &[u8], b: &[u8], dst: &mut [u8], rot: bool));
    tiered!(gather4_avx2, "avx2", gather4_body, (p: [&[u8]; 4], dst: &mut [u8], rot: bool));
    tiered!(gather4_avx512, "avx512bw,avx512f,avx2", gather4_body, (p: [&[u8]; 4], dst: &mut [u8], rot: bool));
}

fn gather8(p: &[&[u8]; 8], dst: &mut [u8], rot: bool) {
    for (j, o) in dst.chunks_exact_mut(8).enumerate() {
        let mut w = [0u8; 8];
        for (byte, plane) in w.iter_mut().zip(p.iter()) {
            *byte = plane.get(j).copied().unwrap_or(0);
        }
        let v = u64::from_le_bytes(w);
        o.copy_from_slice(&if rot { v.rotate_right(1) } else { v }.to_le_bytes());
    }
}

impl BlockStore {
    /// A reusable decoding context for this store.
    #[must_use]
    pub fn decoder(&self) -> Decoder<'_> {
        Decoder::new(self)
    }

    /// Decodes rows `ids` into `out`; see [`Decoder::decode_rows`].
    ///
    /// # Errors
    /// As [`Decoder::decode_rows`].
    pub fn decode_rows(&self, ids: &[u64], out: &mut [u8]) -> Result<()> {
        Decoder::new(self).decode_rows(ids, out)
    }

    /// Decodes the whole tensor, blocks in parallel on all cores.
    ///
    /// # Errors
    /// The first failing block's error.
    pub fn decode_all(&self) -> Result<Vec<u8>> {
        let total = usize::try_from(self.dense_bytes())
            .map_err(|_| Error::Malformed("tensor too large".into()))?;
        let mut out = vec![0u8; total];
        // groups of blocks whose rANS planes decode together
        let chunk = self
            .block_rows
            .saturating_mul(self.row_bytes)
            .saturating_mul(BLOCKS_TOGETHER)
            .max(1);
        if total == 0 {
            return Ok(out);
        }
        let n = self.num_blocks();
        out.par_chunks_mut(chunk).enumerate().try_for_each_init(
            || Decoder::new(self),
            |dec, (g, dst)| {
                let b = g.saturating_mul(BLOCKS_TOGETHER);
                dec.decode_blocks(b..b.saturating_add(BLOCKS_TOGETHER).min(n), dst)
            },
        )?;
        Ok(out)
    }
}
