//! Pretrained decoders: Llama (grouped-query, and tied with attention biases), GPT-NeoX
//! (partial rotary, parallel residual) and GPT-2 (Conv1D) from the tiny random folders and
//! transformers' outputs committed under `fixtures/decoders/` (made by its
//! `make_golden.py`); every storage kind, artifacts, the KV cache, and refusals.

use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use compressme_nn::decoder::{DecoderConfig, KvCache, LanguageModel, max_abs_diff};
use compressme_nn::{Model, ModuleKind, PackOptions, Storage};
use compressme_quant::Format;
use serde_json::Value;

pub(crate) const FAMILIES: [&str; 4] = ["llama-gqa", "llama-tied", "neox", "gpt2"];

pub(crate) fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/decoders")
        .join(name)
}

fn golden(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("golden.json")).unwrap())
        .unwrap()
}

fn ids_tensor(g: &Value) -> Tensor {
    let ids: Vec<Vec<u32>> = serde_json::from_value(g["ids"].clone()).unwrap();
    let (b, t) = (ids.len(), ids[0].len());
    Tensor::from_vec(ids.concat(), (b, t), &Device::Cpu).unwrap()
}

fn golden_logits(g: &Value) -> Tensor {
    let v: Vec<f32> = serde_json::from_value(g["logits"].clone()).unwrap();
    let shape: Vec<usize> = serde_json::from_value(g["shape"].clone()).unwrap();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn open(name: &str) -> LanguageModel {
    LanguageModel::open(&fixture(name), &Device::Cpu).unwrap()
}

/// One test's folder under the system's temporary folder: removed when the test passes,
/// kept when it fails (for a look).
struct Scratch(PathBuf);

impl Scratch {
    fn new(test: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("cm-decoders-{}-{test}", std::process::id()));
        drop(std::fs::remove_dir_all(&dir));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            drop(std::fs::remove_dir_all(&self.0));
        }
    }
}

#[test]
fn every_family_matches_transformers_logits_within_1e_4() {
    for name in FAMILIES {
        let lm = open(name);
        let g = golden(name);
        let got = lm.model.forward(&ids_tensor(&g)).unwrap();
        let err = max_abs_diff(&got, &golden_logits(&g)).unwrap();
        assert!(err < 1e-4, "{name}: max |ours - transformers| = {err}");
        eprintln!("{name}: max |ours - transformers| = {err:.2e}");
    }
}

#[test]
fn greedy_generation_with_the_cache_matches_transformers() {
    for name in FAMILIES {
        let lm = open(name);
        let g = golden(name);
        let prompt: Vec<u32> = serde_json::from_value(g["prompt"].clone()).unwrap();
        let want: Vec<u32> = serde_json::from_value(g["greedy"].clone()).unwrap();
        let got = lm.model.generate(&prompt, want.len(), &[]).unwrap();
        assert_eq!(got, want, "{name}");
    }
}

#[test]
fn kv_cache_logits_equal_the_full_forward() {
    for name in FAMILIES {
        let lm = open(name);
        let ids: Vec<u32> = (0..20u32).map(|i| (i * 37 + 5) % 128).collect();
        let full = lm
            .model
            .forward(
                &Tensor::new(ids.as_slice(), &Device::Cpu)
                    .unwrap()
                    .unsqueeze(0)
                    .unwrap(),
            )
            .unwrap();
        // a prefix of 7, then one token at a time, then the last 3 together
        let mut cache = KvCache::default();
        let mut parts = Vec::new();
        let steps: Vec<(usize, usize)> = std::iter::once((0, 7))
            .chain((7..17).map(|i| (i, i + 1)))
            .chain(std::iter::once((17, 20)))
            .collect();
        for (a, b) in steps {
            let t = Tensor::new(&ids[a..b], &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            parts.push(lm.model.forward_cached(&t, &mut cache).unwrap());
        }
        assert_eq!(cache.len(), 20);
        let cached = Tensor::cat(&parts, 1).unwrap();
        let err = max_abs_diff(&full, &cached).unwrap();
        assert!(err < 1e-5, "{name}: cached against full differ by {err}");
        // a cache that would pass the context is refused
        let long = vec![1u32; 64 - 20 + 1];
        let t = Tensor::new(long.as_slice(), &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let e = lm.model.forward_cached(&t, &mut cache).unwrap_err();
        assert!(e.to_string().contains("context"), "{e}");
    }
}

#[test]
fn logits_from_a_block_input_are_the_full_forwards() {
    for name in FAMILIES {
        let mut lm = open(name);
        let ids: Vec<u32> = (0..20u32).map(|i| (i * 37 + 5) % 128).collect();
        let inputs = lm.model.block_inputs(&ids).unwrap();
        let blocks = inputs.len();
        assert!(blocks > 0, "{name}");
        let full = lm.model.logit_rows(&ids).unwrap();
        for (i, x) in inputs.iter().enumerate() {
            assert_eq!(
                lm.model.logit_rows_from(i, x, 0..20).unwrap(),
                full,
                "{name}: from block {i}"
            );
            assert_eq!(
                lm.model.logit_rows_from(i, x, 9..19).unwrap(),
                full[9..19],
                "{name}: from block {i}, rows 9..19"
            );
        }
        let e = lm
            .model
            .logit_rows_from(blocks, &inputs[0], 0..20)
            .unwrap_err();
        assert!(e.to_string().contains("block"), "{e}");
        let e = lm.model.logit_rows_from(0, &inputs[0], 3..21).unwrap_err();
        assert!(e.to_string().contains("rows 3..21 of 20"), "{e}");
        // a changed linear of block i is seen from block i's cached input, and only
        // there: the inputs up to it do not depend on it
        let last = lm
            .model
            .module_names()
            .into_iter()
            .rfind(|m| lm.model.block_of(m) == Some(blocks - 1))
            .unwrap();
        assert_eq!(lm.model.block_of("no.such.module"), None);
        lm.model
            .set_storage(&[(last.clone(), Storage::Quant(Format::Int8))])
            .unwrap();
        let changed = lm.model.logit_rows(&ids).unwrap();
        assert_ne!(changed, full, "{name}: {last} at int8 changes the logits");
        assert_eq!(
            lm.model
                .logit_rows_from(blocks - 1, &inputs[blocks - 1], 0..20)
                .unwrap(),
            changed,
            "{name}: {last}"
        );
    }
}

/// The rows an evaluation window asks for are the whole forward's rows, bit for bit:
/// the final norm and the head work a position at a time, so running them on some
/// positions only changes nothing else (in chunks of the head and across them).
#[test]
fn logits_at_some_rows_are_those_rows_of_the_full_forward() {
    for name in FAMILIES {
        let lm = open(name);
        let ids: Vec<u32> = (0..60u32).map(|i| (i * 37 + 5) % 128).collect();
        let full = lm.model.logit_rows(&ids).unwrap();
        for rows in [0..59, 29..59, 10..12, 59..60, 0..1, 1..2, 7..7] {
            assert_eq!(
                lm.model.logit_rows_at(&ids, rows.clone()).unwrap(),
                full[rows.clone()],
                "{name}: rows {rows:?}"
            );
        }
        for bad in [3..61, 61..61] {
            let e = lm.model.logit_rows_at(&ids, bad).unwrap_err();
            assert!(e.to_string().contains("of 60 positions"), "{e}");
        }
    }
}

#[test]
fn batched_forward_is_the_rows_one_at_a_time() {
    let lm = open("llama-gqa");
    let g = golden("llama-gqa");
    let ids = ids_tensor(&g);
    let both = lm.model.forward(&ids).unwrap();
    for b in 0..2 {
        let one = lm.model.forward(&ids.narrow(0, b, 1).unwrap()).unwrap();
        let err = max_abs_diff(&one, &both.narrow(0, b, 1).unwrap()).unwrap();
        assert!(err < 1e-5, "row {b}: {err}");
    }
}

#[test]
fn module_names_are_the_checkpoints_and_tied_heads_are_protected() {
    let lm = open("llama-tied");
    let names = lm.model.module_names();
    assert_eq!(names[0], "model.embed_tokens");
    assert!(names.contains(&"model.layers.1.self_attn.k_proj".to_string()));
    assert!(!names.iter().any(|n| n == "lm_head"));
    assert_eq!(
        lm.model.output_heads(),
        vec!["model.embed_tokens".to_string()]
    );
    let m = lm.model.modules();
    assert_eq!(
        m[0].kind,
        ModuleKind::Linear,
        "a tied embedding is the head's linear"
    );

    let gpt2 = open("gpt2");
    let names = gpt2.model.module_names();
    assert_eq!(
        &names[..3],
        [
            "transformer.wte",
            "transformer.wpe",
            "transformer.h.0.attn.c_attn"
        ]
    );
    assert_eq!(
        gpt2.model.output_heads(),
        vec!["transformer.wte".to_string()]
    );
    let c_attn = gpt2
        .model
        .modules()
        .into_iter()
        .find(|m| m.name == "transformer.h.0.attn.c_attn")
        .unwrap();
    assert_eq!(
        (c_attn.rows, c_attn.cols),
        (192, 64),
        "Conv1D [in, out] is held as [out, in]"
    );

    let neox = open("neox");
    assert_eq!(
        neox.model.output_heads(),
        vec!["lm_head".to_string()],
        "as transformers 5 writes it"
    );
    assert!(
        neox.model
            .module_names()
            .contains(&"gpt_neox.layers.0.attention.query_key_value".to_string())
    );
}

/// Every module of the model, in one storage or another.
fn storages(lm: &LanguageModel, kind: &str) -> Vec<(String, Storage)> {
    lm.model
        .modules()
        .into_iter()
        .map(|m| {
            let s = match (kind, m.kind) {
                ("int8", ModuleKind::Linear) => Storage::Quant(Format::Int8),
                ("int8", ModuleKind::Embedding) => Storage::Quant(Format::Int8Rows),
                ("nf4-g32", _) => Storage::Quant(Format::parse("nf4-g32").unwrap()),
                ("f16", _) => Storage::Quant(Format::F16),
                ("lossless", _) => Storage::Lossless(PackOptions::default()),
                _ => Storage::Dense,
            };
            (m.name, s)
        })
        .collect()
}

#[test]
fn every_family_through_every_storage_and_back_from_an_artifact() {
    let scratch = Scratch::new("storages");
    for name in FAMILIES {
        let reference = open(name);
        let g = golden(name);
        let ids = ids_tensor(&g);
        let want = reference.model.forward(&ids).unwrap();
        for (kind, budget) in [
            ("lossless", 0.0),
            ("f16", 2e-2),
            ("int8", 0.2),
            ("nf4-g32", 1.5),
        ] {
            let mut lm = reference.clone();
            lm.model.set_storage(&storages(&lm, kind)).unwrap();
            let stored = lm.model.storage_report();
            if kind != "lossless" {
                assert!(
                    stored.stored_bytes() < stored.dense_bytes(),
                    "{name} {kind}: {} of {}",
                    stored.stored_bytes(),
                    stored.dense_bytes()
                );
            }
            let got = lm.model.forward(&ids).unwrap();
            let err = max_abs_diff(&got, &want).unwrap();
            assert!(err <= budget, "{name} {kind}: {err} over {budget}");
            // written as it is stored, read back with no other file: the same logits
            let path = scratch.join(&format!("{name}-{kind}.cma"));
            lm.save(&path).unwrap();
            let back = LanguageModel::open(&path, &Device::Cpu).unwrap();
            assert_eq!(back.model.config(), lm.model.config());
            assert_eq!(back.source, lm.source);
            let back_bytes = back.model.storage_report().stored_bytes();
            if kind == "lossless" {
                // artifacts keep lossless blocks without the per-row lookup index
                assert!(back_bytes <= stored.stored_bytes(), "{name}: {back_bytes}");
            } else {
                assert_eq!(
                    back_bytes,
                    stored.stored_bytes(),
                    "{name} {kind}: packed stays packed"
                );
            }
            let again = back.model.forward(&ids).unwrap();
            assert_eq!(max_abs_diff(&again, &got).unwrap(), 0.0, "{name} {kind}");
            let descr: Vec<String> = back
                .model
                .modules()
                .iter()
                .map(|m| m.storage.clone())
                .collect();
            let orig: Vec<String> = lm
                .model
                .modules()
                .iter()
                .map(|m| m.storage.clone())
                .collect();
            assert_eq!(descr, orig, "{name} {kind}");
            std::fs::remove_file(&path).unwrap();
        }
    }
}

#[test]
fn set_storage_is_all_or_nothing() {
    let mut lm = open("llama-gqa");
    let before = lm.model.storage_report();
    // int8-rows is for embedding tables (the last change): the whole change is refused
    let mut changes = storages(&lm, "int8");
    for (name, s) in &mut changes {
        if name == "model.layers.1.mlp.down_proj" {
            *s = Storage::Quant(Format::Int8Rows);
        }
    }
    assert!(lm.model.set_storage(&changes).is_err());
    assert_eq!(lm.model.storage_report(), before);
}

fn config(text: &str) -> Result<DecoderConfig, String> {
    let v: Value = serde_json::from_str(text).unwrap();
    DecoderConfig::from_hf_json(&v, "config.json").map_err(|e| e.to_string())
}

#[test]
fn configs_read_as_the_hub_and_transformers_5_write_them() {
    let llama_hub = r#"{"model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 100000, "rope_scaling": null, "tie_word_embeddings": true,
        "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}"#;
    let c = config(llama_hub).unwrap();
    assert_eq!(
        (c.heads, c.kv_heads, c.head_dim, c.rotary_dim),
        (9, 3, 64, 64)
    );
    assert_eq!(c.rope_theta, 100000.0);
    assert!(c.tie_embeddings);
    assert_eq!(c.eos_token_ids, vec![2]);
    let llama_v5 = llama_hub.replace(
        r#""rope_theta": 100000, "rope_scaling": null,"#,
        r#""rope_parameters": {"rope_type": "default", "rope_theta": 100000},"#,
    );
    assert_eq!(config(&llama_v5).unwrap(), c);

    let pythia = r#"{"model_type": "gpt_neox", "vocab_size": 50304, "hidden_size": 512,
        "num_hidden_layers": 6, "num_attention_heads": 8, "intermediate_size": 2048,
        "hidden_act": "gelu", "rotary_pct": 0.25, "rotary_emb_base": 10000,
        "max_position_embeddings": 2048, "layer_norm_eps": 1e-5, "use_parallel_residual": true,
        "tie_word_embeddings": false, "eos_token_id": 0}"#;
    let p = config(pythia).unwrap();
    assert_eq!((p.head_dim, p.rotary_dim, p.rope_theta), (64, 16, 10000.0));
    assert!(p.parallel_residual && p.attention_bias && !p.tie_embeddings);
    let pythia_v5 = pythia.replace(
        r#""rotary_pct": 0.25, "rotary_emb_base": 10000,"#,
        r#""rope_parameters": {"rope_type": "default", "rope_theta": 10000, "partial_rotary_factor": 0.25},"#,
    );
    assert_eq!(config(&pythia_v5).unwrap(), p);
}

/// Sizes at the top of their types in a hostile `config.json` are errors or saturated
/// counts, never an overflow (the debug profile panics on one).
#[test]
fn extreme_config_sizes_do_not_overflow() {
    let max = usize::MAX;
    let gpt2 = format!(
        r#"{{"model_type": "gpt2", "vocab_size": {max}, "n_embd": {max}, "n_layer": {max},
        "n_head": 1, "n_positions": {max}}}"#
    );
    let llama = format!(
        r#"{{"model_type": "llama", "vocab_size": {max}, "hidden_size": {max},
        "intermediate_size": {max}, "num_hidden_layers": {max}, "num_attention_heads": {h},
        "head_dim": {h}, "max_position_embeddings": 64}}"#,
        h = 1u64 << 33
    );
    let mut read = 0;
    for text in [gpt2, llama] {
        if let Ok(c) = config(&text) {
            assert_eq!(c.weights(), u64::MAX, "saturated, not wrapped");
            read += 1;
        }
    }
    assert!(read >= 1, "the GPT-2 sizes fit together and are read");
}

#[test]
fn unsupported_settings_are_refused_by_name() {
    let base = r#"{"model_type": "llama", "vocab_size": 128, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "max_position_embeddings": 64 EXTRA}"#;
    let cases = [
        (
            r#", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}"#,
            "llama3",
        ),
        (
            r#", "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}"#,
            "yarn",
        ),
        (r#", "hidden_act": "relu""#, "hidden_act"),
        (r#", "sliding_window": 4096"#, "sliding_window"),
        (r#", "num_key_value_heads": 3"#, "key/value heads"),
        (r#", "hidden_size": "wide""#, "hidden_size"),
    ];
    for (extra, word) in cases {
        let e = config(&base.replace(" EXTRA", extra)).unwrap_err();
        assert!(e.contains(word), "{extra}: {e}");
    }
    assert!(config(&base.replace(" EXTRA", "")).is_ok());
    let e = config(r#"{"model_type": "mamba"}"#).unwrap_err();
    assert!(
        e.contains("mamba") && e.contains("llama, gpt_neox, gpt2"),
        "{e}"
    );
    let e = config(
        &base
            .replace(" EXTRA", "")
            .replace(r#""vocab_size": 128,"#, ""),
    )
    .unwrap_err();
    assert!(e.contains("vocab_size"), "{e}");
    let gpt2 = r#"{"model_type": "gpt2", "vocab_size": 128, "n_embd": 64, "n_layer": 2,
        "n_head": 4, "n_positions": 64, "scale_attn_by_inverse_layer_idx": true}"#;
    assert!(
        config(gpt2)
            .unwrap_err()
            .contains("scale_attn_by_inverse_layer_idx")
    );
}

/// A copy of a fixture folder in which `edit` changed something.
fn edited(scratch: &Scratch, name: &str, tag: &str, edit: impl FnOnce(&Path)) -> PathBuf {
    let dir = scratch.join(&format!("{name}-{tag}"));
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(fixture(name).join(f), dir.join(f)).unwrap();
    }
    edit(&dir);
    dir
}

/// A checkpoint's f32 tensors by name: shape and values.
type Tensors = std::collections::BTreeMap<String, (Vec<usize>, Vec<f32>)>;

#[test]
fn missing_extra_and_misshapen_tensors_and_foreign_tokenizers_are_named() {
    let scratch = Scratch::new("edited");
    let rewrite = |dir: &Path, f: &dyn Fn(&mut Tensors)| {
        let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut m = std::collections::BTreeMap::new();
        for (n, v) in st.tensors() {
            let vals: Vec<f32> = v
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            m.insert(n, (v.shape().to_vec(), vals));
        }
        f(&mut m);
        let data: Vec<(String, Vec<u8>, Vec<usize>)> = m
            .into_iter()
            .map(|(n, (s, v))| (n, v.iter().flat_map(|x| x.to_le_bytes()).collect(), s))
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
            .iter()
            .map(|(n, b, s)| {
                (
                    n.clone(),
                    safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                        .unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    };
    let err = |dir: &Path| {
        LanguageModel::open(dir, &Device::Cpu)
            .unwrap_err()
            .to_string()
    };

    let d = edited(&scratch, "llama-gqa", "missing", |d| {
        rewrite(d, &|m| {
            m.remove("model.layers.1.mlp.up_proj.weight");
        })
    });
    let e = err(&d);
    assert!(e.contains("model.layers.1.mlp.up_proj.weight"), "{e}");

    let d = edited(&scratch, "llama-gqa", "extra", |d| {
        rewrite(d, &|m| {
            m.insert(
                "model.layers.7.mystery.weight".into(),
                (vec![2], vec![0.0, 1.0]),
            );
        })
    });
    let e = err(&d);
    assert!(
        e.contains("model.layers.7.mystery.weight") && e.contains("no place"),
        "{e}"
    );

    // Pythia's name for the head, misshapen
    let d = edited(&scratch, "neox", "shape", |d| {
        rewrite(d, &|m| {
            m.remove("lm_head.weight");
            m.insert(
                "embed_out.weight".into(),
                (vec![64, 128], vec![0.0; 64 * 128]),
            );
        })
    });
    let e = err(&d);
    assert!(
        e.contains("embed_out.weight") && e.contains("[128, 64]"),
        "{e}"
    );

    // a tokenizer of another model: more tokens than the vocabulary
    let d = edited(&scratch, "gpt2", "tokenizer", |d| {
        let mut t: Value =
            serde_json::from_str(&std::fs::read_to_string(d.join("tokenizer.json")).unwrap())
                .unwrap();
        let vocab = t["model"]["vocab"].as_object_mut().unwrap();
        for i in 0..10 {
            vocab.insert(format!("extra{i}"), Value::from(128 + i));
        }
        std::fs::write(d.join("tokenizer.json"), t.to_string()).unwrap();
    });
    let e = err(&d);
    assert!(
        e.contains("tokenizer") && e.contains("another model"),
        "{e}"
    );

    // a bad config is refused naming the key
    let d = edited(&scratch, "gpt2", "config", |d| {
        let mut c: Value =
            serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap();
        c["activation_function"] = Value::from("swiglu");
        std::fs::write(d.join("config.json"), c.to_string()).unwrap();
    });
    let e = err(&d);
    assert!(e.contains("activation_function"), "{e}");
    // remote identifiers are refused
    let e = LanguageModel::open(Path::new("HuggingFaceTB/SmolLM2-135M"), &Device::Cpu).unwrap_err();
    assert!(e.to_string().contains("remote"), "{e}");
}

#[test]
fn an_artifact_without_a_decoder_config_is_refused_clearly() {
    let scratch = Scratch::new("plain");
    let path = scratch.join("plain.cma");
    let mut w = compressme_artifact::Writer::create(&path).unwrap();
    w.add_dense("x", compressme_artifact::Dtype::F32, &[2], &[0u8; 8])
        .unwrap();
    w.finish().unwrap();
    let e = LanguageModel::open(&path, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("compressme.decoder_config") && e.contains("not packed from a decoder"),
        "{e}"
    );
}

/// Writes the tiny GQA Llama as llama.cpp's converter would: GGUF names, `attn_q` and
/// `attn_k` rows permuted for its rotary layout, hyperparameters and a byte-level BPE
/// vocabulary in the metadata. `edit` may change the tensor list first.
fn llama_gguf(path: &Path, edit: impl FnOnce(&mut Vec<(String, Tensor)>)) {
    use candle_core::quantized::{GgmlDType, QTensor};
    let bytes = std::fs::read(fixture("llama-gqa").join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = |name: &str| {
        let v = st.tensor(name).unwrap();
        Tensor::from_raw_buffer(v.data(), candle_core::DType::F32, v.shape(), &Device::Cpu).unwrap()
    };
    // llama.cpp: w.reshape(heads, 2, d, cols).swapaxes(1, 2)
    let permute = |w: Tensor, heads: usize| {
        let (rows, cols) = w.dims2().unwrap();
        w.reshape((heads, 2, rows / heads / 2, cols))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
            .reshape((rows, cols))
            .unwrap()
    };
    let mut tensors = vec![
        (
            "token_embd.weight".to_string(),
            t("model.embed_tokens.weight"),
        ),
        ("output.weight".to_string(), t("lm_head.weight")),
        ("output_norm.weight".to_string(), t("model.norm.weight")),
    ];
    for i in 0..2 {
        let p = format!("model.layers.{i}");
        for (g, h) in [
            ("attn_norm", "input_layernorm"),
            ("ffn_norm", "post_attention_layernorm"),
            ("attn_v", "self_attn.v_proj"),
            ("attn_output", "self_attn.o_proj"),
            ("ffn_gate", "mlp.gate_proj"),
            ("ffn_up", "mlp.up_proj"),
            ("ffn_down", "mlp.down_proj"),
        ] {
            tensors.push((format!("blk.{i}.{g}.weight"), t(&format!("{p}.{h}.weight"))));
        }
        tensors.push((
            format!("blk.{i}.attn_q.weight"),
            permute(t(&format!("{p}.self_attn.q_proj.weight")), 4),
        ));
        tensors.push((
            format!("blk.{i}.attn_k.weight"),
            permute(t(&format!("{p}.self_attn.k_proj.weight")), 2),
        ));
    }
    edit(&mut tensors);
    let tok: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("llama-gqa").join("tokenizer.json")).unwrap(),
    )
    .unwrap();
    let mut vocab: Vec<(String, u64)> = tok["model"]["vocab"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_u64().unwrap()))
        .collect();
    vocab.sort_by_key(|(_, i)| *i);
    let merges: Vec<gguf::Value> = tok["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            gguf::Value::String(match m {
                Value::String(s) => s.clone(),
                Value::Array(a) => format!("{} {}", a[0].as_str().unwrap(), a[1].as_str().unwrap()),
                _ => unreachable!(),
            })
        })
        .collect();
    use candle_core::quantized::gguf_file as gguf;
    let s = |v: &str| gguf::Value::String(v.into());
    let u = gguf::Value::U32;
    let meta: Vec<(&str, gguf::Value)> = vec![
        ("general.architecture", s("llama")),
        ("llama.block_count", u(2)),
        ("llama.context_length", u(64)),
        ("llama.embedding_length", u(64)),
        ("llama.feed_forward_length", u(96)),
        ("llama.attention.head_count", u(4)),
        ("llama.attention.head_count_kv", u(2)),
        ("llama.rope.freq_base", gguf::Value::F32(500.0)),
        (
            "llama.attention.layer_norm_rms_epsilon",
            gguf::Value::F32(1e-5),
        ),
        ("tokenizer.ggml.model", s("gpt2")),
        (
            "tokenizer.ggml.tokens",
            gguf::Value::Array(vocab.iter().map(|(t, _)| s(t)).collect()),
        ),
        ("tokenizer.ggml.merges", gguf::Value::Array(merges)),
        ("tokenizer.ggml.eos_token_id", u(1)),
    ];
    let q: Vec<(String, QTensor)> = tensors
        .iter()
        .map(|(n, t)| (n.clone(), QTensor::quantize(t, GgmlDType::F32).unwrap()))
        .collect();
    let metas: Vec<(&str, &gguf::Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    let qs: Vec<(&str, &QTensor)> = q.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf::write(&mut f, &metas, &qs).unwrap();
}

#[test]
fn a_llama_gguf_reads_as_transformers_reads_the_folder() {
    let scratch = Scratch::new("gguf");
    let path = scratch.join("llama-gqa.gguf");
    llama_gguf(&path, |_| {});
    let lm = LanguageModel::open(&path, &Device::Cpu).unwrap();
    assert_eq!(lm.source.kind, "gguf");
    assert_eq!(
        lm.source_types["model.layers.0.self_attn.q_proj.weight"],
        "f32"
    );
    let folder = open("llama-gqa");
    let c = lm.model.config();
    assert_eq!(
        (c.heads, c.kv_heads, c.rope_theta, c.tie_embeddings),
        (4, 2, 500.0, false)
    );
    assert_eq!(lm.model.module_names(), folder.model.module_names());
    // the rotary permutation undone: transformers' logits for the same weights
    let g = golden("llama-gqa");
    let err = max_abs_diff(
        &lm.model.forward(&ids_tensor(&g)).unwrap(),
        &golden_logits(&g),
    )
    .unwrap();
    assert!(err < 1e-4, "GGUF against transformers: {err}");

    // a tensor missing, a tensor the mapping does not know: named
    let missing = scratch.join("missing.gguf");
    llama_gguf(&missing, |t| t.retain(|(n, _)| n != "blk.1.ffn_up.weight"));
    let e = LanguageModel::open(&missing, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(e.contains("model.layers.1.mlp.up_proj.weight"), "{e}");
    let extra = scratch.join("extra.gguf");
    llama_gguf(&extra, |t| {
        t.push((
            "blk.0.attn_qkv.weight".into(),
            Tensor::zeros((4, 4), candle_core::DType::F32, &Device::Cpu).unwrap(),
        ))
    });
    let e = LanguageModel::open(&extra, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("blk.0.attn_qkv.weight") && e.contains("no Hugging Face name"),
        "{e}"
    );
    let not_gguf = scratch.join("garbage.gguf");
    std::fs::write(&not_gguf, b"GGUF\x03\x00\x00\x00garbage").unwrap();
    let e = LanguageModel::open(&not_gguf, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(e.contains("GGUF"), "{e}");
}

/// Found by the `tokenizer` fuzz target: decoding no ids panicked inside tokenizers'
/// byte-level BPE decoder (a subtraction that overflows where overflow checks are on,
/// as in this test profile). The empty text and no ids map to each other.
#[test]
fn no_ids_decode_to_the_empty_text() {
    let lm = open("llama-gqa");
    assert_eq!(lm.decode(&[]).unwrap(), "");
    assert!(lm.encode("").unwrap().is_empty());
    let ids = lm.encode("It was a fine morning.").unwrap();
    assert!(!ids.is_empty());
    assert!(!lm.decode(&ids).unwrap().is_empty());
}

/// candle's Q5_0 and Q8_0 linears, then the same with [`compressme_nn::replicate_ggml`]:
/// every logit the same bits (on AVX-512 VNNI, where it replaces them; elsewhere it
/// replaces none, said as skipped).
#[test]
fn replicated_ggml_linears_give_candles_bits() {
    for format in [
        compressme_nn::LlamaFormat::Q5_0,
        compressme_nn::LlamaFormat::Q8_0,
    ] {
        replicated_linears_give_candles_bits(format);
    }
}

fn replicated_linears_give_candles_bits(format: compressme_nn::LlamaFormat) {
    use compressme_nn::{ModuleRef, Weight, llama_qtensor, replicate_ggml};
    let mut lm = open("llama-gqa");
    let g = golden("llama-gqa");
    let mut linears = 0;
    for name in lm.model.module_names() {
        let Some(ModuleRef::Linear(l)) = lm.model.module(&name) else {
            continue;
        };
        let (rows, cols) = l.shape();
        // candle asserts (in debug builds, from a worker of its pool, which a panic
        // poisons for every later product) that a Q5_0 row has an even number of blocks
        if format == compressme_nn::LlamaFormat::Q5_0 && (cols / 32) % 2 == 1 {
            continue;
        }
        let q = llama_qtensor(&l.weight_f32().unwrap(), rows, cols, format).unwrap();
        let Some(compressme_nn::ModuleMut::Linear(l)) = lm.model.module_mut(&name) else {
            unreachable!("{name} was a linear a moment ago");
        };
        l.set_weight(Weight::Ggml(std::sync::Arc::new(q))).unwrap();
        linears += 1;
    }
    let ids = ids_tensor(&g);
    let bits = |t: &Tensor| -> Vec<u32> {
        let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        v.into_iter().map(f32::to_bits).collect()
    };
    let candle = bits(&lm.model.forward(&ids).unwrap());
    let replaced = replicate_ggml(&mut lm.model).unwrap();
    if compressme_quant::kernel_tier().unwrap() >= compressme_quant::Tier::Avx512Vnni {
        assert_eq!(replaced, linears, "{format:?}");
        assert!(linears > 5, "{linears} linears");
    } else {
        assert_eq!(replaced, 0);
        eprintln!(
            "skipped: the {format:?} replica's model-level bits (the kernel tier is not AVX-512 VNNI)"
        );
    }
    assert_eq!(bits(&lm.model.forward(&ids).unwrap()), candle, "{format:?}");
}

/// Every input an observer sees, by module, in order, as bits.
struct Seen(std::sync::Mutex<Vec<(String, Vec<u32>)>>);

impl compressme_nn::Observer for Seen {
    fn observe(&self, module: &str, x: &Tensor) -> compressme_nn::Result<()> {
        let bits = x
            .flatten_all()?
            .to_dtype(candle_core::DType::F32)?
            .to_vec1::<f32>()?
            .into_iter()
            .map(f32::to_bits)
            .collect();
        self.0
            .lock()
            .map_err(|_| compressme_nn::Error::Observer("poisoned".into()))?
            .push((module.to_string(), bits));
        Ok(())
    }
}

/// `Decoder::observe` reports what `forward` reports, every linear's input (the output
/// head's, tied or not, included), in the same order and to the bit, without the head.
#[test]
fn observe_reports_what_forward_reports() {
    for name in FAMILIES {
        let lm = open(name);
        let ids = Tensor::new(&[[3u32, 41, 7, 99, 12, 5]], &Device::Cpu).unwrap();
        let seen = |run: &dyn Fn() -> compressme_nn::Result<()>| {
            let s = std::sync::Arc::new(Seen(std::sync::Mutex::new(Vec::new())));
            let guard = lm.model.hooks().install(s.clone()).unwrap();
            run().unwrap();
            drop(guard);
            std::mem::take(&mut *s.0.lock().unwrap())
        };
        let by_forward = seen(&|| lm.model.forward(&ids).map(drop));
        let by_observe = seen(&|| lm.model.observe(&ids));
        let linears = lm
            .model
            .modules()
            .into_iter()
            .filter(|m| m.kind == ModuleKind::Linear)
            .count();
        assert!(by_forward.len() >= linears, "{name}: {}", by_forward.len());
        assert_eq!(by_observe, by_forward, "{name}");
    }
}
