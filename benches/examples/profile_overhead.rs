//! Profiling time against plain forward passes over the same tokens (MiniLM, the
//! committed calibration text): `cargo run --release -p compressme-benches --example
//! profile_overhead`. Alternates plain and profiled passes for 3 rounds and reports
//! medians; the per-format error estimates (a one-off pass over the weights) are timed
//! separately.

use std::time::Instant;

use candle_core::Device;
use compressme_benches::minilm_dir;
use compressme_nn::SentenceEmbedder;
use compressme_profile::{ActivationRecorder, ProfileSettings};

use compressme_eval::median;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let emb = SentenceEmbedder::from_dir(&minilm_dir(), &Device::Cpu)?;
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/calibration/docs_128.txt");
    let text = std::fs::read_to_string(path)?;
    let lines: Vec<&str> = text.lines().collect();
    let batches = lines
        .chunks(16)
        .map(|c| emb.tokenize(c))
        .collect::<Result<Vec<_>, _>>()?;
    let stats_only = ProfileSettings {
        candidates: Vec::new(),
        ..ProfileSettings::default()
    };
    let (mut plain, mut profiled) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let t = Instant::now();
        for (ids, types, mask) in &batches {
            emb.bert().forward(ids, Some(types), mask)?;
        }
        plain.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        let p = ActivationRecorder::new(stats_only.clone()).record(
            emb.bert(),
            &batches,
            |m, (i, t, k)| m.forward(i, Some(t), k).map(drop),
        )?;
        profiled.push(t.elapsed().as_secs_f64());
        assert!(p.tokens > 0);
    }
    let t = Instant::now();
    ActivationRecorder::new(ProfileSettings::default()).record(
        emb.bert(),
        &batches[..1],
        |m, (i, t, k)| m.forward(i, Some(t), k).map(drop),
    )?;
    let with_errors_one_batch = t.elapsed().as_secs_f64();
    let (p, q) = (median(plain), median(profiled));
    println!(
        "{} lines in {} batches: plain forward {p:.3} s, profiled {q:.3} s: {:.2}x; the error estimates for 9 formats add about {:.2} s once (one batch profiled with them: {with_errors_one_batch:.2} s)",
        lines.len(),
        batches.len(),
        q / p,
        with_errors_one_batch - q / batches.len() as f64
    );
    Ok(())
}
