//! SmolLM2-135M-Instruct, the pretrained decoder `cargo xtask fixtures` fetches into
//! `cache/smollm2/` (a Q4_1 GGUF; its weights dequantized to f32 are the reference), against
//! transformers' token ids and logits on a dozen passages of Persuasion
//! (`fixtures/decoders/smollm2_golden.json`). Fails, saying how to fetch it, when the file
//! is absent, unless `COMPRESSME_SKIP_FIXTURES` is set (then it says it skipped).

use std::path::PathBuf;

use candle_core::Device;
use compressme_nn::Model;
use compressme_nn::decoder::{Family, LanguageModel};

/// The SmolLM2 GGUF, or `None` (with a printed reason) when it is absent and not required.
pub(crate) fn smollm2() -> Option<PathBuf> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../cache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    if path.exists() {
        return Some(path);
    }
    assert!(
        std::env::var_os("COMPRESSME_SKIP_FIXTURES").is_some(),
        "{} is missing; run `cargo xtask fixtures` (or set COMPRESSME_SKIP_FIXTURES=1 to skip the tests that need it)",
        path.display()
    );
    eprintln!(
        "skipped (COMPRESSME_SKIP_FIXTURES): {} is absent",
        path.display()
    );
    None
}

#[test]
fn real_decoder_smollm2_gguf_matches_transformers_ids_and_logits() {
    let Some(path) = smollm2() else { return };
    let lm = LanguageModel::open(&path, &Device::Cpu).unwrap();
    let c = lm.model.config();
    assert_eq!(c.family, Family::Llama);
    assert_eq!(
        (
            c.layers,
            c.hidden,
            c.heads,
            c.kv_heads,
            c.vocab,
            c.intermediate
        ),
        (30, 576, 9, 3, 49152, 1536)
    );
    assert!(c.tie_embeddings);
    assert_eq!((c.rope_theta, c.context), (100000.0, 8192));
    assert_eq!(lm.source.kind, "gguf");
    assert_eq!(
        lm.source.sha256,
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    );
    // the grids the weights sit on, as the file stores them
    assert_eq!(
        lm.source_types["model.layers.0.mlp.down_proj.weight"],
        "q4_1"
    );
    assert_eq!(lm.source_types["model.embed_tokens.weight"], "q8_0");
    assert_eq!(lm.source_types["model.norm.weight"], "f32");
    assert_eq!(
        lm.model.output_heads(),
        vec!["model.embed_tokens".to_string()]
    );
    assert_eq!(lm.model.module_names().len(), 1 + 30 * 7);

    let g: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../fixtures/decoders/smollm2_golden.json"),
        )
        .unwrap(),
    )
    .unwrap();
    assert_eq!(g["gguf_sha256"], lm.source.sha256.as_str());
    let probe: Vec<usize> = serde_json::from_value(g["probe_ids"].clone()).unwrap();
    let (mut worst, mut argmax_same, mut positions) = (0f64, 0usize, 0usize);
    for p in g["passages"].as_array().unwrap() {
        let text = p["text"].as_str().unwrap();
        let want: Vec<u32> = serde_json::from_value(p["ids"].clone()).unwrap();
        let ids = lm.encode(text).unwrap();
        assert_eq!(ids, want, "token ids of {text:?}");
        assert_eq!(
            lm.decode(&ids).unwrap(),
            text,
            "decoding gives the text back"
        );
        let rows = lm.model.logit_rows(&ids).unwrap();
        let lse: Vec<f64> = serde_json::from_value(p["lse"].clone()).unwrap();
        let argmax: Vec<usize> = serde_json::from_value(p["argmax"].clone()).unwrap();
        let probes: Vec<Vec<f64>> = serde_json::from_value(p["probe_logits"].clone()).unwrap();
        for (t, row) in rows.iter().enumerate() {
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let ours_lse = f64::from(max)
                + row
                    .iter()
                    .map(|&v| f64::from(v - max).exp())
                    .sum::<f64>()
                    .ln();
            worst = worst.max((ours_lse - lse[t]).abs());
            for (&id, &want) in probe.iter().zip(&probes[t]) {
                worst = worst.max((f64::from(row[id]) - want).abs());
            }
            let ours = row
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map(|(i, _)| i)
                .unwrap();
            argmax_same += usize::from(ours == argmax[t]);
            positions += 1;
        }
    }
    eprintln!(
        "SmolLM2: max |ours - transformers| over {positions} positions = {worst:.2e}; arg max the same at {argmax_same}"
    );
    assert!(worst < 1e-3, "max logit difference {worst}");
    assert_eq!(argmax_same, positions, "arg max differs somewhere");
}
