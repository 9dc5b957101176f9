//! llama.cpp's Q5_0 weights times `x`, every output the bits of ggml's reference
//! `vec_dot_q5_0_q8_0` (which candle 0.11 runs for Q5_0, one scalar loop an output).
//!
//! # The arithmetic, and why the bits match
//! A Q5_0 block holds 32 weights `w = u - 16` (`u` five bits: a nibble of `qs`, its high
//! bit in `qh`) and an f16 scale `dw`. Each row of `x` is first rounded to Q8_0 blocks
//! as ggml's reference `quantize_row_q8_0` does: `d = amax / 127` (rounded to f16 where it
//! is stored, unrounded where it scales), `q = round(x / d)`. An output is then
//! `sumf = 0; for each block: sumf += (sumi as f32 * dw) * dx`, blocks in order, where
//! `sumi` is the block's exact integer sum of `w · q`. Integer sums are exact however
//! they are formed, and the f32 operations here are the same operations in the same
//! order (no fused multiply-add), so every tier gives the reference's bits.
//! - **Portable**: the definition, one output at a time.
//! - **AVX-512 VNNI**: the codes of 16 rows are interleaved at load (four consecutive
//!   columns of one row a 32-bit lane), so one `vpdpbusd` adds 64 products `u · q` into
//!   the 16 rows' sums; `16 · Σq` per block of `x` takes the bias back out. The f32 steps
//!   run in the 16 lanes, one row a lane, in the reference's order.
//!
//! Every `unsafe` here is a call of the `#[target_feature]` function, which the tier's
//! token makes sound (it exists only after the CPU was seen to have the features), or a
//! load inside a range checked before the loop (see the SAFETY notes).
#![allow(unsafe_code)]

use half::f16;
use rayon::prelude::*;

use super::Isa;
use crate::{Backend, Error, Result};

/// Weights in a Q5_0 block.
pub const Q5_0_BLOCK: usize = 32;
/// Bytes of a Q5_0 block: the f16 scale, 32 high bits, 16 bytes of nibbles.
pub const Q5_0_BLOCK_BYTES: usize = 22;
/// Rows interleaved in a tile.
const TILE_ROWS: usize = 16;
/// Bytes of one block of a tile: 32 codes of 16 rows.
const TILE_BLOCK: usize = Q5_0_BLOCK * TILE_ROWS;

/// A `[rows, cols]` matrix of llama.cpp's Q5_0 blocks, held for products that give ggml's
/// reference bits ([`Q5_0Matrix::matmul`]).
///
/// What it is not: a format of this crate's own ([`crate::Format`] has none with Q5_0's
/// rounding), and not compact: for the product's speed it keeps one byte a weight (the
/// codes biased to `0..32`, 16 rows interleaved) and an f32 scale a block of 32, 9 bits
/// a weight against Q5_0's 5.5.
#[derive(Debug, Clone)]
pub struct Q5_0Matrix {
    rows: usize,
    cols: usize,
    /// `u = w + 16` by tile, block, column group of four, row, column in the group.
    codes: Vec<u8>,
    /// `dw` by tile, block, row (0 for the padding rows).
    scales: Vec<f32>,
}

impl Q5_0Matrix {
    /// Reads `rows * cols / 32` Q5_0 blocks of 22 bytes (as GGUF stores them, row-major).
    ///
    /// # Errors
    /// [`Error::Shape`] for an empty shape or `cols` not a multiple of 32;
    /// [`Error::Malformed`] for a byte count that does not match.
    pub fn from_blocks(bytes: &[u8], rows: usize, cols: usize) -> Result<Self> {
        if rows == 0 || cols == 0 || !cols.is_multiple_of(Q5_0_BLOCK) {
            return Err(Error::Shape(format!(
                "Q5_0 needs rows > 0 and columns a positive multiple of {Q5_0_BLOCK}, got [{rows}, {cols}]"
            )));
        }
        let nb = cols / Q5_0_BLOCK;
        let want = rows
            .checked_mul(nb)
            .and_then(|n| n.checked_mul(Q5_0_BLOCK_BYTES))
            .ok_or_else(|| Error::Shape(format!("[{rows}, {cols}] overflows")))?;
        if bytes.len() != want {
            return Err(Error::Malformed(format!(
                "Q5_0 [{rows}, {cols}] takes {want} bytes, got {}",
                bytes.len()
            )));
        }
        let tiles = rows.div_ceil(TILE_ROWS);
        let mut codes = vec![16u8; tiles * nb * TILE_BLOCK];
        let mut scales = vec![0f32; tiles * nb * TILE_ROWS];
        for (r, row) in bytes.chunks_exact(nb * Q5_0_BLOCK_BYTES).enumerate() {
            let (t, j) = (r / TILE_ROWS, r % TILE_ROWS);
            for (b, block) in row.chunks_exact(Q5_0_BLOCK_BYTES).enumerate() {
                let at = (t * nb + b) * TILE_ROWS + j;
                scales[at] = f16::from_le_bytes([block[0], block[1]]).to_f32();
                let qh = u32::from_le_bytes([block[2], block[3], block[4], block[5]]);
                let qs = &block[6..];
                let tile = &mut codes[(t * nb + b) * TILE_BLOCK..][..TILE_BLOCK];
                for e in 0..Q5_0_BLOCK {
                    let nibble = if e < 16 {
                        qs[e] & 0x0F
                    } else {
                        qs[e - 16] >> 4
                    };
                    let high = u8::from((qh >> e) & 1 == 1) << 4;
                    tile[(e / 4) * 4 * TILE_ROWS + j * 4 + e % 4] = nibble | high;
                }
            }
        }
        Ok(Self {
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

    /// Bytes held in memory (the interleaved codes and the f32 scales).
    #[must_use]
    pub fn held_bytes(&self) -> usize {
        self.codes.len() + self.scales.len() * 4
    }

    /// `x W^T` for `x` of `[batch, cols]`, `[batch, rows]` out, on all cores with the
    /// tier [`crate::kernel_tier`] picks: every output the bits of ggml's reference
    /// `vec_dot_q5_0_q8_0` after `quantize_row_q8_0` of `x`'s row.
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
        let nb = self.cols / Q5_0_BLOCK;
        let xq = QuantizedX::new(x, batch, self.cols);
        let tiles = self.rows.div_ceil(TILE_ROWS);
        // each tile's outputs, `[batch, 16]`, then put in place
        let mut by_tile = vec![0f32; tiles * batch * TILE_ROWS];
        by_tile
            .par_chunks_mut(batch * TILE_ROWS)
            .enumerate()
            .for_each(|(t, out)| {
                let codes = &self.codes[t * nb * TILE_BLOCK..][..nb * TILE_BLOCK];
                let scales = &self.scales[t * nb * TILE_ROWS..][..nb * TILE_ROWS];
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512(token) => avx512::tile(token, codes, scales, &xq, out),
                    _ => portable_tile(codes, scales, &xq, out),
                }
            });
        let mut y = vec![0f32; batch * self.rows];
        for (r, yr) in y.chunks_exact_mut(self.rows).enumerate() {
            for (t, ys) in yr.chunks_mut(TILE_ROWS).enumerate() {
                let from = &by_tile[(t * batch + r) * TILE_ROWS..][..ys.len()];
                ys.copy_from_slice(from);
            }
        }
        Ok(y)
    }
}

/// `x`'s rows as ggml's reference `quantize_row_q8_0` rounds them.
struct QuantizedX {
    batch: usize,
    /// Blocks a row.
    nb: usize,
    /// `[batch, cols]` rounded values.
    q: Vec<i8>,
    /// The same, four consecutive values a little-endian word.
    words: Vec<i32>,
    /// `[batch, nb]` scales, as the f16 stored then read back.
    d: Vec<f32>,
    /// `[batch, nb]` sums of `q` (for the bias of the unsigned codes).
    sums: Vec<i32>,
}

impl QuantizedX {
    fn new(x: &[f32], batch: usize, cols: usize) -> Self {
        let nb = cols / Q5_0_BLOCK;
        let mut q = vec![0i8; batch * cols];
        let mut d = vec![0f32; batch * nb];
        let mut sums = vec![0i32; batch * nb];
        for (i, (xs, qs)) in x
            .chunks_exact(Q5_0_BLOCK)
            .zip(q.chunks_exact_mut(Q5_0_BLOCK))
            .enumerate()
        {
            let amax = xs.iter().fold(0f32, |a, &v| a.max(v.abs()));
            let scale = amax / 127.0;
            let inv = if scale == 0.0 { 0.0 } else { 1.0 / scale };
            d[i] = f16::from_f32(scale).to_f32();
            for (o, &v) in qs.iter_mut().zip(xs) {
                // `as` saturates, as the reference's cast does
                #[allow(clippy::cast_possible_truncation)]
                {
                    *o = (v * inv).round() as i8;
                }
            }
            sums[i] = qs.iter().map(|&v| i32::from(v)).sum();
        }
        let words = q
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([0, 1, 2, 3].map(|k| c[k].to_le_bytes()[0])))
            .collect();
        Self {
            batch,
            nb,
            q,
            words,
            d,
            sums,
        }
    }
}

/// One tile's outputs `[batch, 16]`: the definition, one output at a time.
fn portable_tile(codes: &[u8], scales: &[f32], x: &QuantizedX, out: &mut [f32]) {
    let nb = x.nb;
    for (r, o) in out.chunks_exact_mut(TILE_ROWS).enumerate() {
        let xq = &x.q[r * nb * Q5_0_BLOCK..][..nb * Q5_0_BLOCK];
        for (j, o) in o.iter_mut().enumerate() {
            let mut sumf = 0f32;
            for b in 0..nb {
                let tile = &codes[b * TILE_BLOCK..][..TILE_BLOCK];
                let mut sumi = 0i32;
                for e in 0..Q5_0_BLOCK {
                    let w = i32::from(tile[(e / 4) * 4 * TILE_ROWS + j * 4 + e % 4]) - 16;
                    sumi += w * i32::from(xq[b * Q5_0_BLOCK + e]);
                }
                #[allow(clippy::cast_precision_loss)] // |sumi| <= 32 * 16 * 128: exact
                let s = sumi as f32;
                sumf += s * scales[b * TILE_ROWS + j] * x.d[r * nb + b];
            }
            *o = sumf;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::{
        __m512, __m512i, _mm512_add_ps, _mm512_cvtepi32_ps, _mm512_dpbusd_epi32, _mm512_loadu_ps,
        _mm512_loadu_si512, _mm512_mul_ps, _mm512_set1_epi32, _mm512_set1_ps, _mm512_setzero_ps,
        _mm512_setzero_si512, _mm512_storeu_ps, _mm512_sub_epi32,
    };

    use super::{Q5_0_BLOCK, QuantizedX, TILE_BLOCK, TILE_ROWS};
    use crate::kernels::avx512::Token;

    /// `x` rows a pass over a tile's codes.
    const XS: usize = 4;

    /// One tile's outputs `[batch, 16]` (see the module's doc).
    pub(super) fn tile(_: Token, codes: &[u8], scales: &[f32], x: &QuantizedX, out: &mut [f32]) {
        let nb = x.nb;
        assert!(
            codes.len() == nb * TILE_BLOCK
                && scales.len() == nb * TILE_ROWS
                && out.len() == x.batch * TILE_ROWS
                && x.words.len() == x.batch * nb * Q5_0_BLOCK / 4
                && x.d.len() == x.batch * nb
                && x.sums.len() == x.batch * nb,
            "Q5_0 tile: inconsistent lengths"
        );
        let mut r = 0;
        // SAFETY: the token proves the features; the lengths were checked above and
        // every call has `r + N <= batch`.
        unsafe {
            while r + XS <= x.batch {
                rows::<XS>(codes, scales, x, r, out);
                r += XS;
            }
            while r < x.batch {
                rows::<1>(codes, scales, x, r, out);
                r += 1;
            }
        }
    }

    /// Rows `r..r + N` of `x` against the tile.
    ///
    /// # Safety
    /// The CPU has AVX-512 F, BW and VNNI; the lengths are as [`tile`] checks them and
    /// `r + N <= x.batch`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn rows<const N: usize>(
        codes: &[u8],
        scales: &[f32],
        x: &QuantizedX,
        r: usize,
        out: &mut [f32],
    ) {
        let nb = x.nb;
        let words = x.words.as_ptr();
        let mut sumf: [__m512; N] = [_mm512_setzero_ps(); N];
        for b in 0..nb {
            let mut acc: [__m512i; N] = [_mm512_setzero_si512(); N];
            // SAFETY: block `b < nb` starts inside `codes` (`nb * 512` long)
            let tile = unsafe { codes.as_ptr().add(b * TILE_BLOCK) };
            for g in 0..Q5_0_BLOCK / 4 {
                // SAFETY: 64 bytes at `b * 512 + g * 64`, `g < 8`: inside `codes`
                let w = unsafe { _mm512_loadu_si512(tile.add(g * 64).cast()) };
                for (n, a) in acc.iter_mut().enumerate() {
                    // SAFETY: word `((r + n) * nb + b) * 8 + g` with `r + n < batch`,
                    // `b < nb`, `g < 8`: inside `x.words` (`batch * nb * 8` long)
                    let four = unsafe { *words.add(((r + n) * nb + b) * (Q5_0_BLOCK / 4) + g) };
                    *a = _mm512_dpbusd_epi32(*a, w, _mm512_set1_epi32(four));
                }
            }
            // SAFETY: 16 scales at `b * 16`, inside `scales` (`nb * 16` long)
            let dw = unsafe { _mm512_loadu_ps(scales.as_ptr().add(b * TILE_ROWS)) };
            for (n, (f, a)) in sumf.iter_mut().zip(acc).enumerate() {
                let i = (r + n) * nb + b;
                let sumi = _mm512_sub_epi32(a, _mm512_set1_epi32(16 * x.sums[i]));
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
}
