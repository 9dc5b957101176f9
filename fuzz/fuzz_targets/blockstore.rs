//! Block-store bytes: parse (every size checked, every block verified), then decode every
//! row when the claimed size is small enough to hold.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(store) = compressme_blockstore::BlockStore::from_bytes(data) {
        if store.dense_bytes() <= 1 << 24 {
            let _ = store.decode_all();
            let rows = store.rows().min(64);
            let ids: Vec<u64> = (0..rows).rev().collect();
            let mut out = vec![0u8; ids.len() * store.row_bytes()];
            let _ = store.decode_rows(&ids, &mut out);
        }
    }
});
