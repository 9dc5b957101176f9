//! The `compressme` command-line tool.

mod artifact_cmds;
mod eval_cmds;
mod lm_cmds;
mod plan_cmds;
mod progress;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use candle_core::{DType, Device, Module, Tensor};
use clap::{Parser, Subcommand};
use compressme::blockstore::Coder;
use compressme::{PackOptions, PackedFrozenEmbedding};

#[derive(Parser)]
#[command(
    name = "compressme",
    version,
    about = "Store trained neural-network weights in fewer bytes, with proof"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
#[allow(clippy::large_enum_variant)] // parsed once per process: boxing buys nothing
enum Command {
    /// The offline benchmark (the main job): train a small causal model on a synthetic
    /// task, store it in every compared way, reload each, and report storage, perplexity,
    /// KL, top-1 agreement, paired intervals, timing and peak memory (JSON, table, chart);
    /// or replay a report and check that it reproduces.
    Bench(eval_cmds::BenchArgs),
    /// Internal: measures one stored variant for `bench --model` (a request as JSON on
    /// stdin, the result as JSON on stdout), in its own process.
    #[command(hide = true)]
    BenchProbe,
    /// Quality of a stored model on held-out data against its f32 reference: perplexity,
    /// KL and top-1 agreement (causal artifacts), or sentence-embedding cosine and
    /// retrieval agreement (BERT).
    Evaluate(eval_cmds::EvaluateArgs),
    /// Greedy generation from a pretrained decoder with its KV cache: prints the text,
    /// and tokens a second counted over the tokens actually produced.
    Generate(lm_cmds::GenerateArgs),
    /// Record per-module activation statistics over calibration text, with the estimated
    /// error of each candidate format: of a decoder (a Hugging Face folder, a llama GGUF
    /// file or a decoder artifact) over windows of --text, or of a BERT folder over the
    /// lines of --data.
    Profile {
        /// A decoder (folder, GGUF, artifact) or a BERT folder.
        model_dir: PathBuf,
        /// Decoders: calibration text, one document, cut into windows of --context tokens.
        #[arg(long)]
        text: Option<PathBuf>,
        /// BERT: calibration text, one example a line: a file, or a folder of .txt files.
        #[arg(long)]
        data: Option<PathBuf>,
        /// The profile JSON to write.
        #[arg(short, long)]
        output: PathBuf,
        /// Lines a batch.
        #[arg(long, default_value_t = 16)]
        batch: usize,
        /// BERT: tokens kept a line at most.
        #[arg(long, default_value_t = 128)]
        max_len: usize,
        /// Decoders: tokens a window (default the smaller of the context and 512).
        #[arg(long)]
        context: Option<usize>,
        /// Decoders: calibrate on the first N windows only.
        #[arg(long)]
        max_windows: Option<usize>,
        /// |x| above this counts toward density.
        #[arg(long, default_value_t = 0.01)]
        density_threshold: f32,
        /// Formats whose error is estimated per module (comma-separated; default: f16,
        /// int8, nf4 and blockwise nf4/int4 at groups 32, 64, 128): what `plan
        /// --candidates` may then choose from.
        #[arg(long)]
        candidates: Option<String>,
        /// Decoders: then measure each linear's sensitivity on the text's first N tokens
        /// (the KL divergence from the model with that linear alone quantized to
        /// --measure-format), and make it the estimate `plan --budget-bpw` minimises (the
        /// real-model benchmark's budget plans; a forward pass from the linear's block on
        /// per linear: minutes on a 135M model).
        #[arg(long)]
        measure_tokens: Option<usize>,
        /// Decoders: the format each linear is quantized to for --measure-tokens.
        #[arg(long, default_value = "nf4-g64")]
        measure_format: String,
    },
    /// Choose a storage per module from a profile: under a budget in bits per weight
    /// (minimising the estimated error), or by the importance thresholds.
    Plan {
        /// A profile from `compressme profile`.
        profile: PathBuf,
        /// The plan JSON to write.
        #[arg(short, long)]
        output: PathBuf,
        /// Budget: stored bits per weight of the planned linears.
        #[arg(long)]
        budget_bpw: Option<f64>,
        /// The seed's importance thresholds instead of a budget.
        #[arg(long)]
        thresholds: bool,
        /// Formats the budget solver may choose (comma-separated; default: f16, int8,
        /// nf4 and blockwise nf4/int4 at groups 32, 64, 128), besides dense f32.
        #[arg(long)]
        candidates: Option<String>,
        /// Let output heads go below INT8.
        #[arg(long)]
        no_protect_head: bool,
        /// Output head module names (comma-separated; default lm_head).
        #[arg(long)]
        heads: Option<String>,
        /// Write the shuffled control under this seed instead.
        #[arg(long)]
        shuffle_seed: Option<u64>,
    },
    /// Pack a safetensors checkpoint (a file, a folder, or a sharded index) into one
    /// verified artifact: losslessly, quantized by name pattern, or by a plan.
    Pack(artifact_cmds::PackArgs),
    /// Write a plain safetensors file from an artifact (byte-identical for lossless and
    /// dense tensors, dequantized for quantized ones).
    Unpack {
        /// The artifact.
        artifact: PathBuf,
        /// The safetensors file to write, or a folder (model.safetensors in it).
        #[arg(short, long)]
        output: PathBuf,
        /// Sync the file to the disk before renaming it into place (by default it is
        /// renamed once complete and checked, and the kernel writes it back when it will,
        /// as zstd and cp leave their files).
        #[arg(long)]
        fsync: bool,
        #[command(flatten)]
        limits: artifact_cmds::LimitArgs,
    },
    /// Per-tensor storage, dense and stored bytes, and totals (reads no payload; warns
    /// where a tensor decodes to more than 20x what it stores, and where the decoded-size
    /// limits would make `verify` and `unpack` refuse the file).
    Inspect {
        /// The artifact.
        artifact: PathBuf,
        /// As JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        limits: artifact_cmds::LimitArgs,
    },
    /// Check every digest; a non-zero exit names the tensor and block that failed.
    /// Decodes a piece at a time (memory stays bounded), after the decoded-size limits
    /// were checked against the header.
    Verify {
        /// The artifact.
        artifact: PathBuf,
        /// Check every stored byte against its digest (block digests, each block
        /// store's index digest, dense tensors' and packed buffers' digests) without
        /// decoding: what `pack` checks before it renames its output, and about twice as
        /// fast. Without it, every block is also decoded and every tensor's decoded bytes
        /// hashed against the recipe's whole-tensor SHA-256.
        #[arg(long)]
        stored: bool,
        #[command(flatten)]
        limits: artifact_cmds::LimitArgs,
    },
    /// Sentence embeddings of a BERT sentence-transformers folder (all-MiniLM-L6-v2 and
    /// kin): one JSON array per input line on stdout, computed as sentence-transformers
    /// does (truncation at max_seq_length, mean pooling over the attention mask, L2
    /// normalisation). Empty lines are valid input.
    Embed {
        /// A local model folder: config.json, model.safetensors, tokenizer.json.
        model_dir: PathBuf,
        /// Read lines from this file instead of stdin.
        #[arg(long)]
        text: Option<PathBuf>,
        /// Lines embedded together (padded to the longest of them).
        #[arg(long, default_value_t = 32)]
        batch: usize,
        /// Print metadata (model, lines, tokens, time) as one JSON object on stderr.
        #[arg(long)]
        json: bool,
        /// Take every weight from this artifact (of the folder's checkpoint) instead of
        /// model.safetensors, each module in the artifact's storage: packed linears stay
        /// packed, lossless tables stay in their blocks, read in place from the file.
        #[arg(long)]
        artifact: Option<PathBuf>,
    },
    /// Pack a frozen embedding table losslessly, check every row, and time a batch lookup
    /// against plain `index_select` (default: all-MiniLM-L6-v2's word embeddings).
    LosslessDemo {
        /// A safetensors file (default: cache/minilm/model.safetensors from `cargo xtask fixtures`).
        #[arg(long)]
        model: Option<PathBuf>,
        /// The 2-D float tensor to pack.
        #[arg(long, default_value = "embeddings.word_embeddings.weight")]
        tensor: String,
        /// Rows per block.
        #[arg(long, default_value_t = 16)]
        block_rows: usize,
        /// Code planes with Zstandard at this level instead of shared Huffman tables.
        #[arg(long)]
        zstd_level: Option<i32>,
        /// Leave out the per-row index of coded planes: a few tenths of a percent smaller,
        /// slower random lookups.
        #[arg(long)]
        compact: bool,
        /// Skip the second run on the table rounded to bf16.
        #[arg(long)]
        no_bf16: bool,
        /// Lookup batch shape: batch x sequence random ids.
        #[arg(long, default_value_t = 32)]
        batch: usize,
        /// Lookup batch shape: batch x sequence random ids.
        #[arg(long, default_value_t = 128)]
        seq: usize,
        /// Timed repetitions of each lookup (the median is reported).
        #[arg(long, default_value_t = 51)]
        reps: usize,
    },
}

/// A reader that closed the pipe (`compressme inspect x | head`) ends the run quietly, as
/// it would for a C tool, instead of `println!` panicking.
fn exit_quietly_on_broken_pipe() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if msg.contains("Broken pipe") {
            std::process::exit(141);
        }
        default(info);
    }));
}

/// On SIGINT, SIGTERM or SIGHUP: remove the unfinished temporary files this process is
/// writing (an interrupted `pack` or `unpack` leaves nothing behind), then exit with 128
/// plus the signal's number, as a shell reports a process stopped by it.
fn clean_up_on_signals() {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    match signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP]) {
        Ok(mut signals) => {
            std::thread::spawn(move || {
                if let Some(sig) = signals.forever().next() {
                    let n = compressme::artifact::remove_temporaries();
                    if n > 0 {
                        eprintln!("interrupted: removed {n} unfinished file(s)");
                    }
                    std::process::exit(128 + sig);
                }
            });
        }
        Err(e) => tracing::warn!(
            "no signal handler ({e}): an interrupted run may leave a temporary file, which the next run writing the same output removes"
        ),
    }
}

/// Sets `RAYON_NUM_THREADS` to the number of threads rayon would start anyway (the CPUs
/// this process may use), unless the user set it.
///
/// candle 0.11 asks for its thread count on every matrix product, and without the
/// variable it works the count out again each time: on Linux by parsing `/proc/cpuinfo`
/// for physical cores. Generation makes hundreds of small products a token, and that
/// parsing cost SmolLM2's f32 generation a third of its time (300 tokens, one pinned core:
/// 16.2-17.2 s without the variable, 11.6 s with it). The benchmarks already set it for
/// every child they time.
fn pin_thread_count() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
        // SAFETY: the first statement of `main`, before this process starts any thread,
        // so nothing reads the environment while it is written.
        #[allow(unsafe_code)]
        unsafe {
            std::env::set_var("RAYON_NUM_THREADS", n.to_string());
        }
    }
}

/// Errors print as one line, the cause chain included (`error: reading x: No such file`),
/// with no backtrace: the message names what failed; `COMPRESSME_DEBUG` shows more.
fn main() -> std::process::ExitCode {
    pin_thread_count();
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // the cause chain on one line, leaving out causes a message already quotes
            let mut msg = e.to_string();
            for cause in e.chain().skip(1) {
                let c = cause.to_string();
                if !msg.contains(&c) {
                    msg = format!("{msg}: {c}");
                }
            }
            eprintln!("error: {msg}");
            if std::env::var_os("COMPRESSME_DEBUG").is_some() {
                eprintln!("{e:?}");
            }
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    exit_quietly_on_broken_pipe();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(if std::env::var_os("COMPRESSME_DEBUG").is_some() {
            tracing::Level::DEBUG
        } else {
            tracing::Level::WARN
        })
        .init();
    clean_up_on_signals();
    match Cli::parse().command {
        Command::Bench(args) => eval_cmds::bench(&args),
        Command::BenchProbe => eval_cmds::bench_probe(),
        Command::Evaluate(args) => eval_cmds::evaluate(&args),
        Command::Pack(args) => artifact_cmds::pack(&args),
        Command::Unpack {
            artifact,
            output,
            fsync,
            limits,
        } => artifact_cmds::unpack_cmd(&artifact, &output, &limits.limits(), fsync),
        Command::Generate(args) => lm_cmds::generate(&args),
        Command::Profile {
            model_dir,
            text,
            data,
            output,
            batch,
            max_len,
            context,
            max_windows,
            density_threshold,
            candidates,
            measure_tokens,
            measure_format,
        } => {
            let settings = plan_cmds::profile_settings(density_threshold, candidates.as_deref())?;
            let measure = measure_tokens
                .map(|n| {
                    Ok::<_, anyhow::Error>((n, compressme::quant::Format::parse(&measure_format)?))
                })
                .transpose()?;
            match (text, data) {
                (Some(text), None) => plan_cmds::profile_decoder(&lm_cmds::ProfileOptions {
                    model: &model_dir,
                    text: &text,
                    out: &output,
                    context,
                    max_windows,
                    settings,
                    measure,
                }),
                (None, Some(_)) if measure.is_some() => {
                    bail!("--measure-tokens is for decoders (--text): not with --data")
                }
                (None, Some(data)) => {
                    plan_cmds::profile(&model_dir, &data, &output, batch, max_len, settings)
                }
                _ => bail!(
                    "give --text FILE (a decoder: one document) or --data FILE (BERT: one example a line)"
                ),
            }
        }
        Command::Plan {
            profile,
            output,
            budget_bpw,
            thresholds,
            candidates,
            no_protect_head,
            heads,
            shuffle_seed,
        } => plan_cmds::plan(
            &profile,
            &output,
            budget_bpw,
            thresholds,
            candidates.as_deref(),
            no_protect_head,
            heads.as_deref(),
            shuffle_seed,
        ),
        Command::Inspect {
            artifact,
            json,
            limits,
        } => artifact_cmds::inspect(&artifact, json, &limits.limits()),
        Command::Verify {
            artifact,
            stored,
            limits,
        } => artifact_cmds::verify(&artifact, stored, &limits.limits()),
        Command::Embed {
            model_dir,
            text,
            batch,
            json,
            artifact,
        } => embed(
            &model_dir,
            artifact.as_deref(),
            text.as_deref(),
            batch,
            json,
        ),
        Command::LosslessDemo {
            model,
            tensor,
            block_rows,
            zstd_level,
            compact,
            no_bf16,
            batch,
            seq,
            reps,
        } => {
            let model = model.unwrap_or_else(|| PathBuf::from("cache/minilm/model.safetensors"));
            let coder = zstd_level.map_or(Coder::default(), |level| Coder::Zstd { level });
            let opts = PackOptions {
                block_rows,
                coder,
                row_index: !compact,
            };
            let table = load_table(&model, &tensor)?;
            println!(
                "{tensor} from {}: {:?} {:?}",
                model.display(),
                table.dims(),
                table.dtype()
            );
            demo(&table, &opts, batch, seq, reps)?;
            if !no_bf16 && table.dtype() != DType::BF16 {
                println!();
                println!("the same table rounded to bf16:");
                demo(&table.to_dtype(DType::BF16)?, &opts, batch, seq, reps)?;
            }
            Ok(())
        }
    }
}

fn embed(
    model_dir: &Path,
    artifact: Option<&Path>,
    text: Option<&Path>,
    batch: usize,
    json: bool,
) -> Result<()> {
    use std::io::{BufWriter, Read, Write};
    let t0 = Instant::now();
    let embedder = match artifact {
        None => compressme::nn::SentenceEmbedder::from_dir(model_dir, &Device::Cpu)
            .with_context(|| format!("loading {}", model_dir.display()))?,
        Some(a) => {
            let bert = compressme::nn::Bert::from_artifact(model_dir, a, &Device::Cpu)
                .with_context(|| format!("loading {}", a.display()))?;
            compressme::nn::SentenceEmbedder::with_bert(model_dir, bert)?
        }
    };
    let mut input = String::new();
    match text {
        Some(p) => {
            input =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
        }
        None => {
            std::io::stdin()
                .read_to_string(&mut input)
                .context("reading stdin")?;
        }
    }
    // one embedding per line; a final newline does not start another line
    let body = input.strip_suffix('\n').unwrap_or(&input);
    let lines: Vec<&str> = if input.is_empty() {
        Vec::new()
    } else {
        body.split('\n')
            .map(|l| l.strip_suffix('\r').unwrap_or(l))
            .collect()
    };
    let mut out = BufWriter::new(std::io::stdout().lock());
    let mut tokens = 0usize;
    for chunk in lines.chunks(batch.max(1)) {
        let (_, _, mask) = embedder.tokenize(chunk)?;
        tokens += mask.sum_all()?.to_scalar::<u32>()? as usize;
        for e in embedder.embed(chunk)? {
            serde_json::to_writer(&mut out, &e)?;
            out.write_all(b"\n")?;
        }
    }
    out.flush()?;
    if json {
        let meta = serde_json::json!({
            "model_dir": model_dir.display().to_string(),
            "artifact": artifact.map(|a| a.display().to_string()),
            "lines": lines.len(),
            "tokens": tokens,
            "max_seq_length": embedder.max_len(),
            "dim": embedder.bert().config().hidden_size,
            "seconds": t0.elapsed().as_secs_f64(),
            "tool": concat!("compressme ", env!("CARGO_PKG_VERSION")),
        });
        eprintln!("{meta}");
    }
    Ok(())
}

fn load_table(path: &Path, name: &str) -> Result<Tensor> {
    let bytes = std::fs::read(path).with_context(|| {
        format!(
            "reading {} (run `cargo xtask fixtures` for the default model)",
            path.display()
        )
    })?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .with_context(|| format!("parsing {}", path.display()))?;
    let view = st
        .tensor(name)
        .with_context(|| format!("tensor `{name}` not found in {}", path.display()))?;
    let dtype = match view.dtype() {
        safetensors::Dtype::F32 => DType::F32,
        safetensors::Dtype::BF16 => DType::BF16,
        safetensors::Dtype::F16 => DType::F16,
        safetensors::Dtype::F64 => DType::F64,
        other => bail!("tensor `{name}` has dtype {other:?}; lossless packing takes float tables"),
    };
    Ok(Tensor::from_raw_buffer(
        view.data(),
        dtype,
        view.shape(),
        &Device::Cpu,
    )?)
}

fn median(v: &[Duration]) -> Duration {
    let m = compressme_eval::median(v.iter().map(Duration::as_secs_f64).collect());
    Duration::try_from_secs_f64(m).unwrap_or_default()
}

fn demo(table: &Tensor, opts: &PackOptions, batch: usize, seq: usize, reps: usize) -> Result<()> {
    let t0 = Instant::now();
    let packed = PackedFrozenEmbedding::new(table, opts)?;
    let pack_time = t0.elapsed();
    let t0 = Instant::now();
    packed.store().verify_all()?;
    let verify_time = t0.elapsed();
    let s = packed.store().stored_bytes();
    let dense = packed.dense_bytes();
    println!(
        "  stored {} bytes for {} dense: ratio {:.4} (payload {}, block lengths {}, digests {}, code tables {}, header {})",
        s.total(),
        dense,
        s.total() as f64 / dense as f64,
        s.payload,
        s.offsets,
        s.digests,
        s.tables,
        s.header
    );
    println!(
        "  packed in {:.1} ms ({:.0} MB/s), all {} blocks verified in {:.1} ms",
        pack_time.as_secs_f64() * 1e3,
        dense as f64 / pack_time.as_secs_f64() / 1e6,
        packed.store().num_blocks(),
        verify_time.as_secs_f64() * 1e3
    );
    // every row, byte for byte
    let t0 = Instant::now();
    let snapshot = packed.weight()?;
    let decode_time = t0.elapsed();
    let same = snapshot
        .flatten_all()?
        .to_dtype(DType::F64)?
        .to_vec1::<f64>()?
        .iter()
        .map(|v| v.to_bits())
        .eq(table
            .flatten_all()?
            .to_dtype(DType::F64)?
            .to_vec1::<f64>()?
            .iter()
            .map(|v| v.to_bits()));
    if !same {
        bail!("decoded table differs from the original");
    }
    println!(
        "  every row decoded and identical in {:.1} ms ({:.0} MB/s, both cores)",
        decode_time.as_secs_f64() * 1e3,
        dense as f64 / decode_time.as_secs_f64() / 1e6
    );

    // a batch of random ids: packed lookup against plain index_select, interleaved
    let rows = table.dims().first().copied().unwrap_or(0) as u64;
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let ids: Vec<u32> = (0..batch * seq)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % rows.max(1)) as u32
        })
        .collect();
    let ids = Tensor::from_vec(ids, (batch, seq), &Device::Cpu)?;
    let flat = ids.flatten_all()?;
    let (mut tp, mut ti) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        let t0 = Instant::now();
        let a = packed.forward(&ids)?;
        tp.push(t0.elapsed());
        let t0 = Instant::now();
        let b = table.index_select(&flat, 0)?.reshape(a.dims())?;
        ti.push(t0.elapsed());
        std::hint::black_box((a, b));
    }
    let (mp, mi) = (median(&tp), median(&ti));
    println!(
        "  lookup of {batch}x{seq} random ids: packed {:.3} ms, index_select {:.3} ms, ratio {:.2}x (median of {reps})",
        mp.as_secs_f64() * 1e3,
        mi.as_secs_f64() * 1e3,
        mp.as_secs_f64() / mi.as_secs_f64()
    );
    Ok(())
}
