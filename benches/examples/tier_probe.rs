//! One format's product (4096 x 4096) on each SIMD tier, interleaved, for profiling a
//! kernel: `cargo run --release -p compressme-benches --example tier_probe -- FORMAT
//! [REPS [TIER|all [BATCH]]]` (defaults `nf4-g64 200 all 1`); prints each tier's best time.
use std::time::Instant;

use compressme_quant::synthetic::{MatrixKind, matrix};
use compressme_quant::{Backend, Format, Tier, matmul_with, quantize};

fn main() -> Result<(), String> {
    let mut args = std::env::args().skip(1);
    let name = args.next().unwrap_or_else(|| "nf4-g64".into());
    let reps: usize = args
        .next()
        .map_or(Ok(200), |r| r.parse())
        .map_err(|e| format!("{e}"))?;
    let only = args.next().filter(|t| t != "all");
    let batch: usize = args
        .next()
        .map_or(Ok(1), |b| b.parse())
        .map_err(|e| format!("{e}"))?;
    let format = Format::parse(&name).map_err(|e| e.to_string())?;
    let n = 4096;
    let w = quantize(&matrix(MatrixKind::Gaussian, n, n, 1), n, n, format)
        .map_err(|e| e.to_string())?;
    let x = matrix(MatrixKind::Gaussian, batch, n, 2);
    let tiers: Vec<Tier> = Tier::ALL
        .into_iter()
        .filter(|t| *t != Tier::Portable && t.supported())
        .filter(|t| only.as_deref().is_none_or(|o| o == t.name()))
        .collect();
    let mut best = vec![f64::MAX; tiers.len()];
    for _ in 0..reps {
        for (b, &t) in best.iter_mut().zip(&tiers) {
            let s = Instant::now();
            matmul_with(Backend::Tier(t), &x, batch, &w).map_err(|e| e.to_string())?;
            *b = b.min(s.elapsed().as_secs_f64());
        }
    }
    for (b, t) in best.iter().zip(&tiers) {
        println!(
            "{name} [{t}] batch {batch}: {:.3} ms (best of {reps})",
            1e3 * b
        );
    }
    Ok(())
}
