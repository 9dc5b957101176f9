//! GPTQ rounding on a real decoder, against the rounding a stored artifact used: records
//! every linear's input Gram matrix on calibration windows of the f32 model, then writes
//! an artifact that stores each tensor as `TEMPLATE` does (the same format for every
//! quantized tensor, dense otherwise) with its weights rounded by
//! `compressme_quant::quantize_gptq` instead.
//!
//! ```sh
//! cargo run --release -p compressme-benches --example gptq_probe -- \
//!     cache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf cache/austen/emma.txt 16 \
//!     target/offline/nf4-g64.cma target/gptq/nf4-g64-gptq.cma [DAMP]
//! compressme evaluate target/gptq/nf4-g64-gptq.cma --reference target/offline/f32.cma \
//!     --text cache/austen/persuasion.txt --max-tokens 8192 --json
//! ```
//!
//! The windows are those of `bench-real`'s calibration (`WINDOWS` of 512 tokens from the
//! start of the text), so the comparison with its variants is like for like.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use candle_core::{Device, Tensor};
use compressme_artifact::{Artifact, Dtype, Limits, StorageRecipe, Writer};
use compressme_nn::LanguageModel;
use compressme_quant::Format;
use rayon::prelude::*;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (model, text, windows, template, out, damp) = match args.as_slice() {
        [m, t, w, tp, o] => (m, t, w.parse::<usize>()?, tp, o, 0.01),
        [m, t, w, tp, o, d] => (m, t, w.parse::<usize>()?, tp, o, d.parse::<f64>()?),
        _ => {
            return Err(
                "usage: gptq_probe MODEL.gguf TEXT WINDOWS TEMPLATE.cma OUT.cma [DAMP]".into(),
            );
        }
    };
    let t0 = Instant::now();
    let lm = LanguageModel::open(Path::new(model), &Device::Cpu)?;
    let tpl = Artifact::open(Path::new(template), &Limits::default())?;
    let formats: BTreeMap<String, Format> = tpl
        .recipe()
        .tensors
        .iter()
        .filter_map(|t| match &t.storage {
            StorageRecipe::Quant { format, .. } => Some((t.name.clone(), format.clone())),
            _ => None,
        })
        .map(|(n, f)| Format::parse(&f).map(|f| (n, f)))
        .collect::<Result<_, _>>()?;
    let tensors = lm.model.tensors()?;
    let ids = lm.encode(&std::fs::read_to_string(text)?)?;
    let batches: Vec<Tensor> = ids
        .chunks_exact(512)
        .take(windows)
        .map(|w| Tensor::new(w, &Device::Cpu).and_then(|t| t.unsqueeze(0)))
        .collect::<Result<_, _>>()?;
    let factors = compressme_profile::gptq_factors(
        &lm.model,
        &batches,
        candle_core::utils::get_num_threads(),
        |m, ids| m.observe(ids),
        damp,
    )?;
    eprintln!(
        "{} factors from {} windows in {:.1} s",
        factors.len(),
        batches.len(),
        t0.elapsed().as_secs_f64()
    );
    let t1 = Instant::now();
    let packed: Vec<Option<compressme_quant::Packed>> = tensors
        .par_iter()
        .map(|(name, t)| -> Result<_, String> {
            let (Some(&f), Some(m)) = (formats.get(name), name.strip_suffix(".weight")) else {
                return Ok(None);
            };
            let factor = factors
                .get(m)
                .ok_or_else(|| format!("{m}: no inputs seen"))?;
            let (rows, cols) = t.dims2().map_err(|e| e.to_string())?;
            let w = t
                .flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(|e| e.to_string())?;
            compressme_quant::quantize_gptq(&w, rows, cols, f, factor)
                .map(Some)
                .map_err(|e| format!("{name}: {e}"))
        })
        .collect::<Result<_, _>>()?;
    eprintln!("rounded in {:.1} s", t1.elapsed().as_secs_f64());
    let mut w = Writer::create(Path::new(out))?;
    w.recipe_mut().source_metadata = lm.artifact_metadata()?;
    for ((name, t), p) in tensors.iter().zip(&packed) {
        let shape = t.dims().to_vec();
        match p {
            Some(p) => {
                w.add_packed(name, Dtype::F32, &shape, p)?;
            }
            None => {
                let v = t.flatten_all()?.to_vec1::<f32>()?;
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                w.add_dense(name, Dtype::F32, &shape, &bytes)?;
            }
        }
    }
    let s = w.finish()?;
    println!(
        "{out}: {} quantized tensors as {template} stores them, GPTQ-rounded (damping {damp}) on {windows} windows of {text}; {} stored bytes; {:.1} s",
        formats.len(),
        s.stored_bytes,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
