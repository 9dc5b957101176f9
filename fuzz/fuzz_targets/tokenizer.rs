//! The tokenizer input path: arbitrary text through a decoder's byte-level BPE tokenizer
//! (the tiny Llama fixture's), encoded and decoded back through compressme's own
//! functions, as `evaluate --text` and `generate --prompt` do.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;

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

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Ok(ids) = compressme_nn::decoder::encode_text(tokenizer(), text.as_ref()) {
        let _ = compressme_nn::decoder::decode_ids(tokenizer(), &ids);
    }
});
