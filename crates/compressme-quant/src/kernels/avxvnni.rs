//! The kernels with AVX-VNNI: the 256-bit `vpdpwssd` and `vpdpbusd` (VEX-encoded) that
//! CPUs without AVX-512 have from Alder Lake on (and Sapphire Rapids has beside it).
//! The same exact integer sums as the AVX2 tier, in fewer instructions, so every output
//! is the same bits.
//!
//! - **8-bit codes** at batch 2 and up (decoded rows against up to four rows of `x`):
//!   `vpdpwssd` multiplies and adds 16 pairs an instruction where the AVX2 tier needs
//!   `vpmaddwd` and an add; lane `l` sums positions `2l, 2l + 1` of each 16, class `l`,
//!   exactly as there. The AVX2 tier's loop, expanded over this step.
//! - **4-bit codes at batch 1**, in groups of 64 or more, two weight rows a call: a pair
//!   of runs (64 weights) a step in the [`split`](super::split) layout, whose eight lanes
//!   are the pair's eight class sums, so a group's flush is the AVX2 tier's with no fold.
//!
//! Everything else runs the AVX2 tier's code.
//!
//! Every `unsafe` here is one of two things: calling a `#[target_feature]` function,
//! which a [`Token`] makes sound (it exists only after the CPU was seen to have the
//! features), or an unaligned load inside a range the safe wrapper checked first.
#![allow(unsafe_code)]

use std::arch::x86_64::{
    __m256i, _MM_HINT_T0, _mm_loadu_si128, _mm_prefetch, _mm256_add_epi32, _mm256_and_si256,
    _mm256_broadcastsi128_si256, _mm256_cvtepi8_epi16, _mm256_dpbusd_avx_epi32,
    _mm256_dpwssd_avx_epi32, _mm256_loadu_si256, _mm256_permute4x64_epi64, _mm256_set1_epi8,
    _mm256_setzero_ps, _mm256_setzero_si256, _mm256_shuffle_epi8, _mm256_slli_epi32,
    _mm256_srli_epi16, _mm256_sub_epi32, _mm256_zextsi128_si256,
};

use super::avx2::{self, flush, following, hsum};
use super::split::{CHUNK, PAIR, PAIR_ORDER, SplitX};
use super::{RowScales, RowsView, STEP};

/// Proof that the CPU has AVX-VNNI, besides what the AVX2 tier needs.
#[derive(Debug, Clone, Copy)]
pub(super) struct Token(avx2::Token);

impl Token {
    pub(super) fn detect() -> Option<Self> {
        let ok = is_x86_feature_detected!("avxvnni");
        avx2::Token::detect().filter(|_| ok).map(Self)
    }

    /// The AVX2 tier, which runs whatever this one has no faster path for.
    pub(super) fn avx2(self) -> avx2::Token {
        self.0
    }
}

/// `Σ_g scales[g] · Σ_{j in g} w_j x_j` for each `x` row, from decoded 8-bit codes: the
/// AVX2 tier's `dot_groups` with `vpdpwssd`.
pub(super) fn dot_groups<const N: usize>(
    t: Token,
    w: &[i8],
    xs: [&[i16]; N],
    group: usize,
    scales: &[f32],
) -> [f32; N] {
    if !avx2::groups_fit(w, &xs, group) {
        return avx2::dot_groups(t.avx2(), w, xs, group, scales);
    }
    // SAFETY: the token proves the features; `groups_fit` checked the lengths the loads
    // rely on. Common group sizes get a fixed trip count, as on the AVX2 tier.
    unsafe { by_group!(group, dot_groups_imp::<N>(w, xs, group, scales)) }
}

/// One step of 16 weights for every `x` row.
///
/// # Safety
/// The token's features present; `c + 16 <= w.len()` and `c + 16 <= xs[i].len()`.
#[target_feature(enable = "avx2,fma,avxvnni")]
#[inline]
unsafe fn step<const N: usize>(w: &[i8], xs: &[&[i16]; N], c: usize, acc: &mut [__m256i; N]) {
    // SAFETY: 16 bytes of `w` from c are in range (caller)
    let wv = _mm256_cvtepi8_epi16(unsafe { _mm_loadu_si128(w.as_ptr().add(c).cast()) });
    for (a, x) in acc.iter_mut().zip(xs) {
        // SAFETY: 16 i16 of `x` from c are in range (caller)
        let xv = unsafe { _mm256_loadu_si256(x.as_ptr().add(c).cast::<__m256i>()) };
        *a = _mm256_dpwssd_avx_epi32(*a, wv, xv);
    }
}

/// `G` steps a group when it is not 0 (then `group == 16 * G`).
///
/// # Safety
/// The token's features present; `w.len()` and `group` multiples of 16; every `xs[i]` at
/// least `w.len()` long.
#[target_feature(enable = "avx2,fma,avxvnni")]
unsafe fn dot_groups_imp<const N: usize, const G: usize>(
    w: &[i8],
    xs: [&[i16]; N],
    group: usize,
    scales: &[f32],
) -> [f32; N] {
    // SAFETY: the caller's guarantees, which are `step`'s
    unsafe { dot_groups_loop!(step, w, xs, group, scales, G) }
}

/// Rows `first..first + out.len()` of an integer matrix against one `x` row, the same
/// bits as the AVX2 tier's `dot_rows`. 8-bit codes run the AVX2 code: at batch 1 they are
/// bound by reading the codes, and `vpdpwssd` (a 5-cycle chain where the AVX2 code's add
/// is 1 cycle) measured no faster. `split` is `x` split for the 4-bit
/// kernel ([`SplitX::new`] with the matrix's group); without it, or for a group this tier
/// has no kernel for, the AVX2 tier runs.
pub(super) fn dot_rows(
    t: Token,
    v: &RowsView<'_>,
    first: usize,
    x: &[i16],
    split: Option<&SplitX>,
    out: &mut [f32],
) {
    let (rb, group) = (v.row_bytes, v.group);
    let rows_fit = v.whole_rows(first, out.len());
    match (v.lut, split) {
        (Some(lut), Some(sx)) if rows_fit && sx.covers(rb, group) => {
            in_quads!(v, first, out, |codes, scales| {
                // SAFETY: the token proves the features; every row is `rb` bytes (a
                // multiple of 16) and `sx` covers such a row.
                unsafe { nibble_rows_in_pairs(codes, lut, sx, group, scales) }
            });
        }
        _ => avx2::dot_rows(t.avx2(), v, first, x, out),
    }
}

/// [`nibble_rows_imp`] two rows at a time: four rows' accumulators and this tier's
/// sixteen 256-bit registers do not fit together (measured: with four, the accumulators
/// spill to the stack every step and the kernel ran slower than the AVX2 tier's).
///
/// # Safety
/// As [`nibble_rows_imp`].
#[target_feature(enable = "avx2,fma,avxvnni")]
unsafe fn nibble_rows_in_pairs<const M: usize>(
    codes: [&[u8]; M],
    lut: &[i8; 16],
    sx: &SplitX,
    group: usize,
    scales: [RowScales<'_>; M],
) -> [f32; M] {
    let mut out = [0f32; M];
    for (o, (c, s)) in out.chunks_mut(2).zip(codes.chunks(2).zip(scales.chunks(2))) {
        if let (Ok(c), Ok(s), Ok(o)) = (
            <[&[u8]; 2]>::try_from(c),
            <[RowScales<'_>; 2]>::try_from(s),
            <&mut [f32; 2]>::try_from(&mut *o),
        ) {
            // SAFETY: the caller's guarantees, passed on
            *o = unsafe { nibble_rows_imp(c, lut, sx, group, s) };
        } else {
            for ((o, &c), &s) in o.iter_mut().zip(c).zip(s) {
                // SAFETY: the caller's guarantees, passed on
                [*o] = unsafe { nibble_rows_imp([c], lut, sx, group, [s]) };
            }
        }
    }
    out
}

/// `M` rows of 4-bit codes (indices into `lut`) against one split row of `x`, a pair of
/// runs (64 weights, 32 code bytes) a step with `vpdpbusd`: the codes' middle 64-bit
/// quarters swapped (runs A and B side by side in each 128-bit lane) and their bytes put
/// in the layout's order ([`PAIR_ORDER`]), so the eight 32-bit lanes are the pair's eight
/// class sums; `x`'s low and high bytes make two sums, added as `l + 256 · h` at a
/// group's end, less `128 · Σ x`.
///
/// # Safety
/// The token's features present; `group` a multiple of 64, `sx` split for it and
/// covering the shortest row ([`SplitX::covers`]).
#[target_feature(enable = "avx2,fma,avxvnni")]
unsafe fn nibble_rows_imp<const M: usize>(
    codes: [&[u8]; M],
    lut: &[i8; 16],
    sx: &SplitX,
    group: usize,
    scales: [RowScales<'_>; M],
) -> [f32; M] {
    let runs = codes.iter().map(|r| r.len()).min().unwrap_or(0) / 16;
    let groups = scales.iter().map(|s| s.len()).min().unwrap_or(0);
    let pairs_a_group = group / PAIR;
    let pairs = runs.div_ceil(2);
    let biased = lut.map(|v| v ^ i8::MIN);
    // SAFETY: `biased` and `PAIR_ORDER` are 16 bytes
    let (table, order) = unsafe {
        (
            _mm256_broadcastsi128_si256(_mm_loadu_si128(biased.as_ptr().cast())),
            _mm256_broadcastsi128_si256(_mm_loadu_si128(PAIR_ORDER.as_ptr().cast())),
        )
    };
    let low = _mm256_set1_epi8(0x0f);
    let zero = _mm256_setzero_si256();
    let next = following(&codes);
    let mut f = [_mm256_setzero_ps(); M];
    let (mut l, mut h) = ([zero; M], [zero; M]);
    // the group being summed and its pairs so far (counted, not divided: a division a
    // step measured as a quarter of the kernel's time)
    let (mut g, mut in_group) = (0, 0);
    for pair in 0..pairs {
        let whole = 2 * pair + 2 <= runs;
        for k in 0..(32 * M).div_ceil(64) {
            _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(32 * M * pair + 64 * k));
        }
        let at = CHUNK * (pair / 2) + 32 * (pair % 2);
        // SAFETY: bytes `at .. at + 96 + 32` lie in the pair's chunk, which `sx` covers
        let (xl_lo, xl_hi, xh_lo, xh_hi) = unsafe {
            let (pl, ph) = (sx.xl.as_ptr().add(at), sx.xh.as_ptr().add(at));
            (
                _mm256_loadu_si256(pl.cast()),
                _mm256_loadu_si256(pl.add(64).cast()),
                _mm256_loadu_si256(ph.cast()),
                _mm256_loadu_si256(ph.add(64).cast()),
            )
        };
        for ((lm, hm), r) in l.iter_mut().zip(h.iter_mut()).zip(&codes) {
            // SAFETY: both runs (32 bytes from 32 * pair) are in the row when `whole`,
            // else the one left (16 bytes); the missing run is zeros and meets zeros
            // in `x`
            let c = unsafe {
                let p = r.as_ptr().add(32 * pair);
                if whole {
                    _mm256_loadu_si256(p.cast())
                } else {
                    _mm256_zextsi128_si256(_mm_loadu_si128(p.cast()))
                }
            };
            // quarters 0, 2, 1, 3: run A's first eight bytes beside run B's, then the rest
            let c = _mm256_shuffle_epi8(_mm256_permute4x64_epi64::<0b11_01_10_00>(c), order);
            // each the code's value plus 128, unsigned
            let lo = _mm256_shuffle_epi8(table, _mm256_and_si256(c, low));
            let hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16::<4>(c), low));
            *lm = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(*lm, lo, xl_lo), hi, xl_hi);
            *hm = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(*hm, lo, xh_lo), hi, xh_hi);
        }
        in_group += 1;
        if in_group == pairs_a_group || pair + 1 == pairs {
            if g < groups {
                // SAFETY: group g is one the row reaches, which `sx` covers (caller)
                let cg = unsafe { _mm256_loadu_si256(sx.corr.as_ptr().add(8 * g).cast()) };
                for (((fm, lm), hm), s) in f.iter_mut().zip(&l).zip(&h).zip(&scales) {
                    let sums = _mm256_add_epi32(*lm, _mm256_slli_epi32::<8>(*hm));
                    flush(
                        std::array::from_mut(fm),
                        [_mm256_sub_epi32(sums, cg)],
                        s.get(g),
                    );
                }
            }
            (l, h) = ([zero; M], [zero; M]);
            (g, in_group) = (g + 1, 0);
        }
    }
    f.map(|v| hsum(v))
}
