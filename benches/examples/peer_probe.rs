//! One of our formats against one of candle's (llama.cpp's formats) on the same 4096 x
//! 4096 weights, in strict alternation, for a speed ratio that a noisy machine cannot tilt:
//! `cargo run --release -p compressme-benches --example peer_probe -- FORMAT PEER [PAIRS
//! [BATCH [MATRICES [TIER [RUN]]]]]` (defaults `nf4-g64 q4k 400 1 1 best 1`; PEER is `q8_0`,
//! `q4_0`, `q4_1`, `q4k`, `q6k` or `q5_0`).
//!
//! Each pair times one product of ours and one of candle's, one right after the other (the
//! order swapped every pair), on matrix `p % MATRICES` of both sides: 1 keeps the weights
//! in cache, 8 or more (9 MB of 4-bit weights each, a side) streams them from memory. It
//! prints the median and quartiles of the per-pair ratios (ours over candle's time) and
//! each side's median time. The thread count is `RAYON_NUM_THREADS`'s, for both sides.
//!
//! With RUN above 1, each side of a pair is a run of RUN products back to back (its time
//! the median of the run's products after the first), and the process sleeps 5 ms before
//! each run. On more than one thread this is the fair comparison: candle's worker threads
//! spin for about a millisecond after each product (its barrier pool) and rayon's go to
//! sleep sooner, so in strict alternation each side's product shares the cores with the
//! other side's idle workers, and ours wakes sleeping ones. A run measures each side as a
//! model runs it, one product after another.
use std::time::Instant;

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use compressme_benches::cpu_features;
use compressme_eval::median;
use compressme_nn::{LlamaFormat, candle_kernel_tier};
use compressme_quant::synthetic::{MatrixKind, matrix};
use compressme_quant::{Activations, Backend, Format, Tier, matmul_into_using, quantize};

fn main() -> Result<(), String> {
    let s = |e: &dyn std::fmt::Display| e.to_string();
    let mut args = std::env::args().skip(1);
    let name = args.next().unwrap_or_else(|| "nf4-g64".into());
    let peer_name = args.next().unwrap_or_else(|| "q4k".into());
    let mut count = |default: usize| -> Result<usize, String> {
        args.next()
            .map_or(Ok(default), |v| v.parse().map_err(|e| format!("{v}: {e}")))
    };
    let pairs = count(400)?.max(1);
    let batch = count(1)?.max(1);
    let mats = count(1)?.max(1);
    let run = match std::env::args().nth(7) {
        None => 1,
        Some(v) => v.parse::<usize>().map_err(|e| format!("{v}: {e}"))?.max(1),
    };
    let tier = match std::env::args().nth(6) {
        None => Tier::best(),
        Some(t) if t == "best" => Tier::best(),
        Some(t) => Tier::from_name(&t)
            .filter(|t| t.supported())
            .ok_or(format!("tier {t}: unknown or not on this CPU"))?,
    };
    let peer = match peer_name.to_ascii_lowercase().as_str() {
        "q8_0" => LlamaFormat::Q8_0,
        "q4_0" => LlamaFormat::Q4_0,
        "q4_1" => LlamaFormat::Q4_1,
        "q4k" | "q4_k" => LlamaFormat::Q4K,
        "q6k" | "q6_k" => LlamaFormat::Q6K,
        "q5_0" => LlamaFormat::Q5_0,
        p => return Err(format!("peer {p}: q8_0, q4_0, q4_1, q4k, q6k or q5_0")),
    };
    let format = Format::parse(&name).map_err(|e| s(&e))?;
    let n = 4096;
    let dev = Device::Cpu;
    let mut ours = Vec::new();
    let mut theirs = Vec::new();
    for i in 0..mats {
        let w = matrix(MatrixKind::Gaussian, n, n, 1 + i as u64);
        ours.push(quantize(&w, n, n, format).map_err(|e| s(&e))?);
        let wt = Tensor::from_slice(&w, (n, n), &dev).map_err(|e| s(&e))?;
        let q = QTensor::quantize(&wt, peer.ggml()).map_err(|e| s(&e))?;
        theirs.push(QMatMul::from_qtensor(q).map_err(|e| s(&e))?);
    }
    let x = matrix(MatrixKind::Gaussian, batch, n, 2);
    let xt = Tensor::from_slice(&x, (batch, n), &dev).map_err(|e| s(&e))?;
    let mut y = vec![0f32; batch * n];
    let mut run_ours = |i: usize| -> Result<f64, String> {
        let t = Instant::now();
        matmul_into_using(
            Backend::Tier(tier),
            Activations::Auto,
            &x,
            batch,
            &ours[i],
            &mut y,
        )
        .map_err(|e| s(&e))?;
        Ok(t.elapsed().as_secs_f64())
    };
    let run_theirs = |i: usize| -> Result<f64, String> {
        let t = Instant::now();
        theirs[i].forward(&xt).map_err(|e| s(&e))?;
        Ok(t.elapsed().as_secs_f64())
    };
    // one untimed pass over every matrix first; ours' first product builds any in-memory
    // layout the kernels use (`Packed::layout_bytes`)
    let mut first = 0.0;
    for i in 0..mats {
        first += run_ours(i)?;
        run_theirs(i)?;
    }
    // one product, or the median of a run's products after its first
    let timed = |f: &mut dyn FnMut(usize) -> Result<f64, String>, p: usize| {
        if run == 1 {
            return f(p % mats);
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
        let mut t = Vec::with_capacity(run);
        for k in 0..run {
            let dt = f((p * run + k) % mats)?;
            if k > 0 {
                t.push(dt);
            }
        }
        Ok(median(t))
    };
    let (mut a, mut b, mut r) = (Vec::new(), Vec::new(), Vec::new());
    let mut run_theirs = run_theirs;
    for p in 0..pairs {
        let (ta, tb) = if p % 2 == 0 {
            let ta = timed(&mut run_ours, p)?;
            (ta, timed(&mut run_theirs, p)?)
        } else {
            let tb = timed(&mut run_theirs, p)?;
            (timed(&mut run_ours, p)?, tb)
        };
        a.push(ta);
        b.push(tb);
        r.push(ta / tb);
    }
    r.sort_by(f64::total_cmp);
    let q = |f: f64| r[((r.len() - 1) as f64 * f).round() as usize];
    println!(
        "CPU features: {}; candle's kernels: {}; threads {}",
        cpu_features(),
        candle_kernel_tier(),
        rayon::current_num_threads()
    );
    let built: usize = ours.iter().map(|w| w.layout_bytes()).sum();
    let stored: usize = ours.iter().map(|w| w.stored_bytes()).sum();
    println!(
        "ours' first product of each matrix: {:.3} ms in all; in-memory layouts built {:.1} MB \
         beside {:.1} MB stored",
        1e3 * first,
        built as f64 / 1e6,
        stored as f64 / 1e6
    );
    println!(
        "{name} [{tier}] over candle {peer:?}, batch {batch}, {mats} matri{}, {pairs} pairs{}: \
         median ratio {:.3} (quartiles {:.3}-{:.3}); median ms ours {:.3}, candle {:.3}",
        if mats == 1 { "x" } else { "ces" },
        if run > 1 {
            format!(" of runs of {run}")
        } else {
            String::new()
        },
        q(0.5),
        q(0.25),
        q(0.75),
        1e3 * median(a),
        1e3 * median(b),
    );
    Ok(())
}
