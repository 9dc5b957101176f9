//! One MiniLM-sized linear at a few rows: dense candle against packed kernels.
//! `RAYON_NUM_THREADS=1 cargo run --release -p compressme-benches --example linear_small`

use candle_core::{Device, Tensor};
use compressme_benches::median_time;
use compressme_nn::{Hooks, Linear, Storage};
use compressme_quant::synthetic::{MatrixKind, matrix};
use compressme_quant::{Format, GroupSize};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::Cpu;
    for (out, inp) in [(384usize, 384usize), (1536, 384), (384, 1536)] {
        let w = Tensor::from_vec(matrix(MatrixKind::Gaussian, out, inp, 1), (out, inp), &dev)?;
        let dense = Linear::new("l", w, None, Hooks::default())?;
        for rows in [1usize, 12, 32, 64, 128, 256] {
            let x = Tensor::from_vec(
                matrix(MatrixKind::Gaussian, rows, inp, 2),
                (1, rows, inp),
                &dev,
            )?;
            let td = median_time(200, || {
                dense.forward(&x).map(drop).unwrap_or(());
            });
            let mut line = format!(
                "{out}x{inp} rows {rows}: dense {:.1} us",
                td.as_secs_f64() * 1e6
            );
            for f in [Format::Int8, Format::Nf4Block(GroupSize::G64)] {
                let mut l = dense.clone();
                l.set_weight(l.prepare(&Storage::Quant(f), &dev)?)?;
                let t = median_time(200, || {
                    l.forward(&x).map(drop).unwrap_or(());
                });
                line += &format!(
                    ", {f} {:.1} us ({:.2}x)",
                    t.as_secs_f64() * 1e6,
                    t.as_secs_f64() / td.as_secs_f64()
                );
            }
            println!("{line}");
        }
    }
    // what a module pays for the hook when no observer is installed
    let hooks = Hooks::default();
    let x = Tensor::zeros((1, 4), candle_core::DType::F32, &dev)?;
    let n = 1_000_000;
    let t = std::time::Instant::now();
    for _ in 0..n {
        hooks.observe(std::hint::black_box("layer"), &x)?;
    }
    println!(
        "hook check with no observer: {:.1} ns a call",
        t.elapsed().as_secs_f64() * 1e9 / f64::from(n)
    );
    Ok(())
}
