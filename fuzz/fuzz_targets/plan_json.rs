//! libFuzzer's entry for `plan_json`; the body is `fuzz/bodies/plan_json.rs`.
#![no_main]

#[path = "../bodies/plan_json.rs"]
mod body;

libfuzzer_sys::fuzz_target!(|data: &[u8]| body::run(data));
