//! Benchmark report JSON (synthetic and real), then what `bench --replay` and the
//! table and chart writers do with one: compare it with itself, render it.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(r) = compressme_offline::Report::from_json(text) {
        let _ = compressme_offline::compare(&r, &r, compressme_offline::Tolerance::default());
        let _ = compressme_offline::markdown(&r);
        let _ = compressme_offline::svg_chart(&r);
    }
});
