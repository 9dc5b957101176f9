//! Times a 32x128 random lookup on the main thread and inside a one-thread rayon pool, to
//! see what the allocator does to it: `cargo run --release -p compressme-benches --example lookup_alloc -- MODEL`.
use candle_core::{DType, Device, Module, Tensor};
use compressme_benches::{load_tensor, median_time, random_ids};
use compressme_nn::{PackOptions, PackedFrozenEmbedding};

fn main() -> Result<(), String> {
    let model = std::env::args()
        .nth(1)
        .ok_or("usage: lookup_alloc MODEL.safetensors")?;
    let (data, shape) = load_tensor(
        std::path::Path::new(&model),
        "embeddings.word_embeddings.weight",
    )?;
    let table = Tensor::from_raw_buffer(&data, DType::F32, &shape, &Device::Cpu)
        .map_err(|e| e.to_string())?;
    let packed =
        PackedFrozenEmbedding::new(&table, &PackOptions::default()).map_err(|e| e.to_string())?;
    let ids = Tensor::from_vec(
        random_ids(4096, shape[0] as u64, 7),
        (32, 128),
        &Device::Cpu,
    )
    .map_err(|e| e.to_string())?;
    let flat = ids.flatten_all().map_err(|e| e.to_string())?;
    let run = || {
        let p = median_time(101, || {
            drop(std::hint::black_box(packed.forward(&ids).expect("lookup")))
        });
        let i = median_time(101, || {
            drop(std::hint::black_box(
                table.index_select(&flat, 0).expect("index_select"),
            ))
        });
        format!(
            "packed {:.2} ms, index_select {:.2} ms, {:.1}x",
            p.as_secs_f64() * 1e3,
            i.as_secs_f64() * 1e3,
            p.as_secs_f64() / i.as_secs_f64()
        )
    };
    println!("main thread: {}", run());
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .map_err(|e| e.to_string())?;
    println!("rayon worker: {}", pool.install(run));
    Ok(())
}
