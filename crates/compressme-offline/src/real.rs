//! The real-model benchmark: a pretrained decoder (SmolLM2-135M-Instruct by default,
//! its Q4_1 GGUF dequantized to f32 as the reference) calibrated on one Austen novel
//! and evaluated on another, stored every compared way, each variant reloaded from its
//! file; peak memory and generation speed measured in child processes ([`Probe`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::{Device, Tensor};
use compressme_artifact::recipe::sha256_hex;
use compressme_eval::{
    Rows, Scored, Timing, Window, score_against, score_documents, score_documents_in_lanes, shift,
};
use compressme_nn::decoder::{DECODER_CONFIG_KEY, DecoderConfig, LanguageModel, Layout};
use compressme_nn::{Decoder, LlamaFormat, Model, ModuleKind};
use compressme_plan::{Choice, Plan, Policy};
use compressme_profile::{ActivationRecorder, ProfileSettings};
use compressme_quant::{Format, GroupSize};
use serde::{Deserialize, Serialize};

use crate::report::{Corpus, Report, ThreadTiming, Variant, VariantTiming};
use crate::stages::{
    Gptq, Lm, Planned, Rounding, Spec, io, paired_rows, plans_of, read_gguf, storage, write_gguf,
    write_ours,
};
use crate::{BenchConfig, Error, Progress, Result, Tolerance};

/// Everything that decides a real-model run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RealConfig {
    /// The model: a llama GGUF file, a Hugging Face folder, or a decoder artifact.
    pub model: String,
    /// SHA-256 of its source file; a run refuses another file (empty: not checked).
    pub model_sha256: String,
    /// Calibration text (profiling only).
    pub calibration_text: String,
    /// Calibration windows of `window` tokens, from the start of the text.
    pub calibration_windows: usize,
    /// Held-out text, one document (never profiled).
    pub eval_text: String,
    /// Tokens of the held-out text scored (from its start).
    pub eval_tokens: usize,
    /// Evaluation window.
    pub window: usize,
    /// Evaluation stride.
    pub stride: usize,
    /// Budget plans, in bits a weight of the planned linears.
    pub budgets_bpw: Vec<f64>,
    /// Formats the budget solver may choose.
    pub candidates: Vec<String>,
    /// Seeds of the shuffled controls of every budget plan.
    pub shuffle_seeds: Vec<u64>,
    /// Bootstrap resamples of each paired interval.
    pub bootstrap_resamples: usize,
    /// Seeds the bootstrap.
    pub seed: u64,
    /// Prompt of the timed generation: the first tokens of the held-out text.
    pub prompt_tokens: usize,
    /// Tokens each timed generation produces.
    pub generate_tokens: usize,
    /// Timed rounds (every variant and thread count once a round, each in a child).
    pub timing_reps: usize,
    /// Thread counts timed.
    pub timing_threads: Vec<usize>,
    /// Rows a lossless block.
    pub block_rows: usize,
    /// Tokens (the calibration text's first) on which each linear's sensitivity is
    /// measured for the budget plans: the mean KL divergence from the reference with that
    /// linear alone quantized to `sensitivity_format` (see
    /// `compressme_profile::measure_sensitivity`). 0: the plans minimise the heuristic
    /// estimate alone (reports from before this field ran that way).
    #[serde(default)]
    pub sensitivity_tokens: usize,
    /// The format each linear is quantized to for its measurement.
    #[serde(default)]
    pub sensitivity_format: String,
    /// Whether the budget plans hold the output head at INT8 or above (reports from
    /// before this field did). Without the floor the head's measured sensitivity decides.
    #[serde(default = "yes")]
    pub budget_head_floor: bool,
    /// A budget plan at exactly candle Q4_K's bytes (its linears as the GGUF variant
    /// stores them), beside that variant (reports from before this field had none).
    #[serde(default)]
    pub budget_at_candle_q4_k: bool,
    /// GPTQ rounding: every plan's variant (and its shuffles) rounded by GPTQ against
    /// each linear's input Gram matrix on the calibration windows, with this damping (a
    /// fraction of the matrix's mean diagonal), and a uniform NF4-g64 variant so
    /// rounded beside the absmax and activation-aware ones. Absent (reports from before
    /// this field): the plans use activation-aware scales.
    #[serde(default)]
    pub gptq_damp: Option<f64>,
}

fn yes() -> bool {
    true
}

impl Default for RealConfig {
    fn default() -> Self {
        Self {
            model: "cache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf".into(),
            model_sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53".into(),
            calibration_text: "cache/austen/emma.txt".into(),
            calibration_windows: 16,
            eval_text: "cache/austen/persuasion.txt".into(),
            eval_tokens: 8192,
            window: 512,
            stride: 256,
            // 4.5 needs the tied embedding (a fifth of the weights) below INT8: the plans
            // have no head floor, and the head's measured sensitivity decides
            budgets_bpw: vec![4.5, 6.0],
            // not int4-g32: it reproduces the Q4_1 grid these weights sit on exactly
            candidates: [
                "int8",
                "nf4",
                "nf4-g32",
                "nf4-g64",
                "nf4-g128",
                "int4-g64",
                "int4-g128",
            ]
            .map(String::from)
            .to_vec(),
            shuffle_seeds: vec![1, 2, 3],
            bootstrap_resamples: 2000,
            seed: 42,
            prompt_tokens: 64,
            generate_tokens: 128,
            // two rounds, for the 15-minute budget: a third costs about 90 s, and the speed
            // targets are met by 2x and more (a variant's samples were 0.3-15% apart)
            timing_reps: 2,
            timing_threads: vec![1, 2],
            block_rows: 16,
            sensitivity_tokens: 512,
            sensitivity_format: "nf4-g64".into(),
            budget_head_floor: false,
            budget_at_candle_q4_k: true,
            gptq_damp: Some(0.01),
        }
    }
}

/// What a child process is asked to do with one stored variant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProbeRequest {
    /// The variant's file.
    pub file: PathBuf,
    /// For a GGUF of candle's formats, the format (`q8_0`, `q4_k`, ...); ours otherwise.
    pub candle: Option<String>,
    /// A window to run once after loading (for the memory peak; may be empty).
    pub window: Vec<u32>,
    /// The generation prompt.
    pub prompt: Vec<u32>,
    /// Tokens to generate (0: no generation).
    pub max_new: usize,
}

/// What a child measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProbeResult {
    /// Threads its kernels used.
    pub threads: usize,
    /// Loading the file (read, verify, build), seconds.
    pub load_seconds: f64,
    /// Resident memory before loading.
    pub baseline_rss_bytes: Option<u64>,
    /// Peak resident memory over loading, the window and the generation.
    pub peak_rss_bytes: Option<u64>,
    /// The window's forward pass, seconds (0 when there was none).
    pub window_seconds: f64,
    /// SHA-256 of the window's logits (every value's bits, little-endian, row after
    /// row), when there was one.
    #[serde(default)]
    pub window_sha256: Option<String>,
    /// The generation, seconds.
    pub generate_seconds: f64,
    /// Tokens it produced.
    pub generated: u64,
}

/// Runs a [`ProbeRequest`] on a given number of threads, in a fresh process (so the
/// memory peak is the variant's, and the thread count takes effect).
pub trait Probe: Sync {
    /// Runs `req` with `threads` threads.
    ///
    /// # Errors
    /// The child's failure.
    fn probe(&self, req: &ProbeRequest, threads: usize) -> Result<ProbeResult>;
}

/// Loads a stored variant of a decoder: an artifact (ours), or a GGUF of candle's
/// `format` written by the benchmark (candle's kernels).
///
/// # Errors
/// The file's read, verification and build errors.
pub fn load_variant(file: &Path, candle: Option<LlamaFormat>) -> Result<Decoder> {
    match candle {
        None => Ok(LanguageModel::from_artifact(file, &Device::Cpu)?.model),
        Some(f) => read_gguf(file, f, |meta, tensors| {
            let cfg: DecoderConfig = meta
                .get(DECODER_CONFIG_KEY)
                .ok_or_else(|| {
                    Error::Json(format!("{}: no `{DECODER_CONFIG_KEY}`", file.display()))
                })
                .and_then(|s| serde_json::from_str(s).map_err(|e| Error::Json(e.to_string())))?;
            let mut tensors: BTreeMap<String, Tensor> = tensors.into_iter().collect();
            Ok(Decoder::from_source(
                cfg,
                &mut tensors,
                Layout::Linear,
                &Device::Cpu,
            )?)
        }),
    }
}

/// SHA-256 of rows of logits: every value's bits, little-endian, row after row (the
/// rows are of one length, the vocabulary's).
fn logits_sha256(rows: &[Vec<f32>]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    let mut bytes = Vec::new();
    for row in rows {
        bytes.clear();
        bytes.extend(row.iter().flat_map(|v| v.to_le_bytes()));
        h.update(&bytes);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Parses a candle format name (`q8_0`, `q6_k`, `q4_k`, `q4_0`, `q4_1`, `q5_0`).
///
/// # Errors
/// [`Error::Config`] for another name.
pub fn candle_format(name: &str) -> Result<LlamaFormat> {
    LlamaFormat::ALL
        .into_iter()
        .find(|f| f.name() == name)
        .ok_or_else(|| Error::Config(format!("`{name}` is not one of candle's formats here")))
}

/// Does what a [`ProbeRequest`] asks in this process: load, run the window, generate.
/// A fresh child process runs this, so the peak resident memory it reports is the
/// variant's (the process's peak since it started; nothing is reset).
///
/// # Errors
/// Loading or running the variant.
pub fn probe_in_process(req: &ProbeRequest) -> Result<ProbeResult> {
    let candle = req.candle.as_deref().map(candle_format).transpose()?;
    // no reset: a child runs one request, so its peak since it started is the variant's
    // (the baseline says what the process held before loading)
    let baseline_rss_bytes = compressme_eval::current_rss_bytes();
    let t = Instant::now();
    let model = load_variant(&req.file, candle)?;
    let load_seconds = t.elapsed().as_secs_f64();
    let t = Instant::now();
    // the rows the first window of an evaluation asks for: all but the last
    let logits = match req.window.len() {
        0 => None,
        n => Some(model.logits(&req.window, 0..n - 1)?),
    };
    let window_seconds = if logits.is_some() {
        t.elapsed().as_secs_f64()
    } else {
        0.0
    };
    // the digest after the timing, and the logits dropped before the generation
    let window_sha256 = logits.map(|l| logits_sha256(&l));
    let t = Instant::now();
    let generated = match req.max_new {
        0 => 0,
        n => model.generate_tokens(&req.prompt, n)? as u64,
    };
    let generate_seconds = t.elapsed().as_secs_f64();
    Ok(ProbeResult {
        threads: candle_core::utils::get_num_threads(),
        load_seconds,
        baseline_rss_bytes,
        peak_rss_bytes: compressme_eval::peak_rss_bytes(),
        window_seconds,
        window_sha256,
        generate_seconds,
        generated,
    })
}

/// Measures every linear's sensitivity on `ids`: the mean KL divergence (nats a
/// position) of the model's next-token distributions with that linear alone quantized to
/// `format`, from the unchanged model's, scored as the variants are
/// (`compressme_eval::score_against`, one window over `ids`); then puts it into
/// `profile`'s estimates (`compressme_profile::measure_sensitivity`, a lane a thread). A
/// linear of a block is run from that block's input, kept from one pass of the unchanged
/// model, so a measurement costs the blocks from its own on and the head, not the whole
/// model. `progress` advances once a linear.
///
/// # Errors
/// More ids than the model's context; the model's and the measurement's failures.
pub fn measure_decoder_sensitivity(
    model: &Decoder,
    profile: &mut compressme_profile::Profile,
    ids: &[u32],
    format: Format,
    progress: &dyn Progress,
) -> Result<()> {
    let docs = vec![ids.to_vec()];
    let window = Window {
        len: ids.len(),
        stride: ids.len(),
    };
    let reference = score_documents(&docs, window, true, |w, rows| {
        model.logit_rows_at(w, rows).map_err(|e| e.to_string())
    })?
    .with_probabilities();
    let inputs = model.block_inputs(ids)?;
    compressme_profile::measure_sensitivity(
        model,
        profile,
        format,
        candle_core::utils::get_num_threads(),
        |m, name| {
            let logits = |w: &[u32], rows: Rows| {
                match m.block_of(name).and_then(|b| Some((b, inputs.get(b)?))) {
                    Some((b, x)) => m.logit_rows_from(b, x, rows),
                    None => m.logit_rows_at(w, rows),
                }
                .map_err(|e| e.to_string())
            };
            score_against(&docs, window, &reference, logits)
                .map(|(_, sh)| sh.kl_mean)
                .map_err(|e| e.to_string())
        },
        |_| progress.inc(1),
    )?;
    Ok(())
}

/// One variant stored, reloaded and scored.
struct Done {
    variant: Variant,
    file: PathBuf,
    candle: Option<LlamaFormat>,
    /// The reference's scores with their distributions (the reference only).
    kept: Option<Scored>,
}

fn read_text(path: &str) -> Result<String> {
    std::fs::read_to_string(path).map_err(io(Path::new(path)))
}

fn check(cfg: &RealConfig) -> Result<Vec<Format>> {
    let bad = if cfg.window < 2 || cfg.stride == 0 {
        Some("window must be at least 2 and stride at least 1".to_string())
    } else if cfg.calibration_windows == 0 || cfg.eval_tokens < 2 {
        Some("calibration_windows must be positive and eval_tokens at least 2".into())
    } else if cfg.timing_reps == 0 || cfg.timing_threads.is_empty() {
        Some("timing_reps and timing_threads must not be empty".into())
    } else if cfg.prompt_tokens == 0 || cfg.prompt_tokens > cfg.eval_tokens {
        Some("prompt_tokens must be positive and at most eval_tokens".into())
    } else if cfg.gptq_damp.is_some_and(|d| !(d.is_finite() && d >= 0.0)) {
        Some("gptq_damp must be a finite non-negative number".into())
    } else if cfg.candidates.iter().any(|c| c == "int4-g32") {
        Some(
            "int4-g32 reproduces the Q4_1 grid of the reference exactly: leave it out of the candidates"
                .into(),
        )
    } else {
        None
    };
    let bad = bad.or_else(|| {
        (cfg.sensitivity_tokens > 0 && Format::parse(&cfg.sensitivity_format).is_err()).then(|| {
            format!(
                "sensitivity_format `{}` is not a format",
                cfg.sensitivity_format
            )
        })
    });
    if let Some(b) = bad {
        return Err(Error::Config(b));
    }
    cfg.candidates
        .iter()
        .map(|c| Format::parse(c).map_err(|e| Error::Config(e.to_string())))
        .collect()
}

/// Runs the real-model benchmark of `cfg`, writing every variant's file under
/// `work_dir`; `probe` measures memory and generation speed in child processes.
///
/// # Errors
/// A configuration that cannot run (a model of another SHA-256, a text too short), and
/// any failure of profiling, packing, reloading or evaluating.
#[allow(clippy::too_many_lines)] // the run reads top to bottom as the report's sections
pub fn run_real(
    cfg: &RealConfig,
    work_dir: &Path,
    progress: &dyn Progress,
    probe: &dyn Probe,
) -> Result<Report> {
    let candidates = check(cfg)?;
    let t0 = Instant::now();
    std::fs::create_dir_all(work_dir).map_err(io(work_dir))?;
    let lm = LanguageModel::open(Path::new(&cfg.model), &Device::Cpu)?;
    if !cfg.model_sha256.is_empty() && lm.source.sha256 != cfg.model_sha256 {
        return Err(Error::Config(format!(
            "{} has SHA-256 {}, the configuration {}",
            cfg.model, lm.source.sha256, cfg.model_sha256
        )));
    }
    let model_cfg = lm.model.config().clone();
    if cfg.window > model_cfg.context {
        return Err(Error::Config(format!(
            "windows of {}, the model's context is {}",
            cfg.window, model_cfg.context
        )));
    }
    let calib_text = read_text(&cfg.calibration_text)?;
    let eval_text = read_text(&cfg.eval_text)?;
    let mut eval_ids = lm.encode(&eval_text)?;
    if eval_ids.len() < cfg.eval_tokens {
        return Err(Error::Config(format!(
            "{} has {} tokens, fewer than eval_tokens {}",
            cfg.eval_text,
            eval_ids.len(),
            cfg.eval_tokens
        )));
    }
    eval_ids.truncate(cfg.eval_tokens);
    let calib_ids = lm.encode(&calib_text)?;
    let windows: Vec<Tensor> = calib_ids
        .chunks_exact(cfg.window)
        .take(cfg.calibration_windows)
        .map(|c| Tensor::new(c, &Device::Cpu).and_then(|t| t.unsqueeze(0)))
        .collect::<candle_core::Result<_>>()?;
    if windows.len() < cfg.calibration_windows {
        return Err(Error::Config(format!(
            "{} has {} windows of {} tokens, fewer than calibration_windows {}",
            cfg.calibration_text,
            calib_ids.len() / cfg.window,
            cfg.window,
            cfg.calibration_windows
        )));
    }

    // profile on the calibration windows; error estimates for the candidates only
    progress.stage("calibration", windows.len() as u64);
    let settings = ProfileSettings {
        candidates: cfg.candidates.clone(),
        ..ProfileSettings::default()
    };
    // with GPTQ, each linear's input Gram matrix on the same pass; the head's logits are
    // not needed, only its input (`Decoder::observe`)
    // whole windows side by side, a lane a core (the reference's f32 products gain little
    // from a second thread); the same bits as one window after another
    let recorder = ActivationRecorder::new(settings)
        .with_calibration_sha256(sha256_hex(calib_text.as_bytes()))
        .with_lanes(candle_core::utils::get_num_threads());
    let forward = |m: &Decoder, ids: &Tensor| {
        let r = m.observe(ids);
        progress.inc(1);
        r
    };
    let (mut profile, grams) = match cfg.gptq_damp {
        Some(_) => {
            let (p, g) = recorder.record_with_grams(&lm.model, &windows, forward)?;
            (p, Some(g))
        }
        None => (recorder.record(&lm.model, &windows, forward)?, None),
    };
    progress.done(&format!(
        "profiled {} windows of {}{} in {:.0} s",
        windows.len(),
        cfg.calibration_text,
        if grams.is_some() {
            ", with the linears' input Gram matrices"
        } else {
            ""
        },
        t0.elapsed().as_secs_f64()
    ));
    // GPTQ's factors, from each linear's input Gram matrix on the calibration windows (the
    // matrices, about a gigabyte, are dropped here); the variants share their rounding
    let factors = match cfg.gptq_damp.zip(grams) {
        Some((damp, grams)) => {
            progress.stage("GPTQ factors", 1);
            let t = Instant::now();
            let factors = compressme_profile::factors_of(&grams, damp)?;
            progress.inc(1);
            progress.done(&format!(
                "GPTQ factors of {} linears (damping {damp}) in {:.0} s",
                factors.len(),
                t.elapsed().as_secs_f64()
            ));
            Some(Gptq::new(factors))
        }
        None => None,
    };
    if cfg.sensitivity_tokens > 0 {
        let ids = calib_ids
            .get(..cfg.sensitivity_tokens.min(model_cfg.context))
            .ok_or_else(|| {
                Error::Config(format!(
                    "{} has {} tokens, fewer than sensitivity_tokens {}",
                    cfg.calibration_text,
                    calib_ids.len(),
                    cfg.sensitivity_tokens
                ))
            })?;
        let format =
            Format::parse(&cfg.sensitivity_format).map_err(|e| Error::Config(e.to_string()))?;
        let n = profile
            .modules
            .values()
            .filter(|s| s.kind == ModuleKind::Linear)
            .count();
        progress.stage("sensitivity", n as u64);
        let t = Instant::now();
        measure_decoder_sensitivity(&lm.model, &mut profile, ids, format, progress)?;
        progress.done(&format!(
            "measured {n} linears at {format} on {} tokens in {:.0} s",
            ids.len(),
            t.elapsed().as_secs_f64()
        ));
    }
    let profile_json = profile.to_json()?;
    // kept beside the variants: the plans in the report are made from it
    let profile_path = work_dir.join("profile.json");
    std::fs::write(&profile_path, &profile_json).map_err(io(&profile_path))?;

    let plan_rounding = if factors.is_some() {
        Rounding::Gptq
    } else {
        Rounding::Aware
    };

    // plans
    let policy = Policy {
        protect_output_head: true,
        output_heads: lm.model.output_heads(),
    };
    let shapes = compressme_plan::shapes(&profile);
    let linears: Vec<String> = lm
        .model
        .modules()
        .into_iter()
        .filter(|m| m.kind == ModuleKind::Linear)
        .map(|m| m.name)
        .collect();
    let weights: u64 = shapes
        .iter()
        .filter(|(n, _)| linears.contains(n))
        .map(|(_, s)| (s.rows * s.cols) as u64)
        .sum();
    let uniform = |f: Format| -> BTreeMap<String, Choice> {
        linears
            .iter()
            .map(|n| (n.clone(), Choice::Format(f)))
            .collect()
    };
    let nf4_g64 = Format::Nf4Block(GroupSize::G64);
    let mut planned = vec![
        Planned::ours(
            "f32",
            "the reference: the GGUF's Q4_1 weights dequantized to f32".into(),
            false,
            BTreeMap::new(),
            None,
        ),
        Planned::ours(
            "int8",
            "every linear INT8 per row (the tied embedding/head included)".into(),
            false,
            uniform(Format::Int8),
            None,
        ),
        Planned::ours(
            "int8-g32",
            "every linear INT8 with an f16 scale per 32 weights (Q8_0's layout and 8.5 bits; the tied embedding/head included)".into(),
            false,
            uniform(Format::Int8Block(GroupSize::G32)),
            None,
        ),
        Planned {
            name: "nf4-g64".into(),
            description: "every linear blockwise NF4, groups of 64, absmax scales".into(),
            control: false,
            spec: Spec::Ours {
                choices: uniform(nf4_g64),
                plan: None,
                rounding: Rounding::Absmax,
            },
        },
        Planned::ours(
            "nf4-g64-aware",
            "every linear blockwise NF4, groups of 64, scales chosen against the calibration activations".into(),
            false,
            uniform(nf4_g64),
            None,
        ),
    ];
    if factors.is_some() {
        planned.push(Planned {
            name: "nf4-g64-gptq".into(),
            description: "every linear blockwise NF4, groups of 64, GPTQ-rounded against each linear's input Gram matrix on the calibration windows".into(),
            control: false,
            spec: Spec::Ours {
                choices: uniform(nf4_g64),
                plan: None,
                rounding: Rounding::Gptq,
            },
        });
    }
    let thresholds = Plan::from_importance(&profile, policy.clone());
    planned.push(Planned::ours(
        "thresholds",
        format!("the seed's importance thresholds, {}", thresholds.method),
        false,
        thresholds.modules.clone(),
        Some(thresholds),
    ));
    let budget_policy = Policy {
        protect_output_head: cfg.budget_head_floor,
        ..policy.clone()
    };
    let estimate = if cfg.sensitivity_tokens > 0 {
        format!(
            "each linear's KL measured alone at {} on {} calibration tokens",
            cfg.sensitivity_format, cfg.sensitivity_tokens
        )
    } else {
        "the heuristic error estimate".into()
    };
    let floor = if cfg.budget_head_floor {
        "head at INT8 or above"
    } else {
        "no head floor"
    };
    for &bpw in &cfg.budgets_bpw {
        let bytes = (bpw * weights as f64 / 8.0).floor() as u64;
        let plan = Plan::within_budget(&profile, &candidates, bytes, budget_policy.clone())?;
        let name = format!("budget-{bpw}");
        // as reports from before the measurement described it, when it ran that way
        let how = if cfg.sensitivity_tokens == 0 && cfg.budget_head_floor {
            String::new()
        } else {
            format!("; {estimate}; {floor}")
        };
        planned.push(Planned::ours(
            &name,
            format!("budget solver at {bpw} bits a weight ({bytes} bytes{how})"),
            false,
            plan.modules.clone(),
            Some(plan.clone()),
        ));
        for &s in &cfg.shuffle_seeds {
            let p = plan.shuffled(&shapes, s);
            planned.push(Planned::ours(
                &format!("{name}-shuffled-{s}"),
                format!("{name} shuffled within equal-shaped modules, seed {s} (same bytes)"),
                true,
                p.modules.clone(),
                Some(p),
            ));
        }
    }
    let nf4_bytes = compressme_plan::planned_bytes(&uniform(nf4_g64), &shapes)
        .ok_or_else(|| Error::Config("uniform NF4-g64's bytes cannot be counted".into()))?;
    // uniform NF4-g64 holds the head at 4 bits too, and at its bytes an INT8 head does
    // not fit: this plan, like the uniform one it is compared with, has no head floor
    let unprotected = Policy {
        protect_output_head: false,
        ..policy.clone()
    };
    let at_nf4 = Plan::within_budget(&profile, &candidates, nf4_bytes, unprotected)?;
    planned.push(Planned::ours(
        "budget-at-nf4-g64",
        format!(
            "budget solver at uniform NF4-g64's {nf4_bytes} bytes, no head floor (as uniform NF4-g64){}",
            if cfg.sensitivity_tokens == 0 { String::new() } else { format!("; {estimate}") }
        ),
        false,
        at_nf4.modules.clone(),
        Some(at_nf4),
    ));
    if cfg.budget_at_candle_q4_k {
        // candle's Q4_K variant's linears, each in the type it gets for its width
        let q4k_bytes: u64 = linears
            .iter()
            .filter_map(|n| shapes.get(n))
            .map(|s| {
                let d = LlamaFormat::Q4K.for_width(s.cols).ggml();
                ((s.rows * s.cols / d.block_size()) * d.type_size()) as u64
            })
            .sum();
        let plan = Plan::within_budget(&profile, &candidates, q4k_bytes, budget_policy.clone())?;
        planned.push(Planned::ours(
            "budget-at-candle-q4_k",
            format!("budget solver at candle Q4_K's {q4k_bytes} bytes ({estimate}; {floor})"),
            false,
            plan.modules.clone(),
            Some(plan),
        ));
    }
    // every plan's variant (the shuffles too) rounded one way
    for p in &mut planned {
        if let Spec::Ours {
            plan: Some(_),
            rounding,
            ..
        } = &mut p.spec
        {
            *rounding = plan_rounding;
            if plan_rounding == Rounding::Gptq {
                p.description.push_str("; GPTQ-rounded");
            }
        }
    }
    for f in [LlamaFormat::Q8_0, LlamaFormat::Q6K, LlamaFormat::Q4K] {
        let fallback = f.for_width(model_cfg.hidden);
        let note = if fallback == f {
            String::new()
        } else {
            format!(
                "; rows of {} weights (not a multiple of 256) get {}, as llama.cpp's quantizer does",
                model_cfg.hidden,
                fallback.name()
            )
        };
        // `compressme_nn::replicate_ggml` takes these
        let replica = if matches!(fallback, LlamaFormat::Q5_0 | LlamaFormat::Q8_0) {
            format!(
                "; on AVX-512 VNNI its {} linears of {} columns are scored on compressme's \
                 replica of the kernel candle runs for them (the same bits: every logit of \
                 the first window is compared with candle's), and timed on candle's own",
                fallback.name(),
                model_cfg.hidden
            )
        } else {
            String::new()
        };
        planned.push(Planned {
            name: format!("candle-{}", f.name()),
            description: format!(
                "candle's {} for every linear{note}, saved as GGUF, run by candle's quantized kernels{replica}",
                f.name()
            ),
            control: false,
            spec: Spec::Candle(f),
        });
    }
    let plans = plans_of(&planned);

    // store, reload, evaluate: the reference once with its distributions, the rest
    // against them
    let tensors = lm.model.tensors()?;
    let metadata = lm.artifact_metadata()?;
    let config_json = metadata
        .get(DECODER_CONFIG_KEY)
        .cloned()
        .unwrap_or_default();
    let window = Window {
        len: cfg.window,
        stride: cfg.stride,
    };
    let docs = vec![eval_ids.clone()];
    // the evaluation's first window, which each variant's memory child runs again
    let first_window: Vec<u32> = eval_ids.iter().take(cfg.window).copied().collect();
    // one variant: store, reload, score (against `reference`, or as the reference with
    // its distributions); `note` gets its line
    let one = |p: &Planned, reference: Option<&Scored>, note: &dyn Fn(&str)| -> Result<Done> {
        let t_variant = Instant::now();
        let (file, file_bytes, candle) = match &p.spec {
            Spec::Ours {
                choices,
                plan,
                rounding,
            } => {
                let path = work_dir.join(format!("{}.cma", p.name));
                let s = write_ours(
                    &path,
                    &metadata,
                    &tensors,
                    choices,
                    &profile,
                    plan.as_ref(),
                    cfg.block_rows,
                    *rounding,
                    factors.as_ref(),
                )?;
                (path, s.file_bytes, None)
            }
            Spec::Candle(f) => {
                let path = work_dir.join(format!("{}.gguf", p.name));
                write_gguf(
                    &path,
                    &[(DECODER_CONFIG_KEY, config_json.clone())],
                    &tensors,
                    &linears,
                    *f,
                )?;
                let len = std::fs::metadata(&path).map_err(io(&path))?.len();
                (path, len, Some(*f))
            }
        };
        progress.inc(1);
        let t_load = Instant::now();
        let model = load_variant(&file, candle)?;
        let load_seconds = t_load.elapsed().as_secs_f64();
        // candle's Q5_0 and unrepacked Q8_0 linears scored on the replica of its kernels;
        // the memory child and the timing run candle's own, and the memory child checks
        // the replica's bits
        let replica = match candle {
            Some(_) => {
                // the clone shares the loaded tensors; only its linears' weights change
                let mut m = model.clone();
                let n = compressme_nn::replicate_ggml(&mut m)?;
                (n > 0).then_some((m, n))
            }
            None => None,
        };
        progress.inc(1);
        // the first window's logits as scored, which the variant's memory child (loading
        // the file afresh; candle's own kernels for candle's variants) must give
        let first = std::sync::OnceLock::new();
        let logits = |ids: &[u32], rows: Rows| -> std::result::Result<Vec<Vec<f32>>, String> {
            let m = replica.as_ref().map_or(&model, |(fast, _)| fast);
            let got = m.logits(ids, rows.clone()).map_err(|e| e.to_string())?;
            if ids == first_window.as_slice() && rows == (0..ids.len().saturating_sub(1)) {
                first.get_or_init(|| logits_sha256(&got));
            }
            Ok(got)
        };
        let (scored, sh, kept) = match reference {
            None => {
                // the reference's windows side by side, a lane a core: its f32 products
                // gain little from a second thread, whole windows nearly twice
                let lanes = candle_core::utils::get_num_threads();
                let r = score_documents_in_lanes(&docs, window, true, lanes, logits)?;
                let sh = shift(&r, &r)?;
                let mut scored = r.clone();
                scored.distributions = Vec::new();
                (scored, sh, Some(r))
            }
            Some(r) => {
                let (scored, sh) = score_against(&docs, window, r, logits)?;
                (scored, sh, None)
            }
        };
        let first_sha256 = first.into_inner().ok_or_else(|| {
            Error::Config(format!(
                "{}: no window of the evaluation is the one its memory child runs",
                p.name
            ))
        })?;
        let st = storage(&file, file_bytes, &model)?;
        // memory, and the bits again: a child loads the file afresh (candle's variants on
        // candle's own kernels) and runs the evaluation's first window on one thread, in
        // this lane; its peak is the variant's, and its logits must be the ones scored.
        // Not for the shuffled controls (quality controls, neither timed nor probed)
        let memory = if p.control {
            None
        } else {
            let req = ProbeRequest {
                file: file.clone(),
                candle: candle.map(|f| f.name().to_string()),
                window: first_window.clone(),
                prompt: Vec::new(),
                max_new: 0,
            };
            let r = probe.probe(&req, 1)?;
            if r.window_sha256.as_deref() != Some(first_sha256.as_str()) {
                return Err(Error::Mismatch(format!(
                    "{}: the logits of the evaluation's first window, run again in a child \
                     process{}, are not those scored",
                    file.display(),
                    if candle.is_some() {
                        " on candle's own kernels (scored on the replica)"
                    } else {
                        ""
                    }
                )));
            }
            Some(r)
        };
        let replicated = replica.map_or(0, |(_, n)| n);
        progress.inc(1);
        note(&format!(
            "{}: {} -> {} bytes, perplexity {:.4}, KL {:.2e}, top-1 {:.4}{} in {:.0} s",
            p.name,
            st.module_dense_bytes,
            st.module_stored_bytes,
            scored.perplexity(),
            sh.kl_mean,
            sh.top1_agreement,
            if replicated > 0 {
                format!(" ({replicated} linears on the replica)")
            } else {
                String::new()
            },
            t_variant.elapsed().as_secs_f64()
        ));
        let variant = Variant {
            name: p.name.clone(),
            description: p.description.clone(),
            control: p.control,
            storage: st,
            mean_nll: scored.mean_nll(),
            perplexity: scored.perplexity(),
            shift: sh,
            nll: scored.nll(),
            timing: VariantTiming {
                load_seconds,
                forward: memory.as_ref().map_or_else(
                    || Timing::from_samples(0, Vec::new(), Vec::new()),
                    |r| {
                        Timing::from_samples(
                            0,
                            vec![r.window_seconds],
                            vec![first_window.len() as u64],
                        )
                    },
                ),
                generate: Timing::from_samples(0, Vec::new(), Vec::new()),
                generate_threads: Vec::new(),
            },
            peak_rss_bytes: memory.as_ref().and_then(|r| r.peak_rss_bytes),
            baseline_rss_bytes: memory.as_ref().and_then(|r| r.baseline_rss_bytes),
        };
        Ok(Done {
            variant,
            file,
            candle,
            kept,
        })
    };
    // the reference first, on every core: the others are scored against its
    // distributions
    let (reference_plan, others) = planned
        .split_first()
        .filter(|(p, _)| p.name == "f32")
        .ok_or_else(|| Error::Config("the variants do not start with the f32 reference".into()))?;
    progress.stage(&reference_plan.name, 3);
    let mut done = vec![one(reference_plan, None, &|line| progress.done(line))?];
    // each variant's KL reads the reference's probabilities instead of taking them again
    let reference = done
        .first_mut()
        .and_then(|d| d.kept.take())
        .ok_or_else(|| Error::Config("the reference kept no scores".into()))?
        .with_probabilities();
    // the rest side by side, a lane a core, each on one thread (the same bits as on all
    // of them; candle's quantized kernels keep their own pool, one caller at a time)
    let lanes = candle_core::utils::get_num_threads();
    progress.stage(
        &format!("{} variants, {lanes} lanes", others.len()),
        3 * others.len() as u64,
    );
    let t_others = Instant::now();
    // candle's first: scored on the replica they take longest, and a lane that takes one
    // last would leave the other core idle meanwhile
    let mut order: Vec<usize> = (0..others.len()).collect();
    order.sort_by_key(|&i| {
        others
            .get(i)
            .is_none_or(|p| !matches!(p.spec, Spec::Candle(_)))
    });
    let ordered: Vec<&Planned> = order.iter().filter_map(|&i| others.get(i)).collect();
    let scored = compressme_quant::in_lanes(
        &ordered,
        lanes,
        || Ok(()),
        |(), p| one(p, Some(&reference), &|line| progress.note(line)),
    )?;
    progress.done(&format!(
        "{} variants stored, reloaded and scored in {lanes} lanes of one thread in {:.0} s",
        others.len(),
        t_others.elapsed().as_secs_f64()
    ));
    let mut slots: Vec<Option<Done>> = (0..others.len()).map(|_| None).collect();
    for (i, d) in order.into_iter().zip(scored) {
        if let Some(slot) = slots.get_mut(i) {
            *slot = Some(d);
        }
    }
    done.extend(slots.into_iter().flatten());
    let (mut variants, mut files) = (Vec::new(), Vec::new());
    for d in done {
        variants.push(d.variant);
        files.push((d.file, d.candle));
    }
    let targets = reference.tokens.len();
    drop(reference);

    // speed, each variant but the shuffled controls (quality controls: the formats of
    // their plan on other modules) in child processes, in interleaved rounds
    let prompt: Vec<u32> = eval_ids.iter().take(cfg.prompt_tokens).copied().collect();
    let timed: Vec<usize> = variants
        .iter()
        .enumerate()
        .filter(|(_, v)| !v.control)
        .map(|(i, _)| i)
        .collect();
    let n = timed.len() * cfg.timing_threads.len();
    progress.stage("timing", (n * cfg.timing_reps) as u64);
    let t_timing = Instant::now();
    let mut samples: Vec<Vec<(Vec<f64>, Vec<u64>)>> =
        vec![vec![(Vec::new(), Vec::new()); cfg.timing_threads.len()]; files.len()];
    for _ in 0..cfg.timing_reps {
        for &i in &timed {
            let Some((file, candle)) = files.get(i) else {
                continue;
            };
            for (j, &threads) in cfg.timing_threads.iter().enumerate() {
                let req = ProbeRequest {
                    file: file.clone(),
                    candle: candle.map(|f| f.name().to_string()),
                    window: Vec::new(),
                    prompt: prompt.clone(),
                    max_new: cfg.generate_tokens,
                };
                let r = probe.probe(&req, threads)?;
                if let Some(s) = samples.get_mut(i).and_then(|s| s.get_mut(j)) {
                    s.0.push(r.generate_seconds);
                    s.1.push(r.generated);
                }
                progress.inc(1);
            }
        }
    }
    progress.done(&format!(
        "timed {} variants (not the {} shuffled controls) on {:?} threads, {} interleaved rounds, each in a child process, in {:.0} s",
        timed.len(),
        variants.len() - timed.len(),
        cfg.timing_threads,
        cfg.timing_reps,
        t_timing.elapsed().as_secs_f64(),
    ));
    for (v, per_thread) in variants.iter_mut().zip(samples) {
        if v.control {
            continue;
        }
        v.timing.generate_threads = cfg
            .timing_threads
            .iter()
            .zip(per_thread)
            .map(|(&threads, (s, u))| ThreadTiming {
                threads,
                timing: Timing::from_samples(0, s, u),
            })
            .collect();
        if let Some(t) = v.timing.generate_threads.first() {
            v.timing.generate = t.timing.clone();
        }
    }

    // the questions
    let mut questions: Vec<(String, String, String)> = variants
        .iter()
        .skip(1)
        .map(|v| ("f32".into(), v.name.clone(), format!("{} vs f32", v.name)))
        .collect();
    let q = |a: &str, b: &str, text: String| (a.to_string(), b.to_string(), text);
    for &bpw in &cfg.budgets_bpw {
        for &s in &cfg.shuffle_seeds {
            questions.push(q(
                &format!("budget-{bpw}-shuffled-{s}"),
                &format!("budget-{bpw}"),
                format!("does the {bpw}-bit budget plan beat its shuffle (seed {s})?"),
            ));
        }
    }
    // the plan at NF4-g64's bytes against the uniform variant rounded as it is
    let (same, how) = if factors.is_some() {
        ("nf4-g64-gptq", "GPTQ")
    } else {
        ("nf4-g64-aware", "activation-aware scales")
    };
    questions.push(q(
        same,
        "budget-at-nf4-g64",
        format!("a plan at uniform NF4-g64's bytes vs uniform NF4-g64 ({how})"),
    ));
    if factors.is_some() {
        questions.push(q(
            "nf4-g64-aware",
            "nf4-g64-gptq",
            "GPTQ vs activation-aware scales, NF4-g64".into(),
        ));
    }
    questions.push(q(
        "nf4-g64",
        "nf4-g64-aware",
        "activation-aware scales vs absmax, NF4-g64".into(),
    ));
    questions.push(q(
        "candle-q8_0",
        "int8",
        "INT8 per row vs candle Q8_0".into(),
    ));
    questions.push(q(
        "candle-q8_0",
        "int8-g32",
        "INT8-g32 vs candle Q8_0 (the same layout and bytes)".into(),
    ));
    for &bpw in &cfg.budgets_bpw {
        questions.push(q(
            "candle-q4_k",
            &format!("budget-{bpw}"),
            format!("the {bpw}-bit budget plan vs candle Q4_K"),
        ));
    }
    if cfg.budget_at_candle_q4_k {
        questions.push(q(
            "candle-q4_k",
            "budget-at-candle-q4_k",
            "a plan at candle Q4_K's bytes vs candle Q4_K".into(),
        ));
    }
    let paired = paired_rows(&variants, questions, cfg.bootstrap_resamples, cfg.seed)?;

    let artifact_version = crate::stages::artifact_version(work_dir, &variants)?;
    Ok(Report {
        report_version: crate::REPORT_VERSION,
        tool: format!("compressme {}", env!("CARGO_PKG_VERSION")),
        config: BenchConfig::Real(cfg.clone()),
        corpus: Corpus {
            train_pairs: 0,
            calibration_docs: windows.len(),
            calibration_sha256: sha256_hex(calib_text.as_bytes()),
            eval_docs: 1,
            eval_sha256: crate::task::corpus_sha256(&docs),
            targets,
            window,
        },
        training: None,
        profile_sha256: sha256_hex(profile_json.as_bytes()),
        plans,
        variants,
        paired,
        tolerance: Tolerance::default(),
        threads: std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
        candle_kernels: compressme_nn::candle_kernel_tier().into(),
        our_kernels: crate::our_kernel_tier(),
        artifact_version,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::logits_sha256;

    #[test]
    fn the_logits_digest_sees_every_bit_and_the_row_order() {
        let rows = vec![vec![1.0f32, -0.0, f32::NAN], vec![2.5, 1e-40, 3.0]];
        let d = logits_sha256(&rows);
        assert_eq!(d.len(), 64);
        assert_eq!(d, logits_sha256(&rows.clone()));
        // a signed zero, a NaN payload, a subnormal's last bit, the rows swapped
        let changed = [
            (0, 1, 0.0f32),
            (0, 2, f32::from_bits(f32::NAN.to_bits() | 1)),
            (1, 1, f32::from_bits(1e-40f32.to_bits() ^ 1)),
        ];
        for (r, c, v) in changed {
            let mut other = rows.clone();
            other[r][c] = v;
            assert_ne!(logits_sha256(&other), d, "row {r}, column {c}");
        }
        let swapped = vec![rows[1].clone(), rows[0].clone()];
        assert_ne!(logits_sha256(&swapped), d);
    }
}
