//! The run: train, profile, plan, store every variant, reload, evaluate.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use candle_core::{Device, Tensor};
use compressme_artifact::recipe::sha256_hex;
use compressme_eval::{Scored, Timing, Window, score_documents, shift};
use compressme_nn::causal::CONFIG_KEY;
use compressme_nn::{AdamW, CausalConfig, CausalLm, LlamaFormat, Model};
use compressme_plan::{Choice, Plan, Policy};
use compressme_profile::{ActivationRecorder, ProfileSettings, default_candidates};
use compressme_quant::synthetic::Rng;
use compressme_quant::{Format, GroupSize};
use sha2::{Digest, Sha256};

use crate::report::VariantTiming;
use crate::report::{Corpus, Report, Training, Variant};
use crate::stages::{
    Planned, Spec, f32_bytes, generate_all, io, paired_rows, plans_of, read_gguf, storage,
    time_interleaved, write_gguf, write_ours,
};
use crate::task::{self, corpus_sha256, sequence};
use crate::{BenchConfig, Config, Error, Progress, Result, Tolerance};

/// Checks that a configuration can run at all.
fn check(cfg: &Config) -> Result<()> {
    let m = &cfg.model;
    let bad = if cfg.window_stride == 0 {
        Some("window_stride must be at least 1")
    } else if m.context < 2 || cfg.doc_len < m.context {
        Some(
            "context must be at least 2, and doc_len at least the context (documents span windows)",
        )
    } else if cfg.eval_docs == 0 || cfg.calibration_docs == 0 || cfg.batch == 0 {
        Some("eval_docs, calibration_docs and batch must be positive")
    } else if !m.width.is_multiple_of(64) {
        Some(
            "width must be a multiple of 64 (blockwise NF4 with groups of 64, candle's 32-wide blocks)",
        )
    } else if cfg.timing_reps == 0 {
        Some("timing_reps must be positive")
    } else {
        None
    };
    bad.map_or(Ok(()), |b| Err(Error::Config(b.into())))
}

/// Runs the benchmark of `cfg`, writing every variant's file under `work_dir`.
///
/// # Errors
/// A configuration that cannot run, and any failure of training, packing, reloading or
/// evaluating (naming what failed).
pub fn run(cfg: &Config, work_dir: &Path, progress: &dyn Progress) -> Result<Report> {
    check(cfg)?;
    let t0 = Instant::now();
    std::fs::create_dir_all(work_dir).map_err(io(work_dir))?;
    let dev = Device::Cpu;
    let split = task::split(cfg)?;
    let vocab = cfg.model.vocab;
    let eval_docs: Vec<Vec<u32>> = split
        .eval
        .iter()
        .map(|&p| sequence(p, cfg.doc_len, vocab))
        .collect();
    let calib_docs: Vec<Vec<u32>> = split
        .calibration
        .iter()
        .map(|&p| sequence(p, cfg.doc_len, vocab))
        .collect();
    let window = Window {
        len: cfg.model.context,
        stride: cfg.window_stride,
    };

    // train
    let t_train = Instant::now();
    let model = CausalLm::new(cfg.model, cfg.seed, &dev)?;
    let mut opt = AdamW::new(model.vars(), cfg.lr, cfg.weight_decay)?;
    let mut rng = Rng::new(cfg.seed.wrapping_add(1));
    let mut losses = Vec::with_capacity(cfg.steps);
    progress.stage("training", cfg.steps as u64);
    for _ in 0..cfg.steps {
        let (ids, targets) = task::train_batch(&mut rng, &split.train, cfg, &dev)?;
        let loss = model.loss(&ids, &targets)?;
        losses.push(f64::from(loss.to_scalar::<f32>()?));
        opt.step(model.vars(), &loss.backward()?)?;
        progress.inc(1);
    }
    progress.done(&format!(
        "trained {} steps: loss {:.3} -> {:.3}",
        cfg.steps,
        losses.first().copied().unwrap_or(f64::NAN),
        losses.last().copied().unwrap_or(f64::NAN)
    ));
    drop(opt);
    let tensors = model.tensors()?;
    let mut h = Sha256::new();
    for (name, t) in &tensors {
        h.update(name.as_bytes());
        h.update(f32_bytes(t)?);
    }
    let weights_sha256 = compressme_blockstore::hex(&h.finalize());
    let training = Training {
        losses,
        weights_sha256,
        seconds: t_train.elapsed().as_secs_f64(),
    };

    // profile on the calibration documents, in windows of the context
    let ctx = cfg.model.context;
    let batches: Vec<Tensor> = calib_docs
        .iter()
        .map(|d| {
            let rows: Vec<u32> = d
                .chunks_exact(ctx)
                .flat_map(|c| c.iter().copied())
                .collect();
            let n = rows.len() / ctx;
            Tensor::from_vec(rows, (n, ctx), &dev)
        })
        .collect::<candle_core::Result<_>>()?;
    let calibration_sha256 = corpus_sha256(&calib_docs);
    let profile = ActivationRecorder::new(ProfileSettings::default())
        .with_calibration_sha256(calibration_sha256.clone())
        .record(&model, &batches, |m, b| m.forward(b).map(|_| ()))?;
    let profile_json = profile.to_json()?;

    // plans
    let shapes = compressme_plan::shapes(&profile);
    let mixed = Plan::from_importance(&profile, Policy::default());
    let mixed_bytes = compressme_plan::planned_bytes(&mixed.modules, &shapes)
        .ok_or_else(|| Error::Config("the mixed plan's bytes cannot be counted".into()))?;
    let budget = Plan::within_budget(
        &profile,
        &default_candidates(),
        mixed_bytes,
        Policy::default(),
    )?;
    let linears: Vec<String> = model
        .modules()
        .into_iter()
        .filter(|m| m.kind == compressme_nn::ModuleKind::Linear)
        .map(|m| m.name)
        .collect();
    let uniform = |f: Format| -> BTreeMap<String, Choice> {
        linears
            .iter()
            .map(|n| (n.clone(), Choice::Format(f)))
            .collect()
    };
    let mut planned = vec![
        Planned::ours(
            "fp32",
            "every weight dense f32 (the reference)".into(),
            false,
            BTreeMap::new(),
            None,
        ),
        Planned::ours(
            "lossless-emb",
            "f32, token embedding in lossless row blocks (bit-identical)".into(),
            false,
            BTreeMap::from([("tok_embeddings".to_string(), Choice::Lossless)]),
            None,
        ),
        Planned::ours(
            "int8",
            "every linear INT8 per row (lm_head included)".into(),
            false,
            uniform(Format::Int8),
            None,
        ),
        Planned::ours(
            "nf4",
            "every linear NF4 per row (lm_head included)".into(),
            false,
            uniform(Format::Nf4),
            None,
        ),
        Planned::ours(
            "nf4-g64",
            "every linear blockwise NF4, groups of 64 (lm_head included)".into(),
            false,
            uniform(Format::Nf4Block(GroupSize::G64)),
            None,
        ),
        Planned::ours(
            "mixed",
            format!("activation-guided plan, {}", mixed.method),
            false,
            mixed.modules.clone(),
            Some(mixed.clone()),
        ),
        Planned::ours(
            "budget",
            format!(
                "budget solver at the mixed plan's {mixed_bytes} bytes (estimated output error)"
            ),
            false,
            budget.modules.clone(),
            Some(budget.clone()),
        ),
    ];
    let mut seen: Vec<(String, BTreeMap<String, Choice>)> =
        vec![("mixed".into(), mixed.modules.clone())];
    for &s in &cfg.shuffle_seeds {
        let p = mixed.shuffled(&shapes, s);
        let name = format!("shuffled-{s}");
        // small groups allow few permutations: say when two controls coincide
        let same = seen
            .iter()
            .find(|(_, m)| *m == p.modules)
            .map_or(String::new(), |(n, _)| {
                format!("; the same assignment as {n}")
            });
        seen.push((name.clone(), p.modules.clone()));
        planned.push(Planned::ours(
            &name,
            format!(
                "the mixed plan shuffled within equal-shaped modules, seed {s} (same bytes{same})"
            ),
            true,
            p.modules.clone(),
            Some(p),
        ));
    }
    for (f, name) in [(LlamaFormat::Q8_0, "q8_0"), (LlamaFormat::Q4_0, "q4_0")] {
        planned.push(Planned {
            name: format!("candle-{name}"),
            description: format!(
                "candle's {f:?} for every linear (llama.cpp's format), saved as GGUF, run by candle's quantized kernels"
            ),
            control: false,
            spec: Spec::Candle(f),
        });
    }
    let plans = plans_of(&planned);
    let config_json = serde_json::to_string(&cfg.model).map_err(|e| Error::Json(e.to_string()))?;
    let metadata = BTreeMap::from([(CONFIG_KEY.to_string(), config_json.clone())]);

    // every variant: store, reload, evaluate
    let forward_ids: Vec<u32> = eval_docs
        .iter()
        .flat_map(|d| d.iter().take(ctx).copied())
        .collect();
    let per_doc = forward_ids.len() / eval_docs.len();
    let forward_ids = Tensor::from_vec(forward_ids, (eval_docs.len(), per_doc), &dev)?;
    let prompts: Vec<Vec<u32>> = eval_docs
        .iter()
        .take(4)
        .map(|d| d.iter().take(4).copied().collect())
        .collect();
    let mut variants: Vec<Variant> = Vec::new();
    let mut files = Vec::new();
    let mut reference: Option<Scored> = None;
    for p in &planned {
        progress.stage(&p.name, 4);
        let (file, file_bytes) = match &p.spec {
            Spec::Ours {
                choices,
                plan,
                rounding,
            } => {
                let path = work_dir.join(format!("{}.cma", p.name));
                let summary = write_ours(
                    &path,
                    &metadata,
                    &tensors,
                    choices,
                    &profile,
                    plan.as_ref(),
                    cfg.block_rows,
                    *rounding,
                    None,
                )?;
                (path, summary.file_bytes)
            }
            Spec::Candle(f) => {
                let path = work_dir.join(format!("{}.gguf", p.name));
                write_gguf(
                    &path,
                    &[(CONFIG_KEY, config_json.clone())],
                    &tensors,
                    &linears,
                    *f,
                )?;
                let len = std::fs::metadata(&path).map_err(io(&path))?.len();
                (path, len)
            }
        };
        progress.inc(1);
        // a peak is reported only when the reset before the load took (checked)
        let reset = compressme_eval::reset_peak_rss();
        let baseline_rss_bytes = compressme_eval::current_rss_bytes().filter(|_| reset);
        let t_load = Instant::now();
        let loaded = load(&p.spec, &file, &dev)?;
        let load_seconds = t_load.elapsed().as_secs_f64();
        progress.inc(1);
        let scored = score_documents(&eval_docs, window, true, |ids, rows| {
            loaded.logit_rows_at(ids, rows).map_err(|e| e.to_string())
        })?;
        let reference_scored = reference.get_or_insert_with(|| scored.clone());
        let sh = shift(reference_scored, &scored)?;
        progress.inc(1);
        // the timed work once, so the peak covers it; the timing itself comes later,
        // interleaved across the variants
        loaded.forward(&forward_ids)?;
        generate_all(&loaded, &prompts, cfg.generate_tokens)?;
        let peak_rss_bytes = compressme_eval::peak_rss_bytes().filter(|_| reset);
        let storage = storage(&file, file_bytes, &loaded)?;
        progress.inc(1);
        progress.done(&format!(
            "{}: {} -> {} bytes, perplexity {:.4}, KL {:.2e}, top-1 {:.4}",
            p.name,
            storage.module_dense_bytes,
            storage.module_stored_bytes,
            scored.perplexity(),
            sh.kl_mean,
            sh.top1_agreement
        ));
        variants.push(Variant {
            name: p.name.clone(),
            description: p.description.clone(),
            control: p.control,
            storage,
            mean_nll: scored.mean_nll(),
            perplexity: scored.perplexity(),
            shift: sh,
            nll: scored.nll(),
            timing: VariantTiming {
                load_seconds,
                forward: Timing::from_samples(0, Vec::new(), Vec::new()),
                generate: Timing::from_samples(0, Vec::new(), Vec::new()),
                generate_threads: Vec::new(),
            },
            peak_rss_bytes,
            baseline_rss_bytes,
        });
        files.push(file);
    }

    // timing, interleaved: every variant reloaded from its file (each was dropped after its
    // evaluation, so that no variant's memory peak carries another's), then round r times
    // every variant once, so a slow moment on a shared machine falls on all of them
    let models = planned
        .iter()
        .zip(&files)
        .map(|(p, f)| load(&p.spec, f, &dev))
        .collect::<Result<Vec<_>>>()?;
    let timings = time_interleaved(
        &models,
        &forward_ids,
        &prompts,
        cfg.generate_tokens,
        cfg.timing_warmup,
        cfg.timing_reps,
        progress,
    )?;
    for (v, (forward, generate)) in variants.iter_mut().zip(timings) {
        v.timing.forward = forward;
        v.timing.generate = generate;
    }

    // paired comparisons
    let mut questions: Vec<(String, String, String)> = variants
        .iter()
        .skip(1)
        .map(|v| {
            (
                "fp32".to_string(),
                v.name.clone(),
                format!("{} vs FP32", v.name),
            )
        })
        .collect();
    for &s in &cfg.shuffle_seeds {
        questions.push((
            format!("shuffled-{s}"),
            "mixed".into(),
            format!("does the activation-guided assignment beat its shuffle (seed {s})?"),
        ));
    }
    questions.push((
        "mixed".into(),
        "budget".into(),
        "budget solver vs thresholds at the same bytes".into(),
    ));
    questions.push((
        "candle-q4_0".into(),
        "nf4-g64".into(),
        "blockwise NF4 g64 vs candle Q4_0".into(),
    ));
    questions.push((
        "candle-q8_0".into(),
        "int8".into(),
        "INT8 per row vs candle Q8_0".into(),
    ));
    let paired = paired_rows(&variants, questions, cfg.bootstrap_resamples, cfg.seed)?;

    let artifact_version = crate::stages::artifact_version(work_dir, &variants)?;
    Ok(Report {
        report_version: crate::REPORT_VERSION,
        tool: format!("compressme {}", env!("CARGO_PKG_VERSION")),
        config: BenchConfig::Synthetic(cfg.clone()),
        corpus: Corpus {
            train_pairs: split.train.len(),
            calibration_docs: calib_docs.len(),
            calibration_sha256,
            eval_docs: eval_docs.len(),
            eval_sha256: corpus_sha256(&eval_docs),
            targets: reference.map_or(0, |r| r.tokens.len()),
            window,
        },
        training: Some(training),
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

/// A variant's model from its file.
fn load(spec: &Spec, file: &Path, dev: &Device) -> Result<CausalLm> {
    match spec {
        Spec::Ours { .. } => Ok(CausalLm::from_artifact(file, dev)?),
        Spec::Candle(f) => read_gguf(file, *f, |meta, tensors| {
            let cfg: CausalConfig = meta
                .get(CONFIG_KEY)
                .ok_or_else(|| Error::Json(format!("{}: no `{CONFIG_KEY}`", file.display())))
                .and_then(|s| serde_json::from_str(s).map_err(|e| Error::Json(e.to_string())))?;
            Ok(CausalLm::from_tensors(cfg, &tensors, dev)?)
        }),
    }
}
