//! The benchmarks: the synthetic one (the project's main job, no download, no
//! accelerator) and the real-model one, stages over one report format.
//!
//! [`run`] trains the small causal model of `compressme-nn` from scratch on the synthetic
//! cyclic-symbol task under a seed, profiles it on calibration sequences, stores it in
//! every compared way (FP32; uniform INT8, NF4 and blockwise NF4; the activation-guided
//! plan at the seed's thresholds; the budget solver's plan at the same bytes; shuffled
//! controls of the same bytes; a lossless embedding; candle's Q8_0 and Q4_0), writes each
//! to a file, reloads it, and evaluates it on separate evaluation sequences: perplexity,
//! KL divergence and top-1 agreement against FP32, paired intervals, raw timing samples,
//! peak memory, storage.
//!
//! [`run_real`] does the same for a pretrained decoder ([`RealConfig`]: SmolLM2-135M on
//! Jane Austen by default, its shipped Q4_1 weights dequantized to f32 as the reference):
//! calibrated on one text and evaluated on another, budget plans with shuffled controls,
//! a plan at uniform NF4-g64's bytes, candle's Q8_0, Q6_K and Q4_K; peak memory and
//! generation speed on each thread count measured in child processes ([`Probe`]).
//!
//! The [`Report`] is JSON; [`markdown`] and [`svg_chart`] render it. [`replay`] re-runs a
//! report's configuration and lists every field that did not reproduce.
//!
//! What it is: functional experiments measuring the whole pipeline end to end, the second
//! on a real model and real text. What it is not: the synthetic run is not a
//! pretrained-language-model result (the model has a few hundred thousand weights and the
//! task a handful of rules), and the real run re-quantizes weights that were shipped
//! already on a 4-bit grid.
//!
//! # Example
//! ```no_run
//! use compressme_offline::{Config, NoProgress, run, markdown};
//!
//! let cfg = Config { steps: 50, ..Config::default() };
//! let report = run(&cfg, std::path::Path::new("target/offline"), &NoProgress)?;
//! println!("{}", markdown(&report));
//! # Ok::<(), compressme_offline::Error>(())
//! ```
#![deny(missing_docs)]
#![forbid(unsafe_code)]

mod chart;
mod real;
mod replay;
mod report;
mod run;
mod stages;
pub mod task;

pub use chart::svg_chart;
pub use real::{
    Probe, ProbeRequest, ProbeResult, RealConfig, candle_format, load_variant,
    measure_decoder_sensitivity, probe_in_process, run_real,
};
pub use replay::{Difference, Tolerance, compare, not_compared};
pub use report::{
    Corpus, ModuleBytes, PairedRow, Report, Storage, ThreadTiming, Training, Variant,
    VariantTiming, markdown,
};
pub use run::run;

use compressme_eval::Rows;
use compressme_nn::CausalConfig;
use serde::{Deserialize, Serialize};

/// Report layout version.
pub const REPORT_VERSION: u32 = 1;

/// What can go wrong.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The model layer's.
    #[error(transparent)]
    Nn(#[from] compressme_nn::Error),
    /// candle's.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// Reading or writing an artifact.
    #[error(transparent)]
    Artifact(#[from] compressme_artifact::Error),
    /// Profiling.
    #[error(transparent)]
    Profile(#[from] compressme_profile::Error),
    /// Planning.
    #[error(transparent)]
    Plan(#[from] compressme_plan::Error),
    /// Evaluating.
    #[error(transparent)]
    Eval(#[from] compressme_eval::Error),
    /// Files.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// A report that is not one.
    #[error("report: {0}")]
    Json(String),
    /// Drawing the chart.
    #[error("chart: {0}")]
    Chart(String),
    /// A configuration that cannot run.
    #[error("configuration: {0}")]
    Config(String),
    /// Two runs of one variant that must give the same bits did not.
    #[error("not the same bits: {0}")]
    Mismatch(String),
}

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What a report ran: the synthetic benchmark or the real-model one. Untagged, so a
/// synthetic report's JSON is what it always was.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum BenchConfig {
    /// The synthetic benchmark ([`run`]).
    Synthetic(Config),
    /// The real-model benchmark ([`run_real`]).
    Real(RealConfig),
}

/// Everything that decides a run. Defaults are the README's run (under five minutes on
/// two cores).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Seeds the weights, the data split and the batches.
    pub seed: u64,
    /// Training steps.
    pub steps: usize,
    /// The model.
    pub model: CausalConfig,
    /// Sequences count with strides `1..=max_stride`.
    pub max_stride: usize,
    /// Sequences a training step.
    pub batch: usize,
    /// AdamW learning rate.
    pub lr: f64,
    /// AdamW decoupled weight decay.
    pub weight_decay: f64,
    /// Calibration documents (profiling only).
    pub calibration_docs: usize,
    /// Evaluation documents (never trained on or profiled).
    pub eval_docs: usize,
    /// Tokens a document (longer than the context, so windows overlap).
    pub doc_len: usize,
    /// Evaluation window stride (the window is the model's context).
    pub window_stride: usize,
    /// Seeds of the shuffled controls.
    pub shuffle_seeds: Vec<u64>,
    /// Bootstrap resamples of each paired interval.
    pub bootstrap_resamples: usize,
    /// Untimed calls before timing.
    pub timing_warmup: usize,
    /// Timed calls.
    pub timing_reps: usize,
    /// Tokens each generation prompt may produce.
    pub generate_tokens: usize,
    /// Rows a lossless block.
    pub block_rows: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            seed: 42,
            steps: 500,
            model: CausalConfig {
                vocab: 128,
                width: 128,
                layers: 2,
                heads: 4,
                context: 48,
            },
            max_stride: 9,
            batch: 16,
            lr: 2e-3,
            weight_decay: 0.01,
            calibration_docs: 16,
            eval_docs: 24,
            doc_len: 128,
            window_stride: 24,
            shuffle_seeds: vec![1, 2, 3],
            bootstrap_resamples: 2000,
            timing_warmup: 2,
            timing_reps: 7,
            generate_tokens: 24,
            block_rows: 16,
        }
    }
}

/// Progress of a long run, for a caller that shows it (the CLI draws bars). `Sync`: a
/// stage may run its work side by side on several threads, each reporting.
pub trait Progress: Sync {
    /// A stage of `total` units begins.
    fn stage(&self, name: &str, total: u64);
    /// `n` more units are done.
    fn inc(&self, n: u64);
    /// A line of the stage's results, shown while it goes on.
    fn note(&self, line: &str);
    /// The stage is over, with a one-line summary.
    fn done(&self, summary: &str);
}

/// Shows nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoProgress;

impl Progress for NoProgress {
    fn stage(&self, _: &str, _: u64) {}
    fn inc(&self, _: u64) {}
    fn note(&self, _: &str) {}
    fn done(&self, _: &str) {}
}

/// The name of the tier our kernels run on in this process (`COMPRESSME_KERNEL` or the
/// fastest the CPU has), or why it was refused.
fn our_kernel_tier() -> String {
    compressme_quant::kernel_tier().map_or_else(|e| format!("refused ({e})"), |t| t.name().into())
}

/// Re-runs `recorded`'s configuration (artifacts under `work_dir`) and compares: every
/// deterministic field exactly (the recorded tolerance among them), likelihoods within
/// this version's [`Tolerance::default`]. Returns the fresh report and
/// the differences (empty: reproduced). A real-model report's memory and speed are
/// measured again through `probe` (not compared).
///
/// # Errors
/// As [`run`] and [`run_real`].
pub fn replay(
    recorded: &Report,
    work_dir: &std::path::Path,
    progress: &dyn Progress,
    probe: &dyn Probe,
) -> Result<(Report, Vec<Difference>)> {
    let fresh = match &recorded.config {
        BenchConfig::Synthetic(c) => run(c, work_dir, progress)?,
        BenchConfig::Real(c) => run_real(c, work_dir, progress, probe)?,
    };
    if let Some(note) = not_compared(recorded, &fresh) {
        progress.done(&note);
    }
    // the tool's own tolerance, never the one written in the report under test (which
    // `compare` checks like any other field)
    let diffs = compare(recorded, &fresh, Tolerance::default());
    Ok((fresh, diffs))
}

/// Runs every probe in this process (the thread count is whatever the process has):
/// for tests and for the synthetic benchmark, which measures in-process.
#[derive(Debug, Clone, Copy, Default)]
pub struct InProcess;

impl Probe for InProcess {
    fn probe(&self, req: &ProbeRequest, _threads: usize) -> Result<ProbeResult> {
        probe_in_process(req)
    }
}

/// Perplexity of a causal model on documents of token ids, and, given the f32 reference,
/// its distribution shift and a paired comparison (what `compressme evaluate` prints for
/// causal artifacts).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CausalEvaluation {
    /// Targets scored.
    pub targets: usize,
    /// The windows.
    pub window: compressme_eval::Window,
    /// Mean NLL, nats.
    pub mean_nll: f64,
    /// exp(mean NLL).
    pub perplexity: f64,
    /// The reference's perplexity, when there is one.
    pub reference_perplexity: Option<f64>,
    /// Against the reference.
    pub shift: Option<compressme_eval::Shift>,
    /// NLL(model) - NLL(reference), paired over the targets.
    pub paired: Option<compressme_eval::Paired>,
}

/// Scores `model` (and `reference`, when given) on `docs` with overlapping windows of
/// the model's context.
///
/// # Errors
/// Token ids past the vocabulary, a model or non-finite failure naming the document and
/// position, references of another configuration.
pub fn evaluate_causal(
    model: &compressme_nn::CausalLm,
    reference: Option<&compressme_nn::CausalLm>,
    docs: &[Vec<u32>],
    stride: usize,
) -> Result<CausalEvaluation> {
    let cfg = model.config();
    if let Some(r) = reference
        && r.config() != cfg
    {
        return Err(Error::Config(format!(
            "the reference is {:?}, the model {cfg:?}",
            r.config()
        )));
    }
    if let Some((d, t)) = docs.iter().enumerate().find_map(|(d, doc)| {
        doc.iter()
            .find(|&&t| t as usize >= cfg.vocab)
            .map(|&t| (d, t))
    }) {
        return Err(Error::Config(format!(
            "document {d}: token {t} is past the vocabulary of {}",
            cfg.vocab
        )));
    }
    let window = compressme_eval::Window {
        len: cfg.context,
        stride,
    };
    evaluate_logits(
        docs,
        window,
        |ids: &[u32], rows: Rows| model.logit_rows_at(ids, rows).map_err(|e| e.to_string()),
        reference.map(|r| {
            move |ids: &[u32], rows: Rows| r.logit_rows_at(ids, rows).map_err(|e| e.to_string())
        }),
    )
}

/// Scores `model` on `docs` with `window`, and against `reference` when given (one pass
/// over the windows, no distribution kept): any model whose next-token logits a closure
/// returns, at the rows of a window it is asked for (see [`compressme_eval::Rows`]).
///
/// # Errors
/// A model or non-finite failure naming the document and position; a bad window.
pub fn evaluate_logits<F, G>(
    docs: &[Vec<u32>],
    window: compressme_eval::Window,
    mut model: F,
    reference: Option<G>,
) -> Result<CausalEvaluation>
where
    F: FnMut(&[u32], Rows) -> std::result::Result<Vec<Vec<f32>>, String>,
    G: FnMut(&[u32], Rows) -> std::result::Result<Vec<Vec<f32>>, String>,
{
    let Some(reference) = reference else {
        let s = compressme_eval::score_documents(docs, window, false, model)?;
        return Ok(CausalEvaluation {
            targets: s.tokens.len(),
            window,
            mean_nll: s.mean_nll(),
            perplexity: s.perplexity(),
            reference_perplexity: None,
            shift: None,
            paired: None,
        });
    };
    let pair = compressme_eval::score_pair(docs, window, reference, &mut model)?;
    let (rs, s) = (&pair.reference, &pair.variant);
    let paired = compressme_eval::paired(&rs.nll(), &s.nll(), 2000, 42)?;
    Ok(CausalEvaluation {
        targets: s.tokens.len(),
        window,
        mean_nll: s.mean_nll(),
        perplexity: s.perplexity(),
        reference_perplexity: Some(rs.perplexity()),
        shift: Some(pair.shift),
        paired: Some(paired),
    })
}

/// Perplexity of a pretrained decoder on one document of token ids, windows of
/// `window.len` tokens starting every `window.stride`, every target but the first scored
/// once, in the earliest window that holds it; against `reference` (the f32 model) when
/// given. `progress` counts windows.
///
/// # Errors
/// A window longer than the model's context, token ids past its vocabulary, a reference
/// of another configuration, and the model's failures naming the position.
pub fn evaluate_decoder(
    model: &compressme_nn::Decoder,
    reference: Option<&compressme_nn::Decoder>,
    ids: &[u32],
    window: compressme_eval::Window,
    progress: &dyn Progress,
) -> Result<CausalEvaluation> {
    let cfg = model.config();
    if let Some(r) = reference
        && (r.config().vocab, r.config().context) != (cfg.vocab, cfg.context)
    {
        return Err(Error::Config(format!(
            "the reference has a vocabulary of {} and a context of {}, the model {} and {}",
            r.config().vocab,
            r.config().context,
            cfg.vocab,
            cfg.context
        )));
    }
    if window.len > cfg.context {
        return Err(Error::Config(format!(
            "windows of {} tokens, the model's context is {}",
            window.len, cfg.context
        )));
    }
    if let Some((i, t)) = ids
        .iter()
        .enumerate()
        .find(|(_, t)| **t as usize >= cfg.vocab)
    {
        return Err(Error::Config(format!(
            "token {i} is {t}, past the vocabulary of {}",
            cfg.vocab
        )));
    }
    let n = ids.len();
    let windows = if n < 2 {
        0
    } else {
        1 + n.saturating_sub(window.len).div_ceil(window.step())
    };
    progress.stage("windows", windows as u64);
    let docs = [ids.to_vec()];
    let counted = |w: &[u32], rows: Rows| {
        let r = model.logit_rows_at(w, rows).map_err(|e| e.to_string());
        progress.inc(1);
        r
    };
    let e = evaluate_logits(
        &docs,
        window,
        counted,
        reference.map(|r| {
            move |w: &[u32], rows: Rows| r.logit_rows_at(w, rows).map_err(|e| e.to_string())
        }),
    )?;
    progress.done(&format!("{} targets in {windows} windows", e.targets));
    Ok(e)
}
