//! `pack`, `unpack`, `inspect` and `verify`: the artifact's command-line face.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use compressme::artifact::{
    Artifact, Checkpoint, Dtype, Limits, StorageRecipe, Writer, recipe::sha256_hex, unpack,
};
use compressme::blockstore::Coder;
use compressme::quant::Format;
use indicatif::{ProgressBar, ProgressStyle};

/// How `pack` stores tensors.
#[derive(clap::Args)]
pub(crate) struct PackArgs {
    /// model.safetensors, a model folder, or model.safetensors.index.json.
    pub(crate) input: PathBuf,
    /// The artifact to write (written beside it and renamed when verified).
    #[arg(short, long)]
    pub(crate) output: PathBuf,
    /// Store every float tensor in lossless row blocks where that is smaller (and
    /// tensors that --format or --plan leave alone, when given with them).
    #[arg(long)]
    pub(crate) lossless: bool,
    /// Quantize every float tensor of 2+ dimensions to this format (f16, bf16, int8,
    /// nf4, nf4-g32/64/128, int4-g32/64/128), except those --keep matches.
    #[arg(long)]
    pub(crate) format: Option<String>,
    /// A regular expression of tensor names --format leaves alone (e.g. 'lm_head|embed').
    #[arg(long)]
    pub(crate) keep: Option<String>,
    /// A plan JSON: {"version": 1, "modules": {"NAME": "nf4-g64" | "int8" | "lossless" | "dense", ...}}.
    #[arg(long)]
    pub(crate) plan: Option<PathBuf>,
    /// Rows per lossless block.
    #[arg(long, default_value_t = 16)]
    pub(crate) block_rows: usize,
    /// Code lossless planes with Zstandard at this level instead of shared Huffman tables.
    #[arg(long)]
    pub(crate) zstd_level: Option<i32>,
    /// Shared Huffman tables per byte plane (1-16): more tables fit unusual blocks
    /// better and encode slower.
    #[arg(long, default_value_t = 4)]
    pub(crate) tables: u8,
    /// A profile from `compressme profile`: blockwise 4-bit formats then choose each
    /// group's scale to minimise the activation-weighted error (imatrix-style) instead
    /// of plain absmax.
    #[arg(long)]
    pub(crate) profile: Option<PathBuf>,
    /// Print the per-tensor report as JSON.
    #[arg(long)]
    pub(crate) json: bool,
}

enum Choice {
    Dense,
    Lossless,
    Quant(Format),
}

fn bar(total: u64) -> ProgressBar {
    let pb = ProgressBar::new(total);
    if let Ok(style) =
        ProgressStyle::with_template("{bar:30} {bytes}/{total_bytes} {bytes_per_sec} {msg}")
    {
        pb.set_style(style);
    }
    pb
}

pub(crate) fn pack(a: &PackArgs) -> Result<()> {
    let t0 = Instant::now();
    let mut ckpt = Checkpoint::open(&a.input, &Limits::default())
        .with_context(|| format!("reading checkpoint {}", a.input.display()))?;
    let names: Vec<String> = ckpt.entries().map(|e| e.name.clone()).collect();
    let format = a
        .format
        .as_deref()
        .map(Format::parse)
        .transpose()
        .context("--format")?;
    let keep = a
        .keep
        .as_deref()
        .map(regex::Regex::new)
        .transpose()
        .context("--keep is not a valid regular expression")?;
    let (plan, plan_bytes) = match &a.plan {
        Some(p) => {
            let text = std::fs::read(p).with_context(|| format!("reading plan {}", p.display()))?;
            let plan = compressme::plan::Plan::from_json(&String::from_utf8_lossy(&text))
                .with_context(|| format!("{} is not a valid plan", p.display()))?;
            (Some(plan), Some(text))
        }
        None => (None, None),
    };
    if !a.lossless && format.is_none() && plan.is_none() {
        bail!("say how to pack: --lossless, --format FORMAT, or --plan PLAN.json");
    }
    // every plan entry must name a module (NAME.weight) or a tensor of the checkpoint, and
    // fit its shape
    let mut by_tensor: BTreeMap<String, Choice> = BTreeMap::new();
    if let Some(plan) = &plan {
        let mut shapes = BTreeMap::new();
        for e in ckpt.entries() {
            if let [rows, cols] = e.shape[..] {
                let module = e
                    .name
                    .strip_suffix(".weight")
                    .unwrap_or(&e.name)
                    .to_string();
                let embedding = module.contains("embed");
                let shape = compressme::plan::ModuleShape {
                    rows,
                    cols,
                    embedding,
                };
                shapes.insert(module, shape);
                shapes.insert(e.name.clone(), shape);
            }
        }
        plan.validate(&shapes).with_context(|| {
            format!(
                "plan does not fit {} ({} tensors)",
                a.input.display(),
                names.len()
            )
        })?;
        for (name, choice) in &plan.modules {
            let tensor = if names.contains(name) {
                name.clone()
            } else {
                format!("{name}.weight")
            };
            let c = match choice {
                compressme::plan::Choice::Dense => Choice::Dense,
                compressme::plan::Choice::Lossless => Choice::Lossless,
                compressme::plan::Choice::Format(f) => Choice::Quant(*f),
            };
            by_tensor.insert(tensor, c);
        }
    }
    let profile = match &a.profile {
        Some(p) => Some(
            compressme::profile::Profile::from_json(
                &std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?,
            )
            .with_context(|| format!("{} is not a valid profile", p.display()))?,
        ),
        None => None,
    };
    let coder = a.zstd_level.map_or(
        Coder::SharedHuffman {
            max_tables: a.tables,
        },
        |level| Coder::Zstd { level },
    );
    let total: u64 = ckpt.entries().map(|e| e.len()).sum();
    let largest = ckpt.largest();
    let mut w =
        Writer::create(&a.output).with_context(|| format!("creating {}", a.output.display()))?;
    w.recipe_mut().source_metadata = ckpt.metadata().clone();
    if let Some(p) = &profile {
        w.recipe_mut().calibration_sha256 = Some(p.calibration_sha256.clone());
    }
    if let (Some(plan), Some(bytes)) = (&plan, &plan_bytes) {
        w.recipe_mut().plan_sha256 = Some(sha256_hex(bytes));
        w.recipe_mut().output_head_policy = Some(plan.policy.describe());
    }
    let pb = bar(total);
    let mut report = Vec::with_capacity(names.len());
    for name in &names {
        pb.set_message(name.clone());
        let entry = ckpt
            .entries()
            .find(|e| &e.name == name)
            .cloned()
            .context("tensor vanished")?;
        let bytes = ckpt.read(name)?;
        let quantizable = entry.dtype.is_float() && entry.shape.len() >= 2;
        let choice = match by_tensor.remove(name) {
            Some(c) => c,
            None => match format {
                Some(f) if quantizable && !keep.as_ref().is_some_and(|k| k.is_match(name)) => {
                    Choice::Quant(f)
                }
                _ if a.lossless && entry.dtype.is_float() => Choice::Lossless,
                _ => Choice::Dense,
            },
        };
        let added = match choice {
            Choice::Dense => w.add_dense(name, entry.dtype, &entry.shape, &bytes)?,
            Choice::Lossless => {
                w.add_lossless(name, entry.dtype, &entry.shape, &bytes, a.block_rows, coder)?
            }
            Choice::Quant(f) => {
                let module = name.strip_suffix(".weight").unwrap_or(name);
                let importance: Vec<f32> = profile
                    .as_ref()
                    .and_then(|p| p.modules.get(module))
                    .map(|m| m.channel_mean_sq().iter().map(|v| *v as f32).collect())
                    .unwrap_or_default();
                w.add_quantized_weighted(name, entry.dtype, &entry.shape, &bytes, f, &importance)?
            }
        };
        tracing::debug!(tensor = %name, storage = %added.storage, dense = added.dense_bytes, stored = added.stored_bytes);
        if added.kept_dense && !a.json {
            pb.println(format!(
                "{name}: kept dense ({} bytes; lossless blocks would not be smaller)",
                added.dense_bytes
            ));
        }
        report.push(added);
        pb.inc(entry.len());
    }
    pb.set_message("verifying");
    let summary = w.finish().context("writing the artifact")?;
    pb.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    if a.json {
        let v = serde_json::json!({
            "input": a.input.display().to_string(),
            "output": a.output.display().to_string(),
            "summary": summary,
            "largest_tensor_bytes": largest,
            "seconds": secs,
            "tensors": report,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!(
            "{}: {} tensors ({} lossless, {} quantized, {} dense), {} -> {} bytes ({:.4}), file {} bytes, {} blocks verified, {:.1} s ({:.0} MB/s)",
            a.output.display(),
            summary.tensors,
            summary.lossless,
            summary.quantized,
            summary.dense,
            summary.dense_bytes,
            summary.stored_bytes,
            summary.stored_bytes as f64 / summary.dense_bytes.max(1) as f64,
            summary.file_bytes,
            summary.blocks,
            secs,
            summary.dense_bytes as f64 / secs / 1e6
        );
    }
    Ok(())
}

pub(crate) fn unpack_cmd(artifact: &Path, out: &Path) -> Result<()> {
    let t0 = Instant::now();
    let dest = if out.is_dir() {
        out.join("model.safetensors")
    } else {
        out.to_path_buf()
    };
    let mut a = Artifact::open(artifact, &Limits::default())
        .with_context(|| format!("opening {}", artifact.display()))?;
    let total: u64 = a
        .recipe()
        .tensors
        .iter()
        .map(|t| {
            t.shape.iter().product::<usize>() as u64
                * Dtype::parse(&t.dtype).map_or(1, Dtype::size) as u64
        })
        .sum();
    let pb = bar(total);
    let s = unpack(&mut a, &dest, |name, n| {
        pb.set_message(name.to_string());
        pb.inc(n);
    })
    .with_context(|| format!("unpacking {}", artifact.display()))?;
    pb.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "{}: {} tensors ({} exact, {} dequantized), {} bytes, {:.2} s ({:.0} MB/s)",
        dest.display(),
        s.tensors,
        s.lossless,
        s.quantized,
        s.dense_bytes,
        secs,
        s.dense_bytes as f64 / secs / 1e6
    );
    Ok(())
}

pub(crate) fn inspect(artifact: &Path, json: bool) -> Result<()> {
    let a = Artifact::open(artifact, &Limits::default())
        .with_context(|| format!("opening {}", artifact.display()))?;
    let mut rows = Vec::new();
    let (mut dense_total, mut stored_total) = (0u64, 0u64);
    for t in &a.recipe().tensors {
        let dense = t.shape.iter().product::<usize>() as u64
            * Dtype::parse(&t.dtype).map_or(1, Dtype::size) as u64;
        let stored = a.stored_bytes(t);
        dense_total += dense;
        stored_total += stored;
        let kind = match &t.storage {
            StorageRecipe::Dense => "dense".to_string(),
            StorageRecipe::Lossless {
                coder, block_rows, ..
            } => {
                format!("lossless ({coder}, {block_rows} rows a block)")
            }
            StorageRecipe::Quant { format, .. } => format.clone(),
        };
        rows.push(serde_json::json!({
            "name": t.name, "dtype": t.dtype, "shape": t.shape, "storage": kind,
            "dense_bytes": dense, "stored_bytes": stored,
            "ratio": stored as f64 / dense.max(1) as f64,
        }));
    }
    if json {
        let v = serde_json::json!({
            "artifact": artifact.display().to_string(),
            "format": a.recipe().format,
            "version": a.recipe().version,
            "tool": a.recipe().tool,
            "file_bytes": a.file_bytes(),
            "dense_bytes": dense_total,
            "stored_bytes": stored_total,
            "ratio": stored_total as f64 / dense_total.max(1) as f64,
            "plan_sha256": a.recipe().plan_sha256,
            "output_head_policy": a.recipe().output_head_policy,
            "tensors": rows,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "{} ({} version {}, written by {})",
        artifact.display(),
        a.recipe().format,
        a.recipe().version,
        a.recipe().tool
    );
    println!(
        "{:<60} {:>10} {:>14} {:>14} {:>7}  storage",
        "tensor", "dtype", "dense", "stored", "ratio"
    );
    for r in &rows {
        println!(
            "{:<60} {:>10} {:>14} {:>14} {:>7.4}  {}",
            r["name"].as_str().unwrap_or(""),
            r["dtype"].as_str().unwrap_or(""),
            r["dense_bytes"],
            r["stored_bytes"],
            r["ratio"].as_f64().unwrap_or(0.0),
            r["storage"].as_str().unwrap_or("")
        );
    }
    println!(
        "total: {} tensors, {dense_total} -> {stored_total} bytes ({:.4}); file {} bytes",
        rows.len(),
        stored_total as f64 / dense_total.max(1) as f64,
        a.file_bytes()
    );
    Ok(())
}

pub(crate) fn verify(artifact: &Path) -> Result<()> {
    let t0 = Instant::now();
    let a = Artifact::open(artifact, &Limits::default())
        .with_context(|| format!("opening {}", artifact.display()))?;
    let s = a
        .verify()
        .with_context(|| format!("verifying {}", artifact.display()))?;
    println!(
        "{}: ok: {} tensors ({} lossless with {} blocks, {} quantized, {} dense), every digest matches ({:.2} s)",
        artifact.display(),
        s.tensors,
        s.lossless,
        s.blocks,
        s.quantized,
        s.dense,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
