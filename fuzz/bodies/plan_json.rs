//! Plan JSON (versions 0 and 1), then validation against a fixed set of shapes.
//!
//! The body of fuzz target `plan_json`: run by libFuzzer (`fuzz/fuzz_targets/plan_json.rs`) and by
//! the stable smoke test (`crates/compressme/tests/fuzz_smoke.rs`). It must not panic.

/// Runs the target on one input.
pub(crate) fn run(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(plan) = compressme_plan::Plan::from_json(text) {
        let mut shapes = std::collections::BTreeMap::new();
        for (name, rows, cols, embedding) in [
            ("lm_head", 16, 32, false),
            ("layers.0.attn.q", 32, 32, false),
            ("tok_embeddings", 16, 32, true),
        ] {
            shapes.insert(
                name.to_string(),
                compressme_plan::ModuleShape {
                    rows,
                    cols,
                    embedding,
                },
            );
        }
        let _ = plan.validate(&shapes);
        let _ = plan.to_json();
        let _ = plan.shuffled(&shapes, 1);
    }
}
