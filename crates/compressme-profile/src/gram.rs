//! Input Gram matrices of a model's linears, for GPTQ rounding
//! (`compressme_quant::GptqFactor`).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use candle_core::{DType, Device, Tensor, TensorId};
use compressme_nn::{Model, ModuleKind, Observer};
use compressme_quant::GptqFactor;
use rayon::prelude::*;

use crate::{Error, Result, Watch};

/// Each linear's `Σ x xᵀ` over every input row it saw, row-major `cols x cols`, by
/// module name.
pub type Grams = BTreeMap<String, Vec<f64>>;

pub(crate) struct Collector {
    cols: BTreeMap<String, usize>,
    sums: Mutex<Grams>,
    /// The last input's matrix, by the input tensor's id: a block's query, key and value
    /// projections (its gate and up projections) are called on the same tensor, whose
    /// matrix is taken once.
    last: Mutex<Option<(TensorId, Arc<Vec<f32>>)>>,
    /// Matrices made ahead of their turn ([`Collector::prepare`]), by the input tensor's
    /// id, until the batch that saw them has been summed.
    early: Mutex<HashMap<TensorId, Arc<Vec<f32>>>>,
    /// Products taken (inputs seen, less the repeats).
    products: AtomicUsize,
    watch: Arc<Watch>,
}

impl Collector {
    /// A collector for every linear of `model`, reporting to `watch`.
    pub(crate) fn new<M: Model>(model: &M, watch: Arc<Watch>) -> Self {
        Self {
            cols: model
                .modules()
                .into_iter()
                .filter(|m| m.kind == ModuleKind::Linear)
                .map(|m| (m.name, m.cols))
                .collect(),
            sums: Mutex::new(BTreeMap::new()),
            last: Mutex::new(None),
            early: Mutex::new(HashMap::new()),
            products: AtomicUsize::new(0),
            watch,
        }
    }

    /// The matrices gathered.
    pub(crate) fn take(&self) -> Grams {
        std::mem::take(&mut *self.sums.lock().unwrap_or_else(PoisonError::into_inner))
    }

    fn add(&self, module: &str, x: &Tensor, cols: usize) -> Result<()> {
        let batch = self.watch.batch();
        let model = |source| Error::Model { batch, source };
        let width = x.dims().last().copied().unwrap_or(0);
        if width != cols {
            return Err(Error::Width {
                module: module.into(),
                expected: cols,
                got: width,
            });
        }
        let id = x.id();
        let early = self
            .early
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&id)
            .cloned();
        let g = match early {
            Some(g) => g,
            None => {
                let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
                match &*last {
                    Some((seen, g)) if *seen == id && g.len() == cols.saturating_mul(cols) => {
                        g.clone()
                    }
                    _ => {
                        self.products.fetch_add(1, Ordering::Relaxed);
                        let g = Arc::new(product(x, cols).map_err(|e| model(e.into()))?);
                        *last = Some((id, g.clone()));
                        g
                    }
                }
            }
        };
        if let Some(&value) = g.iter().find(|v| !v.is_finite()) {
            return Err(Error::NonFinite {
                module: module.into(),
                batch,
                value,
            });
        }
        let mut sums = self.sums.lock().unwrap_or_else(PoisonError::into_inner);
        let s = sums
            .entry(module.to_string())
            .or_insert_with(|| vec![0.0; cols.saturating_mul(cols)]);
        for (a, &b) in s.iter_mut().zip(g.iter()) {
            *a += f64::from(b);
        }
        Ok(())
    }

    /// Makes the matrix of `module`'s input `x` ahead of its turn (batches in lanes, see
    /// `crate::lanes`): the matrix [`Collector::add`] would make, kept by the tensor's id
    /// for it to find. Once an input; nothing for a module that is not a linear, or for
    /// an input `add` will refuse (it then makes its error in its turn).
    pub(crate) fn prepare(&self, module: &str, x: &Tensor) {
        let Some(&cols) = self.cols.get(module) else {
            return;
        };
        let id = x.id();
        let lock = || self.early.lock().unwrap_or_else(PoisonError::into_inner);
        if x.dims().last() != Some(&cols) || lock().contains_key(&id) {
            return;
        }
        if let Ok(g) = product(x, cols) {
            self.products.fetch_add(1, Ordering::Relaxed);
            lock().insert(id, Arc::new(g));
        }
    }

    /// Drops the matrices made ahead for a batch's inputs, once they have been summed.
    pub(crate) fn forget(&self, seen: &[(String, Tensor)]) {
        let mut early = self.early.lock().unwrap_or_else(PoisonError::into_inner);
        for (_, x) in seen {
            early.remove(&x.id());
        }
    }
}

/// `xᵀ x` of `x` as rows of `cols`, in f32 over its rows (one chain of products an entry,
/// whatever the thread count).
fn product(x: &Tensor, cols: usize) -> candle_core::Result<Vec<f32>> {
    let x = x
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .reshape(((), cols))?;
    x.t()?
        .contiguous()?
        .matmul(&x)?
        .flatten_all()?
        .to_vec1::<f32>()
}

impl Observer for Collector {
    fn observe(&self, module: &str, activations: &Tensor) -> compressme_nn::Result<()> {
        let Some(&cols) = self.cols.get(module) else {
            return Ok(());
        };
        self.add(module, activations, cols)
            .map_err(|e| self.watch.fail(e))
    }
}

/// Runs `forward` over every batch with an observer on the model's hooks (uninstalled
/// however this returns) and returns every linear's input Gram matrix `Σ x xᵀ` (the
/// linears' inputs only; a linear never called is left out). Each batch's matrix is
/// taken in f32 and the batches are summed in f64 in their order, so the result does not
/// depend on the thread count, nor on `lanes`: more than one runs that many batches side
/// by side, each on one thread (as
/// [`ActivationRecorder::with_lanes`](crate::ActivationRecorder::with_lanes)).
///
/// # Errors
/// [`Error::Empty`] without batches; [`Error::NonFinite`] and [`Error::Width`] naming the
/// module; [`Error::Model`] for the model's own error (naming the batch).
pub fn record_grams<M: Model + Sync, B: Sync>(
    model: &M,
    batches: &[B],
    lanes: usize,
    forward: impl Fn(&M, &B) -> compressme_nn::Result<()> + Sync,
) -> Result<Grams> {
    if batches.is_empty() {
        return Err(Error::Empty);
    }
    let collector = Arc::new(Collector::new(model, Arc::default()));
    collector.watch.run(
        model,
        batches,
        lanes,
        forward,
        collector.clone(),
        Some(collector.clone()),
    )?;
    Ok(collector.take())
}

/// [`record_grams`] (in `lanes` lanes), then each linear's [`GptqFactor`] with damping
/// `damp` (a fraction of its Gram matrix's mean diagonal; 0.01 in the paper). Linears
/// that read the same input (a block's query, key and value projections; its gate and up
/// projections) have the same matrix, bit for bit, and share one factor; the distinct
/// ones are made in parallel.
///
/// # Errors
/// As [`record_grams`]; [`Error::Factor`] naming a linear whose matrix has no factor.
pub fn gptq_factors<M: Model + Sync, B: Sync>(
    model: &M,
    batches: &[B],
    lanes: usize,
    forward: impl Fn(&M, &B) -> compressme_nn::Result<()> + Sync,
    damp: f64,
) -> Result<BTreeMap<String, Arc<GptqFactor>>> {
    factors_of(&record_grams(model, batches, lanes, forward)?, damp)
}

/// Each linear's [`GptqFactor`] from its Gram matrix (as [`record_grams`] or
/// [`ActivationRecorder::record_with_grams`](crate::ActivationRecorder::record_with_grams)
/// gives them) with damping `damp`, as [`gptq_factors`] makes them: one per distinct
/// matrix, made in parallel.
///
/// # Errors
/// [`Error::Factor`] naming a linear whose matrix has no factor (not square, not finite,
/// not positive definite after damping).
pub fn factors_of(grams: &Grams, damp: f64) -> Result<BTreeMap<String, Arc<GptqFactor>>> {
    // the distinct matrices, by the SHA-256 of their bits, each with its first module
    let mut distinct: BTreeMap<[u8; 32], (&str, &[f64])> = BTreeMap::new();
    let mut key_of = BTreeMap::new();
    for (module, g) in grams {
        let mut h = <sha2::Sha256 as sha2::Digest>::new();
        for v in g {
            sha2::Digest::update(&mut h, v.to_le_bytes());
        }
        let key: [u8; 32] = sha2::Digest::finalize(h).into();
        distinct
            .entry(key)
            .or_insert((module.as_str(), g.as_slice()));
        key_of.insert(module.as_str(), key);
    }
    let made: BTreeMap<[u8; 32], Arc<GptqFactor>> = distinct
        .into_par_iter()
        .map(|(key, (module, g))| {
            GptqFactor::new(g, g.len().isqrt(), damp)
                .map(|f| (key, Arc::new(f)))
                .map_err(|source| Error::Factor {
                    module: module.to_string(),
                    source,
                })
        })
        .collect::<Result<_>>()?;
    Ok(key_of
        .into_iter()
        .filter_map(|(module, key)| Some((module.to_string(), made.get(&key)?.clone())))
        .collect())
}

#[cfg(test)]
#[allow(
    clippy::unwrap_used,
    clippy::arithmetic_side_effects,
    clippy::indexing_slicing
)]
mod tests {
    use super::*;
    use crate::{ActivationRecorder, ProfileSettings};
    use compressme_nn::{CausalConfig, CausalLm};

    #[test]
    fn gram_diagonals_are_the_profiles_channel_means_of_squares() {
        // two independent paths over the same inputs: the Gram matrix's diagonal over
        // the tokens seen is the profile's per-channel mean x²
        let cfg = CausalConfig {
            vocab: 16,
            width: 16,
            layers: 2,
            heads: 2,
            context: 8,
        };
        let model = CausalLm::new(cfg, 3, &Device::Cpu).unwrap();
        let batches = vec![
            Tensor::new(&[[1u32, 2, 3, 4, 5, 6]], &Device::Cpu).unwrap(),
            Tensor::new(&[[7u32, 8, 9, 10, 11, 12]], &Device::Cpu).unwrap(),
        ];
        let forward = |m: &CausalLm, ids: &Tensor| m.forward(ids).map(drop);
        let grams = record_grams(&model, &batches, 1, forward).unwrap();
        // linears called on the same input share one product
        let collector = Arc::new(Collector::new(&model, Arc::default()));
        collector
            .watch
            .run(&model, &batches, 1, forward, collector.clone(), None)
            .unwrap();
        assert_eq!(collector.take(), grams);
        let products = collector.products.load(Ordering::Relaxed);
        assert!(
            products < grams.len() * batches.len(),
            "{products} products for {} linears and {} batches",
            grams.len(),
            batches.len()
        );
        let profile = ActivationRecorder::new(ProfileSettings::default())
            .record(&model, &batches, forward)
            .unwrap();
        let linears: Vec<_> = profile
            .modules
            .iter()
            .filter(|(_, s)| s.kind == ModuleKind::Linear)
            .collect();
        assert_eq!(grams.len(), linears.len());
        for (name, s) in linears {
            let g = &grams[name];
            let n = s.cols;
            assert_eq!(g.len(), n * n, "{name}");
            let tokens = s.vectors as f64;
            for (j, want) in s.channel_mean_sq().iter().enumerate() {
                let got = g[j * n + j] / tokens;
                assert!(
                    (got - want).abs() <= 1e-5 * want.abs().max(1e-3),
                    "{name}[{j}]: {got} against {want}"
                );
                for k in 0..n {
                    assert_eq!(
                        g[j * n + k],
                        g[k * n + j],
                        "{name}: not symmetric at ({j}, {k})"
                    );
                }
            }
        }
        assert!(matches!(
            record_grams(&model, &[] as &[Tensor], 2, forward),
            Err(Error::Empty)
        ));
        // one factor per distinct matrix: shared exactly where the inputs are the same
        let factors = gptq_factors(&model, &batches, 1, forward, 0.01).unwrap();
        assert_eq!(factors.len(), grams.len());
        let mut shared = 0;
        for (a, fa) in &factors {
            for (b, fb) in &factors {
                assert_eq!(Arc::ptr_eq(fa, fb), grams[a] == grams[b], "{a} and {b}");
                shared += usize::from(a != b && Arc::ptr_eq(fa, fb));
            }
            assert_eq!(fa.cols(), grams[a].len().isqrt(), "{a}");
        }
        assert!(shared > 0, "no two linears read the same input");
        // the profile's own pass gives the same profile and the same matrices, and the
        // factors made from them are the same
        let (both, grams_too) = ActivationRecorder::new(ProfileSettings::default())
            .record_with_grams(&model, &batches, forward)
            .unwrap();
        assert_eq!(both, profile);
        assert_eq!(grams_too, grams);
        let again = factors_of(&grams_too, 0.01).unwrap();
        assert_eq!(again.len(), factors.len());
        for (name, f) in &again {
            assert_eq!(**f, *factors[name], "{name}");
        }
    }

    #[test]
    fn batches_in_lanes_give_the_same_bits_and_the_same_errors() {
        // more batches than lanes, of different lengths, so that lanes finish out of
        // order and batches wait for the earlier ones
        let cfg = CausalConfig {
            vocab: 32,
            width: 16,
            layers: 3,
            heads: 2,
            context: 16,
        };
        let model = CausalLm::new(cfg, 5, &Device::Cpu).unwrap();
        let batches: Vec<Tensor> = (0..7u32)
            .map(|b| {
                let ids: Vec<u32> = (0..3 + 2 * (b % 4)).map(|i| (5 * b + 3 * i) % 32).collect();
                Tensor::new(ids.as_slice(), &Device::Cpu)
                    .and_then(|t| t.unsqueeze(0))
                    .unwrap()
            })
            .collect();
        let forward = |m: &CausalLm, ids: &Tensor| m.forward(ids).map(drop);
        let recorder = ActivationRecorder::new(ProfileSettings::default());
        let (profile, grams) = recorder
            .record_with_grams(&model, &batches, forward)
            .unwrap();
        for lanes in [2, 3, 8] {
            let (p, g) = recorder
                .clone()
                .with_lanes(lanes)
                .record_with_grams(&model, &batches, forward)
                .unwrap();
            // (not `assert_eq!`: a profile's debug text is pages long)
            assert!(p == profile, "{lanes} lanes: another profile");
            assert!(g == grams, "{lanes} lanes: other Gram matrices");
            assert!(
                record_grams(&model, &batches, lanes, forward).unwrap() == grams,
                "{lanes} lanes: other Gram matrices alone"
            );
            assert!(!model.hooks().installed());
        }
        // a model error in batch 4: the same error, the batch named
        let failing = |m: &CausalLm, ids: &Tensor| {
            if std::ptr::eq(ids, &batches[4]) {
                return Err(compressme_nn::Error::Shape("injected".into()));
            }
            m.forward(ids).map(drop)
        };
        for lanes in [1, 2, 3] {
            let e = recorder
                .clone()
                .with_lanes(lanes)
                .record_with_grams(&model, &batches, failing)
                .unwrap_err();
            let Error::Model { batch, .. } = &e else {
                panic!("{lanes} lanes: not the model's error: {e}");
            };
            assert_eq!(*batch, 4, "{lanes} lanes: {e}");
            assert!(!model.hooks().installed());
        }
        // an observer's error in one batch (a NaN reported by the forward of batch
        // `nan`) and a model error in another (`broken`): whichever batch comes first,
        // as one batch after another would meet them
        let nan = Tensor::full(f32::NAN, (1, 3, 16), &Device::Cpu).unwrap();
        for (nan_at, broken_at) in [(2, 5), (5, 2), (0, 6)] {
            let forward = |m: &CausalLm, ids: &Tensor| {
                if std::ptr::eq(ids, &batches[broken_at]) {
                    return Err(compressme_nn::Error::Shape("injected".into()));
                }
                if std::ptr::eq(ids, &batches[nan_at]) {
                    m.hooks().observe("layers.0.attn.q", &nan)?;
                }
                m.forward(ids).map(drop)
            };
            let errors: Vec<String> = [1, 2, 3]
                .map(|lanes| {
                    let e = recorder
                        .clone()
                        .with_lanes(lanes)
                        .record_with_grams(&model, &batches, forward)
                        .unwrap_err();
                    let case =
                        format!("{lanes} lanes, NaN at {nan_at}, broken at {broken_at}: {e}");
                    if nan_at < broken_at {
                        let Error::NonFinite { module, batch, .. } = &e else {
                            panic!("{case}: not the observer's error");
                        };
                        assert_eq!(
                            (module.as_str(), *batch),
                            ("layers.0.attn.q", nan_at),
                            "{case}"
                        );
                    } else {
                        let Error::Model { batch, .. } = &e else {
                            panic!("{case}: not the model's error");
                        };
                        assert_eq!(*batch, broken_at, "{case}");
                    }
                    assert!(!model.hooks().installed());
                    e.to_string()
                })
                .to_vec();
            assert!(errors.iter().all(|e| *e == errors[0]), "{errors:?}");
        }
    }
}
