//! libFuzzer's entry for `gguf`; the body is `fuzz/bodies/gguf.rs`.
#![no_main]

#[path = "../bodies/gguf.rs"]
mod body;

libfuzzer_sys::fuzz_target!(|data: &[u8]| body::run(data));
