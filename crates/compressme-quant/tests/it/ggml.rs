//! `GgmlMatrix`: every tier against independent transcriptions of ggml's reference
//! `quantize_row_q8_0` and `vec_dot_q5_0_q8_0` and of candle's AVX2 `vec_dot_q8_0_q8_0`,
//! bit for bit.

use compressme_quant::{Backend, Error, GgmlKind, GgmlMatrix, Tier};
use half::f16;

use crate::Rng;

/// Random blocks: any codes, finite scales of mixed magnitudes (zero included).
fn blocks(kind: GgmlKind, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let mut out = Vec::with_capacity(rows * cols / 32 * kind.block_bytes());
    for i in 0..rows * cols / 32 {
        let d = if i % 17 == 5 {
            0.0
        } else {
            (rng.normal() * 0.01 * 10f64.powi((i % 5) as i32 - 2)) as f32
        };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        for _ in 0..kind.block_bytes() - 2 {
            out.push((rng.next_u64() & 0xFF) as u8);
        }
    }
    out
}

/// The references, transcribed: `x`'s row rounded to Q8_0 (ggml's), then ggml's Q5_0 dot
/// product or candle's AVX2 Q8_0 one, block by block, reading the blocks as stored.
fn reference(
    kind: GgmlKind,
    bytes: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    batch: usize,
) -> Vec<f32> {
    let nb = cols / 32;
    let mut y = vec![0f32; batch * rows];
    for r in 0..batch {
        let mut q = vec![0i8; cols];
        let mut d = vec![0f32; nb];
        for b in 0..nb {
            let xs = &x[r * cols + b * 32..][..32];
            let mut amax = 0f32;
            for &v in xs {
                amax = amax.max(v.abs());
            }
            let dd = amax / ((1 << 7) - 1) as f32;
            let id = if dd != 0f32 { 1. / dd } else { 0. };
            d[b] = f16::from_f32(dd).to_f32();
            for (k, &v) in xs.iter().enumerate() {
                q[b * 32 + k] = f32::round(v * id) as i8;
            }
        }
        for row in 0..rows {
            let sumf = match kind {
                GgmlKind::Q5_0 => q5_0_dot(&bytes[row * nb * 22..][..nb * 22], &q, &d),
                _ => q8_0_dot(&bytes[row * nb * 34..][..nb * 34], &q, &d),
            };
            y[r * rows + row] = sumf;
        }
    }
    y
}

/// `vec_dot_q5_0_q8_0` as ggml's reference (and candle 0.11) writes it.
fn q5_0_dot(row: &[u8], q: &[i8], d: &[f32]) -> f32 {
    let mut sumf = 0f32;
    for (b, blk) in row.chunks_exact(22).enumerate() {
        let dw = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
        let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
        let qs = &blk[6..];
        let mut sumi = 0i32;
        for j in 0..16 {
            let xh_0 = (((qh & (1u32 << j)) >> j) << 4) as u8;
            let xh_1 = ((qh & (1u32 << (j + 16))) >> (j + 12)) as u8;
            let x0 = ((qs[j] & 0x0F) as i32 | xh_0 as i32) - 16;
            let x1 = ((qs[j] >> 4) as i32 | xh_1 as i32) - 16;
            sumi += (x0 * q[b * 32 + j] as i32) + (x1 * q[b * 32 + j + 16] as i32);
        }
        sumf += sumi as f32 * dw * d[b];
    }
    sumf
}

/// candle's AVX2 `vec_dot_q8_0_q8_0` in scalar form: eight f32 lanes of four products
/// each, `acc = fma(dw * dx, lane, acc)`, then its horizontal sum's order.
fn q8_0_dot(row: &[u8], q: &[i8], d: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for (b, blk) in row.chunks_exact(34).enumerate() {
        let dd = f16::from_le_bytes([blk[0], blk[1]]).to_f32() * d[b];
        for (l, a) in acc.iter_mut().enumerate() {
            let s: i32 = (0..4)
                .map(|t| (blk[2 + 4 * l + t] as i8) as i32 * q[b * 32 + 4 * l + t] as i32)
                .sum();
            *a = dd.mul_add(s as f32, *a);
        }
    }
    let hi_lo: Vec<f32> = (0..4).map(|i| acc[i + 4] + acc[i]).collect();
    (hi_lo[0] + hi_lo[2]) + (hi_lo[1] + hi_lo[3])
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

#[test]
fn every_tier_gives_the_reference_bits() {
    for kind in [GgmlKind::Q5_0, GgmlKind::Q8_0] {
        every_tier_gives_the_reference_bits_for(kind);
    }
}

fn every_tier_gives_the_reference_bits_for(kind: GgmlKind) {
    let mut rng = Rng::new(7);
    // 37 rows: two whole tiles and a part one; batches across the 4-row steps
    for (rows, cols, batch) in [(37, 576, 9), (16, 32, 1), (5, 1536, 4), (40, 64, 3)] {
        let bytes = blocks(kind, rows, cols, &mut rng);
        let mut x: Vec<f32> = (0..batch * cols)
            .map(|i| (rng.normal() * 10f64.powi((i / 32 % 7) as i32 - 3)) as f32)
            .collect();
        // a block of zeros (scale 0) and one with a huge value
        x[..32].fill(0.0);
        if x.len() > 64 {
            x[40] = 3.0e30;
        }
        let want = bits(&reference(kind, &bytes, rows, cols, &x, batch));
        let m = GgmlMatrix::from_blocks(kind, &bytes, rows, cols).unwrap();
        for tier in Tier::ALL {
            if !tier.supported() {
                eprintln!("skipped: tier {tier} (this CPU lacks {})", tier.needs());
                continue;
            }
            let got = m.matmul_with(Backend::Tier(tier), &x, batch).unwrap();
            assert_eq!(
                bits(&got),
                want,
                "tier {tier}, [{rows}, {cols}] at batch {batch}"
            );
        }
        assert_eq!(bits(&m.matmul(&x, batch).unwrap()), want);
    }
}

#[test]
fn bad_shapes_and_lengths_are_refused() {
    let k = GgmlKind::Q5_0;
    let bytes = vec![0u8; 2 * k.block_bytes()];
    assert!(matches!(
        GgmlMatrix::from_blocks(k, &bytes, 2, 48),
        Err(Error::Shape(_))
    ));
    assert!(matches!(
        GgmlMatrix::from_blocks(k, &bytes, 0, 32),
        Err(Error::Shape(_))
    ));
    assert!(matches!(
        GgmlMatrix::from_blocks(k, &bytes[1..], 2, 32),
        Err(Error::Malformed(_))
    ));
    assert!(matches!(
        GgmlMatrix::from_blocks(GgmlKind::Q8_0, &bytes, 2, 32),
        Err(Error::Malformed(_))
    ));
    let m = GgmlMatrix::from_blocks(k, &bytes, 2, 32).unwrap();
    assert_eq!((m.rows(), m.cols()), (2, 32));
    assert!(matches!(m.matmul(&[0.0; 33], 1), Err(Error::Shape(_))));
    assert_eq!(m.matmul(&[1.0; 64], 2).unwrap(), vec![0.0; 4]);
}
