//! libFuzzer's entry for `tokenizer`; the body is `fuzz/bodies/tokenizer.rs`.
#![no_main]

#[path = "../bodies/tokenizer.rs"]
mod body;

libfuzzer_sys::fuzz_target!(|data: &[u8]| body::run(data));
