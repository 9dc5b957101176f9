//! BERT against golden outputs from `transformers` (fixtures/bert/make_golden.py), and
//! loading errors.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use compressme_nn::{Bert, Error, SentenceEmbedder, bert::mean_pool_normalize};

use crate::real_checkpoint::minilm_dir;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/bert")
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn u32s(v: &serde_json::Value) -> Vec<Vec<u32>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect()
        })
        .collect()
}

fn flat_f32(v: &serde_json::Value, out: &mut Vec<f32>) {
    match v {
        serde_json::Value::Array(a) => a.iter().for_each(|x| flat_f32(x, out)),
        x => out.push(x.as_f64().unwrap() as f32),
    }
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn tensor2(rows: &[Vec<u32>]) -> Tensor {
    let (b, t) = (rows.len(), rows[0].len());
    Tensor::from_vec(rows.concat(), (b, t), &Device::Cpu).unwrap()
}

/// A tiny random BERT (weights committed) matches `transformers` to 1e-5, padding
/// included.
#[test]
fn tiny_bert_matches_transformers() {
    let g = json(&fixtures().join("tiny_golden.json"));
    let bert = Bert::from_dir(&fixtures().join("tiny"), &Device::Cpu).unwrap();
    let ids = tensor2(&u32s(&g["input_ids"]));
    let types = tensor2(&u32s(&g["token_type_ids"]));
    let mask = tensor2(&u32s(&g["attention_mask"]));
    let hidden = bert.forward(&ids, Some(&types), &mask).unwrap();
    let mut want = Vec::new();
    flat_f32(&g["last_hidden_state"], &mut want);
    let got = hidden.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    // padded positions' hidden states are not pooled; compare only real tokens
    let m = u32s(&g["attention_mask"]).concat();
    let h = bert.config().hidden_size;
    let keep = |v: &[f32]| -> Vec<f32> {
        v.chunks(h)
            .zip(&m)
            .filter(|(_, k)| **k == 1)
            .flat_map(|(c, _)| c.to_vec())
            .collect()
    };
    let d = max_abs_diff(&keep(&got), &keep(&want));
    println!("tiny BERT: max |ours - transformers| over real tokens = {d:e}");
    assert!(d <= 1e-5, "{d}");
    let emb = mean_pool_normalize(&hidden, &mask).unwrap();
    let mut want_e = Vec::new();
    flat_f32(&g["embeddings"], &mut want_e);
    let d = max_abs_diff(
        &emb.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        &want_e,
    );
    assert!(d <= 1e-5, "{d}");
}

/// all-MiniLM-L6-v2 sentence embeddings match `transformers` + sentence-transformers'
/// pooling to 1e-5 for the fixed sentences (one padded batch, as the golden script ran).
#[test]
fn minilm_sentence_embeddings_match_transformers() {
    let Some(dir) = minilm_dir() else { return };
    let g = json(&fixtures().join("minilm_golden.json"));
    let sentences: Vec<&str> = g["sentences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    let emb = SentenceEmbedder::from_dir(&dir, &Device::Cpu).unwrap();
    assert_eq!(emb.max_len(), 256);
    let (_, _, mask) = emb.tokenize(&sentences).unwrap();
    let counts: Vec<u32> = mask.sum(1).unwrap().to_vec1::<u32>().unwrap();
    let want_counts: Vec<u32> = g["token_counts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(counts, want_counts, "token counts (truncation at 256)");
    let got = emb.embed(&sentences).unwrap().concat();
    let mut want = Vec::new();
    flat_f32(&g["embeddings"], &mut want);
    let d = max_abs_diff(&got, &want);
    println!(
        "MiniLM: max |ours - transformers| over {} sentences = {d:e}",
        sentences.len()
    );
    assert!(d <= 1e-5, "{d}");
    // one at a time gives the same embeddings (no padding), to float noise
    for (i, s) in sentences.iter().enumerate().take(4) {
        let one = emb.embed(&[s]).unwrap().concat();
        assert!(max_abs_diff(&one, &want[i * 384..(i + 1) * 384]) <= 1e-5);
    }
}

fn copy_tiny(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixtures().join("tiny").join(f), dir.join(f)).unwrap();
    }
}

/// Rewrites the tiny checkpoint with `edit` applied to its tensors.
fn edit_tiny(dir: &Path, edit: impl Fn(&mut Vec<(String, DType, Vec<usize>, Vec<u8>)>)) {
    copy_tiny(dir);
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, DType, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, DType::F32, v.shape().to_vec(), v.data().to_vec()))
        .collect();
    edit(&mut tensors);
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            let dt = match d {
                DType::F32 => safetensors::Dtype::F32,
                _ => safetensors::Dtype::I64,
            };
            (
                n.clone(),
                safetensors::tensor::TensorView::new(dt, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
}

#[test]
fn loading_errors_name_the_file_and_the_tensor() {
    let tmp = std::env::temp_dir().join(format!("compressme-bert-{}", std::process::id()));
    let q = "encoder.layer.1.attention.self.query.weight";

    let d = tmp.join("missing");
    edit_tiny(&d, |t| t.retain(|(n, ..)| n != q));
    let e = Bert::from_dir(&d, &Device::Cpu).unwrap_err();
    let ok = matches!(&e, Error::MissingTensor { name, .. } if name == q);
    assert!(ok, "{e}");
    assert!(e.to_string().contains("model.safetensors"), "{e}");

    let d = tmp.join("shape");
    edit_tiny(&d, |t| {
        let x = t.iter_mut().find(|(n, ..)| n == q).unwrap();
        x.2 = vec![16, 64];
    });
    let e = Bert::from_dir(&d, &Device::Cpu).unwrap_err();
    let ok = matches!(&e, Error::TensorShape { name, got, .. } if name == q && got == &[16, 64]);
    assert!(ok, "{e}");

    let d = tmp.join("dtype");
    edit_tiny(&d, |t| {
        let x = t.iter_mut().find(|(n, ..)| n == q).unwrap();
        x.1 = DType::I64;
        x.2 = vec![32, 16];
    });
    let e = Bert::from_dir(&d, &Device::Cpu).unwrap_err();
    let ok = matches!(&e, Error::TensorDtype { name, .. } if name == q);
    assert!(ok, "{e}");

    let d = tmp.join("model-type");
    copy_tiny(&d);
    let cfg = std::fs::read_to_string(d.join("config.json")).unwrap();
    std::fs::write(d.join("config.json"), cfg.replace("\"bert\"", "\"gpt2\"")).unwrap();
    let e = Bert::from_dir(&d, &Device::Cpu).unwrap_err();
    let ok = matches!(&e, Error::UnsupportedModel { model_type, .. } if model_type == "gpt2");
    assert!(ok, "{e}");
    assert!(e.to_string().contains("supported: bert"), "{e}");

    let e = Bert::from_dir(
        Path::new("sentence-transformers/all-MiniLM-L6-v2"),
        &Device::Cpu,
    )
    .unwrap_err();
    assert!(matches!(e, Error::Remote(_)), "{e}");
    let e = Bert::from_dir(Path::new("https://huggingface.co/x/y"), &Device::Cpu).unwrap_err();
    assert!(matches!(e, Error::Remote(_)), "{e}");
    let e = Bert::from_dir(&tmp.join("nowhere/at/all"), &Device::Cpu).unwrap_err();
    assert!(matches!(e, Error::Load { .. }), "{e}");

    let d = tmp.join("no-tokenizer");
    copy_tiny(&d);
    let e = SentenceEmbedder::from_dir(&d, &Device::Cpu).unwrap_err();
    let ok = matches!(&e, Error::Load { path, .. } if path.ends_with("tokenizer.json"));
    assert!(ok, "{e}");
    std::fs::remove_dir_all(&tmp).unwrap();
}
