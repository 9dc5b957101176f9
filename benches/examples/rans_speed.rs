//! Decode time a byte, rANS tables against Huffman tables, one thread:
//! `cargo run --release -p compressme-benches --example rans_speed`.
//!
//! Two synthetic planes of 4 Mi bytes, stored as 1-byte elements (one plane, no transform)
//! in 64-row blocks of 384 bytes: mantissa-like (almost uniform, about 7.99 bits a byte)
//! and exponent-like (a few values, about 1.8 bits); then the same bytes as 2-byte elements
//! (an exponent-like and a mantissa-like plane, as bf16) and as 4-byte elements (one
//! exponent-like and three mantissa-like planes, as f32), 384 elements a row, where a
//! block's planes are decoded together. Best of 5 passes over every block, one block at a
//! time (`decode_block`) and all blocks at once (`decode_blocks`, which decodes the rANS
//! planes of six blocks side by side).
use compressme_blockstore::{BlockStore, Coder, EncodeOptions, ValueKind};
use compressme_shuffle::ElementSize;

fn main() -> Result<(), String> {
    let mut s = 1u64;
    let mut next = || {
        s = s
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (s >> 33) as f64 / (1u64 << 31) as f64
    };
    let n = 1usize << 22;
    let block_rows = 64;
    let mantissa: Vec<u8> = (0..n).map(|_| (next().powf(1.15) * 256.0) as u8).collect();
    let exponent: Vec<u8> = (0..n)
        .map(|_| (118.0 + (next() * 1e-3).ln().max(-12.0)) as u8)
        .collect();
    let bf16: Vec<u8> = (0..n / 2)
        .flat_map(|i| [mantissa[i], exponent[i]])
        .collect();
    let f32: Vec<u8> = (0..n / 4)
        .flat_map(|i| {
            [
                mantissa[i],
                mantissa[n / 4 + i],
                mantissa[n / 2 + i],
                exponent[i],
            ]
        })
        .collect();
    for (name, data, size) in [
        ("mantissa-like", &mantissa, ElementSize::One),
        ("exponent-like", &exponent, ElementSize::One),
        ("bf16-like planes", &bf16, ElementSize::Two),
        ("f32-like planes", &f32, ElementSize::Four),
    ] {
        let row_bytes = 384 * size.bytes();
        for coder in [
            Coder::SharedRans { max_tables: 4 },
            Coder::SharedHuffman { max_tables: 4 },
        ] {
            let mut opts = EncodeOptions::new(ValueKind::Bytes(size))
                .block_rows(block_rows)
                .coder(coder);
            opts.parallel = false;
            opts.max_coded_fraction = 1.0;
            // whole blocks only, so every block fills `out`
            let rows = (n / row_bytes / block_rows * block_rows) as u64;
            let data = &data[..rows as usize * row_bytes];
            let store =
                BlockStore::encode(data, rows, row_bytes, &opts).map_err(|e| e.to_string())?;
            let mut dec = store.decoder();
            let mut out = vec![0u8; block_rows * row_bytes];
            let mut best = f64::MAX;
            for _ in 0..5 {
                let t = std::time::Instant::now();
                for b in 0..store.num_blocks() {
                    let got = dec
                        .decode_block(b, &mut out[..])
                        .map_err(|e| e.to_string())?;
                    std::hint::black_box(got);
                }
                best = best.min(t.elapsed().as_secs_f64());
            }
            // the same blocks through `decode_blocks`, six at a time side by side
            let mut all = vec![0u8; data.len()];
            let mut together = f64::MAX;
            for _ in 0..5 {
                let t = std::time::Instant::now();
                dec.decode_blocks(0..store.num_blocks(), &mut all)
                    .map_err(|e| e.to_string())?;
                together = together.min(t.elapsed().as_secs_f64());
            }
            if all != data {
                return Err(format!("{name}: decode_blocks gave other bytes"));
            }
            let stored = store.stored_bytes();
            println!(
                "{name}, {coder:?}: {:.3} bits a byte stored, {:.2} ns a byte decoded one block at a time, {:.2} blocks together",
                stored.payload as f64 * 8.0 / data.len() as f64,
                best * 1e9 / data.len() as f64,
                together * 1e9 / data.len() as f64
            );
        }
    }
    Ok(())
}
