//! The shape and settings of a decoder, read from a Hugging Face `config.json` (as
//! checkpoints on the Hub write it, and as transformers 5 writes it) or from GGUF metadata.
//! Settings the forward pass does not implement are refused by name, never run wrongly.
//! Every size here comes from a file: operations on them are checked or saturating
//! (`arithmetic_side_effects` is denied).
#![deny(clippy::arithmetic_side_effects)]

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{Error, Result};

/// The decoder families this crate runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Family {
    /// Llama (and SmolLM): RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.
    Llama,
    /// GPT-NeoX (Pythia): LayerNorm, partial rotary, fused QKV, parallel residual.
    GptNeox,
    /// GPT-2: LayerNorm, learned positions, Conv1D weights stored `[in, out]`.
    Gpt2,
}

impl Family {
    /// The `model_type` of a Hugging Face `config.json`.
    #[must_use]
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::GptNeox => "gpt_neox",
            Self::Gpt2 => "gpt2",
        }
    }
}

/// The `model_type`s [`DecoderConfig::from_hf_json`] reads.
pub const SUPPORTED_DECODERS: [&str; 3] = ["llama", "gpt_neox", "gpt2"];

/// The MLP's activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// `x * sigmoid(x)` (Llama's SwiGLU gate).
    Silu,
    /// Exact GELU (erf).
    Gelu,
    /// GELU's tanh approximation (`gelu_new`, `gelu_pytorch_tanh`).
    GeluTanh,
}

impl Activation {
    fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "silu" | "swish" => Self::Silu,
            "gelu" => Self::Gelu,
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Self::GeluTanh,
            _ => return None,
        })
    }
}

/// Everything the forward pass needs, family-neutral. Serialized into artifacts (the
/// `compressme.decoder_config` metadata key) so a packed model runs with no other file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecoderConfig {
    /// The family (tensor names and block structure).
    pub family: Family,
    /// Token vocabulary (rows of the embedding and the output head).
    pub vocab: usize,
    /// Width.
    pub hidden: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (dividing `heads`; fewer means grouped-query attention).
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Feed-forward width.
    pub intermediate: usize,
    /// Longest sequence (positions).
    pub context: usize,
    /// Normalisation epsilon.
    pub norm_eps: f64,
    /// Rotary base (unused by GPT-2).
    pub rope_theta: f64,
    /// Leading dimensions of each head that rotate (0 for GPT-2; `head_dim` for Llama).
    pub rotary_dim: usize,
    /// The MLP's activation.
    pub activation: Activation,
    /// The output head is the token embedding.
    pub tie_embeddings: bool,
    /// Biases on the attention projections.
    pub attention_bias: bool,
    /// Biases on the MLP projections.
    pub mlp_bias: bool,
    /// Attention and MLP read the same input and add to the residual together (GPT-NeoX).
    pub parallel_residual: bool,
    /// Beginning-of-sequence token, if the model has one.
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    /// End-of-sequence tokens (generation stops at any).
    #[serde(default)]
    pub eos_token_ids: Vec<u32>,
}

fn bad(path: &str, message: String) -> Error {
    Error::Load {
        path: path.into(),
        message,
    }
}

/// Reads config values by name, naming the file and key in every error.
struct Fields<'a> {
    v: &'a Value,
    path: &'a str,
}

impl Fields<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.v.get(key).filter(|v| !v.is_null())
    }
    fn usize_opt(&self, keys: &[&str]) -> Result<Option<usize>> {
        for k in keys {
            if let Some(v) = self.get(k) {
                return v
                    .as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .map(Some)
                    .ok_or_else(|| bad(self.path, format!("`{k}` is {v}, not a count")));
            }
        }
        Ok(None)
    }
    fn usize(&self, keys: &[&str]) -> Result<usize> {
        self.usize_opt(keys)?.ok_or_else(|| {
            bad(
                self.path,
                format!("`{}` is missing", keys.first().copied().unwrap_or("")),
            )
        })
    }
    fn f64_opt(&self, keys: &[&str]) -> Result<Option<f64>> {
        for k in keys {
            if let Some(v) = self.get(k) {
                return v
                    .as_f64()
                    .map(Some)
                    .ok_or_else(|| bad(self.path, format!("`{k}` is {v}, not a number")));
            }
        }
        Ok(None)
    }
    fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| bad(self.path, format!("`{key}` is {v}, not true or false"))),
        }
    }
    fn str_or<'s>(&'s self, key: &str, default: &'s str) -> Result<&'s str> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_str()
                .ok_or_else(|| bad(self.path, format!("`{key}` is {v}, not a string"))),
        }
    }
    fn token_ids(&self, key: &str) -> Result<Vec<u32>> {
        let to_id = |v: &Value| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| bad(self.path, format!("`{key}` holds {v}, not a token id")))
        };
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(a)) => a.iter().map(to_id).collect(),
            Some(v) => Ok(vec![to_id(v)?]),
        }
    }
}

/// The rotary settings, from top-level keys or a transformers 5 `rope_parameters`
/// object; a scaling type other than the default is refused by name.
fn rope(f: &Fields<'_>, theta_keys: &[&str], partial_keys: &[&str]) -> Result<(f64, f64)> {
    let mut theta = f.f64_opt(theta_keys)?;
    let mut partial = f.f64_opt(partial_keys)?;
    for key in ["rope_scaling", "rope_parameters"] {
        let Some(obj) = f.get(key) else { continue };
        let Some(map) = obj.as_object() else {
            return Err(bad(f.path, format!("`{key}` is {obj}, not an object")));
        };
        let kind = map
            .get("rope_type")
            .or_else(|| map.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        if kind != "default" {
            return Err(bad(
                f.path,
                format!(
                    "`{key}` asks for rope type `{kind}`, which is not supported (only the default rotary embedding is)"
                ),
            ));
        }
        let inner = Fields {
            v: obj,
            path: f.path,
        };
        if let Some(t) = inner.f64_opt(&["rope_theta"])? {
            theta = Some(t);
        }
        if let Some(p) = inner.f64_opt(&["partial_rotary_factor"])? {
            partial = Some(p);
        }
    }
    Ok((theta.unwrap_or(10_000.0), partial.unwrap_or(1.0)))
}

impl DecoderConfig {
    /// Reads a Hugging Face `config.json` (already parsed); `path` names the file in errors.
    ///
    /// # Errors
    /// [`Error::UnsupportedModel`] for a `model_type` outside [`SUPPORTED_DECODERS`];
    /// [`Error::Load`] naming the key for a missing or malformed value, an unsupported
    /// activation, rope scaling, sliding window or attention scaling, and sizes that do
    /// not fit together.
    pub fn from_hf_json(v: &Value, path: &str) -> Result<Self> {
        let f = Fields { v, path };
        let model_type = f.str_or("model_type", "")?;
        let cfg = match model_type {
            "llama" => Self::llama(&f)?,
            "gpt_neox" => Self::neox(&f)?,
            "gpt2" => Self::gpt2(&f)?,
            other => {
                return Err(Error::UnsupportedModel {
                    path: path.into(),
                    model_type: other.to_string(),
                    supported: SUPPORTED_DECODERS.join(", "),
                });
            }
        };
        cfg.check().map_err(|m| bad(path, m))?;
        Ok(cfg)
    }

    fn activation(
        f: &Fields<'_>,
        key: &str,
        default: &str,
        allowed: &[Activation],
    ) -> Result<Activation> {
        let name = f.str_or(key, default)?;
        Activation::parse(name)
            .filter(|a| allowed.contains(a))
            .ok_or_else(|| {
                bad(
                    f.path,
                    format!("`{key}` `{name}` is not supported for this family"),
                )
            })
    }

    fn llama(f: &Fields<'_>) -> Result<Self> {
        for key in ["sliding_window", "pretraining_tp"] {
            if let Some(v) = f.get(key)
                && !(key == "pretraining_tp" && v.as_u64() == Some(1))
            {
                return Err(bad(f.path, format!("`{key}` = {v} is not supported")));
            }
        }
        let hidden = f.usize(&["hidden_size"])?;
        let heads = f.usize(&["num_attention_heads"])?;
        let kv_heads = f.usize_opt(&["num_key_value_heads"])?.unwrap_or(heads);
        let head_dim = f
            .usize_opt(&["head_dim"])?
            .unwrap_or(hidden.checked_div(heads).unwrap_or(0));
        let (rope_theta, partial) = rope(f, &["rope_theta"], &["partial_rotary_factor"])?;
        Ok(Self {
            family: Family::Llama,
            vocab: f.usize(&["vocab_size"])?,
            hidden,
            layers: f.usize(&["num_hidden_layers"])?,
            heads,
            kv_heads,
            head_dim,
            intermediate: f.usize(&["intermediate_size"])?,
            context: f.usize(&["max_position_embeddings"])?,
            norm_eps: f.f64_opt(&["rms_norm_eps"])?.unwrap_or(1e-6),
            rope_theta,
            rotary_dim: (head_dim as f64 * partial) as usize,
            activation: Self::activation(f, "hidden_act", "silu", &[Activation::Silu])?,
            tie_embeddings: f.bool_or("tie_word_embeddings", false)?,
            attention_bias: f.bool_or("attention_bias", false)?,
            mlp_bias: f.bool_or("mlp_bias", false)?,
            parallel_residual: false,
            bos_token_id: f.token_ids("bos_token_id")?.first().copied(),
            eos_token_ids: f.token_ids("eos_token_id")?,
        })
    }

    fn neox(f: &Fields<'_>) -> Result<Self> {
        let hidden = f.usize(&["hidden_size"])?;
        let heads = f.usize(&["num_attention_heads"])?;
        let head_dim = hidden.checked_div(heads).unwrap_or(0);
        let (rope_theta, partial) = rope(
            f,
            &["rotary_emb_base", "rope_theta"],
            &["rotary_pct", "partial_rotary_factor"],
        )?;
        Ok(Self {
            family: Family::GptNeox,
            vocab: f.usize(&["vocab_size"])?,
            hidden,
            layers: f.usize(&["num_hidden_layers"])?,
            heads,
            kv_heads: heads,
            head_dim,
            intermediate: f.usize(&["intermediate_size"])?,
            context: f.usize(&["max_position_embeddings"])?,
            norm_eps: f.f64_opt(&["layer_norm_eps"])?.unwrap_or(1e-5),
            rope_theta,
            rotary_dim: (head_dim as f64 * partial) as usize,
            activation: Self::activation(
                f,
                "hidden_act",
                "gelu",
                &[Activation::Gelu, Activation::GeluTanh],
            )?,
            tie_embeddings: f.bool_or("tie_word_embeddings", false)?,
            attention_bias: f.bool_or("attention_bias", true)?,
            mlp_bias: true,
            parallel_residual: f.bool_or("use_parallel_residual", true)?,
            bos_token_id: f.token_ids("bos_token_id")?.first().copied(),
            eos_token_ids: f.token_ids("eos_token_id")?,
        })
    }

    fn gpt2(f: &Fields<'_>) -> Result<Self> {
        for key in ["scale_attn_by_inverse_layer_idx", "add_cross_attention"] {
            if f.bool_or(key, false)? {
                return Err(bad(f.path, format!("`{key}` = true is not supported")));
            }
        }
        if !f.bool_or("scale_attn_weights", true)? {
            return Err(bad(
                f.path,
                "`scale_attn_weights` = false is not supported".into(),
            ));
        }
        let hidden = f.usize(&["n_embd", "hidden_size"])?;
        let heads = f.usize(&["n_head", "num_attention_heads"])?;
        Ok(Self {
            family: Family::Gpt2,
            vocab: f.usize(&["vocab_size"])?,
            hidden,
            layers: f.usize(&["n_layer", "num_hidden_layers"])?,
            heads,
            kv_heads: heads,
            head_dim: hidden.checked_div(heads).unwrap_or(0),
            intermediate: f
                .usize_opt(&["n_inner"])?
                .unwrap_or(hidden.saturating_mul(4)),
            context: f.usize(&["n_positions", "n_ctx", "max_position_embeddings"])?,
            norm_eps: f.f64_opt(&["layer_norm_epsilon"])?.unwrap_or(1e-5),
            rope_theta: 0.0,
            rotary_dim: 0,
            activation: Self::activation(
                f,
                "activation_function",
                "gelu_new",
                &[Activation::Gelu, Activation::GeluTanh],
            )?,
            tie_embeddings: f.bool_or("tie_word_embeddings", true)?,
            attention_bias: true,
            mlp_bias: true,
            parallel_residual: false,
            bos_token_id: f.token_ids("bos_token_id")?.first().copied(),
            eos_token_ids: f.token_ids("eos_token_id")?,
        })
    }

    /// Checks that the sizes fit together; the message says what does not.
    ///
    /// # Errors
    /// A zero size, heads that do not divide, a rotary width that is odd or wider than a
    /// head, a GPT-2 that is not tied.
    pub fn check(&self) -> std::result::Result<(), String> {
        let sizes = [
            ("vocab", self.vocab),
            ("hidden", self.hidden),
            ("layers", self.layers),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("intermediate", self.intermediate),
            ("context", self.context),
        ];
        if let Some((name, _)) = sizes.iter().find(|(_, v)| *v == 0) {
            return Err(format!("{name} is 0"));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(format!(
                "{} key/value heads do not divide {} query heads",
                self.kv_heads, self.heads
            ));
        }
        if self.family != Family::Llama
            && self.heads.checked_mul(self.head_dim) != Some(self.hidden)
        {
            return Err(format!(
                "hidden size {} is not a multiple of {} heads",
                self.hidden, self.heads
            ));
        }
        if self.rotary_dim > self.head_dim || self.rotary_dim % 2 == 1 {
            return Err(format!(
                "rotary width {} does not fit heads of {} (it must be even and at most the head width)",
                self.rotary_dim, self.head_dim
            ));
        }
        if self.family != Family::Gpt2 && self.rotary_dim == 0 {
            return Err("rotary width is 0".into());
        }
        if self.family == Family::Gpt2 && !self.tie_embeddings {
            return Err("a GPT-2 with an untied output head is not supported".into());
        }
        if !(self.norm_eps.is_finite() && self.norm_eps >= 0.0 && self.rope_theta.is_finite()) {
            return Err(format!(
                "norm epsilon {} or rotary base {} is not a finite non-negative number",
                self.norm_eps, self.rope_theta
            ));
        }
        Ok(())
    }

    /// Module weights (linears and embeddings) a forward pass reads, in elements.
    #[must_use]
    pub fn weights(&self) -> u64 {
        let (h, i, q, kv) = (
            self.hidden as u64,
            self.intermediate as u64,
            (self.heads as u64).saturating_mul(self.head_dim as u64),
            (self.kv_heads as u64).saturating_mul(self.head_dim as u64),
        );
        // saturating: a configuration this large is refused by the weights it lacks
        let mul = u64::saturating_mul;
        let mlp = mul(if self.family == Family::Llama { 3 } else { 2 }, mul(h, i));
        let block = [mul(h, q), mul(2, mul(h, kv)), mul(q, h), mlp]
            .into_iter()
            .fold(0, u64::saturating_add);
        let head = if self.tie_embeddings {
            0
        } else {
            mul(self.vocab as u64, h)
        };
        let pos = if self.family == Family::Gpt2 {
            mul(self.context as u64, h)
        } else {
            0
        };
        [
            mul(self.vocab as u64, h),
            pos,
            mul(self.layers as u64, block),
            head,
        ]
        .into_iter()
        .fold(0, u64::saturating_add)
    }
}
