//! Integration tests for compressme-blockstore (one binary, topic modules).
#![allow(clippy::unwrap_used, clippy::indexing_slicing, missing_docs)] // tests

mod corruption;
mod fixtures;
mod roundtrip;

use compressme_blockstore::{BlockStore, Coder, EncodeOptions, ValueKind};

/// Naive gather: the rows `ids` of `data`, one after another.
pub fn naive_rows(data: &[u8], row_bytes: usize, ids: &[u64]) -> Vec<u8> {
    ids.iter()
        .flat_map(|&i| {
            data[i as usize * row_bytes..(i as usize + 1) * row_bytes]
                .iter()
                .copied()
        })
        .collect()
}

/// A deterministic, weight-like f32 table (smooth values, a few special ones).
pub fn weights_f32(rows: usize, cols: usize, seed: u32) -> Vec<u8> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    let mut out = Vec::with_capacity(rows * cols * 4);
    for i in 0..rows * cols {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        let u = (x as f32 / u32::MAX as f32) - 0.5;
        let v = match i % 97 {
            0 => f32::from_bits(0x7fc0_1234), // NaN with a payload
            1 => -0.0,
            2 => f32::from_bits(0x0000_0003), // subnormal
            3 => f32::NEG_INFINITY,
            _ => u * 0.1,
        };
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

pub fn store(
    data: &[u8],
    rows: u64,
    row_bytes: usize,
    kind: ValueKind,
    block_rows: usize,
    coder: Coder,
) -> BlockStore {
    BlockStore::encode(
        data,
        rows,
        row_bytes,
        &EncodeOptions::new(kind).block_rows(block_rows).coder(coder),
    )
    .unwrap()
}
