//! The model trait on the real MiniLM and the causal model: storage swaps (all or nothing,
//! lossless exactness, quantized similarity), hooks, training.

use std::sync::{Arc, Mutex};

use candle_core::{Device, Tensor};
use compressme_nn::causal::cyclic_batch;
use compressme_nn::{
    AdamW, Bert, CausalConfig, CausalLm, Error, Model, ModuleRef, Observer, PackOptions,
    SentenceEmbedder, Storage,
};
use compressme_quant::synthetic::Rng;
use compressme_quant::{Format, GroupSize};

use crate::real_checkpoint::minilm_dir;

/// Sentences the MiniLM checks run on.
pub(crate) const SENTENCES: [&str; 8] = [
    "The weather is lovely today.",
    "It's so sunny outside!",
    "He drove to the stadium.",
    "A man is playing a guitar.",
    "Rust's borrow checker keeps references valid.",
    "Compression should never change a lossless weight.",
    "",
    "Quantized layers trade a little accuracy for bytes.",
];

fn tiny_bert() -> Bert {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/bert/tiny");
    Bert::from_dir(&dir, &Device::Cpu).unwrap()
}

/// Every module's weight as raw f32 bits, by name.
fn weights_bits(m: &impl Model) -> Vec<(String, Vec<u32>)> {
    m.module_names()
        .into_iter()
        .map(|n| {
            let bits = match m.module(&n).unwrap() {
                ModuleRef::Linear(l) => l.weight_f32().unwrap(),
                ModuleRef::Embedding(e) => e
                    .weight()
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap(),
            };
            (n, bits.into_iter().map(f32::to_bits).collect())
        })
        .collect()
}

#[test]
fn set_storage_is_all_or_nothing() {
    let mut bert = tiny_bert();
    let before = weights_bits(&bert);
    let report = bert.storage_report();
    let q = "encoder.layer.0.attention.self.query".to_string();
    let bad = [
        vec![
            (q.clone(), Storage::Quant(Format::Int8)),
            ("no.such.module".into(), Storage::Dense),
        ],
        vec![
            (q.clone(), Storage::Quant(Format::Int8)),
            (q.clone(), Storage::Dense),
        ],
        vec![
            (q.clone(), Storage::Quant(Format::Int8)),
            (
                "embeddings.word_embeddings".into(),
                Storage::Lossless(PackOptions::default()),
            ),
            (
                q.clone().replace("query", "key"),
                Storage::Quant(Format::Int8Rows),
            ),
        ],
        vec![(q.clone(), Storage::Quant(Format::Int8Rows))],
    ];
    for changes in bad {
        let e = bert.set_storage(&changes).unwrap_err();
        let ok = matches!(e, Error::UnknownModule { .. } | Error::BadStorage { .. });
        assert!(ok, "{e}");
        assert_eq!(
            weights_bits(&bert),
            before,
            "model changed by a failed swap: {e}"
        );
        assert_eq!(bert.storage_report(), report);
    }
    let e = bert
        .set_storage(&[("nope".into(), Storage::Dense)])
        .unwrap_err();
    assert!(e.to_string().contains("embeddings.word_embeddings"), "{e}");
    // a good change goes through and is reported
    bert.set_storage(&[(q.clone(), Storage::Quant(Format::Nf4Block(GroupSize::G32)))])
        .unwrap();
    let info = bert.modules().into_iter().find(|m| m.name == q).unwrap();
    assert_eq!(info.storage, "nf4-g32");
    assert!(info.stored_bytes < info.dense_bytes);
}

struct Recorder(Mutex<Vec<(String, Vec<usize>)>>);

impl Observer for Recorder {
    fn observe(&self, module: &str, x: &Tensor) -> compressme_nn::Result<()> {
        self.0
            .lock()
            .unwrap()
            .push((module.to_string(), x.dims().to_vec()));
        Ok(())
    }
}

struct Refuser;

impl Observer for Refuser {
    fn observe(&self, module: &str, _: &Tensor) -> compressme_nn::Result<()> {
        if module.ends_with("layer.1.intermediate.dense") {
            return Err(Error::Observer(format!("refused {module}")));
        }
        Ok(())
    }
}

#[test]
fn observers_see_every_module_by_name_and_uninstall_on_drop() {
    let bert = tiny_bert();
    let ids = Tensor::new(&[[2u32, 17, 45, 3]], &Device::Cpu).unwrap();
    let mask = ids.ones_like().unwrap();
    let plain = bert.forward(&ids, None, &mask).unwrap();
    let rec = Arc::new(Recorder(Mutex::new(Vec::new())));
    {
        let _guard = bert.hooks().install(rec.clone()).unwrap();
        assert!(matches!(
            bert.hooks().install(Arc::new(Refuser)),
            Err(Error::Observer(_))
        ));
        let seen = bert.forward(&ids, None, &mask).unwrap();
        assert_eq!(
            seen.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            plain.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        );
    }
    assert!(!bert.hooks().installed());
    let seen = rec.0.lock().unwrap().clone();
    let names: Vec<&str> = seen.iter().map(|(n, _)| n.as_str()).collect();
    // the three embedding outputs, then six linears a layer, in forward order
    assert_eq!(seen.len(), 3 + 6 * 2);
    assert_eq!(names[0], "embeddings.word_embeddings");
    assert_eq!(names[3], "encoder.layer.0.attention.self.query");
    assert_eq!(names[8], "encoder.layer.0.output.dense");
    assert_eq!(seen[8].1, vec![1, 4, 64]);
    let listed: Vec<String> = bert.module_names();
    assert!(names.iter().all(|n| listed.iter().any(|l| l == n)));

    // an observer's error stops the pass, and the guard still uninstalls it
    let r = (|| -> compressme_nn::Result<Tensor> {
        let _guard = bert.hooks().install(Arc::new(Refuser))?;
        bert.forward(&ids, None, &mask)
    })();
    assert!(matches!(r, Err(Error::Observer(_))));
    assert!(!bert.hooks().installed());
}

/// The seed's real-checkpoint check: with MiniLM's word embeddings in lossless blocks,
/// every weight and every output is bit-identical to the dense model.
#[test]
fn minilm_lossless_word_embeddings_change_nothing() {
    let Some(dir) = minilm_dir() else { return };
    let dense = SentenceEmbedder::from_dir(&dir, &Device::Cpu).unwrap();
    let mut packed = dense.clone();
    let word = "embeddings.word_embeddings".to_string();
    packed
        .bert_mut()
        .set_storage(&[(word.clone(), Storage::Lossless(PackOptions::default()))])
        .unwrap();
    let (a, b) = (weights_bits(dense.bert()), weights_bits(packed.bert()));
    assert_eq!(a.len(), b.len());
    let mut values = 0usize;
    for ((na, wa), (nb, wb)) in a.iter().zip(&b) {
        assert_eq!(na, nb);
        assert!(wa == wb, "{na} differs");
        values += wa.len();
    }
    let (ids, types, mask) = dense.tokenize(&SENTENCES).unwrap();
    let ha = dense.bert().forward(&ids, Some(&types), &mask).unwrap();
    let hb = packed.bert().forward(&ids, Some(&types), &mask).unwrap();
    let bits = |t: &Tensor| -> Vec<u32> {
        t.flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .into_iter()
            .map(f32::to_bits)
            .collect()
    };
    let (oa, ob) = (bits(&ha), bits(&hb));
    assert!(oa == ob, "hidden states differ");
    let (ra, rb) = (
        dense.bert().storage_report(),
        packed.bert().storage_report(),
    );
    println!(
        "lossless word embeddings: {} module weights ({values} values) and {} output values bit-identical; model {} -> {} bytes ({:+} bytes, {:.4} of dense)",
        a.len(),
        oa.len(),
        ra.stored_bytes(),
        rb.stored_bytes(),
        rb.stored_bytes() as i64 - ra.stored_bytes() as i64,
        rb.stored_bytes() as f64 / rb.dense_bytes() as f64
    );
    assert!(rb.stored_bytes() < ra.stored_bytes());
}

use compressme_eval::cosine;

/// Every MiniLM linear quantized: sentence embeddings stay close to the f32 model's.
#[test]
fn minilm_quantized_linears_keep_embeddings_close() {
    let Some(dir) = minilm_dir() else { return };
    let dense = SentenceEmbedder::from_dir(&dir, &Device::Cpu).unwrap();
    let want = dense.embed(&SENTENCES).unwrap();
    let linears: Vec<String> = dense
        .bert()
        .modules()
        .into_iter()
        .filter(|m| m.kind == compressme_nn::ModuleKind::Linear)
        .map(|m| m.name)
        .collect();
    assert_eq!(linears.len(), 36);
    // (format, lowest cosine allowed, lowest mean): measured 0.9965 / 0.9992, 0.909 / 0.952,
    // 0.928 / 0.969 (the empty sentence is the worst each time)
    for (format, floor, mean_floor) in [
        (Format::Int8, 0.995, 0.999),
        (Format::Nf4, 0.90, 0.945),
        (Format::Nf4Block(GroupSize::G64), 0.92, 0.965),
    ] {
        let mut q = dense.clone();
        let changes: Vec<(String, Storage)> = linears
            .iter()
            .map(|n| (n.clone(), Storage::Quant(format)))
            .collect();
        q.bert_mut().set_storage(&changes).unwrap();
        let got = q.embed(&SENTENCES).unwrap();
        let cos: Vec<f64> = got.iter().zip(&want).map(|(a, b)| cosine(a, b)).collect();
        let min = cos.iter().copied().fold(f64::INFINITY, f64::min);
        let mean = cos.iter().sum::<f64>() / cos.len() as f64;
        let r = q.bert().storage_report();
        println!(
            "{format}: cosine to f32 mean {mean:.5} min {min:.5}; model {} of {} dense bytes ({:.4})",
            r.stored_bytes(),
            r.dense_bytes(),
            r.stored_bytes() as f64 / r.dense_bytes() as f64
        );
        assert!(min >= floor, "{format}: min cosine {min}");
        assert!(mean >= mean_floor, "{format}: mean cosine {mean}");
    }
}

fn train(seed: u64, steps: usize) -> (CausalLm, Vec<f32>) {
    let cfg = CausalConfig {
        vocab: 16,
        width: 32,
        layers: 2,
        heads: 2,
        context: 16,
    };
    let dev = Device::Cpu;
    let model = CausalLm::new(cfg, seed, &dev).unwrap();
    let mut opt = AdamW::new(model.vars(), 3e-3, 0.01).unwrap();
    let mut rng = Rng::new(seed ^ 0x5eed);
    let mut losses = Vec::new();
    for _ in 0..steps {
        let (ids, targets) = cyclic_batch(&mut rng, 16, 16, cfg.vocab, 3, &dev).unwrap();
        let loss = model.loss(&ids, &targets).unwrap();
        losses.push(loss.to_scalar::<f32>().unwrap());
        let grads = loss.backward().unwrap();
        opt.step(model.vars(), &grads).unwrap();
    }
    (model, losses)
}

/// The causal model learns the cyclic task (loss from about ln 16 = 2.77 to below 0.5 in
/// 150 steps), and the same seed gives bit-identical weights.
#[test]
fn causal_model_trains_deterministically() {
    let (a, la) = train(7, 150);
    let (b, lb) = train(7, 150);
    let tail = la[la.len() - 10..].iter().sum::<f32>() / 10.0;
    println!("causal loss: first {:.3}, mean of last 10 {tail:.3}", la[0]);
    assert!(la[0] > 2.0, "{}", la[0]);
    assert!(tail < 0.5, "loss only fell to {tail}");
    assert_eq!(la, lb);
    assert_eq!(weights_bits(&a), weights_bits(&b));
    let (c, _) = train(8, 3);
    assert_ne!(weights_bits(&a), weights_bits(&c));
    assert_eq!(a.output_heads(), vec!["lm_head".to_string()]);
    assert_eq!(a.module_names().len(), 1 + 6 * 2 + 1);
}

/// An artifact reloads without the original checkpoint: MiniLM packed with INT8 linears
/// and lossless embeddings gives exactly the embeddings of the same storage applied in
/// memory; applying an artifact of another model fails and changes nothing.
#[test]
fn minilm_reloads_from_an_artifact_alone() {
    use compressme_artifact::{Artifact, Checkpoint, Limits, Writer};
    let Some(dir) = minilm_dir() else { return };
    let tmp = std::env::temp_dir().join(format!("cm-nn-artifact-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let art = tmp.join("minilm.cma");
    let ckpt = Checkpoint::open(&dir, &Limits::default()).unwrap();
    let entries: Vec<_> = ckpt.entries().cloned().collect();
    let mut w = Writer::create(&art).unwrap();
    for e in &entries {
        let bytes = ckpt.read(&e.name).unwrap();
        let linear = e.name.starts_with("encoder.")
            && e.name.ends_with(".weight")
            && !e.name.contains("LayerNorm");
        if linear {
            w.add_quantized(&e.name, e.dtype, &e.shape, &bytes, Format::Int8)
                .unwrap();
        } else if e.dtype.is_float() {
            w.add_lossless(&e.name, e.dtype, &e.shape, &bytes, 16, Default::default())
                .unwrap();
        } else {
            w.add_dense(&e.name, e.dtype, &e.shape, &bytes).unwrap();
        }
    }
    w.finish().unwrap();

    let loaded = Bert::from_artifact(&dir, &art, &Device::Cpu).unwrap();
    let infos = loaded.modules();
    assert!(infos.iter().filter(|m| m.storage == "int8").count() == 36);
    let word = infos
        .iter()
        .find(|m| m.name == "embeddings.word_embeddings")
        .unwrap();
    assert_eq!(word.storage, "lossless");
    let from_artifact = SentenceEmbedder::with_bert(&dir, loaded).unwrap();

    let mut in_memory = SentenceEmbedder::from_dir(&dir, &Device::Cpu).unwrap();
    let changes: Vec<(String, Storage)> = infos
        .iter()
        .filter(|m| m.storage == "int8")
        .map(|m| (m.name.clone(), Storage::Quant(Format::Int8)))
        .collect();
    in_memory.bert_mut().set_storage(&changes).unwrap();
    assert_eq!(
        from_artifact.embed(&SENTENCES).unwrap(),
        in_memory.embed(&SENTENCES).unwrap(),
        "reloaded model differs"
    );

    // the tiny BERT's artifact does not fit MiniLM: an error, and nothing changes
    let tiny_art = tmp.join("tiny.cma");
    let tiny = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/bert/tiny/model.safetensors");
    let ckpt = Checkpoint::open(&tiny, &Limits::default()).unwrap();
    let entries: Vec<_> = ckpt.entries().cloned().collect();
    let mut w = Writer::create(&tiny_art).unwrap();
    for e in &entries {
        let bytes = ckpt.read(&e.name).unwrap();
        w.add_dense(&e.name, e.dtype, &e.shape, &bytes).unwrap();
    }
    w.finish().unwrap();
    let mut target = in_memory.bert().clone();
    let before = weights_bits(&target);
    let mut a = Artifact::open(&tiny_art, &Limits::default()).unwrap();
    let e = compressme_nn::apply_artifact(&mut target, &mut a).unwrap_err();
    assert!(matches!(e, Error::Shape(_)), "{e}");
    assert!(
        e.to_string().contains("artifact tensor `embeddings."),
        "{e}"
    );
    assert_eq!(weights_bits(&target), before);
    std::fs::remove_dir_all(&tmp).unwrap();
}

/// The causal model's named tensors rebuild it exactly; an artifact of them (packed
/// linears, configuration in the metadata) reloads with the packed storage kept; a
/// checkpoint with a tensor missing, extra or misshapen is refused; greedy generation
/// counts only what it produced and stops at the context.
#[test]
fn causal_model_round_trips_through_tensors_and_artifacts() {
    use std::collections::HashMap;

    use compressme_artifact::{Dtype, Writer, from_f32};
    let (model, _) = train(5, 40);
    let cfg = model.config();
    let dev = Device::Cpu;
    let tensors: HashMap<String, Tensor> = model.tensors().unwrap().into_iter().collect();
    assert_eq!(tensors.len(), 2 + 4 * 2 + 2 * 6 * 2 + 2 + 2);
    let again = CausalLm::from_tensors(cfg, &tensors, &dev).unwrap();
    let ids = Tensor::new(&[[1u32, 4, 7, 10, 13, 0]], &dev).unwrap();
    let bits = |m: &CausalLm| -> Vec<u32> {
        m.forward(&ids)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect()
    };
    assert_eq!(bits(&model), bits(&again));

    // refused: a missing, an extra, a misshapen tensor
    let mut missing = tensors.clone();
    missing.remove("layers.1.mlp.up.bias");
    let e = CausalLm::from_tensors(cfg, &missing, &dev).unwrap_err();
    assert!(e.to_string().contains("layers.1.mlp.up.bias"), "{e}");
    let mut extra = tensors.clone();
    extra.insert(
        "layers.2.attn.q.weight".into(),
        Tensor::zeros((32, 32), candle_core::DType::F32, &dev).unwrap(),
    );
    let e = CausalLm::from_tensors(cfg, &extra, &dev).unwrap_err();
    assert!(e.to_string().contains("layers.2.attn.q.weight"), "{e}");
    let mut misshapen = tensors.clone();
    misshapen.insert(
        "ln_f.weight".into(),
        Tensor::ones(31, candle_core::DType::F32, &dev).unwrap(),
    );
    let e = CausalLm::from_tensors(cfg, &misshapen, &dev).unwrap_err();
    assert!(e.to_string().contains("ln_f.weight"), "{e}");

    // an artifact: NF4 linears, the rest dense
    let tmp = std::env::temp_dir().join(format!("cm-nn-causal-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let path = tmp.join("causal.cma");
    let mut w = Writer::create(&path).unwrap();
    w.recipe_mut().source_metadata.insert(
        compressme_nn::causal::CONFIG_KEY.into(),
        serde_json::to_string(&cfg).unwrap(),
    );
    for (name, t) in model.tensors().unwrap() {
        let bytes = from_f32(
            Dtype::F32,
            &t.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        );
        let shape = t.dims().to_vec();
        if name.ends_with(".weight") && name.contains("attn") {
            w.add_quantized(&name, Dtype::F32, &shape, &bytes, Format::Nf4)
                .unwrap();
        } else {
            w.add_dense(&name, Dtype::F32, &shape, &bytes).unwrap();
        }
    }
    w.finish().unwrap();
    let loaded = CausalLm::from_artifact(&path, &dev).unwrap();
    let mut in_memory = model.clone();
    let changes: Vec<(String, Storage)> = in_memory
        .module_names()
        .into_iter()
        .filter(|n| n.contains("attn"))
        .map(|n| (n, Storage::Quant(Format::Nf4)))
        .collect();
    in_memory.set_storage(&changes).unwrap();
    assert_eq!(
        bits(&loaded),
        bits(&in_memory),
        "packed codes reloaded as packed"
    );
    let report = loaded.storage_report();
    assert_eq!(
        report.stored_bytes(),
        in_memory.storage_report().stored_bytes()
    );
    assert!(report.stored_bytes() < model.storage_report().stored_bytes());
    // an artifact without the configuration is not a causal model
    let plain = tmp.join("plain.cma");
    let mut w = Writer::create(&plain).unwrap();
    w.add_dense("x", Dtype::F32, &[1], &[0, 0, 0, 0]).unwrap();
    w.finish().unwrap();
    let e = CausalLm::from_artifact(&plain, &dev).unwrap_err();
    assert!(e.to_string().contains("causal_config"), "{e}");

    // generation: the learnt rule, early stops counted
    let out = model.generate(&[1, 3, 5], 6, None).unwrap();
    assert_eq!(out.len(), 6);
    let stop = out[1];
    let early = model.generate(&[1, 3, 5], 6, Some(stop)).unwrap();
    assert_eq!(
        early,
        out[..2].to_vec(),
        "stops after producing the stop token"
    );
    let full = model.generate(&[0; 14], 10, None).unwrap();
    assert_eq!(
        full.len(),
        cfg.context - 14,
        "stops when the context is full"
    );
    assert!(model.generate(&[], 3, None).is_err());
    std::fs::remove_dir_all(&tmp).unwrap();
}
