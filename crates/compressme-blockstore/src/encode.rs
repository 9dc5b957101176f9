//! Building a store: transform, planes, table clustering, per-plane modes, digests.

use std::sync::Arc;

use rayon::prelude::*;
use sha2::{Digest, Sha256};

use crate::format::{
    MAX_BLOCK_BYTES, MAX_TABLES, MODE_CONST, MODE_HUFFMAN, MODE_HUFFMAN_ROWS, MODE_RANS, MODE_RAW,
    MODE_ZSTD, put_varint, varint_len,
};
use crate::huffman::{CodeLengths, Decoder, Encoder};
use crate::rans;
use crate::{BlockStore, Coder, EncodeOptions, Error, Result, ValueKind};

/// One block's byte counts in one plane (a block is at most 2^28 bytes, so they fit).
type Histogram = [u32; 256];

/// Input bytes whose coded blocks are held at once before they join the payload.
const GROUP_BYTES: usize = 8 << 20;

/// Rotates the sign bit of every element to bit 0, in place (inverse: `unrotate`).
pub(crate) fn rotate(kind: ValueKind, bytes: &mut [u8]) {
    if !kind.rotates_sign() {
        return;
    }
    match kind.element_size().bytes() {
        2 => bytes.chunks_exact_mut(2).for_each(|c| {
            let v = u16::from_le_bytes([c[0], c[1]]).rotate_left(1);
            c.copy_from_slice(&v.to_le_bytes());
        }),
        4 => bytes.chunks_exact_mut(4).for_each(|c| {
            let v = u32::from_le_bytes([c[0], c[1], c[2], c[3]]).rotate_left(1);
            c.copy_from_slice(&v.to_le_bytes());
        }),
        8 => bytes.chunks_exact_mut(8).for_each(|c| {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            c.copy_from_slice(&u64::from_le_bytes(w).rotate_left(1).to_le_bytes());
        }),
        _ => {}
    }
}

/// Row-indexed body: u16 byte lengths of rows `0..rows-1` (the last row's is implied),
/// then each row's own byte-aligned stream.
fn encode_rows(enc: &Encoder, plane: &[u8], re: usize, out: &mut Vec<u8>) {
    let mut segs = Vec::with_capacity(plane.len());
    let mut lens = Vec::new();
    for row in plane.chunks(re.max(1)) {
        let before = segs.len();
        enc.encode(row, &mut segs);
        lens.push(segs.len() - before);
    }
    lens.pop();
    for l in lens {
        // a row of at most 2^16 elements codes to at most 12 bits each: refuse wider rows
        // before this point (see `validate`), so the length always fits
        out.extend_from_slice(&(l as u16).to_le_bytes());
    }
    out.extend_from_slice(&segs);
}

/// What the first pass learns of a block: per plane, its histogram and whether it is
/// constant. The planes themselves are made again when the block is encoded, so the
/// whole tensor is never held twice.
/// Compact body: the first `ceil(rows / 2)` rows and the rest as two bit streams, the
/// first one's byte length (LEB128) in front, so a decoder can run both at once.
fn encode_halves(enc: &Encoder, plane: &[u8], rows: usize, out: &mut Vec<u8>) {
    let re = plane.len() / rows.max(1);
    let (a, b) = plane.split_at((rows.div_ceil(2) * re).min(plane.len()));
    let mut first = Vec::with_capacity(a.len());
    enc.encode(a, &mut first);
    put_varint(out, first.len() as u64);
    out.extend_from_slice(&first);
    enc.encode(b, out);
}

struct BlockStats {
    rows: usize,
    hists: Vec<Histogram>,
    constant: Vec<bool>,
}

/// Per-thread buffers for making the planes of one block.
#[derive(Default)]
struct Scratch {
    rotated: Vec<u8>,
    planes: Vec<u8>,
}

/// Rotates and shuffles `block` into `scratch.planes` (`E` planes of `n` bytes each).
fn make_planes(kind: ValueKind, block: &[u8], scratch: &mut Scratch) {
    scratch.planes.resize(block.len(), 0);
    match (kind.rotates_sign(), kind.element_size().bytes()) {
        // the common cases in one pass: rotate each element as it is scattered to the planes
        (true, 4) => rotate_shuffle4(block, &mut scratch.planes),
        (true, 2) => rotate_shuffle2(block, &mut scratch.planes),
        _ => {
            scratch.rotated.clear();
            scratch.rotated.extend_from_slice(block);
            rotate(kind, &mut scratch.rotated);
            // lengths are equal by construction
            let _ = compressme_shuffle::shuffle_into(
                kind.element_size(),
                &scratch.rotated,
                &mut scratch.planes,
            );
        }
    }
}

/// Rotates each 4-byte element left by one bit and writes byte `k` of element `i` to
/// `planes[k * n + i]`: the sign rotation and the shuffle in one pass, 16 elements at a
/// time so the compiler keeps them in vector registers (about 4x the element-at-a-time
/// loop). Rows are whole elements, so `block` has no partial element.
fn rotate_shuffle4(block: &[u8], planes: &mut [u8]) {
    let n = block.len() / 4;
    let (p0, rest) = planes.split_at_mut(n.min(planes.len()));
    let (p1, rest) = rest.split_at_mut(n.min(rest.len()));
    let (p2, p3) = rest.split_at_mut(n.min(rest.len()));
    let m = n.min(p3.len());
    let p3 = &mut p3[..m];
    const L: usize = 16;
    let (mut src, mut o0, mut o1, mut o2, mut o3) = (
        block.chunks_exact(4 * L),
        p0.chunks_exact_mut(L),
        p1.chunks_exact_mut(L),
        p2.chunks_exact_mut(L),
        p3.chunks_exact_mut(L),
    );
    for ((((s, a), b), c), d) in (&mut src)
        .zip(&mut o0)
        .zip(&mut o1)
        .zip(&mut o2)
        .zip(&mut o3)
    {
        // fixed-size views: no bounds checks in the loop, so it vectorizes
        let (Ok(s), Ok(a), Ok(b), Ok(c), Ok(d)) = (
            <&[u8; 4 * L]>::try_from(s),
            <&mut [u8; L]>::try_from(a),
            <&mut [u8; L]>::try_from(b),
            <&mut [u8; L]>::try_from(c),
            <&mut [u8; L]>::try_from(d),
        ) else {
            continue;
        };
        for i in 0..L {
            let v = u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
            let [x0, x1, x2, x3] = v.rotate_left(1).to_le_bytes();
            a[i] = x0;
            b[i] = x1;
            c[i] = x2;
            d[i] = x3;
        }
    }
    let tail = src.remainder().chunks_exact(4);
    let outs = (o0.into_remainder().iter_mut())
        .zip(o1.into_remainder().iter_mut())
        .zip(o2.into_remainder().iter_mut())
        .zip(o3.into_remainder().iter_mut());
    for (e, (((a, b), c), d)) in tail.zip(outs) {
        let [x0, x1, x2, x3] = u32::from_le_bytes([e[0], e[1], e[2], e[3]])
            .rotate_left(1)
            .to_le_bytes();
        (*a, *b, *c, *d) = (x0, x1, x2, x3);
    }
}

/// [`rotate_shuffle4`] for 2-byte elements.
fn rotate_shuffle2(block: &[u8], planes: &mut [u8]) {
    let n = block.len() / 2;
    let (p0, p1) = planes.split_at_mut(n.min(planes.len()));
    let m = n.min(p1.len());
    let p1 = &mut p1[..m];
    const L: usize = 32;
    let (mut src, mut o0, mut o1) = (
        block.chunks_exact(2 * L),
        p0.chunks_exact_mut(L),
        p1.chunks_exact_mut(L),
    );
    for ((s, a), b) in (&mut src).zip(&mut o0).zip(&mut o1) {
        let (Ok(s), Ok(a), Ok(b)) = (
            <&[u8; 2 * L]>::try_from(s),
            <&mut [u8; L]>::try_from(a),
            <&mut [u8; L]>::try_from(b),
        ) else {
            continue;
        };
        for i in 0..L {
            let [x0, x1] = u16::from_le_bytes([s[2 * i], s[2 * i + 1]])
                .rotate_left(1)
                .to_le_bytes();
            a[i] = x0;
            b[i] = x1;
        }
    }
    let tail = src.remainder().chunks_exact(2);
    let outs = (o0.into_remainder().iter_mut()).zip(o1.into_remainder().iter_mut());
    for (e, (a, b)) in tail.zip(outs) {
        let [x0, x1] = u16::from_le_bytes([e[0], e[1]])
            .rotate_left(1)
            .to_le_bytes();
        (*a, *b) = (x0, x1);
    }
}

fn block_stats(
    kind: ValueKind,
    block: &[u8],
    row_bytes: usize,
    scratch: &mut Scratch,
) -> BlockStats {
    let e = kind.element_size().bytes();
    let rows = block.len().checked_div(row_bytes).unwrap_or(0);
    // the common cases count each rotated element's bytes where they are, without
    // making the planes (the encoder makes them once, when it codes the block)
    let direct = match (kind.rotates_sign(), e) {
        (true, 4) => Some(count_rotated::<4>(block, |w| {
            u32::from_le_bytes([w[0], w[1], w[2], w[3]])
                .rotate_left(1)
                .to_le_bytes()
        })),
        (true, 2) => Some(count_rotated::<2>(block, |w| {
            u16::from_le_bytes([w[0], w[1]])
                .rotate_left(1)
                .to_le_bytes()
        })),
        _ => None,
    };
    if let Some(hists) = direct {
        // a plane is constant when one byte value takes all of it
        let constant = hists
            .iter()
            .map(|h| h.iter().filter(|&&c| c > 0).count() == 1)
            .collect();
        return BlockStats {
            rows,
            hists,
            constant,
        };
    }
    make_planes(kind, block, scratch);
    let n = block.len() / e;
    let planes = (0..e).map(|k| scratch.planes.get(k * n..(k + 1) * n).unwrap_or(&[]));
    let mut hists = Vec::with_capacity(e);
    let mut constant = Vec::with_capacity(e);
    for plane in planes {
        // four partial counts, so consecutive equal bytes do not wait on one another
        let mut part = [[0u32; 256]; 4];
        let mut quads = plane.chunks_exact(4);
        for q in &mut quads {
            part[0][usize::from(q[0])] += 1;
            part[1][usize::from(q[1])] += 1;
            part[2][usize::from(q[2])] += 1;
            part[3][usize::from(q[3])] += 1;
        }
        for &b in quads.remainder() {
            part[0][usize::from(b)] += 1;
        }
        let mut h = [0u32; 256];
        for (i, x) in h.iter_mut().enumerate() {
            *x = part[0][i] + part[1][i] + part[2][i] + part[3][i];
        }
        hists.push(h);
        constant.push(is_constant(plane));
    }
    BlockStats {
        rows,
        hists,
        constant,
    }
}

/// Per plane, the counts of byte `k` of each `N`-byte element rotated by `rot`: what
/// [`make_planes`] then a count of each plane gives, in one pass and without writing
/// the planes. Two partial counts a plane (even and odd elements), so runs of equal
/// bytes (an exponent plane is mostly a few values) do not wait on one another.
fn count_rotated<const N: usize>(
    block: &[u8],
    rot: impl Fn(&[u8; N]) -> [u8; N],
) -> Vec<Histogram> {
    let mut part = vec![[[0u32; 256]; 2]; N];
    let mut pairs = block.chunks_exact(2 * N);
    for p in &mut pairs {
        let (a, b) = p.split_at(N);
        let (Ok(a), Ok(b)) = (<&[u8; N]>::try_from(a), <&[u8; N]>::try_from(b)) else {
            continue;
        };
        let (ra, rb) = (rot(a), rot(b));
        for (k, pk) in part.iter_mut().enumerate() {
            pk[0][usize::from(ra[k])] += 1;
            pk[1][usize::from(rb[k])] += 1;
        }
    }
    for c in pairs.remainder().chunks_exact(N) {
        if let Ok(w) = <&[u8; N]>::try_from(c) {
            for (pk, &x) in part.iter_mut().zip(rot(w).iter()) {
                pk[0][usize::from(x)] += 1;
            }
        }
    }
    part.iter()
        .map(|[even, odd]| {
            let mut h = [0u32; 256];
            for ((x, &a), &b) in h.iter_mut().zip(even.iter()).zip(odd.iter()) {
                *x = a + b;
            }
            h
        })
        .collect()
}

fn is_constant(plane: &[u8]) -> bool {
    plane
        .first()
        .is_some_and(|&f| plane.iter().all(|&b| b == f))
}

/// Approximate information content of a histogram in bits (for seeding clusters).
fn entropy_bits(h: &Histogram) -> f64 {
    let total: u64 = h.iter().map(|&c| u64::from(c)).sum();
    if total == 0 {
        return 0.0;
    }
    let t = total as f64;
    h.iter()
        .filter(|&&c| c > 0)
        .map(|&c| -(c as f64) * (c as f64 / t).log2())
        .sum()
}

fn sum_hists<'a>(hs: impl Iterator<Item = &'a Histogram>) -> [u64; 256] {
    let mut acc = [0u64; 256];
    for h in hs {
        for (a, &c) in acc.iter_mut().zip(h.iter()) {
            *a += u64::from(c);
        }
    }
    acc
}

fn best_table(tables: &[CodeLengths], h: &Histogram) -> (usize, u64) {
    tables
        .iter()
        .enumerate()
        .map(|(i, t)| (i, t.block_cost_bits(h)))
        .min_by_key(|&(i, c)| (c, i))
        .unwrap_or((0, u64::MAX))
}

/// Whether no table can pay for a plane with these block histograms: no block's entropy
/// (which no code beats) fits in `max_coded_fraction` of its bytes, and, where rANS tables
/// are allowed (`min_gain`), the plane's entropy is not `min_gain` below its raw bytes.
/// Such a plane is stored raw without clustering tables for it (near-uniform mantissa
/// planes: most of the clustering time of a checkpoint, for nothing).
fn hopeless(hists: &[&Histogram], max_coded_fraction: f64, min_gain: Option<f64>) -> bool {
    let raw = |h: &Histogram| h.iter().map(|&c| f64::from(c)).sum::<f64>();
    let huffman_may = hists
        .iter()
        .any(|h| entropy_bits(h) / 8.0 < (raw(h) * max_coded_fraction).floor());
    let rans_may = min_gain.is_some_and(|g| {
        let (bits, bytes) = hists
            .iter()
            .fold((0.0, 0.0), |(b, n), h| (b + entropy_bits(h), n + raw(h)));
        bits / 8.0 < bytes * (1.0 - g)
    });
    !huffman_may && !rans_may
}

/// Drops the Huffman tables of plane `k` that no block will be coded with (each block takes
/// its cheapest table when that fits the coded-fraction budget, as `encode_block` does), so
/// a store does not carry 128 bytes for a table nothing reads. Each block's choice is the
/// same after the drop: its cheapest table is kept, and the kept tables keep their order.
fn keep_used(tables: &mut Vec<CodeLengths>, stats: &[BlockStats], k: usize, fraction: f64) {
    let mut used = vec![false; tables.len()];
    for b in stats {
        if b.constant.get(k).copied().unwrap_or(true) {
            continue;
        }
        if let Some(h) = b.hists.get(k) {
            let n: u64 = h.iter().map(|&c| u64::from(c)).sum();
            let budget = (n as f64 * fraction).floor() as u64;
            let (t, bits) = best_table(tables, h);
            if bits.div_ceil(8) < budget
                && let Some(u) = used.get_mut(t)
            {
                *u = true;
            }
        }
    }
    let mut flags = used.into_iter();
    tables.retain(|_| flags.next().unwrap_or(false));
}

/// Clusters block histograms into at most `k` shared code tables, keeping the count that
/// minimises coded bits plus table bytes. Deterministic.
fn cluster_tables(hists: &[&Histogram], k: usize, parallel: bool) -> Vec<CodeLengths> {
    if hists.is_empty() {
        return Vec::new();
    }
    // every block's best table and its cost: one pass over blocks x tables, reused for the
    // total, the next seed and the next grouping (on all cores when `parallel`: the same
    // result, each block's choice is its own)
    let assign = |tables: &[CodeLengths]| -> Vec<(usize, u64)> {
        if parallel {
            hists.par_iter().map(|h| best_table(tables, h)).collect()
        } else {
            hists.iter().map(|h| best_table(tables, h)).collect()
        }
    };
    let total = |tables: &[CodeLengths], a: &[(usize, u64)]| -> u64 {
        a.iter().fold(128 * tables.len() as u64, |acc, &(_, c)| {
            acc.saturating_add(c.div_ceil(8))
        })
    };
    let mut tables = vec![CodeLengths::from_counts(&sum_hists(hists.iter().copied()))];
    let mut a = assign(&tables);
    let mut best = (total(&tables, &a), tables.clone());
    let entropies: Vec<f64> = if k > 1 {
        hists.iter().map(|h| entropy_bits(h)).collect()
    } else {
        Vec::new()
    };
    // one split per extra table allowed; a split whose seed wins no block just shrinks back
    for _ in 1..k.min(hists.len()) {
        // seed a new table with the block the current tables serve worst
        let seed = a
            .iter()
            .zip(&entropies)
            .map(|(&(_, c), e)| c.min(u64::MAX >> 12) as f64 - e)
            .enumerate()
            .max_by(|x, y| x.1.total_cmp(&y.1).then(y.0.cmp(&x.0)))
            .map_or(0, |(i, _)| i);
        let pushed = if let Some(h) = hists.get(seed) {
            tables.push(CodeLengths::from_counts(&h.map(u64::from)));
            true
        } else {
            false
        };
        // a few Lloyd iterations: assign, rebuild from the groups, drop empty ones
        for round in 0..3 {
            a = match (round, pushed, tables.last()) {
                // `a` holds every block's best among the tables before the seed: only the
                // seed's costs are new, and it wins a block only when strictly cheaper
                // (ties go to the lower index, as in `best_table`)
                (0, true, Some(seed_table)) => {
                    let new = tables.len() - 1;
                    let pick = |(&(t, c), h): (&(usize, u64), &&Histogram)| {
                        let nc = seed_table.block_cost_bits(h);
                        if nc < c { (new, nc) } else { (t, c) }
                    };
                    if parallel {
                        a.par_iter().zip(hists.par_iter()).map(pick).collect()
                    } else {
                        a.iter().zip(hists.iter()).map(pick).collect()
                    }
                }
                _ => assign(&tables),
            };
            let mut sums = vec![[0u64; 256]; tables.len()];
            let mut used = vec![false; tables.len()];
            for (h, &(t, _)) in hists.iter().zip(&a) {
                if let (Some(sum), Some(u)) = (sums.get_mut(t), used.get_mut(t)) {
                    for (x, &c) in sum.iter_mut().zip(h.iter()) {
                        *x += u64::from(c);
                    }
                    *u = true;
                }
            }
            tables = sums
                .iter()
                .zip(&used)
                .filter(|(_, u)| **u)
                .map(|(sum, _)| CodeLengths::from_counts(sum))
                .collect();
        }
        a = assign(&tables);
        let cost = total(&tables, &a);
        if cost < best.0 {
            best = (cost, tables.clone());
        }
    }
    best.1
}

fn validate(data: &[u8], rows: u64, row_bytes: usize, opts: &EncodeOptions) -> Result<()> {
    let e = opts.kind.element_size().bytes();
    let bad = |m: String| Err(Error::InvalidInput(m));
    if opts.block_rows == 0 {
        return bad("block_rows must be at least 1".into());
    }
    if !row_bytes.is_multiple_of(e) {
        return bad(format!(
            "row of {row_bytes} bytes is not a whole number of {e}-byte elements"
        ));
    }
    let dense = usize::try_from(rows)
        .ok()
        .and_then(|r| r.checked_mul(row_bytes));
    if dense != Some(data.len()) {
        return bad(format!(
            "{} bytes given for {rows} rows of {row_bytes} bytes",
            data.len()
        ));
    }
    if opts
        .block_rows
        .checked_mul(row_bytes)
        .is_none_or(|b| b > MAX_BLOCK_BYTES)
    {
        return bad(format!(
            "a block of {} rows of {row_bytes} bytes exceeds the {MAX_BLOCK_BYTES}-byte block limit",
            opts.block_rows
        ));
    }
    if opts.row_index && row_bytes / e > 40_000 {
        return bad(format!(
            "a row index needs rows of at most 40000 elements, got {}",
            row_bytes / e
        ));
    }
    if !(opts.max_coded_fraction > 0.0 && opts.max_coded_fraction <= 1.0) {
        return bad(format!(
            "max_coded_fraction {} is not in (0, 1]",
            opts.max_coded_fraction
        ));
    }
    match opts.coder {
        Coder::SharedHuffman { max_tables }
        | Coder::SharedRans { max_tables }
        | Coder::Mixed { max_tables }
            if max_tables == 0 || usize::from(max_tables) > MAX_TABLES =>
        {
            bad(format!(
                "max_tables {max_tables} is not in 1..={MAX_TABLES}"
            ))
        }
        Coder::Zstd { level } if !(1..=22).contains(&level) => {
            bad(format!("zstd level {level} is not in 1..=22"))
        }
        _ => Ok(()),
    }
}

impl BlockStore {
    /// Encodes a row-major `[rows, row_bytes]` byte matrix.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when the bytes do not match the shape, a row is not a whole
    /// number of elements, or the options are out of range. Nothing is kept on error.
    pub fn encode(data: &[u8], rows: u64, row_bytes: usize, opts: &EncodeOptions) -> Result<Self> {
        validate(data, rows, row_bytes, opts)?;
        let kind = opts.kind;
        let e = kind.element_size().bytes();
        let block_bytes = opts.block_rows * row_bytes;
        let chunks: Vec<&[u8]> = if block_bytes == 0 {
            vec![&[][..]; num_blocks(rows, opts.block_rows)]
        } else {
            data.chunks(block_bytes).collect()
        };

        let stats: Vec<BlockStats> = if opts.parallel {
            chunks
                .par_iter()
                .map_init(Scratch::default, |sc, c| {
                    block_stats(kind, c, row_bytes, sc)
                })
                .collect()
        } else {
            let mut sc = Scratch::default();
            chunks
                .iter()
                .map(|c| block_stats(kind, c, row_bytes, &mut sc))
                .collect()
        };

        // the least a rANS plane must save over Huffman tables or raw to be taken
        let min_gain = match opts.coder {
            Coder::SharedRans { .. } => Some(0.0),
            Coder::Mixed { .. } if !opts.row_index => Some(crate::MIXED_MIN_GAIN),
            _ => None,
        };
        let mut tables: Vec<Vec<CodeLengths>> = match opts.coder {
            Coder::SharedHuffman { max_tables }
            | Coder::SharedRans { max_tables }
            | Coder::Mixed { max_tables } => {
                let plane = |k: usize| {
                    let hs: Vec<&Histogram> = stats
                        .iter()
                        .filter(|b| !b.constant.get(k).copied().unwrap_or(true))
                        .filter_map(|b| b.hists.get(k))
                        .collect();
                    if hopeless(&hs, opts.max_coded_fraction, min_gain) {
                        return Vec::new();
                    }
                    // every block takes part: sampling 512 or 1024 of MiniLM's 1908 blocks
                    // sped clustering up but cost up to 0.13% of dense bytes on bf16
                    cluster_tables(&hs, usize::from(max_tables), opts.parallel)
                };
                // planes are independent: clustered side by side
                if opts.parallel {
                    (0..e).into_par_iter().map(plane).collect()
                } else {
                    (0..e).map(plane).collect()
                }
            }
            Coder::Zstd { .. } => vec![Vec::new(); e],
        };
        // rANS tables for the planes where they store fewer bytes than the Huffman tables
        // (never with a row index: each row would carry its own states)
        let rans: Vec<Vec<Arc<rans::Table>>> = match opts.coder {
            _ if !opts.row_index && min_gain.is_some() => {
                let plane = |k: usize| {
                    let ts = tables.get(k).map_or(&[][..], Vec::as_slice);
                    let g = min_gain.unwrap_or(0.0);
                    rans_tables(&stats, k, ts, opts.max_coded_fraction, g)
                };
                if opts.parallel {
                    (0..e).into_par_iter().map(plane).collect()
                } else {
                    (0..e).map(plane).collect()
                }
            }
            _ => vec![Vec::new(); e],
        };
        for (k, (ts, rs)) in tables.iter_mut().zip(&rans).enumerate() {
            if rs.is_empty() {
                keep_used(ts, &stats, k, opts.max_coded_fraction);
            } else {
                ts.clear();
            }
        }
        let encoders: Vec<Vec<Encoder>> = tables
            .iter()
            .map(|ts| ts.iter().map(Encoder::new).collect())
            .collect();

        let encode_one = |sc: &mut Scratch, (c, b): (&&[u8], &BlockStats)| -> Vec<u8> {
            make_planes(kind, c, sc);
            encode_block(&sc.planes, b, e, &tables, &encoders, &rans, opts)
        };
        // blocks are coded a group at a time and appended: memory holds the payload and
        // one group's blocks, not every block twice. The capacity is reserved (not
        // touched) up front: a payload larger than its input is kept dense by callers.
        let mut offsets = Vec::with_capacity(chunks.len() + 1);
        let mut payload = Vec::with_capacity(data.len().saturating_add(data.len() / 64));
        let mut digests = Vec::with_capacity(chunks.len());
        offsets.push(0);
        let group = (GROUP_BYTES / block_bytes.max(1)).max(1);
        let mut sc = Scratch::default();
        for (cs, bs) in chunks.chunks(group).zip(stats.chunks(group)) {
            let coded: Vec<Vec<u8>> = if opts.parallel {
                cs.par_iter()
                    .zip(bs.par_iter())
                    .map_init(Scratch::default, encode_one)
                    .collect()
            } else {
                cs.iter()
                    .zip(bs.iter())
                    .map(|x| encode_one(&mut sc, x))
                    .collect()
            };
            // the group's digests, four blocks at a time (`digest::sha256_many`)
            let four = |c: &[Vec<u8>]| {
                crate::digest::sha256_many(&c.iter().map(Vec::as_slice).collect::<Vec<_>>())
            };
            let ds: Vec<[u8; 32]> = if opts.parallel {
                coded.par_chunks(4).flat_map_iter(four).collect()
            } else {
                coded.chunks(4).flat_map(four).collect()
            };
            for (bytes, digest) in coded.into_iter().zip(ds) {
                payload.extend_from_slice(&bytes);
                offsets.push(payload.len());
                digests.push(digest);
            }
        }
        let mut store = Self {
            kind,
            rows,
            row_bytes,
            block_rows: opts.block_rows,
            decoders: decoders_for(&tables),
            tables,
            rans,
            offsets,
            digests,
            index_digest: [0; 32],
            payload: crate::Payload::owned(payload),
            verify_on_decode: false,
            lazy: false,
        };
        // the index digest seals everything before the payload: header, tables, lengths,
        // digests
        store.index_digest = Sha256::digest(store.index_prefix()).into();
        // verified at build: every block decodes to exactly the bytes it was made from
        store.check_against(data, opts.parallel)?;
        Ok(store)
    }

    /// Decodes every block and compares it with `data`; an encoder bug surfaces here as an
    /// error naming the block instead of as a silently wrong store.
    fn check_against(&self, data: &[u8], parallel: bool) -> Result<()> {
        // groups of blocks decoded side by side, as readers decode them
        let together = crate::BLOCKS_TOGETHER;
        let block = (self.block_rows * self.row_bytes).max(1);
        let n = self.num_blocks();
        let check = |dec: &mut crate::Decoder<'_>,
                     buf: &mut Vec<u8>,
                     (g, want): (usize, &[u8])|
         -> Result<()> {
            buf.resize(want.len(), 0);
            let first = g * together;
            dec.decode_blocks(first..(first + together).min(n), buf)?;
            match buf
                .chunks(block)
                .zip(want.chunks(block))
                .position(|(a, b)| a != b)
            {
                None => Ok(()),
                Some(k) => Err(Error::BadBlock {
                    block: first + k,
                    reason: "encoder produced a block that does not decode to its input".into(),
                }),
            }
        };
        if self.row_bytes == 0 {
            return Ok(());
        }
        let chunk = block * together;
        if parallel {
            data.par_chunks(chunk).enumerate().try_for_each_init(
                || (self.decoder(), Vec::new()),
                |(d, buf), x| check(d, buf, x),
            )
        } else {
            let (mut d, mut buf) = (self.decoder(), Vec::new());
            data.chunks(chunk)
                .enumerate()
                .try_for_each(|x| check(&mut d, &mut buf, x))
        }
    }
}

pub(crate) fn num_blocks(rows: u64, block_rows: usize) -> usize {
    usize::try_from(rows.div_ceil(block_rows.max(1) as u64)).unwrap_or(usize::MAX)
}

pub(crate) fn decoders_for(tables: &[Vec<CodeLengths>]) -> Vec<Vec<Arc<Decoder>>> {
    tables
        .iter()
        .map(|ts| ts.iter().map(|t| Arc::new(Decoder::new(t))).collect())
        .collect()
}

/// Bytes a plane record with a coded body of `body` bytes takes: mode, LEB128, body.
fn record_bytes(body: usize) -> usize {
    1 + varint_len(body as u64) + body
}

/// The cheaper rANS table for one block's plane, with the bytes its stream takes.
fn best_rans(ts: &[Arc<rans::Table>], h: &Histogram) -> Option<(usize, usize)> {
    ts.iter()
        .enumerate()
        .map(|(i, t)| (i, t.block_cost_bits(h)))
        .filter(|&(_, c)| c != u64::MAX)
        .min_by_key(|&(i, c)| (c, i))
        .map(|(i, c)| (i, c.div_ceil(8) as usize + rans::STATE_BYTES))
}

/// rANS tables for plane `k`, one for each group of blocks the Huffman clustering made
/// (each block joins the Huffman table that codes it shortest), when they store the plane
/// in at least `min_gain` (a fraction) fewer bytes than the Huffman tables do, tables
/// included; otherwise none.
fn rans_tables(
    stats: &[BlockStats],
    k: usize,
    huffman: &[CodeLengths],
    max_coded_fraction: f64,
    min_gain: f64,
) -> Vec<Arc<rans::Table>> {
    let blocks: Vec<&Histogram> = stats
        .iter()
        .filter(|b| !b.constant.get(k).copied().unwrap_or(true))
        .filter_map(|b| b.hists.get(k))
        .collect();
    if blocks.is_empty() || huffman.is_empty() {
        return Vec::new();
    }
    let mut sums = vec![[0u64; 256]; huffman.len()];
    let mut huffman_bytes = 128 * huffman.len();
    let raw = |h: &Histogram| h.iter().map(|&c| c as usize).sum::<usize>();
    // Huffman planes are kept when they gain at least `1 - max_coded_fraction`; rANS
    // planes whenever they are smaller than raw (the coder was chosen for size)
    let keep = |h: &Histogram, coded: usize, fraction: f64| {
        let n = raw(h);
        if (coded as f64) <= n as f64 * fraction && coded < n {
            record_bytes(coded)
        } else {
            1 + n
        }
    };
    for h in &blocks {
        let (t, bits) = best_table(huffman, h);
        if let Some(sum) = sums.get_mut(t) {
            for (x, &c) in sum.iter_mut().zip(h.iter()) {
                *x += u64::from(c);
            }
        }
        // the two halves' streams and the first one's length
        huffman_bytes += keep(
            h,
            (bits.div_ceil(8) as usize).saturating_add(3),
            max_coded_fraction,
        );
    }
    let tables: Vec<Arc<rans::Table>> = sums
        .iter()
        .filter_map(rans::Table::from_counts)
        .map(Arc::new)
        .collect();
    let mut rans_bytes: usize = tables.iter().map(|t| t.serialized_len()).sum();
    for h in &blocks {
        rans_bytes += best_rans(&tables, h).map_or(1 + raw(h), |(_, coded)| keep(h, coded, 1.0));
    }
    if (rans_bytes as f64) < huffman_bytes as f64 * (1.0 - min_gain) {
        tables
    } else {
        Vec::new()
    }
}

fn encode_block(
    planes: &[u8],
    b: &BlockStats,
    e: usize,
    tables: &[Vec<CodeLengths>],
    encoders: &[Vec<Encoder>],
    rans: &[Vec<Arc<rans::Table>>],
    opts: &EncodeOptions,
) -> Vec<u8> {
    let n = planes.len() / e;
    let rows = b.rows;
    let mut out = Vec::with_capacity(planes.len() + 16 * e);
    let budget = (n as f64 * opts.max_coded_fraction).floor() as usize;
    for k in 0..e {
        let plane = planes.get(k * n..(k + 1) * n).unwrap_or(&[]);
        if let (true, Some(&v)) = (b.constant.get(k).copied().unwrap_or(false), plane.first()) {
            out.extend_from_slice(&[MODE_CONST, v]);
            continue;
        }
        let rs = rans.get(k).map_or(&[][..], Vec::as_slice);
        let coded: Option<(u8, Vec<u8>)> = match opts.coder {
            _ if !rs.is_empty() => match b.hists.get(k).and_then(|h| best_rans(rs, h)) {
                Some((t, len)) if len < n => rs.get(t).map(|table| {
                    let mut s = Vec::with_capacity(len + 8);
                    table.encode(plane, &mut s);
                    (MODE_RANS + t as u8, s)
                }),
                _ => None,
            },
            Coder::SharedHuffman { .. } | Coder::SharedRans { .. } | Coder::Mixed { .. } => {
                let ts = tables.get(k).map_or(&[][..], Vec::as_slice);
                let h = b.hists.get(k);
                match h.map(|h| best_table(ts, h)) {
                    Some((t, bits)) if (bits.div_ceil(8) as usize) < budget => {
                        encoders.get(k).and_then(|es| es.get(t)).map(|enc| {
                            let mut s = Vec::with_capacity(bits.div_ceil(8) as usize);
                            if opts.row_index {
                                let re = plane.len() / rows.max(1);
                                encode_rows(enc, plane, re, &mut s);
                                (MODE_HUFFMAN_ROWS + t as u8, s)
                            } else {
                                encode_halves(enc, plane, rows, &mut s);
                                (MODE_HUFFMAN + t as u8, s)
                            }
                        })
                    }
                    _ => None,
                }
            }
            Coder::Zstd { level } => zstd::bulk::compress(plane, level)
                .ok()
                .map(|s| (MODE_ZSTD, s)),
        };
        // a rANS plane is kept whenever it is smaller than raw (the coder was chosen for
        // size); any other when it fits the coded-fraction budget
        let kept = |mode: u8, len: usize| {
            if mode >= MODE_RANS {
                len < n
            } else {
                len + 6 <= budget
            }
        };
        match coded {
            Some((mode, s)) if kept(mode, s.len()) => {
                out.push(mode);
                put_varint(&mut out, s.len() as u64);
                out.extend_from_slice(&s);
            }
            _ => {
                out.push(MODE_RAW);
                out.extend_from_slice(plane);
            }
        }
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use crate::{BlockStore, EncodeOptions};

    /// Weight-like f32s: a random sign, a log-uniform mantissa, and exponents 123..=126 with
    /// probabilities 0.4, 0.3, 0.2, 0.1, which Huffman codes in 1.9 bits a symbol where
    /// their entropy is 1.85 (as on trained weights, whose exponent planes cost Huffman
    /// about 1.2% over rANS), so the exponent plane is worth rANS tables and the mantissa
    /// planes, uniform, are not.
    fn weights(n: usize) -> Vec<u8> {
        let mut s = 7u64;
        (0..n)
            .flat_map(|_| {
                s = s
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                let r = s >> 32;
                let u = (s >> 22) & 1023;
                let exponent = match u {
                    0..410 => 126u32,
                    410..717 => 125,
                    717..922 => 124,
                    _ => 123,
                };
                // a mantissa spread as trained weights' are within an octave (density
                // falling as 1 / value, Benford's): its top byte is 0.03 bits below
                // uniform, what `SharedRans` takes and `Mixed` leaves
                let t = ((s >> 8) & 0xff_ffff) as f64 / (1u64 << 24) as f64;
                let mantissa = ((t.exp2() - 1.0) * f64::from(1u32 << 23)) as u32 & 0x7f_ffff;
                let bits = ((r as u32 & 1) << 31) | (exponent << 23) | mantissa;
                f32::from_bits(bits).to_le_bytes()
            })
            .collect()
    }

    fn encode(data: &[u8], coder: Coder) -> BlockStore {
        // 64-row blocks, as `compressme pack` writes: a rANS stream's 16 bytes of states
        // are paid once a block
        let opts = EncodeOptions::new(ValueKind::F32)
            .block_rows(64)
            .coder(coder);
        let s = BlockStore::encode(data, 512, 1024, &opts).unwrap();
        assert_eq!(s.decode_all().unwrap(), data);
        s
    }

    #[test]
    fn mixed_takes_rans_for_the_exponent_plane_only() {
        let data = weights(512 * 256);
        let mixed = encode(&data, Coder::Mixed { max_tables: 4 });
        // plane 3 is the top byte: the exponent's, after the sign's rotation
        let with_rans: Vec<bool> = mixed.rans.iter().map(|r| !r.is_empty()).collect();
        assert_eq!(with_rans, [false, false, false, true]);
        assert!(mixed.has_rans());
        // every plane where rANS would save anything takes it with `SharedRans`, and the
        // mixed store sits between the two others in size
        let rans = encode(&data, Coder::SharedRans { max_tables: 4 });
        assert!(rans.rans.iter().filter(|r| !r.is_empty()).count() > 1);
        let huffman = encode(&data, Coder::SharedHuffman { max_tables: 4 });
        let total = |s: &BlockStore| s.stored_bytes().total();
        assert!(total(&rans) < total(&mixed) && total(&mixed) < total(&huffman));
    }

    /// The mode byte of each block's last plane record (the exponent's).
    fn exponent_modes(s: &BlockStore) -> Vec<u8> {
        (0..s.num_blocks())
            .map(|b| {
                let bytes = s.block_bytes(b).unwrap();
                let mut at = 0usize;
                for _ in 0..3 {
                    let mode = bytes[at];
                    at += 1;
                    at += match mode {
                        MODE_RAW => 64 * 256,
                        MODE_CONST => 1,
                        _ => {
                            let mut p = at;
                            let len = crate::format::get_varint(bytes, &mut p).unwrap();
                            p - at + len
                        }
                    };
                }
                bytes[at]
            })
            .collect()
    }

    #[test]
    fn planes_no_table_can_code_carry_no_tables() {
        let data = weights(512 * 256);
        let s = encode(&data, Coder::SharedHuffman { max_tables: 4 });
        // the two low mantissa bytes are uniform: raw in every block, so no tables; the
        // exponent plane is coded
        let counts: Vec<usize> = s.tables.iter().map(Vec::len).collect();
        assert!(
            counts[0] == 0 && counts[1] == 0 && counts[3] > 0,
            "{counts:?}"
        );
    }

    #[test]
    fn tables_no_block_takes_are_left_out() {
        // the first block is noise: clustering seeds a table with it (the block the other
        // tables serve worst), and that block is then stored raw, leaving the table unused
        let mut data = weights(512 * 256);
        let mut s = 99u32;
        for b in data.iter_mut().take(64 * 1024) {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            *b = s as u8;
        }
        let st = encode(&data, Coder::SharedHuffman { max_tables: 4 });
        let modes = exponent_modes(&st);
        assert_eq!(modes[0], MODE_RAW);
        let used: std::collections::BTreeSet<u8> = modes
            .iter()
            .filter(|&&m| (MODE_HUFFMAN..MODE_HUFFMAN_ROWS).contains(&m))
            .map(|m| m - MODE_HUFFMAN)
            .collect();
        let kept = st.tables[3].len();
        assert!(kept > 0);
        assert_eq!(used, (0..kept as u8).collect(), "every kept table is used");
    }
}
