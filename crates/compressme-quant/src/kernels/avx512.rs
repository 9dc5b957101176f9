//! The kernels with AVX-512 (F, BW, VL) and AVX-512 VNNI: the same exact integer sums as
//! the AVX2 tier, in fewer instructions, so every output is the same bits.
//!
//! # Why the bits do not change
//! The AVX2 kernels sum each group's products exactly in eight `i32` lanes, lane `l`
//! holding the products at the positions `p` of `x` with `(p mod 16) / 2 == l` (its
//! *class*); then each lane is converted to f32, scaled, and accumulated, and the eight
//! lanes are summed at the end. These kernels compute the same eight exact class sums by
//! other means and then run the same f32 operations in the same order:
//! - **8-bit codes** (`vpdpwssd`, the F16/BF16 and small-batch paths): codes widened to
//!   `i16` meet the 14-bit activations 32 at a time; lane `m` of the 16 holds the pair at
//!   positions `2m, 2m + 1`, class `m mod 8`, so adding the upper half of the register to
//!   the lower gives the eight class sums. At batch 1 in groups of 64 or more, where the
//!   CPU has AVX-512 VBMI, they run as stored instead (`vpdpbusd`, 64 byte products an
//!   instruction): biased to unsigned bytes and put in a layout with one class a lane by
//!   one `vpermb`, against `x` split into bytes as for the 4-bit codes below.
//! - **4-bit codes** (`vpdpbusd`, 64 byte products an instruction), at batch 1 in groups
//!   of 64 and of whole chunks of 128 (the per-row formats' 1,024 columns included):
//!   codes decode through the table plus 128 to unsigned bytes `u = w + 128`, and each
//!   activation is split as `x = 256 · xh + xl`, so
//!   `Σ w·x = Σ u·xl + 256 · Σ u·xh − 128 · Σ x`, both sums unsigned-by-signed byte
//!   products and `128 · Σ x` per group and class worked out once a product. The codes
//!   of each pair of runs are regrouped in registers so that every 32-bit lane sums one
//!   class, and `x` is laid out to match ([`SplitX`], shared with the AVX-VNNI tier):
//!   each 256-bit half of a sum is a pair's eight class sums with no fold.
//!
//! Every `unsafe` here is one of three things: calling a `#[target_feature]` function,
//! which a [`Token`] makes sound (it exists only after the CPU was seen to have the
//! features); an unaligned load inside a range the safe wrapper checked first; or a
//! masked load, which reads only the lanes its mask selects (the others are not
//! accessed, so they cannot fault), each selected lane inside a checked range.
#![allow(unsafe_code)]

use std::arch::x86_64::{
    __m256, __m256i, __m512, __m512i, _MM_HINT_T0, _mm_loadu_si128, _mm_prefetch, _mm256_add_epi32,
    _mm256_broadcastsi128_si256, _mm256_castpd_ps, _mm256_cvtepi32_ps, _mm256_fmadd_ps,
    _mm256_maskz_loadu_epi8, _mm256_set1_ps, _mm256_setzero_ps, _mm256_sub_epi32, _mm512_add_epi32,
    _mm512_add_ps, _mm512_and_si512, _mm512_broadcast_i32x4, _mm512_castps_pd,
    _mm512_castps512_ps256, _mm512_castsi512_ps, _mm512_castsi512_si256, _mm512_cvtepi8_epi16,
    _mm512_cvtepi32_ps, _mm512_cvtepu16_epi32, _mm512_cvtph_ps, _mm512_dpbusd_epi32,
    _mm512_dpwssd_epi32, _mm512_extractf64x4_pd, _mm512_extracti64x4_epi64, _mm512_fmadd_ps,
    _mm512_loadu_ps, _mm512_loadu_si512, _mm512_mask_storeu_ps, _mm512_maskz_loadu_epi8,
    _mm512_maskz_loadu_epi16, _mm512_maskz_loadu_epi32, _mm512_maskz_loadu_ps, _mm512_mul_ps,
    _mm512_permutexvar_epi8, _mm512_permutexvar_epi64, _mm512_set1_epi8, _mm512_set1_epi32,
    _mm512_set1_ps, _mm512_setr_epi64, _mm512_setzero_ps, _mm512_setzero_si512,
    _mm512_shuffle_epi8, _mm512_slli_epi32, _mm512_srli_epi16, _mm512_storeu_ps, _mm512_sub_epi32,
    _mm512_xor_si512,
};

use super::avx2::{self, following, hsum};
use super::split::{BYTE_ORDER, CHUNK, PAIR, PAIR_ORDER, SplitX};
use super::{RowScales, RowsView};

/// Proof that the CPU has AVX-512 F, BW, VL and VNNI, besides what the AVX2 tier needs;
/// with AMX's proof where the tier runs the AMX tiles ([`super::Tier::Avx512Amx`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct Token(avx2::Token, Option<super::amx::Token>);

impl Token {
    pub(super) fn detect() -> Option<Self> {
        let ok = is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vnni");
        avx2::Token::detect().filter(|_| ok).map(|t| Self(t, None))
    }

    /// This tier with the AMX tiles, where the CPU and the operating system allow them.
    pub(super) fn with_amx(self) -> Option<Self> {
        super::amx::Token::detect().map(|a| Self(self.0, Some(a)))
    }

    /// AMX's proof, where this tier runs the AMX tiles.
    pub(super) fn amx(self) -> Option<super::amx::Token> {
        self.1
    }

    /// The AVX2 tier, which runs whatever this one has no faster path for.
    pub(super) fn avx2(self) -> avx2::Token {
        self.0
    }
}

/// The shortest group [`dot_groups`] takes; shorter ones run the AVX2 code.
const LONG_GROUP: usize = 256;

/// Whether the 4-bit kernel here takes groups of `group`: one pair of runs, or whole
/// chunks (a group's sums never straddle a chunk's two pairs otherwise).
fn nibble_group(group: usize) -> bool {
    group == PAIR || (group > 0 && group.is_multiple_of(CHUNK))
}

/// `Σ_g scales[g] · Σ_{j in g} w_j x_j` for each `x` row, from decoded 8-bit codes.
pub(super) fn dot_groups<const N: usize>(
    t: Token,
    w: &[i8],
    xs: [&[i16]; N],
    group: usize,
    scales: &[f32],
) -> [f32; N] {
    let kp = w.len();
    // measured (4096 x 4096, batch 32): faster than the AVX2 code for long groups (the
    // per-row formats' 1,024 columns), slower for groups of 128 or less, where flushing a
    // group's sums costs as much as the products; the bits are the same either way
    // (On Zen 4, `double_pumped`, the AVX2 code is faster at every length measured: batch
    // 2, one thread, 1536 x 576 0.084 against 0.118 ms, 4096 x 4096 1.11-1.17 against
    // 1.21-1.31; batch 4 0.113 against 0.143 and 2.5-2.6 against 3.1.)
    let fits = group >= LONG_GROUP
        && !double_pumped()
        && group.is_multiple_of(32)
        && kp.is_multiple_of(16)
        && xs.iter().all(|x| x.len() >= kp);
    if !fits {
        return avx2::dot_groups(t.avx2(), w, xs, group, scales);
    }
    // SAFETY: `i8` and `u8` have the same size and alignment, and every bit pattern
    let bytes: &[u8] = unsafe { std::slice::from_raw_parts(w.as_ptr().cast::<u8>(), w.len()) };
    // SAFETY: the token proves the features; `fits` checked the lengths the loads rely on.
    let [out] = unsafe { int8_imp::<1, N>([bytes], xs, group, [RowScales::Groups(scales, 1.0)]) };
    out
}

/// Rows `first..first + out.len()` of an integer matrix against one `x` row, four rows a
/// call, the same bits as the AVX2 tier's `dot_rows`. `split` is `x` split for the 4-bit
/// kernel ([`SplitX::new`] with the matrix's group) or, where the CPU has AVX-512 VBMI, for
/// the 8-bit one ([`SplitX::new_bytes`], groups of 64 and more: the per-row formats'
/// 1,024 columns included); without it, or for a group size this tier has no kernel for,
/// the AVX2 tier runs. (8-bit codes widened and multiplied with `vpdpwssd`, one 5-cycle
/// chain a row where the AVX2 code's add is 1 cycle, measured slower than the AVX2 code,
/// most of all in groups of 32: 4096 x 4096, 1.16 against 0.94 ms; `vpdpbusd` on the
/// codes as stored, in [`byte_rows_imp`], measured 0.254-0.265 against 0.277-0.284 ms on
/// Zen 5.)
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
        (Some(lut), Some(sx)) if rows_fit && sx.covers(rb, group) && nibble_group(group) => {
            in_quads!(v, first, out, |codes, scales| {
                // SAFETY: the token proves the features; every row is `rb` bytes (a
                // multiple of 16) and `sx` covers the chunks and groups of such a row.
                unsafe { nibble_rows_imp(codes, lut, sx, group, scales) }
            });
        }
        (None, Some(sx)) if rows_fit && sx.per_byte == 1 && sx.covers(rb, group) && vbmi() => {
            in_quads!(v, first, out, |codes, scales| {
                // SAFETY: the token proves the features and `vbmi` VBMI; every row is `rb`
                // bytes and `sx` covers the vectors and groups of such a row.
                unsafe { byte_rows_imp(codes, sx, group, scales) }
            });
        }
        // 8-bit codes on Zen 4 (the VBMI split kernel is off there, see `double_pumped`): the
        // AVX2 code.
        // Stop 44 sent them to `int8_imp` four rows a call, 2-3% faster at 4096 x 4096 in
        // cache; on SmolLM2's 576-wide rows it was 1.7x slower in cache (1536 x 576: 0.042
        // against 0.024 ms) and 2-3x from L3 (its output layer, 49152 x 576), and generation
        // with INT8 per row ran at 0.98x candle's Q8_0 where INT8-g32 ran at 2.4x.
        _ => avx2::dot_rows(t.avx2(), v, first, x, out),
    }
}

/// The CPU's family (`cpuid` leaf 1, base plus extended) when it is AMD's (leaf 0's vendor
/// string), read once: it picks between kernels that give the same bits, never the
/// arithmetic.
pub(super) fn amd_family() -> Option<u32> {
    static FAMILY: std::sync::OnceLock<Option<u32>> = std::sync::OnceLock::new();
    *FAMILY.get_or_init(|| {
        let id = std::arch::x86_64::__cpuid(0);
        let amd = [id.ebx, id.edx, id.ecx]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .eq(*b"AuthenticAMD");
        amd.then(|| {
            let eax = std::arch::x86_64::__cpuid(1).eax;
            let base = (eax >> 8) & 0xf;
            if base == 0xf {
                base + ((eax >> 20) & 0xff)
            } else {
                base
            }
        })
    })
}

/// Whether the CPU runs a 512-bit instruction as two 256-bit halves: AMD's family 25 (Zen
/// 4). There the 8-bit batch-1 kernel ([`byte_rows_imp`]) is slower than the AVX2 code
/// (4096 x 4096 INT8 per row, one thread, best of 300, two runs: 0.460 and 0.464 ms
/// against 0.417 and 0.416 with the AVX2 code, the same bits), where on Zen 5, whose
/// vector units are 512 bits wide, it is faster. (Measured again after its loop took
/// whole vectors unmasked and the long rows' hints, stop 51, the two in one process, best
/// of 60 or 300: faster at 4096 x 4096, 0.35-0.43 against 0.38-0.49 ms, and at 11008 x
/// 4096, 1.89-1.93 against 2.11-2.14, but slower at 4096 x 11008, 1.90-1.94 against
/// 1.69-1.72, and level at 2048 x 2048 and 8192 x 8192: still off here.)
pub(super) fn double_pumped() -> bool {
    amd_family() == Some(25)
}

/// Whether the CPU has AVX-512 VBMI (`vpermb`, a byte permute across the whole register),
/// which the 8-bit batch-1 kernel ([`byte_rows_imp`]) and the AVX-512 generation kernel
/// of `rows8` use when it is there.
pub(super) fn vbmi() -> bool {
    is_x86_feature_detected!("avx512vbmi")
}

/// `M` rows of 8-bit codes against one row of `x` split into bytes ([`SplitX::new_bytes`]),
/// 64 codes a step with `vpdpbusd`: the codes biased to unsigned bytes (`u = c + 128`) and
/// put in the bytes layout with one `vpermb` ([`BYTE_ORDER`]), so each 32-bit lane sums
/// four products of one class and the two 256-bit halves added are the eight class sums
/// of the AVX2 tier: `Σ c·x = Σ u·xl + 256 · Σ u·xh − 128 · Σ x`, exact in `i32`, then the
/// same `fma` a group, so the same bits. The codes are read as stored: no widening to
/// `i16`, and a quarter of the AVX2 code's instructions a weight. Whole vectors are plain
/// loads and only a row's last partial one is masked (masking every load cost 10% on Zen
/// 4); rows prefetch as the AVX2 code's do: the following rows a line a step while the
/// rows are short ([`avx2::NEAR_AHEAD`]), else the start of the next rows and each row's
/// own bytes [`avx2::FAR_AHEAD`] on (on Zen 4, 4096 x 4096 from L3: 0.38-0.40 ms against
/// 0.44-0.45 with the following rows a line a step; 8192 x 8192 from memory 2.9-3.2
/// against 3.7-3.8).
///
/// # Safety
/// The token's features and AVX-512 VBMI present; `group` a multiple of 64, `sx` split in
/// bytes for it and covering the shortest row ([`SplitX::covers`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma")]
unsafe fn byte_rows_imp<const M: usize>(
    codes: [&[u8]; M],
    sx: &SplitX,
    group: usize,
    scales: [RowScales<'_>; M],
) -> [f32; M] {
    let len = codes.iter().map(|r| r.len()).min().unwrap_or(0);
    // SAFETY: the caller's guarantees, passed on
    unsafe {
        if avx2::long_rows(&codes, len) {
            byte_rows_loop::<M, true>(codes, sx, group, scales)
        } else {
            byte_rows_loop::<M, false>(codes, sx, group, scales)
        }
    }
}

/// [`byte_rows_imp`]'s loop, a group at a time: its whole vectors with plain loads, then
/// the row's partial last vector (if the group holds it) with a masked one, then the
/// group's flush. `FAR`: long rows' prefetch hints ([`avx2::FAR_AHEAD`]), else the next
/// rows a line a step.
///
/// # Safety
/// As for [`byte_rows_imp`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma")]
#[inline]
unsafe fn byte_rows_loop<const M: usize, const FAR: bool>(
    codes: [&[u8]; M],
    sx: &SplitX,
    group: usize,
    scales: [RowScales<'_>; M],
) -> [f32; M] {
    let len = codes.iter().map(|r| r.len()).min().unwrap_or(0);
    let groups = scales.iter().map(|s| s.len()).min().unwrap_or(0);
    let (vectors, per_group) = (len.div_ceil(64), (group / 64).max(1));
    let whole = len / 64;
    // SAFETY: `BYTE_ORDER` is 64 bytes
    let order = unsafe { _mm512_loadu_si512(BYTE_ORDER.as_ptr().cast()) };
    let bias = _mm512_set1_epi8(i8::MIN);
    let zero = _mm512_setzero_si512();
    let next = following(&codes);
    let mut f = [_mm256_setzero_ps(); M];
    let (mut l, mut h) = ([zero; M], [zero; M]);
    // vector `v` of every row into the sums `l`, `h`: whole (`None`), or the bytes `mask`
    // selects
    let step = |v: usize, mask: Option<u64>, l: &mut [__m512i; M], h: &mut [__m512i; M]| {
        if FAR {
            avx2::far_ahead(&codes, 64 * v);
        } else {
            for k in 0..M {
                _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(M * 64 * v + 64 * k));
            }
        }
        // SAFETY: bytes 64v..64v + 64 of `xl` and `xh` are in range (caller: `sx` covers
        // the row)
        let (xl, xh) = unsafe {
            (
                _mm512_loadu_si512(sx.xl.as_ptr().add(64 * v).cast()),
                _mm512_loadu_si512(sx.xh.as_ptr().add(64 * v).cast()),
            )
        };
        for ((lm, hm), r) in l.iter_mut().zip(h.iter_mut()).zip(&codes) {
            let at = r.as_ptr().wrapping_add(64 * v);
            let c = match mask {
                // SAFETY: (callers) 64v + 64 <= len, every row's length
                None => unsafe { _mm512_loadu_si512(at.cast()) },
                // SAFETY: (callers) the selected bytes are within the row
                Some(m) => unsafe { _mm512_maskz_loadu_epi8(m, at.cast()) },
            };
            let u = _mm512_xor_si512(_mm512_permutexvar_epi8(order, c), bias);
            *lm = _mm512_dpbusd_epi32(*lm, u, xl);
            *hm = _mm512_dpbusd_epi32(*hm, u, xh);
        }
    };
    let (mut v, mut g) = (0, 0);
    while v < vectors {
        let end = (v + per_group).min(vectors);
        while v < end.min(whole) {
            // 64v + 64 <= whole * 64 <= len
            step(v, None, &mut l, &mut h);
            v += 1;
        }
        if v < end {
            // the partial last vector: the selected bytes, 64v..len, are within the row
            // (the rest are not read; as 128 they meet zeros in `x`)
            step(v, Some((1u64 << (len - 64 * v)) - 1), &mut l, &mut h);
            v += 1;
        }
        // SAFETY: a group the rows reach, which `sx` covers (caller)
        unsafe { flush_split_group(&mut f, &mut l, &mut h, sx, g, groups, &scales) };
        g += 1;
    }
    f.map(|v| hsum(v))
}

/// The bytes layout of an 8-bit per-row matrix (`rows` rows of `view.row_bytes` codes), a
/// tile of 16 rows at a time, for [`byte_tile`]: for tile `t`, vector `v` (the 64 columns
/// from `64v`), lane `L` of the bytes layout (the four columns `64v + byte_source(4L + k)`, one
/// class) and row `r` of the tile, those four codes biased to unsigned bytes (`c + 128`) at
/// `((t · vectors + v) · 16 + L) · 64 + 4r`, `vectors` the row's bytes over 64 rounded up;
/// 128 (a zero code) past a row's end and for rows past the matrix. Each 64-byte vector is
/// one class's four columns of each of 16 rows, a lane a row, met by four bytes of `x`
/// broadcast: one stream in order, and no permutation a product (where [`byte_rows_imp`]
/// reads four rows side by side and permutes every vector).
pub(super) fn tile_bytes(view: &RowsView<'_>, rows: usize) -> crate::format::Tiled {
    let vectors = view.row_bytes.div_ceil(64);
    let span = vectors * 16 * 64;
    let tiles = rows.div_ceil(16);
    let mut codes = vec![0x80u8; tiles * span];
    // tile `t`'s codes into `tile`
    let fill = |t: usize, tile: &mut [u8]| {
        for r in 0..16 {
            let row = view.codes_of(t * 16 + r);
            for (v, piece) in row.chunks(64).enumerate() {
                for (i, &src) in BYTE_ORDER.iter().enumerate() {
                    let (lane, k) = (i / 4, i % 4);
                    if let (Some(&c), Some(o)) = (
                        piece.get(usize::from(src)),
                        tile.get_mut(((v * 16 + lane) * 16 + r) * 4 + k),
                    ) {
                        *o = c ^ 0x80;
                    }
                }
            }
        }
    };
    super::rows8::fill_tiles(&mut codes, span, &fill);
    crate::format::Tiled {
        codes: codes.into_boxed_slice(),
        scales: None,
        mins: None,
    }
}

/// Rows `first..first + out.len()` (`out.len() <= 16`, tile `first / 16` of [`tile_bytes`]'s
/// `tiled`) of an 8-bit per-row matrix against one row of `x` split into bytes
/// ([`SplitX::new_bytes`]): [`byte_rows_imp`]'s sums and arithmetic, lane by lane, so its
/// bits. Each vector's 64 products go into its class's sums for 16 rows at once
/// (`vpdpbusd`, the codes against four bytes of `x` broadcast); a group's end puts the low
/// and high parts together (`l + 256 · h`, integers: the order of the adds does not
/// matter), takes `128 · Σ x` off and runs the AVX2 tier's `fma` with each row's scale, and
/// the eight classes are added in `hsum`'s order. `false`, with nothing written, where the
/// layout, the rows or `sx` do not fit.
pub(super) fn byte_tile(
    t: Token,
    tiled: &[u8],
    view: &RowsView<'_>,
    first: usize,
    sx: &SplitX,
    out: &mut [f32],
) -> bool {
    let len = view.row_bytes;
    let vectors = len.div_ceil(64);
    let span = vectors * 16 * 64;
    let fits = view.lut.is_none()
        && out.len() <= 16
        && first.is_multiple_of(16)
        && sx.per_byte == 1
        && sx.covers(len, view.group)
        && sx.xl.len() >= vectors * 64;
    let Some(codes) = tiled
        .get(first / 16 * span..(first / 16 + 1) * span)
        .filter(|_| fits)
    else {
        return false;
    };
    // each row's scales (none past `out`), and the groups every row has
    let scales: [RowScales<'_>; 16] = std::array::from_fn(|k| {
        if k < out.len() {
            view.scales_of(first + k)
        } else {
            RowScales::Row(0.0, 0)
        }
    });
    let groups = scales
        .iter()
        .take(out.len())
        .map(|s| s.len())
        .min()
        .unwrap_or(0);
    let _ = t;
    // SAFETY: the token proves the features; `codes` is `vectors` vectors of 16 lanes, and
    // `sx` holds `vectors · 64` bytes of each part and the corrections of every group the
    // rows reach (`covers`, checked above)
    let sums = unsafe {
        byte_tile_imp(
            codes,
            sx,
            (view.group / 64).max(1),
            vectors,
            &scales,
            groups,
        )
    };
    for (o, s) in out.iter_mut().zip(sums) {
        *o = s;
    }
    true
}

/// How far ahead [`byte_tile_imp`] prefetches its stream.
const TILE8_AHEAD: usize = 2048;

/// # Safety
/// The token's features present; `codes` at least `vectors · 1024` bytes; `sx.xl` and
/// `sx.xh` at least `vectors · 64`; `sx.corr` at least `8 · groups`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
unsafe fn byte_tile_imp(
    codes: &[u8],
    sx: &SplitX,
    per_group: usize,
    vectors: usize,
    scales: &[RowScales<'_>; 16],
    groups: usize,
) -> [f32; 16] {
    let zero = _mm512_setzero_si512();
    let mut f = [_mm512_setzero_ps(); 8];
    let (mut l, mut h) = ([zero; 8], [zero; 8]);
    let (xl, xh) = (sx.xl.as_ptr().cast::<i32>(), sx.xh.as_ptr().cast::<i32>());
    let (mut v, mut g) = (0, 0);
    while v < vectors {
        let end = (v + per_group).min(vectors);
        while v < end {
            // (a plain loop: iterators here are not inlined into the caller's features)
            #[allow(clippy::needless_range_loop)]
            for lane in 0..16 {
                let at = v * 16 + lane;
                // the stream ahead (a hint: any address is allowed)
                _mm_prefetch::<_MM_HINT_T0>(
                    codes.as_ptr().wrapping_add(at * 64 + TILE8_AHEAD).cast(),
                );
                // SAFETY: at < vectors · 16: the vector is inside `codes`, the words inside
                // `xl` and `xh` (caller)
                let (c, wl, wh) = unsafe {
                    (
                        _mm512_loadu_si512(codes.as_ptr().add(at * 64).cast()),
                        xl.add(at).read_unaligned(),
                        xh.add(at).read_unaligned(),
                    )
                };
                let m = lane % 8;
                l[m] = _mm512_dpbusd_epi32(l[m], c, _mm512_set1_epi32(wl));
                h[m] = _mm512_dpbusd_epi32(h[m], c, _mm512_set1_epi32(wh));
            }
            v += 1;
        }
        if g < groups {
            let s: [f32; 16] = std::array::from_fn(|k| scales[k].get(g));
            // SAFETY: 16 f32
            let sv = unsafe { _mm512_loadu_ps(s.as_ptr()) };
            for m in 0..8 {
                let sums = _mm512_add_epi32(l[m], _mm512_slli_epi32::<8>(h[m]));
                let corr = sx.corr.get(8 * g + m).copied().unwrap_or(0);
                let classes = _mm512_sub_epi32(sums, _mm512_set1_epi32(corr));
                f[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(classes), sv, f[m]);
            }
        }
        (l, h) = ([zero; 8], [zero; 8]);
        g += 1;
    }
    // hsum's order: ((c0 + c4) + (c1 + c5)) + ((c2 + c6) + (c3 + c7))
    let s = _mm512_add_ps(
        _mm512_add_ps(_mm512_add_ps(f[0], f[4]), _mm512_add_ps(f[1], f[5])),
        _mm512_add_ps(_mm512_add_ps(f[2], f[6]), _mm512_add_ps(f[3], f[7])),
    );
    let mut out = [0f32; 16];
    // SAFETY: 16 f32
    unsafe { _mm512_storeu_ps(out.as_mut_ptr(), s) };
    out
}

/// The end of group `g` of split sums ([`SplitX`]): for each row, the low and high parts'
/// sums put together (`l + 256 · h`), the two 256-bit halves added into the eight class
/// sums, `128 · Σ x` taken off, and the AVX2 tier's [`flush`] with the row's scale; the
/// sums zeroed for the next group. Rows past their `groups` scales only have their sums
/// zeroed.
///
/// # Safety
/// The token's features present; `sx` holds group `g`'s corrections when `g < groups`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn flush_split_group<const M: usize>(
    f: &mut [__m256; M],
    l: &mut [__m512i; M],
    h: &mut [__m512i; M],
    sx: &SplitX,
    g: usize,
    groups: usize,
    scales: &[RowScales<'_>; M],
) {
    for (((fm, lm), hm), s) in f.iter_mut().zip(l).zip(h).zip(scales) {
        if g < groups {
            let sums = _mm512_add_epi32(*lm, _mm512_slli_epi32::<8>(*hm));
            let classes = _mm256_add_epi32(
                _mm512_castsi512_si256(sums),
                _mm512_extracti64x4_epi64::<1>(sums),
            );
            // SAFETY: g < groups: a group `sx` holds (caller)
            let cg = _mm512_castsi512_si256(unsafe { corr_of(sx, g, false) });
            flush(fm, _mm256_sub_epi32(classes, cg), s.get(g));
        }
        (*lm, *hm) = (_mm512_setzero_si512(), _mm512_setzero_si512());
    }
}

/// The eight class sums of a 16-lane `vpdpwssd` accumulator: lane `m` holds class
/// `m mod 8`, so the upper half added to the lower.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
#[inline]
fn fold_words(acc: __m512i) -> __m256i {
    _mm256_add_epi32(
        _mm512_castsi512_si256(acc),
        _mm512_extracti64x4_epi64::<1>(acc),
    )
}

/// A group's eight exact class sums, scaled, into an f32 accumulator: the AVX2 tier's
/// flush, operation for operation.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
#[inline]
fn flush(f: &mut __m256, classes: __m256i, scale: f32) {
    *f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(classes), _mm256_set1_ps(scale), *f);
}

/// [`flush`] for sums already converted: the same `fma`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
#[inline]
fn flush_f32(f: &mut __m256, classes: __m256, scale: f32) {
    *f = _mm256_fmadd_ps(classes, _mm256_set1_ps(scale), *f);
}

/// `M` rows of 8-bit codes against `N` rows of 14-bit `x`, 32 weights a step
/// (`vpdpwssd`), the row's scale per group.
///
/// # Safety
/// The token's features present; the shortest row of `w` a multiple of 16 long, `group`
/// a multiple of 32, every `x` at least that long.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
unsafe fn int8_imp<const M: usize, const N: usize>(
    w: [&[u8]; M],
    xs: [&[i16]; N],
    group: usize,
    scales: [RowScales<'_>; M],
) -> [[f32; N]; M] {
    let kp = w.iter().map(|r| r.len()).min().unwrap_or(0);
    let groups = scales.iter().map(|s| s.len()).min().unwrap_or(0);
    let mut f = [[_mm256_setzero_ps(); N]; M];
    let mut start = 0;
    for g in 0..groups {
        if start >= kp {
            break;
        }
        let end = (start + group).min(kp);
        let mut acc = [[_mm512_setzero_si512(); N]; M];
        let mut c = start;
        while c < end {
            // 32 weights, or the row's last 16 (the rest of the lanes masked off: zero)
            let mask: u32 = if end - c >= 32 { u32::MAX } else { 0xffff };
            let mut xv = [_mm512_setzero_si512(); N];
            for (v, x) in xv.iter_mut().zip(&xs) {
                // SAFETY: the selected lanes are c..c + 32 (or c + 16) <= end <= kp,
                // inside every `x` (caller)
                *v = unsafe { _mm512_maskz_loadu_epi16(mask, x.as_ptr().add(c)) };
            }
            for (a, r) in acc.iter_mut().zip(&w) {
                // SAFETY: as for `x`: the selected bytes are inside every row (caller)
                let wv = _mm512_cvtepi8_epi16(unsafe {
                    _mm256_maskz_loadu_epi8(mask, r.as_ptr().add(c).cast())
                });
                for (ai, &xi) in a.iter_mut().zip(&xv) {
                    *ai = _mm512_dpwssd_epi32(*ai, wv, xi);
                }
            }
            c += 32;
        }
        for ((fm, am), s) in f.iter_mut().zip(acc).zip(&scales) {
            let scale = s.get(g);
            for (fi, ai) in fm.iter_mut().zip(am) {
                flush(fi, fold_words(ai), scale);
            }
        }
        start = end;
    }
    f.map(|row| row.map(|v| hsum(v)))
}

/// Group `g`'s eight corrections, and the next group's when `two` (zeros otherwise), as
/// one register.
///
/// # Safety
/// The token's features present; `sx` holds group `g` (`8 * g + 8 <= sx.corr.len()`) and,
/// when `two`, group `g + 1`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
#[inline]
unsafe fn corr_of(sx: &SplitX, g: usize, two: bool) -> __m512i {
    let mask: u16 = if two { 0xffff } else { 0x00ff };
    // SAFETY: the selected lanes are in range (caller); the others are not read
    unsafe { _mm512_maskz_loadu_epi32(mask, sx.corr.as_ptr().add(8 * g)) }
}

/// `M` rows of 4-bit codes (indices into `lut`) against one split row of `x`, a chunk
/// (128 weights, 64 code bytes, two pairs of runs) a step with `vpdpbusd`: the codes'
/// 64-bit halves regrouped by pair (`vpermq`) and their bytes put in the layout's order
/// ([`PAIR_ORDER`]), so each 32-bit lane sums one class of one pair and a pair's eight
/// lanes are its eight class sums. For groups of one pair, a step ends two groups
/// (one in each 256-bit half); for groups of whole chunks, the halves are added.
///
/// # Safety
/// The token's features present; `group` 64 or a multiple of 128, `sx` split for it and
/// covering the shortest row ([`SplitX::covers`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
unsafe fn nibble_rows_imp<const M: usize>(
    codes: [&[u8]; M],
    lut: &[i8; 16],
    sx: &SplitX,
    group: usize,
    scales: [RowScales<'_>; M],
) -> [f32; M] {
    let runs = codes.iter().map(|r| r.len()).min().unwrap_or(0) / 16;
    let groups = scales.iter().map(|s| s.len()).min().unwrap_or(0);
    let chunks_a_group = group / CHUNK;
    // for groups of whole chunks: the group being summed and its chunks so far (counted,
    // not divided: a division a step is slow)
    let (mut g, mut in_group) = (0, 0);
    let biased = lut.map(|v| v ^ i8::MIN);
    // SAFETY: `biased` and `PAIR_ORDER` are 16 bytes
    let (table, order) = unsafe {
        (
            _mm512_broadcast_i32x4(_mm_loadu_si128(biased.as_ptr().cast())),
            _mm512_broadcast_i32x4(_mm_loadu_si128(PAIR_ORDER.as_ptr().cast())),
        )
    };
    let by_pair = _mm512_setr_epi64(0, 2, 1, 3, 4, 6, 5, 7);
    let low = _mm512_set1_epi8(0x0f);
    let zero = _mm512_setzero_si512();
    let next = following(&codes);
    let mut f = [_mm256_setzero_ps(); M];
    let (mut l, mut h) = ([zero; M], [zero; M]);
    for chunk in 0..runs.div_ceil(4) {
        let first_run = 4 * chunk;
        let n = (runs - first_run).min(4);
        let mask: u64 = if n == 4 {
            u64::MAX
        } else {
            (1u64 << (16 * n)) - 1
        };
        for k in 0..4 {
            _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(M * 64 * chunk + 64 * k));
        }
        // SAFETY: bytes CHUNK * chunk.. + CHUNK of `xl` and `xh` are in range (caller)
        let (xl_lo, xl_hi, xh_lo, xh_hi) = unsafe {
            let (pl, ph) = (
                sx.xl.as_ptr().add(CHUNK * chunk),
                sx.xh.as_ptr().add(CHUNK * chunk),
            );
            (
                _mm512_loadu_si512(pl.cast()),
                _mm512_loadu_si512(pl.add(64).cast()),
                _mm512_loadu_si512(ph.cast()),
                _mm512_loadu_si512(ph.add(64).cast()),
            )
        };
        for ((lm, hm), r) in l.iter_mut().zip(h.iter_mut()).zip(&codes) {
            // SAFETY: the selected bytes, 16 * first_run .. + 16 * n, are within the
            // row's `16 * runs` (the rest are not read, and meet zeros in `x`)
            let c = unsafe { _mm512_maskz_loadu_epi8(mask, r.as_ptr().add(64 * chunk).cast()) };
            let c = _mm512_shuffle_epi8(_mm512_permutexvar_epi64(by_pair, c), order);
            // each the code's value plus 128, unsigned
            let lo = _mm512_shuffle_epi8(table, _mm512_and_si512(c, low));
            let hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16::<4>(c), low));
            *lm = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(*lm, lo, xl_lo), hi, xl_hi);
            *hm = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(*hm, lo, xh_lo), hi, xh_hi);
        }
        let done = first_run + n;
        if group == PAIR {
            // groups 2 · chunk (the low half) and 2 · chunk + 1 (the high half, if any)
            let g = 2 * chunk;
            let two = n > 2 && g + 1 < groups;
            for (((fm, lm), hm), s) in f.iter_mut().zip(&mut l).zip(&mut h).zip(&scales) {
                if g < groups {
                    let sums = _mm512_add_epi32(*lm, _mm512_slli_epi32::<8>(*hm));
                    // SAFETY: groups the row reaches, which `sx` covers (caller)
                    let sums = _mm512_sub_epi32(sums, unsafe { corr_of(sx, g, two) });
                    let v = _mm512_cvtepi32_ps(sums);
                    flush_f32(fm, _mm512_castps512_ps256(v), s.get(g));
                    if two {
                        let upper =
                            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
                        flush_f32(fm, upper, s.get(g + 1));
                    }
                }
                (*lm, *hm) = (zero, zero);
            }
        } else {
            in_group += 1;
            if in_group < chunks_a_group && done < runs {
                continue;
            }
            // SAFETY: a group the rows reach, which `sx` covers (caller)
            unsafe { flush_split_group(&mut f, &mut l, &mut h, sx, g, groups, &scales) };
            (g, in_group) = (g + 1, 0);
        }
    }
    f.map(|v| hsum(v))
}

/// `R` rows of F16 (or BF16) codes against `P` pairs of `x` rows, the first `body`
/// columns (a multiple of 8): `[row][pair][0 or 1]`, each the AVX2 tier's head sum for
/// that row and `x` row, the same bits (its eight lanes run the same `fma`s in the same
/// order; a 512-bit register holds the lanes of two `x` rows, so one conversion of the
/// weights and one `fma` serve both). `x2[p]` holds pair `p` interleaved eight at a time:
/// `a[0..8], b[0..8], a[8..16], b[8..16], ...`. `None` when a slice is too short.
pub(super) fn dot_half_tile<const R: usize, const P: usize>(
    t: Token,
    codes: [&[u8]; R],
    bf16: bool,
    x2: [&[f32]; P],
    body: usize,
) -> Option<[[[f32; 2]; P]; R]> {
    let fits = body.is_multiple_of(8)
        && codes.iter().all(|c| c.len() >= 2 * body)
        && x2.iter().all(|x| x.len() >= 2 * body);
    if !fits {
        return None;
    }
    let _ = t;
    // SAFETY: the token proves the features; `fits` checked the lengths the loads rely on
    Some(unsafe {
        if bf16 {
            half_tile_imp::<R, P, true>(codes, x2, body)
        } else {
            half_tile_imp::<R, P, false>(codes, x2, body)
        }
    })
}

/// # Safety
/// The token's features (and F16C) present; `body` a multiple of 8; every row of
/// `codes` at least `2 * body` bytes, every `x2` at least `2 * body` values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn half_tile_imp<const R: usize, const P: usize, const BF16: bool>(
    codes: [&[u8]; R],
    x2: [&[f32]; P],
    body: usize,
) -> [[[f32; 2]; P]; R] {
    let mut acc = [[_mm512_setzero_ps(); P]; R];
    // long rows: the 8-bit kernels' hints ([`avx2::FAR_AHEAD`])
    let far = avx2::long_rows(&codes, 2 * body);
    let mut j = 0;
    while j < body {
        if far {
            avx2::far_ahead(&codes, 2 * j);
        }
        let mut wv = [_mm512_setzero_ps(); R];
        for (w, c) in wv.iter_mut().zip(&codes) {
            // SAFETY: bytes 2j..2j + 16 are in range (caller); the eight values, twice
            let h = _mm256_broadcastsi128_si256(unsafe {
                _mm_loadu_si128(c.as_ptr().add(2 * j).cast())
            });
            *w = if BF16 {
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            } else {
                _mm512_cvtph_ps(h)
            };
        }
        for (p, x) in x2.iter().enumerate() {
            // SAFETY: values 2j..2j + 16 are in range (caller)
            let xv = unsafe { _mm512_loadu_ps(x.as_ptr().add(2 * j)) };
            for (a, w) in acc.iter_mut().zip(&wv) {
                if let Some(a) = a.get_mut(p) {
                    *a = _mm512_fmadd_ps(*w, xv, *a);
                }
            }
        }
        j += 8;
    }
    acc.map(|row| {
        row.map(|v| {
            [
                hsum(_mm512_castps512_ps256(v)),
                hsum(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
                    _mm512_castps_pd(v),
                ))),
            ]
        })
    })
}

/// [`avx2::add_dot_f32_columns`] sixteen or 32 columns a step: the same arithmetic lane by
/// lane (eight `fma` chains, `hsum`'s tree, then the portable tail), so the same bits; a
/// weight's broadcast serves two vectors of columns. A `stride` that is not a multiple of
/// 16 runs the AVX2 code.
pub(super) fn add_dot_f32_columns(t: Token, a: &[f32], xt: &[f32], stride: usize, out: &mut [f32]) {
    let fits = stride.is_multiple_of(16)
        && stride >= out.len()
        && a.len()
            .checked_mul(stride)
            .is_some_and(|len| len <= xt.len());
    if !fits {
        avx2::add_dot_f32_columns(t.avx2(), a, xt, stride, out);
        return;
    }
    // SAFETY: the token proves the features; every load reads 16 values of a row of `xt`
    // from a column `c < out.len() <= stride`, a multiple of 16, and a second vector only
    // where `c + 32 <= stride`: inside the row
    unsafe { add_dot_f32_columns_imp(a, xt, stride, out) };
}

/// `hsum`'s tree over eight vectors of lanes: `((p0 + p4) + (p1 + p5)) + ((p2 + p6) + (p3
/// + p7))`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
fn tree(p: &[__m512; 8]) -> __m512 {
    let s0 = _mm512_add_ps(p[0], p[4]);
    let s1 = _mm512_add_ps(p[1], p[5]);
    let s2 = _mm512_add_ps(p[2], p[6]);
    let s3 = _mm512_add_ps(p[3], p[7]);
    _mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3))
}

/// # Safety
/// AVX-512 F and FMA present; `stride` a multiple of 16 and at least `out.len()`; `xt` at
/// least `a.len() · stride` long.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
unsafe fn add_dot_f32_columns_imp(a: &[f32], xt: &[f32], stride: usize, out: &mut [f32]) {
    let n = a.len();
    let body = n / 8 * 8;
    let (neutral, zeros) = avx2::tail_constants();
    let (neutral, zeros) = (_mm512_set1_ps(neutral), _mm512_set1_ps(zeros));
    let mut c0 = 0;
    while c0 < out.len() {
        let two = c0 + 32 <= stride;
        let mut p0 = [_mm512_setzero_ps(); 8];
        let mut p1 = [_mm512_setzero_ps(); 8];
        let mut j = 0;
        // (plain loops: iterators here are not inlined into the caller's features)
        #[allow(clippy::needless_range_loop)]
        while j < body {
            for l in 0..8 {
                // SAFETY: j + l < body <= n: row j + l of `xt` holds columns c0..c0 + 16,
                // and c0 + 16..c0 + 32 when `two` (caller)
                unsafe {
                    let row = xt.as_ptr().add((j + l) * stride + c0);
                    let m = _mm512_set1_ps(*a.get_unchecked(j + l));
                    p0[l] = _mm512_fmadd_ps(m, _mm512_loadu_ps(row), p0[l]);
                    if two {
                        p1[l] = _mm512_fmadd_ps(m, _mm512_loadu_ps(row.add(16)), p1[l]);
                    }
                }
            }
            j += 8;
        }
        // the portable tail, lane by lane: the products (not fused) summed in order
        let (mut t0, mut t1) = (neutral, neutral);
        let mut i = body;
        while i < n {
            // SAFETY: i < n: row i of `xt` holds columns c0..c0 + 16, and c0 + 16..c0 + 32
            // when `two` (caller)
            unsafe {
                let row = xt.as_ptr().add(i * stride + c0);
                let m = _mm512_set1_ps(*a.get_unchecked(i));
                t0 = _mm512_add_ps(t0, _mm512_mul_ps(m, _mm512_loadu_ps(row)));
                if two {
                    t1 = _mm512_add_ps(t1, _mm512_mul_ps(m, _mm512_loadu_ps(row.add(16))));
                }
            }
            i += 1;
        }
        // out[c] += head[c] + tail[c], the columns past `out` masked off
        let cols = (out.len() - c0).min(if two { 32 } else { 16 });
        let adds = [
            _mm512_add_ps(tree(&p0), _mm512_add_ps(zeros, t0)),
            _mm512_add_ps(tree(&p1), _mm512_add_ps(zeros, t1)),
        ];
        for (k, add) in adds.into_iter().enumerate() {
            let lanes = cols.saturating_sub(16 * k).min(16);
            if lanes == 0 {
                break;
            }
            let mask: u16 = if lanes == 16 { !0 } else { (1 << lanes) - 1 };
            // SAFETY: the mask keeps to the `lanes` values from c0 + 16k, inside `out`
            unsafe {
                let o = out.as_mut_ptr().add(c0 + 16 * k);
                let sum = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, o), add);
                _mm512_mask_storeu_ps(o, mask, sum);
            }
        }
        c0 += if two { 32 } else { 16 };
    }
}

/// [`super::fixed_row`] compiled for this tier's instructions: the same code, the same bits.
pub(super) fn fixed_row(t: Token, row: &[f32], out: &mut [i16], nibbles: bool) -> f32 {
    let _ = t;
    // SAFETY: the token proves the features
    unsafe { fixed_row_imp(row, out, nibbles) }
}

/// # Safety
/// The features present.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn fixed_row_imp(row: &[f32], out: &mut [i16], nibbles: bool) -> f32 {
    super::fixed_row_body(row, out, nibbles)
}

vector_copies!("avx512f,avx512bw,avx512vl,avx2,fma");

/// Element `(j, i)` of `src` (row `j` at `j * src_stride`) to `(i, j)` of `dst` (row `i`
/// at `i * dst_stride`) for `i, j < 16`: a 16 x 16 tile of f32 transposed in registers
/// (four rounds of shuffles). Nothing is computed, so the values are moved as they are.
/// `false`, with nothing written, where either slice is too short for its tile.
pub(super) fn transpose16(
    _: Token,
    src: &[f32],
    src_stride: usize,
    dst: &mut [f32],
    dst_stride: usize,
) -> bool {
    let fits = |len: usize, stride: usize| {
        stride
            .checked_mul(15)
            .and_then(|s| s.checked_add(16))
            .is_some_and(|need| need <= len)
    };
    if !(fits(src.len(), src_stride) && fits(dst.len(), dst_stride)) {
        return false;
    }
    // SAFETY: the token proves AVX-512 F; row `k < 16` of each tile is 16 values at
    // `k * stride`, inside the slice by the check above.
    unsafe { transpose16_tile(src.as_ptr(), src_stride, dst.as_mut_ptr(), dst_stride) };
    true
}

/// # Safety
/// AVX-512 F; 16 rows of 16 readable values at `src + k * src_stride` and writable ones at
/// `dst + k * dst_stride`.
#[target_feature(enable = "avx512f")]
unsafe fn transpose16_tile(src: *const f32, src_stride: usize, dst: *mut f32, dst_stride: usize) {
    use std::arch::x86_64::{
        _mm512_castpd_ps, _mm512_shuffle_f32x4, _mm512_unpackhi_pd, _mm512_unpackhi_ps,
        _mm512_unpacklo_pd, _mm512_unpacklo_ps,
    };
    // SAFETY: row `k` of the source, inside it as the caller promises
    let r: [__m512; 16] =
        std::array::from_fn(|k| unsafe { _mm512_loadu_ps(src.add(k * src_stride)) });
    // pairs of rows interleaved by element, then by pairs of elements
    let t: [__m512; 16] = std::array::from_fn(|k| {
        let (a, b) = (r[k & !1], r[k | 1]);
        if k % 2 == 0 {
            _mm512_unpacklo_ps(a, b)
        } else {
            _mm512_unpackhi_ps(a, b)
        }
    });
    let u: [__m512; 16] = std::array::from_fn(|k| {
        // within each four rows: (t0, t2) low and high, then (t1, t3)
        let base = k & !3;
        let (a, b) = match k % 4 {
            0 | 1 => (t[base], t[base + 2]),
            _ => (t[base + 1], t[base + 3]),
        };
        let (a, b) = (_mm512_castps_pd(a), _mm512_castps_pd(b));
        _mm512_castpd_ps(if k % 2 == 0 {
            _mm512_unpacklo_pd(a, b)
        } else {
            _mm512_unpackhi_pd(a, b)
        })
    });
    // then the 128-bit quarters: within each eight rows, then across the two halves
    let v: [__m512; 16] = std::array::from_fn(|k| {
        let base = k & !7;
        let (a, b) = (u[base + k % 4], u[base + 4 + k % 4]);
        if k % 8 < 4 {
            _mm512_shuffle_f32x4::<0x88>(a, b)
        } else {
            _mm512_shuffle_f32x4::<0xdd>(a, b)
        }
    });
    let w: [__m512; 16] = std::array::from_fn(|k| {
        let (a, b) = (v[k % 8], v[8 + k % 8]);
        if k < 8 {
            _mm512_shuffle_f32x4::<0x88>(a, b)
        } else {
            _mm512_shuffle_f32x4::<0xdd>(a, b)
        }
    });
    for (k, row) in w.into_iter().enumerate() {
        // SAFETY: row `k` of the destination, inside it as the caller promises
        unsafe { _mm512_storeu_ps(dst.add(k * dst_stride), row) };
    }
}
