//! Pretrained decoders (Llama, GPT-NeoX, GPT-2) from Hugging Face folders, llama GGUF
//! files and compressme artifacts, with their tokenizers.
//!
//! [`LanguageModel::open`] takes any of the three and returns the [`Decoder`] (whose
//! modules take any storage and report to hooks, as every [`crate::Model`]), its
//! tokenizer, and where it came from. An artifact written from a [`LanguageModel`] (see
//! [`LanguageModel::artifact_metadata`]) carries the configuration and the tokenizer, so
//! it runs with no other file.

mod config;
mod gguf;
mod model;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

pub use config::{Activation, DecoderConfig, Family, SUPPORTED_DECODERS};
pub use gguf::{GgufModel, SUPPORTED_GGUF_ARCHITECTURES, read_gguf};
pub use model::{Decoder, KvCache, Layout, TensorSource};

use crate::{Error, Result};

/// Artifact metadata key: the [`DecoderConfig`] as JSON.
pub const DECODER_CONFIG_KEY: &str = "compressme.decoder_config";
/// Artifact metadata key: the tokenizer as `tokenizer.json` text.
pub const TOKENIZER_KEY: &str = "compressme.tokenizer";
/// Artifact metadata key: the [`Source`] the model was read from, as JSON.
pub const SOURCE_KEY: &str = "compressme.source";

/// The file a model was first read from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Source {
    /// `hf-folder` or `gguf`.
    pub kind: String,
    /// The file's name (the weights file of a folder), without its directories.
    pub file: String,
    /// SHA-256 of that file (of the index JSON for a sharded folder).
    pub sha256: String,
}

/// A decoder with its tokenizer, and where it came from.
#[derive(Debug, Clone)]
pub struct LanguageModel {
    /// The model.
    pub model: Decoder,
    /// The tokenizer (no padding, no truncation).
    pub tokenizer: tokenizers::Tokenizer,
    /// The tokenizer as `tokenizer.json` text.
    pub tokenizer_json: String,
    /// The original file.
    pub source: Source,
    /// How each tensor was stored in a GGUF source (`q4_1`, `q8_0`, `f32`), by name;
    /// empty for other sources: the grid a GGUF model's weights already sit on.
    pub source_types: BTreeMap<String, String>,
}

fn load_err(path: &Path, message: impl Into<String>) -> Error {
    Error::Load {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

fn sha256_file(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).map_err(|e| load_err(path, e.to_string()))?;
    Ok(compressme_artifact::recipe::sha256_hex(&bytes))
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned())
}

/// A checkpoint folder's tensors, read one at a time as the model asks for them.
struct CheckpointSource {
    ckpt: compressme_artifact::Checkpoint,
    path: PathBuf,
}

impl TensorSource for CheckpointSource {
    fn names(&self) -> Vec<String> {
        self.ckpt.entries().map(|e| e.name.clone()).collect()
    }
    fn tensor(&mut self, name: &str) -> Result<Option<Tensor>> {
        let Some(e) = self.ckpt.entries().find(|e| e.name == name).cloned() else {
            return Ok(None);
        };
        let Some(dtype) = crate::load::candle_dtype(e.dtype) else {
            return Err(Error::TensorDtype {
                path: self.path.clone(),
                name: name.to_string(),
                got: e.dtype.name().to_string(),
            });
        };
        let bytes = self.ckpt.read(name)?;
        Ok(Some(Tensor::from_raw_buffer(
            &bytes,
            dtype,
            &e.shape,
            &Device::Cpu,
        )?))
    }
    fn describe(&self) -> String {
        self.path.display().to_string()
    }
}

/// Whether `path` is a GGUF file (by its magic bytes).
#[must_use]
pub fn is_gguf(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    path.is_file()
        && std::fs::File::open(path).is_ok_and(|mut f| f.read_exact(&mut magic).is_ok())
        && &magic == b"GGUF"
}

/// Whether `dir` is a model folder whose `config.json` names a decoder this crate runs.
#[must_use]
pub fn is_decoder_folder(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join("config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| {
            v.get("model_type")
                .and_then(|m| m.as_str())
                .map(str::to_string)
        })
        .is_some_and(|m| SUPPORTED_DECODERS.contains(&m.as_str()))
}

impl LanguageModel {
    /// Opens a decoder: a Hugging Face folder (`config.json`, `model.safetensors` or a
    /// sharded index, `tokenizer.json`), a llama GGUF file, or a compressme artifact
    /// written with [`LanguageModel::artifact_metadata`].
    ///
    /// # Errors
    /// Each names the file: a remote identifier, a missing file, an unsupported family
    /// or setting, a missing, extra or misshapen tensor, a tokenizer that does not fit
    /// the vocabulary, and an artifact's read and verification errors.
    pub fn open(path: &Path, device: &Device) -> Result<Self> {
        if path.is_dir() {
            Self::from_folder(path, device)
        } else if is_gguf(path) {
            Self::from_gguf(path, device)
        } else if path.is_file() {
            Self::from_artifact(path, device)
        } else {
            crate::bert::local_dir(path).map(drop)?;
            Err(load_err(path, "no such file or folder"))
        }
    }

    /// A Hugging Face folder.
    ///
    /// # Errors
    /// As [`LanguageModel::open`].
    pub fn from_folder(dir: &Path, device: &Device) -> Result<Self> {
        let dir = crate::bert::local_dir(dir)?;
        let cfg_path = dir.join("config.json");
        let text =
            std::fs::read_to_string(&cfg_path).map_err(|e| load_err(&cfg_path, e.to_string()))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| load_err(&cfg_path, e.to_string()))?;
        let cfg = DecoderConfig::from_hf_json(&v, &cfg_path.display().to_string())?;
        let ckpt =
            compressme_artifact::Checkpoint::open(&dir, &compressme_artifact::Limits::default())?;
        let weights = [
            dir.join("model.safetensors"),
            dir.join("model.safetensors.index.json"),
        ]
        .into_iter()
        .find(|p| p.exists())
        .unwrap_or_else(|| dir.join("model.safetensors"));
        let mut src = CheckpointSource {
            ckpt,
            path: weights.clone(),
        };
        let model = Decoder::from_source(cfg, &mut src, Layout::Checkpoint, device)?;
        let tok_path = dir.join("tokenizer.json");
        let tokenizer_json =
            std::fs::read_to_string(&tok_path).map_err(|e| load_err(&tok_path, e.to_string()))?;
        let source = Source {
            kind: "hf-folder".into(),
            file: file_name(&weights),
            sha256: sha256_file(&weights)?,
        };
        Self::assemble(model, tokenizer_json, source, BTreeMap::new(), &tok_path)
    }

    /// A llama GGUF file: tensors dequantized to f32 (the reference for every figure on
    /// such a model), names and rotary layout as Hugging Face's.
    ///
    /// # Errors
    /// As [`LanguageModel::open`].
    pub fn from_gguf(path: &Path, device: &Device) -> Result<Self> {
        let mut f = std::fs::File::open(path).map_err(|e| load_err(path, e.to_string()))?;
        let mut g = read_gguf(&mut f, path)?;
        let mut tensors = std::mem::take(&mut g.tensors);
        let model = Decoder::from_source(g.config, &mut tensors, Layout::Linear, device)
            .map_err(|e| load_err(path, e.to_string()))?;
        let source = Source {
            kind: "gguf".into(),
            file: file_name(path),
            sha256: sha256_file(path)?,
        };
        Self::assemble(model, g.tokenizer_json, source, g.file_types, path)
    }

    /// An artifact whose metadata carries the configuration and the tokenizer: every
    /// tensor is read and verified, then each module keeps the artifact's storage
    /// (packed stays packed, lossless stays in its blocks).
    ///
    /// # Errors
    /// As [`LanguageModel::open`].
    pub fn from_artifact(path: &Path, device: &Device) -> Result<Self> {
        use compressme_artifact::{Artifact, Limits};
        let mut a = Artifact::open(path, &Limits::default())?;
        let meta = a.recipe().source_metadata.clone();
        let get = |key: &str| {
            meta.get(key).ok_or_else(|| {
                load_err(
                    path,
                    format!("no `{key}` in the artifact: not packed from a decoder (pack a model folder or a GGUF file)"),
                )
            })
        };
        let cfg: DecoderConfig = serde_json::from_str(get(DECODER_CONFIG_KEY)?)
            .map_err(|e| load_err(path, format!("bad `{DECODER_CONFIG_KEY}`: {e}")))?;
        let source: Source = serde_json::from_str(get(SOURCE_KEY)?)
            .map_err(|e| load_err(path, format!("bad `{SOURCE_KEY}`: {e}")))?;
        let tokenizer_json = get(TOKENIZER_KEY)?.clone();
        // packed and lossless module weights are never expanded: they stand as empty
        // views until the modules take their stored form
        let (tensors, standing) = crate::load::artifact_tensors_with(&mut a, true)?;
        let mut tensors: BTreeMap<String, Tensor> = tensors.into_iter().collect();
        let mut model = Decoder::from_source(cfg, &mut tensors, Layout::Linear, device)
            .map_err(|e| load_err(path, e.to_string()))?;
        drop(tensors);
        use crate::Model;
        if let Some(n) = standing.iter().find(|n| {
            n.strip_suffix(".weight")
                .and_then(|m| model.module(m))
                .is_none()
        }) {
            return Err(load_err(
                path,
                format!("`{n}` is stored packed but is not a module weight of the model"),
            ));
        }
        crate::load::apply_artifact(&mut model, &mut a)?;
        Self::assemble(model, tokenizer_json, source, BTreeMap::new(), path)
    }

    fn assemble(
        model: Decoder,
        tokenizer_json: String,
        source: Source,
        source_types: BTreeMap<String, String>,
        tok_path: &Path,
    ) -> Result<Self> {
        let tokenizer = tokenizer_from_json(&tokenizer_json, model.config().vocab, tok_path)?;
        Ok(Self {
            model,
            tokenizer,
            tokenizer_json,
            source,
            source_types,
        })
    }

    /// Token ids of `text`, without special tokens (one document).
    ///
    /// # Errors
    /// The tokenizer's.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        encode_text(&self.tokenizer, text)
    }

    /// Text of `ids` (special tokens kept).
    ///
    /// # Errors
    /// The tokenizer's.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        decode_ids(&self.tokenizer, ids)
    }

    /// The metadata an artifact of this model carries ([`DECODER_CONFIG_KEY`],
    /// [`TOKENIZER_KEY`], [`SOURCE_KEY`]), so that [`LanguageModel::from_artifact`]
    /// needs nothing else.
    ///
    /// # Errors
    /// Never in practice (JSON serialization).
    pub fn artifact_metadata(&self) -> Result<BTreeMap<String, String>> {
        Ok(BTreeMap::from([
            (
                DECODER_CONFIG_KEY.to_string(),
                to_json(self.model.config())?,
            ),
            (TOKENIZER_KEY.to_string(), self.tokenizer_json.clone()),
            (SOURCE_KEY.to_string(), to_json(&self.source)?),
        ]))
    }
}

impl LanguageModel {
    /// Writes the model as it is stored now (see [`crate::load::write_artifact`]) with
    /// its configuration, tokenizer and source in the metadata:
    /// [`LanguageModel::from_artifact`] reads it back with nothing else.
    ///
    /// # Errors
    /// As [`crate::load::write_artifact`].
    pub fn save(&self, path: &Path) -> Result<compressme_artifact::Summary> {
        crate::load::write_artifact(
            &self.model,
            &self.model.tensors()?,
            self.artifact_metadata()?,
            path,
        )
    }
}

fn to_json<T: Serialize>(v: &T) -> Result<String> {
    serde_json::to_string(v).map_err(|e| Error::Shape(e.to_string()))
}

/// Token ids of `text` under `tokenizer`, without special tokens: what
/// [`LanguageModel::encode`] does.
///
/// # Errors
/// The tokenizer's.
pub fn encode_text(tokenizer: &tokenizers::Tokenizer, text: &str) -> Result<Vec<u32>> {
    Ok(tokenizer
        .encode(text, false)
        .map_err(|e| Error::Tokenizer(e.to_string()))?
        .get_ids()
        .to_vec())
}

/// Text of `ids` under `tokenizer`, special tokens kept: what [`LanguageModel::decode`]
/// does. No ids give the empty text without calling the tokenizer: tokenizers 0.23's
/// byte-level BPE decoder subtracts one from the token count, which overflows (a panic
/// where overflow checks are on) on none (found by the `tokenizer` fuzz target).
///
/// # Errors
/// The tokenizer's.
pub fn decode_ids(tokenizer: &tokenizers::Tokenizer, ids: &[u32]) -> Result<String> {
    if ids.is_empty() {
        return Ok(String::new());
    }
    tokenizer
        .decode(ids, false)
        .map_err(|e| Error::Tokenizer(e.to_string()))
}

/// A tokenizer from `tokenizer.json` text, with padding and truncation off, refused when
/// it has more tokens than the model's vocabulary (a tokenizer of another model).
///
/// # Errors
/// [`Error::Load`] naming `path`.
pub fn tokenizer_from_json(json: &str, vocab: usize, path: &Path) -> Result<tokenizers::Tokenizer> {
    let mut tok: tokenizers::Tokenizer = json
        .parse()
        .map_err(|e| load_err(path, format!("not a tokenizer: {e}")))?;
    tok.with_padding(None);
    tok.with_truncation(None)
        .map_err(|e| Error::Tokenizer(e.to_string()))?;
    let n = tok.get_vocab_size(true);
    let max_id = tok.get_vocab(true).values().copied().max().unwrap_or(0) as usize;
    if n > vocab || max_id >= vocab {
        return Err(load_err(
            path,
            format!(
                "the tokenizer has {n} tokens (largest id {max_id}), the model's vocabulary {vocab}: it belongs to another model"
            ),
        ));
    }
    Ok(tok)
}

/// Logits of the same ids from `a` and `b` differ by at most this much (absolute, over
/// every element): a helper for tests and checks.
///
/// # Errors
/// Shapes that differ; candle's.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    if a.dims() != b.dims() {
        return Err(Error::Shape(format!(
            "{:?} against {:?}",
            a.dims(),
            b.dims()
        )));
    }
    Ok((a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()?)
}
