//! One format's product (4096 x 4096) on each SIMD tier, interleaved, for profiling a
//! kernel: `cargo run --release -p compressme-benches --example tier_probe -- FORMAT
//! [REPS [TIER|all [BATCH [ACTIVATIONS [SIZE]]]]]` (defaults `nf4-g64 200 all 1 auto 4096`,
//! the matrix SIZE x SIZE, or ROWS x COLS when SIZE is written `ROWSxCOLS`, e.g.
//! `49152x576` for SmolLM2's output layer);
//! ACTIVATIONS is `auto`, `14`, `8` or `both`, the last interleaving 14- and 8-bit
//! activations); prints each tier's best time, and a checksum of the last output's bits (so
//! two settings of one binary, e.g. `COMPRESSME_REPACK=0`, can be seen to give the same).
use std::time::Instant;

use compressme_quant::synthetic::{MatrixKind, matrix};
use compressme_quant::{Activations, Backend, Format, Tier, matmul_into_using, quantize};

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
    let acts: Vec<Activations> = match args.next().as_deref() {
        None => vec![Activations::Auto],
        Some("both") => vec![Activations::Fixed14, Activations::Block8],
        Some(a) => vec![Activations::from_name(a).ok_or(format!("activations {a}?"))?],
    };
    let size = args.next().unwrap_or_else(|| "4096".into());
    let (r, c) = size.split_once('x').unwrap_or((&size, &size));
    let rows: usize = r.parse().map_err(|e| format!("rows in {size}: {e}"))?;
    let n: usize = c.parse().map_err(|e| format!("columns in {size}: {e}"))?;
    let format = Format::parse(&name).map_err(|e| e.to_string())?;
    let w = quantize(&matrix(MatrixKind::Gaussian, rows, n, 1), rows, n, format)
        .map_err(|e| e.to_string())?;
    let x = matrix(MatrixKind::Gaussian, batch, n, 2);
    let mut y = vec![0f32; batch * rows];
    let runs: Vec<(Tier, Activations)> = Tier::ALL
        .into_iter()
        .filter(|t| *t != Tier::Portable && t.supported())
        .filter(|t| only.as_deref().is_none_or(|o| o == t.name()))
        .flat_map(|t| acts.iter().map(move |&a| (t, a)))
        .collect();
    let mut best = vec![f64::MAX; runs.len()];
    for _ in 0..reps {
        for (b, &(t, a)) in best.iter_mut().zip(&runs) {
            let s = Instant::now();
            matmul_into_using(Backend::Tier(t), a, &x, batch, &w, &mut y)
                .map_err(|e| e.to_string())?;
            *b = b.min(s.elapsed().as_secs_f64());
        }
    }
    let sum = y.iter().fold(0u64, |h, v| {
        h.wrapping_mul(31).wrapping_add(u64::from(v.to_bits()))
    });
    println!("checksum of the last output's bits: {sum:016x}");
    for (b, (t, a)) in best.iter().zip(&runs) {
        println!(
            "{name} [{t}] batch {batch}, activations {}: {:.3} ms (best of {reps})",
            a.name(),
            1e3 * b
        );
    }
    Ok(())
}
