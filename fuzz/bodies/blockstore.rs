//! Block-store bytes: parse (every size checked, every block verified), then decode every
//! row when the claimed size is small enough to hold; and read in place with block digests
//! skipped, so that mutated payloads (which no block digest would let through) reach the
//! Huffman and rANS decoders, which must refuse them with an error.
//!
//! The body of fuzz target `blockstore`: run by libFuzzer (`fuzz/fuzz_targets/blockstore.rs`) and by
//! the stable smoke test (`crates/compressme/tests/fuzz_smoke.rs`). It must not panic.

/// Runs the target on one input.
pub(crate) fn run(data: &[u8]) {
    if let Ok(store) = compressme_blockstore::BlockStore::from_bytes(data)
        && store.dense_bytes() <= 1 << 24
    {
        let _ = store.decode_all();
        let rows = store.rows().min(64);
        let ids: Vec<u64> = (0..rows).rev().collect();
        let mut out = vec![0u8; ids.len() * store.row_bytes()];
        let _ = store.decode_rows(&ids, &mut out);
    }
    let shared: compressme_blockstore::SharedBytes = std::sync::Arc::new(data.to_vec());
    if let Ok(mut store) = compressme_blockstore::BlockStore::from_shared(shared)
        && store.dense_bytes() <= 1 << 24
    {
        store.skip_block_digests();
        let _ = store.decode_all();
    }
}
