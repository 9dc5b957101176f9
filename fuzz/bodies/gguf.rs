//! GGUF bytes: the llama reader (metadata, tensors, the rotary permutation, the BPE
//! tokenizer built from the vocabulary), as `LanguageModel::from_gguf` reads a file.
//!
//! The body of fuzz target `gguf`: run by libFuzzer (`fuzz/fuzz_targets/gguf.rs`) and by
//! the stable smoke test (`crates/compressme/tests/fuzz_smoke.rs`). It must not panic.

/// Runs the target on one input.
pub(crate) fn run(data: &[u8]) {
    let mut cursor = std::io::Cursor::new(data);
    let _ = compressme_nn::decoder::read_gguf(&mut cursor, std::path::Path::new("fuzz.gguf"));
}
