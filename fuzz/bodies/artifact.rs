//! Artifact bytes: open (header, recipe, decoded-size limits), inspect every tensor's
//! sizes, verify, and unpack, as `inspect`, `verify` and `unpack` do. The limits are
//! tightened so a claim that passes them stays cheap to decode.
//!
//! The body of fuzz target `artifact`: run by libFuzzer (`fuzz/fuzz_targets/artifact.rs`) and by
//! the stable smoke test (`crates/compressme/tests/fuzz_smoke.rs`). It must not panic.

use std::io::Write;

use compressme_artifact::{Artifact, Limits};

/// Runs the target on one input.
pub(crate) fn run(data: &[u8]) {
    let dir = std::env::temp_dir().join(format!("cm-fuzz-artifact-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    let path = dir.join("input.cma");
    let Ok(mut f) = std::fs::File::create(&path) else {
        return;
    };
    if f.write_all(data).is_err() {
        return;
    }
    drop(f);
    let limits = Limits {
        max_decoded_total: 1 << 26,
        max_decoded_tensor: 1 << 26,
        ..Limits::default()
    };
    if let Ok(mut a) = Artifact::open(&path, &limits) {
        for t in a.recipe().tensors.clone() {
            let _ = a.expansion(&t);
            let _ = a.read_stored(&t.name);
        }
        let _ = a.verify();
        let _ = compressme_artifact::unpack(
            &mut a,
            &dir.join("out.safetensors"),
            compressme_artifact::Durability::Cached,
            |_, _| {},
        );
    }
}
