//! `Q5_0Matrix`: every tier against an independent transcription of ggml's reference
//! `quantize_row_q8_0` and `vec_dot_q5_0_q8_0`, bit for bit.

use compressme_quant::{Backend, Error, Q5_0_BLOCK_BYTES, Q5_0Matrix, Tier};
use half::f16;

use crate::Rng;

/// Random Q5_0 blocks: any codes, finite scales of mixed magnitudes (zero included).
fn blocks(rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let mut out = Vec::with_capacity(rows * cols / 32 * Q5_0_BLOCK_BYTES);
    for i in 0..rows * cols / 32 {
        let d = if i % 17 == 5 {
            0.0
        } else {
            (rng.normal() * 0.01 * 10f64.powi((i % 5) as i32 - 2)) as f32
        };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        for _ in 0..20 {
            out.push((rng.next_u64() & 0xFF) as u8);
        }
    }
    out
}

/// ggml's reference, transcribed: `x`'s row rounded to Q8_0, then the Q5_0 dot product
/// block by block, reading the blocks as stored.
fn reference(bytes: &[u8], rows: usize, cols: usize, x: &[f32], batch: usize) -> Vec<f32> {
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
            let mut sumf = 0f32;
            for b in 0..nb {
                let blk = &bytes[(row * nb + b) * 22..][..22];
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
            y[r * rows + row] = sumf;
        }
    }
    y
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

#[test]
fn every_tier_gives_ggml_reference_bits() {
    let mut rng = Rng::new(7);
    // 37 rows: two whole tiles and a part one; batches across the 4-row steps
    for (rows, cols, batch) in [(37, 576, 9), (16, 32, 1), (5, 1536, 4), (40, 64, 3)] {
        let bytes = blocks(rows, cols, &mut rng);
        let mut x: Vec<f32> = (0..batch * cols)
            .map(|i| (rng.normal() * 10f64.powi((i / 32 % 7) as i32 - 3)) as f32)
            .collect();
        // a block of zeros (scale 0) and one with a huge value
        x[..32].fill(0.0);
        if x.len() > 64 {
            x[40] = 3.0e30;
        }
        let want = bits(&reference(&bytes, rows, cols, &x, batch));
        let m = Q5_0Matrix::from_blocks(&bytes, rows, cols).unwrap();
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
    let bytes = vec![0u8; 2 * Q5_0_BLOCK_BYTES];
    assert!(matches!(
        Q5_0Matrix::from_blocks(&bytes, 2, 48),
        Err(Error::Shape(_))
    ));
    assert!(matches!(
        Q5_0Matrix::from_blocks(&bytes, 0, 32),
        Err(Error::Shape(_))
    ));
    assert!(matches!(
        Q5_0Matrix::from_blocks(&bytes[1..], 2, 32),
        Err(Error::Malformed(_))
    ));
    let m = Q5_0Matrix::from_blocks(&bytes, 2, 32).unwrap();
    assert_eq!((m.rows(), m.cols()), (2, 32));
    assert!(matches!(m.matmul(&[0.0; 33], 1), Err(Error::Shape(_))));
    assert_eq!(m.matmul(&[1.0; 64], 2).unwrap(), vec![0.0; 4]);
}
