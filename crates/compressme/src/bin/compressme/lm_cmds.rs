//! Pretrained decoders on the command line: `evaluate --text`, `generate`, and `profile
//! --text` over a Hugging Face folder, a llama GGUF file or a decoder artifact. Argument
//! handling and display; the work is in `compressme-nn`, `compressme-profile` and
//! `compressme-offline`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use candle_core::Device;
use compressme::nn::decoder::{LanguageModel, is_decoder_folder, is_gguf};
use compressme::nn::{Model, causal::CONFIG_KEY};
use compressme::offline::Progress;

use crate::progress::Bars;

/// Whether `path` names a decoder `compressme` runs: a decoder folder, a GGUF file, or
/// an artifact packed from one (its recipe carries the decoder configuration).
pub(crate) fn is_decoder(path: &Path) -> bool {
    if path.is_dir() {
        return is_decoder_folder(path);
    }
    is_gguf(path)
        || compressme::artifact::Artifact::open(path, &compressme::artifact::Limits::default())
            .is_ok_and(|a| {
                a.recipe()
                    .source_metadata
                    .contains_key(compressme::nn::decoder::DECODER_CONFIG_KEY)
                    && !a.recipe().source_metadata.contains_key(CONFIG_KEY)
            })
}

/// Opens a decoder, naming the path in the error.
pub(crate) fn open(path: &Path) -> Result<LanguageModel> {
    LanguageModel::open(path, &Device::Cpu).with_context(|| format!("loading {}", path.display()))
}

fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path)
        .with_context(|| format!("reading {} (UTF-8 text)", path.display()))
}

/// Options of `evaluate` for decoders.
pub(crate) struct EvalOptions<'a> {
    pub(crate) model: &'a Path,
    pub(crate) text: &'a Path,
    pub(crate) reference: Option<&'a Path>,
    pub(crate) context: Option<usize>,
    pub(crate) stride: Option<usize>,
    pub(crate) max_tokens: Option<usize>,
    pub(crate) json: bool,
}

pub(crate) fn evaluate(o: &EvalOptions<'_>) -> Result<()> {
    let t0 = Instant::now();
    let text = read_text(o.text)?;
    let lm = open(o.model)?;
    let reference = o.reference.map(open).transpose()?;
    let mut ids = lm.encode(&text)?;
    if let Some(r) = &reference {
        let rids = r.encode(&text)?;
        if rids != ids {
            bail!(
                "{} and {} tokenize {} differently: they are not the same model",
                o.model.display(),
                o.reference
                    .map_or(String::new(), |p| p.display().to_string()),
                o.text.display()
            );
        }
    }
    let total_tokens = ids.len();
    if let Some(m) = o.max_tokens {
        ids.truncate(m);
    }
    if ids.len() < 2 {
        bail!(
            "{} has {} tokens: nothing to predict",
            o.text.display(),
            ids.len()
        );
    }
    let cfg = lm.model.config();
    let len = o.context.unwrap_or(cfg.context.min(512));
    if len < 2 || len > cfg.context {
        bail!(
            "--context {len}: give 2 to the model's context, {}",
            cfg.context
        );
    }
    let window = compressme::eval::Window {
        len,
        stride: o.stride.unwrap_or(len / 2).max(1),
    };
    let bar = Bars::new();
    let e = compressme::offline::evaluate_decoder(
        &lm.model,
        reference.as_ref().map(|r| &r.model),
        &ids,
        window,
        &bar,
    )?;
    let storage = lm.model.storage_report();
    let text_sha = compressme::artifact::recipe::sha256_hex(text.as_bytes());
    if o.json {
        let v = serde_json::json!({
            "model": o.model.display().to_string(),
            "source": lm.source,
            "reference": o.reference.map(|p| p.display().to_string()),
            "text": o.text.display().to_string(),
            "text_sha256": text_sha,
            "tokens": ids.len(),
            "tokens_in_text": total_tokens,
            "stored_bytes": storage.stored_bytes(),
            "dense_bytes": storage.dense_bytes(),
            "threads": candle_core::utils::get_num_threads(),
            "seconds": t0.elapsed().as_secs_f64(),
            "evaluation": e,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "{}: {} tokens of {} (SHA-256 {}), windows of {} at stride {}: {} targets, perplexity {:.4} (mean NLL {:.5}); module bytes {} of {} dense ({:.3}); {:.1} s",
        o.model.display(),
        ids.len(),
        o.text.display(),
        &text_sha[..12],
        window.len,
        window.stride,
        e.targets,
        e.perplexity,
        e.mean_nll,
        storage.stored_bytes(),
        storage.dense_bytes(),
        storage.stored_bytes() as f64 / storage.dense_bytes().max(1) as f64,
        t0.elapsed().as_secs_f64()
    );
    if let (Some(rp), Some(s), Some(p)) = (e.reference_perplexity, &e.shift, &e.paired) {
        println!(
            "reference perplexity {rp:.4} (ratio {:.4}); KL mean {:.3e} (p99 {:.3e}); top-1 agreement {:.4}; NLL - reference {:+.5} [{:+.5}, {:+.5}] (95% bootstrap), sign test p {:.3}",
            e.perplexity / rp,
            s.kl_mean,
            s.kl_p99,
            s.top1_agreement,
            p.mean_diff,
            p.ci_low,
            p.ci_high,
            p.sign_test_p
        );
    }
    Ok(())
}

/// Options of `compressme generate`.
#[derive(clap::Args)]
pub(crate) struct GenerateArgs {
    /// A model folder, a llama GGUF file, or a decoder artifact.
    model: PathBuf,
    /// The prompt (tokenized without special tokens added).
    #[arg(long)]
    prompt: String,
    /// Tokens to produce at most (fewer at an end-of-sequence token or a full context).
    #[arg(long, default_value_t = 64)]
    max_new: usize,
    /// Also print a JSON line of metadata (tokens, seconds, tokens a second, threads) on
    /// stderr.
    #[arg(long)]
    json: bool,
}

pub(crate) fn generate(a: &GenerateArgs) -> Result<()> {
    let lm = open(&a.model)?;
    let prompt = lm.encode(&a.prompt)?;
    if prompt.is_empty() {
        bail!("the prompt has no tokens");
    }
    let t0 = Instant::now();
    let out = lm
        .model
        .generate(&prompt, a.max_new, &lm.model.config().eos_token_ids)?;
    let secs = t0.elapsed().as_secs_f64();
    println!("{}{}", a.prompt, lm.decode(&out)?);
    let rate = out.len() as f64 / secs.max(1e-9);
    let threads = candle_core::utils::get_num_threads();
    eprintln!(
        "{} prompt tokens, {} produced in {secs:.2} s: {rate:.1} tokens a second (prompt included in the time; {threads} thread(s))",
        prompt.len(),
        out.len()
    );
    if a.json {
        let v = serde_json::json!({
            "model": a.model.display().to_string(),
            "prompt_tokens": prompt.len(),
            "new_tokens": out.len(),
            "seconds": secs,
            "tokens_per_second": rate,
            "threads": threads,
        });
        eprintln!("{v}");
    }
    Ok(())
}

/// Options of `profile` for decoders.
pub(crate) struct ProfileOptions<'a> {
    pub(crate) model: &'a Path,
    pub(crate) text: &'a Path,
    pub(crate) out: &'a Path,
    pub(crate) context: Option<usize>,
    pub(crate) max_windows: Option<usize>,
    pub(crate) settings: compressme::profile::ProfileSettings,
    /// Measure each linear's sensitivity on this many of the text's first tokens, at
    /// this format.
    pub(crate) measure: Option<(usize, compressme::quant::Format)>,
}

/// Profiles a decoder over consecutive windows of a text (one document), every linear
/// (the output head included) observed.
/// `ids` in windows of `len` tokens (the last may be shorter, not under 2), at most
/// `max` of them.
fn calibration_windows(
    ids: &[u32],
    len: usize,
    max: Option<usize>,
    text: &Path,
) -> Result<Vec<candle_core::Tensor>> {
    let mut windows: Vec<candle_core::Tensor> = Vec::new();
    for chunk in ids.chunks(len) {
        if chunk.len() < 2 || max.is_some_and(|m| windows.len() >= m) {
            break;
        }
        windows.push(candle_core::Tensor::new(chunk, &Device::Cpu)?.unsqueeze(0)?);
    }
    if windows.is_empty() {
        bail!("{} has too few tokens to calibrate on", text.display());
    }
    Ok(windows)
}

/// GPTQ's factor of every linear of `lm`, from its input Gram matrix on the first
/// `max_windows` windows of up to 512 tokens of `text` (by module name), and the text's
/// SHA-256.
pub(crate) fn gptq_factors(
    lm: &LanguageModel,
    text: &Path,
    max_windows: usize,
    damp: f64,
) -> Result<(
    BTreeMap<String, std::sync::Arc<compressme::quant::GptqFactor>>,
    String,
)> {
    let body = read_text(text)?;
    let ids = lm.encode(&body)?;
    let len = lm.model.config().context.clamp(2, 512);
    let windows = calibration_windows(&ids, len, Some(max_windows), text)?;
    let bar = Bars::new();
    bar.stage("GPTQ calibration", windows.len() as u64);
    // whole windows side by side, a lane a core: the same bits
    let factors = compressme::profile::gptq_factors(
        &lm.model,
        &windows,
        candle_core::utils::get_num_threads(),
        |m, ids| {
            let r = m.observe(ids);
            bar.inc(1);
            r
        },
        damp,
    )?;
    bar.done(&format!(
        "input Gram matrices of {} linears on {} windows of {len} tokens of {}",
        factors.len(),
        windows.len(),
        text.display()
    ));
    Ok((
        factors,
        compressme::artifact::recipe::sha256_hex(body.as_bytes()),
    ))
}

pub(crate) fn profile(o: &ProfileOptions<'_>) -> Result<compressme::profile::Profile> {
    use compressme::profile::ActivationRecorder;
    let text = read_text(o.text)?;
    let lm = open(o.model)?;
    let ids = lm.encode(&text)?;
    let cfg = lm.model.config().clone();
    let len = o
        .context
        .unwrap_or(cfg.context.min(512))
        .min(cfg.context)
        .max(2);
    let windows = calibration_windows(&ids, len, o.max_windows, o.text)?;
    let settings = o.settings.clone();
    let bar = Bars::new();
    bar.stage("windows", windows.len() as u64);
    let profile = ActivationRecorder::new(settings)
        .with_calibration_sha256(compressme::artifact::recipe::sha256_hex(text.as_bytes()))
        .with_lanes(candle_core::utils::get_num_threads())
        .record(&lm.model, &windows, |m, ids| {
            let r = m.observe(ids);
            bar.inc(1);
            r
        })?;
    bar.done(&format!(
        "profiled {} windows of {len} tokens",
        windows.len()
    ));
    let mut profile = profile;
    if let Some((n, format)) = o.measure {
        let Some(head) = ids.get(..n.min(cfg.context)).filter(|h| h.len() >= 2) else {
            bail!(
                "--measure-tokens {n}: {} has {} tokens",
                o.text.display(),
                ids.len()
            );
        };
        let linears = profile
            .modules
            .values()
            .filter(|s| s.kind == compressme::nn::ModuleKind::Linear)
            .count();
        bar.stage("sensitivity", linears as u64);
        compressme::offline::measure_decoder_sensitivity(
            &lm.model,
            &mut profile,
            head,
            format,
            &bar,
        )?;
        bar.done(&format!(
            "measured {linears} linears at {format} on {} tokens",
            head.len()
        ));
    }
    Ok(profile)
}
