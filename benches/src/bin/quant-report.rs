//! Our quantized formats beside llama.cpp's (through candle), on the same weights:
//! `cargo run --release -p compressme-benches --bin quant-report -- [--threads N] [--rounds R]`.
//!
//! Prints one markdown table, a row per format: stored bits a weight, RMSE relative to the
//! weights' RMS on three fixed 256 x 512 matrices (Gaussian, Student-t with 3 degrees of
//! freedom, rows with outliers), quantize throughput (GB/s of f32 input, 4096 x 4096), and
//! `y = x W^T` for W 4096 x 4096 at batch 1 and 32 as a ratio to dense f32 (candle's
//! `x.matmul(&w.t())`).
//!
//! Timing is interleaved: every round times dense f32 and then every format, and a
//! format's ratio is the median over rounds of its time over dense's time in the same
//! round, so a busy neighbour slows both sides of each ratio; the formats take turns in a
//! different order each round. The thread count goes to
//! both candle and our kernels through `RAYON_NUM_THREADS` (the binary re-runs itself
//! with it set).
//!
//! Our formats run once per kernel tier this CPU supports besides the portable one
//! (`--tiers best` for the fastest only; `--tiers all` adds the portable tier), each row
//! naming its tier; every tier gives the same bits, so only the times differ. Beside each
//! batch-1 time is a **read floor**: the time one thread takes to stream a buffer of the
//! weights' stored size, measured in the same rounds (a sum over it, best of the same
//! repetitions), so it is cached or not exactly as the weights are. The CPU's features and
//! candle's kernel path are printed above the table.
//!
//! The integer formats run a second time with 8-bit activations (`Activations::Block8`,
//! rows marked `x8`; `--activations 14` leaves them out, `8` keeps only them beside the
//! half formats); the 8-bit formats run batch 1 on 14-bit activations either way, so
//! their `x8` rows leave it blank.

use std::time::{Duration, Instant};

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use compressme_benches::cpu_features;
use compressme_nn::{LlamaFormat, candle_kernel_tier, llama_quantize};
use compressme_quant::synthetic::{MatrixKind, matrix, rel_rmse};
use compressme_quant::{
    Activations, Backend, Format, GroupSize, Packed, Tier, matmul_into_using, quantize,
};

const ERR_ROWS: usize = 256;
const ERR_COLS: usize = 512;
const N: usize = 4096;

type Fallible<T> = Result<T, String>;

fn s<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

struct Args {
    threads: usize,
    rounds: usize,
    tiers: Vec<Tier>,
    /// Which activations the integer formats run.
    activations: Vec<Activations>,
}

fn args() -> Fallible<Args> {
    let simd: Vec<Tier> = Tier::ALL
        .into_iter()
        .filter(|t| *t != Tier::Portable && t.supported())
        .collect();
    let mut a = Args {
        threads: 1,
        rounds: 9,
        tiers: simd.clone(),
        activations: vec![Activations::Fixed14, Activations::Block8],
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let v = it.next().ok_or(format!("{k} needs a value"))?;
        let count =
            || -> Fallible<usize> { v.parse().map_err(|_| format!("{k}: `{v}` is not a count")) };
        match k.as_str() {
            "--threads" => a.threads = count()?.max(1),
            "--rounds" => a.rounds = count()?.max(1),
            "--activations" => {
                a.activations = match v.as_str() {
                    "14" => vec![Activations::Fixed14],
                    "8" => vec![Activations::Block8],
                    "both" => vec![Activations::Fixed14, Activations::Block8],
                    _ => return Err(format!("--activations {v}: 14, 8 or both")),
                }
            }
            "--tiers" => {
                a.tiers = match v.as_str() {
                    "best" => vec![Tier::best()],
                    "simd" => simd.clone(),
                    "all" => Tier::ALL.into_iter().filter(|t| t.supported()).collect(),
                    name => {
                        let t = Tier::from_name(name).ok_or(format!(
                            "--tiers {name}: best, simd, all, or a tier ({})",
                            Tier::ALL.map(Tier::name).join(", ")
                        ))?;
                        if !t.supported() {
                            return Err(format!("--tiers {name}: this CPU lacks {}", t.needs()));
                        }
                        vec![t]
                    }
                }
            }
            _ => {
                return Err(format!(
                    "unknown option {k} (--threads N, --rounds R, --tiers best|simd|all|NAME, --activations 14|8|both)"
                ));
            }
        }
    }
    if a.tiers.is_empty() {
        a.tiers = vec![Tier::Portable];
    }
    Ok(a)
}

/// Seconds to stream `buf` once (a wrapping sum in eight lanes), best of `reps`.
fn read_floor(buf: &[u64], reps: usize) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..reps {
        let t = Instant::now();
        let mut acc = [0u64; 8];
        for c in buf.chunks_exact(8) {
            for (a, v) in acc.iter_mut().zip(c) {
                *a = a.wrapping_add(*v);
            }
        }
        std::hint::black_box(acc);
        best = best.min(t.elapsed().as_secs_f64());
    }
    best
}

/// A kernel under test: ours (on a tier) or candle's.
enum Kernel {
    Ours(std::rc::Rc<Packed>, Tier, Activations),
    Candle(QMatMul),
}

struct Row {
    name: String,
    bits: f64,
    rmse: [f64; 3],
    quantize_gbs: f64,
    kernel: Kernel,
    /// The weights' stored bytes at 4096 x 4096.
    stored: usize,
    /// Per batch size: (time, ratio to dense) per round.
    samples: [Vec<(f64, f64)>; 2],
    /// Seconds to stream the stored bytes, per round.
    floor: Vec<f64>,
}

fn best_of(reps: usize, mut f: impl FnMut() -> Fallible<()>) -> Fallible<Duration> {
    let mut best = Duration::MAX;
    for _ in 0..reps {
        let t = Instant::now();
        f()?;
        best = best.min(t.elapsed());
    }
    Ok(best)
}

use compressme_eval::median;

fn ours_rows(
    format: Format,
    name: &str,
    mats: &[Vec<f32>],
    w: &[f32],
    tiers: &[Tier],
    activations: &[Activations],
) -> Fallible<Vec<Row>> {
    let mut rmse = [0.0; 3];
    let mut bits = 0.0;
    for (r, m) in rmse.iter_mut().zip(mats) {
        let q = quantize(m, ERR_ROWS, ERR_COLS, format).map_err(s)?;
        let mut back = vec![0f32; m.len()];
        q.dequantize_into(&mut back).map_err(s)?;
        *r = rel_rmse(m, &back);
        bits = 8.0 * q.stored_bytes() as f64 / (ERR_ROWS * ERR_COLS) as f64;
    }
    let mut packed = None;
    let t = best_of(3, || {
        packed = Some(quantize(w, N, N, format).map_err(s)?);
        Ok(())
    })?;
    let packed = std::rc::Rc::new(packed.ok_or("no packed weights")?);
    let half = matches!(format, Format::F16 | Format::Bf16);
    let acts: &[Activations] = if half {
        &[Activations::Fixed14]
    } else {
        activations
    };
    Ok(acts
        .iter()
        .flat_map(|&a| tiers.iter().map(move |&tier| (a, tier)))
        .map(|(a, tier)| Row {
            name: match a {
                Activations::Block8 => format!("ours {name} [{tier}, x8]"),
                _ => format!("ours {name} [{tier}]"),
            },
            bits,
            rmse,
            quantize_gbs: (N * N * 4) as f64 / t.as_secs_f64() / 1e9,
            stored: packed.stored_bytes(),
            kernel: Kernel::Ours(packed.clone(), tier, a),
            samples: [Vec::new(), Vec::new()],
            floor: Vec::new(),
        })
        .collect())
}

fn candle_row(f: LlamaFormat, mats: &[Vec<f32>], wt: &Tensor) -> Fallible<Row> {
    let mut rmse = [0.0; 3];
    let mut bits = 0.0;
    for (r, m) in rmse.iter_mut().zip(mats) {
        let q = llama_quantize(m, ERR_ROWS, ERR_COLS, f).map_err(s)?;
        *r = rel_rmse(m, &q.dequantized);
        bits = 8.0 * q.stored_bytes as f64 / (ERR_ROWS * ERR_COLS) as f64;
    }
    let dtype = f.ggml();
    let mut qt = None;
    let t = best_of(3, || {
        qt = Some(QTensor::quantize(wt, dtype).map_err(s)?);
        Ok(())
    })?;
    let qt = qt.ok_or("no tensor")?;
    let stored = qt.storage_size_in_bytes();
    let qm = QMatMul::from_qtensor(qt).map_err(s)?;
    Ok(Row {
        stored,
        floor: Vec::new(),
        name: format!("llama.cpp {f:?} (candle)"),
        bits,
        rmse,
        quantize_gbs: (N * N * 4) as f64 / t.as_secs_f64() / 1e9,
        kernel: Kernel::Candle(qm),
        samples: [Vec::new(), Vec::new()],
    })
}

fn main() -> Fallible<()> {
    let a = args()?;
    if std::env::var("RAYON_NUM_THREADS").ok() != Some(a.threads.to_string()) {
        // candle reads its thread count from the environment: run again with it set
        let exe = std::env::current_exe().map_err(s)?;
        let status = std::process::Command::new(exe)
            .args(std::env::args().skip(1))
            .env("RAYON_NUM_THREADS", a.threads.to_string())
            .status()
            .map_err(s)?;
        return if status.success() {
            Ok(())
        } else {
            Err(format!("report failed: {status}"))
        };
    }
    let mats: Vec<Vec<f32>> = MatrixKind::ALL
        .iter()
        .map(|&k| matrix(k, ERR_ROWS, ERR_COLS, 42))
        .collect();
    let w = matrix(MatrixKind::Gaussian, N, N, 1);
    let dev = Device::Cpu;
    let wt = Tensor::from_slice(&w, (N, N), &dev).map_err(s)?;

    let mut rows = Vec::new();
    let mut ours = vec![
        (Format::F16, "F16".to_string()),
        (Format::Bf16, "BF16".to_string()),
        (Format::Int8, "INT8 (per row)".to_string()),
        (Format::Nf4, "NF4 (per row)".to_string()),
    ];
    for g in [GroupSize::G32, GroupSize::G64, GroupSize::G128] {
        ours.push((Format::Nf4Block(g), format!("NF4 g{}", g.get())));
        ours.push((Format::Int4Block(g), format!("INT4 g{} (asym)", g.get())));
    }
    for (f, name) in &ours {
        eprintln!("quantizing {name}");
        rows.extend(ours_rows(*f, name, &mats, &w, &a.tiers, &a.activations)?);
    }
    for f in LlamaFormat::ALL {
        eprintln!("quantizing {f:?}");
        rows.push(candle_row(f, &mats, &wt)?);
    }

    let batches = [1usize, 32];
    let xs: Vec<(Vec<f32>, Tensor)> = batches
        .iter()
        .map(|&b| {
            let x = matrix(MatrixKind::Gaussian, b, N, 2);
            let t = Tensor::from_slice(&x, (b, N), &dev).map_err(s)?;
            Ok((x, t))
        })
        .collect::<Fallible<_>>()?;
    // the largest stored matrix is f32's 64 MiB; nothing here is larger
    let stream: Vec<u64> = (0..(N * N * 4 / 8) as u64).collect();
    let mut dense = [Vec::new(), Vec::new()];
    for round in 0..a.rounds {
        eprintln!("timing round {}/{}", round + 1, a.rounds);
        for (bi, &batch) in batches.iter().enumerate() {
            let (x, xt) = &xs[bi];
            let reps = if batch == 1 { 20 } else { 3 };
            let d = best_of(reps, || {
                xt.matmul(&wt.t().map_err(s)?).map_err(s)?;
                Ok(())
            })?
            .as_secs_f64();
            dense[bi].push(d);
            // a different order each round, so no format always follows the same one
            let n = rows.len();
            for k in 0..n {
                // rotated by the round, and reversed every other round
                let k = if round % 2 == 0 { k } else { n - 1 - k };
                let Some(row) = rows.get_mut((k + round) % n) else {
                    continue;
                };
                if batch == 1
                    && matches!(&row.kernel, Kernel::Ours(p, _, Activations::Block8) if p.format().code_bits() != 4)
                {
                    // the 8-bit formats run a single row on 14-bit activations: the other
                    // row's time
                    continue;
                }
                let mut y = vec![0f32; batch * N];
                let t = best_of(reps, || {
                    match &row.kernel {
                        Kernel::Ours(p, tier, acts) => {
                            matmul_into_using(Backend::Tier(*tier), *acts, x, batch, p, &mut y)
                                .map_err(s)?;
                        }
                        Kernel::Candle(q) => {
                            q.forward(xt).map_err(s)?;
                        }
                    }
                    Ok(())
                })?
                .as_secs_f64();
                row.samples[bi].push((t, t / d));
                if batch == 1 {
                    let buf = &stream[..row.stored.div_ceil(8).min(stream.len())];
                    row.floor.push(read_floor(buf, reps));
                }
            }
        }
    }

    println!(
        "{} thread(s), {} interleaved rounds; ratios are medians of per-round time / dense f32 time.\n",
        a.threads, a.rounds
    );
    println!(
        "CPU features: {}; our tiers: {}; candle's quantized kernels: {}.\n",
        cpu_features(),
        a.tiers
            .iter()
            .map(|t| t.name())
            .collect::<Vec<_>>()
            .join(", "),
        candle_kernel_tier()
    );
    println!(
        "| format | bits/weight | rel. RMSE Gaussian | Student-t (3) | outlier rows | quantize GB/s | batch 1 ms | / dense | read floor ms | / floor | batch 32 ms | / dense |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    println!(
        "| dense f32 (candle) | 32 | 0 | 0 | 0 | - | {:.3} | 1.00x | - | - | {:.2} | 1.00x |",
        1e3 * median(dense[0].clone()),
        1e3 * median(dense[1].clone())
    );
    for row in &rows {
        if row.samples[0].is_empty() {
            let t = 1e3 * median(row.samples[1].iter().map(|p| p.0).collect());
            let r = median(row.samples[1].iter().map(|p| p.1).collect());
            println!(
                "| {} | {:.3} | {:.5} | {:.5} | {:.5} | {:.2} | - | - | - | - | {t:.2} | {r:.2}x |",
                row.name, row.bits, row.rmse[0], row.rmse[1], row.rmse[2], row.quantize_gbs,
            );
            continue;
        }
        let t = |i: usize| 1e3 * median(row.samples[i].iter().map(|p| p.0).collect());
        let r = |i: usize| median(row.samples[i].iter().map(|p| p.1).collect());
        let floor = 1e3 * median(row.floor.clone());
        println!(
            "| {} | {:.3} | {:.5} | {:.5} | {:.5} | {:.2} | {:.3} | {:.2}x | {:.3} | {:.2}x | {:.2} | {:.2}x |",
            row.name,
            row.bits,
            row.rmse[0],
            row.rmse[1],
            row.rmse[2],
            row.quantize_gbs,
            t(0),
            r(0),
            floor,
            median(
                row.samples[0]
                    .iter()
                    .zip(&row.floor)
                    .map(|(p, f)| p.0 / f)
                    .collect()
            ),
            t(1),
            r(1)
        );
    }
    Ok(())
}
