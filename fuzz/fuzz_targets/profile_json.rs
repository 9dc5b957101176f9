//! libFuzzer's entry for `profile_json`; the body is `fuzz/bodies/profile_json.rs`.
#![no_main]

#[path = "../bodies/profile_json.rs"]
mod body;

libfuzzer_sys::fuzz_target!(|data: &[u8]| body::run(data));
