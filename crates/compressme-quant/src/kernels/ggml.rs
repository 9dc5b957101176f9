//! llama.cpp's Q5_0 and Q8_0 weights times `x`, every output the bits candle 0.11 gives
//! for rows it does not repack: ggml's reference `vec_dot_q5_0_q8_0` (candle's only Q5_0
//! kernel, one scalar loop an output) and candle's AVX2 `vec_dot_q8_0_q8_0` (its Q8_0
//! kernel on x86 CPUs with AVX2 and FMA, for rows whose length is not a multiple of 256).
//!
//! # The arithmetic, and why the bits match
//! Each row of `x` is first rounded to Q8_0 blocks of 32 as ggml's reference
//! `quantize_row_q8_0` does: `d = amax / 127` (rounded to f16 where it is stored,
//! unrounded where it scales), `q = round(x / d)`. Then, blocks in order:
//! - **Q5_0**: a block holds 32 weights `w = u - 16` (`u` five bits: a nibble of `qs`, its
//!   high bit in `qh`) and an f16 scale `dw`; `sumf += (sumi as f32 * dw) * dx`, with
//!   `sumi` the block's exact integer sum of `w · q`.
//! - **Q8_0**: 32 weights `w` and `dw`; eight f32 lanes, lane `l` the block's exact sum of
//!   the four products at columns `4l..4l + 4`, each accumulated as
//!   `acc[l] = fma(dw * dx, sum, acc[l])`; the output is
//!   `((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))`,
//!   the order of candle's horizontal sum.
//!
//! Integer sums are exact however they are formed, and the f32 operations here are the
//! same operations in the same order, so every tier gives candle's bits.
//! - **Portable**: the definitions, one output at a time.
//! - **AVX-512 VNNI**: the codes of 16 rows are interleaved at load (four consecutive
//!   columns of one row a 32-bit lane) and biased to unsigned bytes, so one `vpdpbusd`
//!   adds 64 products into the 16 rows' sums; the bias times the sums of `x` takes it
//!   back out. The f32 steps run in the 16 lanes, one row a lane, in the order above.
//!
//! Every `unsafe` here is a call of a `#[target_feature]` function, which the tier's
//! token makes sound (it exists only after the CPU was seen to have the features), or a
//! load inside a range checked before the loop (see the SAFETY notes).
#![allow(unsafe_code)]

use half::f16;
use rayon::prelude::*;

use super::Isa;
use crate::{Backend, Error, Result};

/// Weights in a block of either type.
pub const GGML_BLOCK: usize = 32;
/// Rows interleaved in a tile.
const TILE_ROWS: usize = 16;
/// Bytes of one block of a tile: 32 codes of 16 rows.
const TILE_BLOCK: usize = GGML_BLOCK * TILE_ROWS;
/// Groups of four columns in a block.
const GROUPS: usize = GGML_BLOCK / 4;

/// Which of llama.cpp's types a [`GgmlMatrix`] holds, and so which of candle's kernels
/// it gives the bits of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlKind {
    /// Q5_0: five bits a weight and an f16 scale per 32 (22 bytes a block); ggml's
    /// reference dot product.
    Q5_0,
    /// Q8_0: a byte a weight and an f16 scale per 32 (34 bytes a block); candle's AVX2
    /// dot product.
    Q8_0,
}

impl GgmlKind {
    /// Bytes of one block as GGUF stores it.
    #[must_use]
    pub fn block_bytes(self) -> usize {
        match self {
            Self::Q5_0 => 22,
            Self::Q8_0 => 34,
        }
    }

    /// What a stored code is biased by to make it an unsigned byte.
    fn bias(self) -> u8 {
        match self {
            Self::Q5_0 => 16,
            Self::Q8_0 => 128,
        }
    }
}

/// A `[rows, cols]` matrix of llama.cpp's Q5_0 or Q8_0 blocks, held for products that
/// give candle's bits ([`GgmlMatrix::matmul`]).
///
/// What it is not: a format of this crate's own ([`crate::Format`] rounds differently),
/// and not compact: for the product's speed it keeps one byte a weight (the codes biased
/// to unsigned bytes, 16 rows interleaved) and an f32 scale a block of 32, 9 bits a
/// weight against Q5_0's 5.5 and Q8_0's 8.5.
#[derive(Debug, Clone)]
pub struct GgmlMatrix {
    kind: GgmlKind,
    rows: usize,
    cols: usize,
    /// `u = w + bias` by tile, block, column group of four, row, column in the group.
    codes: Vec<u8>,
    /// `dw` by tile, block, row (0 for the padding rows).
    scales: Vec<f32>,
}

impl GgmlMatrix {
    /// Reads `rows * cols / 32` blocks of `kind` (as GGUF stores them, row-major).
    ///
    /// # Errors
    /// [`Error::Shape`] for an empty shape or `cols` not a multiple of 32;
    /// [`Error::Malformed`] for a byte count that does not match.
    pub fn from_blocks(kind: GgmlKind, bytes: &[u8], rows: usize, cols: usize) -> Result<Self> {
        if rows == 0 || cols == 0 || !cols.is_multiple_of(GGML_BLOCK) {
            return Err(Error::Shape(format!(
                "{kind:?} needs rows > 0 and columns a positive multiple of {GGML_BLOCK}, got [{rows}, {cols}]"
            )));
        }
        let nb = cols / GGML_BLOCK;
        let size = kind.block_bytes();
        let want = rows
            .checked_mul(nb)
            .and_then(|n| n.checked_mul(size))
            .ok_or_else(|| Error::Shape(format!("[{rows}, {cols}] overflows")))?;
        if bytes.len() != want {
            return Err(Error::Malformed(format!(
                "{kind:?} [{rows}, {cols}] takes {want} bytes, got {}",
                bytes.len()
            )));
        }
        let tiles = rows.div_ceil(TILE_ROWS);
        // padding rows: code `bias` (weight 0), scale 0
        let mut codes = vec![kind.bias(); tiles * nb * TILE_BLOCK];
        let mut scales = vec![0f32; tiles * nb * TILE_ROWS];
        for (r, row) in bytes.chunks_exact(nb * size).enumerate() {
            let (t, j) = (r / TILE_ROWS, r % TILE_ROWS);
            for (b, block) in row.chunks_exact(size).enumerate() {
                let at = (t * nb + b) * TILE_ROWS + j;
                scales[at] = f16::from_le_bytes([block[0], block[1]]).to_f32();
                let tile = &mut codes[(t * nb + b) * TILE_BLOCK..][..TILE_BLOCK];
                for e in 0..GGML_BLOCK {
                    tile[(e / 4) * 4 * TILE_ROWS + j * 4 + e % 4] = code(kind, block, e);
                }
            }
        }
        Ok(Self {
            kind,
            rows,
            cols,
            codes,
            scales,
        })
    }

    /// Output features.
    #[must_use]
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    #[must_use]
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// `x W^T` for `x` of `[batch, cols]`, `[batch, rows]` out, on all cores with the
    /// tier [`crate::kernel_tier`] picks: every output candle's bits (see the kind).
    ///
    /// # Errors
    /// [`Error::Shape`] when `x` is not `batch * cols` long; [`Error::Kernel`] as
    /// [`crate::kernel_tier`].
    pub fn matmul(&self, x: &[f32], batch: usize) -> Result<Vec<f32>> {
        self.matmul_with(Backend::Auto, x, batch)
    }

    /// [`Self::matmul`] on a chosen backend (the portable one is the definition; the
    /// AVX2 and AVX-VNNI tiers run it too).
    ///
    /// # Errors
    /// As [`Self::matmul`], and [`Error::Kernel`] for a tier this CPU lacks.
    pub fn matmul_with(&self, backend: Backend, x: &[f32], batch: usize) -> Result<Vec<f32>> {
        if batch.checked_mul(self.cols) != Some(x.len()) {
            return Err(Error::Shape(format!(
                "x has {} values, not {batch} rows of {}",
                x.len(),
                self.cols
            )));
        }
        let isa = Isa::pick(backend)?;
        let nb = self.cols / GGML_BLOCK;
        let xq = QuantizedX::new(x, batch, self.cols, self.kind);
        let tiles = self.rows.div_ceil(TILE_ROWS);
        // each tile's outputs, `[batch, 16]`, then put in place
        let mut by_tile = vec![0f32; tiles * batch * TILE_ROWS];
        by_tile
            .par_chunks_mut(batch * TILE_ROWS)
            .enumerate()
            .for_each(|(t, out)| {
                let tile = Tile {
                    kind: self.kind,
                    codes: &self.codes[t * nb * TILE_BLOCK..][..nb * TILE_BLOCK],
                    scales: &self.scales[t * nb * TILE_ROWS..][..nb * TILE_ROWS],
                };
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512(token) => avx512::tile(token, &tile, &xq, out),
                    _ => portable_tile(&tile, &xq, out),
                }
            });
        let mut y = vec![0f32; batch * self.rows];
        for (r, yr) in y.chunks_exact_mut(self.rows).enumerate() {
            for (t, ys) in yr.chunks_mut(TILE_ROWS).enumerate() {
                ys.copy_from_slice(&by_tile[(t * batch + r) * TILE_ROWS..][..ys.len()]);
            }
        }
        Ok(y)
    }
}

/// Element `e` of a stored block, biased to an unsigned byte.
fn code(kind: GgmlKind, block: &[u8], e: usize) -> u8 {
    match kind {
        GgmlKind::Q5_0 => {
            let qh = u32::from_le_bytes([block[2], block[3], block[4], block[5]]);
            let qs = &block[6..];
            let nibble = if e < 16 {
                qs[e] & 0x0F
            } else {
                qs[e - 16] >> 4
            };
            nibble | (u8::from((qh >> e) & 1 == 1) << 4)
        }
        // i8 plus 128: flip the sign bit
        GgmlKind::Q8_0 => block[2 + e] ^ 0x80,
    }
}

/// One tile of 16 rows: its codes and scales for every block.
struct Tile<'a> {
    kind: GgmlKind,
    codes: &'a [u8],
    scales: &'a [f32],
}

/// `x`'s rows as ggml's reference `quantize_row_q8_0` rounds them.
struct QuantizedX {
    batch: usize,
    /// Blocks a row.
    nb: usize,
    /// `[batch, cols]` rounded values, four consecutive ones a little-endian word.
    words: Vec<i32>,
    /// `[batch, nb]` scales, as the f16 stored then read back.
    d: Vec<f32>,
    /// `words` with each byte biased to an unsigned one (`q + 128`, the sign bit flipped),
    /// for Q8_0's kernel (empty for Q5_0).
    uwords: Vec<i32>,
    /// `[batch, nb]` sums of the rounded values over each block.
    block_sums: Vec<i32>,
}

impl QuantizedX {
    fn new(x: &[f32], batch: usize, cols: usize, kind: GgmlKind) -> Self {
        let nb = cols / GGML_BLOCK;
        let mut q = vec![0i8; batch * cols];
        let mut d = vec![0f32; batch * nb];
        for (i, (xs, qs)) in x
            .chunks_exact(GGML_BLOCK)
            .zip(q.chunks_exact_mut(GGML_BLOCK))
            .enumerate()
        {
            let amax = xs.iter().fold(0f32, |a, &v| a.max(v.abs()));
            let scale = amax / 127.0;
            let inv = if scale == 0.0 { 0.0 } else { 1.0 / scale };
            d[i] = f16::from_f32(scale).to_f32();
            for (o, &v) in qs.iter_mut().zip(xs) {
                *o = round_to_i8(v * inv);
            }
        }
        let block_sums = q
            .chunks_exact(GGML_BLOCK)
            .map(|c| c.iter().map(|&v| i32::from(v)).sum())
            .collect();
        let words: Vec<i32> = q
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([0, 1, 2, 3].map(|k| c[k].to_le_bytes()[0])))
            .collect();
        // flipping each byte's sign bit adds 128 to it
        #[allow(clippy::cast_possible_wrap)]
        let uwords = match kind {
            GgmlKind::Q8_0 => words.iter().map(|w| w ^ 0x8080_8080_u32 as i32).collect(),
            GgmlKind::Q5_0 => Vec::new(),
        };
        Self {
            batch,
            nb,
            words,
            d,
            uwords,
            block_sums,
        }
    }
}

/// `v.round() as i8` (half away from zero, then saturated; NaN to 0, as the reference's
/// `roundf` and cast give), in plain integer and float steps the compiler vectorises
/// instead of a call of `roundf` a value.
#[inline]
#[allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)]
fn round_to_i8(v: f32) -> i8 {
    // past the i8 range the result saturates either way; inside, `v - t` is exact
    let v = v.clamp(-129.0, 128.0);
    let i = v as i32; // towards zero; NaN to 0
    let f = v - i as f32;
    let r = if f >= 0.5 {
        i + 1
    } else if f <= -0.5 {
        i - 1
    } else {
        i
    };
    r.clamp(-128, 127) as i8
}

/// One tile's outputs `[batch, 16]`: the definitions, one output at a time.
fn portable_tile(tile: &Tile<'_>, x: &QuantizedX, out: &mut [f32]) {
    let nb = x.nb;
    let bias = i32::from(tile.kind.bias());
    for (r, o) in out.chunks_exact_mut(TILE_ROWS).enumerate() {
        for (j, o) in o.iter_mut().enumerate() {
            // the sum of the four products of group `g` of block `b`
            let group = |b: usize, g: usize| -> i32 {
                (0..4)
                    .map(|t| {
                        let u = tile.codes[b * TILE_BLOCK + g * 4 * TILE_ROWS + j * 4 + t];
                        let word = x.words[(r * nb + b) * GROUPS + g].to_le_bytes();
                        (i32::from(u) - bias) * i32::from(i8::from_le_bytes([word[t]]))
                    })
                    .sum()
            };
            let dw = |b: usize| tile.scales[b * TILE_ROWS + j];
            let dx = |b: usize| x.d[r * nb + b];
            *o = match tile.kind {
                GgmlKind::Q5_0 => {
                    let mut sumf = 0f32;
                    for b in 0..nb {
                        let sumi: i32 = (0..GROUPS).map(|g| group(b, g)).sum();
                        #[allow(clippy::cast_precision_loss)] // |sumi| <= 32 * 16 * 128
                        let s = sumi as f32;
                        sumf += s * dw(b) * dx(b);
                    }
                    sumf
                }
                GgmlKind::Q8_0 => {
                    let mut acc = [0f32; GROUPS];
                    for b in 0..nb {
                        let d = dw(b) * dx(b);
                        for (g, a) in acc.iter_mut().enumerate() {
                            #[allow(clippy::cast_precision_loss)] // |sum| <= 4 * 128 * 128
                            let s = group(b, g) as f32;
                            *a = d.mul_add(s, *a);
                        }
                    }
                    ((acc[0] + acc[4]) + (acc[2] + acc[6]))
                        + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
                }
            };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::{
        __m512, __m512i, _mm512_add_ps, _mm512_cvtepi32_ps, _mm512_dpbusd_epi32, _mm512_fmadd_ps,
        _mm512_loadu_ps, _mm512_loadu_si512, _mm512_mul_ps, _mm512_set1_epi32, _mm512_set1_ps,
        _mm512_setzero_ps, _mm512_setzero_si512, _mm512_storeu_ps, _mm512_sub_epi32,
    };

    use super::{GROUPS, GgmlKind, QuantizedX, TILE_BLOCK, TILE_ROWS, Tile};
    use crate::kernels::avx512::Token;

    /// `x` rows a pass over a Q5_0 tile's codes (four sums in registers each).
    const XS_Q5_0: usize = 4;
    /// `x` rows a pass over a Q8_0 tile's codes (eight f32 lanes each).
    const XS_Q8_0: usize = 2;

    /// One tile's outputs `[batch, 16]` (see the module's doc).
    pub(super) fn tile(_: Token, tile: &Tile<'_>, x: &QuantizedX, out: &mut [f32]) {
        let nb = x.nb;
        assert!(
            tile.codes.len() == nb * TILE_BLOCK
                && tile.scales.len() == nb * TILE_ROWS
                && out.len() == x.batch * TILE_ROWS
                && x.words.len() == x.batch * nb * GROUPS
                && (tile.kind == GgmlKind::Q5_0 || x.uwords.len() == x.batch * nb * GROUPS)
                && x.block_sums.len() == x.batch * nb
                && x.d.len() == x.batch * nb,
            "ggml tile: inconsistent lengths"
        );
        let mut r = 0;
        // SAFETY: the token proves the features; the lengths were checked above and
        // every call has `r + N <= batch`.
        unsafe {
            match tile.kind {
                GgmlKind::Q5_0 => {
                    while r + XS_Q5_0 <= x.batch {
                        q5_0::<XS_Q5_0>(tile, x, r, out);
                        r += XS_Q5_0;
                    }
                    while r < x.batch {
                        q5_0::<1>(tile, x, r, out);
                        r += 1;
                    }
                }
                GgmlKind::Q8_0 => {
                    let signed = Signed::new(tile);
                    while r + XS_Q8_0 <= x.batch {
                        q8_0::<XS_Q8_0>(tile, &signed, x, r, out);
                        r += XS_Q8_0;
                    }
                    while r < x.batch {
                        q8_0::<1>(tile, &signed, x, r, out);
                        r += 1;
                    }
                }
            }
        }
    }

    /// The biased sums of group `g` of block `b` for rows `r..r + N` of `x`: one
    /// `vpdpbusd` a row.
    ///
    /// # Safety
    /// AVX-512 F, BW and VNNI; `b < nb`, `g < 8`, `r + N <= batch`, lengths as [`tile`]
    /// checks them.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn group<const N: usize>(
        tile: &Tile<'_>,
        x: &QuantizedX,
        r: usize,
        b: usize,
        g: usize,
        acc: &mut [__m512i; N],
    ) {
        // SAFETY: 64 bytes at `b * 512 + g * 64` with `b < nb`, `g < 8`: inside `codes`
        // (`nb * 512` long)
        let w =
            unsafe { _mm512_loadu_si512(tile.codes.as_ptr().add(b * TILE_BLOCK + g * 64).cast()) };
        for (n, a) in acc.iter_mut().enumerate() {
            // SAFETY: word `((r + n) * nb + b) * 8 + g` with `r + n < batch`, `b < nb`,
            // `g < 8`: inside `x.words` (`batch * nb * 8` long)
            let four = unsafe { *x.words.as_ptr().add(((r + n) * x.nb + b) * GROUPS + g) };
            *a = _mm512_dpbusd_epi32(*a, w, _mm512_set1_epi32(four));
        }
    }

    /// Rows `r..r + N` of `x` against a Q5_0 tile.
    ///
    /// # Safety
    /// As [`group`], for every block.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn q5_0<const N: usize>(tile: &Tile<'_>, x: &QuantizedX, r: usize, out: &mut [f32]) {
        let nb = x.nb;
        let mut sumf: [__m512; N] = [_mm512_setzero_ps(); N];
        for b in 0..nb {
            let mut acc: [__m512i; N] = [_mm512_setzero_si512(); N];
            for g in 0..GROUPS {
                // SAFETY: as this function's
                unsafe { group(tile, x, r, b, g, &mut acc) };
            }
            // SAFETY: 16 scales at `b * 16`, inside `scales` (`nb * 16` long)
            let dw = unsafe { _mm512_loadu_ps(tile.scales.as_ptr().add(b * TILE_ROWS)) };
            for (n, (f, a)) in sumf.iter_mut().zip(acc).enumerate() {
                let i = (r + n) * nb + b;
                let sumi = _mm512_sub_epi32(a, _mm512_set1_epi32(16 * x.block_sums[i]));
                let s = _mm512_mul_ps(_mm512_cvtepi32_ps(sumi), dw);
                let s = _mm512_mul_ps(s, _mm512_set1_ps(x.d[i]));
                *f = _mm512_add_ps(*f, s);
            }
        }
        for (n, f) in sumf.into_iter().enumerate() {
            // SAFETY: 16 floats at `(r + n) * 16`, inside `out` (`batch * 16` long)
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add((r + n) * TILE_ROWS), f) };
        }
    }

    /// A Q8_0 tile made ready for [`q8_0`]: the weights as signed bytes (the stored codes'
    /// sign bits flipped back) and, for each block and group of four columns, the 16 rows'
    /// sums of the weights times -128, the start of the group's sums.
    pub(super) struct Signed {
        codes: Vec<u8>,
        starts: Vec<[i32; TILE_ROWS]>,
    }

    impl Signed {
        pub(super) fn new(tile: &Tile<'_>) -> Self {
            let codes: Vec<u8> = tile.codes.iter().map(|u| u ^ 0x80).collect();
            let starts = codes
                .chunks_exact(4 * TILE_ROWS)
                .map(|group| {
                    std::array::from_fn(|j| {
                        -128 * group[4 * j..4 * j + 4]
                            .iter()
                            .map(|&c| i32::from(c.cast_signed()))
                            .sum::<i32>()
                    })
                })
                .collect();
            Self { codes, starts }
        }
    }

    /// Rows `r..r + N` of `x` against a Q8_0 tile. Each group's exact sum
    /// `S = Σ w·q` is `Σ w·(q + 128) - 128 Σ w`: one `vpdpbusd` of the biased `x` (unsigned)
    /// and the signed weights, started from the tile's `-128 Σ w`.
    ///
    /// # Safety
    /// AVX-512 F, BW and VNNI; `r + N <= batch`, lengths as [`tile`] checks them, and
    /// `signed` made from the same tile.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn q8_0<const N: usize>(
        tile: &Tile<'_>,
        signed: &Signed,
        x: &QuantizedX,
        r: usize,
        out: &mut [f32],
    ) {
        let nb = x.nb;
        let mut lanes: [[__m512; GROUPS]; N] = [[_mm512_setzero_ps(); GROUPS]; N];
        for b in 0..nb {
            // SAFETY: 16 scales at `b * 16`, inside `scales` (`nb * 16` long)
            let dw = unsafe { _mm512_loadu_ps(tile.scales.as_ptr().add(b * TILE_ROWS)) };
            let d: [__m512; N] =
                std::array::from_fn(|n| _mm512_mul_ps(dw, _mm512_set1_ps(x.d[(r + n) * nb + b])));
            #[allow(clippy::needless_range_loop)] // `g` also picks the codes and the words
            for g in 0..GROUPS {
                let at = b * GROUPS + g;
                // SAFETY: 64 bytes at `at * 64` and 16 starts at `at`, with `b < nb` and
                // `g < 8`: inside `signed` (`nb * 512` bytes, `nb * 8` starts)
                let (w, start) = unsafe {
                    (
                        _mm512_loadu_si512(signed.codes.as_ptr().add(at * 64).cast()),
                        _mm512_loadu_si512(signed.starts.as_ptr().add(at).cast()),
                    )
                };
                for (n, l) in lanes.iter_mut().enumerate() {
                    // SAFETY: word `((r + n) * nb + b) * 8 + g` with `r + n < batch`:
                    // inside `x.uwords` (`batch * nb * 8` long)
                    let four = unsafe { *x.uwords.as_ptr().add(((r + n) * nb + b) * GROUPS + g) };
                    let sum = _mm512_dpbusd_epi32(start, _mm512_set1_epi32(four), w);
                    l[g] = _mm512_fmadd_ps(d[n], _mm512_cvtepi32_ps(sum), l[g]);
                }
            }
        }
        for (n, l) in lanes.into_iter().enumerate() {
            let s = _mm512_add_ps(
                _mm512_add_ps(_mm512_add_ps(l[0], l[4]), _mm512_add_ps(l[2], l[6])),
                _mm512_add_ps(_mm512_add_ps(l[1], l[5]), _mm512_add_ps(l[3], l[7])),
            );
            // SAFETY: 16 floats at `(r + n) * 16`, inside `out` (`batch * 16` long)
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add((r + n) * TILE_ROWS), s) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::round_to_i8;

    #[test]
    #[allow(clippy::cast_possible_truncation)]
    fn round_to_i8_is_round_then_the_saturating_cast() {
        let mut values = vec![
            0.0,
            -0.0,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            1e-45,
            3e9,
            -3e9,
        ];
        // every half and its neighbours across the range and past it
        for k in -600..=600 {
            let h = k as f32 * 0.5;
            values.extend([h, h.next_up(), h.next_down()]);
        }
        let mut s = 0x9e37_79b9_u32;
        for _ in 0..100_000 {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            values.push(f32::from_bits(s));
        }
        for v in values {
            assert_eq!(
                round_to_i8(v),
                v.round() as i8,
                "{v:e} ({:#010x})",
                v.to_bits()
            );
        }
    }
}
