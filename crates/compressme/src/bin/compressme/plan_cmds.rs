//! `profile` and `plan`: activation statistics and precision plans.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use candle_core::Device;
use compressme::nn::SentenceEmbedder;
use compressme::plan::{Plan, Policy, magnitude_density, shapes};
use compressme::profile::{ActivationRecorder, Profile, ProfileSettings, default_candidates};
use compressme::quant::Format;
use indicatif::ProgressBar;

/// Profiles a decoder over windows of a text, and prints the summary.
pub(crate) fn profile_decoder(o: &crate::lm_cmds::ProfileOptions<'_>) -> Result<()> {
    let t0 = Instant::now();
    let profile = crate::lm_cmds::profile(o)?;
    write_and_summarise(&profile, o.out, t0)
}

/// Profile settings from the command line: the density threshold, and the candidate
/// formats (checked by name here, so a typo fails before any model is loaded).
pub(crate) fn profile_settings(
    density_threshold: f32,
    candidates: Option<&str>,
) -> Result<ProfileSettings> {
    let mut settings = ProfileSettings {
        density_threshold,
        ..ProfileSettings::default()
    };
    if let Some(c) = candidates {
        settings.candidates = parse_formats(c)?.iter().map(ToString::to_string).collect();
    }
    Ok(settings)
}

/// Comma-separated format names.
fn parse_formats(list: &str) -> Result<Vec<Format>> {
    Ok(list
        .split(',')
        .map(|s| Format::parse(s.trim()))
        .collect::<Result<_, _>>()?)
}

/// Profiles a BERT folder over the lines of `data`.
pub(crate) fn profile(
    model_dir: &Path,
    data: &Path,
    out: &Path,
    batch: usize,
    max_len: usize,
    settings: ProfileSettings,
) -> Result<()> {
    let t0 = Instant::now();
    let emb = SentenceEmbedder::from_dir(model_dir, &Device::Cpu)
        .with_context(|| format!("loading {}", model_dir.display()))?;
    // a file, or every .txt file of a folder in name order
    let text = if data.is_dir() {
        let mut files: Vec<_> = std::fs::read_dir(data)
            .with_context(|| format!("reading {}", data.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "txt"))
            .collect();
        files.sort();
        if files.is_empty() {
            bail!("{} holds no .txt files", data.display());
        }
        let mut all = Vec::new();
        for f in files {
            all.extend(std::fs::read(&f).with_context(|| format!("reading {}", f.display()))?);
            all.push(b'\n');
        }
        all
    } else {
        std::fs::read(data).with_context(|| format!("reading {}", data.display()))?
    };
    let lines: Vec<&str> = std::str::from_utf8(&text)
        .with_context(|| format!("{} is not UTF-8", data.display()))?
        .lines()
        .filter(|l| !l.trim().is_empty())
        .collect();
    if lines.is_empty() {
        bail!("{} has no non-empty lines to calibrate on", data.display());
    }
    let mut batches = Vec::new();
    for chunk in lines.chunks(batch.max(1)) {
        let (ids, types, mask) = emb.tokenize(chunk)?;
        let t = ids.dims().get(1).copied().unwrap_or(0).min(max_len.max(1));
        batches.push((
            ids.narrow(1, 0, t)?,
            types.narrow(1, 0, t)?,
            mask.narrow(1, 0, t)?,
        ));
    }
    let pb = ProgressBar::new(batches.len() as u64);
    let profile = ActivationRecorder::new(settings)
        .with_calibration_sha256(compressme::artifact::recipe::sha256_hex(&text))
        .record(emb.bert(), &batches, |m, (ids, types, mask)| {
            let r = m.forward(ids, Some(types), mask).map(drop);
            pb.inc(1);
            r
        })?;
    pb.finish_and_clear();
    write_and_summarise(&profile, out, t0)
}

/// Writes the profile and prints the modules of highest importance.
fn write_and_summarise(profile: &Profile, out: &Path, t0: Instant) -> Result<()> {
    std::fs::write(out, profile.to_json()?)
        .with_context(|| format!("writing {}", out.display()))?;
    let scores = magnitude_density(profile);
    let mut ranked: Vec<(&String, &f64)> = scores.iter().collect();
    ranked.sort_by(|a, b| b.1.total_cmp(a.1));
    println!(
        "{}: {} modules, {} tokens in {} batches, {:.1} s",
        out.display(),
        profile.modules.len(),
        profile.tokens,
        profile.batches,
        t0.elapsed().as_secs_f64()
    );
    println!(
        "{:<50} {:>10} {:>8} {:>8} {:>10}",
        "module (highest importance first)", "mean |x|", "density", "max |x|", "importance"
    );
    for (name, score) in ranked.iter().take(12) {
        let s = &profile.modules[*name];
        println!(
            "{name:<50} {:>10.4} {:>8.4} {:>8.2} {score:>10.4}",
            s.mean_abs(),
            s.density(),
            s.max_abs
        );
    }
    Ok(())
}

/// Plans from a profile: thresholds or a budget in bits per weight.
#[allow(clippy::too_many_arguments)]
pub(crate) fn plan(
    profile_path: &Path,
    out: &Path,
    budget_bpw: Option<f64>,
    thresholds: bool,
    candidates: Option<&str>,
    no_protect_head: bool,
    heads: Option<&str>,
    shuffle_seed: Option<u64>,
) -> Result<()> {
    let text = std::fs::read_to_string(profile_path)
        .with_context(|| format!("reading {}", profile_path.display()))?;
    let profile = Profile::from_json(&text)?;
    let policy = Policy {
        protect_output_head: !no_protect_head,
        // the heads the profile recorded (a tied embedding, `embed_out`), else `lm_head`
        output_heads: match heads {
            Some(h) => h.split(',').map(|s| s.trim().to_string()).collect(),
            None if !profile.output_heads.is_empty() => profile.output_heads.clone(),
            None => Policy::default().output_heads,
        },
    };
    let candidates: Vec<Format> = match candidates {
        Some(c) => parse_formats(c)?,
        None => default_candidates(),
    };
    let sh = shapes(&profile);
    let weights: u64 = profile
        .modules
        .values()
        .filter(|s| s.kind == compressme::nn::ModuleKind::Linear)
        .map(|s| (s.rows * s.cols) as u64)
        .sum();
    let plan = match (budget_bpw, thresholds) {
        (Some(bpw), false) => {
            let budget = (bpw * weights as f64 / 8.0).floor() as u64;
            Plan::within_budget(&profile, &candidates, budget, policy)?
        }
        (None, true) => Plan::from_importance(&profile, policy),
        _ => bail!("give exactly one of --budget-bpw BITS and --thresholds"),
    };
    let plan = match shuffle_seed {
        Some(seed) => plan.shuffled(&sh, seed),
        None => plan,
    };
    plan.validate(&sh)?;
    std::fs::write(out, plan.to_json()?).with_context(|| format!("writing {}", out.display()))?;
    let mut counts = std::collections::BTreeMap::<String, (usize, u64)>::new();
    for (name, c) in &plan.modules {
        let s = &sh[name];
        let e = counts.entry(c.name()).or_default();
        e.0 += 1;
        e.1 += c.bytes(s.rows, s.cols).unwrap_or(0);
    }
    let stored = plan.stored_bytes.unwrap_or(0);
    println!(
        "{}: {} ({} modules), {stored} bytes for {weights} weights = {:.3} bits a weight{}{}",
        out.display(),
        plan.method,
        plan.modules.len(),
        8.0 * stored as f64 / weights.max(1) as f64,
        plan.budget_bytes
            .map(|b| format!(", budget {b} (slack {})", b.saturating_sub(stored)))
            .unwrap_or_default(),
        match plan.exact {
            Some(true) => ", optimal for the estimated error",
            Some(false) => ", Lagrangian fallback (not proven optimal)",
            None => "",
        }
    );
    println!("{:<12} {:>8} {:>14}", "storage", "modules", "bytes");
    for (name, (n, b)) in &counts {
        println!("{name:<12} {n:>8} {b:>14}");
    }
    if let Some(e) = plan.estimated_error {
        println!("summed estimated error (a heuristic, from per-channel E[x^2]): {e:.6e}");
    }
    Ok(())
}
