//! Encodes the MiniLM table on one thread, a few times, for a profiler to look at:
//! `cargo run --release -p compressme-benches --example encode_profile -- MODEL`.
use compressme_benches::load_tensor;
use compressme_blockstore::{BlockStore, EncodeOptions, ValueKind};

fn main() -> Result<(), String> {
    let model = std::env::args()
        .nth(1)
        .ok_or("usage: encode_profile MODEL.safetensors")?;
    let (data, shape) = load_tensor(
        std::path::Path::new(&model),
        "embeddings.word_embeddings.weight",
    )?;
    let mut opts = EncodeOptions::new(ValueKind::F32);
    opts.parallel = false;
    for _ in 0..5 {
        let s = BlockStore::encode(&data, shape[0] as u64, shape[1] * 4, &opts)
            .map_err(|e| e.to_string())?;
        std::hint::black_box(s);
    }
    Ok(())
}
