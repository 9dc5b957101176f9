//! MiniLM with packed storage against the dense model, in one run:
//! `cargo run --release -p compressme-benches --bin model-report -- [--threads N] [--rounds R]`.
//!
//! Prints a markdown table, one row per variant (lossless word embeddings; every linear as
//! INT8, NF4 per row, NF4 group 64, or, run by candle's own kernels on the same weights,
//! llama.cpp's Q8_0 and Q4_K, the latter Q5_0 on 384-wide rows as llama.cpp's quantizer
//! would store them): stored bytes of the whole model, the cosine similarity
//! of its sentence embeddings to the dense model's over the golden sentences
//! (fixtures/bert/minilm_golden.json), and forward time for 32 x 128 tokens and for one
//! 12-token sentence as a ratio to dense. Timing is interleaved: every round times dense
//! and then each variant (in an order that changes from round to round); a ratio is the
//! median over rounds of variant time / dense time in that round.

use std::time::Instant;

use candle_core::{Device, Tensor};
use compressme_benches::{cosine, cpu_features, minilm_dir, minilm_variants, random_ids};
use compressme_nn::bert::mean_pool_normalize;
use compressme_nn::{Bert, Model, SentenceEmbedder};

type Fallible<T> = Result<T, Box<dyn std::error::Error>>;

use compressme_eval::median;

fn main() -> Fallible<()> {
    let mut threads = 1usize;
    let mut rounds = 5usize;
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let v: usize = it.next().ok_or(format!("{k} needs a value"))?.parse()?;
        match k.as_str() {
            "--threads" => threads = v.max(1),
            "--rounds" => rounds = v.max(1),
            _ => return Err(format!("unknown option {k} (--threads N, --rounds R)").into()),
        }
    }
    if std::env::var("RAYON_NUM_THREADS").ok() != Some(threads.to_string()) {
        let status = std::process::Command::new(std::env::current_exe()?)
            .args(std::env::args().skip(1))
            .env("RAYON_NUM_THREADS", threads.to_string())
            .status()?;
        return if status.success() {
            Ok(())
        } else {
            Err(format!("{status}").into())
        };
    }
    let variants = minilm_variants().ok_or("run `cargo xtask fixtures` first")?;
    let dev = Device::Cpu;
    // sentence embeddings through each variant, with the real tokenizer
    let golden: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../fixtures/bert/minilm_golden.json"),
    )?)?;
    let sentences: Vec<&str> = golden["sentences"]
        .as_array()
        .ok_or("no sentences")?
        .iter()
        .filter_map(|s| s.as_str())
        .collect();
    let tok = SentenceEmbedder::from_dir(&minilm_dir(), &dev)?;
    let (ids, types, mask) = tok.tokenize(&sentences)?;
    let embed = |m: &Bert| -> Fallible<Vec<Vec<f32>>> {
        Ok(mean_pool_normalize(&m.forward(&ids, Some(&types), &mask)?, &mask)?.to_vec2::<f32>()?)
    };
    let dense = &variants.last().ok_or("no variants")?.1;
    let want = embed(dense)?;
    let dense_bytes = dense.storage_report().stored_bytes();

    let shapes = [(32usize, 128usize), (1, 12)];
    let inputs: Vec<(Tensor, Tensor)> = shapes
        .iter()
        .map(|&(b, t)| {
            let ids = Tensor::from_vec(random_ids(b * t, 30522, 5), (b, t), &dev)?;
            let mask = ids.ones_like()?;
            Ok((ids, mask))
        })
        .collect::<Fallible<_>>()?;
    let n = variants.len();
    let mut samples = vec![vec![Vec::new(); shapes.len()]; n];
    for round in 0..rounds {
        eprintln!("round {}/{rounds}", round + 1);
        for (si, (ids, mask)) in inputs.iter().enumerate() {
            let reps = if shapes[si].0 == 1 { 20 } else { 1 };
            let time = |m: &Bert| -> Fallible<f64> {
                let mut best = f64::INFINITY;
                for _ in 0..reps {
                    let t = Instant::now();
                    m.forward(ids, None, mask)?;
                    best = best.min(t.elapsed().as_secs_f64());
                }
                Ok(best)
            };
            let d = time(dense)?;
            for k in 0..n - 1 {
                let k = if round % 2 == 0 { k } else { n - 2 - k };
                let i = (k + round) % (n - 1);
                let t = time(&variants[i].1)?;
                samples[i][si].push((t, t / d));
            }
            samples[n - 1][si].push((d, 1.0));
        }
    }
    println!(
        "{threads} thread(s), {rounds} interleaved rounds; ratios are medians of per-round variant / dense time.\n"
    );
    println!(
        "CPU features: {}; our kernel tier: {}; candle's quantized kernels: {}.\n",
        cpu_features(),
        compressme_quant::kernel_tier().map_or_else(|e| e.to_string(), |t| t.name().to_string()),
        compressme_nn::candle_kernel_tier()
    );
    println!(
        "| variant | stored bytes | / dense | cosine to dense, mean | min | 32 x 128 s | / dense | 1 x 12 ms | / dense |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for (i, (name, m)) in variants.iter().enumerate() {
        let got = embed(m)?;
        let cos: Vec<f64> = got.iter().zip(&want).map(|(a, b)| cosine(a, b)).collect();
        let stored = m.storage_report().stored_bytes();
        let t = |si: usize| median(samples[i][si].iter().map(|p| p.0).collect());
        let r = |si: usize| median(samples[i][si].iter().map(|p| p.1).collect());
        println!(
            "| {name} | {stored} | {:.4} | {:.6} | {:.6} | {:.3} | {:.3}x | {:.2} | {:.3}x |",
            stored as f64 / dense_bytes as f64,
            cos.iter().sum::<f64>() / cos.len() as f64,
            cos.iter().copied().fold(f64::INFINITY, f64::min),
            t(0),
            r(0),
            1e3 * t(1),
            r(1)
        );
    }
    Ok(())
}
