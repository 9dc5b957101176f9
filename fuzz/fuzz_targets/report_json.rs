//! libFuzzer's entry for `report_json`; the body is `fuzz/bodies/report_json.rs`.
#![no_main]

#[path = "../bodies/report_json.rs"]
mod body;

libfuzzer_sys::fuzz_target!(|data: &[u8]| body::run(data));
