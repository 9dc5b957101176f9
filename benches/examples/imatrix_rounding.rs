//! Activation-aware rounding against plain absmax on MiniLM: every linear quantized to a
//! blockwise 4-bit format both ways, with per-channel E[x²] from the committed calibration
//! text. Reports the summed weighted error (the objective) and the cosine of sentence
//! embeddings of the golden sentences (held out from the calibration text) to f32.
//! `cargo run --release -p compressme-benches --example imatrix_rounding`

use std::sync::Arc;

use candle_core::Device;
use compressme_benches::{cosine, minilm_dir};
use compressme_nn::{Model, ModuleMut, ModuleRef, SentenceEmbedder, Weight};
use compressme_profile::{ActivationRecorder, ProfileSettings};
use compressme_quant::{Format, GroupSize, quantize, quantize_weighted};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let dense = SentenceEmbedder::from_dir(&minilm_dir(), &Device::Cpu)?;
    let calib = std::fs::read_to_string(root.join("fixtures/calibration/docs_128.txt"))?;
    let lines: Vec<&str> = calib.lines().collect();
    let batches = lines
        .chunks(16)
        .map(|c| dense.tokenize(c))
        .collect::<Result<Vec<_>, _>>()?;
    let profile = ActivationRecorder::new(ProfileSettings {
        candidates: Vec::new(),
        ..ProfileSettings::default()
    })
    .record(dense.bert(), &batches, |m, (i, t, k)| {
        m.forward(i, Some(t), k).map(drop)
    })?;
    let golden: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
        root.join("fixtures/bert/minilm_golden.json"),
    )?)?;
    let sentences: Vec<&str> = golden["sentences"]
        .as_array()
        .ok_or("sentences")?
        .iter()
        .filter_map(|s| s.as_str())
        .collect();
    let want = dense.embed(&sentences)?;
    println!("| format | rounding | summed weighted error | mean cosine to f32 | min cosine |");
    println!("| --- | --- | --- | --- | --- |");
    for format in [
        Format::Nf4Block(GroupSize::G64),
        Format::Nf4Block(GroupSize::G128),
        Format::Int4Block(GroupSize::G64),
        Format::Int4Block(GroupSize::G128),
    ] {
        for aware in [false, true] {
            let mut m = dense.clone();
            let mut total = 0f64;
            for name in dense.bert().module_names() {
                let Some(ModuleRef::Linear(l)) = dense.bert().module(&name) else {
                    continue;
                };
                let (rows, cols) = l.shape();
                let w = l.weight_f32()?;
                let imp: Vec<f32> = profile.modules[&name]
                    .channel_mean_sq()
                    .iter()
                    .map(|v| *v as f32)
                    .collect();
                let q = if aware {
                    quantize_weighted(&w, rows, cols, format, &imp)?
                } else {
                    quantize(&w, rows, cols, format)?
                };
                let mut back = vec![0f32; w.len()];
                q.dequantize_into(&mut back)?;
                for (a, b) in w.chunks(cols).zip(back.chunks(cols)) {
                    total += a
                        .iter()
                        .zip(b)
                        .zip(&imp)
                        .map(|((x, y), i)| f64::from(*i) * f64::from(x - y).powi(2))
                        .sum::<f64>();
                }
                if let Some(ModuleMut::Linear(slot)) = m.bert_mut().module_mut(&name) {
                    slot.set_weight(Weight::Packed(Arc::new(q)))?;
                }
            }
            let got = m.embed(&sentences)?;
            let cos: Vec<f64> = got.iter().zip(&want).map(|(a, b)| cosine(a, b)).collect();
            println!(
                "| {format} | {} | {total:.3} | {:.5} | {:.5} |",
                if aware { "activation-aware" } else { "absmax" },
                cos.iter().sum::<f64>() / cos.len() as f64,
                cos.iter().copied().fold(f64::INFINITY, f64::min)
            );
        }
    }
    Ok(())
}
