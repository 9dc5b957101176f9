//! Eight or more rows of `x` against an integer matrix, `x` rounded to 8 bits per block
//! of 32 columns: [`super::Activations::Block8`], llama.cpp's and candle's Q8
//! activations, on the tiles of [`super::tiles`] (one `x` row a vector lane).
//!
//! Each row of `x` is cut into blocks of [`BLOCK`] columns, in the order the weights'
//! codes come in (nibble order for the 4-bit formats: a permutation inside each block, so
//! a block holds the same 32 values either way). A block with largest magnitude `a` is
//! rounded to `q = round(x · 127 / a)` in `-127..=127`, with step `s = a / 127` (0 and 0
//! for a block of zeros). The panel holds, for 16 rows of `x` (AVX-512) or 8 (AVX2,
//! AVX-VNNI), unit `p · lanes + l` = row `l`'s four bytes `4p..4p + 4`; a weight row's four
//! codes, broadcast, meet it in one instruction: 64 products (AVX-512 `vpdpbusd`) or 32,
//! against 32 or 16 for the 14-bit tiles.
//!
//! # Arithmetic (the same on every SIMD tier, and in [`reference`])
//! For weight row `r` (codes `c_j`, one scale `w_g` a group) and `x` row `b`:
//! - each block's products are summed exactly in one `i32`: `S = Σ c_j q_j` (at most
//!   `32 · 128 · 127` in magnitude);
//! - `a_g = fma(S as f32, s, a_g)` over the group's blocks in order, from `a_g = 0`;
//! - `acc = fma(a_g, w_g, acc)` over the groups in order, from `acc = 0` (a per-row
//!   format is one group of the whole row);
//! - `Int4Block`'s minimums add `Σ_g min_g · Σ_{j in g} x_j`, with `x`'s group sums taken
//!   in f32 from the unrounded values.
//!
//! How each tier gets `S`: AVX-512 VNNI and AVX-VNNI with `vpdpbusd`, the codes biased to
//! unsigned bytes `u = c + 128` (`Σ u q = S + 128 · Σ q`, and `128 · Σ q` is worked out once
//! a block of `x`); AVX2 with `vpsignb`, `vpabsb`, `vpmaddubsw` and `vpmaddwd` (`|c| <= 128`
//! and `|q| <= 127`, so a pair of products, at most 32,512, never saturates an `i16`). So
//! every SIMD tier gives the same bits.
//!
//! As in [`super::tiles`], the next task's codes are prefetched into the second-level
//! cache while a task's kernel runs ([`super::tiles::Ahead`], a line or more a block).
//!
//! The error is that of 8-bit activations: at most `s / 2` a value of `x`, against
//! `absmax / 16382` on the 14-bit path; [`super::error_bound_block8`] states it.
//!
//! Every `unsafe` here is one of two things: calling a `#[target_feature]` function,
//! which a token makes sound (it exists only after the CPU was seen to have the
//! features), or an unaligned load, store or broadcast inside a range the safe wrapper
//! checked first.
#![allow(unsafe_code)]

use std::arch::x86_64::{
    __m256i, __m512i, _CMP_GE_OQ, _CMP_LE_OQ, _mm_loadu_si128, _mm_storeu_si128, _mm256_abs_epi8,
    _mm256_add_epi16, _mm256_add_epi32, _mm256_castps_si256, _mm256_cmp_ps, _mm256_cvtepi32_ps,
    _mm256_cvttps_epi32, _mm256_dpbusd_avx_epi32, _mm256_fmadd_ps, _mm256_loadu_ps,
    _mm256_loadu_si256, _mm256_madd_epi16, _mm256_maddubs_epi16, _mm256_max_epi32, _mm256_max_ps,
    _mm256_min_epi32, _mm256_min_ps, _mm256_mul_ps, _mm256_packs_epi16, _mm256_packs_epi32,
    _mm256_permute4x64_epi64, _mm256_permutevar8x32_epi32, _mm256_set1_epi16, _mm256_set1_epi32,
    _mm256_set1_ps, _mm256_setr_epi8, _mm256_setr_epi32, _mm256_setzero_ps, _mm256_setzero_si256,
    _mm256_shuffle_epi8, _mm256_sign_epi8, _mm256_storeu_ps, _mm256_storeu_si256, _mm256_sub_epi32,
    _mm256_sub_ps, _mm512_add_epi32, _mm512_and_si512, _mm512_broadcast_i32x4, _mm512_cmp_ps_mask,
    _mm512_cvtepi32_epi8, _mm512_cvtepi32_ps, _mm512_cvttps_epi32, _mm512_dpbusd_epi32,
    _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_loadu_si512, _mm512_mask_add_epi32,
    _mm512_mask_sub_epi32, _mm512_max_epi32, _mm512_max_ps, _mm512_min_epi32, _mm512_min_ps,
    _mm512_mul_ps, _mm512_permutex2var_epi64, _mm512_reduce_add_epi32, _mm512_set1_epi8,
    _mm512_set1_epi32, _mm512_set1_ps, _mm512_setr_epi64, _mm512_setzero_ps, _mm512_setzero_si512,
    _mm512_shuffle_epi8, _mm512_srli_epi16, _mm512_storeu_ps, _mm512_storeu_si512,
    _mm512_sub_epi32, _mm512_sub_ps,
};

use super::tiles::{Ahead, Kind, ROWS, next_codes};
use super::{RowsView, ScaleRule, avx2, prescale};

/// Columns of `x` that share one 8-bit step.
const BLOCK: usize = super::BLOCK8;
/// Groups of four bytes in a block.
const QUADS: usize = BLOCK / 4;
/// Weight rows a kernel call takes.
const MR: usize = 8;
/// The widest panel: 16 lanes.
const LANES: usize = 16;

/// `q.round().clamp(-127, 127)` for a finite `q` at most a little past 127 in magnitude
/// (rounding half away from zero, as [`super::round_fixed`] does).
#[cfg(test)]
fn round8(q: f32) -> i8 {
    // a no-op for the values made here; keeps any other value's truncation in range
    let q = q.clamp(-128.0, 128.0);
    let t = q as i32;
    let frac = q - t as f32;
    let r = t + i32::from(frac >= 0.5) - i32::from(frac <= -0.5);
    r.clamp(-127, 127) as i8
}

/// Where value `i` of a block goes in nibble order ([`super::nibble_slot`] within a block).
#[cfg(test)]
const NIBBLE_SLOTS: [usize; BLOCK] = {
    let mut t = [0; BLOCK];
    let mut i = 0;
    while i < BLOCK {
        t[i] = (i % 2) * (BLOCK / 2) + i / 2;
        i += 1;
    }
    t
};

/// The largest magnitude of a block, in eight lanes (so it vectorizes; the maximum does
/// not depend on the order).
#[inline]
fn absmax(v: &[f32; BLOCK]) -> f32 {
    let mut m = [0f32; 8];
    for c in v.chunks_exact(8) {
        for (a, &x) in m.iter_mut().zip(c) {
            *a = a.max(x.abs());
        }
    }
    m.iter().fold(0f32, |a, &b| a.max(b))
}

/// Whether a matrix takes these tiles: a per-row format, or groups of whole blocks.
pub(super) fn fits(view: &RowsView<'_>) -> bool {
    match view.rule {
        ScaleRule::Row { .. } => true,
        ScaleRule::Groups { .. } => view.group > 0 && view.group.is_multiple_of(BLOCK),
    }
}

/// `x` rounded to 8 bits per block and transposed into blocks of `lanes` rows.
pub(super) struct Panel {
    lanes: usize,
    /// Columns, padded to whole blocks.
    pub(super) kp: usize,
    /// From `q[q0]`, unit `(k · kp / 4 + u) · lanes + l`: row `k · lanes + l`'s bytes
    /// `4u..4u + 4`.
    q: Vec<u32>,
    /// `(k · blocks + c) · lanes + l`: that row's step in block `c`.
    step: Vec<f32>,
    /// Laid out as `step`: `128 · Σ q` over the block (what the biased codes add).
    bias: Vec<i32>,
    /// Per row, per block: `s · Σ q`, the rounded block's sum.
    sums: Vec<f32>,
}

/// One panel's share of a [`Panel`]'s buffers.
type PanelParts<'a> = (&'a mut [u32], &'a mut [f32], &'a mut [i32], &'a mut [f32]);

impl Panel {
    /// `x` (`[batch, cols]`, every value finite) for `lanes` lanes; `nibbles` puts each
    /// block in nibble order; `kind` is the tier that multiplies, whose vectors round it
    /// (AVX-512's sixteen values at a time on its own tier only, so a forced lower tier
    /// is timed as it runs on a CPU without AVX-512; the same bytes either way). Panels of
    /// `lanes` rows are independent, so a large `x` is rounded a panel at a time on the
    /// kernel pool's threads, with the same bits.
    pub(super) fn new(
        x: &[f32],
        batch: usize,
        cols: usize,
        nibbles: bool,
        lanes: usize,
        kind: Kind,
    ) -> Self {
        let lanes = lanes.max(1);
        let kp = cols.div_ceil(BLOCK) * BLOCK;
        let (units, blocks) = (kp / 4, kp / BLOCK);
        let panels = batch.div_ceil(lanes);
        let mut q = vec![0u32; panels * units * lanes + 15];
        let q0 = first_line(&q);
        let mut step = vec![0f32; panels * blocks * lanes];
        let mut bias = vec![0i32; panels * blocks * lanes];
        let mut sums = vec![0f32; batch * blocks];
        let avx512 = matches!(kind, Kind::Avx512(_));
        let shape = Shape {
            x,
            batch,
            cols,
            nibbles,
            lanes,
        };
        let one = |k: usize, parts: PanelParts<'_>| {
            if avx512 {
                // SAFETY: the AVX-512 tier's token in `kind` proves its features
                unsafe { fill_avx512(&shape, k, parts) };
            } else {
                // SAFETY: every tier's token proves AVX2
                unsafe { fill_avx2(&shape, k, parts) };
            }
        };
        // (no columns: nothing to fill, and no chunks of zero length)
        let parts = q[q0..]
            .chunks_mut((units * lanes).max(1))
            .zip(step.chunks_mut((blocks * lanes).max(1)))
            .zip(bias.chunks_mut((blocks * lanes).max(1)))
            .zip(sums.chunks_mut((blocks * lanes).max(1)))
            .map(|(((q, s), o), t)| (q, s, o, t))
            .collect();
        let share = batch.saturating_mul(cols) >= super::SHARE_MIN_VALUES;
        super::pool::each(share, parts, &one);
        Self {
            lanes,
            kp,
            q,
            step,
            bias,
            sums,
        }
    }

    /// Per row, the rounded `x`'s sum over each group of `gblocks` blocks (for
    /// `Int4Block`'s minimums), the blocks added in order.
    pub(super) fn group_sums(&self, batch: usize, gblocks: usize) -> Vec<f32> {
        let blocks = self.blocks();
        let gblocks = gblocks.max(1);
        let mut out = Vec::with_capacity(batch * blocks.div_ceil(gblocks));
        for b in 0..batch {
            let row = self.sums.get(b * blocks..(b + 1) * blocks).unwrap_or(&[]);
            out.extend(
                row.chunks(gblocks)
                    .map(|g| g.iter().fold(0f32, |a, &v| a + v)),
            );
        }
        out
    }

    /// Where the units start in `q`: its first unit on a 64-byte boundary (so with 16
    /// lanes each unit row is a cache line: the AMX tiles load it as one, and a load
    /// across two lines took longer).
    fn q0(&self) -> usize {
        first_line(&self.q)
    }

    pub(super) fn blocks(&self) -> usize {
        self.kp / BLOCK
    }

    /// Block `k` of rows: its units, steps and biases.
    pub(super) fn block(&self, k: usize) -> (&[u32], &[f32], &[i32]) {
        let (nq, ns) = (self.kp / 4 * self.lanes, self.blocks() * self.lanes);
        (
            self.q
                .get(self.q0() + k * nq..self.q0() + (k + 1) * nq)
                .unwrap_or(&[]),
            self.step.get(k * ns..(k + 1) * ns).unwrap_or(&[]),
            self.bias.get(k * ns..(k + 1) * ns).unwrap_or(&[]),
        )
    }
}

/// The index of `v`'s first value on a 64-byte boundary (at most 15: `v` is made 15
/// longer than its units).
fn first_line(v: &[u32]) -> usize {
    v.as_ptr().align_offset(64).min(15)
}

/// What every panel of a [`Panel`] is made from.
struct Shape<'a> {
    x: &'a [f32],
    batch: usize,
    cols: usize,
    nibbles: bool,
    lanes: usize,
}

/// [`fill`] compiled with AVX2, so its loops vectorize 8 wide (the same IEEE operations,
/// so the same bits; at batch 32 the panel took a tenth of the product's time at the
/// baseline's SSE2).
///
/// # Safety
/// AVX2 present.
#[target_feature(enable = "avx2")]
unsafe fn fill_avx2(shape: &Shape<'_>, k: usize, parts: PanelParts<'_>) {
    fill::<AVX2>(shape, k, parts);
}

/// [`fill`] with each block rounded 16 values a vector ([`round_block_avx512`]: the same
/// IEEE operations lane by lane, so the same bytes), its rounded sum taken from the same
/// vectors. One 512-token window of SmolLM2 as NF4-g64, one thread, Intel Xeon with
/// AVX-512: the rounding took about 8% of the window with [`fill_avx2`].
///
/// # Safety
/// The AVX-512 tier's features present (F, BW, VL).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
unsafe fn fill_avx512(shape: &Shape<'_>, k: usize, parts: PanelParts<'_>) {
    fill::<AVX512>(shape, k, parts);
}

/// [`fill`]'s rounding: [`round_block_avx2`], from [`fill_avx2`].
const AVX2: u8 = 1;
/// [`fill`]'s rounding: [`round_block_avx512`], from [`fill_avx512`].
const AVX512: u8 = 2;

/// Panel `k` (rows `k · lanes..`) of `shape.x`: its units, steps and biases (laid out as
/// in [`Panel`], from the panel's start) and its rows' block sums. `MODE` picks how each
/// block is rounded ([`AVX2`] or [`AVX512`], each the same bits as [`round8`] a value);
/// only [`fill_avx2`] and [`fill_avx512`], compiled for their features, call it.
#[inline(always)]
fn fill<const MODE: u8>(shape: &Shape<'_>, k: usize, (q, step, bias, sums): PanelParts<'_>) {
    let (cols, lanes) = (shape.cols.max(1), shape.lanes);
    let blocks = cols.div_ceil(BLOCK);
    for l in 0..lanes {
        let b = k * lanes + l;
        if b >= shape.batch {
            break;
        }
        let Some(row) = shape.x.get(b * cols..(b + 1) * cols) else {
            break;
        };
        for (c, vals) in row.chunks(BLOCK).enumerate() {
            let mut v = [0f32; BLOCK];
            for (o, &x) in v.iter_mut().zip(vals) {
                *o = x;
            }
            let absmax = absmax(&v);
            let (bytes, qsum) = if absmax > 0.0 {
                let (pre, inv) = prescale(absmax, 127.0);
                let sum = |b: [i8; BLOCK]| (b, b.iter().map(|&v| i32::from(v)).sum::<i32>());
                if MODE == AVX512 {
                    // SAFETY: only `fill_avx512`, compiled with AVX-512 F, BW and VL for a
                    // CPU that has them, passes `AVX512`
                    unsafe { round_block_avx512(&v, pre, inv, shape.nibbles) }
                } else {
                    // SAFETY: both callers are compiled with AVX2 for a CPU that has it
                    sum(unsafe { round_block_avx2(&v, pre, inv, shape.nibbles) })
                }
            } else {
                ([0i8; BLOCK], 0)
            };
            let at = c * lanes + l;
            if let (Some(s), Some(o), Some(t)) = (
                step.get_mut(at),
                bias.get_mut(at),
                sums.get_mut(l * blocks + c),
            ) {
                *s = absmax / 127.0;
                *o = 128 * qsum;
                *t = qsum as f32 * *s;
            }
            for (u, quad) in bytes.chunks_exact(4).enumerate() {
                let v = u32::from_le_bytes([quad[0], quad[1], quad[2], quad[3]].map(|v| v as u8));
                if let Some(o) = q.get_mut((c * QUADS + u) * lanes + l) {
                    *o = v;
                }
            }
        }
    }
}

/// A block rounded to 8 bits with `round8((x · pre) · inv)`, in nibble order when
/// `nibbles` (slot `i < 16` value `2i`, slot `16 + i` value `2i + 1`): the definition the
/// tests hold the vector roundings to (every tier that rounds `x` to 8 bits has AVX2).
#[cfg(test)]
fn round_block(v: &[f32; BLOCK], pre: f32, inv: f32, nibbles: bool) -> [i8; BLOCK] {
    let mut natural = [0i8; BLOCK];
    for (o, &x) in natural.iter_mut().zip(v) {
        *o = round8((x * pre) * inv);
    }
    if !nibbles {
        return natural;
    }
    let mut out = [0i8; BLOCK];
    for (&slot, &q) in NIBBLE_SLOTS.iter().zip(&natural) {
        out[slot % BLOCK] = q;
    }
    out
}

/// [`round_block`] eight values a vector: the same IEEE products, `round8`'s clamp,
/// truncation and comparisons of the fraction lane by lane, so the same bytes.
///
/// # Safety
/// AVX2 present.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn round_block_avx2(v: &[f32; BLOCK], pre: f32, inv: f32, nibbles: bool) -> [i8; BLOCK] {
    let (vpre, vinv) = (_mm256_set1_ps(pre), _mm256_set1_ps(inv));
    let (lo, hi) = (_mm256_set1_ps(-128.0), _mm256_set1_ps(128.0));
    let (half, neg_half) = (_mm256_set1_ps(0.5), _mm256_set1_ps(-0.5));
    let (min, max) = (_mm256_set1_epi32(-127), _mm256_set1_epi32(127));
    let mut r = [_mm256_setzero_si256(); 4];
    for (j, out) in r.iter_mut().enumerate() {
        // SAFETY: 8 of the block's 32 values
        let x = unsafe { _mm256_loadu_ps(v.as_ptr().add(8 * j)) };
        let q = _mm256_mul_ps(_mm256_mul_ps(x, vpre), vinv);
        // `clamp(-128, 128)` (no NaN reaches here: `x` is finite, `inv` at most 127 / |x|)
        let q = _mm256_max_ps(_mm256_min_ps(q, hi), lo);
        let t = _mm256_cvttps_epi32(q);
        let frac = _mm256_sub_ps(q, _mm256_cvtepi32_ps(t));
        // the comparisons' masks are -1 where true
        let up = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GE_OQ>(frac, half));
        let down = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(frac, neg_half));
        let t = _mm256_add_epi32(_mm256_sub_epi32(t, up), down);
        *out = _mm256_max_epi32(_mm256_min_epi32(t, max), min);
    }
    // i32 -> i8 (every value in -127..=127): the packs interleave the 128-bit lanes, the
    // permutation restores the order
    let w01 = _mm256_packs_epi32(r[0], r[1]);
    let w23 = _mm256_packs_epi32(r[2], r[3]);
    let b = _mm256_packs_epi16(w01, w23);
    let mut b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    if nibbles {
        // each lane's even bytes, then its odd ones; then the evens of both lanes first
        let split = _mm256_setr_epi8(
            0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12, 14, 1, 3,
            5, 7, 9, 11, 13, 15,
        );
        b = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_shuffle_epi8(b, split));
    }
    let mut out = [0i8; BLOCK];
    // SAFETY: 32 bytes
    unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), b) };
    out
}

/// [`round_block_avx2`] sixteen values a vector, with the block's sum of rounded values
/// (`Σ q`, exact in `i32`): the same IEEE products, clamp, truncation and comparisons of
/// the fraction lane by lane as [`round8`], so the same bytes.
///
/// # Safety
/// AVX-512 F, BW and VL present.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
unsafe fn round_block_avx512(
    v: &[f32; BLOCK],
    pre: f32,
    inv: f32,
    nibbles: bool,
) -> ([i8; BLOCK], i32) {
    let (vpre, vinv) = (_mm512_set1_ps(pre), _mm512_set1_ps(inv));
    let (lo, hi) = (_mm512_set1_ps(-128.0), _mm512_set1_ps(128.0));
    let (half, neg_half) = (_mm512_set1_ps(0.5), _mm512_set1_ps(-0.5));
    let (min, max, one) = (
        _mm512_set1_epi32(-127),
        _mm512_set1_epi32(127),
        _mm512_set1_epi32(1),
    );
    let mut out = [0i8; BLOCK];
    let mut total = _mm512_setzero_si512();
    for (j, o) in out.chunks_exact_mut(16).enumerate() {
        // SAFETY: 16 of the block's 32 values
        let x = unsafe { _mm512_loadu_ps(v.as_ptr().add(16 * j)) };
        let q = _mm512_mul_ps(_mm512_mul_ps(x, vpre), vinv);
        // `clamp(-128, 128)` (no NaN reaches here: `x` is finite, `inv` at most 127 / |x|)
        let q = _mm512_max_ps(_mm512_min_ps(q, hi), lo);
        let t = _mm512_cvttps_epi32(q);
        let frac = _mm512_sub_ps(q, _mm512_cvtepi32_ps(t));
        let up = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(frac, half);
        let down = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(frac, neg_half);
        let t = _mm512_mask_sub_epi32(_mm512_mask_add_epi32(t, up, t, one), down, t, one);
        let t = _mm512_max_epi32(_mm512_min_epi32(t, max), min);
        total = _mm512_add_epi32(total, t);
        // every value in -127..=127: the narrowing is exact
        // SAFETY: 16 bytes
        unsafe { _mm_storeu_si128(o.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(t)) };
    }
    if nibbles {
        // SAFETY: 32 bytes
        let b = unsafe { _mm256_loadu_si256(out.as_ptr().cast()) };
        // each 128-bit lane's even bytes, then its odd ones; then the evens of both first
        let split = _mm256_setr_epi8(
            0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12, 14, 1, 3,
            5, 7, 9, 11, 13, 15,
        );
        let b = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_shuffle_epi8(b, split));
        // SAFETY: 32 bytes
        unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), b) };
    }
    (out, _mm512_reduce_add_epi32(total))
}

/// A thread's reused buffers: 16 weight rows' codes as bytes (biased by 128 for the VNNI
/// tiers) and each row's group scales.
struct Rows {
    kp: usize,
    groups: usize,
    codes: Vec<i8>,
    scales: Vec<f32>,
}

impl Rows {
    fn new(kp: usize, groups: usize) -> Self {
        Self {
            kp,
            groups,
            codes: vec![0; ROWS * kp],
            scales: vec![0.0; ROWS * groups],
        }
    }

    /// Rows `first..first + n` (`n <= 16`) of the matrix; rows past `n` are left as they
    /// were (their outputs are not kept).
    fn load(&mut self, kind: Kind, view: &RowsView<'_>, first: usize, n: usize) {
        let biased = !matches!(kind, Kind::Avx2(_));
        let pad = if biased { i8::MIN } else { 0 };
        let (kp, ng) = (self.kp, self.groups);
        for (k, row) in self.codes.chunks_exact_mut(kp.max(1)).enumerate().take(n) {
            let codes = view.codes_of(first + k);
            // the padding: what the codes below leave (a 4-bit row's whole runs of 16
            // code bytes write all 32 of their values; a shorter last run leaves gaps)
            let written = match view.lut {
                Some(_) => (codes.len() / 16).min(row.len() / 32) * 32,
                None => codes.len().min(row.len()),
            };
            row.get_mut(written..).unwrap_or(&mut []).fill(pad);
            match view.lut {
                Some(lut) => {
                    let lut = if biased {
                        lut.map(|v| v ^ i8::MIN)
                    } else {
                        *lut
                    };
                    decode_nibbles(kind, codes, &lut, row);
                }
                None => {
                    for (o, &c) in row.iter_mut().zip(codes) {
                        *o = (c as i8) ^ pad;
                    }
                }
            }
            let scales = view.scales_of(first + k);
            for (g, o) in self.scales[k * ng..(k + 1) * ng].iter_mut().enumerate() {
                *o = scales.get(g);
            }
        }
    }
}

/// 4-bit indices through `lut` into `out` in nibble order, as [`avx2::decode_nibbles`]
/// (which does the rest): the AVX-512 tier 64 code bytes at a time.
fn decode_nibbles(kind: Kind, codes: &[u8], lut: &[i8; 16], out: &mut [i8]) {
    let mut done = 0;
    if let Kind::Avx512(t) = kind {
        let chunks = codes.len().min(out.len() / 2) / 64;
        let _ = t;
        // SAFETY: the token proves AVX-512 F and BW; the loop stays within `chunks`
        // whole chunks of both slices.
        unsafe { decode_nibbles_avx512(codes, lut, out, chunks) };
        done = 64 * chunks;
    }
    if let (Some(c), Some(o)) = (codes.get(done..), out.get_mut(2 * done..)) {
        avx2::decode_nibbles(kind.avx2(), c, lut, o);
    }
}

/// # Safety
/// AVX-512 F and BW present; `codes.len() >= 64 · chunks`, `out.len() >= 128 · chunks`.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn decode_nibbles_avx512(codes: &[u8], lut: &[i8; 16], out: &mut [i8], chunks: usize) {
    // SAFETY: `lut` is 16 bytes
    let table = _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(lut.as_ptr().cast()) });
    for i in 0..chunks {
        // SAFETY: i < chunks: bytes 64i..64i + 64 of `codes` are in range
        let b = unsafe { _mm512_loadu_si512(codes.as_ptr().add(64 * i).cast()) };
        let (b01, b23) = nibble_blocks(table, b);
        // SAFETY: i < chunks: outputs 128i..128i + 128 are in range
        unsafe {
            let o = out.as_mut_ptr().add(128 * i);
            _mm512_storeu_si512(o.cast(), b01);
            _mm512_storeu_si512(o.add(64).cast(), b23);
        }
    }
}

/// 64 code bytes (four 16-byte runs) through `table` (a 16-byte table in each 128-bit
/// lane) in nibble order: blocks 0 and 1, then blocks 2 and 3, each block a run's low
/// nibbles' values, then its high ones'.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
pub(super) fn nibble_blocks(table: __m512i, b: __m512i) -> (__m512i, __m512i) {
    let low = _mm512_set1_epi8(0x0f);
    let lo = _mm512_shuffle_epi8(table, _mm512_and_si512(b, low));
    let hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16::<4>(b), low));
    // 128-bit lanes (lo 0, hi 0, lo 1, hi 1) and (lo 2, hi 2, lo 3, hi 3), in 64-bit indices
    (
        _mm512_permutex2var_epi64(lo, _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), hi),
        _mm512_permutex2var_epi64(lo, _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15), hi),
    )
}

/// Eight weight rows' codes as four-byte units, and their scales, for one kernel call.
struct Eight<'a> {
    rows: [&'a [i8]; MR],
    scales: [&'a [f32]; MR],
}

impl<'a> Eight<'a> {
    fn of(s: &'a Rows, m: usize) -> Self {
        let (kp, ng) = (s.kp, s.groups);
        Self {
            rows: std::array::from_fn(|r| {
                s.codes
                    .get((m * MR + r) * kp..(m * MR + r + 1) * kp)
                    .unwrap_or(&[])
            }),
            scales: std::array::from_fn(|r| {
                s.scales
                    .get((m * MR + r) * ng..(m * MR + r + 1) * ng)
                    .unwrap_or(&[])
            }),
        }
    }
}

/// Row `r`'s four codes of unit `u` as one `i32`.
///
/// # Safety
/// `4u + 4 <= w.len()`.
#[inline]
unsafe fn quad_of(w: &[i8], u: usize) -> i32 {
    // SAFETY: in range (caller)
    unsafe { w.as_ptr().add(4 * u).cast::<i32>().read_unaligned() }
}

/// Eight weight rows against one block of the panel: `out[r][l]` is the row against the
/// block's row `l`, before `Int4Block`'s minimums (AVX2 and AVX-VNNI fill 8 lanes).
/// `codes` says what the codes can be, which picks the AVX2 tier's step.
fn dots(
    kind: Kind,
    e: &Eight<'_>,
    gblocks: usize,
    p: &Panel,
    k: usize,
    codes: Codes,
    ahead: &mut Ahead,
) -> [[f32; LANES]; MR] {
    let (xq, step, bias) = p.block(k);
    let (kp, blocks, lanes) = (p.kp, p.blocks(), kind.lanes());
    let groups = blocks.div_ceil(gblocks.max(1));
    let ok = gblocks > 0
        && p.lanes == lanes
        && e.rows.iter().all(|r| r.len() >= kp)
        && e.scales.iter().all(|s| s.len() >= groups)
        && xq.len() >= kp / 4 * lanes
        && step.len() >= blocks * lanes
        && bias.len() >= blocks * lanes;
    if !ok {
        return reference(
            lanes,
            e,
            gblocks,
            blocks,
            xq,
            step,
            !matches!(kind, Kind::Avx2(_)),
        );
    }
    let _ = kind;
    // SAFETY: the token in `kind` proves the features; `ok` checked every range the
    // loads read (rows of `kp = 32 · blocks` codes, `blocks` groups at most, the block's
    // `kp / 4` units, steps and biases of `lanes` each).
    unsafe {
        match kind {
            Kind::Avx2(_) if codes == Codes::Linear => {
                tile_avx2_linear(e, gblocks, blocks, xq, step, bias, ahead)
            }
            Kind::Avx2(_) if codes == Codes::Table => {
                tile_avx2_table(e, gblocks, blocks, xq, step, bias, ahead)
            }
            Kind::Avx2(_) => tile_avx2(e, gblocks, blocks, xq, step, bias, ahead),
            Kind::AvxVnni(_) => tile_avxvnni(e, gblocks, blocks, xq, step, bias, ahead),
            Kind::Avx512(_) => tile_avx512(e, gblocks, blocks, xq, step, bias, ahead),
        }
    }
}

/// [`dots`] in plain Rust, the definition the SIMD code is held to: `biased` says the
/// codes carry the VNNI tiers' `+ 128`, which it takes off first.
fn reference(
    lanes: usize,
    e: &Eight<'_>,
    gblocks: usize,
    blocks: usize,
    xq: &[u32],
    step: &[f32],
    biased: bool,
) -> [[f32; LANES]; MR] {
    let mut out = [[0f32; LANES]; MR];
    let gblocks = gblocks.max(1);
    for (r, o) in out.iter_mut().enumerate() {
        let code = |j: usize| {
            let c = e.rows[r].get(j).copied().unwrap_or(0);
            i32::from(if biased { c ^ i8::MIN } else { c })
        };
        for (l, acc) in o.iter_mut().enumerate().take(lanes) {
            for g in 0..blocks.div_ceil(gblocks) {
                let mut a = 0f32;
                for c in g * gblocks..((g + 1) * gblocks).min(blocks) {
                    let mut sum = 0i32;
                    for j in c * BLOCK..(c + 1) * BLOCK {
                        let unit = xq.get((j / 4) * lanes + l).copied().unwrap_or(0);
                        let q = i32::from((unit >> (8 * (j % 4))) as u8 as i8);
                        sum += code(j) * q;
                    }
                    let s = step.get(c * lanes + l).copied().unwrap_or(0.0);
                    a = (sum as f32).mul_add(s, a);
                }
                let w = e.scales[r].get(g).copied().unwrap_or(0.0);
                *acc = a.mul_add(w, *acc);
            }
        }
    }
    out
}

/// A 256-bit tile kernel: `$name`, with `$features`, summing a block with
/// `$step(sum, xv, wv)` (`wv` four codes broadcast) and making the block's exact sum with
/// `$finish(sum, bias)` (taking the biased codes' `128 · Σ q` off, or widening sums kept
/// in `i16`, or nothing).
macro_rules! tile_256 {
    ($name:ident, $features:literal, $step:expr, $finish:expr) => {
        /// # Safety
        /// The features present; every row of `e` holds `32 · blocks` codes and every
        /// row's scales `blocks.div_ceil(gblocks)` (with `gblocks > 0`); `xq` holds
        /// `8 · blocks · 8` units, `step` and `bias` `8 · blocks` values.
        #[target_feature(enable = $features)]
        unsafe fn $name(
            e: &Eight<'_>,
            gblocks: usize,
            blocks: usize,
            xq: &[u32],
            step: &[f32],
            bias: &[i32],
            ahead: &mut Ahead,
        ) -> [[f32; LANES]; MR] {
            let mut acc = [_mm256_setzero_ps(); MR];
            let mut g = 0;
            while g * gblocks < blocks {
                let mut ga = [_mm256_setzero_ps(); MR];
                for c in g * gblocks..((g + 1) * gblocks).min(blocks) {
                    ahead.step();
                    let mut s = [_mm256_setzero_si256(); MR];
                    for u in c * QUADS..(c + 1) * QUADS {
                        // SAFETY: u < 8 · blocks: eight units from 8u are in `xq`
                        let xv = unsafe { _mm256_loadu_si256(xq.as_ptr().add(8 * u).cast()) };
                        for (sr, row) in s.iter_mut().zip(e.rows) {
                            // SAFETY: 4u + 4 <= 32 · blocks <= the row's length
                            let wv = _mm256_set1_epi32(unsafe { quad_of(row, u) });
                            *sr = $step(*sr, xv, wv);
                        }
                    }
                    // SAFETY: c < blocks: eight values from 8c are in `step` and `bias`
                    let (sv, bv) = unsafe {
                        (
                            _mm256_loadu_ps(step.as_ptr().add(8 * c)),
                            _mm256_loadu_si256(bias.as_ptr().add(8 * c).cast()),
                        )
                    };
                    for r in 0..MR {
                        let exact = $finish(s[r], bv);
                        ga[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), sv, ga[r]);
                    }
                }
                for r in 0..MR {
                    acc[r] = _mm256_fmadd_ps(ga[r], _mm256_set1_ps(e.scales[r][g]), acc[r]);
                }
                g += 1;
            }
            let mut out = [[0f32; LANES]; MR];
            for (o, v) in out.iter_mut().zip(acc) {
                // SAFETY: 8 of the row's 16 f32
                unsafe { _mm256_storeu_ps(o.as_mut_ptr(), v) };
            }
            out
        }
    };
}

/// `s` plus, in each 32-bit lane, the four products of signed codes `w` and signed
/// activations `x` (AVX2): `|w|` as unsigned bytes times `x` with `w`'s sign, exact pairs
/// in `i16` (`|w| <= 128`, `|x| <= 127`), then quads.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) fn quads_avx2(s: __m256i, w: __m256i, x: __m256i) -> __m256i {
    let pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
    _mm256_add_epi32(s, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
}

/// `s` plus, in each 32-bit lane, the four products of codes biased to unsigned bytes `w`
/// and signed activations `x` (AVX-VNNI `vpdpbusd`).
#[inline]
#[target_feature(enable = "avx2,fma,avxvnni")]
pub(super) fn quads_avxvnni(s: __m256i, w: __m256i, x: __m256i) -> __m256i {
    _mm256_dpbusd_avx_epi32(s, w, x)
}

/// A quad of codes in `0..=15` read as they are (INT4's identity table, unbiased on the
/// AVX2 tier) against signed `x`: the codes are the unsigned operand of `vpmaddubsw` with
/// no sign moved, and the pairs stay in `i16` until the block ends ([`widen_avx2`]): 8
/// quads of a pair of products each are at most `16 · 15 · 127 = 30,480` in magnitude, so
/// nothing saturates or rounds, and the block sums are [`quads_avx2`]'s in 2 instructions
/// a quad instead of 5.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn pairs_linear_avx2(s: __m256i, x: __m256i, w: __m256i) -> __m256i {
    _mm256_add_epi16(s, _mm256_maddubs_epi16(w, x))
}

/// A block's pairs in `i16` ([`pairs_linear_avx2`]) widened to its sums in `i32`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn widen_avx2(s: __m256i, _b: __m256i) -> __m256i {
    _mm256_madd_epi16(s, _mm256_set1_epi16(1))
}

tile_256!(
    tile_avx2,
    "avx2,fma",
    |s: __m256i, x: __m256i, w: __m256i| quads_avx2(s, w, x),
    |s: __m256i, _b: __m256i| s
);
tile_256!(tile_avx2_linear, "avx2,fma", pairs_linear_avx2, widen_avx2);

/// `s` plus, in each 32-bit lane, the four products of codes `w` with `|w| <= 127` (a
/// 4-bit table's values, never -128) and signed activations `x` (AVX2): `|x|` as unsigned
/// bytes times `w` with `x`'s sign. `|x|` depends on the quad of `x` alone, so the
/// compiler computes it once for the tile's 8 rows (their steps are one unrolled block),
/// where [`quads_avx2`] takes `|w|` a row: 5 instructions a row and quad instead of 6.
/// The same exact sums (`|x| · (w · sgn x) = w · x`; pairs at most 32,258).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn quads_table_avx2(s: __m256i, x: __m256i, w: __m256i) -> __m256i {
    let pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(x), _mm256_sign_epi8(w, x));
    _mm256_add_epi32(s, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
}

tile_256!(
    tile_avx2_table,
    "avx2,fma",
    quads_table_avx2,
    |s: __m256i, _b: __m256i| s
);

/// What a product's codes can be, which picks the AVX2 tile's step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Codes {
    /// Any byte, -128 included (the 8-bit formats): [`quads_avx2`].
    Bytes,
    /// A 4-bit table's values, `|w| <= 127`: [`quads_table_avx2`].
    Table,
    /// `0..=15` as they are (INT4's identity table): [`pairs_linear_avx2`].
    Linear,
}

impl Codes {
    /// The codes a format's table (`None` for the 8-bit formats) gives.
    pub(super) fn of(lut: Option<&[i8; 16]>) -> Self {
        match lut {
            Some(lut) if *lut == super::INT4_I8 => Self::Linear,
            Some(lut) if lut.iter().all(|&v| v != i8::MIN) => Self::Table,
            _ => Self::Bytes,
        }
    }
}
tile_256!(
    tile_avxvnni,
    "avx2,fma,avxvnni",
    |s: __m256i, x: __m256i, w: __m256i| quads_avxvnni(s, w, x),
    |s: __m256i, b: __m256i| _mm256_sub_epi32(s, b)
);

/// # Safety
/// AVX-512 F and VNNI and FMA present; the ranges of [`tile_avx2`] with 16 lanes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
unsafe fn tile_avx512(
    e: &Eight<'_>,
    gblocks: usize,
    blocks: usize,
    xq: &[u32],
    step: &[f32],
    bias: &[i32],
    ahead: &mut Ahead,
) -> [[f32; LANES]; MR] {
    let mut acc = [_mm512_setzero_ps(); MR];
    let mut g = 0;
    while g * gblocks < blocks {
        let mut ga = [_mm512_setzero_ps(); MR];
        for c in g * gblocks..((g + 1) * gblocks).min(blocks) {
            ahead.step();
            let mut s = [_mm512_setzero_si512(); MR];
            for u in c * QUADS..(c + 1) * QUADS {
                // SAFETY: u < 8 · blocks: sixteen units from 16u are in `xq`
                let xv = unsafe { _mm512_loadu_si512(xq.as_ptr().add(LANES * u).cast()) };
                for (sr, row) in s.iter_mut().zip(e.rows) {
                    // SAFETY: 4u + 4 <= 32 · blocks <= the row's length
                    let wv = _mm512_set1_epi32(unsafe { quad_of(row, u) });
                    *sr = _mm512_dpbusd_epi32(*sr, wv, xv);
                }
            }
            // SAFETY: c < blocks: sixteen values from 16c are in `step` and `bias`
            let (sv, bv) = unsafe {
                (
                    _mm512_loadu_ps(step.as_ptr().add(LANES * c)),
                    _mm512_loadu_si512(bias.as_ptr().add(LANES * c).cast()),
                )
            };
            for r in 0..MR {
                let exact = _mm512_sub_epi32(s[r], bv);
                ga[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), sv, ga[r]);
            }
        }
        for r in 0..MR {
            acc[r] = _mm512_fmadd_ps(ga[r], _mm512_set1_ps(e.scales[r][g]), acc[r]);
        }
        g += 1;
    }
    let mut out = [[0f32; LANES]; MR];
    for (o, v) in out.iter_mut().zip(acc) {
        // SAFETY: the row's 16 f32
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), v) };
    }
    out
}

/// Blocks of [`BLOCK`] columns a group: a per-row format is one group of the whole row.
pub(super) fn group_blocks(view: &RowsView<'_>, blocks: usize) -> usize {
    match view.rule {
        ScaleRule::Row { .. } => blocks.max(1),
        ScaleRule::Groups { .. } => (view.group / BLOCK).max(1),
    }
}

/// `Int4Block`'s minimums against the rounded `x`: each row's minimums (one a group) and
/// each `x` row's group sums; for a batch of [`Self::COLUMNS`] or more also held a group a
/// row (`[groups][stride]`), so that one weight row's terms for the whole batch are
/// computed together.
pub(super) struct Minimums<'a> {
    mins: Option<&'a [f32]>,
    /// `x` row `b`'s group sums at `b · groups..`.
    xsums: Vec<f32>,
    /// Group `g`'s sum for `x` row `b` at `g · stride + b`, `stride` the batch rounded up
    /// to 16 (empty for small batches).
    xt: Vec<f32>,
    stride: usize,
    batch: usize,
    groups: usize,
}

impl<'a> Minimums<'a> {
    /// The smallest batch whose terms are computed eight `x` rows a step (below it, one
    /// `x` row at a time is faster: at batch 1 the steps would be 1/8 full).
    const COLUMNS: usize = 8;

    /// For `batch` rows of `panel` in groups of `gblocks` blocks; `mins` is `None` for the
    /// formats without minimums.
    pub(super) fn new(
        panel: &Panel,
        batch: usize,
        gblocks: usize,
        mins: Option<&'a [f32]>,
    ) -> Self {
        let groups = panel.blocks().div_ceil(gblocks.max(1));
        let stride = batch.next_multiple_of(16);
        let xsums = match mins {
            Some(_) => panel.group_sums(batch, gblocks),
            None => Vec::new(),
        };
        let mut xt = Vec::new();
        if mins.is_some() && batch >= Self::COLUMNS {
            xt = vec![0f32; groups * stride];
            for (b, row) in xsums.chunks(groups.max(1)).enumerate().take(batch) {
                for (g, &v) in row.iter().enumerate() {
                    if let Some(o) = xt.get_mut(g * stride + b) {
                        *o = v;
                    }
                }
            }
        }
        Self {
            mins,
            xsums,
            xt,
            stride,
            batch,
            groups,
        }
    }

    /// [`Minimums::add_terms`] for the 16 rows `first..first + n` of a tile at once, bit for
    /// bit: `out` is their outputs, `[n, batch]`, and `tile` their minimums in the tiled
    /// layout (`tile[16g + r]` row `first + r`'s of group `g`). On the AVX-512 tier the 16
    /// rows are the lanes of [`super::avx512::add_dot_f32_columns`] (which gives each lane
    /// [`super::avx2::dot_f32`]'s bits, and a dot's terms commute); elsewhere, or where
    /// `tile` is short, a row at a time.
    pub(super) fn add_terms_tile(
        &self,
        kind: Kind,
        tile: &[f32],
        first: usize,
        n: usize,
        out: &mut [f32],
    ) {
        let (g, batch) = (self.groups, self.batch);
        let fits = self.mins.is_some()
            && n <= 16
            && g.checked_mul(16).is_some_and(|need| need <= tile.len());
        let (Kind::Avx512(t), true) = (kind, fits) else {
            return self.add_rows(kind, first, n, out);
        };
        for b in 0..batch {
            let Some(sx) = self.xsums.get(b * g..(b + 1) * g) else {
                continue;
            };
            let mut lanes = [0f32; 16];
            for (r, l) in lanes.iter_mut().enumerate().take(n) {
                *l = out.get(r * batch + b).copied().unwrap_or(0.0);
            }
            super::avx512::add_dot_f32_columns(t, sx, tile, 16, &mut lanes);
            for (r, &l) in lanes.iter().enumerate().take(n) {
                if let Some(o) = out.get_mut(r * batch + b) {
                    *o = l;
                }
            }
        }
    }

    /// [`Minimums::add_terms`] for rows `first..first + n`, a row at a time (`out` as for
    /// [`Minimums::add_terms_tile`]).
    pub(super) fn add_rows(&self, kind: Kind, first: usize, n: usize, out: &mut [f32]) {
        let batch = self.batch;
        for r in 0..n {
            if let Some(yr) = out.get_mut(r * batch..(r + 1) * batch) {
                self.add_terms(kind, first + r, yr);
            }
        }
    }

    /// Adds what weight row `r`'s minimums add to its outputs, `out[b]` for `x` row `b`
    /// (`out` at most the batch long): the dot product of the row's minimums with the `x`
    /// row's group sums, [`super::avx2::dot_f32`]'s arithmetic to the bit at any batch,
    /// `out[b] + dot`. Nothing for the formats without minimums; `+ 0` for a row without
    /// them.
    pub(super) fn add_terms(&self, kind: Kind, r: usize, out: &mut [f32]) {
        let Some(mins) = self.mins else {
            return;
        };
        let g = self.groups;
        let n = out.len().min(self.batch);
        let out = &mut out[..n];
        let Some(m) = r.checked_mul(g).and_then(|at| mins.get(at..at + g)) else {
            for o in out {
                *o += 0.0;
            }
            return;
        };
        let t = kind.avx2();
        if self.xt.is_empty() {
            for (b, o) in out.iter_mut().enumerate() {
                let sx = self.xsums.get(b * g..(b + 1) * g);
                *o += sx.map_or(0.0, |sx| super::avx2::dot_f32(t, m, sx));
            }
        } else if let Kind::Avx512(t) = kind {
            super::avx512::add_dot_f32_columns(t, m, &self.xt, self.stride, out);
        } else {
            super::avx2::add_dot_f32_columns(t, m, &self.xt, self.stride, out);
        }
    }
}

/// The whole product: `yt` is `[rows, batch]`; each output is its row's sum plus, when
/// `mins` is given (`Int4Block`: each row's minimums, one a group), the dot product of the
/// row's minimums with the rounded `x` row's group sums ([`Minimums::add_terms`]), so the
/// output is the rounded `x`
/// against the weights as they are, `Σ (s_g c_j + min_g) x~_j`.
#[allow(clippy::too_many_arguments)]
pub(super) fn run(
    kind: Kind,
    x: &[f32],
    batch: usize,
    view: &RowsView<'_>,
    cols: usize,
    rows: usize,
    yt: &mut [f32],
    mins: Option<&[f32]>,
) {
    let lanes = kind.lanes();
    let panel = Panel::new(x, batch, cols, view.lut.is_some(), lanes, kind);
    let (kp, blocks) = (panel.kp, panel.blocks());
    // a per-row format is one group of the whole row
    let gblocks = group_blocks(view, blocks);
    let groups = blocks.div_ceil(gblocks);
    let panels = batch.div_ceil(lanes);
    let minimums = Minimums::new(&panel, batch, gblocks, mins);
    let codes = Codes::of(view.lut);
    super::run_tasks(
        yt,
        batch * ROWS,
        batch * rows * cols,
        || Rows::new(kp, groups),
        |s, (task, out)| {
            let first = task * ROWS;
            let n = (out.len() / batch).min(rows.saturating_sub(first));
            s.load(kind, view, first, n);
            // the next task's codes into the second-level cache, a line a block or so
            let mut ahead = Ahead::new(next_codes(view, first), n.div_ceil(MR) * panels * blocks);
            for m in 0..n.div_ceil(MR) {
                let e = Eight::of(s, m);
                for k in 0..panels {
                    let d = dots(kind, &e, gblocks, &panel, k, codes, &mut ahead);
                    for (r, dr) in d.iter().enumerate() {
                        let row = m * MR + r;
                        if row >= n {
                            break;
                        }
                        let Some(yr) = out.get_mut(row * batch..(row + 1) * batch) else {
                            continue;
                        };
                        let ys = yr.get_mut(k * lanes..).unwrap_or(&mut []);
                        for (o, &v) in ys.iter_mut().zip(dr.iter().take(lanes)) {
                            *o = v;
                        }
                    }
                }
            }
            minimums.add_rows(kind, first, n, out);
        },
    );
}

#[cfg(test)]
mod tests {
    use super::super::nibble_slot;
    use super::super::tiles::tests::{kinds, values, xorshift};
    use super::*;

    /// The AVX2 rounding of a block gives the scalar rounding's bytes, in both orders, on
    /// random blocks and on values whose scaled form lands on a half, next to one, on
    /// the clamp, on signed zeros and on subnormals (with `prescale`'s pre-scaling).
    #[test]
    fn block_rounding_in_vectors_gives_the_scalar_bytes() {
        if avx2::Token::detect().is_none() {
            eprintln!("skipped: block_rounding_in_vectors_gives_the_scalar_bytes (no AVX2)");
            return;
        }
        let avx512 = super::super::avx512::Token::detect().is_some();
        if !avx512 {
            eprintln!(
                "skipped: the AVX-512 half of block_rounding_in_vectors_gives_the_scalar_bytes (no AVX-512)"
            );
        }
        let mut ran512 = 0;
        let mut next = xorshift(0x2545_f491);
        let mut blocks: Vec<[f32; BLOCK]> = Vec::new();
        for _ in 0..3000 {
            let scale = [1e-3f32, 1.0, 37.5, 1e-39, 3e-42, 6e4][(next() % 6) as usize];
            blocks.push(std::array::from_fn(|_| {
                (next() % 20_001) as f32 / 10_000.0 * scale - scale
            }));
        }
        // absmax 127 so that q = x: halves, their neighbours, the extremes, signed zeros
        for k in -127i32..=127 {
            let h = k as f32 + 0.5;
            let mut b = [0f32; BLOCK];
            b[0] = 127.0;
            b[1] = h.min(127.0);
            b[2] = -h.min(127.0);
            b[3] = f32::from_bits(h.to_bits() + 1).min(127.0);
            b[4] = f32::from_bits(h.to_bits().wrapping_sub(1));
            b[5] = -0.0;
            b[6] = -127.0;
            b[7] = k as f32;
            blocks.push(b);
        }
        for v in &blocks {
            let absmax = absmax(v);
            if absmax == 0.0 {
                continue;
            }
            let (pre, inv) = prescale(absmax, 127.0);
            for nibbles in [false, true] {
                let want = round_block(v, pre, inv, nibbles);
                // SAFETY: AVX2 was detected above
                let got = unsafe { round_block_avx2(v, pre, inv, nibbles) };
                assert_eq!(got, want, "{v:?} nibbles {nibbles}");
                if avx512 {
                    let sum = want.iter().map(|&v| i32::from(v)).sum::<i32>();
                    // SAFETY: the AVX-512 tier's features were detected above
                    let got = unsafe { round_block_avx512(v, pre, inv, nibbles) };
                    assert_eq!(got, (want, sum), "AVX-512: {v:?} nibbles {nibbles}");
                    ran512 += 1;
                }
            }
        }
        if avx512 {
            assert!(ran512 > 6000, "{ran512} blocks");
        }
    }

    /// Every kind of tile the CPU runs gives the bits of [`reference`], on rows with
    /// several groups and the extreme codes and activations.
    #[test]
    fn simd_tiles8_give_the_reference_bits() {
        let kinds = kinds("simd_tiles8_give_the_reference_bits");
        let mut next = xorshift(0x9e37_79b9);
        let cols = 5 * BLOCK - 7;
        let batch = 21;
        let x = values(&mut next, batch * cols, 6, 3.5);
        let unbiased: Vec<i8> = (0..ROWS * 5 * BLOCK)
            .map(|_| match next() % 5 {
                0 => -128,
                1 => 127,
                _ => (next() % 256) as u8 as i8,
            })
            .collect();
        for gblocks in [1, 2, 5] {
            let groups = 5usize.div_ceil(gblocks);
            let scales: Vec<f32> = (0..ROWS * groups)
                .map(|_| (next() % 1000) as f32 / 997.0 - 0.3)
                .collect();
            for &kind in &kinds {
                let biased = !matches!(kind, Kind::Avx2(_));
                // each AVX2 step on the codes it is for: any byte (-128 and 127 among
                // them), a table's (|w| <= 127), INT4's 0..=15 with the extremes
                for (nibbles, codes) in [
                    (false, Codes::Bytes),
                    (true, Codes::Bytes),
                    (true, Codes::Table),
                    (true, Codes::Linear),
                ] {
                    let panel = Panel::new(&x, batch, cols, nibbles, kind.lanes(), kind);
                    let code = |c: i8| match codes {
                        Codes::Bytes => c,
                        Codes::Table => c.max(-127),
                        Codes::Linear => (c as u8 % 16) as i8,
                    };
                    let s = Rows {
                        kp: panel.kp,
                        groups,
                        codes: unbiased
                            .iter()
                            .map(|&c| if biased { code(c) ^ i8::MIN } else { code(c) })
                            .collect(),
                        scales: scales.clone(),
                    };
                    for m in 0..ROWS / MR {
                        let e = Eight::of(&s, m);
                        for k in 0..batch.div_ceil(kind.lanes()) {
                            let got =
                                dots(kind, &e, gblocks, &panel, k, codes, &mut Ahead::new(&[], 1));
                            let (xq, step, _) = panel.block(k);
                            let want = reference(kind.lanes(), &e, gblocks, 5, xq, step, biased);
                            let bits = |v: [[f32; LANES]; MR]| -> Vec<u32> {
                                v.iter().flatten().map(|f| f.to_bits()).collect()
                            };
                            assert_eq!(
                                bits(got),
                                bits(want),
                                "{kind:?}, rows {m}, block {k}, {codes:?}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Every tier's nibble decode gives the portable decode's bytes, on rows of every
    /// length up to a few 64-byte chunks.
    #[test]
    fn nibble_decode_matches_the_portable_one() {
        let mut next = xorshift(0x1234_5678);
        let lut: [i8; 16] = std::array::from_fn(|i| (9 * i as i32 - 70) as i8);
        for &kind in &kinds("nibble_decode_matches_the_portable_one") {
            for len in 0..200 {
                let codes: Vec<u8> = (0..len).map(|_| next() as u8).collect();
                let mut want = vec![7i8; 2 * len + 5];
                super::super::portable::decode_nibbles(&codes, &lut, &mut want);
                let mut got = vec![7i8; 2 * len + 5];
                decode_nibbles(kind, &codes, &lut, &mut got);
                assert_eq!(got, want, "{kind:?}, {len} bytes");
            }
        }
    }

    /// Blocks whose largest value is subnormal round as any other block (no overflow, no
    /// panic), and a value far out of range clamps.
    #[test]
    fn tiny_blocks_round_in_proportion() {
        for kind in kinds("tiny_blocks_round_in_proportion") {
            for absmax in [f32::from_bits(1), 1e-40, 1e-37, 1e-30] {
                let x = [absmax, -absmax, 0.0, absmax];
                let p = Panel::new(&x, 1, 4, false, 8, kind);
                assert_eq!(
                    p.q[p.q0()].to_le_bytes().map(|b| b as i8),
                    [127, -127, 0, 127],
                    "{absmax:e} {kind:?}"
                );
                assert_eq!(p.step[0], absmax / 127.0);
            }
        }
        assert_eq!(round8(f32::INFINITY), 127);
        assert_eq!(round8(f32::NEG_INFINITY), -127);
        assert_eq!(round8(f32::NAN), 0);
    }

    /// The panel holds each block rounded with its own step, in the asked order, and the
    /// bias is `128 · Σ q`.
    /// A row's minimum terms for a whole batch at once (the AVX2 and the AVX-512 code) are,
    /// bit for bit, the dot product `avx2::dot_f32` gives each `x` row alone, added to the
    /// output after it: on lengths
    /// with and without a tail, batches that fill part of a vector, and signed zeros,
    /// subnormals and values far apart in magnitude.
    #[test]
    fn batched_minimum_terms_give_the_bits_of_one_dot_a_row() {
        let Some(t) = super::super::avx2::Token::detect() else {
            eprintln!("skipped: batched_minimum_terms_give_the_bits_of_one_dot_a_row (no AVX2)");
            return;
        };
        let mut next = xorshift(0x1f2e_3d4c);
        let mut value = || match next() % 9 {
            0 => -0.0,
            1 => 0.0,
            2 => f32::from_bits(next() % 0x0080_0000),
            3 => (next() % 2001) as f32 * 1e6 - 1e9,
            _ => (next() % 2001) as f32 / 1000.0 - 1.0,
        };
        let t512 = super::super::avx512::Token::detect();
        if t512.is_none() {
            eprintln!(
                "skipped: batched_minimum_terms_give_the_bits_of_one_dot_a_row on AVX-512 \
                 (this CPU lacks AVX-512 VNNI)"
            );
        }
        for n in [1, 5, 8, 9, 16, 63, 64, 67] {
            for batch in [1usize, 3, 8, 9, 17, 32, 40] {
                for wide in [false, true] {
                    let stride = batch.next_multiple_of(if wide { 16 } else { 8 });
                    let a: Vec<f32> = (0..n).map(|_| value()).collect();
                    let xt: Vec<f32> = (0..n * stride).map(|_| value()).collect();
                    let before: Vec<f32> = (0..batch).map(|_| value()).collect();
                    let mut got = before.clone();
                    match (wide, t512) {
                        (false, _) => {
                            super::super::avx2::add_dot_f32_columns(t, &a, &xt, stride, &mut got)
                        }
                        (true, Some(t5)) => {
                            super::super::avx512::add_dot_f32_columns(t5, &a, &xt, stride, &mut got)
                        }
                        (true, None) => continue,
                    }
                    for (b, (&g, &v)) in got.iter().zip(&before).enumerate() {
                        let col: Vec<f32> = (0..n).map(|j| xt[j * stride + b]).collect();
                        let want = v + super::super::avx2::dot_f32(t, &a, &col);
                        assert_eq!(
                            g.to_bits(),
                            want.to_bits(),
                            "n {n}, batch {batch}, column {b}, AVX-512 {wide}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_panel_is_each_block_rounded_with_its_step() {
        let cols = 40;
        let x: Vec<f32> = (0..2 * cols).map(|i| (i as f32 - 30.0) / 7.0).collect();
        let kinds = kinds("the_panel_is_each_block_rounded_with_its_step");
        for (kind, nibbles) in kinds.iter().flat_map(|&k| [(k, false), (k, true)]) {
            let p = Panel::new(&x, 2, cols, nibbles, 8, kind);
            assert_eq!(p.kp, 64);
            for b in 0..2 {
                for c in 0..2 {
                    let vals =
                        &x[b * cols + c * BLOCK..(b * cols + (c + 1) * BLOCK).min((b + 1) * cols)];
                    let absmax = vals.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let at = c * 8 + b;
                    assert_eq!(p.step[at], absmax / 127.0);
                    let mut sum = 0;
                    let inv = 127.0 / absmax;
                    for (i, &v) in vals.iter().enumerate() {
                        let slot = if nibbles { nibble_slot(i) } else { i };
                        let unit = p.q[p.q0() + (c * QUADS + slot / 4) * 8 + b];
                        let q = (unit >> (8 * (slot % 4))) as u8 as i8;
                        assert_eq!(q, (v * inv).round().clamp(-127.0, 127.0) as i8);
                        assert!((f32::from(q) * p.step[at] - v).abs() <= p.step[at] / 2.0 * 1.0001);
                        sum += i32::from(q);
                    }
                    assert_eq!(p.bias[at], 128 * sum);
                }
            }
        }
    }
}
