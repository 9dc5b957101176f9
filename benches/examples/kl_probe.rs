//! The KL against a kept reference with and without its probabilities worked out once
//! (`Scored::with_probabilities`), alternated, on one thread: TARGETS rows of a VOCAB-wide
//! vocabulary of pseudo-random logits, as the sensitivity stage scores them.
//!
//! `RAYON_NUM_THREADS=1 target/release/examples/kl_probe [TARGETS] [VOCAB] [ROUNDS]`
//! (defaults 512, 49152, 5).

use std::time::Instant;

use compressme_eval::{Rows, Window, score_against, score_documents};

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let targets = args.first().copied().unwrap_or(512);
    let vocab = args.get(1).copied().unwrap_or(49_152);
    let rounds = args.get(2).copied().unwrap_or(5);
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32
    };
    let ids: Vec<u32> = (0..=targets)
        .map(|_| (next() * vocab as f32) as u32)
        .collect();
    let logits_of = |scale: f32, next: &mut dyn FnMut() -> f32| -> Vec<Vec<f32>> {
        (0..targets)
            .map(|_| (0..vocab).map(|_| scale * 8.0 * next()).collect())
            .collect()
    };
    let p = logits_of(1.0, &mut next);
    let q: Vec<Vec<f32>> = p
        .iter()
        .map(|r| r.iter().map(|v| v + 0.1 * next()).collect())
        .collect();
    let docs = vec![ids];
    let window = Window {
        len: targets + 1,
        stride: targets + 1,
    };
    fn run(rows: &[Vec<f32>]) -> impl FnMut(&[u32], Rows) -> Result<Vec<Vec<f32>>, String> + '_ {
        move |_, r| Ok(rows[r].to_vec())
    }
    let bare = score_documents(&docs, window, true, run(&p)).expect("reference");
    let t = Instant::now();
    let cached = bare.clone().with_probabilities();
    let prepare = t.elapsed().as_secs_f64();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let t = Instant::now();
        let (_, s1) = score_against(&docs, window, &bare, run(&q)).expect("bare");
        a.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        let (_, s2) = score_against(&docs, window, &cached, run(&q)).expect("cached");
        b.push(t.elapsed().as_secs_f64());
        assert_eq!(s1.kl_mean.to_bits(), s2.kl_mean.to_bits());
    }
    a.sort_by(f64::total_cmp);
    b.sort_by(f64::total_cmp);
    println!(
        "{targets} targets x {vocab}: exp taken again {:.3} s, probabilities kept {:.3} s (medians of {rounds}; ratio {:.3}); kept once in {prepare:.3} s",
        a[rounds / 2],
        b[rounds / 2],
        b[rounds / 2] / a[rounds / 2]
    );
}
