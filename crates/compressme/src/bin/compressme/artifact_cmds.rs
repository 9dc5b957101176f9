//! `pack`, `unpack`, `inspect` and `verify`: the artifact's command-line face.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use compressme::artifact::{
    Artifact, Checkpoint, Dtype, Durability, Input as WriteInput, Limits, Storage, StorageRecipe,
    WholeDigest, Writer, recipe::sha256_hex, unpack,
};
use compressme::blockstore::{Coder, SharedBytes};
use compressme::quant::Format;
use indicatif::{ProgressBar, ProgressStyle};

/// The entropy coder of `pack`'s lossless planes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum EntropyCoder {
    /// rANS tables on the planes where they save at least 0.5% over Huffman tables or raw
    /// (exponent planes), Huffman tables or raw elsewhere.
    Mixed,
    /// rANS or Huffman tables per plane, whichever stores it smaller.
    Rans,
    /// Huffman tables only.
    Huffman,
}

/// The whole-tensor digest `pack` records for each lossless tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum WholeDigestArg {
    /// XXH3-128 (artifact version 4).
    Xxh3,
    /// SHA-256 (artifact versions 2 and 3).
    Sha256,
}

#[derive(clap::Args)]
pub(crate) struct PackArgs {
    /// model.safetensors, a model folder, model.safetensors.index.json, or a llama GGUF
    /// file. A folder of a decoder compressme runs (Llama, GPT-NeoX, GPT-2) and a GGUF
    /// file are packed as a model: every linear weight `[out, in]`, GGUF tensors
    /// dequantized to f32 under Hugging Face names, and the configuration, tokenizer and
    /// source file's SHA-256 in the artifact, so `evaluate` and `generate` need nothing
    /// else.
    pub(crate) input: PathBuf,
    /// The artifact to write (written beside it and renamed when verified).
    #[arg(short, long)]
    pub(crate) output: PathBuf,
    /// Store every float tensor in lossless row blocks where that is smaller (and
    /// tensors that --format or --plan leave alone, when given with them).
    #[arg(long)]
    pub(crate) lossless: bool,
    /// Quantize every float tensor of 2+ dimensions to this format (f16, bf16, int8,
    /// nf4, nf4-g32/64/128, int4-g32/64/128, int8-g32/64/128), except those --keep matches.
    #[arg(long)]
    pub(crate) format: Option<String>,
    /// A regular expression of tensor names --format leaves alone (e.g. 'lm_head|embed').
    #[arg(long)]
    pub(crate) keep: Option<String>,
    /// Keep dense (and say so) a tensor whose values the chosen format cannot hold (a
    /// finite weight f16 would make infinite, say), instead of refusing the checkpoint.
    #[arg(long)]
    pub(crate) keep_unrepresentable: bool,
    /// Lossless tensors' Huffman planes get a per-row index (plane mode 32 + t), so a
    /// lookup decodes only the rows it asks for, for a few tenths of a percent more bytes.
    #[arg(long)]
    pub(crate) row_index: bool,
    /// A plan JSON: {"version": 1, "modules": {"NAME": "nf4-g64" | "int8" | "lossless" | "dense", ...}}.
    #[arg(long)]
    pub(crate) plan: Option<PathBuf>,
    /// Rows per lossless block: each block carries a 32-byte SHA-256 and a few bytes of
    /// framing, and is the unit a lookup decodes.
    #[arg(long, default_value_t = 64)]
    pub(crate) block_rows: usize,
    /// Entropy coder of lossless planes: `mixed` (rANS frequency tables on the planes
    /// where they save at least 0.5% of the plane, in practice exponent planes, Huffman
    /// tables or raw elsewhere; block store version 2 when a plane has rANS tables),
    /// `huffman` (Huffman code tables only: block store version 1, the fastest to decode,
    /// 0.15-0.3% of the dense bytes larger) or `rans` (rANS tables on every plane where
    /// they store it smaller: the smallest files, a further 0.05-0.15% smaller, and the
    /// slowest to decode: near-uniform mantissa planes take rANS too).
    #[arg(long, value_enum, default_value_t = EntropyCoder::Mixed)]
    pub(crate) coder: EntropyCoder,
    /// The whole-tensor digest of each lossless tensor: `xxh3` (XXH3-128, artifact version
    /// 4; the stored bytes stay sealed by every block's SHA-256, and checking what they
    /// decode to costs a fraction of a SHA-256) or `sha256` (artifact versions 2 and 3,
    /// which compressme reads from before version 4 did; a recipe that names each tensor
    /// by its SHA-256).
    #[arg(long, value_enum, default_value_t = WholeDigestArg::Xxh3)]
    pub(crate) whole_digest: WholeDigestArg,
    /// Code lossless planes with Zstandard at this level instead of shared tables.
    #[arg(long)]
    pub(crate) zstd_level: Option<i32>,
    /// Shared tables per byte plane (1-16): more tables fit unusual blocks
    /// better and encode slower (planes no table can code are not clustered).
    #[arg(long, default_value_t = 16)]
    pub(crate) tables: u8,
    /// A profile from `compressme profile`: blockwise 4-bit formats then choose each
    /// group's scale to minimise the activation-weighted error (imatrix-style) instead
    /// of plain absmax.
    #[arg(long, conflicts_with = "gptq")]
    pub(crate) profile: Option<PathBuf>,
    /// Round every quantized linear of a model (a decoder folder or a GGUF file) by GPTQ
    /// instead: its codes chosen one column at a time, each rounding error spread over
    /// the columns after it against the linear's input Gram matrix, recorded on
    /// windows of 512 tokens of this text (each group's scale chosen against that
    /// matrix's diagonal, as --profile chooses it). The same formats and layouts; only
    /// which codes the weights get differs.
    #[arg(long, value_name = "TEXT")]
    pub(crate) gptq: Option<PathBuf>,
    /// Windows of --gptq's text to record on (from its start).
    #[arg(long, default_value_t = 16, requires = "gptq")]
    pub(crate) gptq_windows: usize,
    /// GPTQ's damping: a fraction of each Gram matrix's mean diagonal added to its
    /// diagonal before it is inverted.
    #[arg(long, default_value_t = 0.01, requires = "gptq")]
    pub(crate) gptq_damp: f64,
    /// Print the per-tensor report as JSON.
    #[arg(long)]
    pub(crate) json: bool,
    /// After writing, decode every block and hash every tensor again before the rename
    /// (by default the reopened file's stored bytes are checked against their digests
    /// without decoding: the encoder already decoded each block and compared it with the
    /// input).
    #[arg(long)]
    pub(crate) paranoid: bool,
    /// Sync the artifact to the disk before renaming it into place (by default it is
    /// renamed once complete and checked, and the kernel writes it back when it will, as
    /// zstd and cp leave their files).
    #[arg(long)]
    pub(crate) fsync: bool,
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

/// What `pack` reads: a checkpoint a tensor at a time, or a decoder's tensors as the
/// model holds them.
enum Input {
    Checkpoint(Checkpoint),
    Model(BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>),
}

impl Input {
    fn entries(&self) -> Vec<(String, Dtype, Vec<usize>)> {
        match self {
            Self::Checkpoint(c) => c
                .entries()
                .map(|e| (e.name.clone(), e.dtype, e.shape.clone()))
                .collect(),
            Self::Model(m) => m
                .iter()
                .map(|(n, (d, s, _))| (n.clone(), *d, s.clone()))
                .collect(),
        }
    }
}

/// One tensor for `pack`'s pipeline: name, dtype, shape, storage, its bytes when they
/// are already in memory, and the tensor itself when it was prepared ahead.
type Item = (
    String,
    Dtype,
    Vec<usize>,
    Storage,
    Option<Vec<u8>>,
    Option<compressme::artifact::Prepared<'static>>,
);

fn dense_len(dtype: Dtype, shape: &[usize]) -> u64 {
    shape.iter().product::<usize>() as u64 * dtype.size() as u64
}

/// `pack`'s items in the pipeline's units: runs of up to four consecutive lossless
/// tensors with the same storage, not prepared ahead and together at most `budget` bytes
/// (so the pipeline's memory bound holds), and every other item alone.
fn lockstep_groups(items: Vec<Item>, budget: u64) -> Vec<Vec<Item>> {
    let mut groups: Vec<Vec<Item>> = Vec::new();
    let mut weight = 0u64;
    for item in items {
        let joins = matches!(item.3, Storage::Lossless { .. }) && item.5.is_none();
        let w = dense_len(item.1, &item.2);
        let fits = groups.last().is_some_and(|g| {
            g.len() < 4
                && weight.saturating_add(w) <= budget
                // the group's first item lossless too: its storage equals this one's
                && g.first().is_some_and(|f| f.3 == item.3 && f.5.is_none())
        });
        if joins && fits {
            weight = weight.saturating_add(w);
            if let Some(g) = groups.last_mut() {
                g.push(item);
            }
        } else {
            weight = w;
            groups.push(vec![item]);
        }
    }
    groups
}

/// A decoder's tensors (every linear `[out, in]`, f32), the metadata that lets the
/// artifact run alone, and its modules' shapes for plan validation.
type ModelInput = (
    Input,
    BTreeMap<String, String>,
    BTreeMap<String, compressme::plan::ModuleShape>,
    String,
    Option<Gptq>,
);

/// Each linear's GPTQ factor, by module name, and the calibration text's SHA-256.
type Gptq = (BTreeMap<String, Arc<compressme::quant::GptqFactor>>, String);

fn model_input(path: &Path, a: &PackArgs) -> Result<ModelInput> {
    use compressme::nn::Model;
    let lm = crate::lm_cmds::open(path)?;
    let gptq = match &a.gptq {
        Some(text) => Some(crate::lm_cmds::gptq_factors(
            &lm,
            text,
            a.gptq_windows,
            a.gptq_damp,
        )?),
        None => None,
    };
    // a folder's tensors keep their checkpoint dtype (the model holds them as f32, an
    // exact widening of bf16 and f16): a bf16 checkpoint packs as bf16
    let source_dtypes: BTreeMap<String, Dtype> = if path.is_dir() {
        Checkpoint::open(path, &Limits::default())?
            .entries()
            .filter(|e| e.dtype.is_float())
            .map(|e| (e.name.clone(), e.dtype))
            .collect()
    } else {
        BTreeMap::new()
    };
    let mut tensors = BTreeMap::new();
    for (name, t) in lm.model.tensors()? {
        let values = t.flatten_all()?.to_vec1::<f32>()?;
        let dtype = match source_dtypes.get(&name) {
            Some(d @ (Dtype::Bf16 | Dtype::F16)) => *d,
            _ => Dtype::F32,
        };
        tensors.insert(
            name,
            (
                dtype,
                t.dims().to_vec(),
                compressme::artifact::from_f32(dtype, &values),
            ),
        );
    }
    let mut shapes = BTreeMap::new();
    for m in lm.model.modules() {
        shapes.insert(
            m.name.clone(),
            compressme::plan::ModuleShape {
                rows: m.rows,
                cols: m.cols,
                embedding: m.kind == compressme::nn::ModuleKind::Embedding,
            },
        );
    }
    let tokenizer_sha = sha256_hex(lm.tokenizer_json.as_bytes());
    Ok((
        Input::Model(tensors),
        lm.artifact_metadata()?,
        shapes,
        tokenizer_sha,
        gptq,
    ))
}

pub(crate) fn pack(a: &PackArgs) -> Result<()> {
    let t0 = Instant::now();
    if a.gptq.is_some() && a.format.is_none() && a.plan.is_none() {
        bail!(
            "--gptq rounds quantized tensors: say which with --format FORMAT or --plan PLAN.json"
        );
    }
    let (mut ckpt, metadata, model_shapes, tokenizer_sha, gptq) = if crate::lm_cmds::is_decoder(
        &a.input,
    ) {
        let (input, meta, shapes, tok, gptq) = model_input(&a.input, a)?;
        (input, meta, Some(shapes), Some(tok), gptq)
    } else {
        if a.gptq.is_some() {
            bail!(
                "--gptq runs the model on its text: {} is a checkpoint, not a model compressme runs (a decoder folder or a GGUF file)",
                a.input.display()
            );
        }
        let c = Checkpoint::open(&a.input, &Limits::default())
            .with_context(|| format!("reading checkpoint {}", a.input.display()))?;
        let meta = c.metadata().clone();
        (Input::Checkpoint(c), meta, None, None, None)
    };
    let entries = ckpt.entries();
    let names: Vec<String> = entries.iter().map(|e| e.0.clone()).collect();
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
        for (name, _, shape) in &entries {
            if let [rows, cols] = shape[..] {
                let module = name.strip_suffix(".weight").unwrap_or(name).to_string();
                // a model's own module kinds; a bare checkpoint's by name
                let embedding = match &model_shapes {
                    Some(m) => m.get(&module).is_some_and(|s| s.embedding),
                    None => module.contains("embed"),
                };
                let shape = compressme::plan::ModuleShape {
                    rows,
                    cols,
                    embedding,
                };
                shapes.insert(module, shape);
                shapes.insert(name.clone(), shape);
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
    let coder = match (a.zstd_level, a.coder) {
        (Some(level), _) => Coder::Zstd { level },
        (None, EntropyCoder::Rans) => Coder::SharedRans {
            max_tables: a.tables,
        },
        (None, EntropyCoder::Mixed) => Coder::Mixed {
            max_tables: a.tables,
        },
        (None, EntropyCoder::Huffman) => Coder::SharedHuffman {
            max_tables: a.tables,
        },
    };
    let total: u64 = entries.iter().map(|(_, d, s)| dense_len(*d, s)).sum();
    let largest = entries
        .iter()
        .map(|(_, d, s)| dense_len(*d, s))
        .max()
        .unwrap_or(0);
    let mut w =
        Writer::create(&a.output).with_context(|| format!("creating {}", a.output.display()))?;
    w.set_paranoid(a.paranoid);
    w.set_durability(durability(a.fsync));
    w.recipe_mut().source_metadata = metadata;
    w.recipe_mut().tokenizer_sha256 = tokenizer_sha;
    // a checkpoint of one file: its header is recorded, so `unpack` gives the file back
    if let Input::Checkpoint(c) = &ckpt
        && let Some(text) = c.source_header()
    {
        w.set_source_header(text)?;
    }
    if let Some(p) = &profile {
        w.recipe_mut().calibration_sha256 = Some(p.calibration_sha256.clone());
    }
    if let Some((_, text_sha)) = &gptq {
        w.recipe_mut().calibration_sha256 = Some(text_sha.clone());
    }
    if let (Some(plan), Some(bytes)) = (&plan, &plan_bytes) {
        w.recipe_mut().plan_sha256 = Some(sha256_hex(bytes));
        w.recipe_mut().output_head_policy = Some(plan.policy.describe());
    }
    let pb = bar(total);
    let mut report = Vec::with_capacity(names.len());
    // every tensor's storage, decided up front; then tensors are prepared in parallel
    // (at most the largest tensor, or 64 MiB, of them in flight) and written in order
    let (ckpt, mut owned) = match &mut ckpt {
        Input::Checkpoint(c) => (Some(&*c), BTreeMap::new()),
        Input::Model(m) => (None, std::mem::take(m)),
    };
    let mut items = Vec::with_capacity(entries.len());
    for (name, dtype, shape) in &entries {
        // an empty tensor has nothing to quantize or code: it stays dense
        let empty = shape.contains(&0);
        let quantizable = dtype.is_float() && shape.len() >= 2 && !empty;
        let choice = match by_tensor.remove(name) {
            Some(_) if empty => Choice::Dense,
            Some(c) => c,
            None => match format {
                Some(f) if quantizable && !keep.as_ref().is_some_and(|k| k.is_match(name)) => {
                    Choice::Quant(f)
                }
                _ if a.lossless && dtype.is_float() => Choice::Lossless,
                _ => Choice::Dense,
            },
        };
        let storage = match choice {
            Choice::Dense => Storage::Dense,
            Choice::Lossless => Storage::Lossless {
                block_rows: a.block_rows,
                coder,
                row_index: a.row_index,
                digest: match a.whole_digest {
                    WholeDigestArg::Xxh3 => WholeDigest::Xxh3,
                    WholeDigestArg::Sha256 => WholeDigest::Sha256,
                },
            },
            Choice::Quant(f) => {
                let module = name.strip_suffix(".weight").unwrap_or(name);
                let factor = gptq.as_ref().and_then(|(fs, _)| fs.get(module));
                let importance: Vec<f32> = profile
                    .as_ref()
                    .and_then(|p| p.modules.get(module))
                    .map(|m| m.channel_mean_sq().iter().map(|v| *v as f32).collect())
                    .unwrap_or_default();
                match factor {
                    // a linear that saw the calibration text (GPTQ rounds linears only;
                    // a factor of another width is refused by the rounding, by name)
                    Some(factor) => Storage::Gptq {
                        format: f,
                        factor: factor.clone(),
                    },
                    None => Storage::Quantized {
                        format: f,
                        importance,
                    },
                }
            }
        };
        // a model's tensors are already in memory: handed over; a checkpoint's are
        // memory-mapped when their turn comes
        let held = owned.remove(name).map(|(_, _, b)| b);
        items.push((name.clone(), *dtype, shape.clone(), storage, held, None));
    }
    // payloads go straight into the artifact, after room kept for its header. A small
    // tensor asked to be lossless is prepared now, so that the room is not sized for a
    // block entry where blocks did not pay (its result is the one written); large ones
    // are sized as lossless: the room is a bound whichever way they go
    let mut predicted = Vec::with_capacity(items.len());
    for (name, dtype, shape, storage, held, ready) in &mut items {
        let small = dense_len(*dtype, shape) < 64 << 10;
        if small && matches!(storage, Storage::Lossless { .. }) {
            let bytes: SharedBytes = match (held.take(), ckpt) {
                (Some(v), _) => Arc::new(v),
                // copied, not mapped: held until its turn, a map each would add up
                (None, Some(c)) => Arc::new(c.read(name)?),
                (None, None) => bail!("tensor `{name}` has no bytes"),
            };
            let p = Writer::prepare(name, *dtype, shape, WriteInput::Shared(bytes), storage)?;
            if p.added().kept_dense {
                *storage = Storage::Dense;
            }
            *ready = Some(p);
        }
        predicted.push(storage.clone());
    }
    let plan: Vec<(&str, Dtype, &[usize], &Storage)> = items
        .iter()
        .zip(&predicted)
        .map(|((n, d, s, _, _, _), st)| (n.as_str(), *d, s.as_slice(), st))
        .collect();
    let room = w.header_room(&plan)?;
    w.reserve_header(room)?;
    drop(plan);
    let keep_unrepresentable = a.keep_unrepresentable;
    let bytes_of =
        |name: &str, held: Option<Vec<u8>>| -> compressme::artifact::Result<SharedBytes> {
            match (held, ckpt) {
                (Some(v), _) => Ok(Arc::new(v)),
                (None, Some(c)) => Ok(Arc::new(c.map(name)?)),
                (None, None) => Err(compressme::artifact::Error::MissingTensor(name.into())),
            }
        };
    let one =
        |(name, dtype, shape, storage, held, ready): Item| -> compressme::artifact::Result<_> {
            if let Some(p) = ready {
                return Ok((p, None));
            }
            let bytes = bytes_of(&name, held)?;
            let input = WriteInput::Shared(bytes.clone());
            match Writer::prepare(&name, dtype, &shape, input, &storage) {
                Err(compressme::artifact::Error::Quant {
                    source: e @ compressme::quant::Error::Unrepresentable { .. },
                    ..
                }) if keep_unrepresentable => {
                    let dense = Writer::prepare(
                        &name,
                        dtype,
                        &shape,
                        WriteInput::Shared(bytes),
                        &Storage::Dense,
                    )?;
                    Ok((dense, Some(format!("{name}: kept dense ({e})"))))
                }
                r => r.map(|p| (p, None)),
            }
        };
    // lossless tensors go up to four at a time, so that their whole-tensor digests run
    // in lockstep (`Writer::prepare_many`); anything else alone
    let work = |group: Vec<Item>| -> compressme::artifact::Result<Vec<_>> {
        if group.len() < 2 {
            return group.into_iter().map(one).collect();
        }
        let storage = group.first().map(|i| i.3.clone()).unwrap_or(Storage::Dense);
        let mut tensors = Vec::with_capacity(group.len());
        for (name, dtype, shape, _, held, _) in group {
            let bytes = bytes_of(&name, held)?;
            tensors.push((name, dtype, shape, WriteInput::Shared(bytes)));
        }
        Writer::prepare_many(tensors, &storage)
            .into_iter()
            .map(|r| r.map(|p| (p, None)))
            .collect()
    };
    let mut sink_one = |(p, note): (compressme::artifact::Prepared<'static>, Option<String>)| {
        let added = w.commit(p)?;
        let name = &added.name;
        pb.set_message(name.clone());
        if let Some(note) = note {
            // printed even when the bar is hidden (not a terminal)
            pb.suspend(|| eprintln!("{note}"));
        }
        tracing::debug!(tensor = %name, storage = %added.storage, dense = added.dense_bytes, stored = added.stored_bytes);
        if added.kept_dense && !a.json && added.dense_bytes >= 1 << 20 {
            // said for tensors that matter; small ones are counted at the end
            pb.suspend(|| {
                eprintln!(
                    "{name}: kept dense ({} bytes; lossless blocks would not be smaller)",
                    added.dense_bytes
                );
            });
        }
        pb.inc(added.dense_bytes);
        report.push(added);
        Ok(())
    };
    let sink = |prepared: Vec<_>| prepared.into_iter().try_for_each(&mut sink_one);
    let item_weight = |(_, dtype, shape, _, _, _): &Item| dense_len(*dtype, shape);
    let weight = |g: &Vec<Item>| g.iter().map(item_weight).sum::<u64>();
    let budget = largest.max(64 << 20);
    let groups = lockstep_groups(items, budget);
    if let Err(e) = compressme::artifact::pipeline::ordered(groups, weight, budget, work, sink) {
        if let compressme::artifact::Error::Quant {
            tensor,
            source: q @ compressme::quant::Error::Unrepresentable { .. },
        } = &e
        {
            bail!("tensor `{tensor}`: {q} (--keep-unrepresentable keeps such tensors dense)");
        }
        return Err(e.into());
    }
    pb.set_message("verifying");
    let summary = w.finish().context("writing the artifact")?;
    // the writer checks its own output without the readers' decoded-size limits; say so
    // when a reader with the defaults would refuse the file (a huge tensor of one value)
    if let Err(e) = Artifact::open(&a.output, &Limits::default()) {
        eprintln!(
            "warning: {e}\n(`verify`, `unpack` and loading need the limit raised for this file)"
        );
    }
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

/// The decoded-size limits of a command that reads an artifact someone else wrote.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct LimitArgs {
    /// The most the whole artifact may decode to (bytes, or with K, M, G, T, KiB, MiB,
    /// GiB, TiB); one tensor at most this too. Default 1 TiB, and 64 GiB a tensor.
    #[arg(long, value_parser = parse_size)]
    max_decoded: Option<u64>,
    /// The most a tensor decoding to over 64 MiB may expand, decoded over stored bytes
    /// (default 1024; only a degenerate tensor of one repeated value or a decompression
    /// bomb goes past it).
    #[arg(long)]
    max_expansion: Option<u64>,
}

impl LimitArgs {
    pub(crate) fn limits(&self) -> Limits {
        let d = Limits::default();
        Limits {
            max_decoded_total: self.max_decoded.unwrap_or(d.max_decoded_total),
            max_decoded_tensor: self
                .max_decoded
                .map_or(d.max_decoded_tensor, |m| m.min(d.max_decoded_tensor)),
            max_expansion: self.max_expansion.unwrap_or(d.max_expansion),
            ..d
        }
    }
}

/// `123`, `64M`, `8GiB`, ... as bytes.
fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a size (a number of bytes, with K, M, G or T)"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(format!("`{s}`: unknown unit `{unit}` (K, M, G or T)")),
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("`{s}` is too large"))
}

/// `--fsync` as a [`Durability`].
pub(crate) fn durability(fsync: bool) -> Durability {
    if fsync {
        Durability::Synced
    } else {
        Durability::Cached
    }
}

pub(crate) fn unpack_cmd(artifact: &Path, out: &Path, limits: &Limits, fsync: bool) -> Result<()> {
    let t0 = Instant::now();
    let dest = if out.is_dir() {
        out.join("model.safetensors")
    } else {
        out.to_path_buf()
    };
    let mut a = Artifact::open(artifact, limits)
        .with_context(|| format!("opening {}", artifact.display()))?;
    // bounded by the limits `open` checked
    let total: u64 = a.recipe().tensors.iter().map(|t| a.expansion(t).0).sum();
    let pb = bar(total);
    let s = unpack(&mut a, &dest, durability(fsync), |name, n| {
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

/// Expansion (decoded over stored bytes) past which `inspect` warns: the coder reaches
/// about 20x only through constant byte planes.
const WARN_EXPANSION: u64 = 20;

pub(crate) fn inspect(artifact: &Path, json: bool, limits: &Limits) -> Result<()> {
    // inspect decodes nothing, so it opens whatever the file claims to decode to and
    // says what the limits would do to `verify` and `unpack`
    let unbounded = Limits {
        max_decoded_tensor: u64::MAX,
        max_decoded_total: u64::MAX,
        max_expansion: u64::MAX,
        ..*limits
    };
    let a = Artifact::open(artifact, &unbounded)
        .with_context(|| format!("opening {}", artifact.display()))?;
    let refused = a.check_limits(limits).err().map(|e| e.to_string());
    let mut warnings = Vec::new();
    let mut rows = Vec::new();
    let (mut dense_total, mut stored_total) = (0u64, 0u64);
    for t in &a.recipe().tensors {
        let (dense, stored) = a.expansion(t);
        dense_total = dense_total.saturating_add(dense);
        stored_total = stored_total.saturating_add(stored);
        if dense > stored.saturating_mul(WARN_EXPANSION) && dense > 1 << 20 {
            warnings.push(format!(
                "tensor `{}` decodes to {dense} bytes from {stored} stored ({}x): beyond what the coder produces except for one repeated value; a decompression bomb looks like this",
                t.name,
                dense / stored.max(1)
            ));
        }
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
            "source_header_bytes": a.source_header().map(<[u8]>::len),
            "tensors": rows,
            "warnings": warnings,
            "refused_by_limits": refused,
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
    match a.source_header() {
        Some(h) => println!(
            "source header: recorded ({} bytes): `unpack` writes the source file back byte for byte{}",
            h.len(),
            if rows.iter().any(|r| r["storage"]
                .as_str()
                .is_some_and(|s| s != "dense" && !s.starts_with("lossless")))
            {
                " but for the quantized tensors, which it dequantizes"
            } else {
                ""
            }
        ),
        None => println!(
            "source header: not recorded: `unpack` writes the tensors in name order under a header of its own"
        ),
    }
    for w in &warnings {
        eprintln!("warning: {w}");
    }
    if let Some(e) = refused {
        eprintln!("warning: `verify` and `unpack` refuse this file under these limits: {e}");
    }
    Ok(())
}

pub(crate) fn verify(artifact: &Path, stored: bool, limits: &Limits) -> Result<()> {
    let t0 = Instant::now();
    let a = Artifact::open(artifact, limits)
        .with_context(|| format!("opening {}", artifact.display()))?;
    // bounded by the limits `open` checked
    let total: u64 = a.recipe().tensors.iter().map(|t| a.expansion(t).0).sum();
    let pb = bar(total);
    let tick = |name: &str, n: u64| {
        pb.set_message(name.to_string());
        pb.inc(n);
    };
    let s = if stored {
        a.check_stored_with(tick)
    } else {
        a.verify_with(tick)
    }
    .with_context(|| format!("verifying {}", artifact.display()))?;
    pb.finish_and_clear();
    let what = if stored {
        "every stored byte matches its digest (not decoded)"
    } else {
        "every digest matches"
    };
    println!(
        "{}: ok: {} tensors ({} lossless with {} blocks, {} quantized, {} dense), {what} ({:.2} s)",
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
