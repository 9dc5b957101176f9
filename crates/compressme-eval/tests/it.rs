//! Windows count every target once, errors name where they happened, and the metrics on a
//! real (small, trained) model behave.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, missing_docs)] // tests

use std::cell::RefCell;

use candle_core::Device;
use compressme_eval::{Error, Rows, Window, paired, score_documents, shift, sign_test};

/// A fake model over a vocabulary of 50 that predicts token `t + 1` after token `t`, at
/// the rows asked for; it records each call's ids and rows.
#[allow(clippy::type_complexity)]
fn fake(
    calls: &RefCell<Vec<(Vec<u32>, Rows)>>,
) -> impl FnMut(&[u32], Rows) -> Result<Vec<Vec<f32>>, String> + '_ {
    move |ids: &[u32], rows: Rows| {
        calls.borrow_mut().push((ids.to_vec(), rows.clone()));
        Ok(ids[rows]
            .iter()
            .map(|&t| {
                (0..50)
                    .map(|v| if v == (t + 1) % 50 { 5.0 } else { 0.0 })
                    .collect()
            })
            .collect())
    }
}

/// Brute force: windows start at every multiple of `min(stride, len - 1)` below `n`; a
/// target `p` (1..n) is scored by the first window holding both `p - 1` and `p`.
fn brute_force(n: usize, len: usize, stride: usize) -> Vec<(usize, usize)> {
    let step = stride.min(len - 1);
    let starts: Vec<usize> = (0..n).step_by(step).collect();
    (1..n)
        .map(|p| {
            let start = starts
                .iter()
                .copied()
                .find(|&s| s < p && p < s + len)
                .expect("some window covers every target");
            (p, p - start)
        })
        .collect()
}

#[test]
fn every_target_is_scored_once_with_the_longest_context_the_window_allows() {
    // every combination: documents shorter than a window, stride 1, stride = len - 1,
    // stride = len and stride > len
    for n in 0..=24usize {
        for len in 2..=9usize {
            for stride in 1..=12usize {
                let doc: Vec<u32> = (0..n as u32).collect();
                let calls = RefCell::new(Vec::new());
                let s = score_documents(
                    &[doc.clone(), vec![7], doc.clone()],
                    Window { len, stride },
                    false,
                    fake(&calls),
                )
                .unwrap();
                let got: Vec<(usize, usize, usize)> = s
                    .tokens
                    .iter()
                    .map(|t| (t.doc, t.position, t.context))
                    .collect();
                let want: Vec<(usize, usize, usize)> = [0usize, 2]
                    .into_iter()
                    .flat_map(|d| {
                        brute_force(n, len, stride)
                            .into_iter()
                            .map(move |(p, c)| (d, p, c))
                    })
                    .collect();
                assert_eq!(got, want, "n {n} len {len} stride {stride}");
                for t in &s.tokens {
                    assert_eq!(t.target, t.position as u32);
                    // past the first window, a target sees at least the tokens windows
                    // overlap by
                    let overlap = len - stride.min(len - 1);
                    assert!(t.context >= overlap.min(t.position), "{t:?}");
                }
                // the fake model predicts every target: probability e^5 / (e^5 + 49)
                let p = 5f64.exp() / (5f64.exp() + 49.0);
                assert!(n < 2 || (s.mean_nll() + p.ln()).abs() < 1e-9);
                // every call is a slice of a document, no longer than the window (the
                // fake predicts each target from its row: a row off by one would miss
                // every target, and the mean NLL above would not be the fake's)
                assert!(calls.borrow().iter().all(|(c, _)| c.len() <= len
                    && (c.is_empty() || doc.windows(c.len()).any(|w| w == &c[..]))));
                // and asks for the rows its targets need, no more: one a target
                let asked: usize = calls.borrow().iter().map(|(_, r)| r.len()).sum();
                assert_eq!(asked, s.tokens.len(), "n {n} len {len} stride {stride}");
                // the window's last row predicts a token past it: never asked for
                assert!(calls.borrow().iter().all(|(c, r)| r.end < c.len()));
            }
        }
    }
    for bad in [Window { len: 1, stride: 1 }, Window { len: 4, stride: 0 }] {
        let r = score_documents(&[vec![1, 2]], bad, false, |_, _| Ok(vec![]));
        let ok = matches!(r, Err(Error::Invalid(_)));
        assert!(ok, "{bad:?} accepted");
    }
}

#[test]
fn errors_name_the_document_and_position() {
    let docs = vec![vec![1u32, 2, 3], vec![4, 5, 6, 7, 8, 9]];
    let e = score_documents(&docs, Window { len: 3, stride: 2 }, false, |ids, rows| {
        if ids.first() == Some(&6) {
            Err("boom".into())
        } else {
            Ok(rows.map(|_| vec![0.0; 10]).collect())
        }
    })
    .unwrap_err();
    let ok = matches!(
        e,
        Error::Model {
            doc: 1,
            start: 2,
            ..
        }
    );
    assert!(ok, "{e}");
    let e = score_documents(&docs, Window { len: 8, stride: 4 }, false, |ids, rows| {
        Ok(ids[rows]
            .iter()
            .map(|&t| {
                if t == 7 {
                    vec![f32::NAN; 10]
                } else {
                    vec![0.0; 10]
                }
            })
            .collect())
    })
    .unwrap_err();
    let ok = matches!(
        e,
        Error::NonFinite {
            doc: 1,
            position: 4,
            ..
        }
    );
    assert!(ok, "{e}");
}

/// A model that returns a row for every position of the window, not the rows asked for,
/// is refused by name, before anything is scored from rows that do not line up.
#[test]
fn rows_other_than_those_asked_for_are_refused() {
    let docs = vec![(0..20u32).collect::<Vec<u32>>()];
    let window = Window { len: 8, stride: 4 };
    let every_row = |ids: &[u32], _: Rows| Ok(ids.iter().map(|_| vec![0.0f32; 20]).collect());
    let e = score_documents(&docs, window, false, every_row).unwrap_err();
    match &e {
        Error::Invalid(m) => assert!(
            m.contains("8 logit rows where rows 0..7 of 8 tokens"),
            "{e}"
        ),
        other => panic!("refused as invalid rows, not: {other}"),
    }
    // the first window asks for rows 0..7 (its last row predicts a token past it)
    let calls = RefCell::new(Vec::new());
    score_documents(&docs, window, false, fake(&calls)).unwrap();
    let rows: Vec<Rows> = calls.borrow().iter().map(|(_, r)| r.clone()).collect();
    assert_eq!(rows, vec![0..7, 3..7, 3..7, 3..7]);
}

#[test]
fn paired_comparisons_and_the_sign_test() {
    assert!((sign_test(0, 10) - 2.0 / 1024.0).abs() < 1e-12);
    assert!((sign_test(5, 5) - 1.0).abs() < 1e-12);
    assert!((sign_test(2, 8) - 2.0 * (1.0 + 10.0 + 45.0) / 1024.0).abs() < 1e-12);
    let a: Vec<f64> = (0..500)
        .map(|i| 2.0 + ((i * 37) % 11) as f64 * 0.1)
        .collect();
    let b: Vec<f64> = a
        .iter()
        .enumerate()
        .map(|(i, x)| x - 0.05 + if i % 7 == 0 { 0.2 } else { 0.0 })
        .collect();
    let p = paired(&a, &b, 1000, 42).unwrap();
    assert_eq!(
        p,
        paired(&a, &b, 1000, 42).unwrap(),
        "same seed, same interval"
    );
    let other = paired(&a, &b, 1000, 43).unwrap();
    assert!(
        (other.ci_low, other.ci_high) != (p.ci_low, p.ci_high),
        "the seed drives the resampling"
    );
    assert_eq!(other.mean_diff, p.mean_diff);
    assert!(p.ci_low <= p.mean_diff && p.mean_diff <= p.ci_high);
    assert!(p.ci_high < 0.0, "b is better: {p:?}");
    assert!(p.sign_test_p < 1e-6);
    assert!(paired(&a, &b[..3], 10, 1).is_err());
}

fn logits(
    m: &compressme_nn::CausalLm,
) -> impl FnMut(&[u32], Rows) -> Result<Vec<Vec<f32>>, String> + '_ {
    move |ids: &[u32], rows: Rows| m.logit_rows_at(ids, rows).map_err(|e| e.to_string())
}

#[test]
fn a_quantized_causal_model_shifts_its_distributions() {
    use compressme_nn::causal::cyclic_batch;
    use compressme_nn::{AdamW, CausalConfig, CausalLm, Model, Storage};
    use compressme_quant::Format;
    use compressme_quant::synthetic::Rng;
    let cfg = CausalConfig {
        vocab: 16,
        width: 32,
        layers: 2,
        heads: 2,
        context: 16,
    };
    let dev = Device::Cpu;
    let model = CausalLm::new(cfg, 7, &dev).unwrap();
    let mut opt = AdamW::new(model.vars(), 3e-3, 0.01).unwrap();
    let mut rng = Rng::new(1);
    for _ in 0..120 {
        let (ids, targets) = cyclic_batch(&mut rng, 16, 16, 16, 3, &dev).unwrap();
        let loss = model.loss(&ids, &targets).unwrap();
        opt.step(model.vars(), &loss.backward().unwrap()).unwrap();
    }
    let (docs, _) = cyclic_batch(&mut Rng::new(99), 6, 40, 16, 3, &dev).unwrap();
    let docs: Vec<Vec<u32>> = docs.to_vec2::<u32>().unwrap();
    let w = Window { len: 16, stride: 8 };
    let reference = score_documents(&docs, w, true, logits(&model)).unwrap();
    let same = score_documents(&docs, w, true, logits(&model)).unwrap();
    // windows side by side in lanes: the same targets, likelihoods and distributions, bit
    // for bit, and a failing window's error as one at a time gives it
    for lanes in [1, 2, 3] {
        let side = compressme_eval::score_documents_in_lanes(&docs, w, true, lanes, |ids, rows| {
            model.logit_rows_at(ids, rows).map_err(|e| e.to_string())
        })
        .unwrap();
        assert_eq!(side.tokens, reference.tokens, "{lanes} lanes");
        let bits = |s: &compressme_eval::Scored| -> Vec<u32> {
            s.distributions
                .iter()
                .flatten()
                .map(|v| v.to_bits())
                .collect()
        };
        assert_eq!(bits(&side), bits(&reference), "{lanes} lanes");
        let refuse = |ids: &[u32], rows: Rows| {
            if ids.first() == docs[2].first() && rows.start > 0 {
                return Err("window refused".to_string());
            }
            model.logit_rows_at(ids, rows).map_err(|e| e.to_string())
        };
        let failing = compressme_eval::score_documents_in_lanes(&docs, w, true, lanes, refuse);
        let Err(compressme_eval::Error::Model { message, .. }) = &failing else {
            panic!("{lanes} lanes: not a window's failure: {failing:?}");
        };
        assert_eq!(message, "window refused", "{lanes} lanes");
        let alone = score_documents(&docs, w, true, refuse);
        assert_eq!(
            failing.map(|_| ()).map_err(|e| e.to_string()),
            alone.map(|_| ()).map_err(|e| e.to_string())
        );
    }
    let s0 = shift(&reference, &same).unwrap();
    // identical models: KL exactly zero, every top-1 the same, no probability moved
    assert_eq!(s0.kl_mean, 0.0);
    assert_eq!(s0.kl_p99, 0.0);
    assert_eq!(s0.top1_agreement, 1.0);
    assert_eq!(s0.dp_correct_abs_p99, 0.0);
    let mut q = model.clone();
    let changes: Vec<(String, Storage)> = q
        .module_names()
        .into_iter()
        .filter(|n| n != "tok_embeddings")
        .map(|n| (n, Storage::Quant(Format::Nf4)))
        .collect();
    q.set_storage(&changes).unwrap();
    let quant = score_documents(&docs, w, true, logits(&q)).unwrap();
    let s = shift(&reference, &quant).unwrap();
    println!(
        "f32 ppl {:.3}, nf4 ppl {:.3}, {s:?}",
        reference.perplexity(),
        quant.perplexity()
    );
    assert_eq!(s.targets, 6 * 39);
    assert!(s.kl_mean > 0.0 && s.kl_p99 >= s.kl_mean);
    assert!(s.top1_agreement > 0.5);
    // the streaming forms agree with keeping every distribution
    let (against, s2) = compressme_eval::score_against(&docs, w, &reference, logits(&q)).unwrap();
    assert_eq!(against.nll(), quant.nll());
    assert!(
        (s2.kl_mean - s.kl_mean).abs() < 1e-9 && s2.top1_agreement == s.top1_agreement,
        "{s2:?}"
    );
    // the reference's probabilities worked out once give the same bits as taking them again
    let cached = reference.clone().with_probabilities();
    assert_eq!(cached.probabilities.len(), cached.distributions.len());
    let (against3, s3) = compressme_eval::score_against(&docs, w, &cached, logits(&q)).unwrap();
    assert_eq!(against3, against);
    assert_eq!(s3.kl_mean.to_bits(), s2.kl_mean.to_bits());
    assert_eq!(s3.kl_p99.to_bits(), s2.kl_p99.to_bits());
    assert_eq!(s3.dp_correct_mean.to_bits(), s2.dp_correct_mean.to_bits());
    assert_eq!(s3.top1_agreement, s2.top1_agreement);
    let pair = compressme_eval::score_pair(&docs, w, logits(&model), logits(&q)).unwrap();
    assert_eq!(pair.variant.nll(), quant.nll());
    assert_eq!(pair.reference.nll(), reference.nll());
    assert!(
        (pair.shift.kl_mean - s.kl_mean).abs() < 1e-6,
        "{:?}",
        pair.shift
    );
    assert_eq!(pair.shift.top1_agreement, s.top1_agreement);
    // a reference without its distributions, or of other documents, is refused
    let bare = score_documents(&docs, w, false, logits(&model)).unwrap();
    assert!(compressme_eval::score_against(&docs, w, &bare, logits(&q)).is_err());
    assert!(compressme_eval::score_against(&docs[1..], w, &reference, logits(&q)).is_err());
    let p = paired(&reference.nll(), &quant.nll(), 500, 42).unwrap();
    assert_eq!(p.targets, 234);
    assert!(p.ci_low <= p.mean_diff && p.mean_diff <= p.ci_high, "{p:?}");
    assert!(p.a_better + p.b_better > 0, "NF4 changed some likelihoods");
}

#[test]
fn timing_keeps_raw_samples_and_counts_actual_units() {
    let mut calls = 0u64;
    let t = compressme_eval::time(2, 5, || -> Result<u64, String> {
        calls += 1;
        std::thread::sleep(std::time::Duration::from_millis(2));
        Ok(if calls.is_multiple_of(2) { 10 } else { 7 }) // early stops produce fewer tokens
    })
    .unwrap();
    assert_eq!(calls, 7, "2 warm-up calls and 5 timed");
    assert_eq!(t.samples.len(), 5);
    assert_eq!(t.units, vec![7, 10, 7, 10, 7]);
    assert!(t.min <= t.median && t.median <= t.max && t.min >= 0.002);
    assert!(t.median_rate() > 0.0 && t.median_rate() < 10.0 / 0.002);
    // nothing timed: a summary of zeros, which a report can write and read back
    let none = compressme_eval::Timing::from_samples(0, Vec::new(), Vec::new());
    assert_eq!((none.median, none.min, none.max), (0.0, 0.0, 0.0));
    let json = serde_json::to_string(&none).unwrap();
    assert_eq!(
        serde_json::from_str::<compressme_eval::Timing>(&json).unwrap(),
        none
    );
    let e = compressme_eval::time(0, 3, || -> Result<u64, String> { Err("stop".into()) });
    assert_eq!(e.unwrap_err(), "stop");
    let before = compressme_eval::peak_rss_bytes().unwrap();
    let big = vec![1u8; 64 << 20];
    assert!(big.iter().step_by(4096).all(|&b| b == 1));
    let after = compressme_eval::peak_rss_bytes().unwrap();
    assert!(after >= before && after >= 64 << 20, "{before} -> {after}");
}

#[test]
fn embedding_agreement_measures_cosine_and_nearest_neighbours() {
    let reference = vec![
        vec![1.0f32, 0.0, 0.0],
        vec![0.9, 0.1, 0.0],
        vec![0.0, 1.0, 0.0],
        vec![0.0, 0.9, 0.2],
    ];
    let same = compressme_eval::embedding_agreement(&reference, &reference).unwrap();
    assert_eq!(same.items, 4);
    assert!((same.cosine_mean - 1.0).abs() < 1e-12 && same.retrieval_top1_agreement == 1.0);
    // move item 1 next to item 3: its own cosine drops; item 0 loses its neighbour, items
    // 1 and 3 become each other's; only item 2 keeps item 3
    let mut moved = reference.clone();
    moved[1] = vec![0.0, 0.9, 0.25];
    let a = compressme_eval::embedding_agreement(&reference, &moved).unwrap();
    assert!(a.cosine_min < 0.2 && a.cosine_mean < 0.8, "{a:?}");
    assert!((a.retrieval_top1_agreement - 0.25).abs() < 1e-12, "{a:?}");
    assert!(compressme_eval::embedding_agreement(&reference, &moved[..2]).is_err());
    assert!(compressme_eval::embedding_agreement(&[], &[]).is_err());
}

#[test]
fn peak_memory_can_be_reset_between_stages() {
    let Some(before) = compressme_eval::peak_rss_bytes() else {
        // not Linux: nothing to measure, and said so rather than passed silently
        if cfg!(target_os = "linux") {
            panic!("Linux without /proc/self/status");
        }
        eprintln!("skipped: no /proc/self/status on this system");
        return;
    };
    let big = vec![1u8; 64 << 20];
    let touched: u64 = big.iter().step_by(4096).map(|&b| u64::from(b)).sum();
    assert!(touched > 0);
    let peak = compressme_eval::peak_rss_bytes().unwrap();
    assert!(peak >= before + (32 << 20), "{before} -> {peak}");
    drop(big);
    if compressme_eval::reset_peak_rss() {
        let after = compressme_eval::peak_rss_bytes().unwrap();
        assert!(after + (32 << 20) <= peak, "reset: {peak} -> {after}");
    } else {
        // some kernels and sandboxes refuse or ignore /proc/self/clear_refs; the function
        // must then say so, never report a reset that did not happen (the benchmark then
        // reports the stage's peak as unavailable)
        let now = compressme_eval::current_rss_bytes().unwrap();
        let still = compressme_eval::peak_rss_bytes().unwrap();
        assert!(
            still > now + (1 << 20),
            "false, yet the peak {still} is the resident set {now}"
        );
        eprintln!("skipped: this kernel does not reset the peak resident set (clear_refs)");
    }
}

/// Logits that depend on the whole context, so every target's distribution differs.
fn mixed(scale: f32) -> impl FnMut(&[u32], Rows) -> Result<Vec<Vec<f32>>, String> {
    move |ids: &[u32], rows: Rows| {
        Ok(rows
            .map(|i| {
                let h = ids[..=i]
                    .iter()
                    .fold(7u32, |a, &t| a.wrapping_mul(31).wrapping_add(t));
                (0..300u32)
                    .map(|v| ((h ^ v.wrapping_mul(2_654_435_761)) % 1000) as f32 * scale / 100.0)
                    .collect()
            })
            .collect())
    }
}

/// Scoring runs its targets' log-softmaxes and shifts on rayon's threads: the results are
/// the same bits on one thread and on three, and an error is the first in the targets'
/// order even when a later target of the same chunk fails too.
#[test]
fn scores_do_not_depend_on_the_thread_count() {
    let docs = vec![
        (0..200u32).map(|i| (i * 37) % 300).collect::<Vec<u32>>(),
        (0..77u32).map(|i| (i * 11 + 5) % 300).collect(),
    ];
    let window = Window {
        len: 40,
        stride: 20,
    };
    let run = || {
        let reference = score_documents(&docs, window, true, mixed(1.0)).unwrap();
        let pair = compressme_eval::score_pair(&docs, window, mixed(1.0), mixed(1.1)).unwrap();
        let (against, sh) =
            compressme_eval::score_against(&docs, window, &reference, mixed(1.1)).unwrap();
        (reference, pair, against, sh)
    };
    let on = |threads: usize| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(run)
    };
    let (r1, p1, a1, s1) = on(1);
    let (r3, p3, a3, s3) = on(3);
    assert_eq!(r1.tokens.len(), 275);
    assert_eq!(r1.tokens, r3.tokens);
    assert_eq!(r1.distributions, r3.distributions);
    assert_eq!(p1.variant.tokens, p3.variant.tokens);
    assert_eq!(p1.shift, p3.shift);
    assert_eq!(a1.tokens, a3.tokens);
    assert_eq!(s1, s3);
    // the kept reference (log-probabilities rounded to f32) gives about the shift of
    // scoring both together
    assert!((s1.kl_mean - p1.shift.kl_mean).abs() < 1e-6 * p1.shift.kl_mean.max(1.0));
    assert!(s1.kl_mean > 0.0 && s1.targets == 275);
    // two bad targets in one chunk: the first is named
    let e = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap()
        .install(|| {
            score_documents(&docs, window, false, |_, rows| {
                Ok(rows
                    .map(|i| {
                        if i == 5 || i == 9 {
                            vec![f32::NAN; 300]
                        } else {
                            vec![0.0; 300]
                        }
                    })
                    .collect())
            })
        })
        .unwrap_err();
    let ok = matches!(
        e,
        Error::NonFinite {
            doc: 0,
            position: 6,
            ..
        }
    );
    assert!(ok, "{e}");
}
