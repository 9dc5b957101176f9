//! One of our formats against one of candle's (llama.cpp's formats) on the same 4096 x
//! 4096 weights, in strict alternation, for a speed ratio that a noisy machine cannot tilt:
//! `cargo run --release -p compressme-benches --example peer_probe -- FORMAT PEER [PAIRS
//! [BATCH [MATRICES [TIER]]]]` (defaults `nf4-g64 q4k 400 1 1 best`; PEER is `q8_0`, `q4_0`,
//! `q4k`, `q6k` or `q5_0`).
//!
//! Each pair times one product of ours and one of candle's, one right after the other (the
//! order swapped every pair), on matrix `p % MATRICES` of both sides: 1 keeps the weights
//! in cache, 8 or more (9 MB of 4-bit weights each, a side) streams them from memory. It
//! prints the median and quartiles of the per-pair ratios (ours over candle's time) and
//! each side's median time. The thread count is `RAYON_NUM_THREADS`'s, for both sides.
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
        "q4k" | "q4_k" => LlamaFormat::Q4K,
        "q6k" | "q6_k" => LlamaFormat::Q6K,
        "q5_0" => LlamaFormat::Q5_0,
        p => return Err(format!("peer {p}: q8_0, q4_0, q4k, q6k or q5_0")),
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
    // one untimed pass over every matrix first
    for i in 0..mats {
        run_ours(i)?;
        run_theirs(i)?;
    }
    let (mut a, mut b, mut r) = (Vec::new(), Vec::new(), Vec::new());
    for p in 0..pairs {
        let i = p % mats;
        let (ta, tb) = if p % 2 == 0 {
            let ta = run_ours(i)?;
            (ta, run_theirs(i)?)
        } else {
            let tb = run_theirs(i)?;
            (run_ours(i)?, tb)
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
    println!(
        "{name} [{tier}] over candle {peer:?}, batch {batch}, {mats} matri{}, {pairs} pairs: \
         median ratio {:.3} (quartiles {:.3}-{:.3}); median ms ours {:.3}, candle {:.3}",
        if mats == 1 { "x" } else { "ces" },
        q(0.5),
        q(0.25),
        q(0.75),
        1e3 * median(a),
        1e3 * median(b),
    );
    Ok(())
}
