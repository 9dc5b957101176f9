//! GGUF bytes: the llama reader (metadata, tensors, the rotary permutation, the BPE
//! tokenizer built from the vocabulary), as `LanguageModel::from_gguf` reads a file.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut cursor = std::io::Cursor::new(data);
    let _ = compressme_nn::decoder::read_gguf(&mut cursor, std::path::Path::new("fuzz.gguf"));
});
