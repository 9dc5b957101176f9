//! Scoring alone, without a model: a reference and a variant of random logits over
//! SmolLM2's vocabulary (49,152 entries), one document of 1,024 tokens in windows of 512
//! at stride 256, as the real-model benchmark scores them. Prints the microseconds a
//! target of `score_documents` (the reference, its distributions and probabilities kept)
//! and of `score_against` (a variant against it).
//!
//! ```sh
//! cargo build --release -p compressme-eval --example score_probe
//! taskset -c 1 target/release/examples/score_probe
//! ```

use std::time::Instant;

use compressme_eval::{Window, score_against, score_documents};

fn main() -> Result<(), compressme_eval::Error> {
    const VOCAB: usize = 49_152;
    const TOKENS: usize = 1_024;
    let docs = vec![
        (0..TOKENS as u32)
            .map(|i| (i * 7_919) % VOCAB as u32)
            .collect::<Vec<u32>>(),
    ];
    let window = Window {
        len: 512,
        stride: 256,
    };
    let mut rng = compressme_quant::synthetic::Rng::new(7);
    let reference_rows: Vec<Vec<f32>> = (0..TOKENS)
        .map(|_| {
            (0..VOCAB)
                .map(|_| (rng.uniform() * 12.0 - 6.0) as f32)
                .collect()
        })
        .collect();
    let variant_rows: Vec<Vec<f32>> = reference_rows
        .iter()
        .map(|r| r.iter().map(|v| v * 1.01).collect())
        .collect();
    let rows_of = |rows: &[Vec<f32>], asked: std::ops::Range<usize>| -> Vec<Vec<f32>> {
        asked.filter_map(|i| rows.get(i).cloned()).collect()
    };
    let t = Instant::now();
    let reference = score_documents(&docs, window, true, |_, asked| {
        Ok(rows_of(&reference_rows, asked))
    })?
    .with_probabilities();
    let reference_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let (_, shift) = score_against(&docs, window, &reference, |_, asked| {
        Ok(rows_of(&variant_rows, asked))
    })?;
    let variant_s = t.elapsed().as_secs_f64();
    let targets = reference.tokens.len() as f64;
    println!(
        "{targets} targets: the reference {:.1} µs a target, a variant {:.1} µs a target (KL {:e})",
        reference_s / targets * 1e6,
        variant_s / targets * 1e6,
        shift.kl_mean
    );
    Ok(())
}
