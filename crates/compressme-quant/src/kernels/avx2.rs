//! The kernels with AVX2, FMA and F16C intrinsics.
//!
//! Every `unsafe` here is one of two things: calling a `#[target_feature]` function, which
//! a [`Token`] makes sound (it exists only after the CPU was seen to have the features),
//! or an unaligned load or store, each inside a range the safe wrapper checked first.
#![allow(unsafe_code)]

use std::arch::x86_64::{
    __m128i, __m256, __m256i, _mm_add_ps, _mm_and_si128, _mm_cvtss_f32, _mm_hadd_ps,
    _mm_loadu_si128, _mm_set1_epi8, _mm_shuffle_epi8, _mm_srli_epi16, _mm_storeu_si128,
    _mm256_add_epi32, _mm256_add_ps, _mm256_castps256_ps128, _mm256_castsi256_ps,
    _mm256_cvtepi8_epi16, _mm256_cvtepi32_ps, _mm256_cvtepu16_epi32, _mm256_cvtph_ps,
    _mm256_extractf128_ps, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_loadu_si256, _mm256_madd_epi16,
    _mm256_mul_ps, _mm256_set1_ps, _mm256_setzero_ps, _mm256_setzero_si256, _mm256_slli_epi32,
    _mm256_storeu_ps,
};

use super::{RowScales, RowsView, STEP, portable};
use std::arch::x86_64::{_MM_HINT_T0, _MM_HINT_T1, _mm_prefetch};

/// `$imp::<.., G>(..)` with `G` the steps of 16 a group for the common group sizes (a
/// fixed trip count, so the inner loop unrolls) and 0 (counted at run time) otherwise.
macro_rules! by_group {
    ($group:expr, $imp:ident :: < $($g:tt),* > ( $($a:expr),* )) => {
        match $group {
            32 => $imp::<$($g,)* 2>($($a),*),
            64 => $imp::<$($g,)* 4>($($a),*),
            128 => $imp::<$($g,)* 8>($($a),*),
            _ => $imp::<$($g,)* 0>($($a),*),
        }
    };
}

/// The body of a `dot_groups` kernel over `$step`, an unsafe function that adds the
/// products of 16 weights from column `c` to each `x` row's eight `i32` lanes: the AVX2
/// tier's step (`vpmaddwd` and an add) and the AVX-VNNI tier's (`vpdpwssd`) expand the
/// same loop, so both flush the same sums in the same order. Unsafe as `$step` is; in a
/// function generic over `N` (the `x` rows); `$g` steps a group when it is not 0.
macro_rules! dot_groups_loop {
    ($step:ident, $w:expr, $xs:expr, $group:expr, $scales:expr, $g:expr) => {{
        let (w, xs, group, scales): (&[i8], [&[i16]; N], usize, &[f32]) =
            ($w, $xs, $group, $scales);
        let kp = w.len();
        let mut f = [_mm256_setzero_ps(); N];
        let mut start = 0;
        for &s in scales {
            if start >= kp {
                break;
            }
            let end = (start + group).min(kp);
            let mut acc = [_mm256_setzero_si256(); N];
            // c + 16 <= end <= kp <= every length (all multiples of 16, caller)
            if $g > 0 && end - start == $g * STEP {
                for k in 0..$g {
                    $step(w, &xs, start + k * STEP, &mut acc);
                }
            } else {
                let mut c = start;
                while c < end {
                    $step(w, &xs, c, &mut acc);
                    c += STEP;
                }
            }
            flush(&mut f, acc, s);
            start = end;
        }
        f.map(|v| hsum(v))
    }};
}

/// Proof that the CPU has AVX2, FMA and F16C.
#[derive(Debug, Clone, Copy)]
pub(super) struct Token(());

impl Token {
    pub(super) fn detect() -> Option<Self> {
        let ok = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        ok.then_some(Self(()))
    }
}

#[target_feature(enable = "avx2,fma")]
pub(super) fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_hadd_ps(s, s);
    _mm_cvtss_f32(_mm_hadd_ps(s, s))
}

/// A group's `i32` sums, scaled, into the f32 accumulators.
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(super) fn flush<const N: usize>(f: &mut [__m256; N], acc: [__m256i; N], scale: f32) {
    let sv = _mm256_set1_ps(scale);
    for (fi, a) in f.iter_mut().zip(acc) {
        *fi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), sv, *fi);
    }
}

/// Whether decoded codes `w` and rows `xs` fit the `dot_groups` kernels' 16-wide steps
/// (this tier's and the AVX-VNNI tier's).
pub(super) fn groups_fit<const N: usize>(w: &[i8], xs: &[&[i16]; N], group: usize) -> bool {
    group > 0
        && group.is_multiple_of(STEP)
        && w.len().is_multiple_of(STEP)
        && xs.iter().all(|x| x.len() >= w.len())
}

pub(super) fn dot_groups<const N: usize>(
    t: Token,
    w: &[i8],
    xs: [&[i16]; N],
    group: usize,
    scales: &[f32],
) -> [f32; N] {
    if !groups_fit(w, &xs, group) {
        return portable::dot_groups(w, xs, group, scales);
    }
    let _ = t;
    // SAFETY: the token proves AVX2 and FMA; `groups_fit` checked the lengths the loads rely on.
    // Common group sizes get a fixed trip count, so their inner loop unrolls.
    unsafe { by_group!(group, dot_groups_imp::<N>(w, xs, group, scales)) }
}

/// One step of 16 weights for every `x` row.
///
/// # Safety
/// AVX2 present; `c + 16 <= w.len()` and `c + 16 <= xs[i].len()`.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn step<const N: usize>(w: &[i8], xs: &[&[i16]; N], c: usize, acc: &mut [__m256i; N]) {
    // SAFETY: 16 bytes of `w` from c are in range (caller)
    let wv = _mm256_cvtepi8_epi16(unsafe { _mm_loadu_si128(w.as_ptr().add(c).cast()) });
    for (a, x) in acc.iter_mut().zip(xs) {
        // SAFETY: 16 i16 of `x` from c are in range (caller)
        let xv = unsafe { _mm256_loadu_si256(x.as_ptr().add(c).cast::<__m256i>()) };
        *a = _mm256_add_epi32(*a, _mm256_madd_epi16(wv, xv));
    }
}

/// `G` steps a group when it is not 0 (then `group == 16 * G`).
///
/// # Safety
/// AVX2 and FMA present; `w.len()` and `group` multiples of 16; every `xs[i]` at least
/// `w.len()` long.
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_groups_imp<const N: usize, const G: usize>(
    w: &[i8],
    xs: [&[i16]; N],
    group: usize,
    scales: &[f32],
) -> [f32; N] {
    // SAFETY: the caller's guarantees, which are `step`'s
    unsafe { dot_groups_loop!(step, w, xs, group, scales, G) }
}

pub(super) fn dot_nibbles<const N: usize>(
    t: Token,
    codes: &[u8],
    lut: &[i8; 16],
    xs: [&[i16]; N],
    group: usize,
    scales: &[f32],
) -> [f32; N] {
    let kp = 2 * codes.len();
    let fits = group > 0
        && group.is_multiple_of(32)
        && codes.len().is_multiple_of(16)
        && xs.iter().all(|x| x.len() >= kp);
    if !fits {
        return portable::dot_nibbles(codes, lut, xs, group, scales);
    }
    let _ = t;
    // SAFETY: the token proves AVX2 and FMA; `fits` checked the lengths the loads rely on.
    unsafe {
        match group {
            // measured: a fixed count helps one run a group, not two or four
            32 => dot_nibbles_imp::<N, 1>(codes, lut, xs, group, scales),
            _ => dot_nibbles_imp::<N, 0>(codes, lut, xs, group, scales),
        }
    }
}

/// One run of 16 code bytes (32 weights) for every `x` row.
///
/// # Safety
/// AVX2 present; `16 * run + 16 <= codes.len()` and `32 * run + 32 <= xs[i].len()`.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn run<const N: usize>(
    codes: &[u8],
    table: __m128i,
    xs: &[&[i16]; N],
    run: usize,
    acc: &mut [__m256i; N],
) {
    // SAFETY: 16 bytes from 16 * run are in range (caller)
    let b = unsafe { _mm_loadu_si128(codes.as_ptr().add(16 * run).cast()) };
    let low = _mm_set1_epi8(0x0f);
    let lo = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(b, low)));
    let hi = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(
        table,
        _mm_and_si128(_mm_srli_epi16::<4>(b), low),
    ));
    for (a, x) in acc.iter_mut().zip(xs) {
        // SAFETY: 32 i16 from 32 * run are in range (caller)
        let (x0, x1) = unsafe {
            let p = x.as_ptr().add(32 * run);
            (
                _mm256_loadu_si256(p.cast::<__m256i>()),
                _mm256_loadu_si256(p.add(16).cast::<__m256i>()),
            )
        };
        *a = _mm256_add_epi32(
            *a,
            _mm256_add_epi32(_mm256_madd_epi16(lo, x0), _mm256_madd_epi16(hi, x1)),
        );
    }
}

/// `R` runs a group when it is not 0 (then `group == 32 * R`).
///
/// # Safety
/// AVX2 and FMA present; `codes.len()` a multiple of 16, `group` of 32; every `xs[i]` at
/// least `2 * codes.len()` long.
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_nibbles_imp<const N: usize, const R: usize>(
    codes: &[u8],
    lut: &[i8; 16],
    xs: [&[i16]; N],
    group: usize,
    scales: &[f32],
) -> [f32; N] {
    let runs = codes.len() / 16;
    let per_group = group / 32;
    // SAFETY: `lut` is 16 bytes
    let table = unsafe { _mm_loadu_si128(lut.as_ptr().cast()) };
    let mut f = [_mm256_setzero_ps(); N];
    let mut start = 0;
    for &s in scales {
        if start >= runs {
            break;
        }
        let end = (start + per_group).min(runs);
        let mut acc = [_mm256_setzero_si256(); N];
        if R > 0 && end - start == R {
            for k in 0..R {
                // SAFETY: start + k < end <= runs: in range of `codes` and every `x`
                unsafe { run(codes, table, &xs, start + k, &mut acc) };
            }
        } else {
            for k in start..end {
                // SAFETY: k < runs: in range of `codes` and every `x`
                unsafe { run(codes, table, &xs, k, &mut acc) };
            }
        }
        flush(&mut f, acc, s);
        start = end;
    }
    f.map(|v| hsum(v))
}

/// Rows `first..first + out.len()` of an integer matrix against one `x` row (the raw
/// dots: scales applied, the minimums and `x`'s step not), four rows a call to the inner
/// loop, which loads `x` once for all four. Each row's sums, flushes and final horizontal
/// sum are done in the same order as [`dot_groups`] and [`dot_nibbles`] with one `x` row,
/// so the results are the same bits. The loop over the rows runs inside the AVX2 code,
/// so the per-row bookkeeping is inlined with it.
pub(super) fn dot_rows(t: Token, v: &RowsView<'_>, first: usize, x: &[i16], out: &mut [f32]) {
    let (rb, group) = (v.row_bytes, v.group);
    let weights = if v.lut.is_some() { 2 * rb } else { rb };
    let unit = if v.lut.is_some() { 32 } else { STEP };
    let fits = group > 0
        && group.is_multiple_of(unit)
        && x.len() >= weights
        && v.whole_rows(first, out.len());
    if !fits {
        return portable::dot_rows(v, first, x, out);
    }
    let _ = t;
    // SAFETY: the token proves AVX2 and FMA; `fits` checked that every row asked for is
    // `rb` bytes of codes (a multiple of 16) and that `x` covers a row's weights.
    unsafe {
        match (v.lut, group) {
            (Some(_), 32) => dot_rows_imp::<1, 0>(v, first, x, out),
            (Some(_), 64) => dot_rows_imp::<2, 0>(v, first, x, out),
            (Some(_), _) => dot_rows_imp::<0, 0>(v, first, x, out),
            (None, 32) => dot_rows_imp::<0, 2>(v, first, x, out),
            (None, 64) => dot_rows_imp::<0, 4>(v, first, x, out),
            (None, 128) => dot_rows_imp::<0, 8>(v, first, x, out),
            (None, _) => dot_rows_imp::<0, 0>(v, first, x, out),
        }
    }
}

/// [`dot_rows`] with the trip counts fixed: `R` runs a group for 4-bit codes, `G` steps a
/// group for 8-bit ones (0: counted at run time).
///
/// # Safety
/// AVX2 and FMA present; every row from `first` to `first + out.len()` is a whole
/// `v.row_bytes` of codes, a multiple of 16; `x` covers a row's weights (twice the
/// code bytes for 4-bit codes).
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_rows_imp<const R: usize, const G: usize>(
    v: &RowsView<'_>,
    first: usize,
    x: &[i16],
    out: &mut [f32],
) {
    let group = v.group;
    for (i, quad) in out.chunks_mut(4).enumerate() {
        let r = first + 4 * i;
        if let Ok(quad) = <&mut [f32; 4]>::try_from(&mut *quad) {
            let codes = [
                v.codes_of(r),
                v.codes_of(r + 1),
                v.codes_of(r + 2),
                v.codes_of(r + 3),
            ];
            let scales = [
                v.scales_of(r),
                v.scales_of(r + 1),
                v.scales_of(r + 2),
                v.scales_of(r + 3),
            ];
            // SAFETY: the caller's guarantees, passed on
            *quad = unsafe {
                match v.lut {
                    Some(lut) => dot_nibbles_rows_imp::<4, R>(codes, lut, x, group, scales),
                    None => dot_groups_rows_imp::<4, G>(codes, x, group, scales),
                }
            };
        } else {
            for (k, o) in quad.iter_mut().enumerate() {
                let (codes, scales) = ([v.codes_of(r + k)], [v.scales_of(r + k)]);
                // SAFETY: the caller's guarantees, passed on
                [*o] = unsafe {
                    match v.lut {
                        Some(lut) => dot_nibbles_rows_imp::<1, R>(codes, lut, x, group, scales),
                        None => dot_groups_rows_imp::<1, G>(codes, x, group, scales),
                    }
                };
            }
        }
    }
}

/// One step of 16 weights of every row against `x`.
///
/// # Safety
/// AVX2 present; `c + 16 <= w[m].len()` for every row and `c + 16 <= x.len()`.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn step_rows<const M: usize>(w: &[&[u8]; M], x: &[i16], c: usize, acc: &mut [__m256i; M]) {
    // SAFETY: 16 i16 of `x` from c are in range (caller)
    let xv = unsafe { _mm256_loadu_si256(x.as_ptr().add(c).cast::<__m256i>()) };
    for (a, r) in acc.iter_mut().zip(w) {
        // SAFETY: 16 bytes of the row from c are in range (caller)
        let wv = _mm256_cvtepi8_epi16(unsafe { _mm_loadu_si128(r.as_ptr().add(c).cast()) });
        *a = _mm256_add_epi32(*a, _mm256_madd_epi16(wv, xv));
    }
}

/// `G` steps a group when it is not 0 (then `group == 16 * G`).
///
/// # Safety
/// AVX2 and FMA present; the shortest row's length a multiple of 16, `group` a multiple
/// of 16; `x` at least that long.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn dot_groups_rows_imp<const M: usize, const G: usize>(
    w: [&[u8]; M],
    x: &[i16],
    group: usize,
    scales: [RowScales<'_>; M],
) -> [f32; M] {
    let kp = w.iter().map(|r| r.len()).min().unwrap_or(0);
    let groups = scales.iter().map(|s| s.len()).min().unwrap_or(0);
    // the following rows, prefetched only while the call's rows are short (`NEAR_AHEAD`)
    let ahead = (M * kp <= NEAR_AHEAD).then(|| following(&w));
    // long rows: the start of each next row, and each row's own bytes `FAR_AHEAD` on
    let far = long_rows(&w, kp);
    let mut f = [_mm256_setzero_ps(); M];
    let mut start = 0;
    for g in 0..groups {
        if start >= kp {
            break;
        }
        let end = (start + group).min(kp);
        let mut acc = [_mm256_setzero_si256(); M];
        if G > 0 && end - start == G * STEP {
            for k in 0..G {
                let c = start + k * STEP;
                // the same share of the rows that follow, a cache line a step
                if let Some(ahead) = ahead {
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(4 * c));
                }
                if far {
                    far_ahead(&w, c);
                }
                // SAFETY: c + 16 <= end <= kp, every row's and x's length
                unsafe { step_rows(&w, x, c, &mut acc) };
            }
        } else {
            let mut c = start;
            while c < end {
                if let Some(ahead) = ahead {
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(4 * c));
                }
                if far {
                    far_ahead(&w, c);
                }
                // SAFETY: c + 16 <= end <= kp (all multiples of 16)
                unsafe { step_rows(&w, x, c, &mut acc) };
                c += STEP;
            }
        }
        flush_rows(&mut f, acc, &scales, g);
        start = end;
    }
    f.map(|v| hsum(v))
}

/// Where the bytes after the last of `rows` start: the next rows of the same matrix, which
/// the multi-row kernels prefetch (one cache line for each 64 bytes they read), so the
/// memory stream runs ahead of the arithmetic. A prefetch is only a hint: it never faults,
/// so the address may lie past the end of the matrix.
pub(super) fn following<const M: usize>(rows: &[&[u8]; M]) -> *const i8 {
    rows.last().map_or(std::ptr::null(), |r| {
        r.as_ptr().wrapping_add(r.len()).cast::<i8>()
    })
}

/// The most bytes of following rows the 8-bit kernels prefetch ahead of the rows they
/// read (the rows' own bytes, `M` rows of the shortest length): above it the hint fills L1
/// with lines not needed for a while, and the hardware's stream prefetch, which ramps up on
/// long rows, does the work. 4096 x 8192 INT8 per row from memory, one thread on AMD Zen 4:
/// 4.3-4.5 ms prefetching the next four rows (32 KB ahead, all of L1), 3.5-3.6 without;
/// on short rows the hint is what keeps the stream going (49152 x 576, from L3: 1.5 ms with
/// it, 3.3-4.0 without).
pub(super) const NEAR_AHEAD: usize = 8 << 10;

/// How far ahead in its own row an 8-bit or F16/BF16 rows kernel prefetches a row too long
/// for [`NEAR_AHEAD`] (into L2, a cache line for each 64 bytes read), besides the start of
/// each next row ([`long_rows`]). The hardware's stream prefetch stops at the end of
/// a 4 KiB page and starts again only after misses in the next one; a row of 4,096 or more
/// 8-bit codes is a page or more, four rows a call four streams. INT8 per row, batch 1, one
/// thread on AMD Zen 4, best of 60, AVX2 code without and with these hints: 4096 x 11008
/// from memory 2.35-2.37 ms against 1.55-1.58, 11008 x 4096 2.25-2.29 against 1.91-1.92,
/// 4096 x 16384 3.12-3.16 against 2.21-2.22, 4096 x 4096 from L3 0.41 against 0.39-0.41.
/// F16 at batch 1, four rows a call (`half_quads`), 4096 x 4096 (33.5 MB, from memory):
/// 2.0-2.3 ms without, 1.2-1.4 with; at batch 2 on the AVX2 tier 3.2 against 1.9.
/// (The AVX-512 split kernel at 4096 x 16384: 2.24 ms at 3 KiB, 2.31-2.33 at 1.5, 2 and
/// 4 KiB.)
pub(super) const FAR_AHEAD: usize = 3 << 10;

/// Prefetches `bytes` into L2, a line at a time: only a hint, which never faults.
pub(super) fn prefetch_l2(bytes: &[u8]) {
    for line in bytes.chunks(64) {
        // SAFETY: SSE, which `prefetcht1` needs, is part of x86_64's baseline; a prefetch
        // reads nothing the program sees and never faults
        unsafe { _mm_prefetch::<_MM_HINT_T1>(line.as_ptr().cast()) };
    }
}

/// Whether a row of `row_bytes` is long for the kernels that read four rows a call: the
/// four together past [`NEAR_AHEAD`].
pub(super) const fn long_row(row_bytes: usize) -> bool {
    4 * row_bytes > NEAR_AHEAD
}

/// Whether `rows`, `bytes` read from each, are past [`NEAR_AHEAD`] together, and if so
/// prefetches the first two cache lines of each of the `M` rows after them (into L1), so a
/// long row's first page does not wait for the hardware's stream to start: the kernel then
/// calls [`far_ahead`] as it reads.
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(super) fn long_rows<const M: usize>(rows: &[&[u8]; M], bytes: usize) -> bool {
    let long = M * bytes > NEAR_AHEAD;
    if long {
        let next = following(rows);
        let len = rows.iter().map(|r| r.len()).min().unwrap_or(0);
        for k in 0..M {
            _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(len * k));
            _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(len * k + 64));
        }
    }
    long
}

/// The [`FAR_AHEAD`] hint for the bytes of each row read from `at`: byte `at + FAR_AHEAD`
/// of each row into L2, once a 64 bytes (only where `at` is a multiple of 64). A prefetch
/// never faults, so the address may lie past a row's end.
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(super) fn far_ahead<const M: usize>(rows: &[&[u8]; M], at: usize) {
    if at.is_multiple_of(64) {
        for r in rows {
            _mm_prefetch::<_MM_HINT_T1>(r.as_ptr().wrapping_add(at + FAR_AHEAD).cast());
        }
    }
}

/// Row `m`'s group sums, scaled by its own scale of group `g`, into its f32 accumulator: the
/// same operations as [`flush`] does for one row.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn flush_rows<const M: usize>(
    f: &mut [__m256; M],
    acc: [__m256i; M],
    scales: &[RowScales<'_>; M],
    g: usize,
) {
    for ((fi, a), s) in f.iter_mut().zip(acc).zip(scales) {
        let sv = _mm256_set1_ps(s.get(g));
        *fi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), sv, *fi);
    }
}

/// One run of 16 code bytes (32 weights) of every row against `x`.
///
/// # Safety
/// AVX2 present; `16 * run + 16 <= codes[m].len()` for every row and
/// `32 * run + 32 <= x.len()`.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn run_rows<const M: usize>(
    codes: &[&[u8]; M],
    table: __m128i,
    x: &[i16],
    run: usize,
    acc: &mut [__m256i; M],
) {
    // SAFETY: 32 i16 from 32 * run are in range (caller)
    let (x0, x1) = unsafe {
        let p = x.as_ptr().add(32 * run);
        (
            _mm256_loadu_si256(p.cast::<__m256i>()),
            _mm256_loadu_si256(p.add(16).cast::<__m256i>()),
        )
    };
    let low = _mm_set1_epi8(0x0f);
    for (a, r) in acc.iter_mut().zip(codes) {
        // SAFETY: 16 bytes from 16 * run are in range (caller)
        let b = unsafe { _mm_loadu_si128(r.as_ptr().add(16 * run).cast()) };
        let lo = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(b, low)));
        let hi = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(
            table,
            _mm_and_si128(_mm_srli_epi16::<4>(b), low),
        ));
        *a = _mm256_add_epi32(
            *a,
            _mm256_add_epi32(_mm256_madd_epi16(lo, x0), _mm256_madd_epi16(hi, x1)),
        );
    }
}

/// `R` runs a group when it is not 0 (then `group == 32 * R`).
///
/// # Safety
/// AVX2 and FMA present; `group` a multiple of 32; `x` at least twice as long as the
/// shortest row rounded down to 16 bytes.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn dot_nibbles_rows_imp<const M: usize, const R: usize>(
    codes: [&[u8]; M],
    lut: &[i8; 16],
    x: &[i16],
    group: usize,
    scales: [RowScales<'_>; M],
) -> [f32; M] {
    let runs = codes.iter().map(|r| r.len()).min().unwrap_or(0) / 16;
    let per_group = group / 32;
    let groups = scales.iter().map(|s| s.len()).min().unwrap_or(0);
    // SAFETY: `lut` is 16 bytes
    let table = unsafe { _mm_loadu_si128(lut.as_ptr().cast()) };
    let mut f = [_mm256_setzero_ps(); M];
    let mut start = 0;
    let ahead = following(&codes);
    for g in 0..groups {
        if start >= runs {
            break;
        }
        let end = (start + per_group).min(runs);
        let mut acc = [_mm256_setzero_si256(); M];
        if R > 0 && end - start == R {
            for k in 0..R {
                // the same share of the rows that follow, a cache line a run
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * (start + k)));
                // SAFETY: start + k < end <= runs: in range of every row and of `x`
                unsafe { run_rows(&codes, table, x, start + k, &mut acc) };
            }
        } else {
            for k in start..end {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * k));
                // SAFETY: k < runs: in range of every row and of `x`
                unsafe { run_rows(&codes, table, x, k, &mut acc) };
            }
        }
        flush_rows(&mut f, acc, &scales, g);
        start = end;
    }
    f.map(|v| hsum(v))
}

/// `Σ a_j b_j` in f32.
pub(super) fn dot_f32(t: Token, a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let body = n / 8 * 8;
    let _ = t;
    // SAFETY: the token proves AVX2 and FMA; the loop reads `body <= n` values of each.
    let head = unsafe { dot_f32_imp(a, b, body) };
    head + portable::dot_f32(a.get(body..n).unwrap_or(&[]), b.get(body..n).unwrap_or(&[]))
}

/// `out[b] + dot_f32(a, column b of xt)` into `out[b]` for every `b < out.len()`, bit for
/// bit what [`dot_f32`] gives a column at a time, eight columns a step: `xt` is `a.len()`
/// rows of `stride` values (a row a term of the dot). The same arithmetic in the same
/// order, lane by lane: eight `fma` chains, the same tree of additions as [`hsum`], then
/// the portable tail.
pub(super) fn add_dot_f32_columns(t: Token, a: &[f32], xt: &[f32], stride: usize, out: &mut [f32]) {
    let n = a.len();
    let fits = stride.is_multiple_of(8)
        && stride >= out.len()
        && n.checked_mul(stride).is_some_and(|len| len <= xt.len());
    if !fits {
        let mut col = vec![0f32; n];
        for (b, o) in out.iter_mut().enumerate() {
            for (j, c) in col.iter_mut().enumerate() {
                *c = xt.get(j * stride + b).copied().unwrap_or(0.0);
            }
            *o += dot_f32(t, a, &col);
        }
        return;
    }
    // SAFETY: the token proves AVX2 and FMA; every load reads 8 values of a row of `xt`
    // from column `8c <= out.len() - 1 < stride`, a multiple of 8: inside the row
    unsafe { add_dot_f32_columns_imp(a, xt, stride, out) };
}

/// The constants of [`portable::dot_f32`]'s tail, which the column dots take lane by lane:
/// it sums its products from the neutral element of `f32`'s `Sum` (the first), and adds
/// that sum to the sum of its eight accumulators, zeros for a tail (the second).
pub(super) fn tail_constants() -> (f32, f32) {
    (std::iter::empty::<f32>().sum(), [0f32; 8].iter().sum())
}

/// # Safety
/// AVX2 and FMA present; `stride` a multiple of 8 and at least `out.len()`; `xt` at least
/// `a.len() · stride` long.
#[target_feature(enable = "avx2,fma")]
unsafe fn add_dot_f32_columns_imp(a: &[f32], xt: &[f32], stride: usize, out: &mut [f32]) {
    let n = a.len();
    let body = n / 8 * 8;
    let (neutral, zeros) = tail_constants();
    let (neutral, zeros) = (_mm256_set1_ps(neutral), _mm256_set1_ps(zeros));
    let mut c0 = 0;
    while c0 < out.len() {
        let mut p = [_mm256_setzero_ps(); 8];
        let mut j = 0;
        while j < body {
            // (a plain loop: iterators here are not inlined into the caller's features)
            #[allow(clippy::needless_range_loop)]
            for l in 0..8 {
                // SAFETY: j + l < body <= n: row j + l of `xt` holds columns c0..c0 + 8
                // (caller)
                let x = unsafe { _mm256_loadu_ps(xt.as_ptr().add((j + l) * stride + c0)) };
                p[l] = _mm256_fmadd_ps(_mm256_set1_ps(a[j + l]), x, p[l]);
            }
            j += 8;
        }
        // hsum's tree: lanes i and i + 4, then pairs, then the two halves
        let s0 = _mm256_add_ps(p[0], p[4]);
        let s1 = _mm256_add_ps(p[1], p[5]);
        let s2 = _mm256_add_ps(p[2], p[6]);
        let s3 = _mm256_add_ps(p[3], p[7]);
        let h = _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3));
        // the portable tail, lane by lane: the products (not fused) summed in order
        let mut t = neutral;
        let mut i = body;
        while i < n {
            // SAFETY: i < n: row i of `xt` holds columns c0..c0 + 8 (caller)
            let x = unsafe { _mm256_loadu_ps(xt.as_ptr().add(i * stride + c0)) };
            t = _mm256_add_ps(t, _mm256_mul_ps(_mm256_set1_ps(a[i]), x));
            i += 1;
        }
        // out[c] += head[c] + tail[c]
        let add = _mm256_add_ps(h, _mm256_add_ps(zeros, t));
        let cols = (out.len() - c0).min(8);
        if cols == 8 {
            // SAFETY: c0 + 8 <= out.len()
            unsafe {
                let o = out.as_mut_ptr().add(c0);
                _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), add));
            }
        } else {
            let mut v = [0f32; 8];
            // SAFETY: 8 f32
            unsafe { _mm256_storeu_ps(v.as_mut_ptr(), add) };
            for (o, &v) in out.iter_mut().skip(c0).zip(&v[..cols]) {
                *o += v;
            }
        }
        c0 += 8;
    }
}

/// # Safety
/// AVX2 and FMA present; `body` a multiple of 8, at most both lengths.
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_f32_imp(a: &[f32], b: &[f32], body: usize) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let mut j = 0;
    while j < body {
        // SAFETY: j + 8 <= body <= both lengths
        let (x, y) = unsafe {
            (
                _mm256_loadu_ps(a.as_ptr().add(j)),
                _mm256_loadu_ps(b.as_ptr().add(j)),
            )
        };
        acc = _mm256_fmadd_ps(x, y, acc);
        j += 8;
    }
    hsum(acc)
}

pub(super) fn decode_nibbles(t: Token, codes: &[u8], lut: &[i8; 16], out: &mut [i8]) {
    // whole 16-byte chunks whose 32 outputs fit; the rest the portable way
    let chunks = codes.len().min(out.len() / 2) / 16;
    let _ = t;
    // SAFETY: the token proves AVX2 (SSSE3 included); the loop stays within `chunks`
    // whole chunks of both slices.
    unsafe { decode_nibbles_imp(codes, lut, out, chunks) };
    let done = chunks * 16;
    if let (Some(c), Some(o)) = (codes.get(done..), out.get_mut(2 * done..)) {
        portable::decode_nibbles(c, lut, o);
    }
}

/// # Safety
/// AVX2 present; `codes.len() >= 16 * chunks` and `out.len() >= 32 * chunks`.
#[target_feature(enable = "avx2")]
unsafe fn decode_nibbles_imp(codes: &[u8], lut: &[i8; 16], out: &mut [i8], chunks: usize) {
    // SAFETY: `lut` is 16 bytes
    let table = unsafe { _mm_loadu_si128(lut.as_ptr().cast()) };
    for i in 0..chunks {
        // SAFETY: i < chunks: bytes 16i..16i+16 of `codes` are in range
        let b = unsafe { _mm_loadu_si128(codes.as_ptr().add(16 * i).cast()) };
        let (first, second) = lookup_nibbles(table, b);
        // SAFETY: i < chunks: outputs 32i..32i+32 are in range
        unsafe {
            _mm_storeu_si128(out.as_mut_ptr().add(32 * i).cast(), first);
            _mm_storeu_si128(out.as_mut_ptr().add(32 * i + 16).cast(), second);
        }
    }
}

/// `table`'s bytes for the low nibbles of 16 code bytes, then for their high nibbles (the
/// nibble order: a chunk's first 16 codes sit in the low nibbles).
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn lookup_nibbles(table: __m128i, b: __m128i) -> (__m128i, __m128i) {
    let low = _mm_set1_epi8(0x0f);
    (
        _mm_shuffle_epi8(table, _mm_and_si128(b, low)),
        _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16::<4>(b), low)),
    )
}

pub(super) fn dot_half<const N: usize>(
    t: Token,
    codes: &[u8],
    bf16: bool,
    xs: [&[f32]; N],
) -> [f32; N] {
    let cols = codes.len() / 2;
    if !xs.iter().all(|x| x.len() >= cols) {
        return portable::dot_half(codes, bf16, xs);
    }
    let body = cols / 8 * 8;
    let _ = t;
    // SAFETY: the token proves AVX2, FMA and F16C; the loop reads `body <= cols` values
    // of each `x` and `2 * body` bytes of `codes`.
    let mut out = unsafe { dot_half_imp(codes, bf16, xs, body) };
    if let Some(rest) = codes.get(2 * body..) {
        let tails = xs.map(|x| x.get(body..).unwrap_or(&[]));
        for (o, v) in out.iter_mut().zip(portable::dot_half(rest, bf16, tails)) {
            *o += v;
        }
    }
    out
}

/// [`dot_half`] for `R` weight rows at once, without the tail: `[row][x row]`, each the
/// head sum over the first `body` columns (a multiple of 8) that [`dot_half`] adds its tail
/// to, the same bits (each pair's eight lanes run the same `fma`s in the same order, then
/// [`hsum`]); each `x` vector loaded once for the `R` rows. `None` when a slice is too
/// short.
pub(super) fn dot_half_rows<const R: usize, const N: usize>(
    t: Token,
    codes: [&[u8]; R],
    bf16: bool,
    xs: [&[f32]; N],
    body: usize,
) -> Option<[[f32; N]; R]> {
    let fits = body.is_multiple_of(8)
        && codes.iter().all(|c| c.len() >= 2 * body)
        && xs.iter().all(|x| x.len() >= body);
    if !fits {
        return None;
    }
    let _ = t;
    // SAFETY: the token proves AVX2, FMA and F16C; `fits` checked the lengths the loads
    // rely on
    Some(unsafe { dot_half_rows_imp(codes, bf16, xs, body) })
}

/// # Safety
/// AVX2, FMA and F16C present; `body` a multiple of 8 with every `codes[r].len() >= 2 *
/// body` and every `xs[i].len() >= body`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_half_rows_imp<const R: usize, const N: usize>(
    codes: [&[u8]; R],
    bf16: bool,
    xs: [&[f32]; N],
    body: usize,
) -> [[f32; N]; R] {
    let mut acc = [[_mm256_setzero_ps(); N]; R];
    // long rows: the 8-bit kernels' hints (short ones are left to the hardware's stream)
    let far = long_rows(&codes, 2 * body);
    let mut j = 0;
    while j < body {
        if far {
            far_ahead(&codes, 2 * j);
        }
        let mut wv = [_mm256_setzero_ps(); R];
        for (w, c) in wv.iter_mut().zip(&codes) {
            // SAFETY: j + 8 <= body: bytes 2j..2j+16 of the row are in range
            let h = unsafe { _mm_loadu_si128(c.as_ptr().add(2 * j).cast()) };
            *w = if bf16 {
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
            } else {
                _mm256_cvtph_ps(h)
            };
        }
        for (k, x) in xs.iter().enumerate() {
            // SAFETY: j + 8 <= body <= x.len()
            let xv = unsafe { _mm256_loadu_ps(x.as_ptr().add(j)) };
            for (a, w) in acc.iter_mut().zip(&wv) {
                if let Some(a) = a.get_mut(k) {
                    *a = _mm256_fmadd_ps(*w, xv, *a);
                }
            }
        }
        j += 8;
    }
    acc.map(|row| row.map(|v| hsum(v)))
}

/// # Safety
/// AVX2, FMA and F16C present; `body` a multiple of 8 with `codes.len() >= 2 * body` and
/// every `xs[i].len() >= body`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_half_imp<const N: usize>(
    codes: &[u8],
    bf16: bool,
    xs: [&[f32]; N],
    body: usize,
) -> [f32; N] {
    let mut acc = [_mm256_setzero_ps(); N];
    let mut j = 0;
    while j < body {
        // SAFETY: j + 8 <= body: bytes 2j..2j+16 of `codes` are in range
        let h = unsafe { _mm_loadu_si128(codes.as_ptr().add(2 * j).cast()) };
        let wv = if bf16 {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        } else {
            _mm256_cvtph_ps(h)
        };
        for (a, x) in acc.iter_mut().zip(xs) {
            // SAFETY: j + 8 <= body <= x.len()
            let xv = unsafe { _mm256_loadu_ps(x.as_ptr().add(j)) };
            *a = _mm256_fmadd_ps(wv, xv, *a);
        }
        j += 8;
    }
    acc.map(|v| hsum(v))
}

/// [`super::fixed_row`] compiled for this tier's instructions: the same code, the same bits.
pub(super) fn fixed_row(t: Token, row: &[f32], out: &mut [i16], nibbles: bool) -> f32 {
    let _ = t;
    // SAFETY: the token proves the features
    unsafe { fixed_row_imp(row, out, nibbles) }
}

/// # Safety
/// The features present.
#[target_feature(enable = "avx2,fma")]
unsafe fn fixed_row_imp(row: &[f32], out: &mut [i16], nibbles: bool) -> f32 {
    super::fixed_row_body(row, out, nibbles)
}

vector_copies!("avx2,fma");
