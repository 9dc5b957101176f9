//! A small causal transformer defined here, trainable with candle autograd and AdamW,
//! deterministic under a seed; and the synthetic cyclic-symbol task it learns.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor, Var, backprop::GradStore};
use compressme_quant::synthetic::Rng;
use serde::{Deserialize, Serialize};

use crate::ops::{LayerNorm, join_heads, log_softmax_last, softmax_last, split_heads};
use crate::{Embedding, Error, Hooks, Linear, Model, ModuleMut, ModuleRef, Result};

/// Shape of a [`CausalLm`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CausalConfig {
    /// Token vocabulary.
    pub vocab: usize,
    /// Width.
    pub width: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Attention heads (dividing `width`).
    pub heads: usize,
    /// Longest sequence.
    pub context: usize,
}

/// The artifact metadata key under which [`CausalLm::tensors`]' writers record the
/// configuration (JSON), so that [`CausalLm::from_artifact`] needs nothing else.
pub const CONFIG_KEY: &str = "compressme.causal_config";

impl CausalConfig {
    fn check(&self) -> Result<()> {
        if self.vocab == 0
            || self.width == 0
            || self.context == 0
            || self.heads == 0
            || !self.width.is_multiple_of(self.heads)
        {
            return Err(Error::Shape(format!(
                "bad causal config {self:?}: every size must be positive and heads must divide width"
            )));
        }
        Ok(())
    }
}

#[derive(Debug, Clone)]
struct Block {
    ln1: LayerNorm,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    ln2: LayerNorm,
    up: Linear,
    down: Linear,
}

impl Block {
    fn linears(&self) -> [&Linear; 6] {
        [&self.q, &self.k, &self.v, &self.o, &self.up, &self.down]
    }
    fn linears_mut(&mut self) -> [&mut Linear; 6] {
        [
            &mut self.q,
            &mut self.k,
            &mut self.v,
            &mut self.o,
            &mut self.up,
            &mut self.down,
        ]
    }
}

/// A pre-norm GPT-style decoder: token and position embeddings, blocks of causal
/// self-attention and a GELU MLP (4x width), a final norm and an untied `lm_head`.
///
/// Module names: `tok_embeddings`, `layers.{i}.attn.{q,k,v,o}`, `layers.{i}.mlp.{up,down}`,
/// `lm_head`.
#[derive(Debug, Clone)]
pub struct CausalLm {
    cfg: CausalConfig,
    tok: Embedding,
    pos: Tensor,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    head: Linear,
    hooks: Hooks,
    vars: Vec<Var>,
}

struct Init<'a> {
    rng: Rng,
    dev: &'a Device,
    vars: Vec<Var>,
}

impl Init<'_> {
    fn normal(&mut self, shape: (usize, usize), std: f64) -> Result<Tensor> {
        let v: Vec<f32> = (0..shape.0 * shape.1)
            .map(|_| (self.rng.normal() * std) as f32)
            .collect();
        self.var(Tensor::from_vec(v, shape, self.dev)?)
    }
    fn constant(&mut self, n: usize, value: f32) -> Result<Tensor> {
        self.var(Tensor::from_vec(vec![value; n], n, self.dev)?)
    }
    fn var(&mut self, t: Tensor) -> Result<Tensor> {
        let v = Var::from_tensor(&t)?;
        let out = v.as_tensor().clone();
        self.vars.push(v);
        Ok(out)
    }
    fn linear(&mut self, name: &str, out: usize, inp: usize, hooks: &Hooks) -> Result<Linear> {
        let w = self.normal((out, inp), 1.0 / (inp as f64).sqrt())?;
        let b = self.constant(out, 0.0)?;
        Linear::new(name, w, Some(b), hooks.clone())
    }
    fn norm(&mut self, width: usize) -> Result<LayerNorm> {
        Ok(LayerNorm::new(
            self.constant(width, 1.0)?,
            self.constant(width, 0.0)?,
            1e-5,
        ))
    }
}

impl CausalLm {
    /// A freshly initialised model: the same `seed` gives the same weights.
    ///
    /// # Errors
    /// [`Error::Shape`] for a bad configuration.
    pub fn new(cfg: CausalConfig, seed: u64, device: &Device) -> Result<Self> {
        cfg.check()?;
        let hooks = Hooks::default();
        let mut init = Init {
            rng: Rng::new(seed),
            dev: device,
            vars: Vec::new(),
        };
        let w = cfg.width;
        let tok = Embedding::new(
            "tok_embeddings",
            init.normal((cfg.vocab, w), 0.5)?,
            hooks.clone(),
        )?;
        let pos = init.normal((cfg.context, w), 0.1)?;
        let mut blocks = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            let p = format!("layers.{i}");
            blocks.push(Block {
                ln1: init.norm(w)?,
                q: init.linear(&format!("{p}.attn.q"), w, w, &hooks)?,
                k: init.linear(&format!("{p}.attn.k"), w, w, &hooks)?,
                v: init.linear(&format!("{p}.attn.v"), w, w, &hooks)?,
                o: init.linear(&format!("{p}.attn.o"), w, w, &hooks)?,
                ln2: init.norm(w)?,
                up: init.linear(&format!("{p}.mlp.up"), 4 * w, w, &hooks)?,
                down: init.linear(&format!("{p}.mlp.down"), w, 4 * w, &hooks)?,
            });
        }
        let ln_f = init.norm(w)?;
        let head = init.linear("lm_head", cfg.vocab, w, &hooks)?;
        Ok(Self {
            cfg,
            tok,
            pos,
            blocks,
            ln_f,
            head,
            hooks,
            vars: init.vars,
        })
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> CausalConfig {
        self.cfg
    }

    /// Every parameter by name, f32 (module weights dequantized if they are stored
    /// packed): `tok_embeddings.weight`, `pos_embeddings`, `layers.{i}.ln{1,2}.{weight,bias}`,
    /// `layers.{i}.attn.{q,k,v,o}.{weight,bias}`, `layers.{i}.mlp.{up,down}.{weight,bias}`,
    /// `ln_f.{weight,bias}`, `lm_head.{weight,bias}`. [`CausalLm::from_tensors`] reads them
    /// back.
    ///
    /// # Errors
    /// A lossless block that fails to decode; candle's.
    pub fn tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = vec![
            (
                "tok_embeddings.weight".to_string(),
                self.tok.weight()?.to_dtype(DType::F32)?,
            ),
            ("pos_embeddings".to_string(), self.pos.detach()),
        ];
        let linear = |out: &mut Vec<(String, Tensor)>, l: &Linear| -> Result<()> {
            let (r, c) = l.shape();
            let w = Tensor::from_vec(l.weight_f32()?, (r, c), self.pos.device())?;
            out.push((format!("{}.weight", l.name()), w));
            if let Some(b) = l.bias() {
                out.push((format!("{}.bias", l.name()), b.detach()));
            }
            Ok(())
        };
        let norm = |out: &mut Vec<(String, Tensor)>, name: String, n: &LayerNorm| {
            let [w, b] = n.params();
            out.push((format!("{name}.weight"), w.detach()));
            out.push((format!("{name}.bias"), b.detach()));
        };
        for (i, b) in self.blocks.iter().enumerate() {
            norm(&mut out, format!("layers.{i}.ln1"), &b.ln1);
            norm(&mut out, format!("layers.{i}.ln2"), &b.ln2);
            for l in b.linears() {
                linear(&mut out, l)?;
            }
        }
        norm(&mut out, "ln_f".into(), &self.ln_f);
        linear(&mut out, &self.head)?;
        Ok(out)
    }

    /// A model from the tensors [`CausalLm::tensors`] names, each checked for shape; the
    /// weights are dense and trainable. Extra tensors are an error too (a checkpoint of
    /// another shape should not load half-way).
    ///
    /// # Errors
    /// [`Error::Shape`] for a bad configuration, a missing, extra or misshapen tensor.
    pub fn from_tensors(
        cfg: CausalConfig,
        tensors: &HashMap<String, Tensor>,
        device: &Device,
    ) -> Result<Self> {
        cfg.check()?;
        let mut used = std::collections::HashSet::new();
        let mut vars = Vec::new();
        let mut get = |name: &str, shape: &[usize]| -> Result<Tensor> {
            let t = tensors
                .get(name)
                .ok_or_else(|| Error::Shape(format!("causal checkpoint: `{name}` is missing")))?;
            if t.dims() != shape {
                return Err(Error::Shape(format!(
                    "causal checkpoint: `{name}` is {:?}, the configuration needs {shape:?}",
                    t.dims()
                )));
            }
            used.insert(name.to_string());
            let v = Var::from_tensor(&t.to_dtype(DType::F32)?.to_device(device)?)?;
            let out = v.as_tensor().clone();
            vars.push(v);
            Ok(out)
        };
        let hooks = Hooks::default();
        let w = cfg.width;
        let tok = Embedding::new(
            "tok_embeddings",
            get("tok_embeddings.weight", &[cfg.vocab, w])?,
            hooks.clone(),
        )?;
        let pos = get("pos_embeddings", &[cfg.context, w])?;
        let mut linear = |name: String, out: usize, inp: usize| -> Result<Linear> {
            let weight = get(&format!("{name}.weight"), &[out, inp])?;
            let bias = get(&format!("{name}.bias"), &[out])?;
            Linear::new(&name, weight, Some(bias), hooks.clone())
        };
        let mut linears = Vec::new();
        for i in 0..cfg.layers {
            let p = format!("layers.{i}");
            for (n, o, inp) in [
                ("attn.q", w, w),
                ("attn.k", w, w),
                ("attn.v", w, w),
                ("attn.o", w, w),
                ("mlp.up", 4 * w, w),
                ("mlp.down", w, 4 * w),
            ] {
                linears.push(linear(format!("{p}.{n}"), o, inp)?);
            }
        }
        let head = linear("lm_head".into(), cfg.vocab, w)?;
        let mut norm = |name: String| -> Result<LayerNorm> {
            Ok(LayerNorm::new(
                get(&format!("{name}.weight"), &[w])?,
                get(&format!("{name}.bias"), &[w])?,
                1e-5,
            ))
        };
        let mut norms = Vec::new();
        for i in 0..cfg.layers {
            norms.push((
                norm(format!("layers.{i}.ln1"))?,
                norm(format!("layers.{i}.ln2"))?,
            ));
        }
        let ln_f = norm("ln_f".into())?;
        if used.len() != tensors.len() {
            let mut extra: Vec<&String> = tensors.keys().filter(|k| !used.contains(*k)).collect();
            extra.sort();
            return Err(Error::Shape(format!(
                "causal checkpoint: tensors the configuration has no place for: {extra:?}"
            )));
        }
        let mut it = linears.into_iter();
        let mut blocks = Vec::with_capacity(cfg.layers);
        for (ln1, ln2) in norms {
            let mut next = || {
                it.next()
                    .ok_or_else(|| Error::Shape("causal checkpoint: too few linears".into()))
            };
            blocks.push(Block {
                ln1,
                q: next()?,
                k: next()?,
                v: next()?,
                o: next()?,
                ln2,
                up: next()?,
                down: next()?,
            });
        }
        Ok(Self {
            cfg,
            tok,
            pos,
            blocks,
            ln_f,
            head,
            hooks,
            vars,
        })
    }

    /// A model from an artifact written from [`CausalLm::tensors`] with the configuration
    /// under [`CONFIG_KEY`] in its source metadata: every tensor is read and verified,
    /// then each module takes its weight in the artifact's storage (packed stays packed,
    /// see [`crate::load::apply_artifact`]).
    ///
    /// # Errors
    /// No or a bad configuration in the artifact, a missing or misshapen tensor, and any
    /// read or verification error.
    pub fn from_artifact(path: &Path, device: &Device) -> Result<Self> {
        use compressme_artifact::{Artifact, Limits};
        let mut a = Artifact::open(path, &Limits::default())?;
        let cfg: CausalConfig = a
            .recipe()
            .source_metadata
            .get(CONFIG_KEY)
            .ok_or_else(|| {
                Error::Shape(format!(
                    "{} has no `{CONFIG_KEY}`: not a causal-model artifact",
                    path.display()
                ))
            })
            .and_then(|j| {
                serde_json::from_str(j).map_err(|e| {
                    Error::Shape(format!("{}: bad `{CONFIG_KEY}`: {e}", path.display()))
                })
            })?;
        let tensors: HashMap<String, Tensor> =
            crate::load::artifact_tensors(&mut a)?.into_iter().collect();
        let mut model = Self::from_tensors(cfg, &tensors, device)?;
        drop(tensors);
        crate::load::apply_artifact(&mut model, &mut a)?;
        Ok(model)
    }

    /// Greedy generation: appends the most likely next token to `prompt` until
    /// `max_new` tokens were produced, `stop` was produced (it is kept), or the context is
    /// full. Returns only the new tokens, so their count is what was actually produced.
    ///
    /// # Errors
    /// An empty prompt, as [`CausalLm::forward`].
    pub fn generate(&self, prompt: &[u32], max_new: usize, stop: Option<u32>) -> Result<Vec<u32>> {
        if prompt.is_empty() {
            return Err(Error::Shape("generation needs a prompt".into()));
        }
        let mut seq = prompt.to_vec();
        let mut out = Vec::new();
        while out.len() < max_new && seq.len() < self.cfg.context {
            let ids = Tensor::new(seq.as_slice(), self.pos.device())?.unsqueeze(0)?;
            let logits = self.forward(&ids)?.squeeze(0)?;
            let last = logits.get(seq.len() - 1)?.argmax(0)?.to_scalar::<u32>()?;
            seq.push(last);
            out.push(last);
            if Some(last) == stop {
                break;
            }
        }
        Ok(out)
    }

    /// The trainable parameters (dense weights as first built; a re-stored module's new
    /// weights are not among them).
    #[must_use]
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// Next-token logits `[b, t, vocab]` for token ids `[b, t]` (u32, `t <= context`).
    ///
    /// # Errors
    /// Too long a sequence, ids past the vocabulary, candle's.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let (_, t) = ids.dims2()?;
        if t > self.cfg.context {
            return Err(Error::Shape(format!(
                "{t} tokens, the context is {}",
                self.cfg.context
            )));
        }
        let dev = self.pos.device();
        let mut x = self
            .tok
            .forward(ids)?
            .to_dtype(DType::F32)?
            .broadcast_add(&self.pos.narrow(0, 0, t)?)?;
        let mask: Vec<f32> = (0..t * t)
            .map(|i| if i % t > i / t { -1e9 } else { 0.0 })
            .collect();
        let mask = Tensor::from_vec(mask, (t, t), dev)?;
        let heads = self.cfg.heads;
        let scale = 1.0 / ((self.cfg.width / heads) as f64).sqrt();
        for b in &self.blocks {
            let h = b.ln1.forward(&x)?;
            let q = split_heads(&b.q.forward(&h)?, heads)?;
            let k = split_heads(&b.k.forward(&h)?, heads)?;
            let v = split_heads(&b.v.forward(&h)?, heads)?;
            let scores =
                (crate::ops::matmul(&q, &k.t()?.contiguous()?)? * scale)?.broadcast_add(&mask)?;
            let ctx = join_heads(&crate::ops::matmul(&softmax_last(&scores)?, &v)?)?;
            x = (x + b.o.forward(&ctx)?)?;
            let h = b.ln2.forward(&x)?;
            x = (x + b.down.forward(&b.up.forward(&h)?.gelu_erf()?)?)?;
        }
        self.head.forward(&self.ln_f.forward(&x)?)
    }

    /// Next-token logits of one sequence, a row per position (the shape evaluation
    /// closures take, see `compressme_eval::score_documents`).
    ///
    /// # Errors
    /// As [`CausalLm::forward`].
    pub fn logit_rows(&self, ids: &[u32]) -> Result<Vec<Vec<f32>>> {
        self.logit_rows_at(ids, 0..ids.len())
    }

    /// The rows `rows` of [`CausalLm::logit_rows`] (what evaluation asks for: the
    /// positions a window scores). The model is small: the forward pass runs whole.
    ///
    /// # Errors
    /// As [`CausalLm::forward`]; rows past the sequence.
    pub fn logit_rows_at(
        &self,
        ids: &[u32],
        rows: std::ops::Range<usize>,
    ) -> Result<Vec<Vec<f32>>> {
        crate::ops::check_rows(&rows, ids.len())?;
        let t = Tensor::new(ids, self.pos.device())?.unsqueeze(0)?;
        let logits = self.forward(&t)?.squeeze(0)?;
        Ok(logits.narrow(0, rows.start, rows.len())?.to_vec2::<f32>()?)
    }

    /// Per-token negative log-likelihood `[b, t]` of `targets` (u32) under `forward(ids)`.
    ///
    /// # Errors
    /// As [`CausalLm::forward`], targets of another shape.
    pub fn token_nll(&self, ids: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let logp = log_softmax_last(&self.forward(ids)?)?;
        Ok(logp.gather(&targets.unsqueeze(2)?, 2)?.squeeze(2)?.neg()?)
    }

    /// Mean negative log-likelihood of `targets`: the training loss.
    ///
    /// # Errors
    /// As [`CausalLm::token_nll`].
    pub fn loss(&self, ids: &Tensor, targets: &Tensor) -> Result<Tensor> {
        Ok(self.token_nll(ids, targets)?.mean_all()?)
    }
}

impl Model for CausalLm {
    fn module_names(&self) -> Vec<String> {
        let mut v = vec![self.tok.name().to_string()];
        for b in &self.blocks {
            v.extend(b.linears().iter().map(|l| l.name().to_string()));
        }
        v.push(self.head.name().to_string());
        v
    }

    fn module(&self, name: &str) -> Option<ModuleRef<'_>> {
        if self.tok.name() == name {
            return Some(ModuleRef::Embedding(&self.tok));
        }
        if self.head.name() == name {
            return Some(ModuleRef::Linear(&self.head));
        }
        self.blocks
            .iter()
            .flat_map(Block::linears)
            .find(|l| l.name() == name)
            .map(ModuleRef::Linear)
    }

    fn module_mut(&mut self, name: &str) -> Option<ModuleMut<'_>> {
        if self.tok.name() == name {
            return Some(ModuleMut::Embedding(&mut self.tok));
        }
        if self.head.name() == name {
            return Some(ModuleMut::Linear(&mut self.head));
        }
        self.blocks
            .iter_mut()
            .flat_map(Block::linears_mut)
            .find(|l| l.name() == name)
            .map(ModuleMut::Linear)
    }

    fn output_heads(&self) -> Vec<String> {
        vec![self.head.name().to_string()]
    }

    fn hooks(&self) -> &Hooks {
        &self.hooks
    }

    fn other_bytes(&self) -> u64 {
        (4 * self.pos.elem_count()) as u64
            + self.ln_f.bytes()
            + self
                .blocks
                .iter()
                .map(|b| b.ln1.bytes() + b.ln2.bytes())
                .sum::<u64>()
    }
}

/// AdamW (decoupled weight decay), as in Loshchilov and Hutter.
#[derive(Debug, Clone)]
pub struct AdamW {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Added to the root of the second moment.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    step: i32,
    moments: Vec<(Tensor, Tensor)>,
}

impl AdamW {
    /// Moments at zero for `vars`.
    ///
    /// # Errors
    /// candle's.
    pub fn new(vars: &[Var], lr: f64, weight_decay: f64) -> Result<Self> {
        let moments = vars
            .iter()
            .map(|v| Ok((v.zeros_like()?, v.zeros_like()?)))
            .collect::<Result<_>>()?;
        Ok(Self {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay,
            step: 0,
            moments,
        })
    }

    /// One update of `vars` (the same, in the same order, as at construction) from `grads`;
    /// a variable without a gradient is left alone.
    ///
    /// # Errors
    /// candle's.
    pub fn step(&mut self, vars: &[Var], grads: &GradStore) -> Result<()> {
        self.step += 1;
        let c1 = 1.0 - self.beta1.powi(self.step);
        let c2 = 1.0 - self.beta2.powi(self.step);
        for (v, (m, s)) in vars.iter().zip(self.moments.iter_mut()) {
            let Some(g) = grads.get(v.as_tensor()) else {
                continue;
            };
            *m = ((&*m * self.beta1)? + (g * (1.0 - self.beta1))?)?;
            *s = ((&*s * self.beta2)? + (g.sqr()? * (1.0 - self.beta2))?)?;
            let update = ((&*m / c1)? / ((&*s / c2)?.sqrt()? + self.eps)?)?;
            let decayed = (v.as_tensor() * (1.0 - self.lr * self.weight_decay))?;
            v.set(&(decayed - (update * self.lr)?)?)?;
        }
        Ok(())
    }
}

/// The synthetic cyclic-symbol task: each sequence counts through the vocabulary with its
/// own start and stride (`x[i + 1] = (x[i] + stride) mod vocab`, stride in `1..=max_stride`),
/// so the next token follows from the last two. Returns `(ids, targets)`, each
/// `[batch, len]` u32, targets shifted by one.
///
/// # Errors
/// candle's.
pub fn cyclic_batch(
    rng: &mut Rng,
    batch: usize,
    len: usize,
    vocab: usize,
    max_stride: usize,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let (mut ids, mut targets) = (
        Vec::with_capacity(batch * len),
        Vec::with_capacity(batch * len),
    );
    let vocab = vocab.max(1) as u64;
    for _ in 0..batch {
        let start = rng.next_u64() % vocab;
        let stride = 1 + rng.next_u64() % (max_stride.max(1) as u64);
        let seq: Vec<u32> = (0..=len as u64)
            .map(|i| ((start + i * stride) % vocab) as u32)
            .collect();
        ids.extend_from_slice(&seq[..len]);
        targets.extend_from_slice(&seq[1..]);
    }
    Ok((
        Tensor::from_vec(ids, (batch, len), device)?,
        Tensor::from_vec(targets, (batch, len), device)?,
    ))
}
