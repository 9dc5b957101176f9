//! libFuzzer's entry for `artifact`; the body is `fuzz/bodies/artifact.rs`.
#![no_main]

#[path = "../bodies/artifact.rs"]
mod body;

libfuzzer_sys::fuzz_target!(|data: &[u8]| body::run(data));
