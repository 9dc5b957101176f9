//! One-thread encode and decode speed on a raw f32 region of a file (default: 46.9 MB of
//! all-MiniLM-L6-v2's data section). `cargo run --release --example encode_speed -- FILE`.
use compressme_blockstore::{BlockStore, EncodeOptions, ValueKind};
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args()
        .nth(1)
        .ok_or("usage: encode_speed FILE [bf16]")?;
    let bf16 = std::env::args().nth(2).is_some();
    let raw = std::fs::read(path)?;
    let row = 384 * 4;
    let rows = (raw.len() - 4096) / row;
    let rows = rows.min(30522);
    let mut data = raw[4096..4096 + rows * row].to_vec();
    let (kind, rb) = if bf16 {
        data = data.chunks_exact(4).flat_map(|c| [c[2], c[3]]).collect();
        (ValueKind::Bf16, 384 * 2)
    } else {
        (ValueKind::F32, row)
    };
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build()?;
    for _ in 0..6 {
        let t = Instant::now();
        let s =
            pool.install(|| BlockStore::encode(&data, rows as u64, rb, &EncodeOptions::new(kind)))?;
        let e = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let back = pool.install(|| s.decode_all())?;
        let d = t.elapsed().as_secs_f64();
        assert!(back == data);
        println!(
            "{} MB: encode {:.0} MB/s, decode {:.0} MB/s, ratio {:.4}",
            data.len() / 1_000_000,
            data.len() as f64 / e / 1e6,
            data.len() as f64 / d / 1e6,
            s.stored_bytes().total() as f64 / data.len() as f64
        );
    }
    Ok(())
}
