//! Benchmark report JSON (synthetic and real), then what `bench --replay` and the
//! table and chart writers do with one: compare it with itself, render it.
//!
//! The body of fuzz target `report_json`: run by libFuzzer (`fuzz/fuzz_targets/report_json.rs`) and by
//! the stable smoke test (`crates/compressme/tests/fuzz_smoke.rs`). It must not panic.

/// Runs the target on one input.
pub(crate) fn run(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(r) = compressme_offline::Report::from_json(text) {
        let _ = compressme_offline::compare(&r, &r, compressme_offline::Tolerance::default());
        let _ = compressme_offline::markdown(&r);
        let _ = compressme_offline::svg_chart(&r);
    }
}
