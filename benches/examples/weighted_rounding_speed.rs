//! The speed of activation-aware rounding (`quantize_weighted`) on one SmolLM2-sized MLP
//! matrix (1,536 x 576, synthetic weights and importances), NF4-g64 and INT4-g64, best of
//! 5, with a hash of the codes and scales so that two builds can be checked for the same
//! output. `RAYON_NUM_THREADS=1 cargo run --release -p compressme-benches --example
//! weighted_rounding_speed`

use compressme_quant::{Format, GroupSize, quantize_weighted};

fn main() -> Result<(), compressme_quant::Error> {
    let (rows, cols) = (1536usize, 576usize);
    let mut s = 12345u64;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let w: Vec<f32> = (0..rows * cols).map(|_| next() * 0.1).collect();
    let imp: Vec<f32> = (0..cols).map(|_| next() + 0.6).collect();
    for f in [
        Format::Nf4Block(GroupSize::G64),
        Format::Int4Block(GroupSize::G64),
    ] {
        let mut best = f64::MAX;
        let mut h = 0u64;
        for _ in 0..5 {
            let t = std::time::Instant::now();
            let p = quantize_weighted(&w, rows, cols, f, &imp)?;
            best = best.min(t.elapsed().as_secs_f64());
            h = p
                .codes()
                .iter()
                .fold(0u64, |a, &b| a.wrapping_mul(31).wrapping_add(u64::from(b)));
            h = p.scales().iter().fold(h, |a, &b| {
                a.wrapping_mul(31).wrapping_add(u64::from(b.to_bits()))
            });
        }
        println!("{f}: {:.1} ms, output hash {h:016x}", best * 1e3);
    }
    Ok(())
}
