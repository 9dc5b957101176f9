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
    /// The report; the table (.md) and chart (.svg) go beside it with the same stem.
    #[arg(short, long, default_value = "results/offline.json")]
    output: PathBuf,
    /// Where the variants' files are written (and kept).
    #[arg(long, default_value = "target/offline")]
    work_dir: PathBuf,
    /// Re-run the configuration recorded in this report and check that it reproduces
    /// (exit 1 listing the fields that differ); nothing under --output is written.
    #[arg(long)]
    replay: Option<PathBuf>,
}

pub(crate) fn bench(a: &BenchArgs) -> Result<()> {
    let bars = Bars::new();
    if let Some(recorded_path) = &a.replay {
        let text = std::fs::read_to_string(recorded_path)
            .with_context(|| format!("reading {}", recorded_path.display()))?;
        let recorded = Report::from_json(&text)
            .with_context(|| format!("{} is not a benchmark report", recorded_path.display()))?;
        eprintln!(
            "replaying {} (seed {}, {} steps)",
            recorded_path.display(),
            recorded.config.seed,
            recorded.config.steps
        );
        let tol = recorded.tolerance;
        let (fresh, diffs) = offline::replay(&recorded, &a.work_dir, tol, &bars)?;
        let fresh_path = a.work_dir.join("replay.json");
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
    let report = offline::run(&cfg, &a.work_dir, &bars)?;
    if let Some(dir) = a.output.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let md = offline::markdown(&report);
    let svg = offline::svg_chart(&report)?;
    for (path, text) in [
        (a.output.clone(), report.to_json()?),
        (a.output.with_extension("md"), md.clone()),
        (a.output.with_extension("svg"), svg),
    ] {
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    println!("{md}");
    println!(
        "wrote {}, {}, {} in {:.0} s",
        a.output.display(),
        a.output.with_extension("md").display(),
        a.output.with_extension("svg").display(),
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
