//! The synthetic cyclic-symbol task and its split.
//!
//! A sequence is fixed by a start symbol and a stride: `x[i + 1] = (x[i] + stride) mod
//! vocab`, so the next token follows from the last two. The `(start, stride)` pairs are
//! shuffled under the seed and split three ways: evaluation documents, calibration
//! documents, and the pairs training batches start from. Documents of different pairs are
//! different token sequences, but every sequence of a stride is a rotation of every other
//! (the task has one rule per stride), so held-out documents test the stored model, not
//! generalisation to new rules.

use candle_core::{Device, Tensor};
use compressme_quant::synthetic::Rng;
use sha2::{Digest, Sha256};

use crate::{Config, Error, Result};

/// The three disjoint sets of `(start, stride)` pairs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Split {
    /// Evaluation documents' pairs.
    pub eval: Vec<(u32, u32)>,
    /// Calibration documents' pairs.
    pub calibration: Vec<(u32, u32)>,
    /// Training pairs.
    pub train: Vec<(u32, u32)>,
}

/// Splits every pair of `cfg`'s task under its seed.
///
/// # Errors
/// [`Error::Config`] when the task has too few pairs for the documents asked for.
pub fn split(cfg: &Config) -> Result<Split> {
    let vocab = cfg.model.vocab as u32;
    let mut pairs: Vec<(u32, u32)> = (1..=cfg.max_stride as u32)
        .flat_map(|d| (0..vocab).map(move |s| (s, d)))
        .collect();
    let need = cfg.eval_docs + cfg.calibration_docs;
    if pairs.len() < need + cfg.batch.max(1) {
        return Err(Error::Config(format!(
            "{} (start, stride) pairs cannot give {need} documents and a training set",
            pairs.len()
        )));
    }
    let mut rng = Rng::new(cfg.seed ^ 0x005e_ed0f_da7a);
    for i in (1..pairs.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        pairs.swap(i, j);
    }
    let train = pairs.split_off(need);
    let calibration = pairs.split_off(cfg.eval_docs);
    Ok(Split {
        eval: pairs,
        calibration,
        train,
    })
}

/// The `len` tokens of a pair's sequence.
#[must_use]
pub fn sequence(pair: (u32, u32), len: usize, vocab: usize) -> Vec<u32> {
    let v = vocab.max(1) as u64;
    (0..len as u64)
        .map(|i| ((u64::from(pair.0) + i * u64::from(pair.1)) % v) as u32)
        .collect()
}

/// SHA-256 (hex) of documents: each as its length (u32 LE) then its tokens (u32 LE).
#[must_use]
pub fn corpus_sha256(docs: &[Vec<u32>]) -> String {
    let mut h = Sha256::new();
    for d in docs {
        h.update((d.len() as u32).to_le_bytes());
        for t in d {
            h.update(t.to_le_bytes());
        }
    }
    compressme_blockstore::hex(&h.finalize())
}

/// A training batch: `batch` sequences of `context + 1` tokens from random training
/// pairs at random phases, as `(ids, targets)` `[batch, context]`.
///
/// # Errors
/// candle's.
pub fn train_batch(
    rng: &mut Rng,
    train: &[(u32, u32)],
    cfg: &Config,
    dev: &Device,
) -> Result<(Tensor, Tensor)> {
    let t = cfg.model.context;
    let (mut ids, mut targets) = (Vec::new(), Vec::new());
    for _ in 0..cfg.batch {
        let k = (rng.next_u64() % train.len().max(1) as u64) as usize;
        let Some(&(s, d)) = train.get(k) else {
            continue;
        };
        let seq = sequence((s, d), t + 1, cfg.model.vocab);
        ids.extend_from_slice(seq.get(..t).unwrap_or(&[]));
        targets.extend_from_slice(seq.get(1..).unwrap_or(&[]));
    }
    let n = ids.len() / t.max(1);
    Ok((
        Tensor::from_vec(ids, (n, t), dev)?,
        Tensor::from_vec(targets, (n, t), dev)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_split_is_disjoint_and_follows_the_seed() {
        let cfg = Config::default();
        let s = split(&cfg).unwrap();
        assert_eq!(s.eval.len(), cfg.eval_docs);
        assert_eq!(s.calibration.len(), cfg.calibration_docs);
        let all: std::collections::BTreeSet<_> = s
            .eval
            .iter()
            .chain(&s.calibration)
            .chain(&s.train)
            .collect();
        assert_eq!(all.len(), cfg.model.vocab * cfg.max_stride);
        assert_eq!(split(&cfg).unwrap(), s);
        let other = split(&Config {
            seed: 43,
            ..cfg.clone()
        })
        .unwrap();
        assert_ne!(other.eval, s.eval);
        assert_eq!(sequence((62, 3), 4, 64), vec![62, 1, 4, 7]);
        let docs = vec![vec![1, 2], vec![3]];
        assert_ne!(corpus_sha256(&docs), corpus_sha256(&[vec![1], vec![2, 3]]));
        let too_many = Config {
            eval_docs: 100_000,
            ..cfg
        };
        assert!(split(&too_many).is_err());
    }
}
