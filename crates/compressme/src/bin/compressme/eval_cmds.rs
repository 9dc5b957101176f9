//! `bench` (the offline benchmark and its replay) and `evaluate`: argument handling and
//! display; the work is in `compressme-offline` and `compressme-eval`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::progress::Bars;
use candle_core::Device;
use compressme::offline::{self, Config, Report};

/// Options of `compressme bench`.
#[derive(clap::Args)]
pub(crate) struct BenchArgs {
    /// Seeds the weights, the data split and the batches.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Training steps.
    #[arg(long)]
    steps: Option<usize>,
    /// Timed calls per variant (forward and generation).
    #[arg(long)]
    timing_reps: Option<usize>,
    /// Evaluation documents.
    #[arg(long)]
    eval_docs: Option<usize>,
    /// Seeds of the shuffled controls (comma-separated).
    #[arg(long)]
    shuffle_seeds: Option<String>,
    /// The report; the table (.md) and chart (.svg) go beside it with the same stem
    /// (default results/offline.json, or results/real.json with --model).
    #[arg(short, long)]
    output: Option<PathBuf>,
    /// Where the variants' files are written and kept (default target/offline, or
    /// target/real with --model).
    #[arg(long)]
    work_dir: Option<PathBuf>,
    /// The real-model benchmark on this pretrained decoder (a llama GGUF file, a model
    /// folder or a decoder artifact) instead of the synthetic one: calibrated on
    /// --calibration-text, evaluated on --eval-text, memory and speed measured in child
    /// processes. Default settings: `RealConfig::default()` (SmolLM2 on Austen).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Real model: the SHA-256 its source file must have (default: SmolLM2's when the
    /// model is the default one, otherwise not checked).
    #[arg(long)]
    model_sha256: Option<String>,
    /// Real model: calibration text.
    #[arg(long)]
    calibration_text: Option<String>,
    /// Real model: calibration windows.
    #[arg(long)]
    calibration_windows: Option<usize>,
    /// Real model: held-out text.
    #[arg(long)]
    eval_text: Option<String>,
    /// Real model: held-out tokens scored.
    #[arg(long)]
    eval_tokens: Option<usize>,
    /// Real model: evaluation (and calibration) window.
    #[arg(long)]
    window: Option<usize>,
    /// Real model: evaluation stride.
    #[arg(long)]
    stride: Option<usize>,
    /// Real model: budgets in bits a weight (comma-separated).
    #[arg(long)]
    budgets: Option<String>,
    /// Real model: calibration tokens on which each linear's sensitivity (KL with it alone
    /// quantized) is measured for the budget plans; 0 plans on the heuristic estimate.
    #[arg(long)]
    sensitivity_tokens: Option<usize>,
    /// Real model: timed generation, new tokens.
    #[arg(long)]
    generate_tokens: Option<usize>,
    /// Real model: timed generation, prompt tokens.
    #[arg(long)]
    prompt_tokens: Option<usize>,
    /// Real model: thread counts timed (comma-separated).
    #[arg(long)]
    timing_threads: Option<String>,
    /// Re-run the configuration recorded in this report and check that it reproduces
    /// (exit 1 listing the fields that differ); nothing under --output is written.
    #[arg(long)]
    replay: Option<PathBuf>,
}

fn list<T: std::str::FromStr>(s: &str, what: &str) -> Result<Vec<T>> {
    s.split(',')
        .map(|x| x.trim().parse::<T>())
        .collect::<Result<_, _>>()
        .map_err(|_| anyhow::anyhow!("{what} takes a comma-separated list"))
}

/// Measures a stored variant in a child process of this binary (`bench-probe`), so the
/// memory peak is the variant's alone and the thread count takes effect.
struct ChildProbe;

impl offline::Probe for ChildProbe {
    fn probe(
        &self,
        req: &offline::ProbeRequest,
        threads: usize,
    ) -> offline::Result<offline::ProbeResult> {
        use std::io::Write;
        let fail =
            |m: String| offline::Error::Config(format!("probe of {}: {m}", req.file.display()));
        let exe = std::env::current_exe().map_err(|e| fail(e.to_string()))?;
        let mut child = std::process::Command::new(exe)
            .arg("bench-probe")
            .env("RAYON_NUM_THREADS", threads.to_string())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| fail(e.to_string()))?;
        let body = serde_json::to_vec(req).map_err(|e| fail(e.to_string()))?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin.write_all(&body).map_err(|e| fail(e.to_string()))?;
        }
        let out = child.wait_with_output().map_err(|e| fail(e.to_string()))?;
        if !out.status.success() {
            return Err(fail(
                String::from_utf8_lossy(&out.stderr).trim().to_string(),
            ));
        }
        serde_json::from_slice(&out.stdout).map_err(|e| fail(e.to_string()))
    }
}

/// `bench-probe`: one [`offline::ProbeRequest`] from stdin, its result as JSON on stdout.
pub(crate) fn bench_probe() -> Result<()> {
    let mut body = Vec::new();
    std::io::Read::read_to_end(&mut std::io::stdin(), &mut body).context("reading stdin")?;
    let req: offline::ProbeRequest =
        serde_json::from_slice(&body).context("stdin is not a probe request")?;
    let r = offline::probe_in_process(&req)?;
    println!("{}", serde_json::to_string(&r)?);
    Ok(())
}

fn real_config(a: &BenchArgs, model: &Path) -> Result<offline::RealConfig> {
    let mut c = offline::RealConfig::default();
    let default_model = Path::new(&c.model) == model;
    c.model = model.display().to_string();
    match (&a.model_sha256, default_model) {
        (Some(s), _) => c.model_sha256.clone_from(s),
        (None, false) => c.model_sha256.clear(),
        (None, true) => {}
    }
    if let Some(t) = &a.calibration_text {
        c.calibration_text.clone_from(t);
    }
    if let Some(t) = &a.eval_text {
        c.eval_text.clone_from(t);
    }
    let set = |slot: &mut usize, v: Option<usize>| {
        if let Some(v) = v {
            *slot = v;
        }
    };
    set(&mut c.calibration_windows, a.calibration_windows);
    set(&mut c.eval_tokens, a.eval_tokens);
    set(&mut c.window, a.window);
    set(&mut c.stride, a.stride);
    set(&mut c.generate_tokens, a.generate_tokens);
    set(&mut c.prompt_tokens, a.prompt_tokens);
    set(&mut c.timing_reps, a.timing_reps);
    set(&mut c.sensitivity_tokens, a.sensitivity_tokens);
    if let Some(b) = &a.budgets {
        c.budgets_bpw = list(b, "--budgets")?;
    }
    if let Some(t) = &a.timing_threads {
        c.timing_threads = list(t, "--timing-threads")?;
    }
    if let Some(s) = &a.shuffle_seeds {
        c.shuffle_seeds = list(s, "--shuffle-seeds")?;
    }
    c.seed = a.seed;
    Ok(c)
}

pub(crate) fn bench(a: &BenchArgs) -> Result<()> {
    let bars = Bars::new();
    let real = a.model.is_some();
    let output = a.output.clone().unwrap_or_else(|| {
        PathBuf::from(if real {
            "results/real.json"
        } else {
            "results/offline.json"
        })
    });
    let work_dir = a.work_dir.clone().unwrap_or_else(|| {
        PathBuf::from(if real {
            "target/real"
        } else {
            "target/offline"
        })
    });
    if let Some(recorded_path) = &a.replay {
        let text = std::fs::read_to_string(recorded_path)
            .with_context(|| format!("reading {}", recorded_path.display()))?;
        let recorded = Report::from_json(&text)
            .with_context(|| format!("{} is not a benchmark report", recorded_path.display()))?;
        match &recorded.config {
            offline::BenchConfig::Synthetic(c) => eprintln!(
                "replaying {} (seed {}, {} steps)",
                recorded_path.display(),
                c.seed,
                c.steps
            ),
            offline::BenchConfig::Real(c) => eprintln!(
                "replaying {} ({} on {} tokens of {})",
                recorded_path.display(),
                c.model,
                c.eval_tokens,
                c.eval_text
            ),
        }
        let tol = offline::Tolerance::default();
        let (fresh, diffs) = offline::replay(&recorded, &work_dir, &bars, &ChildProbe)?;
        std::fs::create_dir_all(&work_dir)
            .with_context(|| format!("creating {}", work_dir.display()))?;
        let fresh_path = work_dir.join("replay.json");
        std::fs::write(&fresh_path, fresh.to_json()?)
            .with_context(|| format!("writing {}", fresh_path.display()))?;
        if diffs.is_empty() {
            println!(
                "replay of {}: reproduced ({} variants; hashes, byte counts and digests identical, likelihoods within {:e} per target and {:e} on means); fresh report {}",
                recorded_path.display(),
                fresh.variants.len(),
                tol.nll_abs,
                tol.metric_abs,
                fresh_path.display()
            );
            return Ok(());
        }
        for d in &diffs {
            println!("differs: {d}");
        }
        bail!(
            "replay of {}: {} fields differ (fresh report {})",
            recorded_path.display(),
            diffs.len(),
            fresh_path.display()
        );
    }
    if let Some(model) = &a.model {
        if a.steps.is_some() || a.eval_docs.is_some() {
            bail!("--steps and --eval-docs are the synthetic benchmark's: not with --model");
        }
        let cfg = real_config(a, model)?;
        let report = offline::run_real(&cfg, &work_dir, &bars, &ChildProbe)?;
        return write_report(&report, &output);
    }
    let real_only = [
        a.model_sha256.is_some(),
        a.calibration_text.is_some(),
        a.calibration_windows.is_some(),
        a.eval_text.is_some(),
        a.eval_tokens.is_some(),
        a.window.is_some(),
        a.stride.is_some(),
        a.budgets.is_some(),
        a.sensitivity_tokens.is_some(),
        a.generate_tokens.is_some(),
        a.prompt_tokens.is_some(),
        a.timing_threads.is_some(),
    ];
    if real_only.into_iter().any(|x| x) {
        bail!("that option is the real-model benchmark's: give --model too");
    }
    let mut cfg = Config {
        seed: a.seed,
        ..Config::default()
    };
    if let Some(s) = a.steps {
        cfg.steps = s;
    }
    if let Some(n) = a.eval_docs {
        cfg.eval_docs = n;
    }
    if let Some(r) = a.timing_reps {
        cfg.timing_reps = r;
    }
    if let Some(s) = &a.shuffle_seeds {
        cfg.shuffle_seeds = s
            .split(',')
            .map(|x| x.trim().parse::<u64>())
            .collect::<Result<_, _>>()
            .context("--shuffle-seeds takes comma-separated integers")?;
    }
    let report = offline::run(&cfg, &work_dir, &bars)?;
    write_report(&report, &output)
}

/// The report, and beside it the table (.md) and the chart (.svg).
fn write_report(report: &Report, output: &Path) -> Result<()> {
    if let Some(dir) = output.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let md = offline::markdown(report);
    let svg = offline::svg_chart(report)?;
    for (path, text) in [
        (output.to_path_buf(), report.to_json()?),
        (output.with_extension("md"), md.clone()),
        (output.with_extension("svg"), svg),
    ] {
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    println!("{md}");
    println!(
        "wrote {}, {}, {} in {:.0} s",
        output.display(),
        output.with_extension("md").display(),
        output.with_extension("svg").display(),
        report.seconds
    );
    Ok(())
}

/// Options of `compressme evaluate`.
#[derive(clap::Args)]
pub(crate) struct EvaluateArgs {
    /// A pretrained decoder (a Hugging Face folder, a llama GGUF file, or an artifact
    /// packed from one), a causal-model artifact (from `compressme bench`), a BERT
    /// artifact (with --reference naming its model folder), or a BERT model folder.
    model: PathBuf,
    /// Decoders: held-out text, one document (tokenized without special tokens).
    #[arg(long)]
    text: Option<PathBuf>,
    /// Held-out data for the other models: for causal artifacts, token ids separated by
    /// spaces, one document a line; for BERT, one text a line.
    #[arg(long)]
    data: Option<PathBuf>,
    /// The f32 reference: for a decoder, the model it was packed from (folder, GGUF or
    /// artifact); a causal artifact (fp32.cma); or the BERT model folder.
    #[arg(long)]
    reference: Option<PathBuf>,
    /// Decoders: tokens a window (default the smaller of the model's context and 512).
    #[arg(long)]
    context: Option<usize>,
    /// Window stride (default half the window).
    #[arg(long)]
    stride: Option<usize>,
    /// Decoders: score only the first N tokens of the text.
    #[arg(long)]
    max_tokens: Option<usize>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

fn is_causal_artifact(path: &Path) -> bool {
    compressme::artifact::Artifact::open(path, &compressme::artifact::Limits::default()).is_ok_and(
        |a| {
            a.recipe()
                .source_metadata
                .contains_key(compressme::nn::causal::CONFIG_KEY)
        },
    )
}

pub(crate) fn evaluate(a: &EvaluateArgs) -> Result<()> {
    if a.text.is_some() || crate::lm_cmds::is_decoder(&a.model) {
        let Some(text) = &a.text else {
            bail!(
                "{} is a decoder: give --text FILE (held-out text, one document)",
                a.model.display()
            );
        };
        return crate::lm_cmds::evaluate(&crate::lm_cmds::EvalOptions {
            model: &a.model,
            text,
            reference: a.reference.as_deref(),
            context: a.context,
            stride: a.stride,
            max_tokens: a.max_tokens,
            json: a.json,
        });
    }
    let Some(data) = &a.data else {
        bail!("give --data FILE (token ids or one text a line), or --text FILE for a decoder");
    };
    let text =
        std::fs::read_to_string(data).with_context(|| format!("reading {}", data.display()))?;
    let dev = Device::Cpu;
    if a.model.is_file() && is_causal_artifact(&a.model) {
        let docs: Vec<Vec<u32>> = text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(i, l)| {
                l.split_whitespace()
                    .map(|t| {
                        t.parse::<u32>().with_context(|| {
                            format!("{} line {}: `{t}` is not a token id", data.display(), i + 1)
                        })
                    })
                    .collect::<Result<Vec<u32>>>()
            })
            .collect::<Result<_>>()?;
        let model = compressme::nn::CausalLm::from_artifact(&a.model, &dev)
            .with_context(|| format!("loading {}", a.model.display()))?;
        let reference = a
            .reference
            .as_deref()
            .map(|r| {
                compressme::nn::CausalLm::from_artifact(r, &dev)
                    .with_context(|| format!("loading {}", r.display()))
            })
            .transpose()?;
        let stride = a.stride.unwrap_or(model.config().context / 2).max(1);
        let e = offline::evaluate_causal(&model, reference.as_ref(), &docs, stride)?;
        if a.json {
            println!("{}", serde_json::to_string_pretty(&e)?);
        } else {
            println!(
                "{}: {} targets in {} documents, perplexity {:.4}",
                a.model.display(),
                e.targets,
                docs.len(),
                e.perplexity
            );
            if let (Some(rp), Some(s), Some(p)) = (e.reference_perplexity, &e.shift, &e.paired) {
                println!(
                    "reference perplexity {rp:.4}; KL mean {:.3e} (p99 {:.3e}); top-1 agreement {:.4}; NLL - reference {:+.5} [{:+.5}, {:+.5}] (95% bootstrap), sign test p {:.3}",
                    s.kl_mean,
                    s.kl_p99,
                    s.top1_agreement,
                    p.mean_diff,
                    p.ci_low,
                    p.ci_high,
                    p.sign_test_p
                );
            }
        }
        return Ok(());
    }
    // BERT: sentence embeddings against the f32 model of the reference folder
    let (dir, variant) = if a.model.is_dir() {
        let Some(reference) = &a.reference else {
            bail!(
                "{} is a model folder: give --reference (another folder, the f32 model) to compare with",
                a.model.display()
            );
        };
        (
            reference.clone(),
            compressme::nn::SentenceEmbedder::from_dir(&a.model, &dev)
                .with_context(|| format!("loading {}", a.model.display()))?,
        )
    } else {
        let Some(dir) = &a.reference else {
            bail!(
                "{} is not a causal-model artifact: for a BERT artifact give --reference MODEL_DIR (its config, tokenizer and f32 weights)",
                a.model.display()
            );
        };
        let bert = compressme::nn::Bert::from_artifact(dir, &a.model, &dev)
            .with_context(|| format!("loading {} over {}", a.model.display(), dir.display()))?;
        (
            dir.clone(),
            compressme::nn::SentenceEmbedder::with_bert(dir, bert)?,
        )
    };
    let reference = compressme::nn::SentenceEmbedder::from_dir(&dir, &dev)
        .with_context(|| format!("loading {}", dir.display()))?;
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    if lines.len() < 2 {
        bail!("{}: need at least two non-empty lines", data.display());
    }
    let (mut r, mut v) = (Vec::new(), Vec::new());
    for chunk in lines.chunks(32) {
        r.extend(reference.embed(chunk)?);
        v.extend(variant.embed(chunk)?);
    }
    let agreement = compressme::eval::embedding_agreement(&r, &v)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&agreement)?);
    } else {
        println!(
            "{} against {}: {} texts, cosine to f32 mean {:.5} (min {:.5}), nearest-neighbour retrieval agreement {:.4}",
            a.model.display(),
            dir.display(),
            agreement.items,
            agreement.cosine_mean,
            agreement.cosine_min,
            agreement.retrieval_top1_agreement
        );
    }
    Ok(())
}
