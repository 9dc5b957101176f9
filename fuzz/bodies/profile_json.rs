//! Profile JSON, then every plan made from it (thresholds, a budget, its shuffle).
//!
//! The body of fuzz target `profile_json`: run by libFuzzer (`fuzz/fuzz_targets/profile_json.rs`) and by
//! the stable smoke test (`crates/compressme/tests/fuzz_smoke.rs`). It must not panic.

/// Runs the target on one input.
pub(crate) fn run(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(p) = compressme_profile::Profile::from_json(text) {
        let policy = compressme_plan::Policy::default();
        let t = compressme_plan::Plan::from_importance(&p, policy.clone());
        let shapes = compressme_plan::shapes(&p);
        let _ = t.validate(&shapes);
        if p.modules.len() <= 64 {
            let candidates = compressme_profile::default_candidates();
            if let Ok(b) = compressme_plan::Plan::within_budget(&p, &candidates, 1 << 20, policy) {
                let _ = b.shuffled(&shapes, 3);
            }
        }
        let _ = p.to_json();
    }
}
