//! Eight or more rows of `x` against an integer matrix, one `x` row a vector lane.
//!
//! `x` is rounded to 14-bit fixed point as everywhere else ([`super::FixedX`]) and then
//! transposed once a product into a panel of 16 rows (AVX-512) or 8 (AVX2): unit
//! `p · lanes + l` holds row `l`'s pair of values `2p, 2p + 1`. Each weight row is widened
//! to `i16` once (4-bit codes through their table first); a pair of its codes, broadcast,
//! meets the panel's vector of the same pair, one instruction for 16 (or 8) rows of `x`:
//! `vpdpwssd` on the AVX-512 tier (512-bit) and the AVX-VNNI tier (256-bit), `vpmaddwd`
//! and an add on the AVX2 tier. Eight weight rows share each load of the panel; on the
//! AVX-512 tier two blocks of the panel (32 rows of `x`) run together with four weight
//! rows, so each broadcast pair of codes meets both (eight sums in registers), through
//! every group with the rows' f32 sums kept in registers too ([`groups4x2`]). While a
//! task's kernel runs, the next task's codes are prefetched into the second-level cache
//! ([`Ahead`]): each task widens its rows first, and that read would otherwise wait on
//! memory. A group's sum for a row of `x` is one lane, so its flush is one convert and one
//! fused multiply-add for all the lanes: the per-group work that bounds the
//! one-row-at-a-time kernels (eight class sums to flush for each row and group) is gone.
//!
//! # Arithmetic (the same on every SIMD tier, and in [`reference`])
//! For weight row `r` and `x` row `b`, with codes in the kernels' integer view:
//! - each group's products are summed exactly in one `i32` (a group of the per-row
//!   formats is a flush of [`super::FLUSH`] columns: at most `1024 · 127 · 8191` in
//!   magnitude, below `2^31`);
//! - `acc = fma(sum as f32, scale, acc)` for the groups in order, from `acc = 0`;
//! - then `acc` gets the group minimums' term (`Int4Block`) and `x`'s step, as in the
//!   other paths.
//!
//! So every SIMD tier gives the same bits here, as it does on the other paths; but the
//! bits are not those of the same row at batch 7 or less (whose kernels sum a group in
//! eight lanes and add the lanes at the end): a batch of 8 or more is its own product,
//! within the same [`super::error_bound`].
//!
//! Every `unsafe` here is one of two things: calling a `#[target_feature]` function,
//! which a token makes sound (it exists only after the CPU was seen to have the
//! features), or an unaligned load, store or broadcast inside a range the safe wrapper
//! checked first.
#![allow(unsafe_code)]

use std::arch::x86_64::{
    __m512i, _MM_HINT_T1, _mm_loadu_si128, _mm_prefetch, _mm256_add_epi32, _mm256_cvtepi8_epi16,
    _mm256_cvtepi32_ps, _mm256_dpwssd_avx_epi32, _mm256_fmadd_ps, _mm256_loadu_si256,
    _mm256_madd_epi16, _mm256_set1_epi32, _mm256_set1_ps, _mm256_setzero_ps, _mm256_setzero_si256,
    _mm256_storeu_ps, _mm256_storeu_si256, _mm512_cvtepi32_ps, _mm512_dpwssd_epi32,
    _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_loadu_si512, _mm512_set1_epi32, _mm512_set1_ps,
    _mm512_setzero_ps, _mm512_setzero_si512, _mm512_storeu_ps,
};

use super::{FLUSH, FixedX, RowsView, avx2, avx512, avxvnni};

/// The smallest batch that runs here.
pub(super) const MIN_BATCH: usize = 8;
/// Weight rows a task takes.
pub(super) const ROWS: usize = 16;
/// Weight rows a kernel call takes (each with its own accumulator).
const MR: usize = 8;
/// The widest panel: 16 lanes.
const LANES: usize = 16;

/// Which tier's code runs the tiles.
#[derive(Debug, Clone, Copy)]
pub(super) enum Kind {
    Avx2(avx2::Token),
    AvxVnni(avxvnni::Token),
    Avx512(avx512::Token),
}

impl Kind {
    /// Rows of `x` a vector holds.
    pub(super) fn lanes(self) -> usize {
        match self {
            Self::Avx2(_) | Self::AvxVnni(_) => 8,
            Self::Avx512(_) => 16,
        }
    }

    pub(super) fn avx2(self) -> avx2::Token {
        match self {
            Self::Avx2(t) => t,
            Self::AvxVnni(t) => t.avx2(),
            Self::Avx512(t) => t.avx2(),
        }
    }
}

/// One flush: pairs `start..end` of a row, summed, then scaled by the row's scale number
/// `scale`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Flush {
    start: usize,
    end: usize,
    scale: usize,
}

/// The flushes of a row of `kp` slots with `view`'s groups: the same for every row.
fn schedule(view: &RowsView<'_>, kp: usize) -> Vec<Flush> {
    let n = view.scales_of(0).len();
    let group = view.group.clamp(2, FLUSH);
    let mut out = Vec::with_capacity(n);
    for g in 0..n {
        let start = g * group;
        if start >= kp {
            break;
        }
        let end = (start + group).min(kp);
        out.push(Flush {
            start: start / 2,
            end: end / 2,
            scale: g,
        });
    }
    out
}

/// Whether a matrix takes the tiles: groups and padded rows made of whole pairs.
pub(super) fn fits(view: &RowsView<'_>, kp: usize) -> bool {
    view.group >= 2 && view.group.is_multiple_of(2) && view.group <= FLUSH && kp.is_multiple_of(2)
}

/// `x` transposed into blocks of `lanes` rows: unit `p · lanes + l` of block `k` holds
/// row `k · lanes + l`'s values `2p` (low half) and `2p + 1`; rows past the batch are 0.
struct XPanel {
    lanes: usize,
    pairs: usize,
    data: Vec<u32>,
}

impl XPanel {
    /// Blocks are independent, so a large `x` is laid out a block at a time on the kernel
    /// pool's threads.
    fn new(fx: &FixedX, batch: usize, lanes: usize) -> Self {
        let pairs = fx.kp / 2;
        let blocks = batch.div_ceil(lanes);
        let mut data = vec![0u32; blocks * pairs * lanes];
        if pairs * lanes == 0 {
            return Self { lanes, pairs, data };
        }
        let fill = |k: usize, block: &mut [u32]| {
            for l in 0..lanes {
                let b = k * lanes + l;
                if b >= batch {
                    break;
                }
                for (p, v) in fx.row(b).chunks_exact(2).enumerate().take(pairs) {
                    if let Some(o) = block.get_mut(p * lanes + l) {
                        *o = u32::from(v[0] as u16) | (u32::from(v[1] as u16) << 16);
                    }
                }
            }
        };
        let share = batch * fx.kp >= super::SHARE_MIN_VALUES;
        super::pool::each(share, data.chunks_mut(pairs * lanes).collect(), &fill);
        Self { lanes, pairs, data }
    }

    fn block(&self, k: usize) -> &[u32] {
        let n = self.pairs * self.lanes;
        self.data.get(k * n..(k + 1) * n).unwrap_or(&[])
    }
}

/// A thread's reused buffers: a row's 4-bit codes through the table, 16 rows widened to
/// `i16`, and each row's scale for each flush.
struct Scratch {
    kp: usize,
    codes: Vec<i8>,
    wide: Vec<i16>,
    scales: Vec<f32>,
}

impl Scratch {
    fn new(kp: usize, flushes: usize) -> Self {
        Self {
            kp,
            codes: vec![0; kp],
            wide: vec![0; ROWS * kp],
            scales: vec![0.0; ROWS * flushes],
        }
    }

    /// Rows `first..first + n` (`n <= 16`) of the matrix, widened, with their scales;
    /// rows past `n` are left as they were (their outputs are not kept).
    fn load(&mut self, kind: Kind, view: &RowsView<'_>, sched: &[Flush], first: usize, n: usize) {
        let kp = self.kp;
        let nf = sched.len();
        for (k, row) in self.wide.chunks_exact_mut(kp.max(1)).enumerate().take(n) {
            let codes = view.codes_of(first + k);
            match view.lut {
                Some(lut) => widen_nibbles(kind.avx2(), codes, lut, row, &mut self.codes),
                None => widen_bytes(kind.avx2(), codes, row),
            }
            let scales = view.scales_of(first + k);
            for (o, f) in self.scales[k * nf..(k + 1) * nf].iter_mut().zip(sched) {
                *o = scales.get(f.scale);
            }
        }
    }
}

/// 4-bit codes through `lut`, widened to `i16`, into `row` in nibble order (for each
/// run of 16 bytes, the 16 low nibbles, then the 16 high ones), zeros past the codes;
/// `tmp` (at least as long as `row`) holds a short last run's table values.
fn widen_nibbles(t: avx2::Token, codes: &[u8], lut: &[i8; 16], row: &mut [i16], tmp: &mut [i8]) {
    let chunks = codes.len().min(row.len() / 2) / 16;
    let _ = t;
    // SAFETY: the token proves AVX2; the loop stays within `chunks` whole chunks of both.
    unsafe { widen_nibbles_imp(codes, lut, row, chunks) };
    let done = chunks * 16;
    let rest = row.get_mut(2 * done..).unwrap_or(&mut []);
    let tmp = tmp.get_mut(..rest.len()).unwrap_or(&mut []);
    tmp.fill(0);
    super::portable::decode_nibbles(codes.get(done..).unwrap_or(&[]), lut, tmp);
    for (o, &c) in rest.iter_mut().zip(tmp.iter()) {
        *o = i16::from(c);
    }
}

/// # Safety
/// AVX2 present; `codes.len() >= 16 · chunks`, `row.len() >= 32 · chunks`.
#[target_feature(enable = "avx2")]
unsafe fn widen_nibbles_imp(codes: &[u8], lut: &[i8; 16], row: &mut [i16], chunks: usize) {
    // SAFETY: `lut` is 16 bytes
    let table = unsafe { _mm_loadu_si128(lut.as_ptr().cast()) };
    for i in 0..chunks {
        // SAFETY: i < chunks: bytes 16i..16i + 16 of `codes` are in range
        let b = unsafe { _mm_loadu_si128(codes.as_ptr().add(16 * i).cast()) };
        let (lo, hi) = avx2::lookup_nibbles(table, b);
        let (lo, hi) = (_mm256_cvtepi8_epi16(lo), _mm256_cvtepi8_epi16(hi));
        // SAFETY: i < chunks: values 32i..32i + 32 of `row` are in range
        unsafe {
            _mm256_storeu_si256(row.as_mut_ptr().add(32 * i).cast(), lo);
            _mm256_storeu_si256(row.as_mut_ptr().add(32 * i + 16).cast(), hi);
        }
    }
}

/// 8-bit codes widened to `i16` into `row`, zeros past the codes.
fn widen_bytes(t: avx2::Token, codes: &[u8], row: &mut [i16]) {
    let chunks = codes.len().min(row.len()) / 16;
    let _ = t;
    // SAFETY: the token proves AVX2; the loop stays within `chunks` whole chunks of both.
    unsafe { widen_bytes_imp(codes, row, chunks) };
    let done = chunks * 16;
    let rest = row.get_mut(done..).unwrap_or(&mut []);
    let tail = codes.get(done..).unwrap_or(&[]);
    let (head, zeros) = rest.split_at_mut(tail.len().min(rest.len()));
    for (o, &c) in head.iter_mut().zip(tail) {
        *o = i16::from(c as i8);
    }
    zeros.fill(0);
}

/// # Safety
/// AVX2 present; `codes.len() >= 16 · chunks`, `row.len() >= 16 · chunks`.
#[target_feature(enable = "avx2")]
unsafe fn widen_bytes_imp(codes: &[u8], row: &mut [i16], chunks: usize) {
    for i in 0..chunks {
        // SAFETY: i < chunks: 16 bytes of `codes` and 16 values of `row` from 16i
        unsafe {
            let b = _mm_loadu_si128(codes.as_ptr().add(16 * i).cast());
            _mm256_storeu_si256(row.as_mut_ptr().add(16 * i).cast(), _mm256_cvtepi8_epi16(b));
        }
    }
}

/// Weight rows `m · 8..m · 8 + 8` of the scratch against one block of the `x` panel:
/// `out[r][l]` is the row against the block's row `l`, scaled, before minimums and `x`'s
/// step (AVX2 fills eight lanes).
fn dots(
    kind: Kind,
    s: &Scratch,
    m: usize,
    sched: &[Flush],
    x: &[u32],
    ahead: &mut Ahead,
) -> [[f32; LANES]; MR] {
    let (kp, nf) = (s.kp, sched.len());
    let wide = s.wide.get(m * MR * kp..(m + 1) * MR * kp).unwrap_or(&[]);
    let scales = s.scales.get(m * MR * nf..(m + 1) * MR * nf).unwrap_or(&[]);
    let ok = wide.len() == MR * kp
        && scales.len() == MR * nf
        && sched.iter().all(|f| f.start <= f.end && 2 * f.end <= kp)
        && x.len() >= kp / 2 * kind.lanes();
    if !ok {
        return reference(kind.lanes(), wide, scales, kp, sched, x);
    }
    match kind {
        Kind::Avx2(t) => {
            let _ = t;
            // SAFETY: the token proves the features; `ok` checked every range the loads read.
            unsafe { dots_avx2(wide, scales, kp, sched, x, ahead) }
        }
        Kind::AvxVnni(t) => {
            let _ = t;
            // SAFETY: the token proves the features; `ok` checked every range the loads read.
            unsafe { dots_avxvnni(wide, scales, kp, sched, x, ahead) }
        }
        // the AVX-512 tiles run in `dots_all`; here only when its checks failed
        Kind::Avx512(_) => reference(kind.lanes(), wide, scales, kp, sched, x),
    }
}

/// [`dots`] in plain Rust: the definition the SIMD code is held to.
fn reference(
    lanes: usize,
    wide: &[i16],
    scales: &[f32],
    kp: usize,
    sched: &[Flush],
    x: &[u32],
) -> [[f32; LANES]; MR] {
    let nf = sched.len();
    let mut out = [[0f32; LANES]; MR];
    for (r, o) in out.iter_mut().enumerate() {
        let row = wide.get(r * kp..(r + 1) * kp).unwrap_or(&[]);
        for (l, acc) in o.iter_mut().enumerate().take(lanes) {
            for (fi, f) in sched.iter().enumerate() {
                let mut sum = 0i32;
                for p in f.start..f.end {
                    let (w0, w1) = (row.get(2 * p), row.get(2 * p + 1));
                    let v = x.get(p * lanes + l).copied().unwrap_or(0);
                    let (x0, x1) = (v as u16 as i16, (v >> 16) as u16 as i16);
                    sum += i32::from(w0.copied().unwrap_or(0)) * i32::from(x0)
                        + i32::from(w1.copied().unwrap_or(0)) * i32::from(x1);
                }
                let scale = scales.get(r * nf + fi).copied().unwrap_or(0.0);
                *acc = (sum as f32).mul_add(scale, *acc);
            }
        }
    }
    out
}

/// A pair of `i16` at pair `p`, as one `i32`.
///
/// # Safety
/// `2p + 2 <= w.len()`.
#[inline]
unsafe fn pair_of(w: &[i16], p: usize) -> i32 {
    // SAFETY: in range (caller)
    unsafe { w.as_ptr().add(2 * p).cast::<i32>().read_unaligned() }
}

/// Software prefetch of the next task's codes, spread over this task's kernel steps: the
/// rows are widened at the start of each task, all at once, and without it that read
/// waits on memory with nothing else to do. A prefetch is a hint: it changes no result.
pub(super) struct Ahead {
    start: *const u8,
    lines: usize,
    next: usize,
    every: usize,
    per: usize,
    count: usize,
}

impl Ahead {
    /// The cache lines of `bytes`, spread evenly over `steps` calls of [`Self::step`].
    pub(super) fn new(bytes: &[u8], steps: usize) -> Self {
        let (lines, steps) = (bytes.len().div_ceil(64), steps.max(1));
        Self {
            start: bytes.as_ptr(),
            lines,
            next: 0,
            every: (steps / lines.max(1)).max(1),
            per: lines.div_ceil(steps).max(1),
            count: 0,
        }
    }

    /// One kernel step: every `every` steps, the next `per` lines into the second-level
    /// cache.
    #[inline(always)]
    pub(super) fn step(&mut self) {
        self.count += 1;
        if self.count >= self.every && self.next < self.lines {
            self.count = 0;
            for _ in 0..self.per {
                // a hint only: the address is inside the slice `new` was given
                let at = self.start.wrapping_add(64 * self.next);
                // SAFETY: SSE is baseline on x86_64; a prefetch reads nothing, cannot fault
                unsafe { _mm_prefetch::<_MM_HINT_T1>(at.cast()) };
                self.next += 1;
            }
        }
    }
}

/// The codes of the 16 rows after `first`'s 16: the next task's, in a run of tasks.
pub(super) fn next_codes<'a>(view: &RowsView<'a>, first: usize) -> &'a [u8] {
    let rb = view.row_bytes;
    view.codes
        .get((first + ROWS) * rb..)
        .map_or(&[][..], |c| c.get(..ROWS * rb).unwrap_or(c))
}

/// A 256-bit tile kernel: `$name`, with `$features`, adding `$step(acc, xv, wv)` (the
/// exact products of a pair of eight `x` rows by a broadcast pair of codes) into each
/// row's `i32` lanes; the AVX2 tier's step (`vpmaddwd` and an add) and the AVX-VNNI
/// tier's (`vpdpwssd`) compute the same sums, so the two kernels give the same bits.
macro_rules! tile_kernel_256 {
    ($name:ident, $features:literal, $step:expr) => {
        /// # Safety
        /// The features present; `wide` is 8 rows of `kp`, `scales` 8 rows of one a
        /// flush, every flush's `2 · end <= kp`, `x` holds `8 · kp / 2` units.
        #[target_feature(enable = $features)]
        unsafe fn $name(
            wide: &[i16],
            scales: &[f32],
            kp: usize,
            sched: &[Flush],
            x: &[u32],
            ahead: &mut Ahead,
        ) -> [[f32; LANES]; MR] {
            let nf = sched.len();
            let rows: [&[i16]; MR] = std::array::from_fn(|r| &wide[r * kp..(r + 1) * kp]);
            let mut f = [_mm256_setzero_ps(); MR];
            for (fi, fl) in sched.iter().enumerate() {
                ahead.step();
                let mut acc = [_mm256_setzero_si256(); MR];
                for p in fl.start..fl.end {
                    // SAFETY: p < end <= kp / 2: eight units from 8p are in `x` (caller)
                    let xv = unsafe { _mm256_loadu_si256(x.as_ptr().add(8 * p).cast()) };
                    for r in 0..MR {
                        // SAFETY: 2p + 2 <= kp (caller)
                        let wv = _mm256_set1_epi32(unsafe { pair_of(rows[r], p) });
                        acc[r] = $step(acc[r], xv, wv);
                    }
                }
                for r in 0..MR {
                    let s = _mm256_set1_ps(scales[r * nf + fi]);
                    f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), s, f[r]);
                }
            }
            let mut out = [[0f32; LANES]; MR];
            for (o, v) in out.iter_mut().zip(f) {
                // SAFETY: 8 of the row's 16 f32
                unsafe { _mm256_storeu_ps(o.as_mut_ptr(), v) };
            }
            out
        }
    };
}

tile_kernel_256!(dots_avx2, "avx2,fma", |a, x, w| _mm256_add_epi32(
    a,
    _mm256_madd_epi16(x, w)
));
tile_kernel_256!(dots_avxvnni, "avx2,fma,avxvnni", |a, x, w| {
    _mm256_dpwssd_avx_epi32(a, x, w)
});

/// Every weight row of the scratch against every block of the `x` panel:
/// `acc[(m · blocks + k) · 8 + r]` accumulates row `8m + r` against block `k`, lane `l`
/// its row `l`. On the AVX-512 tier pairs of blocks run four rows at a time through every
/// group ([`groups4x2`]); an odd last block, and the 256-bit tiers, go group by group (so a
/// group's part of the panel and of the rows stays in the first-level cache while all of
/// them run).
fn dots_all(
    kind: Kind,
    s: &Scratch,
    sched: &[Flush],
    xp: &XPanel,
    acc: &mut Vec<[f32; LANES]>,
    next: &[u8],
) {
    let (kp, nf, lanes) = (s.kp, sched.len(), kind.lanes());
    let blocks = xp.data.len() / (xp.pairs * lanes).max(1);
    acc.clear();
    acc.resize(ROWS / MR * blocks * MR, [0.0; LANES]);
    let ok = s.wide.len() == ROWS * kp
        && s.scales.len() == ROWS * nf
        && xp.lanes == lanes
        && 2 * xp.pairs == kp
        && sched.iter().all(|f| f.start <= f.end && 2 * f.end <= kp);
    if let (Kind::Avx512(t), true) = (kind, ok) {
        let _ = t;
        // SAFETY: the token proves the features; `ok` checked every range the loads read.
        unsafe { dots_all_avx512(&s.wide, &s.scales, kp, sched, &xp.data, acc, next) };
        return;
    }
    // a step a flush on these tiers (a step a pair slowed their loop by half)
    let mut ahead = Ahead::new(next, ROWS / MR * blocks * nf);
    for m in 0..ROWS / MR {
        for k in 0..blocks {
            let d = dots(kind, s, m, sched, xp.block(k), &mut ahead);
            let at = (m * blocks + k) * MR;
            if let Some(dst) = acc.get_mut(at..at + MR) {
                dst.copy_from_slice(&d);
            }
        }
    }
}

/// The exact sums of pairs `start..end` of eight weight rows against one block of the `x`
/// panel, a lane a row of `x`.
///
/// # Safety
/// AVX-512 F and VNNI present; `2 · end` at most every row's length, `16 · end` at most
/// the block's.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
#[inline]
unsafe fn block_sums(
    rows: [&[i16]; MR],
    xb: &[u32],
    start: usize,
    end: usize,
    ahead: &mut Ahead,
) -> [__m512i; MR] {
    let mut sums = [_mm512_setzero_si512(); MR];
    for p in start..end {
        ahead.step();
        // SAFETY: p < end: 16 units from 16p are in the block (caller)
        let xv = unsafe { _mm512_loadu_si512(xb.as_ptr().add(LANES * p).cast()) };
        for r in 0..MR {
            // SAFETY: 2p + 2 <= 2 · end <= the row's length (caller)
            let pair = unsafe { pair_of(rows[r], p) };
            sums[r] = _mm512_dpwssd_epi32(sums[r], xv, _mm512_set1_epi32(pair));
        }
    }
    sums
}

/// `dst[r] = fma(sums[r] as f32, sc[r], dst[r])` for the eight rows.
///
/// # Safety
/// AVX-512 F present.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
#[inline]
unsafe fn flush_sums(sums: &[__m512i; MR], sc: &[f32; MR], dst: &mut [[f32; LANES]]) {
    for ((d, &s), &c) in dst.iter_mut().zip(sums).zip(sc) {
        let o = d.as_mut_ptr();
        // SAFETY: 16 f32
        unsafe {
            let v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(c), _mm512_loadu_ps(o));
            _mm512_storeu_ps(o, v);
        }
    }
}

/// Four weight rows against two blocks of the `x` panel (32 rows of `x`) over every flush
/// of `sched`: each broadcast pair of codes meets both blocks, and the rows' f32 sums stay
/// in registers from group to group (eight `i32` sums and eight f32 ones, with the four
/// rows' slices in general registers). Eight rows with the f32 sums in memory, a flush at
/// a time, spent as much as a fifth of a batch-32 product of INT8-g32 on the flushes
/// and reloaded the rows' pointers from the stack at every step. The same operations in
/// the same order as [`block_sums`] and [`flush_sums`] from `acc = 0`, so the same bits.
/// Writes `d0[r]` and `d1[r]`.
///
/// # Safety
/// AVX-512 F, VNNI and FMA present; every flush's `2 · end` at most every row's length,
/// `16 · end` at most each block's; `sc` holds row `r`'s scales at `r · sched.len()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn groups4x2(
    rows: [&[i16]; 4],
    sc: &[f32],
    sched: &[Flush],
    xb0: &[u32],
    xb1: &[u32],
    d0: &mut [[f32; LANES]],
    d1: &mut [[f32; LANES]],
    ahead: &mut Ahead,
) {
    let nf = sched.len();
    let mut f0 = [_mm512_setzero_ps(); 4];
    let mut f1 = [_mm512_setzero_ps(); 4];
    for (fi, fl) in sched.iter().enumerate() {
        let mut s0 = [_mm512_setzero_si512(); 4];
        let mut s1 = [_mm512_setzero_si512(); 4];
        for p in fl.start..fl.end {
            ahead.step();
            // SAFETY: p < end: 16 units from 16p are in each block (caller)
            let (x0, x1) = unsafe {
                (
                    _mm512_loadu_si512(xb0.as_ptr().add(LANES * p).cast()),
                    _mm512_loadu_si512(xb1.as_ptr().add(LANES * p).cast()),
                )
            };
            for r in 0..4 {
                // SAFETY: 2p + 2 <= 2 · end <= the row's length (caller)
                let w = _mm512_set1_epi32(unsafe { pair_of(rows[r], p) });
                s0[r] = _mm512_dpwssd_epi32(s0[r], x0, w);
                s1[r] = _mm512_dpwssd_epi32(s1[r], x1, w);
            }
        }
        for r in 0..4 {
            let c = _mm512_set1_ps(sc.get(r * nf + fi).copied().unwrap_or(0.0));
            f0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0[r]), c, f0[r]);
            f1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1[r]), c, f1[r]);
        }
    }
    for r in 0..4 {
        if let (Some(a), Some(b)) = (d0.get_mut(r), d1.get_mut(r)) {
            // SAFETY: 16 f32 each
            unsafe {
                _mm512_storeu_ps(a.as_mut_ptr(), f0[r]);
                _mm512_storeu_ps(b.as_mut_ptr(), f1[r]);
            }
        }
    }
}

/// # Safety
/// AVX-512 F, VNNI and FMA present; `wide` is 16 rows of `kp`, `scales` 16 rows of one a
/// flush, every flush's `2 · end <= kp`, `x` holds whole blocks of `16 · kp / 2`
/// units (`blocks` of them), `acc` `2 · blocks · 8` rows of 16; `next` the codes to
/// prefetch for the next task.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
unsafe fn dots_all_avx512(
    wide: &[i16],
    scales: &[f32],
    kp: usize,
    sched: &[Flush],
    x: &[u32],
    acc: &mut [[f32; LANES]],
    next: &[u8],
) {
    let nf = sched.len();
    let pairs = kp / 2;
    let blocks = x.len() / (pairs * LANES).max(1);
    let xb = |k: usize| &x[k * pairs * LANES..(k + 1) * pairs * LANES];
    let per_pass: usize = sched.iter().map(|f| f.end - f.start).sum();
    let steps = (ROWS / 4 * (blocks / 2) + ROWS / MR * (blocks % 2)) * per_pass;
    let mut ahead = Ahead::new(next, steps);
    // pairs of blocks: four rows at a time over every flush, sums in registers
    for q in 0..ROWS / 4 {
        let rows: [&[i16]; 4] =
            std::array::from_fn(|r| &wide[(q * 4 + r) * kp..(q * 4 + r + 1) * kp]);
        let sc = &scales[q * 4 * nf..(q * 4 + 4) * nf];
        // rows 4q..4q + 4 are rows r0..r0 + 4 of the eight-row group m
        let (m, r0) = (q * 4 / MR, q * 4 % MR);
        for k in (0..blocks / 2).map(|j| 2 * j) {
            let a = (m * blocks + k) * MR + r0;
            let (lo, hi) = acc.split_at_mut(a + MR);
            // SAFETY: the caller's guarantees, passed on
            unsafe {
                groups4x2(
                    rows,
                    sc,
                    sched,
                    xb(k),
                    xb(k + 1),
                    &mut lo[a..a + 4],
                    &mut hi[..4],
                    &mut ahead,
                );
            }
        }
    }
    if blocks.is_multiple_of(2) {
        return;
    }
    // an odd last block: eight rows a flush, group by group
    let k = blocks - 1;
    for (fi, fl) in sched.iter().enumerate() {
        for m in 0..ROWS / MR {
            let rows: [&[i16]; MR] =
                std::array::from_fn(|r| &wide[(m * MR + r) * kp..(m * MR + r + 1) * kp]);
            let sc: [f32; MR] = std::array::from_fn(|r| scales[(m * MR + r) * nf + fi]);
            let at = (m * blocks + k) * MR;
            // SAFETY: the caller's guarantees, passed on
            let sums = unsafe { block_sums(rows, xb(k), fl.start, fl.end, &mut ahead) };
            // SAFETY: AVX-512 F (caller)
            unsafe { flush_sums(&sums, &sc, &mut acc[at..at + MR]) };
        }
    }
}

/// The whole product on the tiles: `yt` is `[rows, batch]`. Each output is its row's
/// scaled sum plus, when `mins` is given (`Int4Block`), `mins(r, b)` (the minimums' term
/// for weight row `r` and `x` row `b`), times `x`'s step.
#[allow(clippy::too_many_arguments)]
pub(super) fn run(
    kind: Kind,
    fx: &FixedX,
    batch: usize,
    view: &RowsView<'_>,
    rows: usize,
    macs: usize,
    yt: &mut [f32],
    mins: Option<&(dyn Fn(usize, usize) -> f32 + Sync)>,
) {
    let kp = fx.kp;
    let sched = schedule(view, kp);
    let lanes = kind.lanes();
    let xp = XPanel::new(fx, batch, lanes);
    let blocks = batch.div_ceil(lanes);
    super::run_tasks(
        yt,
        batch * ROWS,
        macs,
        || (Scratch::new(kp, sched.len()), Vec::new()),
        |(s, acc), (task, out)| {
            let first = task * ROWS;
            let n = (out.len() / batch).min(rows.saturating_sub(first));
            s.load(kind, view, &sched, first, n);
            dots_all(kind, s, &sched, &xp, acc, next_codes(view, first));
            for (k, yr) in out.chunks_exact_mut(batch).enumerate().take(n) {
                let (m, r) = (k / MR, k % MR);
                for blk in 0..blocks {
                    let at = (m * blocks + blk) * MR + r;
                    let (Some(dr), Some(ys)) = (acc.get(at), yr.get_mut(blk * lanes..)) else {
                        continue;
                    };
                    let ds = fx.d.get(blk * lanes..).unwrap_or(&[]);
                    match mins {
                        None => {
                            for ((o, &v), &d) in ys.iter_mut().zip(dr.iter().take(lanes)).zip(ds) {
                                *o = v * d;
                            }
                        }
                        Some(f) => {
                            for (l, ((o, &v), &d)) in
                                ys.iter_mut().zip(dr.iter().take(lanes)).zip(ds).enumerate()
                            {
                                *o = (v + f(first + k, blk * lanes + l)) * d;
                            }
                        }
                    }
                }
            }
        },
    );
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// Every kind of tile this CPU runs; `test` names on stderr as skipped the ones it
    /// lacks (all of them without AVX2: then the list is empty).
    pub(in super::super) fn kinds(test: &str) -> Vec<Kind> {
        let Some(t2) = avx2::Token::detect() else {
            eprintln!("skipped: {test} (no AVX2)");
            return Vec::new();
        };
        let mut kinds = vec![Kind::Avx2(t2)];
        match avxvnni::Token::detect() {
            Some(t) => kinds.push(Kind::AvxVnni(t)),
            None => eprintln!("skipped: {test} on AVX-VNNI (this CPU lacks AVX-VNNI)"),
        }
        match avx512::Token::detect() {
            Some(t) => kinds.push(Kind::Avx512(t)),
            None => eprintln!("skipped: {test} on AVX-512 (this CPU lacks AVX-512 VNNI)"),
        }
        kinds
    }

    /// `n` test values from `next`: `±extreme` one draw in `one_in` each, otherwise a
    /// multiple of 0.001 in `[-1, 1]` (a second draw).
    pub(in super::super) fn values(
        next: &mut impl FnMut() -> u32,
        n: usize,
        one_in: u32,
        extreme: f32,
    ) -> Vec<f32> {
        (0..n)
            .map(|_| match next() % one_in {
                0 => extreme,
                1 => -extreme,
                _ => (next() % 2001) as f32 / 1000.0 - 1.0,
            })
            .collect()
    }

    /// A xorshift stream: the tests' fixed pseudo-random values.
    pub(in super::super) fn xorshift(mut seed: u32) -> impl FnMut() -> u32 {
        move || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            seed
        }
    }

    /// Every kind of tile the CPU runs gives the bits of [`reference`], on rows with
    /// several flushes and extreme codes and activations.
    #[test]
    fn simd_tiles_give_the_reference_bits() {
        let kinds = kinds("simd_tiles_give_the_reference_bits");
        let kp = 96;
        let sched = [
            Flush {
                start: 0,
                end: 16,
                scale: 0,
            },
            Flush {
                start: 16,
                end: 40,
                scale: 1,
            },
            Flush {
                start: 40,
                end: 48,
                scale: 2,
            },
        ];
        let mut s = Scratch::new(kp, sched.len());
        let mut next = xorshift(0x9e37_79b9);
        for c in &mut s.wide {
            *c = match next() % 5 {
                0 => 127,
                1 => -127,
                _ => i16::from((next() % 255) as u8 as i8),
            };
        }
        for v in &mut s.scales {
            *v = (next() % 1000) as f32 / 997.0 - 0.3;
        }
        let x: Vec<u32> = (0..kp / 2 * LANES)
            .map(|_| {
                let mut v = || match next() % 4 {
                    0 => 8191i16,
                    1 => -8191,
                    _ => (next() % 16383) as i16 - 8191,
                };
                u32::from(v() as u16) | (u32::from(v() as u16) << 16)
            })
            .collect();
        let bits = |v: [[f32; LANES]; MR]| -> Vec<u32> {
            v.iter().flatten().map(|f| f.to_bits()).collect()
        };
        for kind in kinds {
            let lanes = kind.lanes();
            // three blocks of the x panel (on AVX-512, a pair of blocks and one alone)
            let xp = XPanel {
                lanes,
                pairs: kp / 2,
                data: x.iter().cycle().take(3 * kp / 2 * lanes).copied().collect(),
            };
            let mut acc = Vec::new();
            dots_all(kind, &s, &sched, &xp, &mut acc, &[]);
            for m in 0..ROWS / MR {
                for k in 0..3 {
                    let (wide, nf) = (&s.wide[m * MR * kp..(m + 1) * MR * kp], sched.len());
                    let scales = &s.scales[m * MR * nf..(m + 1) * MR * nf];
                    let want = reference(lanes, wide, scales, kp, &sched, xp.block(k));
                    let got = &acc[(m * 3 + k) * MR..(m * 3 + k + 1) * MR];
                    let got: [[f32; LANES]; MR] = got.try_into().unwrap();
                    assert_eq!(bits(got), bits(want), "{kind:?}, rows {m}, block {k}");
                }
            }
        }
    }
}
