//! Tensors with a whole-tensor digest (dense and lossless) read side by side, so their
//! digests are taken four at a time in lockstep.
//!
//! A tensor's SHA-256 is one chain that no number of cores shortens, and one chain leaves
//! most of the CPU's SHA unit idle: four chains interleaved run about 1.8x as fast
//! ([`sha256_many`], [`Sha256Streams`]). So [`Artifact::stream_digested`] reads tensors in
//! two passes:
//! - tensors of more than [`STREAM_PIECE`] decoded bytes stream in up to four lanes, a
//!   round at a time, every lane advancing by about as many bytes as the shortest has left
//!   (at most [`LANE_PIECE`], but [`BLOCKS_TOGETHER`] blocks at least where they fit in
//!   [`STREAM_PIECE`], so a piece's rANS planes still decode six side by side); one
//!   round's pieces are hashed (and handed to the caller's
//!   sink) while the next round's are decoded. The lanes are filled largest tensor first,
//!   and a tensor enters only while the stored bytes of those in the lanes stay within
//!   [`LANES_BYTES`] (one tensor at least, however large), so memory stays bounded;
//! - the smaller ones, four of similar size at a time, groups in parallel, in waves of at
//!   most `SMALL_BYTES` of stored bytes: each decoded whole (or read in place from the
//!   file's map, if dense) and the group's SHA-256s taken at once; or, a lossless tensor
//!   whose whole-tensor digest is XXH3-128 (version 4), which needs no lockstep, decoded
//!   a piece at a time through one reused buffer and hashed as it goes.
//!
//! Both passes run on the caller's rayon pool (`rayon::join`), and nothing in them blocks a
//! worker on a channel, so a pool of one thread runs them too.
//!
//! The schedule depends on the tensors' sizes only, never on the thread count, and so
//! does the error reported: in the first pass, the first round with a failure and in it
//! the tensor first in the caller's order; in the second, the first group (largest
//! first) with a failure, and in it the tensor first in the caller's order.
#![deny(clippy::arithmetic_side_effects)]

use rayon::prelude::*;
use xxhash_rust::xxh3::Xxh3;

use compressme_blockstore::{BLOCKS_TOGETHER, BlockStore, Decoder, Sha256Streams, sha256_many};

use super::{Artifact, STREAM_BYTES, STREAM_PIECE, Stored, has_whole_digest};
use crate::recipe::{StorageRecipe, TensorRecipe, WholeDigest, hex, xxh3_128_hex};
use crate::st::Mapped;
use crate::validate::decoded_bytes;
use crate::{Error, Result};

/// Tensors streamed side by side.
const LANES: usize = 4;

/// Stored bytes of the tensors in the lanes at once (one tensor at least): their pages of
/// the file's map, which stay resident until the tensor ends.
const LANES_BYTES: u64 = 8 * STREAM_BYTES as u64;

/// Decoded bytes a lane advances by a round, and a streamed small tensor by a piece, at
/// most (but see [`min_blocks`]): a piece decoded, hashed and handed on while it is still
/// in the cache, in buffers small enough that a short run does not spend its time faulting
/// in fresh pages for them (at [`STREAM_PIECE`], a third of `verify`'s page faults on
/// MiniLM bf16 were first touches of the lanes' buffers; 1 MiB to 512 KiB took 260 more).
const LANE_PIECE: u64 = 512 << 10;

/// The fewest blocks of `block_bytes` decoded bytes a lane's piece takes: enough that
/// their rANS planes decode [`BLOCKS_TOGETHER`] side by side, but no more than fit in
/// [`STREAM_PIECE`] (one block at least), so that memory stays bounded by the piece
/// whatever the blocks' size.
fn min_blocks(block_bytes: usize) -> usize {
    BLOCKS_TOGETHER
        .min(STREAM_PIECE.div_ceil(block_bytes.max(1)))
        .max(1)
}

/// Stored bytes of the small tensors' groups in flight at once (one group at least): enough
/// to keep two cores busy, few enough that the groups' buffers are reused.
const SMALL_BYTES: u64 = 4 * STREAM_PIECE as u64;

/// Where a lane's tensor comes from.
enum Source {
    /// A dense tensor's bytes, in the file's map.
    Dense(Mapped),
    /// A lossless tensor's block store (its blocks in the map).
    Lossless(BlockStore),
}

/// A tensor in a lane.
struct Running<'t> {
    /// Its place in the caller's list.
    index: usize,
    t: &'t TensorRecipe,
    src: Source,
    /// The next block (lossless) to decode.
    next_block: usize,
    /// Bytes produced so far, and the bytes the recipe says it decodes to.
    at: u64,
    want: u64,
    /// Its stored bytes (what it holds of the budget).
    weight: u64,
}

impl Running<'_> {
    fn left(&self) -> u64 {
        self.want.saturating_sub(self.at)
    }

    /// Produces this tensor's next piece, about `target` bytes (whole blocks, a multiple
    /// of [`min_blocks`]), into `buf`: decoded in parallel, each block checked against its
    /// digest first with `blocks`. Returns the piece's offset in the tensor and whether it
    /// is the last.
    fn produce(
        &mut self,
        target: u64,
        blocks: bool,
        buf: &mut Vec<u8>,
        scratch: &Pool,
    ) -> Result<(u64, bool)> {
        let name = &self.t.name;
        let blocks_err = |source| Error::Blocks {
            tensor: name.clone(),
            source,
        };
        let at = self.at;
        match &self.src {
            Source::Dense(bytes) => {
                buf.clear();
                let a = usize::try_from(at).unwrap_or(usize::MAX);
                let n = usize::try_from(target.max(1)).unwrap_or(usize::MAX);
                let end = a.saturating_add(n).min(bytes.len());
                buf.extend_from_slice(bytes.get(a..end).unwrap_or(&[]));
            }
            Source::Lossless(store) => {
                let (rb, br, nb) = (store.row_bytes(), store.block_rows(), store.num_blocks());
                let block_bytes = rb.saturating_mul(br);
                if block_bytes == 0 {
                    // rows of no bytes: nothing to decode (the size check below holds it)
                    buf.clear();
                    self.next_block = nb;
                } else if self.next_block < nb {
                    let b0 = self.next_block;
                    // whole groups of `min_blocks`, so no group decodes fewer side by side
                    // than it could (a piece of 11 blocks was decoded as 6 and 5)
                    let m = min_blocks(block_bytes);
                    let per = usize::try_from(target)
                        .unwrap_or(usize::MAX)
                        .div_ceil(block_bytes)
                        .div_ceil(m)
                        .saturating_mul(m);
                    let b1 = b0.saturating_add(per).min(nb);
                    if blocks {
                        store.verify_blocks(b0..b1).map_err(blocks_err)?;
                    }
                    decode_blocks(store, b0..b1, buf, name, scratch)?;
                    self.next_block = b1;
                } else {
                    buf.clear();
                }
            }
        }
        self.at = self.at.saturating_add(buf.len() as u64);
        if self.at > self.want {
            return Err(Error::Invalid {
                tensor: name.clone(),
                reason: format!("decodes to more than {} bytes", self.want),
            });
        }
        let exhausted = match &self.src {
            Source::Dense(bytes) => self.at >= bytes.len() as u64,
            Source::Lossless(store) => self.next_block >= store.num_blocks(),
        };
        if exhausted && self.at != self.want {
            return Err(Error::Invalid {
                tensor: name.clone(),
                reason: format!("decoded {} bytes, expected {}", self.at, self.want),
            });
        }
        Ok((at, exhausted))
    }
}

/// A small tensor's bytes, whole.
enum Whole {
    Mapped(Mapped),
    Decoded(Vec<u8>),
}

impl Whole {
    fn bytes(&self) -> &[u8] {
        match self {
            Whole::Mapped(m) => m,
            Whole::Decoded(v) => v,
        }
    }
}

/// One lane's piece of a round.
struct Piece {
    lane: usize,
    index: usize,
    at: u64,
    last: bool,
    bytes: Vec<u8>,
}

impl Artifact {
    /// Every tensor of `ts`, read and checked: quantized ones dequantized a piece at a time
    /// (their seal is the payload digest), tensors in parallel on
    /// [`crate::pipeline::ordered_light`]; then dense and lossless ones through
    /// [`Artifact::stream_digested`]. `sink` and `done` get each tensor's place in `ts`.
    /// What `verify` and `unpack` share.
    ///
    /// # Errors
    /// The first failure among the quantized tensors in `ts`'s order, else
    /// [`Artifact::stream_digested`]'s; or `sink`'s or `done`'s.
    pub(crate) fn stream_all(
        &self,
        ts: &[&TensorRecipe],
        blocks: bool,
        sink: impl Fn(usize, u64, &[u8]) -> Result<()> + Sync,
        mut done: impl FnMut(usize) -> Result<()> + Send,
    ) -> Result<()> {
        let (digested, quantized): (Vec<usize>, Vec<usize>) =
            (0..ts.len()).partition(|&i| ts.get(i).is_some_and(|t| has_whole_digest(t)));
        let weight = |i: &usize| ts.get(*i).map_or(0, |t| self.stored_bytes(t));
        let work = |i: usize| -> Result<usize> {
            let t = ts.get(i).ok_or(Error::Cancelled)?;
            self.stream_dequantized(t, |at, piece| sink(i, at, piece))?;
            Ok(i)
        };
        crate::pipeline::ordered_light(quantized, weight, STREAM_BYTES as u64, work, &mut done)?;
        let lanes: Vec<&TensorRecipe> = digested
            .iter()
            .filter_map(|&i| ts.get(i).copied())
            .collect();
        let place = |j: usize| digested.get(j).copied().unwrap_or(usize::MAX);
        self.stream_digested(
            &lanes,
            blocks,
            |j, at, piece| sink(place(j), at, piece),
            |j| done(place(j)),
        )
    }

    /// Streams `ts` (dense and lossless tensors: an error for a quantized one) side by
    /// side, four at a time, and checks each against its whole-tensor SHA-256, taken in
    /// lockstep with the others' (see the module's documentation). `sink` gets each
    /// piece with the tensor's place in `ts` and the piece's offset in the tensor, and
    /// `done` each tensor's place once its digest has matched. With `blocks`, every
    /// lossless block is checked against its own digest before it is decoded (`verify`);
    /// without, the whole-tensor digest is the check (`unpack`).
    ///
    /// # Errors
    /// The first failure (see the module's documentation), or `sink`'s or `done`'s.
    pub(crate) fn stream_digested(
        &self,
        ts: &[&TensorRecipe],
        blocks: bool,
        sink: impl Fn(usize, u64, &[u8]) -> Result<()> + Sync,
        done: impl FnMut(usize) -> Result<()> + Send,
    ) -> Result<()> {
        let size = |i: &usize| ts.get(*i).and_then(|t| decoded_bytes(t)).unwrap_or(0);
        // largest first, ties in the caller's order
        let mut order: Vec<usize> = (0..ts.len()).collect();
        order.sort_by_key(|i| std::cmp::Reverse(size(i)));
        let (large, small): (Vec<usize>, Vec<usize>) = order
            .into_iter()
            .partition(|i| size(i) > STREAM_PIECE as u64);
        // the two passes at once, on the caller's pool: the first's lanes are few when its
        // tensors are few (one large embedding table streams alone), and its one chain of
        // SHA-256 a tensor then leaves a core idle that the small tensors fill
        let done = std::sync::Mutex::new(done);
        let report = |i: usize| -> Result<()> {
            (done
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner))(i)
        };
        let (first, second) = rayon::join(
            || {
                self.stream_large(ts, large, blocks, &sink, &mut |ended| {
                    ended.iter().try_for_each(|&i| report(i))
                })
            },
            || self.digest_small(ts, &small, blocks, &sink, &report),
        );
        // the first pass's failure first, whatever the timing
        first.and(second)
    }

    /// The first pass of [`Artifact::stream_digested`]: tensors `queue` (indices into
    /// `ts`, largest first) streamed in lanes; `round` gets, after each round, the
    /// tensors whose digests it checked.
    fn stream_large(
        &self,
        ts: &[&TensorRecipe],
        queue: Vec<usize>,
        blocks: bool,
        sink: &(impl Fn(usize, u64, &[u8]) -> Result<()> + Sync),
        round: &mut impl FnMut(&[usize]) -> Result<()>,
    ) -> Result<()> {
        let mut queue = queue.into_iter().peekable();
        let mut lanes: Vec<Option<Running<'_>>> = (0..LANES).map(|_| None).collect();
        let mut spare: Vec<Vec<u8>> = Vec::new();
        let mut in_flight = 0u64;
        let mut hasher = Sha256Streams::new(LANES);
        // the lanes whose tensors' digests are XXH3-128 (lossless, version 4): fed here
        // and not to `hasher`, whose stream for that lane stays empty
        let mut xxh: Vec<Option<Box<Xxh3>>> = (0..LANES).map(|_| None).collect();
        // decoders' scratch space, reused from piece to piece
        let scratch = Pool::default();

        // fills free lanes within the budget, then produces every lane's next piece
        let mut next_round = |mut bufs: Vec<Vec<u8>>| -> Result<Vec<Piece>> {
            for slot in lanes.iter_mut() {
                if slot.is_some() {
                    continue;
                }
                let Some(&i) = queue.peek() else { break };
                let Some(t) = ts.get(i) else { break };
                let weight = self.stored_bytes(t);
                if in_flight > 0 && in_flight.saturating_add(weight) > LANES_BYTES {
                    break;
                }
                queue.next();
                *slot = Some(self.start(i, t, weight)?);
                in_flight = in_flight.saturating_add(weight);
            }
            // every lane advances by about what the shortest has left
            let target = lanes
                .iter()
                .flatten()
                .map(Running::left)
                .filter(|&n| n > 0)
                .min()
                .unwrap_or(0)
                .min(LANE_PIECE);
            let mut work: Vec<(usize, &mut Running<'_>, Vec<u8>)> = Vec::new();
            for (lane, r) in lanes.iter_mut().enumerate() {
                if let Some(r) = r.as_mut() {
                    work.push((lane, r, bufs.pop().unwrap_or_default()));
                }
            }
            let produced: Vec<Result<Piece>> = work
                .into_par_iter()
                .map(|(lane, r, mut bytes)| {
                    let (at, last) = r.produce(target, blocks, &mut bytes, &scratch)?;
                    Ok(Piece {
                        lane,
                        index: r.index,
                        at,
                        last,
                        bytes,
                    })
                })
                .collect();
            // the failure of the tensor first in the caller's order
            let mut pieces = Vec::with_capacity(produced.len());
            let mut failed: Option<(usize, Error)> = None;
            for (p, lane) in produced.into_iter().zip(lanes.iter().flatten()) {
                match p {
                    Ok(p) => pieces.push(p),
                    Err(e) => {
                        if failed.as_ref().is_none_or(|(i, _)| lane.index < *i) {
                            failed = Some((lane.index, e));
                        }
                    }
                }
            }
            if let Some((_, e)) = failed {
                return Err(e);
            }
            for p in &pieces {
                if p.last
                    && let Some(slot) = lanes.get_mut(p.lane)
                    && let Some(r) = slot.take()
                {
                    in_flight = in_flight.saturating_sub(r.weight);
                }
            }
            Ok(pieces)
        };

        // hashes one round's pieces, gives them to `sink`, checks the tensors that ended
        // (their places in `ts`, for `done` on the calling thread)
        let take = |(hasher, xxh): (&mut Sha256Streams, &mut Vec<Option<Box<Xxh3>>>),
                    pieces: &[Piece]|
         -> Result<Vec<usize>> {
            let mut ended = Vec::new();
            let mut feed: Vec<&[u8]> = vec![&[]; LANES];
            for p in pieces {
                sink(p.index, p.at, &p.bytes)?;
                let t = ts.get(p.index).ok_or(Error::Cancelled)?;
                if t.whole_digest() == Some(WholeDigest::Xxh3) {
                    if let Some(x) = xxh.get_mut(p.lane) {
                        x.get_or_insert_with(|| Box::new(Xxh3::new()))
                            .update(&p.bytes);
                    }
                } else if let Some(f) = feed.get_mut(p.lane) {
                    *f = &p.bytes;
                }
            }
            hasher.update(&feed);
            for p in pieces.iter().filter(|p| p.last) {
                let t = ts.get(p.index).ok_or(Error::Cancelled)?;
                let got = if t.whole_digest() == Some(WholeDigest::Xxh3) {
                    // a tensor of no bytes fed nothing: the empty input's digest
                    let x = xxh.get_mut(p.lane).and_then(Option::take);
                    xxh3_128_hex(x.unwrap_or_default().digest128())
                } else {
                    hex(&hasher.finish(p.lane).unwrap_or_default())
                };
                whole_digest(t, &got)?;
                ended.push(p.index);
            }
            Ok(ended)
        };

        let mut ready = next_round(Vec::new())?;
        while !ready.is_empty() {
            let bufs = std::mem::take(&mut spare);
            let (taken, next) = rayon::join(
                || take((&mut hasher, &mut xxh), &ready),
                || next_round(bufs),
            );
            round(&taken?)?;
            let next = next?;
            spare = std::mem::replace(&mut ready, next)
                .into_iter()
                .map(|p| p.bytes)
                .collect();
        }
        Ok(())
    }

    /// The second pass of [`Artifact::stream_digested`]: tensors `small` (indices into
    /// `ts`, largest first, each at most [`STREAM_PIECE`] decoded bytes), four at a time.
    fn digest_small(
        &self,
        ts: &[&TensorRecipe],
        small: &[usize],
        blocks: bool,
        sink: &(impl Fn(usize, u64, &[u8]) -> Result<()> + Sync),
        done: &(impl Fn(usize) -> Result<()> + Sync),
    ) -> Result<()> {
        let weight = |g: &&[usize]| {
            g.iter()
                .filter_map(|&i| ts.get(i))
                .map(|t| self.stored_bytes(t))
                .fold(0, u64::saturating_add)
        };
        // decoded buffers reused from group to group: fresh ones cost a page fault every
        // 4 KiB, which was a tenth of `verify`'s time on MiniLM
        let pool = Pool::default();
        let scratch = Pool::default();
        let work = |g: &[usize]| -> Result<Vec<usize>> {
            // lossless tensors with an XXH3-128 digest stream a piece at a time through
            // one reused buffer (checked and handed to `sink` here: `None`); the others
            // are read whole, for their SHA-256s four at a time below
            let read: Vec<Result<Option<Whole>>> = g
                .par_iter()
                .map(|&i| match ts.get(i) {
                    Some(t) if t.lossless_whole_digest() == Some(WholeDigest::Xxh3) => self
                        .stream_small(i, t, blocks, sink, &pool, &scratch)
                        .map(|()| None),
                    Some(t) => self.read_whole(t, blocks, &pool, &scratch).map(Some),
                    None => Err(Error::Cancelled),
                })
                .collect();
            // the failure of the tensor first in the caller's order
            let mut failed: Option<(usize, Error)> = None;
            let mut found = Vec::with_capacity(read.len());
            for (&i, r) in g.iter().zip(read) {
                match r {
                    Ok(Some(w)) => found.push((i, w)),
                    Ok(None) => {}
                    Err(e) if failed.as_ref().is_none_or(|(f, _)| i < *f) => failed = Some((i, e)),
                    Err(_) => {}
                }
            }
            // SHA-256s four at a time
            let msgs: Vec<&[u8]> = found.iter().map(|(_, w)| w.bytes()).collect();
            for ((i, w), sha) in found.iter().zip(sha256_many(&msgs)) {
                let Some(t) = ts.get(*i) else { continue };
                if let Err(e) = whole_digest(t, &hex(&sha))
                    && failed.as_ref().is_none_or(|(f, _)| i < f)
                {
                    failed = Some((*i, e));
                }
                if failed.is_none() {
                    sink(*i, 0, w.bytes())?;
                }
            }
            for (_, w) in found {
                if let Whole::Decoded(buf) = w {
                    pool.give(buf);
                }
            }
            match failed {
                Some((_, e)) => Err(e),
                None => Ok(g.to_vec()),
            }
        };
        // waves of groups whose stored bytes fit SMALL_BYTES (one group at least), each
        // wave's groups in parallel: a pool worker may run this, so nothing here waits on
        // a channel (as `pipeline::ordered_light` does) while the pool has work queued
        let groups: Vec<&[usize]> = small.chunks(LANES).collect();
        let mut at = 0;
        while at < groups.len() {
            let (mut end, mut bytes) = (at, 0u64);
            while let Some(g) = groups.get(end) {
                let w = weight(g);
                if end > at && bytes.saturating_add(w) > SMALL_BYTES {
                    break;
                }
                bytes = bytes.saturating_add(w);
                end = end.saturating_add(1);
            }
            let wave = groups.get(at..end).unwrap_or(&[]);
            let results: Vec<Result<Vec<usize>>> = wave.par_iter().map(|g| work(g)).collect();
            // the first failing group in order
            for r in results {
                r?.into_iter().try_for_each(done)?;
            }
            at = end;
        }
        Ok(())
    }

    /// Small tensor `t` (at `index` in the caller's list), lossless with an XXH3-128
    /// digest: decoded [`LANE_PIECE`] at a time (see [`Running::produce`]), each piece's
    /// blocks checked against their digests first with `blocks`, into one buffer from
    /// `pool` that stays in the cache while `sink` and the digest read it (decoded whole,
    /// the tensors' fresh buffers were a third of `verify`'s page faults on MiniLM bf16),
    /// then the digest checked.
    fn stream_small(
        &self,
        index: usize,
        t: &TensorRecipe,
        blocks: bool,
        sink: &(impl Fn(usize, u64, &[u8]) -> Result<()> + Sync),
        pool: &Pool,
        scratch: &Pool,
    ) -> Result<()> {
        let mut r = self.start(index, t, 0)?;
        let mut buf = pool.take();
        let mut x = Xxh3::new();
        let mut piece = || -> Result<()> {
            loop {
                let (at, last) = r.produce(LANE_PIECE, blocks, &mut buf, scratch)?;
                sink(index, at, &buf)?;
                x.update(&buf);
                if last {
                    return Ok(());
                }
            }
        };
        let streamed = piece();
        pool.give(buf);
        streamed?;
        whole_digest(t, &xxh3_128_hex(x.digest128()))
    }

    /// A small tensor's decoded bytes, whole: a dense one's in the file's map, a lossless
    /// one's decoded (its blocks checked against their digests first, with `blocks`).
    /// The size is checked here, the whole-tensor digest by the caller.
    fn read_whole(
        &self,
        t: &TensorRecipe,
        blocks: bool,
        pool: &Pool,
        scratch: &Pool,
    ) -> Result<Whole> {
        let want = decoded_bytes(t).unwrap_or(u64::MAX);
        let w = match &t.storage {
            StorageRecipe::Dense => Whole::Mapped(self.map_entry(&t.name)?),
            StorageRecipe::Lossless { .. } => match self.open_stored(&t.name)? {
                Stored::Lossless(mut store) => {
                    let err = |source| Error::Blocks {
                        tensor: t.name.clone(),
                        source,
                    };
                    if blocks {
                        store.verify_all().map_err(err)?;
                    }
                    store.skip_block_digests();
                    let mut buf = pool.take();
                    decode_blocks(&store, 0..store.num_blocks(), &mut buf, &t.name, scratch)?;
                    Whole::Decoded(buf)
                }
                _ => return Err(not_digested(t)),
            },
            StorageRecipe::Quant { .. } => return Err(not_digested(t)),
        };
        if w.bytes().len() as u64 != want {
            return Err(Error::Invalid {
                tensor: t.name.clone(),
                reason: format!("decoded {} bytes, expected {want}", w.bytes().len()),
            });
        }
        Ok(w)
    }

    /// Opens tensor `t` for a lane: its recipe against the store (lossless), no digest
    /// checked yet.
    fn start<'t>(&self, index: usize, t: &'t TensorRecipe, weight: u64) -> Result<Running<'t>> {
        let want = decoded_bytes(t).unwrap_or(u64::MAX);
        let src = match &t.storage {
            StorageRecipe::Dense => Source::Dense(self.map_entry(&t.name)?),
            StorageRecipe::Lossless { .. } => match self.open_stored(&t.name)? {
                Stored::Lossless(mut store) => {
                    // blocks are checked a piece at a time, four digests at once
                    store.skip_block_digests();
                    Source::Lossless(store)
                }
                _ => return Err(not_digested(t)),
            },
            StorageRecipe::Quant { .. } => return Err(not_digested(t)),
        };
        Ok(Running {
            index,
            t,
            src,
            next_block: 0,
            at: 0,
            want,
            weight,
        })
    }
}

fn not_digested(t: &TensorRecipe) -> Error {
    Error::Invalid {
        tensor: t.name.clone(),
        reason: "a quantized tensor has no whole-tensor digest to stream against".into(),
    }
}

/// `got` (hex of the digest `t.whole_digest()` names) against `t`'s whole-tensor digest.
fn whole_digest(t: &TensorRecipe, got: &str) -> Result<()> {
    if t.whole_is(got) {
        Ok(())
    } else {
        Err(Error::Digest {
            tensor: t.name.clone(),
            what: "whole tensor".into(),
        })
    }
}

/// Decodes blocks `range` of `store` into `buf` (resized to their rows; every byte is
/// decoded over, so a reused buffer is not zeroed first), in parallel.
fn decode_blocks(
    store: &BlockStore,
    range: std::ops::Range<usize>,
    buf: &mut Vec<u8>,
    name: &str,
    scratch: &Pool,
) -> Result<()> {
    let (rb, br) = (store.row_bytes(), store.block_rows());
    let block_bytes = rb.saturating_mul(br).max(1);
    let r0 = (range.start as u64).saturating_mul(br as u64);
    let r1 = (range.end as u64)
        .saturating_mul(br as u64)
        .min(store.rows());
    let len = usize::try_from(r1.saturating_sub(r0))
        .ok()
        .and_then(|r| r.checked_mul(rb))
        .ok_or_else(|| Error::Invalid {
            tensor: name.into(),
            reason: "block range overflows".into(),
        })?;
    buf.resize(len, 0);
    let b0 = range.start;
    // groups of blocks whose rANS planes decode together, each decoder in scratch space
    // from the pool (zeroing fresh space was 3.5% of `verify`'s time)
    buf.par_chunks_mut(block_bytes.saturating_mul(BLOCKS_TOGETHER))
        .enumerate()
        .try_for_each_init(
            || Pooled {
                dec: Decoder::with_scratch(store, scratch.take()),
                pool: scratch,
            },
            |Pooled { dec, .. }, (i, dst)| {
                let b = b0.saturating_add(i.saturating_mul(BLOCKS_TOGETHER));
                dec.decode_blocks(b..b.saturating_add(BLOCKS_TOGETHER).min(range.end), dst)
            },
        )
        .map_err(|source| Error::Blocks {
            tensor: name.into(),
            source,
        })
}

/// A decoder that gives its scratch space back to its pool when dropped.
struct Pooled<'s, 'p> {
    dec: Decoder<'s>,
    pool: &'p Pool,
}

impl Drop for Pooled<'_, '_> {
    fn drop(&mut self) {
        self.pool.give(self.dec.take_scratch());
    }
}

/// Buffers handed back for reuse.
#[derive(Default)]
struct Pool(std::sync::Mutex<Vec<Vec<u8>>>);

impl Pool {
    fn take(&self) -> Vec<u8> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .pop()
            .unwrap_or_default()
    }

    fn give(&self, buf: Vec<u8>) {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(buf);
    }
}
