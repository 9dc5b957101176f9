//! Llama GGUF files as an input: tensors dequantized to f32 under the Hugging Face names
//! (with llama.cpp's rotary permutation of `attn_q` / `attn_k` undone, as transformers
//! does), the configuration from the metadata, and the tokenizer from its vocabulary and
//! merges. Sizes come from the file: operations on them are checked
//! (`arithmetic_side_effects` is denied; candle parses the container itself).
#![deny(clippy::arithmetic_side_effects)]

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Seek};
use std::path::Path;

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::{Device, Tensor};
use serde_json::json;

use super::config::{Activation, DecoderConfig, Family};
use crate::{Error, Result};

/// The GGUF `general.architecture`s this reader maps.
pub const SUPPORTED_GGUF_ARCHITECTURES: [&str; 1] = ["llama"];

/// What a GGUF file holds, in the Hugging Face form.
#[derive(Debug)]
pub struct GgufModel {
    /// The configuration from the metadata.
    pub config: DecoderConfig,
    /// Every tensor, f32, under its Hugging Face name.
    pub tensors: BTreeMap<String, Tensor>,
    /// The tokenizer as `tokenizer.json` text.
    pub tokenizer_json: String,
    /// The storage type of each tensor in the file (`q4_1`, `f32`, ...), by Hugging Face
    /// name: the grid the weights sit on.
    pub file_types: BTreeMap<String, String>,
}

fn load_err(path: &Path, message: String) -> Error {
    Error::Load {
        path: path.to_path_buf(),
        message,
    }
}

/// The Hugging Face name of a llama GGUF tensor, and how many heads its rows were
/// permuted over (`Some(heads)` for `attn_q` / `attn_k`).
fn hf_name(gguf: &str, heads: usize, kv_heads: usize) -> Option<(String, Option<usize>)> {
    let direct = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(n) = direct {
        return Some((n.to_string(), None));
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, tail) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (module, kind) = tail.rsplit_once('.')?;
    let (hf, permute) = match module {
        "attn_norm" => ("input_layernorm", None),
        "ffn_norm" => ("post_attention_layernorm", None),
        "attn_q" => ("self_attn.q_proj", Some(heads)),
        "attn_k" => ("self_attn.k_proj", Some(kv_heads)),
        "attn_v" => ("self_attn.v_proj", None),
        "attn_output" => ("self_attn.o_proj", None),
        "ffn_gate" => ("mlp.gate_proj", None),
        "ffn_up" => ("mlp.up_proj", None),
        "ffn_down" => ("mlp.down_proj", None),
        _ => return None,
    };
    if !matches!(kind, "weight" | "bias") {
        return None;
    }
    // a bias is permuted like the rows it belongs to
    Some((format!("model.layers.{layer}.{hf}.{kind}"), permute))
}

/// Undoes llama.cpp's rotary permutation: its converter reorders the rows of each head
/// from `[half 0 | half 1]` to interleaved pairs; row `h*2d + j*d + i` of the Hugging
/// Face layout is row `h*2d + 2i + j` of the file.
fn unpermute(t: &Tensor, heads: usize) -> Result<Tensor> {
    let rows = t.dim(0)?;
    let Some(d) = heads
        .checked_mul(2)
        .filter(|&hh| hh > 0 && rows.is_multiple_of(hh))
        .and_then(|hh| rows.checked_div(hh))
    else {
        return Err(Error::Shape(format!(
            "{rows} rows cannot be split into {heads} rotary heads"
        )));
    };
    let mut shape = vec![heads, d, 2];
    shape.extend_from_slice(t.dims().get(1..).unwrap_or(&[]));
    let r = t.reshape(shape)?.transpose(1, 2)?.contiguous()?;
    Ok(r.reshape(t.dims())?)
}

struct Meta<'a> {
    md: &'a HashMap<String, Value>,
    path: &'a Path,
    arch: String,
}

impl Meta<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.md.get(key)
    }
    fn arch_key(&self, key: &str) -> String {
        format!("{}.{key}", self.arch)
    }
    fn usize(&self, key: &str) -> Result<usize> {
        let k = self.arch_key(key);
        self.usize_opt(&k)?
            .ok_or_else(|| load_err(self.path, format!("GGUF metadata `{k}` is missing")))
    }
    fn usize_opt(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .to_u64()
                .ok()
                .or_else(|| v.to_u32().ok().map(u64::from))
                .or_else(|| v.to_i32().ok().and_then(|n| u64::try_from(n).ok()))
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| {
                    load_err(self.path, format!("GGUF metadata `{key}` is not a count"))
                }),
        }
    }
    fn f64_opt(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .to_f32()
                .map(f64::from)
                .or_else(|_| v.to_f64())
                .map(Some)
                .map_err(|_| load_err(self.path, format!("GGUF metadata `{key}` is not a number"))),
        }
    }
    fn string(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .to_string()
                .map(|s| Some(s.as_str()))
                .map_err(|_| load_err(self.path, format!("GGUF metadata `{key}` is not a string"))),
        }
    }
    /// An array, each element converted by `f` (`what` names the element type in errors);
    /// empty when the key is absent.
    fn array<T>(&self, key: &str, what: &str, f: impl Fn(&Value) -> Option<T>) -> Result<Vec<T>> {
        let Some(v) = self.get(key) else {
            return Ok(Vec::new());
        };
        let arr = v
            .to_vec()
            .map_err(|_| load_err(self.path, format!("GGUF metadata `{key}` is not an array")))?;
        arr.iter()
            .map(|x| {
                f(x).ok_or_else(|| {
                    load_err(
                        self.path,
                        format!("GGUF metadata `{key}` holds a non-{what}"),
                    )
                })
            })
            .collect()
    }
    fn strings(&self, key: &str) -> Result<Vec<String>> {
        self.array(key, "string", |x| x.to_string().ok().cloned())
    }
    fn ints(&self, key: &str) -> Result<Vec<i64>> {
        self.array(key, "integer", |x| {
            x.to_i32()
                .map(i64::from)
                .or_else(|_| x.to_u32().map(i64::from))
                .or_else(|_| x.to_i64())
                .ok()
        })
    }
}

/// llama.cpp's token type for control tokens (`<|im_start|>`, `<|endoftext|>`).
const TOKEN_TYPE_CONTROL: i64 = 3;
/// llama.cpp's token type for user-defined tokens (matched whole, not special).
const TOKEN_TYPE_USER: i64 = 4;

/// GPT-2's byte-to-character map: printable bytes stand for themselves, the rest map to
/// characters from U+0100 on.
fn byte_alphabet() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut next = 256u32;
    for (b, slot) in out.iter_mut().enumerate() {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let code = if printable {
            b as u32
        } else {
            // at most 256 + 256
            next = next.saturating_add(1);
            next.saturating_sub(1)
        };
        *slot = char::from_u32(code).unwrap_or('\u{FFFD}');
    }
    out
}

/// The `tokenizer.json` transformers builds from a GGUF's `gpt2` vocabulary: byte-level
/// BPE with the file's vocabulary and merges, the GPT-2 pre-tokenizer with no prefix
/// space, and control tokens as special added tokens.
fn tokenizer_json(m: &Meta<'_>) -> Result<String> {
    let model = m.string("tokenizer.ggml.model")?.unwrap_or("");
    if model != "gpt2" {
        return Err(load_err(
            m.path,
            format!(
                "GGUF tokenizer model `{model}` is not supported (only `gpt2`, byte-level BPE)"
            ),
        ));
    }
    let tokens = m.strings("tokenizer.ggml.tokens")?;
    let merges = m.strings("tokenizer.ggml.merges")?;
    let types = m.ints("tokenizer.ggml.token_type")?;
    if tokens.is_empty() || merges.is_empty() {
        return Err(load_err(
            m.path,
            "GGUF tokenizer has no tokens or no merges".into(),
        ));
    }
    let add_prefix = matches!(
        m.get("tokenizer.ggml.add_space_prefix"),
        Some(Value::Bool(true))
    );
    // every real token is spelled in the byte alphabet; one that is not is re-spelled
    // byte by byte, and is never a special token (as transformers reads these files)
    let alphabet = byte_alphabet();
    let spelled = |t: &str| t.chars().all(|c| alphabet.contains(&c));
    let mut vocab = serde_json::Map::new();
    for (i, t) in tokens.iter().enumerate() {
        let key = if spelled(t) {
            t.clone()
        } else {
            t.bytes().map(|b| alphabet[usize::from(b)]).collect()
        };
        vocab.insert(key, json!(i));
    }
    let added: Vec<serde_json::Value> = tokens
        .iter()
        .enumerate()
        .filter_map(|(i, t)| {
            let kind = types.get(i).copied();
            let special = kind == Some(TOKEN_TYPE_CONTROL) && spelled(t);
            (special || kind == Some(TOKEN_TYPE_USER)).then(|| {
                json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                       "rstrip": false, "normalized": false, "special": special})
            })
        })
        .collect();
    let bpe = json!({
        "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
        "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false,
        "ignore_merges": false, "vocab": vocab, "merges": merges,
    });
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": add_prefix,
                            "trim_offsets": true, "use_regex": true});
    let post = json!({"type": "ByteLevel", "add_prefix_space": true,
                      "trim_offsets": false, "use_regex": true});
    let tok = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null, "pre_tokenizer": byte_level, "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                    "use_regex": true},
        "model": bpe,
    });
    serde_json::to_string(&tok).map_err(|e| load_err(m.path, e.to_string()))
}

/// Runs a candle call that panics on some malformed files (a zero `general.alignment`
/// divides by zero; dimensions whose product overflows), turning a panic into an error.
fn guarded<T>(path: &Path, f: impl FnOnce() -> T) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|p| {
        let what = p
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| p.downcast_ref::<&str>().copied())
            .unwrap_or("a panic");
        load_err(
            path,
            format!("malformed GGUF file (candle's reader failed: {what})"),
        )
    })
}

/// Reads a llama GGUF from `reader` (`path` names it in errors).
///
/// # Errors
/// [`Error::Load`] for a file that is not GGUF, an architecture outside
/// [`SUPPORTED_GGUF_ARCHITECTURES`], rope scaling or a rotary width other than the head's,
/// a tokenizer other than byte-level BPE, missing metadata, and a tensor the mapping does
/// not know (named); candle's errors dequantizing.
pub fn read_gguf<R: Read + Seek>(reader: &mut R, path: &Path) -> Result<GgufModel> {
    let content = guarded(path, || Content::read(reader))?
        .map_err(|e| load_err(path, format!("not a readable GGUF file: {e}")))?;
    let arch = match content.metadata.get("general.architecture") {
        Some(Value::String(s)) => s.clone(),
        _ => {
            return Err(load_err(
                path,
                "GGUF metadata `general.architecture` is missing".into(),
            ));
        }
    };
    if !SUPPORTED_GGUF_ARCHITECTURES.contains(&arch.as_str()) {
        return Err(load_err(
            path,
            format!(
                "GGUF architecture `{arch}` is not supported (supported: {})",
                SUPPORTED_GGUF_ARCHITECTURES.join(", ")
            ),
        ));
    }
    let m = Meta {
        md: &content.metadata,
        path,
        arch,
    };
    if let Some(kind) = m.string(&m.arch_key("rope.scaling.type"))?
        && kind != "none"
    {
        return Err(load_err(
            path,
            format!("GGUF rope scaling `{kind}` is not supported"),
        ));
    }
    let hidden = m.usize("embedding_length")?;
    let heads = m.usize("attention.head_count")?;
    let kv_heads = m
        .usize_opt(&m.arch_key("attention.head_count_kv"))?
        .unwrap_or(heads);
    let head_dim = m
        .usize_opt(&m.arch_key("attention.key_length"))?
        .unwrap_or(hidden.checked_div(heads).unwrap_or(0));
    let rotary = m
        .usize_opt(&m.arch_key("rope.dimension_count"))?
        .unwrap_or(head_dim);
    if rotary != head_dim {
        return Err(load_err(
            path,
            format!(
                "GGUF rotary width {rotary} differs from the head width {head_dim}: not supported"
            ),
        ));
    }
    let tokenizer_json = tokenizer_json(&m)?;
    let n_tokens = m.strings("tokenizer.ggml.tokens")?.len();
    let vocab = m.usize_opt(&m.arch_key("vocab_size"))?.unwrap_or(n_tokens);
    let token_id = |key: &str| -> Result<Option<u32>> {
        Ok(m.usize_opt(key)?.and_then(|n| u32::try_from(n).ok()))
    };
    let config = DecoderConfig {
        family: Family::Llama,
        vocab,
        hidden,
        layers: m.usize("block_count")?,
        heads,
        kv_heads,
        head_dim,
        intermediate: m.usize("feed_forward_length")?,
        context: m.usize("context_length")?,
        norm_eps: m
            .f64_opt(&m.arch_key("attention.layer_norm_rms_epsilon"))?
            .unwrap_or(1e-5),
        rope_theta: m
            .f64_opt(&m.arch_key("rope.freq_base"))?
            .unwrap_or(10_000.0),
        rotary_dim: rotary,
        activation: Activation::Silu,
        tie_embeddings: !content.tensor_infos.contains_key("output.weight"),
        attention_bias: content.tensor_infos.contains_key("blk.0.attn_q.bias"),
        mlp_bias: false,
        parallel_residual: false,
        bos_token_id: token_id("tokenizer.ggml.bos_token_id")?,
        eos_token_ids: token_id("tokenizer.ggml.eos_token_id")?
            .into_iter()
            .collect(),
    };
    config
        .check()
        .map_err(|e| load_err(path, format!("GGUF hyperparameters do not fit: {e}")))?;
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let unknown: Vec<&String> = names
        .iter()
        .copied()
        .filter(|n| hf_name(n, heads, kv_heads).is_none())
        .collect();
    if !unknown.is_empty() {
        return Err(load_err(
            path,
            format!(
                "{} GGUF tensor(s) with no Hugging Face name: {}",
                unknown.len(),
                unknown
                    .iter()
                    .take(8)
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ));
    }
    let mut tensors = BTreeMap::new();
    let mut file_types = BTreeMap::new();
    for name in names {
        let Some((hf, permute)) = hf_name(name, heads, kv_heads) else {
            continue;
        };
        let (q, mut t) = guarded(path, || {
            let q = content.tensor(reader, name, &Device::Cpu)?;
            let t = q.dequantize(&Device::Cpu)?;
            Ok::<_, candle_core::Error>((q, t))
        })?
        .map_err(|e| load_err(path, format!("GGUF tensor `{name}`: {e}")))?;
        file_types.insert(hf.clone(), format!("{:?}", q.dtype()).to_lowercase());
        if let Some(h) = permute {
            t = unpermute(&t, h)?;
        }
        tensors.insert(hf, t);
    }
    Ok(GgufModel {
        config,
        tensors,
        tokenizer_json,
        file_types,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_files_are_errors_not_panics() {
        use candle_core::quantized::gguf_file;
        let write = |meta: &[(&str, &Value)]| {
            let mut buf = std::io::Cursor::new(Vec::new());
            gguf_file::write(&mut buf, meta, &[]).unwrap();
            buf.into_inner()
        };
        let p = Path::new("x.gguf");
        // a zero alignment makes candle's reader divide by zero
        let bytes = write(&[("general.alignment", &Value::U32(0))]);
        let e = read_gguf(&mut std::io::Cursor::new(bytes), p).unwrap_err();
        assert!(e.to_string().contains("malformed GGUF"), "{e}");
        // another architecture, and no architecture, are refused by name
        let arch = Value::String("mamba".into());
        let bytes = write(&[("general.architecture", &arch)]);
        let e = read_gguf(&mut std::io::Cursor::new(bytes), p).unwrap_err();
        assert!(e.to_string().contains("`mamba` is not supported"), "{e}");
        let e = read_gguf(&mut std::io::Cursor::new(write(&[])), p).unwrap_err();
        assert!(e.to_string().contains("general.architecture"), "{e}");
        // truncated and empty files
        for bytes in [
            b"GGUF".to_vec(),
            Vec::new(),
            b"GGUF\x03\x00\x00\x00\xff\xff".to_vec(),
        ] {
            assert!(read_gguf(&mut std::io::Cursor::new(bytes), p).is_err());
        }
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permutation() {
        // llama.cpp: w.reshape(heads, 2, d, ...).swapaxes(1, 2).reshape(shape)
        let (heads, d, cols) = (3usize, 4usize, 2usize);
        let rows = heads * 2 * d;
        let hf: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
        let hf_t = Tensor::from_vec(hf.clone(), (rows, cols), &Device::Cpu).unwrap();
        let permuted = hf_t
            .reshape((heads, 2, d, cols))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
            .reshape((rows, cols))
            .unwrap();
        let back = unpermute(&permuted, heads).unwrap();
        assert_eq!(back.flatten_all().unwrap().to_vec1::<f32>().unwrap(), hf);
        assert!(unpermute(&hf_t, 5).is_err());
    }

    #[test]
    fn every_llama_gguf_name_maps_and_others_do_not() {
        let cases = [
            ("token_embd.weight", "model.embed_tokens.weight"),
            ("output.weight", "lm_head.weight"),
            ("output_norm.weight", "model.norm.weight"),
            (
                "blk.0.attn_norm.weight",
                "model.layers.0.input_layernorm.weight",
            ),
            (
                "blk.12.ffn_norm.weight",
                "model.layers.12.post_attention_layernorm.weight",
            ),
            (
                "blk.3.attn_q.weight",
                "model.layers.3.self_attn.q_proj.weight",
            ),
            (
                "blk.3.attn_k.weight",
                "model.layers.3.self_attn.k_proj.weight",
            ),
            (
                "blk.3.attn_v.weight",
                "model.layers.3.self_attn.v_proj.weight",
            ),
            (
                "blk.3.attn_output.weight",
                "model.layers.3.self_attn.o_proj.weight",
            ),
            (
                "blk.29.ffn_gate.weight",
                "model.layers.29.mlp.gate_proj.weight",
            ),
            ("blk.29.ffn_up.weight", "model.layers.29.mlp.up_proj.weight"),
            (
                "blk.29.ffn_down.weight",
                "model.layers.29.mlp.down_proj.weight",
            ),
        ];
        for (g, h) in cases {
            assert_eq!(hf_name(g, 9, 3).map(|x| x.0).as_deref(), Some(h), "{g}");
        }
        assert_eq!(
            hf_name("blk.0.attn_q.weight", 9, 3).and_then(|x| x.1),
            Some(9)
        );
        assert_eq!(
            hf_name("blk.0.attn_k.weight", 9, 3).and_then(|x| x.1),
            Some(3)
        );
        for g in [
            "rope_freqs.weight",
            "blk.x.attn_q.weight",
            "blk.0.attn_qkv.weight",
            "blk.0.attn_q.scale",
        ] {
            assert!(hf_name(g, 9, 3).is_none(), "{g}");
        }
    }
}
