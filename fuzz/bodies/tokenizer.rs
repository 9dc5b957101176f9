//! The tokenizer input path: arbitrary text through a decoder's byte-level BPE tokenizer
//! (the tiny Llama fixture's), encoded and decoded back through compressme's own
//! functions, as `evaluate --text` and `generate --prompt` do.
//!
//! The body of fuzz target `tokenizer`: run by libFuzzer (`fuzz/fuzz_targets/tokenizer.rs`) and by
//! the stable smoke test (`crates/compressme/tests/fuzz_smoke.rs`). It must not panic.

use std::sync::OnceLock;

fn tokenizer() -> &'static tokenizers::Tokenizer {
    static T: OnceLock<tokenizers::Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let json = include_str!("../../fixtures/decoders/llama-gqa/tokenizer.json");
        compressme_nn::decoder::tokenizer_from_json(
            json,
            1 << 20,
            std::path::Path::new("tokenizer.json"),
        )
        .expect("the fixture's tokenizer")
    })
}

/// Runs the target on one input.
pub(crate) fn run(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    if let Ok(ids) = compressme_nn::decoder::encode_text(tokenizer(), text.as_ref()) {
        let _ = compressme_nn::decoder::decode_ids(tokenizer(), &ids);
    }
}
