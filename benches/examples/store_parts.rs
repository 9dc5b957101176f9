//! What a lossless checkpoint's block stores are made of, summed over its float tensors:
//! header, tables, block lengths, digests and payload, at `compressme pack`'s defaults
//! (64-row blocks, 4 Huffman tables a plane) or with TABLES / CODER=rans from the
//! environment. `cargo run --release -p compressme-benches --example store_parts -- CKPT`
use compressme_artifact::{Checkpoint, Dtype, Limits};
use compressme_blockstore::{BlockStore, Coder, EncodeOptions, StoredBytes, ValueKind};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args()
        .nth(1)
        .ok_or("usage: store_parts CHECKPOINT")?;
    let ckpt = Checkpoint::open(std::path::Path::new(&path), &Limits::default())?;
    let t: u8 = std::env::var("TABLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    let rans = std::env::var("CODER").is_ok_and(|c| c == "rans");
    let mut sum = StoredBytes::default();
    let (mut dense, mut small) = (0u64, 0u64);
    for e in ckpt.entries().cloned().collect::<Vec<_>>() {
        let kind = match e.dtype {
            Dtype::F32 => ValueKind::F32,
            Dtype::Bf16 => ValueKind::Bf16,
            _ => continue,
        };
        let bytes = ckpt.read(&e.name)?;
        dense += bytes.len() as u64;
        let rows = e.shape.first().copied().unwrap_or(1).max(1);
        let coder = if rans {
            Coder::SharedRans { max_tables: t }
        } else {
            Coder::SharedHuffman { max_tables: t }
        };
        let o = EncodeOptions::new(kind).block_rows(64).coder(coder);
        let s = BlockStore::encode(&bytes, rows as u64, bytes.len() / rows, &o)?.stored_bytes();
        if bytes.len() < 8192 {
            small += s.total();
        }
        sum = StoredBytes {
            header: sum.header + s.header,
            tables: sum.tables + s.tables,
            offsets: sum.offsets + s.offsets,
            digests: sum.digests + s.digests,
            payload: sum.payload + s.payload,
        };
    }
    let f = |x: u64| x as f64 / dense as f64;
    println!(
        "dense {dense}: total {:.5}, header {:.5}, tables {:.5}, offsets {:.5}, digests {:.5}, payload {:.5}; tensors under 8 KiB {:.5}",
        f(sum.total()),
        f(sum.header),
        f(sum.tables),
        f(sum.offsets),
        f(sum.digests),
        f(sum.payload),
        f(small)
    );
    Ok(())
}
