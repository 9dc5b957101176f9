//! libFuzzer's entry for `blockstore`; the body is `fuzz/bodies/blockstore.rs`.
#![no_main]

#[path = "../bodies/blockstore.rs"]
mod body;

libfuzzer_sys::fuzz_target!(|data: &[u8]| body::run(data));
