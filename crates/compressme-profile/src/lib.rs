//! Activation profiling: run a model over calibration batches and accumulate, for every
//! named module, statistics of what it sees, weighted by element count.
//!
//! [`ActivationRecorder::record`] installs an observer on the model's hooks for the length
//! of the run (uninstalled on return, error or panic), calls the caller's forward function
//! once per batch, and returns a [`Profile`]: per module the mean |x|, the density (share
//! of |x| above a threshold), the max |x|, and per input channel the mean |x| and mean x²
//! (the statistic llama.cpp's imatrix and AWQ use), plus, for each linear and each
//! candidate format, the estimated output error `Σ_j E[x_j²] · Σ_i (w_ij - q(w)_ij)²`.
//! Sums are kept in f64 over elements, so the same tokens in different batchings give the
//! same statistics up to float rounding. Profiles are versioned JSON.
//!
//! What it is not: a planner (`compressme-plan` turns profiles into plans) or a data
//! loader (the caller decides what a batch is).
//!
//! # Example
//! ```
//! use candle_core::{Device, Tensor};
//! use compressme_nn::{CausalConfig, CausalLm};
//! use compressme_profile::{ActivationRecorder, ProfileSettings};
//!
//! let cfg = CausalConfig { vocab: 16, width: 16, layers: 1, heads: 2, context: 8 };
//! let model = CausalLm::new(cfg, 1, &Device::Cpu)?;
//! let batches = vec![Tensor::new(&[[1u32, 2, 3, 4]], &Device::Cpu)?];
//! let profile = ActivationRecorder::new(ProfileSettings::default())
//!     .record(&model, &batches, |m, ids| m.forward(ids).map(drop))?;
//! let q = &profile.modules["layers.0.attn.q"];
//! assert_eq!(q.elements, 4 * 16); // 4 tokens of 16 channels
//! assert!(q.mean_abs() > 0.0 && q.channel_mean_sq().len() == 16);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![deny(missing_docs)]
#![forbid(unsafe_code)]
// profiles are read back from JSON: every operation on a count is checked or saturating
#![deny(clippy::arithmetic_side_effects)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use candle_core::{DType, Device, Tensor};
pub use compressme_nn::ModuleKind;
use compressme_nn::{Model, ModuleRef, Observer};
use compressme_quant::{Format, GroupSize};
use serde::{Deserialize, Serialize};

/// The profile JSON version this build writes.
pub const VERSION: u32 = 1;

/// What can go wrong profiling.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A module saw NaN or infinity.
    #[error("module `{module}` saw a non-finite activation ({value}) in batch {batch}")]
    NonFinite {
        /// The module.
        module: String,
        /// The batch.
        batch: usize,
        /// The value.
        value: f32,
    },
    /// A module's input changed width between calls.
    #[error("module `{module}`: input width {got}, earlier {expected}")]
    Width {
        /// The module.
        module: String,
        /// Earlier width.
        expected: usize,
        /// This call's width.
        got: usize,
    },
    /// The model failed.
    #[error("batch {batch}: {source}")]
    Model {
        /// The batch.
        batch: usize,
        /// The model's error.
        source: compressme_nn::Error,
    },
    /// A profile file that cannot be read.
    #[error("profile: {0}")]
    Json(String),
    /// No batches.
    #[error("no calibration batches")]
    Empty,
}

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// How to profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileSettings {
    /// |x| above this counts toward density.
    pub density_threshold: f32,
    /// Formats whose estimated error is recorded for each linear.
    pub candidates: Vec<String>,
}

impl Default for ProfileSettings {
    fn default() -> Self {
        Self {
            density_threshold: 0.01,
            candidates: default_candidates()
                .iter()
                .map(ToString::to_string)
                .collect(),
        }
    }
}

/// f16, INT8, NF4 per row, and blockwise NF4 and INT4 at groups 32, 64 and 128.
#[must_use]
pub fn default_candidates() -> Vec<Format> {
    let mut v = vec![Format::F16, Format::Int8, Format::Nf4];
    for g in [GroupSize::G32, GroupSize::G64, GroupSize::G128] {
        v.push(Format::Nf4Block(g));
        v.push(Format::Int4Block(g));
    }
    v
}

/// Statistics of one module's input (a linear) or output (an embedding).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModuleStats {
    /// Linear or embedding.
    pub kind: ModuleKind,
    /// Output features (linear) or table rows (embedding).
    pub rows: usize,
    /// Input features (linear) or width (embedding): the channels.
    pub cols: usize,
    /// Weight bytes in f32.
    pub dense_bytes: u64,
    /// Elements seen.
    pub elements: u64,
    /// Vectors seen (tokens): `elements / cols`.
    pub vectors: u64,
    /// Σ |x|.
    pub sum_abs: f64,
    /// How many |x| were above the threshold.
    pub above: u64,
    /// max |x|.
    pub max_abs: f32,
    /// Per channel Σ |x|.
    pub channel_sum_abs: Vec<f64>,
    /// Per channel Σ x².
    pub channel_sum_sq: Vec<f64>,
    /// Linears only: estimated output error under each candidate format,
    /// `Σ_j E[x_j²] · Σ_i (w_ij - q(w)_ij)²` (a heuristic).
    #[serde(default)]
    pub estimated_error: BTreeMap<String, f64>,
    /// Linears only: formats that cannot hold this module's weights (a finite weight
    /// would become infinite: f16 past 65,504, say); a plan never chooses them. Absent
    /// from the JSON when empty, so profiles of ordinary models are unchanged.
    #[serde(default, skip_serializing_if = "std::collections::BTreeSet::is_empty")]
    pub unrepresentable: std::collections::BTreeSet<String>,
}

impl ModuleStats {
    /// Mean |x|.
    #[must_use]
    pub fn mean_abs(&self) -> f64 {
        self.sum_abs / self.elements.max(1) as f64
    }

    /// Share of |x| above the threshold.
    #[must_use]
    pub fn density(&self) -> f64 {
        self.above as f64 / self.elements.max(1) as f64
    }

    /// Per channel mean |x|.
    #[must_use]
    pub fn channel_mean_abs(&self) -> Vec<f64> {
        let n = self.vectors.max(1) as f64;
        self.channel_sum_abs.iter().map(|s| s / n).collect()
    }

    /// Per channel mean x².
    #[must_use]
    pub fn channel_mean_sq(&self) -> Vec<f64> {
        let n = self.vectors.max(1) as f64;
        self.channel_sum_sq.iter().map(|s| s / n).collect()
    }

    fn add(&mut self, x: &[f32], cols: usize, threshold: f32) -> std::result::Result<(), f32> {
        for row in x.chunks_exact(cols) {
            for ((v, sa), sq) in row
                .iter()
                .zip(self.channel_sum_abs.iter_mut())
                .zip(self.channel_sum_sq.iter_mut())
            {
                if !v.is_finite() {
                    return Err(*v);
                }
                let a = v.abs();
                *sa += f64::from(a);
                *sq += f64::from(a) * f64::from(a);
                self.sum_abs += f64::from(a);
                if a > threshold {
                    self.above = self.above.saturating_add(1);
                }
                if a > self.max_abs {
                    self.max_abs = a;
                }
            }
            self.vectors = self.vectors.saturating_add(1);
            self.elements = self.elements.saturating_add(cols as u64);
        }
        Ok(())
    }
}

/// Per-module statistics of one calibration run, and what produced them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// [`VERSION`].
    pub version: u32,
    /// The settings used.
    pub settings: ProfileSettings,
    /// SHA-256 of the model's weights (every module's f32 weight bytes, in name order),
    /// so a plan can be checked against the model it is applied to.
    pub model_sha256: String,
    /// SHA-256 of the calibration data as the caller describes it (text bytes, or token
    /// ids), empty when not given.
    pub calibration_sha256: String,
    /// Tokens (vectors) seen by the first module.
    pub tokens: u64,
    /// Batches run.
    pub batches: usize,
    /// By module name.
    pub modules: BTreeMap<String, ModuleStats>,
    /// The model's output heads ([`Model::output_heads`]) when they are not the planner's
    /// default, `lm_head` alone: the token embedding of a tied model, GPT-NeoX's
    /// `embed_out`. Empty (and absent from the JSON, so profiles of models with an
    /// `lm_head` are as they were) otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub output_heads: Vec<String>,
}

impl Profile {
    /// As pretty JSON.
    ///
    /// # Errors
    /// Never in practice.
    pub fn to_json(&self) -> Result<String> {
        serde_json::to_string_pretty(self).map_err(|e| Error::Json(e.to_string()))
    }

    /// Reads a profile, refusing versions this build does not know.
    ///
    /// # Errors
    /// [`Error::Json`] naming what is wrong.
    pub fn from_json(text: &str) -> Result<Self> {
        let v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| Error::Json(e.to_string()))?;
        let version = v.get("version").and_then(serde_json::Value::as_u64);
        if version != Some(u64::from(VERSION)) {
            return Err(Error::Json(format!(
                "profile version {version:?} is not supported (this build reads {VERSION})"
            )));
        }
        serde_json::from_value(v).map_err(|e| Error::Json(e.to_string()))
    }
}

struct Collector {
    threshold: f32,
    stats: Mutex<BTreeMap<String, ModuleStats>>,
    batch: Mutex<usize>,
    failure: Mutex<Option<Error>>,
}

impl Observer for Collector {
    fn observe(&self, module: &str, activations: &Tensor) -> compressme_nn::Result<()> {
        let fail = |e: Error| -> compressme_nn::Result<()> {
            let msg = e.to_string();
            *self.failure.lock().unwrap_or_else(PoisonError::into_inner) = Some(e);
            Err(compressme_nn::Error::Observer(msg))
        };
        let x = activations
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let cols = activations.dims().last().copied().unwrap_or(1).max(1);
        let batch = *self.batch.lock().unwrap_or_else(PoisonError::into_inner);
        let mut stats = self.stats.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(s) = stats.get_mut(module) else {
            return Ok(());
        };
        if s.channel_sum_abs.len() != cols {
            let expected = s.channel_sum_abs.len();
            drop(stats);
            return fail(Error::Width {
                module: module.into(),
                expected,
                got: cols,
            });
        }
        if let Err(value) = s.add(&x, cols, self.threshold) {
            drop(stats);
            return fail(Error::NonFinite {
                module: module.into(),
                batch,
                value,
            });
        }
        Ok(())
    }
}

/// Records activation statistics of a [`Model`].
#[derive(Debug, Clone, Default)]
pub struct ActivationRecorder {
    settings: ProfileSettings,
    calibration_sha256: String,
}

impl ActivationRecorder {
    /// A recorder with these settings.
    #[must_use]
    pub fn new(settings: ProfileSettings) -> Self {
        Self {
            settings,
            calibration_sha256: String::new(),
        }
    }

    /// Records `hash` (SHA-256 of the calibration data) in the profile.
    #[must_use]
    pub fn with_calibration_sha256(mut self, hash: String) -> Self {
        self.calibration_sha256 = hash;
        self
    }

    /// Runs `forward(model, batch)` for each batch with an observer installed, and returns
    /// the statistics. The observer is uninstalled however this returns.
    ///
    /// # Errors
    /// [`Error::Empty`], [`Error::NonFinite`] and [`Error::Width`] naming the module,
    /// [`Error::Model`] for the model's own error (naming the batch), and a bad candidate
    /// format name.
    pub fn record<M: Model, B>(
        &self,
        model: &M,
        batches: &[B],
        mut forward: impl FnMut(&M, &B) -> compressme_nn::Result<()>,
    ) -> Result<Profile> {
        if batches.is_empty() {
            return Err(Error::Empty);
        }
        let candidates = self
            .settings
            .candidates
            .iter()
            .map(|c| Format::parse(c))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::Json(e.to_string()))?;
        let mut stats = BTreeMap::new();
        for m in model.modules() {
            stats.insert(
                m.name.clone(),
                ModuleStats {
                    kind: m.kind,
                    rows: m.rows,
                    cols: m.cols,
                    dense_bytes: m.dense_bytes,
                    elements: 0,
                    vectors: 0,
                    sum_abs: 0.0,
                    above: 0,
                    max_abs: 0.0,
                    channel_sum_abs: vec![0.0; m.cols],
                    channel_sum_sq: vec![0.0; m.cols],
                    estimated_error: BTreeMap::new(),
                    unrepresentable: std::collections::BTreeSet::new(),
                },
            );
        }
        let collector = Arc::new(Collector {
            threshold: self.settings.density_threshold,
            stats: Mutex::new(stats),
            batch: Mutex::new(0),
            failure: Mutex::new(None),
        });
        {
            let _guard = model
                .hooks()
                .install(collector.clone())
                .map_err(|source| Error::Model { batch: 0, source })?;
            for (i, b) in batches.iter().enumerate() {
                *collector
                    .batch
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner) = i;
                if let Err(source) = forward(model, b) {
                    if let Some(e) = collector
                        .failure
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .take()
                    {
                        return Err(e);
                    }
                    return Err(Error::Model { batch: i, source });
                }
            }
        }
        let mut modules = std::mem::take(
            &mut *collector
                .stats
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        let mut hasher = <sha2::Sha256 as sha2::Digest>::new();
        for (name, s) in &mut modules {
            let Some(ModuleRef::Linear(l)) = model.module(name) else {
                continue;
            };
            let w = l
                .weight_f32()
                .map_err(|source| Error::Model { batch: 0, source })?;
            for v in &w {
                sha2::Digest::update(&mut hasher, v.to_le_bytes());
            }
            let max_abs = w.iter().fold(0f32, |m, v| m.max(v.abs()));
            s.unrepresentable = compressme_quant::Format::ALL
                .into_iter()
                .filter(|f| !f.holds(max_abs))
                .map(|f| f.to_string())
                .collect();
            let msq = s.channel_mean_sq();
            for f in &candidates {
                let Ok(q) = compressme_quant::quantize(&w, s.rows, s.cols, *f) else {
                    continue;
                };
                let mut back = vec![0f32; w.len()];
                if q.dequantize_into(&mut back).is_err() {
                    continue;
                }
                let mut col_err = vec![0f64; s.cols];
                for (row, brow) in w.chunks_exact(s.cols).zip(back.chunks_exact(s.cols)) {
                    for ((e, a), b) in col_err.iter_mut().zip(row).zip(brow) {
                        let d = f64::from(a - b);
                        *e += d * d;
                    }
                }
                let err: f64 = col_err.iter().zip(&msq).map(|(e, m)| e * m).sum();
                s.estimated_error.insert(f.to_string(), err);
            }
        }
        let digest: [u8; 32] = sha2::Digest::finalize(hasher).into();
        let tokens = modules
            .values()
            .find(|s| s.kind == ModuleKind::Linear)
            .map_or(0, |s| s.vectors);
        Ok(Profile {
            version: VERSION,
            settings: self.settings.clone(),
            model_sha256: compressme_blockstore::hex(&digest),
            calibration_sha256: self.calibration_sha256.clone(),
            tokens,
            batches: batches.len(),
            modules,
            output_heads: Some(model.output_heads())
                .filter(|h| h.as_slice() != ["lm_head"])
                .unwrap_or_default(),
        })
    }
}
