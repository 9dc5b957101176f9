//! The report: what a run measured, as JSON, and the table a person reads.
#![deny(clippy::arithmetic_side_effects)] // reads files: no unchecked arithmetic

use std::collections::BTreeMap;
use std::fmt::Write as _;

use compressme_eval::{Paired, Shift, Timing, Window};
use compressme_plan::Plan;
use serde::{Deserialize, Serialize};

use crate::{BenchConfig, Error, Result, Tolerance};

/// Everything one run measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Report {
    /// [`crate::REPORT_VERSION`].
    pub report_version: u32,
    /// The tool and its version.
    pub tool: String,
    /// What was asked for: the synthetic benchmark's configuration, or the real-model
    /// benchmark's.
    pub config: BenchConfig,
    /// What it was trained, calibrated and evaluated on.
    pub corpus: Corpus,
    /// How training went (the synthetic benchmark; none for a pretrained model).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub training: Option<Training>,
    /// SHA-256 of the calibration profile's JSON.
    pub profile_sha256: String,
    /// The plans the mixed variants were packed from, by variant name.
    pub plans: BTreeMap<String, Plan>,
    /// Every variant, FP32 first.
    pub variants: Vec<Variant>,
    /// Paired comparisons on the same evaluation targets.
    pub paired: Vec<PairedRow>,
    /// How closely a replay's likelihoods must agree.
    pub tolerance: Tolerance,
    /// Threads the machine offered.
    pub threads: usize,
    /// The tier of candle's quantized kernels on the machine that ran it
    /// (`compressme_nn::candle_kernel_tier`): the candle variants' likelihoods reproduce
    /// only on the same tier. `unrecorded` in reports written before it was recorded.
    #[serde(default = "unrecorded")]
    pub candle_kernels: String,
    /// The tier of our kernels on the machine that ran it (`compressme_quant::Tier`'s
    /// name): every tier gives the same bits, so it is context for the speed figures and
    /// is not compared. `unrecorded` in reports written before it was recorded.
    #[serde(default = "unrecorded")]
    pub our_kernels: String,
    /// The artifact version the run wrote its `.cma` variants in, the newest among them
    /// (4 where a variant holds a lossless tensor since 2026-12-06, else 2): their files'
    /// bytes and digests reproduce only under the same version. 1 in reports written
    /// before it was recorded.
    #[serde(default = "artifact_v1")]
    pub artifact_version: u32,
    /// Wall-clock seconds of the whole run.
    pub seconds: f64,
}

fn unrecorded() -> String {
    "unrecorded".into()
}

const fn artifact_v1() -> u32 {
    1
}

/// The data, by hash.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Corpus {
    /// `(start, stride)` pairs training batches start from.
    pub train_pairs: usize,
    /// Calibration documents.
    pub calibration_docs: usize,
    /// SHA-256 of the calibration documents (see `task::corpus_sha256`).
    pub calibration_sha256: String,
    /// Evaluation documents.
    pub eval_docs: usize,
    /// SHA-256 of the evaluation documents.
    pub eval_sha256: String,
    /// Targets scored a variant.
    pub targets: usize,
    /// The evaluation windows.
    pub window: Window,
}

/// Training.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Training {
    /// Loss at each step.
    pub losses: Vec<f64>,
    /// SHA-256 over the trained tensors' names and f32 bytes.
    pub weights_sha256: String,
    /// Wall-clock seconds.
    pub seconds: f64,
}

/// One module's bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModuleBytes {
    /// Module name.
    pub name: String,
    /// `dense f32`, a format, `lossless`, or a candle type.
    pub storage: String,
    /// Bytes its weight and bias take in f32.
    pub dense_bytes: u64,
    /// Bytes they take stored (every buffer: codes, scales, minimums, blocks, bias).
    pub stored_bytes: u64,
}

/// A variant's bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Storage {
    /// The file it was saved to and reloaded from (name only).
    pub file: String,
    /// Its size.
    pub file_bytes: u64,
    /// Its SHA-256.
    pub file_sha256: String,
    /// Per module, as the reloaded model holds it.
    pub modules: Vec<ModuleBytes>,
    /// Bytes outside the modules (norms, positions), dense.
    pub other_bytes: u64,
    /// The modules' dense bytes.
    pub module_dense_bytes: u64,
    /// The modules' stored bytes.
    pub module_stored_bytes: u64,
}

/// Timing of a reloaded variant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VariantTiming {
    /// Loading the file (read, verify, build), seconds.
    pub load_seconds: f64,
    /// One forward pass over a batch (units: tokens in the batch), timed in rounds
    /// interleaved with the other variants.
    pub forward: Timing,
    /// Greedy generation from a few prompts (units: tokens actually produced).
    pub generate: Timing,
    /// Generation on each thread count timed (the real-model benchmark, each sample a
    /// child process; empty otherwise, and for its shuffled controls, which it does not
    /// time).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub generate_threads: Vec<ThreadTiming>,
}

/// Generation timing on one thread count.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ThreadTiming {
    /// Threads the kernels used.
    pub threads: usize,
    /// Seconds and tokens produced, one sample a round.
    pub timing: Timing,
}

/// One stored variant and how it did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Variant {
    /// Short name.
    pub name: String,
    /// What it is.
    pub description: String,
    /// A control (the shuffled plans), drawn apart in the chart.
    pub control: bool,
    /// Bytes.
    pub storage: Storage,
    /// Mean negative log-likelihood a target, nats.
    pub mean_nll: f64,
    /// exp(mean NLL).
    pub perplexity: f64,
    /// Against the FP32 variant.
    pub shift: Shift,
    /// Per-target NLL, in target order (written at f32 precision, well inside the
    /// replay tolerance, to keep reports small).
    #[serde(serialize_with = "as_f32")]
    pub nll: Vec<f64>,
    /// Timing.
    pub timing: VariantTiming,
    /// Peak resident memory of the process while loading and evaluating this variant
    /// (after a reset; `None` where the system cannot say, and for the real-model
    /// benchmark's shuffled controls, which it does not measure).
    pub peak_rss_bytes: Option<u64>,
    /// The process's resident memory just before loading this variant (the peak's
    /// baseline: the process, its other data, the allocator's reserve).
    pub baseline_rss_bytes: Option<u64>,
}

/// A paired comparison.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PairedRow {
    /// The baseline.
    pub a: String,
    /// The variant compared with it (negative mean difference: `b` is better).
    pub b: String,
    /// What the comparison asks.
    pub question: String,
    /// The numbers.
    pub paired: Paired,
}

fn as_f32<S: serde::Serializer>(v: &[f64], s: S) -> std::result::Result<S::Ok, S::Error> {
    use serde::ser::SerializeSeq;
    let mut seq = s.serialize_seq(Some(v.len()))?;
    for &x in v {
        seq.serialize_element(&(x as f32))?;
    }
    seq.end()
}

impl Report {
    /// Compact JSON (per-target arrays make pretty printing a line per number; the
    /// Markdown table is for people).
    ///
    /// # Errors
    /// Never in practice.
    pub fn to_json(&self) -> Result<String> {
        serde_json::to_string(self).map_err(|e| Error::Json(e.to_string()))
    }

    /// Reads a report.
    ///
    /// # Errors
    /// [`Error::Json`] for text that is not a report of this version.
    pub fn from_json(text: &str) -> Result<Self> {
        let r: Self = serde_json::from_str(text).map_err(|e| Error::Json(e.to_string()))?;
        if r.report_version != crate::REPORT_VERSION {
            return Err(Error::Json(format!(
                "report version {}, this tool reads {}",
                r.report_version,
                crate::REPORT_VERSION
            )));
        }
        Ok(r)
    }

    /// The variant of this name.
    #[must_use]
    pub fn variant(&self, name: &str) -> Option<&Variant> {
        self.variants.iter().find(|v| v.name == name)
    }

    /// The variant of this name, to change.
    #[must_use]
    pub fn variant_mut(&mut self, name: &str) -> Option<&mut Variant> {
        self.variants.iter_mut().find(|v| v.name == name)
    }
}

fn kib(b: u64) -> String {
    format!("{:.1}", b as f64 / 1024.0)
}

/// The report as Markdown: a summary line, the variant table, the paired comparisons.
#[must_use]
pub fn markdown(r: &Report) -> String {
    match (&r.config, &r.training) {
        (BenchConfig::Synthetic(c), Some(t)) => markdown_synthetic(r, c, t),
        (BenchConfig::Real(c), _) => markdown_real(r, c),
        (BenchConfig::Synthetic(_), None) => "A synthetic report without its training.\n".into(),
    }
}

/// The paired comparisons other than each variant against the reference.
fn questions_table(s: &mut String, r: &Report) {
    let reference = r.variants.first();
    s.push_str("| question | a | b | mean NLL(b) - NLL(a) | 95% bootstrap CI | b better / a better | sign test p |\n");
    s.push_str("| --- | --- | --- | ---: | --- | ---: | ---: |\n");
    for p in r
        .paired
        .iter()
        .filter(|p| reference.is_none_or(|f| p.a != f.name))
    {
        let q = &p.paired;
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:+.5} | [{:+.5}, {:+.5}] | {} / {} | {:.3} |",
            p.question,
            p.a,
            p.b,
            q.mean_diff,
            q.ci_low,
            q.ci_high,
            q.b_better,
            q.a_better,
            q.sign_test_p
        );
    }
}

/// `NLL(v) - NLL(reference)` with its interval, from the paired rows.
fn against_reference(r: &Report, v: &Variant) -> String {
    let reference = r.variants.first();
    r.paired
        .iter()
        .find(|p| reference.is_some_and(|f| p.a == f.name) && p.b == v.name)
        .map_or("-".to_string(), |p| {
            format!(
                "{:+.4} [{:+.4}, {:+.4}]",
                p.paired.mean_diff, p.paired.ci_low, p.paired.ci_high
            )
        })
}

fn markdown_real(r: &Report, c: &crate::RealConfig) -> String {
    let mut s = String::new();
    let reference = r.variants.first();
    let base = reference
        .map_or(1, |v| v.storage.module_stored_bytes)
        .max(1);
    let ref_ppl = reference.map_or(f64::NAN, |v| v.perplexity);
    let _ = writeln!(
        s,
        "Real-model benchmark ({}): {} (SHA-256 {}), **the reference is its weights dequantized to f32**: they were shipped on a 4-bit grid (Q4_1), so every other variant re-quantizes already-quantized weights. Calibrated on {} windows of {} tokens of `{}` (SHA-256 {}); evaluated on the first {} tokens of `{}` ({} targets, windows of {} at stride {}; token SHA-256 {}). candle's kernels: {}; ours: {}.",
        r.tool,
        c.model,
        c.model_sha256.get(..12).unwrap_or(""),
        r.corpus.calibration_docs,
        c.window,
        c.calibration_text,
        r.corpus.calibration_sha256.get(..12).unwrap_or(""),
        c.eval_tokens,
        c.eval_text,
        r.corpus.targets,
        r.corpus.window.len,
        r.corpus.window.stride,
        r.corpus.eval_sha256.get(..12).unwrap_or(""),
        r.candle_kernels,
        r.our_kernels,
    );
    s.push('\n');
    let threads: Vec<String> = c
        .timing_threads
        .iter()
        .map(|t| format!("gen tok/s, {t} thread{}", if *t == 1 { "" } else { "s" }))
        .collect();
    let _ = writeln!(
        s,
        "| variant | module MiB | vs f32 | file MiB | perplexity | ratio | NLL - f32 [95% CI] | KL mean | KL p99 | top-1 agree | {} | peak RSS MiB |",
        threads.join(" | ")
    );
    let _ = writeln!(
        s,
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | {}---: |",
        "---: | ".repeat(threads.len())
    );
    let mib = |b: u64| format!("{:.1}", b as f64 / 1048576.0);
    for v in &r.variants {
        let name = if v.control {
            format!("{} (control)", v.name)
        } else {
            v.name.clone()
        };
        // "-" for a variant not timed (the shuffled controls)
        let rates: Vec<String> = c
            .timing_threads
            .iter()
            .map(|&n| {
                v.timing
                    .generate_threads
                    .iter()
                    .find(|t| t.threads == n && !t.timing.samples.is_empty())
                    .map_or("-".into(), |t| format!("{:.1}", t.timing.median_rate()))
            })
            .collect();
        let _ = writeln!(
            s,
            "| {name} | {} | {:.3} | {} | {:.3} | {:.4} | {} | {:.2e} | {:.2e} | {:.4} | {} | {} |",
            mib(v.storage.module_stored_bytes),
            v.storage.module_stored_bytes as f64 / base as f64,
            mib(v.storage.file_bytes),
            v.perplexity,
            v.perplexity / ref_ppl,
            against_reference(r, v),
            v.shift.kl_mean,
            v.shift.kl_p99,
            v.shift.top1_agreement,
            rates.join(" | "),
            v.peak_rss_bytes.map_or("-".into(), mib),
        );
    }
    s.push('\n');
    questions_table(&mut s, r);
    s.push('\n');
    let _ = writeln!(
        s,
        "Module weights: every stored buffer of the linears and embeddings (the tied embedding is the output head); norms ({} bytes) are dense in every variant. Generation: greedy, {} new tokens after a {}-token prompt from the held-out text, one child process a sample, {} interleaved rounds; peak RSS: a child that loaded the variant and ran one window of {} tokens on one thread. The shuffled controls are not timed (\"-\"): they are quality controls, their plan's formats on other modules. Timing and memory are context for this machine, not claims.",
        reference.map_or(0, |v| v.storage.other_bytes),
        c.generate_tokens,
        c.prompt_tokens,
        c.timing_reps,
        c.window,
    );
    s
}

fn markdown_synthetic(r: &Report, c: &crate::Config, training: &Training) -> String {
    let mut s = String::new();
    let fp32 = r.variants.first();
    let base = fp32.map_or(1, |v| v.storage.module_stored_bytes).max(1);
    let _ = writeln!(
        s,
        "Offline benchmark ({}): a {}-layer causal model (width {}, vocabulary {}, context {}) trained {} steps from seed {} on the synthetic cyclic-symbol task (loss {:.3} -> {:.3}); {} evaluation documents of {} tokens, {} targets, windows of {} with stride {}; calibration corpus {}, evaluation corpus {}. A functional experiment on a synthetic task, not a pretrained-language-model result.",
        r.tool,
        c.model.layers,
        c.model.width,
        c.model.vocab,
        c.model.context,
        c.steps,
        c.seed,
        training.losses.first().copied().unwrap_or(f64::NAN),
        training.losses.last().copied().unwrap_or(f64::NAN),
        r.corpus.eval_docs,
        c.doc_len,
        r.corpus.targets,
        r.corpus.window.len,
        r.corpus.window.stride,
        r.corpus.calibration_sha256.get(..12).unwrap_or(""),
        r.corpus.eval_sha256.get(..12).unwrap_or(""),
    );
    s.push('\n');
    s.push_str("| variant | module weights KiB | vs FP32 | file KiB | perplexity | NLL - FP32 [95% CI] | KL mean | KL p99 | top-1 agree | forward ms | gen tok/s | peak RSS MiB (+ over its start) |\n");
    s.push_str(
        "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    for v in &r.variants {
        let ci = against_reference(r, v);
        let name = if v.control {
            format!("{} (control)", v.name)
        } else {
            v.name.clone()
        };
        let _ = writeln!(
            s,
            "| {name} | {} | {:.3} | {} | {:.4} | {ci} | {:.2e} | {:.2e} | {:.4} | {:.2} | {:.0} | {} |",
            kib(v.storage.module_stored_bytes),
            v.storage.module_stored_bytes as f64 / base as f64,
            kib(v.storage.file_bytes),
            v.perplexity,
            v.shift.kl_mean,
            v.shift.kl_p99,
            v.shift.top1_agreement,
            v.timing.forward.median * 1e3,
            v.timing.generate.median_rate(),
            match (v.peak_rss_bytes, v.baseline_rss_bytes) {
                (Some(p), Some(b)) => format!(
                    "{:.1} (+{:.1})",
                    p as f64 / 1048576.0,
                    p.saturating_sub(b) as f64 / 1048576.0
                ),
                (Some(p), None) => format!("{:.1}", p as f64 / 1048576.0),
                _ => "-".into(),
            },
        );
    }
    s.push('\n');
    questions_table(&mut s, r);
    s.push('\n');
    let _ = writeln!(
        s,
        "Module weights: every stored buffer of the linears and the embedding (codes, scales, minimums, lossless blocks, biases); norms and positions ({} bytes) are dense in every variant. Forward: median of {} timed calls on a [{}, {}] batch, after {} warm-up rounds, the variants interleaved round by round; generation: greedy from 4 prompts, tokens actually produced; one process, {} threads offered. Timing and memory are context for this machine, not claims; peak memory is the process's, reset at each variant's load (the reset checked; `-` where it did not take) and covering its load, evaluation and one timed call of each kind.",
        fp32.map_or(0, |v| v.storage.other_bytes),
        c.timing_reps,
        r.corpus.eval_docs,
        c.model.context,
        c.timing_warmup,
        r.threads,
    );
    s
}
