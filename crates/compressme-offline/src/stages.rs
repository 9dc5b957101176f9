//! The stages both benchmarks share: what a variant is, storing it (an artifact, or a
//! GGUF file of candle's formats), reloading it, accounting its bytes, timing variants in
//! interleaved rounds, and the paired comparisons.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use candle_core::quantized::{GgmlDType, QTensor, gguf_file};
use candle_core::{Device, Tensor};
use compressme_artifact::Storage as ArtifactStorage;
use compressme_artifact::{Dtype, Input, Writer, from_f32, recipe::sha256_hex};
use compressme_blockstore::Coder;
use compressme_eval::{Rows, Timing, paired};
use compressme_nn::{CausalLm, Decoder, LlamaFormat, Model, ModuleMut};
use compressme_plan::{Choice, Plan};
use compressme_profile::Profile;
use compressme_quant::{Format, GptqFactor, Packed};

use crate::report::{ModuleBytes, PairedRow, Storage, Variant};
use crate::{Error, Progress, Result};

/// A model the benchmarks can score, run and time: the synthetic causal model or a
/// pretrained decoder.
pub(crate) trait Lm: Model {
    /// Next-token logits of one sequence at the positions `rows` (the rows an
    /// evaluation window scores).
    fn logits(&self, ids: &[u32], rows: Rows) -> compressme_nn::Result<Vec<Vec<f32>>>;
    /// One forward pass over a batch `[b, t]`.
    fn forward_batch(&self, ids: &Tensor) -> compressme_nn::Result<Tensor>;
    /// Greedy generation; how many tokens were produced.
    fn generate_tokens(&self, prompt: &[u32], max_new: usize) -> compressme_nn::Result<usize>;
}

impl Lm for CausalLm {
    fn logits(&self, ids: &[u32], rows: Rows) -> compressme_nn::Result<Vec<Vec<f32>>> {
        self.logit_rows_at(ids, rows)
    }
    fn forward_batch(&self, ids: &Tensor) -> compressme_nn::Result<Tensor> {
        self.forward(ids)
    }
    fn generate_tokens(&self, prompt: &[u32], max_new: usize) -> compressme_nn::Result<usize> {
        Ok(self.generate(prompt, max_new, None)?.len())
    }
}

impl Lm for Decoder {
    fn logits(&self, ids: &[u32], rows: Rows) -> compressme_nn::Result<Vec<Vec<f32>>> {
        self.logit_rows_at(ids, rows)
    }
    fn forward_batch(&self, ids: &Tensor) -> compressme_nn::Result<Tensor> {
        self.forward(ids)
    }
    fn generate_tokens(&self, prompt: &[u32], max_new: usize) -> compressme_nn::Result<usize> {
        // no stop token: every variant produces the same number of tokens
        Ok(self.generate(prompt, max_new, &[])?.len())
    }
}

/// How our variants' weights are rounded onto their formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rounding {
    /// Each group's (or row's) absmax scale, every weight to its nearest code.
    Absmax,
    /// Blockwise 4-bit formats choose each group's scale against the profile's
    /// per-channel mean x² (`compressme_quant::quantize_weighted`); absmax otherwise.
    Aware,
    /// GPTQ against each linear's input Gram matrix (`compressme_quant::quantize_gptq`),
    /// each group's scale chosen as `Aware` chooses it, against the Gram diagonal.
    Gptq,
}

/// How a variant is stored.
#[derive(Debug, Clone)]
pub(crate) enum Spec {
    /// Ours: per module (by name) a plan choice, rounded by `rounding`; modules not
    /// named stay dense f32.
    Ours {
        choices: BTreeMap<String, Choice>,
        plan: Option<Plan>,
        rounding: Rounding,
    },
    /// candle's GGUF types for every linear, the rest f32, in a GGUF file.
    Candle(LlamaFormat),
}

/// One variant to store, reload and evaluate.
pub(crate) struct Planned {
    pub(crate) name: String,
    pub(crate) description: String,
    pub(crate) control: bool,
    pub(crate) spec: Spec,
}

impl Planned {
    /// Ours, from a plan's choices.
    pub(crate) fn ours(
        name: &str,
        description: String,
        control: bool,
        choices: BTreeMap<String, Choice>,
        plan: Option<Plan>,
    ) -> Self {
        Self {
            name: name.into(),
            description,
            control,
            spec: Spec::Ours {
                choices,
                plan,
                rounding: Rounding::Aware,
            },
        }
    }
}

/// The plans the variants were packed from, by variant name.
pub(crate) fn plans_of(planned: &[Planned]) -> BTreeMap<String, Plan> {
    planned
        .iter()
        .filter_map(|p| match &p.spec {
            Spec::Ours {
                plan: Some(plan), ..
            } => Some((p.name.clone(), plan.clone())),
            _ => None,
        })
        .collect()
}

pub(crate) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.display().to_string(),
        source,
    }
}

pub(crate) fn f32_bytes(t: &Tensor) -> Result<Vec<u8>> {
    Ok(from_f32(Dtype::F32, &t.flatten_all()?.to_vec1::<f32>()?))
}

pub(crate) fn file_sha256(path: &Path) -> Result<String> {
    Ok(sha256_hex(&std::fs::read(path).map_err(io(path))?))
}

/// A run's GPTQ rounding: each linear's factor (from its input's Gram matrix on the
/// calibration windows), and the weights it has rounded so far, by module and format. A
/// linear's rounding depends only on its weights, its format and its factor, all fixed for
/// the run, so the variants that share a pair (a plan and its shuffles, the plans beside
/// each other) round it once: the same bytes as rounding it again
/// (`compressme_quant::quantize_gptq` is deterministic), without the time. Two lanes that
/// ask for the same pair together round it once; the other waits.
pub(crate) struct Gptq {
    factors: BTreeMap<String, Arc<GptqFactor>>,
    rounded: Mutex<HashMap<(String, Format), Arc<Rounded>>>,
}

/// One linear's rounding in one format, made by the first lane that asks.
type Rounded = OnceLock<std::result::Result<Arc<Packed>, String>>;

impl Gptq {
    pub(crate) fn new(factors: BTreeMap<String, Arc<GptqFactor>>) -> Self {
        Self {
            factors,
            rounded: Mutex::new(HashMap::new()),
        }
    }

    /// Linear `module`'s weight `w` (`[rows, cols]`, or more dimensions flattened into
    /// the columns, as `Writer::prepare` reads it) GPTQ-rounded to `format`.
    fn rounded(&self, module: &str, format: Format, w: &Tensor) -> Result<Arc<Packed>> {
        let factor = self.factors.get(module).ok_or_else(|| {
            Error::Config(format!(
                "{module}: no input Gram matrix to round it by GPTQ"
            ))
        })?;
        let slot = {
            let mut map = self
                .rounded
                .lock()
                .map_err(|_| Error::Config("a lane rounding by GPTQ panicked".into()))?;
            Arc::clone(map.entry((module.to_string(), format)).or_default())
        };
        slot.get_or_init(|| {
            let rows = w.dims().first().copied().unwrap_or(0);
            let cols = w.elem_count() / rows.max(1);
            w.flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(|e| e.to_string())
                .and_then(|v| {
                    compressme_quant::quantize_gptq(&v, rows, cols, format, factor)
                        .map(Arc::new)
                        .map_err(|e| format!("{module}: {e}"))
                })
        })
        .clone()
        .map_err(Error::Config)
    }
}

/// Writes an artifact of every tensor: modules named in `choices` as chosen, rounded by
/// `rounding` (with `profile`'s channel statistics for [`Rounding::Aware`], `gptq`'s
/// factors and its rounded weights for [`Rounding::Gptq`]), everything else dense;
/// `metadata` lets the artifact run alone.
#[allow(clippy::too_many_arguments)] // one call site per benchmark, every argument distinct
pub(crate) fn write_ours(
    path: &Path,
    metadata: &BTreeMap<String, String>,
    tensors: &[(String, Tensor)],
    choices: &BTreeMap<String, Choice>,
    profile: &Profile,
    plan: Option<&Plan>,
    block_rows: usize,
    rounding: Rounding,
    gptq: Option<&Gptq>,
) -> Result<compressme_artifact::Summary> {
    let mut w = Writer::create(path)?;
    w.recipe_mut().source_metadata = metadata.clone();
    w.recipe_mut().calibration_sha256 = Some(profile.calibration_sha256.clone());
    if let Some(plan) = plan {
        w.recipe_mut().plan_sha256 = Some(sha256_hex(plan.to_json()?.as_bytes()));
        w.recipe_mut().output_head_policy = Some(plan.policy.describe());
    }
    for (name, t) in tensors {
        let shape = t.dims().to_vec();
        let module = name.strip_suffix(".weight");
        let choice = module.and_then(|m| choices.get(m).map(|c| (m, c)));
        if let (Some((m, Choice::Format(f))), Rounding::Gptq) = (choice, rounding) {
            let gptq = gptq.ok_or_else(|| {
                Error::Config(format!("{m}: no input Gram matrices to round it by GPTQ"))
            })?;
            // `Writer::prepare`'s GPTQ storage, its rounding made once a run
            let packed = gptq.rounded(m, *f, t)?;
            w.add_packed(name, Dtype::F32, &shape, &packed)?;
            continue;
        }
        let bytes = f32_bytes(t)?;
        match choice {
            Some((m, Choice::Format(f))) => {
                let importance = profile
                    .modules
                    .get(m)
                    .filter(|_| rounding == Rounding::Aware)
                    .map(|s| s.channel_mean_sq().iter().map(|&v| v as f32).collect())
                    .unwrap_or_default();
                let storage = ArtifactStorage::Quantized {
                    format: *f,
                    importance,
                };
                let input = Input::Borrowed(&bytes);
                w.commit(Writer::prepare(name, Dtype::F32, &shape, input, &storage)?)?;
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

/// Writes a GGUF file (candle's writer): every linear in `linears` in `format` (or the
/// type llama.cpp falls back to for its width, see `LlamaFormat::for_width`), the rest
/// f32, under the model's own tensor names, with `metadata` as strings.
pub(crate) fn write_gguf(
    path: &Path,
    metadata: &[(&str, String)],
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
                compressme_nn::llama_qtensor(&w, rows, cols, format.for_width(cols))?
            }
            _ => QTensor::quantize(t, GgmlDType::F32)?,
        };
        q.push((name.as_str(), qt));
    }
    let values: Vec<(&str, gguf_file::Value)> = metadata
        .iter()
        .map(|(k, v)| (*k, gguf_file::Value::String(v.clone())))
        .collect();
    let meta: Vec<(&str, &gguf_file::Value)> = values.iter().map(|(k, v)| (*k, v)).collect();
    let refs: Vec<(&str, &QTensor)> = q.iter().map(|(n, t)| (*n, t)).collect();
    let tmp = path.with_extension("gguf.tmp");
    let mut f = std::fs::File::create(&tmp).map_err(io(&tmp))?;
    gguf_file::write(&mut f, &meta, &refs)?;
    f.sync_all().map_err(io(&tmp))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(io(path))?;
    Ok(())
}

/// Reads a GGUF file [`write_gguf`] wrote: `build` makes the model from its string
/// metadata and its tensors dequantized, then every linear takes candle's quantized
/// tensor (checked to be `format`, or its fallback for the row width), run by candle's
/// quantized kernels.
pub(crate) fn read_gguf<M: Model>(
    path: &Path,
    format: LlamaFormat,
    build: impl FnOnce(&BTreeMap<String, String>, HashMap<String, Tensor>) -> Result<M>,
) -> Result<M> {
    let dev = Device::Cpu;
    let mut f = std::fs::File::open(path).map_err(io(path))?;
    let content = gguf_file::Content::read(&mut f)?;
    let metadata: BTreeMap<String, String> = content
        .metadata
        .iter()
        .filter_map(|(k, v)| match v {
            gguf_file::Value::String(s) => Some((k.clone(), s.clone())),
            _ => None,
        })
        .collect();
    let mut tensors = HashMap::new();
    let mut quantized = HashMap::new();
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    for name in names {
        let qt = content.tensor(&mut f, name, &dev)?;
        if qt.dtype() == GgmlDType::F32 {
            tensors.insert(name.clone(), qt.dequantize(&dev)?);
        } else {
            // never dequantized: a zero-stride view stands in until the linear takes it
            let view = Tensor::zeros((), candle_core::DType::F32, &dev)?
                .broadcast_as(qt.shape().dims())?;
            tensors.insert(name.clone(), view);
            quantized.insert(name.clone(), qt);
        }
    }
    // build with dense weights, then give every linear candle's quantized tensor
    let mut model = build(&metadata, tensors)?;
    for m in model.modules() {
        if m.kind != compressme_nn::ModuleKind::Linear {
            continue;
        }
        let want = format.for_width(m.cols).ggml();
        let qt = quantized
            .remove(&format!("{}.weight", m.name))
            .ok_or_else(|| {
                Error::Json(format!(
                    "{}: `{}.weight` is not quantized",
                    path.display(),
                    m.name
                ))
            })?;
        if qt.dtype() != want {
            return Err(Error::Json(format!(
                "{}: `{}.weight` is {:?}, expected {want:?}",
                path.display(),
                m.name,
                qt.dtype()
            )));
        }
        match model.module_mut(&m.name) {
            Some(ModuleMut::Linear(l)) => {
                l.set_weight(compressme_nn::Weight::Ggml(std::sync::Arc::new(qt)))?;
            }
            _ => return Err(Error::Json(format!("`{}` is not a linear", m.name))),
        }
    }
    if let Some(name) = quantized.keys().next() {
        return Err(Error::Json(format!(
            "{}: `{name}` is quantized but no linear takes it",
            path.display()
        )));
    }
    Ok(model)
}

/// Every module's bytes as the model holds them.
pub(crate) fn module_bytes(m: &impl Model) -> Vec<ModuleBytes> {
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

/// The artifact version the report records: the newest among the variants' `.cma` files
/// in `work_dir` (version 4 where a variant holds a lossless tensor, version 2 otherwise;
/// [`compressme_artifact::recipe::VERSION`] when there is none).
pub(crate) fn artifact_version(work_dir: &Path, variants: &[Variant]) -> Result<u32> {
    let mut version = compressme_artifact::recipe::VERSION;
    for v in variants.iter().filter(|v| v.storage.file.ends_with(".cma")) {
        let a = compressme_artifact::Artifact::open(
            &work_dir.join(&v.storage.file),
            &compressme_artifact::Limits::default(),
        )?;
        version = version.max(a.recipe().version);
    }
    Ok(version)
}

/// A reloaded variant's bytes: its file, and its modules as loaded.
pub(crate) fn storage(file: &Path, file_bytes: u64, m: &impl Model) -> Result<Storage> {
    let modules = module_bytes(m);
    let module_dense_bytes = modules.iter().map(|m| m.dense_bytes).sum();
    let module_stored_bytes = modules.iter().map(|m| m.stored_bytes).sum();
    Ok(Storage {
        file: file
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        file_bytes,
        file_sha256: file_sha256(file)?,
        modules,
        other_bytes: m.other_bytes(),
        module_dense_bytes,
        module_stored_bytes,
    })
}

/// Greedy generation from every prompt; the tokens actually produced.
pub(crate) fn generate_all(m: &impl Lm, prompts: &[Vec<u32>], max_new: usize) -> Result<u64> {
    let mut produced = 0u64;
    for p in prompts {
        produced += m.generate_tokens(p, max_new)? as u64;
    }
    Ok(produced)
}

/// Forward and generation timing of every model, in rounds that time every model once,
/// so a slow moment on a shared machine falls on all of them. Returns, per model, the
/// forward and generation timings.
pub(crate) fn time_interleaved<M: Lm>(
    models: &[M],
    forward_ids: &Tensor,
    prompts: &[Vec<u32>],
    max_new: usize,
    warmup: usize,
    reps: usize,
    progress: &dyn Progress,
) -> Result<Vec<(Timing, Timing)>> {
    let n = models.len();
    progress.stage("timing", ((warmup + reps) * n * 2) as u64);
    let n_fwd = forward_ids.elem_count() as u64;
    let (mut fwd, mut gen_s, mut gen_u) = (
        vec![Vec::new(); n],
        vec![Vec::new(); n],
        vec![Vec::new(); n],
    );
    for round in 0..warmup + reps {
        for (i, m) in models.iter().enumerate() {
            let t = Instant::now();
            m.forward_batch(forward_ids)?;
            let s_fwd = t.elapsed().as_secs_f64();
            let t = Instant::now();
            let produced = generate_all(m, prompts, max_new)?;
            let s_gen = t.elapsed().as_secs_f64();
            if round >= warmup {
                fwd[i].push(s_fwd);
                gen_s[i].push(s_gen);
                gen_u[i].push(produced);
            }
            progress.inc(2);
        }
    }
    progress.done(&format!(
        "timed {n} variants, {reps} interleaved rounds after {warmup} warm-up rounds"
    ));
    Ok(fwd
        .into_iter()
        .zip(gen_s)
        .zip(gen_u)
        .map(|((f, s), u)| {
            let units = vec![n_fwd; f.len()];
            (
                Timing::from_samples(warmup, f, units),
                Timing::from_samples(warmup, s, u),
            )
        })
        .collect())
}

/// The paired comparisons asked for, `(a, b, question)`, over the variants both name
/// (questions naming a missing variant are left out).
pub(crate) fn paired_rows(
    variants: &[Variant],
    questions: Vec<(String, String, String)>,
    resamples: usize,
    seed: u64,
) -> Result<Vec<PairedRow>> {
    let mut rows = Vec::new();
    for (a, b, question) in questions {
        let (Some(va), Some(vb)) = (
            variants.iter().find(|v| v.name == a),
            variants.iter().find(|v| v.name == b),
        ) else {
            continue;
        };
        rows.push(PairedRow {
            paired: paired(&va.nll, &vb.nll, resamples, seed)?,
            a,
            b,
            question,
        });
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run's GPTQ rounding is made once a (module, format) pair and gives the bytes of
    /// rounding it alone; another format, or another module, is rounded apart.
    #[test]
    fn gptq_rounding_is_made_once_a_module_and_format() {
        let (rows, cols) = (8, 64);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0)
            .collect();
        let x: Vec<f64> = (0..4 * cols)
            .map(|i| ((i * 13 % 29) as f64 - 14.0) / 7.0)
            .collect();
        let mut gram = vec![0f64; cols * cols];
        for row in x.chunks(cols) {
            for (i, a) in row.iter().enumerate() {
                for (j, b) in row.iter().enumerate() {
                    gram[i * cols + j] += a * b;
                }
            }
        }
        let factor = Arc::new(GptqFactor::new(&gram, cols, 0.01).unwrap());
        let factors = ["a", "b"]
            .into_iter()
            .map(|m| (m.to_string(), Arc::clone(&factor)))
            .collect();
        let gptq = Gptq::new(factors);
        let t = Tensor::from_vec(w.clone(), (rows, cols), &Device::Cpu).unwrap();
        let nf4 = Format::parse("nf4-g32").unwrap();
        let int4 = Format::parse("int4-g32").unwrap();
        let first = gptq.rounded("a", nf4, &t).unwrap();
        let alone = compressme_quant::quantize_gptq(&w, rows, cols, nf4, &factor).unwrap();
        assert_eq!(first.codes(), alone.codes());
        assert_eq!(first.scales(), alone.scales());
        assert!(Arc::ptr_eq(&first, &gptq.rounded("a", nf4, &t).unwrap()));
        assert!(!Arc::ptr_eq(&first, &gptq.rounded("b", nf4, &t).unwrap()));
        assert!(!Arc::ptr_eq(&first, &gptq.rounded("a", int4, &t).unwrap()));
        assert!(gptq.rounded("c", nf4, &t).is_err());
    }
}
