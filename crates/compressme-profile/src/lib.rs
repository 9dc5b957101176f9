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
//! [`measure_sensitivity`] then measures instead of estimating: each linear alone is
//! quantized, the caller's measure (the benchmarks: KL divergence of the next-token
//! distributions from the unchanged model's) is taken, and the estimates a budget plan
//! minimises are rescaled to it, the heuristic keeping only the ratio between formats
//! within a module.
//!
//! [`ActivationRecorder::with_lanes`] runs whole batches side by side, a lane a thread,
//! with the same bits: each batch's observations are summed in the batches' order.
//!
//! [`record_grams`] collects each linear's input Gram matrix `Σ x xᵀ` on the same kind
//! of run ([`ActivationRecorder::record_with_grams`] on the profile's own run), and
//! [`factors_of`] and [`gptq_factors`] turn them into GPTQ's factors
//! (`compressme_quant::GptqFactor`, for `compressme_quant::quantize_gptq`); they are
//! kept apart from the profile (a few hundred megabytes for a 135M decoder, not JSON
//! material).
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
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

mod gram;
mod lanes;
pub use gram::{Grams, factors_of, gptq_factors, record_grams};

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
    /// A module's sensitivity could not be measured.
    #[error("measuring `{module}`: {message}")]
    Measure {
        /// The module.
        module: String,
        /// What failed.
        message: String,
    },
    /// A linear's GPTQ factor could not be made from its input Gram matrix.
    #[error("GPTQ factor of `{module}`: {source}")]
    Factor {
        /// The module.
        module: String,
        /// Why.
        source: compressme_quant::Error,
    },
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
    /// `Σ_j E[x_j²] · Σ_i (w_ij - q(w)_ij)²` (a heuristic); once [`measure_sensitivity`]
    /// has run, in the measured unit instead (see [`ModuleStats::measured`]).
    #[serde(default)]
    pub estimated_error: BTreeMap<String, f64>,
    /// Linears only, when [`measure_sensitivity`] ran: the model's measured response to
    /// this module alone quantized. Absent from the JSON otherwise, so profiles without a
    /// measurement are unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured: Option<Measured>,
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

/// A module's measured sensitivity: what quantizing it alone did to the model's output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Measured {
    /// The format the module was quantized to for the measurement (4-bit groups with
    /// activation-aware scales, as a plan stores them).
    pub format: String,
    /// What the caller's measure returned, in its unit (the benchmarks: mean KL divergence
    /// of the next-token distributions from the unchanged model's, nats a position).
    pub value: f64,
    /// The heuristic of every candidate format, each as a plan stores it (activation-aware
    /// scales where the format takes them, which [`ModuleStats::estimated_error`] as
    /// recorded does not use): the ratios the measurement is spread by.
    pub heuristic: BTreeMap<String, f64>,
}

/// Measures each linear's sensitivity and puts the measurement into the estimates a
/// budget plan minimises.
///
/// For every linear of `profile` a copy of `model` gets the linear's weight replaced by
/// its round trip through `format` (activation-aware scales from the profile for
/// blockwise 4-bit formats, as a plan stores them), `measure(copy, module)` is called,
/// and the weight is put back. The linears are measured in `lanes` lanes side by side,
/// each on its own copy of `model` and one thread ([`compressme_quant::in_lanes`]), so
/// `measure` must not depend on the thread count (the kernels' outputs do not); `model`
/// itself is never changed. Then each linear's
/// `estimated_error[f]` becomes `value · heuristic(f) / heuristic(format)`, where the
/// heuristic is the recorded one's formula applied to each format as a plan stores it
/// (activation-aware scales included): the measurement fixes the module's scale (how
/// much its error costs the model's output), the heuristic only the ratio between
/// formats within one module, which it does see (the weights' round-trip error under
/// each format). A module that `format` stores exactly (heuristic 0) keeps 0 for the
/// formats that are exact too and the largest measured value for the others.
/// `progress` is told each module's name when it is done (in the lanes' order of
/// finishing).
///
/// The budget solver adds these estimates, which assumes the modules' effects add up;
/// that is the approximation this measurement makes, where the heuristic alone also
/// assumed every module's error reached the output alike.
///
/// # Errors
/// Before anything is measured, [`Error::Measure`] for a module that is not a linear of
/// `model` or a candidate the profile has no estimate of; then for a weight `format`
/// cannot hold and the measure's failure (the first in name order). The profile is
/// changed only when every measurement succeeded.
pub fn measure_sensitivity<M: Model + Clone + Send + Sync>(
    model: &M,
    profile: &mut Profile,
    format: Format,
    lanes: usize,
    measure: impl Fn(&M, &str) -> std::result::Result<f64, String> + Sync,
    progress: impl Fn(&str) + Sync,
) -> Result<()> {
    let key = format.to_string();
    let fail = |name: &str, message: String| Error::Measure {
        module: name.to_string(),
        message,
    };
    let linears: Vec<(&String, &ModuleStats)> = profile
        .modules
        .iter()
        .filter(|(_, s)| s.kind == ModuleKind::Linear)
        .collect();
    for &(name, stats) in &linears {
        if !stats.estimated_error.contains_key(&key) {
            return Err(fail(name, format!("the profile has no estimate for {key}")));
        }
        if !matches!(model.module(name), Some(ModuleRef::Linear(_))) {
            return Err(fail(name, "not a linear of the model".into()));
        }
    }
    let measured = compressme_quant::in_lanes(
        &linears,
        lanes,
        || Ok(model.clone()),
        |copy, &(name, stats)| -> Result<(f64, BTreeMap<String, f64>)> {
            let fail = |message: String| fail(name, message);
            let Some(ModuleRef::Linear(l)) = copy.module(name) else {
                return Err(fail("not a linear of the model".into()));
            };
            let original = l.weight().clone();
            let (rows, cols) = l.shape();
            let w = l.weight_f32().map_err(|e| fail(e.to_string()))?;
            let msq = stats.channel_mean_sq();
            let importance: Vec<f32> = msq.iter().map(|&v| v as f32).collect();
            // the heuristic again, but of each format as a plan stores it (activation-aware
            // scales where the format takes them), so that the ratios between formats are
            // those of what is stored
            let mut heuristic = BTreeMap::new();
            for f in stats.estimated_error.keys() {
                let fmt = Format::parse(f).map_err(|e| fail(e.to_string()))?;
                let e = round_trip_error(&w, rows, cols, fmt, &msq, &importance)
                    .ok_or_else(|| fail(format!("{f} cannot take its weights")))?;
                heuristic.insert(f.clone(), e);
            }
            let q = compressme_quant::quantize_weighted(&w, rows, cols, format, &importance)
                .map_err(|e| fail(e.to_string()))?;
            let mut back = vec![0f32; w.len()];
            q.dequantize_into(&mut back)
                .map_err(|e| fail(e.to_string()))?;
            let t = Tensor::from_vec(back, (rows, cols), &Device::Cpu)
                .map_err(|e| fail(e.to_string()))?;
            set_linear(copy, name, compressme_nn::Weight::Dense(t)).map_err(fail)?;
            let value = measure(copy, name);
            set_linear(copy, name, original).map_err(fail)?;
            let value = value.map_err(fail)?;
            if !value.is_finite() {
                return Err(fail(format!("the measure returned {value}")));
            }
            progress(name);
            Ok((value.max(0.0), heuristic))
        },
    )?;
    let values: BTreeMap<String, (f64, BTreeMap<String, f64>)> = linears
        .into_iter()
        .map(|(n, _)| n.clone())
        .zip(measured)
        .collect();
    let largest = values.values().map(|v| v.0).fold(0f64, f64::max);
    for (name, (value, heuristic)) in values {
        let Some(s) = profile.modules.get_mut(&name) else {
            continue;
        };
        let at = heuristic.get(&key).copied().unwrap_or(0.0);
        for (f, e) in &mut s.estimated_error {
            let h = heuristic.get(f).copied().unwrap_or(0.0);
            *e = if at > 0.0 {
                value * (h / at)
            } else if h > 0.0 {
                largest
            } else {
                0.0
            };
        }
        s.measured = Some(Measured {
            format: key.clone(),
            value,
            heuristic,
        });
    }
    Ok(())
}

/// `Σ_j msq[j] · Σ_i (w_ij - q(w)_ij)²` for `w` `[rows, cols]` through `format`, with
/// activation-aware scales from `importance` (empty: absmax, as [`compressme_quant::quantize`]);
/// `None` when the format cannot take the weights.
fn round_trip_error(
    w: &[f32],
    rows: usize,
    cols: usize,
    format: Format,
    msq: &[f64],
    importance: &[f32],
) -> Option<f64> {
    let q = compressme_quant::quantize_weighted(w, rows, cols, format, importance).ok()?;
    let mut back = vec![0f32; w.len()];
    q.dequantize_into(&mut back).ok()?;
    let mut col_err = vec![0f64; cols];
    for (row, brow) in w.chunks_exact(cols).zip(back.chunks_exact(cols)) {
        for ((e, a), b) in col_err.iter_mut().zip(row).zip(brow) {
            let d = f64::from(a - b);
            *e += d * d;
        }
    }
    Some(col_err.iter().zip(msq).map(|(e, m)| e * m).sum())
}

fn set_linear<M: Model>(
    model: &mut M,
    name: &str,
    weight: compressme_nn::Weight,
) -> std::result::Result<(), String> {
    match model.module_mut(name) {
        Some(compressme_nn::ModuleMut::Linear(l)) => {
            l.set_weight(weight).map_err(|e| e.to_string())
        }
        _ => Err("not a linear of the model".into()),
    }
}

struct Collector {
    threshold: f32,
    stats: Mutex<BTreeMap<String, ModuleStats>>,
    watch: Arc<Watch>,
}

/// The statistics' collector and the Gram matrices' on one pass, reporting to one watch.
struct Both(Arc<Collector>, Arc<gram::Collector>);

impl Observer for Both {
    fn observe(&self, module: &str, activations: &Tensor) -> compressme_nn::Result<()> {
        self.0.observe(module, activations)?;
        self.1.observe(module, activations)
    }
}

/// What an observer shares with the run it watches: the batch being run, and the first
/// failure it met, which the run reports in place of the model's error.
#[derive(Default)]
pub(crate) struct Watch {
    batch: Mutex<usize>,
    failure: Mutex<Option<Error>>,
}

impl Watch {
    fn batch(&self) -> usize {
        *self.batch.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn set_batch(&self, i: usize) {
        *self.batch.lock().unwrap_or_else(PoisonError::into_inner) = i;
    }

    /// The failure an observer kept, if one did.
    fn take_failure(&self) -> Option<Error> {
        self.failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    /// Keeps `e` for the run to report and gives the model an error that stops it.
    fn fail(&self, e: Error) -> compressme_nn::Error {
        let msg = e.to_string();
        *self.failure.lock().unwrap_or_else(PoisonError::into_inner) = Some(e);
        compressme_nn::Error::Observer(msg)
    }

    /// Runs `forward` over every batch with `observer` on the model's hooks (uninstalled
    /// however this returns); the observer's failure, if it had one, is the error. With
    /// more than one lane, whole batches side by side (`crate::lanes`: the observer gets
    /// the same observations in the same order), `early`'s Gram products made in the
    /// lanes.
    fn run<M: Model + Sync, B: Sync>(
        &self,
        model: &M,
        batches: &[B],
        lanes: usize,
        forward: impl Fn(&M, &B) -> compressme_nn::Result<()> + Sync,
        observer: Arc<dyn Observer>,
        early: Option<Arc<gram::Collector>>,
    ) -> Result<()> {
        if lanes > 1 && batches.len() > 1 {
            return lanes::run(self, model, batches, lanes, &forward, &*observer, early);
        }
        let _guard = model
            .hooks()
            .install(observer)
            .map_err(|source| Error::Model { batch: 0, source })?;
        for (i, b) in batches.iter().enumerate() {
            self.set_batch(i);
            if let Err(source) = forward(model, b) {
                return Err(self
                    .take_failure()
                    .unwrap_or(Error::Model { batch: i, source }));
            }
        }
        Ok(())
    }
}

impl Observer for Collector {
    fn observe(&self, module: &str, activations: &Tensor) -> compressme_nn::Result<()> {
        let fail = |e: Error| -> compressme_nn::Result<()> { Err(self.watch.fail(e)) };
        let x = activations
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let cols = activations.dims().last().copied().unwrap_or(1).max(1);
        let batch = self.watch.batch();
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
    /// Batches run side by side (at most 1: one after another).
    lanes: usize,
}

impl ActivationRecorder {
    /// A recorder with these settings.
    #[must_use]
    pub fn new(settings: ProfileSettings) -> Self {
        Self {
            settings,
            calibration_sha256: String::new(),
            lanes: 1,
        }
    }

    /// Runs `lanes` batches side by side, each on one thread
    /// ([`compressme_quant::in_lanes`]: a batch's products on its own thread), instead of
    /// one batch after another on every thread: for a model whose products gain little
    /// from a second thread at a batch's size. The profile and the Gram matrices are the
    /// same bits (the observations are summed in the batches' order); a batch's
    /// observations wait, as shared handles on its tensors (with their Gram products,
    /// about 600 MB a 512-token window of SmolLM2-135M), until the earlier batches' have
    /// been summed.
    #[must_use]
    pub fn with_lanes(mut self, lanes: usize) -> Self {
        self.lanes = lanes;
        self
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
    pub fn record<M: Model + Sync, B: Sync>(
        &self,
        model: &M,
        batches: &[B],
        forward: impl Fn(&M, &B) -> compressme_nn::Result<()> + Sync,
    ) -> Result<Profile> {
        Ok(self.recorded(model, batches, forward, false)?.0)
    }

    /// [`record`](Self::record), and on the same pass each linear's input Gram matrix, as
    /// [`record_grams`] gathers them (the same bits): one run of the batches for both.
    ///
    /// # Errors
    /// As [`record`](Self::record) and [`record_grams`].
    pub fn record_with_grams<M: Model + Sync, B: Sync>(
        &self,
        model: &M,
        batches: &[B],
        forward: impl Fn(&M, &B) -> compressme_nn::Result<()> + Sync,
    ) -> Result<(Profile, Grams)> {
        self.recorded(model, batches, forward, true)
    }

    fn recorded<M: Model + Sync, B: Sync>(
        &self,
        model: &M,
        batches: &[B],
        forward: impl Fn(&M, &B) -> compressme_nn::Result<()> + Sync,
        with_grams: bool,
    ) -> Result<(Profile, Grams)> {
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
                    measured: None,
                    unrepresentable: std::collections::BTreeSet::new(),
                },
            );
        }
        let watch = Arc::new(Watch::default());
        let collector = Arc::new(Collector {
            threshold: self.settings.density_threshold,
            stats: Mutex::new(stats),
            watch: watch.clone(),
        });
        let grams = with_grams.then(|| Arc::new(gram::Collector::new(model, watch.clone())));
        let observer: Arc<dyn Observer> = match &grams {
            Some(g) => Arc::new(Both(collector.clone(), g.clone())),
            None => collector.clone(),
        };
        watch.run(model, batches, self.lanes, forward, observer, grams.clone())?;
        let grams = grams.map(|g| g.take()).unwrap_or_default();
        let mut modules = std::mem::take(
            &mut *collector
                .stats
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        // each linear's estimates on its own (in parallel), then the weights' digest in
        // the modules' order
        let linear = |name: &str| match model.module(name) {
            Some(ModuleRef::Linear(l)) => Some(l),
            _ => None,
        };
        modules
            .par_iter_mut()
            .try_for_each(|(name, s)| -> Result<()> {
                let Some(l) = linear(name) else {
                    return Ok(());
                };
                let w = l
                    .weight_f32()
                    .map_err(|source| Error::Model { batch: 0, source })?;
                let max_abs = w.iter().fold(0f32, |m, v| m.max(v.abs()));
                s.unrepresentable = compressme_quant::Format::ALL
                    .into_iter()
                    .filter(|f| !f.holds(max_abs))
                    .map(|f| f.to_string())
                    .collect();
                let msq = s.channel_mean_sq();
                for f in &candidates {
                    if let Some(err) = round_trip_error(&w, s.rows, s.cols, *f, &msq, &[]) {
                        s.estimated_error.insert(f.to_string(), err);
                    }
                }
                Ok(())
            })?;
        let mut hasher = <sha2::Sha256 as sha2::Digest>::new();
        for l in modules.keys().filter_map(|name| linear(name)) {
            let w = l
                .weight_f32()
                .map_err(|source| Error::Model { batch: 0, source })?;
            for v in &w {
                sha2::Digest::update(&mut hasher, v.to_le_bytes());
            }
        }
        let digest: [u8; 32] = sha2::Digest::finalize(hasher).into();
        let tokens = modules
            .values()
            .find(|s| s.kind == ModuleKind::Linear)
            .map_or(0, |s| s.vectors);
        let profile = Profile {
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
        };
        Ok((profile, grams))
    }
}
