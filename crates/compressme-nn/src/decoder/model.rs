//! The decoder: one forward pass for the three families, a KV cache, greedy generation.

use std::collections::{BTreeMap, BTreeSet};

use candle_core::{DType, Device, Tensor};

use super::config::{Activation, DecoderConfig, Family};
use crate::ops::{LayerNorm, add};
use crate::{Embedding, Error, Hooks, Linear, Model, ModuleMut, ModuleRef, Result};

/// How module weights are laid out in the tensors a decoder is built from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// As the family's Hugging Face checkpoints store them: GPT-2's Conv1D weights are
    /// `[in, out]`.
    Checkpoint,
    /// Every linear weight `[out, in]` (what [`Decoder::tensors`] writes, and what
    /// decoder artifacts hold).
    Linear,
}

#[derive(Debug, Clone)]
enum Norm {
    Rms { weight: Tensor, eps: f64 },
    Layer(LayerNorm),
}

impl Norm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Rms { weight, eps } => crate::ops::rms_norm(x, weight, *eps),
            Self::Layer(l) => l.forward(x),
        }
    }

    fn bytes(&self) -> u64 {
        match self {
            Self::Rms { weight, .. } => (4 * weight.elem_count()) as u64,
            Self::Layer(l) => l.bytes(),
        }
    }

    fn tensors(&self, name: &str, out: &mut Vec<(String, Tensor)>) {
        match self {
            Self::Rms { weight, .. } => out.push((format!("{name}.weight"), weight.clone())),
            Self::Layer(l) => {
                let [w, b] = l.params();
                out.push((format!("{name}.weight"), w.clone()));
                out.push((format!("{name}.bias"), b.clone()));
            }
        }
    }
}

#[derive(Debug, Clone)]
enum Attn {
    Split { q: Linear, k: Linear, v: Linear },
    Fused(Linear),
}

#[derive(Debug, Clone)]
enum Mlp {
    Gated {
        gate: Linear,
        up: Linear,
        down: Linear,
    },
    Plain {
        up: Linear,
        down: Linear,
    },
}

#[derive(Debug, Clone)]
struct Block {
    ln1: Norm,
    ln1_name: String,
    attn: Attn,
    o: Linear,
    ln2: Norm,
    ln2_name: String,
    mlp: Mlp,
}

impl Block {
    fn linears(&self) -> Vec<&Linear> {
        let mut v = match &self.attn {
            Attn::Split { q, k, v } => vec![q, k, v],
            Attn::Fused(l) => vec![l],
        };
        v.push(&self.o);
        match &self.mlp {
            Mlp::Gated { gate, up, down } => v.extend([gate, up, down]),
            Mlp::Plain { up, down } => v.extend([up, down]),
        }
        v
    }

    fn linears_mut(&mut self) -> Vec<&mut Linear> {
        let mut v = match &mut self.attn {
            Attn::Split { q, k, v } => vec![q, k, v],
            Attn::Fused(l) => vec![l],
        };
        v.push(&mut self.o);
        match &mut self.mlp {
            Mlp::Gated { gate, up, down } => v.extend([gate, up, down]),
            Mlp::Plain { up, down } => v.extend([up, down]),
        }
        v
    }
}

/// The token embedding: a table of its own, or the output head's weight (tied).
#[derive(Debug, Clone)]
enum Tokens {
    Table(Embedding),
    Tied(Linear),
}

/// Keys and values of the positions seen so far, per layer (after rotary), for
/// generation one token at a time.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    len: usize,
}

impl KvCache {
    /// Positions held.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is held yet.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A pretrained decoder (Llama, GPT-NeoX or GPT-2) whose linears and embeddings can be
/// re-stored and observed by the checkpoint's module names.
///
/// Tied models hold one module for the token embedding and the output head (a
/// [`Linear`] under the embedding's name, listed among [`Model::output_heads`]): its
/// statistics are those of the head's input, and the output-head floor protects it.
#[derive(Debug, Clone)]
pub struct Decoder {
    cfg: DecoderConfig,
    tokens: Tokens,
    positions: Option<Embedding>,
    blocks: Vec<Block>,
    norm: Norm,
    norm_name: String,
    head: Option<Linear>,
    hooks: Hooks,
    device: Device,
}

/// The checkpoint names of one family, with its optional prefix (`model.`,
/// `gpt_neox.`, `transformer.`; GPT-2 checkpoints exist with and without it).
struct Names {
    family: Family,
    prefix: String,
    /// The output head's module: `lm_head`; Pythia's checkpoints call it `embed_out`
    /// (transformers 5 writes `lm_head` for GPT-NeoX too).
    head: &'static str,
}

impl Names {
    fn tokens(&self) -> String {
        match self.family {
            Family::Llama => format!("{}embed_tokens", self.prefix),
            Family::GptNeox => format!("{}embed_in", self.prefix),
            Family::Gpt2 => format!("{}wte", self.prefix),
        }
    }
    fn block(&self, i: usize) -> String {
        match self.family {
            Family::Llama | Family::GptNeox => format!("{}layers.{i}", self.prefix),
            Family::Gpt2 => format!("{}h.{i}", self.prefix),
        }
    }
    fn final_norm(&self) -> String {
        match self.family {
            Family::Llama => format!("{}norm", self.prefix),
            Family::GptNeox => format!("{}final_layer_norm", self.prefix),
            Family::Gpt2 => format!("{}ln_f", self.prefix),
        }
    }
    fn head(&self) -> &'static str {
        self.head
    }
    /// The names of a block's parts, after `{block}.`.
    fn parts(&self) -> BlockParts {
        match self.family {
            Family::Llama => BlockParts {
                ln1: "input_layernorm",
                qkv: Qkv::Split("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                o: "self_attn.o_proj",
                ln2: "post_attention_layernorm",
                gate: Some("mlp.gate_proj"),
                up_down: ("mlp.up_proj", "mlp.down_proj"),
            },
            Family::GptNeox => BlockParts {
                ln1: "input_layernorm",
                qkv: Qkv::Fused("attention.query_key_value"),
                o: "attention.dense",
                ln2: "post_attention_layernorm",
                gate: None,
                up_down: ("mlp.dense_h_to_4h", "mlp.dense_4h_to_h"),
            },
            Family::Gpt2 => BlockParts {
                ln1: "ln_1",
                qkv: Qkv::Fused("attn.c_attn"),
                o: "attn.c_proj",
                ln2: "ln_2",
                gate: None,
                up_down: ("mlp.c_fc", "mlp.c_proj"),
            },
        }
    }
    /// Buffers some checkpoints carry that the forward pass recomputes.
    fn is_buffer(&self, name: &str) -> bool {
        name.ends_with(".rotary_emb.inv_freq")
            || name.ends_with(".attn.bias")
            || name.ends_with(".attn.masked_bias")
            || name.ends_with(".attention.bias")
            || name.ends_with(".attention.masked_bias")
    }
}

/// The query, key and value projections: three linears, or one (GPT-NeoX's per-head
/// `[q | k | v]`, GPT-2's `[q; k; v]`).
enum Qkv {
    Split(&'static str, &'static str, &'static str),
    Fused(&'static str),
}

/// A block's module names, after the block's prefix.
struct BlockParts {
    ln1: &'static str,
    qkv: Qkv,
    o: &'static str,
    ln2: &'static str,
    /// The gate of a gated MLP (SwiGLU).
    gate: Option<&'static str>,
    up_down: (&'static str, &'static str),
}

/// Where a decoder's tensors come from: a name to a tensor, every name checked off as it
/// is used so that leftovers can be named.
pub trait TensorSource {
    /// The names it holds.
    fn names(&self) -> Vec<String>;
    /// The tensor called `name` (f32 on the CPU is fine), if present.
    ///
    /// # Errors
    /// A read error.
    fn tensor(&mut self, name: &str) -> Result<Option<Tensor>>;
    /// What to call the source in errors (a file).
    fn describe(&self) -> String;
}

impl TensorSource for BTreeMap<String, Tensor> {
    fn names(&self) -> Vec<String> {
        self.keys().cloned().collect()
    }
    fn tensor(&mut self, name: &str) -> Result<Option<Tensor>> {
        Ok(self.get(name).cloned())
    }
    fn describe(&self) -> String {
        "tensors".into()
    }
}

struct Taker<'a> {
    src: &'a mut dyn TensorSource,
    used: BTreeSet<String>,
    device: Device,
}

impl Taker<'_> {
    fn take(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let t = self.src.tensor(name)?.ok_or_else(|| Error::MissingTensor {
            path: self.src.describe().into(),
            name: name.to_string(),
        })?;
        if !t.dtype().is_float() {
            return Err(Error::TensorDtype {
                path: self.src.describe().into(),
                name: name.to_string(),
                got: format!("{:?}", t.dtype()),
            });
        }
        if t.dims() != shape {
            return Err(Error::TensorShape {
                path: self.src.describe().into(),
                name: name.to_string(),
                expected: shape.to_vec(),
                got: t.dims().to_vec(),
            });
        }
        self.used.insert(name.to_string());
        Ok(t.to_dtype(DType::F32)?.to_device(&self.device)?)
    }

    /// `[out, in]` weight, from `[in, out]` when `transposed`.
    fn weight(&mut self, name: &str, out: usize, inp: usize, transposed: bool) -> Result<Tensor> {
        if transposed {
            Ok(self.take(name, &[inp, out])?.t()?.contiguous()?)
        } else {
            self.take(name, &[out, inp])
        }
    }

    fn linear(
        &mut self,
        name: &str,
        (out, inp): (usize, usize),
        bias: bool,
        transposed: bool,
        hooks: &Hooks,
    ) -> Result<Linear> {
        let w = self.weight(&format!("{name}.weight"), out, inp, transposed)?;
        let b = if bias {
            Some(self.take(&format!("{name}.bias"), &[out])?)
        } else {
            None
        };
        Linear::new(name, w, b, hooks.clone())
    }

    fn norm(&mut self, name: &str, cfg: &DecoderConfig) -> Result<Norm> {
        let w = self.take(&format!("{name}.weight"), &[cfg.hidden])?;
        Ok(match cfg.family {
            Family::Llama => Norm::Rms {
                weight: w,
                eps: cfg.norm_eps,
            },
            Family::GptNeox | Family::Gpt2 => Norm::Layer(LayerNorm::new(
                w,
                self.take(&format!("{name}.bias"), &[cfg.hidden])?,
                cfg.norm_eps,
            )),
        })
    }
}

impl Decoder {
    /// Builds the model from `src`, checking every tensor's shape against `cfg`: a
    /// missing, misshapen or non-float tensor is named, and so is every tensor the model
    /// has no place for (recomputed buffers such as `rotary_emb.inv_freq` and GPT-2's
    /// `attn.bias` are skipped; a tied model's `lm_head.weight` copy too).
    ///
    /// # Errors
    /// As above, and a configuration whose sizes do not fit together.
    pub fn from_source(
        cfg: DecoderConfig,
        src: &mut dyn TensorSource,
        layout: Layout,
        device: &Device,
    ) -> Result<Self> {
        cfg.check().map_err(|m| Error::Load {
            path: src.describe().into(),
            message: format!("bad decoder configuration: {m}"),
        })?;
        let all = src.names();
        let prefix = match cfg.family {
            Family::Llama => "model.",
            Family::GptNeox => "gpt_neox.",
            Family::Gpt2 => {
                if all.iter().any(|n| n.starts_with("transformer.")) {
                    "transformer."
                } else {
                    ""
                }
            }
        };
        let head = if cfg.family == Family::GptNeox && all.iter().any(|n| n == "embed_out.weight") {
            "embed_out"
        } else {
            "lm_head"
        };
        let names = Names {
            family: cfg.family,
            prefix: prefix.to_string(),
            head,
        };
        let hooks = Hooks::default();
        let mut t = Taker {
            src,
            used: BTreeSet::new(),
            device: device.clone(),
        };
        let (h, hd) = (cfg.hidden, cfg.head_dim);
        let (qw, kvw) = (cfg.heads * hd, cfg.kv_heads * hd);
        let conv = cfg.family == Family::Gpt2 && layout == Layout::Checkpoint;
        let tok_name = names.tokens();
        let tokens = if cfg.tie_embeddings {
            Tokens::Tied(t.linear(&tok_name, (cfg.vocab, h), false, false, &hooks)?)
        } else {
            Tokens::Table(Embedding::new(
                &tok_name,
                t.take(&format!("{tok_name}.weight"), &[cfg.vocab, h])?,
                hooks.clone(),
            )?)
        };
        let positions = if cfg.family == Family::Gpt2 {
            let name = format!("{prefix}wpe");
            Some(Embedding::new(
                &name,
                t.take(&format!("{name}.weight"), &[cfg.context, h])?,
                hooks.clone(),
            )?)
        } else {
            None
        };
        let parts = names.parts();
        let (ab, mb) = (cfg.attention_bias, cfg.mlp_bias);
        let mut blocks = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            let p = names.block(i);
            let lin = |t: &mut Taker<'_>, suffix: &str, shape, bias| {
                t.linear(&format!("{p}.{suffix}"), shape, bias, conv, &hooks)
            };
            let (ln1_name, ln2_name) = (format!("{p}.{}", parts.ln1), format!("{p}.{}", parts.ln2));
            let ln1 = t.norm(&ln1_name, &cfg)?;
            let attn = match parts.qkv {
                Qkv::Split(q, k, v) => Attn::Split {
                    q: lin(&mut t, q, (qw, h), ab)?,
                    k: lin(&mut t, k, (kvw, h), ab)?,
                    v: lin(&mut t, v, (kvw, h), ab)?,
                },
                Qkv::Fused(qkv) => Attn::Fused(lin(&mut t, qkv, (3 * qw, h), ab)?),
            };
            let o = lin(&mut t, parts.o, (h, qw), ab)?;
            let ln2 = t.norm(&ln2_name, &cfg)?;
            let (i_s, (up, down)) = (cfg.intermediate, parts.up_down);
            let mlp = match parts.gate {
                Some(gate) => Mlp::Gated {
                    gate: lin(&mut t, gate, (i_s, h), mb)?,
                    up: lin(&mut t, up, (i_s, h), mb)?,
                    down: lin(&mut t, down, (h, i_s), mb)?,
                },
                None => Mlp::Plain {
                    up: lin(&mut t, up, (i_s, h), mb)?,
                    down: lin(&mut t, down, (h, i_s), mb)?,
                },
            };
            blocks.push(Block {
                ln1,
                ln1_name,
                attn,
                o,
                ln2,
                ln2_name,
                mlp,
            });
        }
        let norm_name = names.final_norm();
        let norm = t.norm(&norm_name, &cfg)?;
        let head = if cfg.tie_embeddings {
            None
        } else {
            Some(t.linear(names.head(), (cfg.vocab, h), false, false, &hooks)?)
        };
        let extra: Vec<String> = all
            .iter()
            .filter(|n| !t.used.contains(*n) && !names.is_buffer(n))
            .filter(|n| !(cfg.tie_embeddings && n.as_str() == format!("{}.weight", names.head())))
            .cloned()
            .collect();
        if !extra.is_empty() {
            return Err(Error::Load {
                path: t.src.describe().into(),
                message: format!(
                    "{} tensor(s) the {} configuration has no place for: {}",
                    extra.len(),
                    cfg.family.model_type(),
                    extra.iter().take(8).cloned().collect::<Vec<_>>().join(", ")
                ),
            });
        }
        Ok(Self {
            cfg,
            tokens,
            positions,
            blocks,
            norm,
            norm_name,
            head,
            hooks,
            device: device.clone(),
        })
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &DecoderConfig {
        &self.cfg
    }

    /// The device dense tensors live on.
    #[must_use]
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Every parameter under its checkpoint name, f32, module weights `[out, in]`
    /// ([`Layout::Linear`]; dequantized where they are stored packed):
    /// [`Decoder::from_source`] with that layout reads them back.
    ///
    /// # Errors
    /// A lossless block that fails to decode; candle's.
    pub fn tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        let linear = |out: &mut Vec<(String, Tensor)>, l: &Linear| -> Result<()> {
            let w = Tensor::from_vec(l.weight_f32()?, l.shape(), &Device::Cpu)?;
            out.push((format!("{}.weight", l.name()), w));
            if let Some(b) = l.bias() {
                out.push((format!("{}.bias", l.name()), b.clone()));
            }
            Ok(())
        };
        match &self.tokens {
            Tokens::Table(e) => out.push((
                format!("{}.weight", e.name()),
                e.weight()?.to_dtype(DType::F32)?,
            )),
            Tokens::Tied(l) => linear(&mut out, l)?,
        }
        if let Some(p) = &self.positions {
            out.push((
                format!("{}.weight", p.name()),
                p.weight()?.to_dtype(DType::F32)?,
            ));
        }
        for b in &self.blocks {
            b.ln1.tensors(&b.ln1_name, &mut out);
            b.ln2.tensors(&b.ln2_name, &mut out);
            for l in b.linears() {
                linear(&mut out, l)?;
            }
        }
        self.norm.tensors(&self.norm_name, &mut out);
        if let Some(h) = &self.head {
            linear(&mut out, h)?;
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    fn embed(&self, ids: &Tensor, past: usize) -> Result<Tensor> {
        let mut x = match &self.tokens {
            Tokens::Table(e) => e.forward(ids)?.to_dtype(DType::F32)?,
            Tokens::Tied(l) => l.lookup(ids)?.to_device(&self.device)?,
        };
        if let Some(p) = &self.positions {
            let t = ids.dim(1)?;
            let pos = Tensor::arange(past as u32, (past + t) as u32, &self.device)?;
            x = x.broadcast_add(&p.forward(&pos)?.to_dtype(DType::F32)?)?;
        }
        Ok(x)
    }

    /// cos and sin `[t, rotary_dim]` for positions `past..past + t`, as transformers
    /// computes them (inverse frequencies in f32, `cat(freqs, freqs)`).
    fn rope(&self, past: usize, t: usize) -> Result<Option<(Tensor, Tensor)>> {
        let rd = self.cfg.rotary_dim;
        if rd == 0 {
            return Ok(None);
        }
        let inv: Vec<f32> = (0..rd / 2)
            .map(|i| (1.0 / self.cfg.rope_theta.powf((2 * i) as f64 / rd as f64)) as f32)
            .collect();
        let (mut cos, mut sin) = (Vec::with_capacity(t * rd), Vec::with_capacity(t * rd));
        for p in past..past + t {
            let angles: Vec<f32> = inv.iter().map(|&f| p as f32 * f).collect();
            for _ in 0..2 {
                cos.extend(angles.iter().map(|&a| f64::from(a).cos() as f32));
                sin.extend(angles.iter().map(|&a| f64::from(a).sin() as f32));
            }
        }
        Ok(Some((
            Tensor::from_vec(cos, (t, rd), &self.device)?,
            Tensor::from_vec(sin, (t, rd), &self.device)?,
        )))
    }

    fn attention(
        &self,
        b: &Block,
        h: &Tensor,
        rope: Option<&(Tensor, Tensor)>,
        past: usize,
        cache: Option<&mut Option<(Tensor, Tensor)>>,
    ) -> Result<Tensor> {
        let (bsz, t, _) = h.dims3()?;
        let (heads, kvh, hd) = (self.cfg.heads, self.cfg.kv_heads, self.cfg.head_dim);
        let (q, k, v) = match &b.attn {
            Attn::Split { q, k, v } => (q.forward(h)?, k.forward(h)?, v.forward(h)?),
            Attn::Fused(l) => {
                let qkv = l.forward(h)?;
                if self.cfg.family == Family::GptNeox {
                    // per head: [q | k | v]
                    let r = qkv.reshape((bsz, t, heads, 3 * hd))?;
                    let part = |i: usize| -> Result<Tensor> {
                        Ok(r.narrow(3, i * hd, hd)?.reshape((bsz, t, heads * hd))?)
                    };
                    (part(0)?, part(1)?, part(2)?)
                } else {
                    let w = heads * hd;
                    (
                        qkv.narrow(2, 0, w)?,
                        qkv.narrow(2, w, w)?,
                        qkv.narrow(2, 2 * w, w)?,
                    )
                }
            }
        };
        let split = |x: Tensor, n: usize| -> Result<Tensor> {
            Ok(x.reshape((bsz, t, n, hd))?.transpose(1, 2)?.contiguous()?)
        };
        let (mut q, mut k, mut v) = (split(q, heads)?, split(k, kvh)?, split(v, kvh)?);
        if let Some((cos, sin)) = rope {
            q = crate::ops::rotary(&q, cos, sin)?;
            k = crate::ops::rotary(&k, cos, sin)?;
        }
        if let Some(slot) = cache {
            if let Some((pk, pv)) = slot.as_ref() {
                k = Tensor::cat(&[pk, &k], 2)?;
                v = Tensor::cat(&[pv, &v], 2)?;
            }
            *slot = Some((k.clone(), v.clone()));
        }
        // grouped-query attention without repeating keys and values, each block of
        // queries against only the keys it can see
        let scale = 1.0 / (hd as f64).sqrt();
        b.o.forward(&crate::ops::causal_attention(&q, &k, &v, past, scale)?)
    }

    fn mlp(&self, b: &Block, h: &Tensor) -> Result<Tensor> {
        let act = |x: Tensor| -> Result<Tensor> {
            Ok(match self.cfg.activation {
                Activation::Silu => x.silu()?,
                Activation::Gelu => x.gelu_erf()?,
                Activation::GeluTanh => x.gelu()?,
            })
        };
        match &b.mlp {
            Mlp::Gated { gate, up, down } => {
                let (g, u) = (gate.forward(h)?, up.forward(h)?);
                let product = match self.cfg.activation {
                    Activation::Silu => crate::ops::silu_mul(&g, &u)?,
                    _ => (act(g)? * u)?,
                };
                down.forward(&product)
            }
            Mlp::Plain { up, down } => down.forward(&act(up.forward(h)?)?),
        }
    }

    fn run(&self, ids: &Tensor, cache: Option<&mut KvCache>) -> Result<Tensor> {
        self.head_logits(&self.hidden(ids, cache)?)
    }

    /// The final hidden states `[b, t, hidden]` (after the last norm) for `ids`.
    fn hidden(&self, ids: &Tensor, cache: Option<&mut KvCache>) -> Result<Tensor> {
        self.norm.forward(&self.residual(ids, cache)?)
    }

    /// The residual stream `[b, t, hidden]` after the last block, before the final norm.
    fn residual(&self, ids: &Tensor, mut cache: Option<&mut KvCache>) -> Result<Tensor> {
        let (_, t) = ids.dims2()?;
        let past = cache.as_ref().map_or(0, |c| c.len);
        if t == 0 {
            return Err(Error::Shape("no tokens to run".into()));
        }
        if past + t > self.cfg.context {
            return Err(Error::Shape(format!(
                "{} tokens, the context is {}",
                past + t,
                self.cfg.context
            )));
        }
        if let Some(c) = cache.as_deref_mut()
            && c.layers.len() != self.blocks.len()
        {
            c.layers = vec![None; self.blocks.len()];
        }
        let rope = self.rope(past, t)?;
        let mut x = self.embed(ids, past)?;
        for (i, b) in self.blocks.iter().enumerate() {
            let slot = cache.as_deref_mut().and_then(|c| c.layers.get_mut(i));
            x = self.block(b, x, rope.as_ref(), past, slot)?;
        }
        if let Some(c) = cache {
            c.len += t;
        }
        Ok(x)
    }

    /// One block on its input `x` `[b, t, hidden]`: the residual stream after it.
    fn block(
        &self,
        b: &Block,
        x: Tensor,
        rope: Option<&(Tensor, Tensor)>,
        past: usize,
        slot: Option<&mut Option<(Tensor, Tensor)>>,
    ) -> Result<Tensor> {
        let h = b.ln1.forward(&x)?;
        let a = self.attention(b, &h, rope, past, slot)?;
        Ok(if self.cfg.parallel_residual {
            let m = self.mlp(b, &b.ln2.forward(&x)?)?;
            add(&add(&x, &a)?, &m)?
        } else {
            let x = add(&x, &a)?;
            let m = self.mlp(b, &b.ln2.forward(&x)?)?;
            add(&x, &m)?
        })
    }

    /// The input of every block (the residual stream before it, `[1, t, hidden]`) for one
    /// sequence, so that a change to one block's linears can be scored from that block on
    /// ([`Decoder::logit_rows_from`]) without running the blocks before it again.
    ///
    /// # Errors
    /// As [`Decoder::forward`].
    pub fn block_inputs(&self, ids: &[u32]) -> Result<Vec<Tensor>> {
        let t = Tensor::new(ids, &self.device)?.unsqueeze(0)?;
        let n = ids.len();
        if n == 0 || n > self.cfg.context {
            return Err(Error::Shape(format!(
                "{n} tokens, the context is {}",
                self.cfg.context
            )));
        }
        let rope = self.rope(0, n)?;
        let mut x = self.embed(&t, 0)?;
        let mut out = Vec::with_capacity(self.blocks.len());
        for b in &self.blocks {
            out.push(x.clone());
            x = self.block(b, x, rope.as_ref(), 0, None)?;
        }
        Ok(out)
    }

    /// Next-token logits at the positions `rows`, from block `first` on, given that
    /// block's input `x` (from [`Decoder::block_inputs`] of the same sequence): what
    /// [`Decoder::logit_rows_at`] gives when the blocks before `first` are unchanged.
    ///
    /// # Errors
    /// [`Error::Shape`] for a block past the last or rows past the sequence, as
    /// [`Decoder::forward`].
    pub fn logit_rows_from(
        &self,
        first: usize,
        x: &Tensor,
        rows: std::ops::Range<usize>,
    ) -> Result<Vec<Vec<f32>>> {
        if first >= self.blocks.len() {
            return Err(Error::Shape(format!(
                "block {first} of {}",
                self.blocks.len()
            )));
        }
        let n = x.dim(1)?;
        crate::ops::check_rows(&rows, n)?;
        let rope = self.rope(0, n)?;
        let mut x = x.clone();
        for b in self.blocks.iter().skip(first) {
            x = self.block(b, x, rope.as_ref(), 0, None)?;
        }
        self.final_rows(&x.squeeze(0)?, rows)
    }

    /// The final norm and the head on the positions `rows` of the last hidden states
    /// `[t, hidden]` (both work a position at a time, so the other positions need neither).
    /// Fewer than [`HEAD_MIN`] rows take their neighbours along (those before them
    /// first), and drop them after.
    fn final_rows(&self, x: &Tensor, rows: std::ops::Range<usize>) -> Result<Vec<Vec<f32>>> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let lo = rows.start.min(rows.end.saturating_sub(HEAD_MIN));
        let hi = rows.end.max(lo + HEAD_MIN).min(x.dim(0)?);
        let x = x.narrow(0, lo, hi - lo)?;
        let mut out = self.head_rows(&self.norm.forward(&x)?)?;
        out.truncate(rows.end - lo);
        out.drain(..rows.start - lo);
        Ok(out)
    }

    /// The block (layer index) a linear belongs to; `None` for the embeddings and the
    /// output head, and for a name that is not a linear of a block.
    #[must_use]
    pub fn block_of(&self, module: &str) -> Option<usize> {
        self.blocks
            .iter()
            .position(|b| b.linears().iter().any(|l| l.name() == module))
    }

    /// The head on final hidden states `[t, hidden]`, [`HEAD_CHUNK`] positions at a time.
    fn head_rows(&self, x: &Tensor) -> Result<Vec<Vec<f32>>> {
        let n = x.dim(0)?;
        let mut rows = Vec::with_capacity(n);
        let mut c0 = 0;
        while c0 < n {
            let mut len = HEAD_CHUNK.min(n - c0);
            if n - c0 - len < HEAD_MIN {
                // no chunk of fewer than `HEAD_MIN` after this one: this one takes them
                len = n - c0;
            }
            rows.extend(self.head_logits(&x.narrow(0, c0, len)?)?.to_vec2::<f32>()?);
            c0 += len;
        }
        Ok(rows)
    }

    /// The output head on final hidden states `[.., hidden]`.
    fn head_logits(&self, x: &Tensor) -> Result<Tensor> {
        self.head_linear()?.forward(x)
    }

    /// The output head: its own linear, or the token embedding it is tied to.
    fn head_linear(&self) -> Result<&Linear> {
        match (&self.head, &self.tokens) {
            (Some(h), _) => Ok(h),
            (None, Tokens::Tied(l)) => Ok(l),
            (None, Tokens::Table(e)) => Err(Error::BadStorage {
                module: e.name().to_string(),
                reason: "an untied model without an output head".into(),
            }),
        }
    }

    /// Next-token logits `[b, t, vocab]` for token ids `[b, t]` (u32, every row the same
    /// length; `t` at most the context), with a causal mask.
    ///
    /// # Errors
    /// An empty or too long a sequence, ids past the vocabulary, candle's.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        self.run(ids, None)
    }

    /// What [`Decoder::forward`] reports to the observers (every linear's input, the
    /// output head's included), without the output head's product, whose logits
    /// recording activations does not use: a fifth of a small model's products.
    ///
    /// # Errors
    /// As [`Decoder::forward`].
    pub fn observe(&self, ids: &Tensor) -> Result<()> {
        let head = self.head_linear()?;
        head.observe(&self.hidden(ids, None)?)
    }

    /// Logits `[b, t, vocab]` for `ids` `[b, t]` that follow the positions `cache` holds;
    /// their keys and values are appended to it.
    ///
    /// # Errors
    /// As [`Decoder::forward`], and a cache that would grow past the context.
    pub fn forward_cached(&self, ids: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        self.run(ids, Some(cache))
    }

    /// Next-token logits of one sequence, a row per position (the shape evaluation
    /// closures take, see `compressme_eval::score_documents`).
    ///
    /// # Errors
    /// As [`Decoder::forward`].
    ///
    /// The head runs on 64 positions at a time, so the logits are held once,
    /// as the rows returned (a window of 512 tokens over a vocabulary of 49,152 is 100 MB).
    pub fn logit_rows(&self, ids: &[u32]) -> Result<Vec<Vec<f32>>> {
        self.logit_rows_at(ids, 0..ids.len())
    }

    /// The rows `rows` of [`Decoder::logit_rows`]: every position runs through the
    /// blocks (each is context for the next), the final norm and the output head only
    /// the positions asked for. Evaluation with overlapping windows asks for the half of
    /// a window it scores, and the head (a vocabulary wide) is a fifth of a small
    /// model's products.
    ///
    /// # Errors
    /// As [`Decoder::forward`]; rows past the sequence.
    pub fn logit_rows_at(
        &self,
        ids: &[u32],
        rows: std::ops::Range<usize>,
    ) -> Result<Vec<Vec<f32>>> {
        crate::ops::check_rows(&rows, ids.len())?;
        let t = Tensor::new(ids, &self.device)?.unsqueeze(0)?;
        self.final_rows(&self.residual(&t, None)?.squeeze(0)?, rows)
    }

    /// Greedy generation with the KV cache: the prompt is run once, then one token at a
    /// time, until `max_new` tokens were produced, one of `stop` was produced (it is
    /// kept), or the context is full. Returns only the new tokens, so their count is what
    /// was actually produced.
    ///
    /// # Errors
    /// An empty prompt, as [`Decoder::forward`].
    pub fn generate(&self, prompt: &[u32], max_new: usize, stop: &[u32]) -> Result<Vec<u32>> {
        if prompt.is_empty() {
            return Err(Error::Shape("generation needs a prompt".into()));
        }
        let mut cache = KvCache::default();
        let mut out = Vec::new();
        let mut next = prompt.to_vec();
        while out.len() < max_new && cache.len + next.len() <= self.cfg.context {
            let ids = Tensor::new(next.as_slice(), &self.device)?.unsqueeze(0)?;
            // the head runs on the last position only: the others' logits are not used
            let h = self.hidden(&ids, Some(&mut cache))?.squeeze(0)?;
            let last = self
                .head_logits(&h.narrow(0, next.len() - 1, 1)?)?
                .squeeze(0)?
                .argmax(0)?
                .to_scalar::<u32>()?;
            out.push(last);
            if stop.contains(&last) {
                break;
            }
            next = vec![last];
        }
        Ok(out)
    }
}

/// Positions the output head runs on at a time in [`Decoder::logit_rows`].
const HEAD_CHUNK: usize = 64;

/// The fewest positions the output head runs on at a time, where the sequence has as
/// many, so that a row's logits do not depend on how many rows were asked for: products
/// of fewer rows take other paths whose sums run in another order (one or two rows,
/// `gemm`'s small-matrix path for dense f32, `logits_at_some_rows_are_those_rows_of_the_full_forward`;
/// under eight, the packed 8-bit kernels' row-at-a-time path instead of their tiles:
/// the CI report's last window, two targets, moved by 6e-7 with three).
const HEAD_MIN: usize = 8;

impl Model for Decoder {
    fn module_names(&self) -> Vec<String> {
        let mut v = vec![match &self.tokens {
            Tokens::Table(e) => e.name().to_string(),
            Tokens::Tied(l) => l.name().to_string(),
        }];
        if let Some(p) = &self.positions {
            v.push(p.name().to_string());
        }
        for b in &self.blocks {
            v.extend(b.linears().iter().map(|l| l.name().to_string()));
        }
        if let Some(h) = &self.head {
            v.push(h.name().to_string());
        }
        v
    }

    fn module(&self, name: &str) -> Option<ModuleRef<'_>> {
        match &self.tokens {
            Tokens::Table(e) if e.name() == name => return Some(ModuleRef::Embedding(e)),
            Tokens::Tied(l) if l.name() == name => return Some(ModuleRef::Linear(l)),
            _ => {}
        }
        if let Some(p) = self.positions.as_ref().filter(|p| p.name() == name) {
            return Some(ModuleRef::Embedding(p));
        }
        if let Some(h) = self.head.as_ref().filter(|h| h.name() == name) {
            return Some(ModuleRef::Linear(h));
        }
        self.blocks
            .iter()
            .flat_map(Block::linears)
            .find(|l| l.name() == name)
            .map(ModuleRef::Linear)
    }

    fn module_mut(&mut self, name: &str) -> Option<ModuleMut<'_>> {
        match &mut self.tokens {
            Tokens::Table(e) if e.name() == name => return Some(ModuleMut::Embedding(e)),
            Tokens::Tied(l) if l.name() == name => return Some(ModuleMut::Linear(l)),
            _ => {}
        }
        if let Some(p) = self.positions.as_mut().filter(|p| p.name() == name) {
            return Some(ModuleMut::Embedding(p));
        }
        if let Some(h) = self.head.as_mut().filter(|h| h.name() == name) {
            return Some(ModuleMut::Linear(h));
        }
        self.blocks
            .iter_mut()
            .flat_map(Block::linears_mut)
            .find(|l| l.name() == name)
            .map(ModuleMut::Linear)
    }

    fn output_heads(&self) -> Vec<String> {
        match (&self.head, &self.tokens) {
            (Some(h), _) => vec![h.name().to_string()],
            (None, Tokens::Tied(l)) => vec![l.name().to_string()],
            (None, Tokens::Table(_)) => Vec::new(),
        }
    }

    fn hooks(&self) -> &Hooks {
        &self.hooks
    }

    fn other_bytes(&self) -> u64 {
        self.norm.bytes()
            + self
                .blocks
                .iter()
                .map(|b| b.ln1.bytes() + b.ln2.bytes())
                .sum::<u64>()
    }
}
