//! BERT from a Hugging Face folder, and sentence embeddings as sentence-transformers
//! computes them (mean pooling over the attention mask, L2 normalisation).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use serde::Deserialize;

use crate::ops::{LayerNorm, join_heads, softmax_last, split_heads};
use crate::{Embedding, Error, Hooks, Linear, Model, ModuleMut, ModuleRef, Result};

/// The `model_type`s this module loads.
pub const SUPPORTED_MODEL_TYPES: [&str; 1] = ["bert"];

/// The fields of a BERT `config.json` that the forward pass needs.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct BertConfig {
    /// Must be `bert`.
    #[serde(default)]
    pub model_type: String,
    /// Token vocabulary.
    pub vocab_size: usize,
    /// Width.
    pub hidden_size: usize,
    /// Encoder layers.
    pub num_hidden_layers: usize,
    /// Attention heads.
    pub num_attention_heads: usize,
    /// Feed-forward width.
    pub intermediate_size: usize,
    /// `gelu` (exact, erf) or `gelu_new` / `gelu_pytorch_tanh` (tanh approximation).
    #[serde(default = "default_act")]
    pub hidden_act: String,
    /// Positions.
    pub max_position_embeddings: usize,
    /// Token types.
    #[serde(default = "default_types")]
    pub type_vocab_size: usize,
    /// Layer-norm epsilon.
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
}

fn default_act() -> String {
    "gelu".into()
}
fn default_types() -> usize {
    2
}
fn default_eps() -> f64 {
    1e-12
}

#[derive(Debug, Clone)]
struct Layer {
    query: Linear,
    key: Linear,
    value: Linear,
    attn_out: Linear,
    attn_ln: LayerNorm,
    intermediate: Linear,
    output: Linear,
    out_ln: LayerNorm,
}

/// A BERT encoder whose linears and embeddings can be re-stored and observed.
#[derive(Debug, Clone)]
pub struct Bert {
    cfg: BertConfig,
    word: Embedding,
    position: Embedding,
    token_type: Embedding,
    emb_ln: LayerNorm,
    layers: Vec<Layer>,
    hooks: Hooks,
    device: Device,
}

/// A local model folder, refusing remote identifiers.
///
/// # Errors
/// [`Error::Remote`] for something that looks like `org/name` and is not a folder here,
/// [`Error::Load`] for a missing folder.
pub fn local_dir(dir: &Path) -> Result<PathBuf> {
    if dir.is_dir() {
        return Ok(dir.to_path_buf());
    }
    let s = dir.to_string_lossy();
    let remote = s.contains("://")
        || (!dir.exists()
            && s.split('/').count() == 2
            && !s.starts_with('.')
            && !s.starts_with('/'));
    if remote {
        return Err(Error::Remote(s.into_owned()));
    }
    Err(Error::Load {
        path: dir.to_path_buf(),
        message: "no such folder (expected config.json and model.safetensors in it)".into(),
    })
}

/// The checkpoint's tensors, checked as they are taken.
struct Checkpoint {
    path: PathBuf,
    tensors: HashMap<String, Tensor>,
    prefix: &'static str,
    device: Device,
}

impl Checkpoint {
    fn open(path: PathBuf, device: &Device) -> Result<Self> {
        let tensors =
            candle_core::safetensors::load(&path, &Device::Cpu).map_err(|e| Error::Load {
                path: path.clone(),
                message: e.to_string(),
            })?;
        let prefix = if tensors.contains_key("bert.embeddings.word_embeddings.weight") {
            "bert."
        } else {
            ""
        };
        Ok(Self {
            path,
            tensors,
            prefix,
            device: device.clone(),
        })
    }

    fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.get_any(&[name], shape)
    }

    /// The first of `names` present (checkpoints spell LayerNorm parameters two ways).
    fn get_any(&self, names: &[&str], shape: &[usize]) -> Result<Tensor> {
        let found = names.iter().find_map(|n| {
            let full = format!("{}{n}", self.prefix);
            self.tensors.get(&full).map(|t| (full, t))
        });
        let Some((full, t)) = found else {
            return Err(Error::MissingTensor {
                path: self.path.clone(),
                name: format!("{}{}", self.prefix, names.first().copied().unwrap_or("")),
            });
        };
        if !matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16) {
            return Err(Error::TensorDtype {
                path: self.path.clone(),
                name: full,
                got: format!("{:?}", t.dtype()),
            });
        }
        if t.dims() != shape {
            return Err(Error::TensorShape {
                path: self.path.clone(),
                name: full,
                expected: shape.to_vec(),
                got: t.dims().to_vec(),
            });
        }
        Ok(t.to_dtype(DType::F32)?.to_device(&self.device)?)
    }

    fn linear(&self, name: &str, out: usize, inp: usize, hooks: &Hooks) -> Result<Linear> {
        let w = self.get(&format!("{name}.weight"), &[out, inp])?;
        let b = self.get(&format!("{name}.bias"), &[out])?;
        Linear::new(name, w, Some(b), hooks.clone())
    }

    fn layer_norm(&self, name: &str, width: usize, eps: f64) -> Result<LayerNorm> {
        let w = self.get_any(
            &[&format!("{name}.weight"), &format!("{name}.gamma")],
            &[width],
        )?;
        let b = self.get_any(
            &[&format!("{name}.bias"), &format!("{name}.beta")],
            &[width],
        )?;
        Ok(LayerNorm::new(w, b, eps))
    }
}

impl Bert {
    /// Loads `config.json` and `model.safetensors` from a local folder (tensor names with
    /// or without a `bert.` prefix).
    ///
    /// # Errors
    /// Each names the file, and the tensor where there is one: a remote identifier, a
    /// missing or unreadable file, an unsupported `model_type` or activation, a missing
    /// tensor, a wrong shape or dtype.
    pub fn from_dir(dir: &Path, device: &Device) -> Result<Self> {
        let dir = local_dir(dir)?;
        let cfg = read_config(&dir.join("config.json"))?;
        let ckpt = Checkpoint::open(dir.join("model.safetensors"), device)?;
        Self::from_checkpoint(cfg, &ckpt)
    }

    /// Loads BERT from `config.json` in `dir` and every tensor from a compressme artifact
    /// (no original checkpoint needed): the artifact is opened and checked, every tensor
    /// verified, and each module keeps the artifact's storage (packed linears stay packed,
    /// a lossless table stays in its blocks).
    ///
    /// # Errors
    /// As [`Bert::from_dir`], and the artifact's read and verification errors.
    pub fn from_artifact(dir: &Path, artifact: &Path, device: &Device) -> Result<Self> {
        use compressme_artifact::{Artifact, Limits};
        let dir = local_dir(dir)?;
        let cfg = read_config(&dir.join("config.json"))?;
        let mut a = Artifact::open(artifact, &Limits::default())?;
        // module weights stand as zero-stride placeholders until `apply_artifact` gives
        // them the artifact's storage: no weight is ever held dense on the way
        let (named, _) = crate::load::artifact_tensors_with(&mut a, true)?;
        let tensors: HashMap<String, Tensor> = named.into_iter().collect();
        let prefix = if tensors.contains_key("bert.embeddings.word_embeddings.weight") {
            "bert."
        } else {
            ""
        };
        let ckpt = Checkpoint {
            path: artifact.to_path_buf(),
            tensors,
            prefix,
            device: device.clone(),
        };
        let mut bert = Self::from_checkpoint(cfg, &ckpt)?;
        drop(ckpt);
        crate::load::apply_artifact(&mut bert, &mut a)?;
        Ok(bert)
    }

    fn from_checkpoint(cfg: BertConfig, c: &Checkpoint) -> Result<Self> {
        let hooks = Hooks::default();
        let h = cfg.hidden_size;
        let emb = |name: &str, rows: usize| -> Result<Embedding> {
            Embedding::new(
                name,
                c.get(&format!("{name}.weight"), &[rows, h])?,
                hooks.clone(),
            )
        };
        let word = emb("embeddings.word_embeddings", cfg.vocab_size)?;
        let position = emb(
            "embeddings.position_embeddings",
            cfg.max_position_embeddings,
        )?;
        let token_type = emb("embeddings.token_type_embeddings", cfg.type_vocab_size)?;
        let emb_ln = c.layer_norm("embeddings.LayerNorm", h, cfg.layer_norm_eps)?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("encoder.layer.{i}");
            let i_s = cfg.intermediate_size;
            layers.push(Layer {
                query: c.linear(&format!("{p}.attention.self.query"), h, h, &hooks)?,
                key: c.linear(&format!("{p}.attention.self.key"), h, h, &hooks)?,
                value: c.linear(&format!("{p}.attention.self.value"), h, h, &hooks)?,
                attn_out: c.linear(&format!("{p}.attention.output.dense"), h, h, &hooks)?,
                attn_ln: c.layer_norm(
                    &format!("{p}.attention.output.LayerNorm"),
                    h,
                    cfg.layer_norm_eps,
                )?,
                intermediate: c.linear(&format!("{p}.intermediate.dense"), i_s, h, &hooks)?,
                output: c.linear(&format!("{p}.output.dense"), h, i_s, &hooks)?,
                out_ln: c.layer_norm(&format!("{p}.output.LayerNorm"), h, cfg.layer_norm_eps)?,
            });
        }
        Ok(Self {
            cfg,
            word,
            position,
            token_type,
            emb_ln,
            layers,
            hooks,
            device: c.device.clone(),
        })
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &BertConfig {
        &self.cfg
    }

    /// The device the dense tensors live on.
    #[must_use]
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Last hidden states `[b, t, hidden]` for `input_ids` `[b, t]` (u32), optional
    /// `token_type_ids` `[b, t]` (u32, zeros when absent) and `attention_mask` `[b, t]`
    /// (1 for tokens, 0 for padding; any numeric dtype).
    ///
    /// # Errors
    /// Shapes that do not fit, sequences longer than the position table, candle's.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        token_type_ids: Option<&Tensor>,
        attention_mask: &Tensor,
    ) -> Result<Tensor> {
        let (b, t) = input_ids.dims2()?;
        if t > self.cfg.max_position_embeddings {
            return Err(Error::Shape(format!(
                "{t} tokens, the model has {} positions",
                self.cfg.max_position_embeddings
            )));
        }
        let types = match token_type_ids {
            Some(tt) => tt.clone(),
            None => Tensor::zeros((b, t), DType::U32, &self.device)?,
        };
        let positions = Tensor::arange(0u32, t as u32, &self.device)?;
        let x = self
            .word
            .forward(input_ids)?
            .to_dtype(DType::F32)?
            .broadcast_add(&self.position.forward(&positions)?.to_dtype(DType::F32)?)?
            .add(&self.token_type.forward(&types)?.to_dtype(DType::F32)?)?;
        let mut x = self.emb_ln.forward(&x)?;
        // (1 - mask) * f32::MIN, as [b, 1, 1, t]
        let mask = attention_mask.to_dtype(DType::F32)?;
        let bias = ((mask.ones_like()? - &mask)? * f64::from(f32::MIN))?.reshape((b, 1, 1, t))?;
        let heads = self.cfg.num_attention_heads;
        let scale = 1.0 / ((self.cfg.hidden_size / heads) as f64).sqrt();
        for l in &self.layers {
            let q = split_heads(&l.query.forward(&x)?, heads)?;
            let k = split_heads(&l.key.forward(&x)?, heads)?;
            let v = split_heads(&l.value.forward(&x)?, heads)?;
            let scores = (crate::ops::matmul(&q, &k.t()?)? * scale)?.broadcast_add(&bias)?;
            let ctx = join_heads(&crate::ops::matmul(&softmax_last(&scores)?, &v)?)?;
            x = l.attn_ln.forward(&(l.attn_out.forward(&ctx)? + &x)?)?;
            let inter = l.intermediate.forward(&x)?;
            let inter = match self.cfg.hidden_act.as_str() {
                "gelu_new" | "gelu_pytorch_tanh" => inter.gelu()?,
                _ => inter.gelu_erf()?,
            };
            x = l.out_ln.forward(&(l.output.forward(&inter)? + &x)?)?;
        }
        Ok(x)
    }
}

fn read_config(path: &Path) -> Result<BertConfig> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::Load {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Load {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    let model_type = v
        .get("model_type")
        .and_then(|m| m.as_str())
        .unwrap_or("")
        .to_string();
    if !SUPPORTED_MODEL_TYPES.contains(&model_type.as_str()) {
        return Err(Error::UnsupportedModel {
            path: path.to_path_buf(),
            model_type,
            supported: SUPPORTED_MODEL_TYPES.join(", "),
        });
    }
    let cfg: BertConfig = serde_json::from_value(v).map_err(|e| Error::Load {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    if !matches!(
        cfg.hidden_act.as_str(),
        "gelu" | "gelu_new" | "gelu_pytorch_tanh"
    ) {
        return Err(Error::Load {
            path: path.to_path_buf(),
            message: format!(
                "hidden_act `{}` is not supported (gelu, gelu_new, gelu_pytorch_tanh)",
                cfg.hidden_act
            ),
        });
    }
    if cfg.num_attention_heads == 0 || !cfg.hidden_size.is_multiple_of(cfg.num_attention_heads) {
        return Err(Error::Load {
            path: path.to_path_buf(),
            message: format!(
                "hidden_size {} is not a multiple of num_attention_heads {}",
                cfg.hidden_size, cfg.num_attention_heads
            ),
        });
    }
    Ok(cfg)
}

impl Model for Bert {
    fn module_names(&self) -> Vec<String> {
        let mut v = vec![
            self.word.name().to_string(),
            self.position.name().to_string(),
            self.token_type.name().to_string(),
        ];
        for l in &self.layers {
            for m in [
                &l.query,
                &l.key,
                &l.value,
                &l.attn_out,
                &l.intermediate,
                &l.output,
            ] {
                v.push(m.name().to_string());
            }
        }
        v
    }

    fn module(&self, name: &str) -> Option<ModuleRef<'_>> {
        for e in [&self.word, &self.position, &self.token_type] {
            if e.name() == name {
                return Some(ModuleRef::Embedding(e));
            }
        }
        self.layers
            .iter()
            .flat_map(|l| {
                [
                    &l.query,
                    &l.key,
                    &l.value,
                    &l.attn_out,
                    &l.intermediate,
                    &l.output,
                ]
            })
            .find(|m| m.name() == name)
            .map(ModuleRef::Linear)
    }

    fn module_mut(&mut self, name: &str) -> Option<ModuleMut<'_>> {
        for e in [&mut self.word, &mut self.position, &mut self.token_type] {
            if e.name() == name {
                return Some(ModuleMut::Embedding(e));
            }
        }
        self.layers
            .iter_mut()
            .flat_map(|l| {
                [
                    &mut l.query,
                    &mut l.key,
                    &mut l.value,
                    &mut l.attn_out,
                    &mut l.intermediate,
                    &mut l.output,
                ]
            })
            .find(|m| m.name() == name)
            .map(ModuleMut::Linear)
    }

    fn output_heads(&self) -> Vec<String> {
        Vec::new()
    }

    fn hooks(&self) -> &Hooks {
        &self.hooks
    }

    fn other_bytes(&self) -> u64 {
        self.emb_ln.bytes()
            + self
                .layers
                .iter()
                .map(|l| l.attn_ln.bytes() + l.out_ln.bytes())
                .sum::<u64>()
    }
}

/// A BERT encoder with its tokenizer: text in, sentence embeddings out.
#[derive(Debug, Clone)]
pub struct SentenceEmbedder {
    bert: Bert,
    tokenizer: tokenizers::Tokenizer,
    max_len: usize,
    pad_id: u32,
}

impl SentenceEmbedder {
    /// Loads the model and `tokenizer.json` from a local folder; the maximum sequence
    /// length is `max_seq_length` from `sentence_bert_config.json` when present (256 for
    /// all-MiniLM-L6-v2), else the position table's size.
    ///
    /// # Errors
    /// As [`Bert::from_dir`], and a missing or unreadable tokenizer.
    pub fn from_dir(dir: &Path, device: &Device) -> Result<Self> {
        let dir = local_dir(dir)?;
        let bert = Bert::from_dir(&dir, device)?;
        Self::with_bert(&dir, bert)
    }

    /// The tokenizer and settings of folder `dir` around an already loaded encoder (one
    /// from [`Bert::from_artifact`], say).
    ///
    /// # Errors
    /// A missing or unreadable tokenizer.
    pub fn with_bert(dir: &Path, bert: Bert) -> Result<Self> {
        let tok_path = dir.join("tokenizer.json");
        let mut tokenizer =
            tokenizers::Tokenizer::from_file(&tok_path).map_err(|e| Error::Load {
                path: tok_path.clone(),
                message: e.to_string(),
            })?;
        let st_path = dir.join("sentence_bert_config.json");
        let max_len = std::fs::read_to_string(&st_path)
            .ok()
            .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
            .and_then(|v| v.get("max_seq_length").and_then(serde_json::Value::as_u64))
            .map_or(bert.cfg.max_position_embeddings, |n| n as usize)
            .min(bert.cfg.max_position_embeddings);
        let pad_id = tokenizer
            .get_padding()
            .map(|p| p.pad_id)
            .or_else(|| tokenizer.token_to_id("[PAD]"))
            .unwrap_or(0);
        // the file's own padding and truncation (128 for MiniLM) are replaced by ours
        tokenizer.with_padding(None);
        tokenizer
            .with_truncation(Some(tokenizers::TruncationParams {
                max_length: max_len,
                ..Default::default()
            }))
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(Self {
            bert,
            tokenizer,
            max_len,
            pad_id,
        })
    }

    /// The encoder.
    #[must_use]
    pub fn bert(&self) -> &Bert {
        &self.bert
    }

    /// The encoder, mutably (to re-store its modules).
    pub fn bert_mut(&mut self) -> &mut Bert {
        &mut self.bert
    }

    /// Tokens kept a text at most.
    #[must_use]
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Token ids, type ids and attention mask of `texts`, padded to the longest.
    ///
    /// # Errors
    /// The tokenizer's, candle's.
    pub fn tokenize(&self, texts: &[&str]) -> Result<(Tensor, Tensor, Tensor)> {
        let encs = self
            .tokenizer
            .encode_batch(texts.to_vec(), true)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        let t = encs.iter().map(|e| e.get_ids().len()).max().unwrap_or(0);
        let b = encs.len();
        let (mut ids, mut types, mut mask) = (
            vec![self.pad_id; b * t],
            vec![0u32; b * t],
            vec![0u32; b * t],
        );
        for (i, e) in encs.iter().enumerate() {
            for (j, ((&id, &ty), &m)) in e
                .get_ids()
                .iter()
                .zip(e.get_type_ids())
                .zip(e.get_attention_mask())
                .enumerate()
            {
                ids[i * t + j] = id;
                types[i * t + j] = ty;
                mask[i * t + j] = m;
            }
        }
        let dev = &self.bert.device;
        Ok((
            Tensor::from_vec(ids, (b, t), dev)?,
            Tensor::from_vec(types, (b, t), dev)?,
            Tensor::from_vec(mask, (b, t), dev)?,
        ))
    }

    /// Sentence embeddings of `texts` (one batch, padded to the longest): mean of the
    /// last hidden states over the attention mask, L2-normalised.
    ///
    /// # Errors
    /// The tokenizer's, the model's.
    pub fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>> {
        if texts.is_empty() {
            return Ok(Vec::new());
        }
        let (ids, types, mask) = self.tokenize(texts)?;
        let hidden = self.bert.forward(&ids, Some(&types), &mask)?;
        Ok(mean_pool_normalize(&hidden, &mask)?.to_vec2::<f32>()?)
    }
}

/// Mean over the tokens the mask keeps, then L2 normalisation (as sentence-transformers:
/// counts clamped at 1e-9, norms at 1e-12).
///
/// # Errors
/// candle's.
pub fn mean_pool_normalize(hidden: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let m = mask.to_dtype(DType::F32)?.unsqueeze(2)?;
    let summed = hidden.broadcast_mul(&m)?.sum(1)?;
    let counts = m.sum(1)?.clamp(1e-9, f64::MAX)?;
    let mean = summed.broadcast_div(&counts)?;
    let norm = mean.sqr()?.sum_keepdim(1)?.sqrt()?.clamp(1e-12, f64::MAX)?;
    Ok(mean.broadcast_div(&norm)?)
}
