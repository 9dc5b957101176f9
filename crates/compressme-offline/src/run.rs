//! The run: train, profile, plan, store every variant, reload, evaluate.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::Instant;

use candle_core::quantized::{GgmlDType, QTensor, gguf_file};
use candle_core::{Device, Tensor};
use compressme_artifact::{Dtype, Writer, from_f32, recipe::sha256_hex};
use compressme_blockstore::Coder;
use compressme_eval::{Scored, Timing, Window, paired, score_documents, shift};
use compressme_nn::causal::CONFIG_KEY;
use compressme_nn::{AdamW, CausalConfig, CausalLm, LlamaFormat, Model};
use compressme_plan::{Choice, Plan, Policy};
use compressme_profile::{ActivationRecorder, Profile, ProfileSettings, default_candidates};
use compressme_quant::synthetic::Rng;
use compressme_quant::{Format, GroupSize};
use sha2::{Digest, Sha256};

use crate::report::VariantTiming;
use crate::report::{Corpus, ModuleBytes, PairedRow, Report, Storage, Training, Variant};
use crate::task::{self, corpus_sha256, sequence};
use crate::{Config, Error, Progress, Result, Tolerance};

/// How a variant is stored.
enum Spec {
    /// Ours: per module (by name) a plan choice; modules not named stay dense f32.
    Ours {
        choices: BTreeMap<String, Choice>,
        plan: Option<Plan>,
    },
    /// candle's GGUF types for every linear, the rest f32, in a GGUF file.
    Candle(LlamaFormat),
}

struct Planned {
    name: String,
    description: String,
    control: bool,
    spec: Spec,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.display().to_string(),
        source,
    }
}

fn f32_bytes(t: &Tensor) -> Result<Vec<u8>> {
    Ok(from_f32(Dtype::F32, &t.flatten_all()?.to_vec1::<f32>()?))
}

fn file_sha256(path: &Path) -> Result<String> {
    Ok(sha256_hex(&std::fs::read(path).map_err(io(path))?))
}

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
    let weights_sha256: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
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
    let ours = |choices, plan| Spec::Ours { choices, plan };
    let mut planned = vec![
        Planned {
            name: "fp32".into(),
            description: "every weight dense f32 (the reference)".into(),
            control: false,
            spec: ours(BTreeMap::new(), None),
        },
        Planned {
            name: "lossless-emb".into(),
            description: "f32, token embedding in lossless row blocks (bit-identical)".into(),
            control: false,
            spec: ours(
                BTreeMap::from([("tok_embeddings".to_string(), Choice::Lossless)]),
                None,
            ),
        },
        Planned {
            name: "int8".into(),
            description: "every linear INT8 per row (lm_head included)".into(),
            control: false,
            spec: ours(uniform(Format::Int8), None),
        },
        Planned {
            name: "nf4".into(),
            description: "every linear NF4 per row (lm_head included)".into(),
            control: false,
            spec: ours(uniform(Format::Nf4), None),
        },
        Planned {
            name: "nf4-g64".into(),
            description: "every linear blockwise NF4, groups of 64 (lm_head included)".into(),
            control: false,
            spec: ours(uniform(Format::Nf4Block(GroupSize::G64)), None),
        },
        Planned {
            name: "mixed".into(),
            description: format!("activation-guided plan, {}", mixed.method),
            control: false,
            spec: ours(mixed.modules.clone(), Some(mixed.clone())),
        },
        Planned {
            name: "budget".into(),
            description: format!(
                "budget solver at the mixed plan's {mixed_bytes} bytes (estimated output error)"
            ),
            control: false,
            spec: ours(budget.modules.clone(), Some(budget.clone())),
        },
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
        planned.push(Planned {
            name,
            description: format!(
                "the mixed plan shuffled within equal-shaped modules, seed {s} (same bytes{same})"
            ),
            control: true,
            spec: ours(p.modules.clone(), Some(p)),
        });
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
    let mut plans = BTreeMap::new();
    for p in &planned {
        if let Spec::Ours {
            plan: Some(plan), ..
        } = &p.spec
        {
            plans.insert(p.name.clone(), plan.clone());
        }
    }

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
            Spec::Ours { choices, plan } => {
                let path = work_dir.join(format!("{}.cma", p.name));
                let summary = write_ours(
                    &path,
                    cfg.model,
                    &tensors,
                    choices,
                    &profile,
                    plan.as_ref(),
                    cfg.block_rows,
                )?;
                (path, summary.file_bytes)
            }
            Spec::Candle(f) => {
                let path = work_dir.join(format!("{}.gguf", p.name));
                write_gguf(&path, cfg.model, &tensors, &linears, *f)?;
                let len = std::fs::metadata(&path).map_err(io(&path))?.len();
                (path, len)
            }
        };
        progress.inc(1);
        compressme_eval::reset_peak_rss();
        let baseline_rss_bytes = compressme_eval::current_rss_bytes();
        let t_load = Instant::now();
        let (loaded, modules) = load(&p.spec, &file, &linears, &dev)?;
        let load_seconds = t_load.elapsed().as_secs_f64();
        progress.inc(1);
        let scored = score_documents(&eval_docs, window, true, |ids| {
            loaded.logit_rows(ids).map_err(|e| e.to_string())
        })?;
        let reference_scored = reference.get_or_insert_with(|| scored.clone());
        let sh = shift(reference_scored, &scored)?;
        progress.inc(1);
        // the timed work once, so the peak covers it; the timing itself comes later,
        // interleaved across the variants
        loaded.forward(&forward_ids)?;
        generate_all(&loaded, &prompts, cfg.generate_tokens)?;
        let peak_rss_bytes = compressme_eval::peak_rss_bytes();
        let module_dense_bytes = modules.iter().map(|m: &ModuleBytes| m.dense_bytes).sum();
        let module_stored_bytes = modules.iter().map(|m: &ModuleBytes| m.stored_bytes).sum();
        let storage = Storage {
            file: file
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            file_bytes,
            file_sha256: file_sha256(&file)?,
            modules,
            other_bytes: loaded.other_bytes(),
            module_dense_bytes,
            module_stored_bytes,
        };
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
        .map(|(p, f)| load(&p.spec, f, &linears, &dev).map(|(m, _)| m))
        .collect::<Result<Vec<_>>>()?;
    let n = models.len();
    progress.stage(
        "timing",
        ((cfg.timing_warmup + cfg.timing_reps) * n * 2) as u64,
    );
    let n_fwd = forward_ids.elem_count() as u64;
    let (mut fwd, mut gen_s, mut gen_u) = (
        vec![Vec::new(); n],
        vec![Vec::new(); n],
        vec![Vec::new(); n],
    );
    for round in 0..cfg.timing_warmup + cfg.timing_reps {
        for (i, m) in models.iter().enumerate() {
            let t = Instant::now();
            m.forward(&forward_ids)?;
            let s_fwd = t.elapsed().as_secs_f64();
            let t = Instant::now();
            let produced = generate_all(m, &prompts, cfg.generate_tokens)?;
            let s_gen = t.elapsed().as_secs_f64();
            if round >= cfg.timing_warmup {
                fwd[i].push(s_fwd);
                gen_s[i].push(s_gen);
                gen_u[i].push(produced);
            }
            progress.inc(2);
        }
    }
    for (((v, f), s), u) in variants.iter_mut().zip(fwd).zip(gen_s).zip(gen_u) {
        let units = vec![n_fwd; f.len()];
        v.timing.forward = Timing::from_samples(cfg.timing_warmup, f, units);
        v.timing.generate = Timing::from_samples(cfg.timing_warmup, s, u);
    }
    progress.done(&format!(
        "timed {n} variants, {} interleaved rounds after {} warm-up rounds",
        cfg.timing_reps, cfg.timing_warmup
    ));

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
    let mut paired_rows = Vec::new();
    for (a, b, question) in questions {
        let (Some(va), Some(vb)) = (
            variants.iter().find(|v| v.name == a),
            variants.iter().find(|v| v.name == b),
        ) else {
            continue;
        };
        paired_rows.push(PairedRow {
            paired: paired(&va.nll, &vb.nll, cfg.bootstrap_resamples, cfg.seed)?,
            a,
            b,
            question,
        });
    }

    Ok(Report {
        report_version: crate::REPORT_VERSION,
        tool: format!("compressme {}", env!("CARGO_PKG_VERSION")),
        config: cfg.clone(),
        corpus: Corpus {
            train_pairs: split.train.len(),
            calibration_docs: calib_docs.len(),
            calibration_sha256,
            eval_docs: eval_docs.len(),
            eval_sha256: corpus_sha256(&eval_docs),
            targets: reference.map_or(0, |r| r.tokens.len()),
            window,
        },
        training,
        profile_sha256: sha256_hex(profile_json.as_bytes()),
        plans,
        variants,
        paired: paired_rows,
        tolerance: Tolerance::default(),
        threads: std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
        candle_kernels: compressme_nn::candle_kernel_tier().into(),
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// A variant's model from its file, and its modules' bytes as loaded.
fn load(
    spec: &Spec,
    file: &Path,
    linears: &[String],
    dev: &Device,
) -> Result<(CausalLm, Vec<ModuleBytes>)> {
    match spec {
        Spec::Ours { .. } => {
            let m = CausalLm::from_artifact(file, dev)?;
            let modules = module_bytes(&m);
            Ok((m, modules))
        }
        Spec::Candle(f) => read_gguf(file, linears, *f, dev),
    }
}

fn module_bytes(m: &CausalLm) -> Vec<ModuleBytes> {
    m.modules()
        .into_iter()
        .map(|i| ModuleBytes {
            name: i.name,
            storage: i.storage,
            dense_bytes: i.dense_bytes,
            stored_bytes: i.stored_bytes,
        })
        .collect()
}

/// Greedy generation from every prompt; the tokens actually produced.
fn generate_all(m: &CausalLm, prompts: &[Vec<u32>], max_new: usize) -> Result<u64> {
    let mut produced = 0u64;
    for p in prompts {
        produced += m.generate(p, max_new, None)?.len() as u64;
    }
    Ok(produced)
}

/// Writes an artifact of every tensor: modules named in `choices` as chosen (4-bit blocks
/// with activation-weighted rounding from `profile`), everything else dense.
fn write_ours(
    path: &Path,
    model: CausalConfig,
    tensors: &[(String, Tensor)],
    choices: &BTreeMap<String, Choice>,
    profile: &Profile,
    plan: Option<&Plan>,
    block_rows: usize,
) -> Result<compressme_artifact::Summary> {
    let mut w = Writer::create(path)?;
    let config = serde_json::to_string(&model).map_err(|e| Error::Json(e.to_string()))?;
    w.recipe_mut()
        .source_metadata
        .insert(CONFIG_KEY.to_string(), config);
    w.recipe_mut().calibration_sha256 = Some(profile.calibration_sha256.clone());
    if let Some(plan) = plan {
        w.recipe_mut().plan_sha256 = Some(sha256_hex(plan.to_json()?.as_bytes()));
        w.recipe_mut().output_head_policy = Some(plan.policy.describe());
    }
    for (name, t) in tensors {
        let bytes = f32_bytes(t)?;
        let shape = t.dims().to_vec();
        let module = name.strip_suffix(".weight");
        match module.and_then(|m| choices.get(m).map(|c| (m, c))) {
            Some((m, Choice::Format(f))) => {
                let importance: Vec<f32> = profile
                    .modules
                    .get(m)
                    .map(|s| s.channel_mean_sq().iter().map(|&v| v as f32).collect())
                    .unwrap_or_default();
                w.add_quantized_weighted(name, Dtype::F32, &shape, &bytes, *f, &importance)?;
            }
            Some((_, Choice::Lossless)) => {
                w.add_lossless(
                    name,
                    Dtype::F32,
                    &shape,
                    &bytes,
                    block_rows,
                    Coder::default(),
                )?;
            }
            _ => {
                w.add_dense(name, Dtype::F32, &shape, &bytes)?;
            }
        }
    }
    Ok(w.finish()?)
}

fn write_gguf(
    path: &Path,
    model: CausalConfig,
    tensors: &[(String, Tensor)],
    linears: &[String],
    format: LlamaFormat,
) -> Result<()> {
    let mut q = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let is_linear = name
            .strip_suffix(".weight")
            .is_some_and(|m| linears.iter().any(|l| l == m));
        let qt = match (is_linear, t.dims2()) {
            (true, Ok((rows, cols))) => {
                let w = t.flatten_all()?.to_vec1::<f32>()?;
                compressme_nn::llama_qtensor(&w, rows, cols, format)?
            }
            _ => QTensor::quantize(t, GgmlDType::F32)?,
        };
        q.push((name.as_str(), qt));
    }
    let config = serde_json::to_string(&model).map_err(|e| Error::Json(e.to_string()))?;
    let value = gguf_file::Value::String(config);
    let refs: Vec<(&str, &QTensor)> = q.iter().map(|(n, t)| (*n, t)).collect();
    let tmp = path.with_extension("gguf.tmp");
    let mut f = std::fs::File::create(&tmp).map_err(io(&tmp))?;
    gguf_file::write(&mut f, &[(CONFIG_KEY, &value)], &refs)?;
    f.sync_all().map_err(io(&tmp))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(io(path))?;
    Ok(())
}

fn read_gguf(
    path: &Path,
    linears: &[String],
    format: LlamaFormat,
    dev: &Device,
) -> Result<(CausalLm, Vec<ModuleBytes>)> {
    let mut f = std::fs::File::open(path).map_err(io(path))?;
    let content = gguf_file::Content::read(&mut f)?;
    let cfg: CausalConfig = match content.metadata.get(CONFIG_KEY) {
        Some(gguf_file::Value::String(s)) => {
            serde_json::from_str(s).map_err(|e| Error::Json(e.to_string()))?
        }
        _ => {
            return Err(Error::Json(format!(
                "{}: no `{CONFIG_KEY}`",
                path.display()
            )));
        }
    };
    let mut tensors = HashMap::new();
    let mut packed = Vec::new();
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    for name in names {
        let qt = content.tensor(&mut f, name, dev)?;
        tensors.insert(name.clone(), qt.dequantize(dev)?);
        if let Some(m) = name.strip_suffix(".weight")
            && linears.iter().any(|l| l == m)
        {
            packed.push((m.to_string(), qt));
        }
    }
    // build with dense weights, then give every linear candle's quantized tensor, run
    // by candle's quantized kernels
    let mut model = CausalLm::from_tensors(cfg, &tensors, dev)?;
    drop(tensors);
    for (m, qt) in packed {
        if qt.dtype() != format.ggml() {
            return Err(Error::Json(format!(
                "{}: `{m}.weight` is {:?}, expected {:?}",
                path.display(),
                qt.dtype(),
                format.ggml()
            )));
        }
        match model.module_mut(&m) {
            Some(compressme_nn::ModuleMut::Linear(l)) => {
                l.set_weight(compressme_nn::Weight::Ggml(std::sync::Arc::new(qt)))?;
            }
            _ => return Err(Error::Json(format!("`{m}` is not a linear"))),
        }
    }
    let modules = module_bytes(&model);
    Ok((model, modules))
}
