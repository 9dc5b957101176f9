//! Decodes every block of the MiniLM table (bf16 or f32) on one thread, many times, for a
//! profiler: `cargo run --release -p compressme-benches --example decode_profile -- MODEL bf16`.
use compressme_benches::{f32_to_bf16_bytes, load_tensor};
use compressme_blockstore::{BlockStore, EncodeOptions, ValueKind};

fn main() -> Result<(), String> {
    let model = std::env::args()
        .nth(1)
        .ok_or("usage: decode_profile MODEL.safetensors [f32|bf16]")?;
    let bf16 = std::env::args().nth(2).is_some_and(|k| k == "bf16");
    let (data, shape) = load_tensor(
        std::path::Path::new(&model),
        "embeddings.word_embeddings.weight",
    )?;
    let (data, kind, row_bytes) = if bf16 {
        (f32_to_bf16_bytes(&data), ValueKind::Bf16, shape[1] * 2)
    } else {
        (data, ValueKind::F32, shape[1] * 4)
    };
    let store = BlockStore::encode(&data, shape[0] as u64, row_bytes, &EncodeOptions::new(kind))
        .map_err(|e| e.to_string())?;
    let mut dec = store.decoder();
    let mut out = vec![0u8; 16 * row_bytes];
    let t = std::time::Instant::now();
    for _ in 0..20 {
        for b in 0..store.num_blocks() - 1 {
            dec.decode_block(b, &mut out).map_err(|e| e.to_string())?;
        }
    }
    println!(
        "{:.0} MB/s",
        20.0 * data.len() as f64 / t.elapsed().as_secs_f64() / 1e6
    );
    Ok(())
}
