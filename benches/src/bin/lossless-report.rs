//! The lossless figures of docs/BENCHMARKS.md, from one run:
//! `cargo run --release -p compressme-benches --bin lossless-report -- MODEL.safetensors OUT.json`
//! (or `cargo xtask bench-lossless`, which adds the Python peers on the same bytes).
//!
//! Speeds are one thread unless labelled otherwise; lookup times are ratios to candle's
//! `index_select` measured in the same loop.

use std::time::Instant;

use candle_core::{DType, Device, Module, Tensor};
use compressme_benches::{f32_to_bf16_bytes, load_tensor, median_time, random_ids};
use compressme_blockstore::{BlockStore, Coder, EncodeOptions, ValueKind};
use compressme_nn::{PackOptions, PackedFrozenEmbedding};
use compressme_shuffle::ElementSize;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

const TABLE: &str = "embeddings.word_embeddings.weight";

fn one_thread<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    match rayon::ThreadPoolBuilder::new().num_threads(1).build() {
        Ok(pool) => pool.install(f),
        Err(_) => f(),
    }
}

fn mbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e6
}

/// Encodes on one thread, decodes every block on one thread (no hashing), and reports.
fn measure(
    data: &[u8],
    rows: u64,
    row_bytes: usize,
    kind: ValueKind,
    block_rows: usize,
    coder: Coder,
    row_index: bool,
) -> Value {
    let mut opts = EncodeOptions::new(kind)
        .block_rows(block_rows)
        .coder(coder)
        .row_index(row_index);
    opts.parallel = false;
    let t = Instant::now();
    let store = one_thread(|| BlockStore::encode(data, rows, row_bytes, &opts)).expect("encode");
    let enc = t.elapsed().as_secs_f64(); // includes the SHA-256 of every block
    let mut out = vec![0u8; block_rows * row_bytes];
    let mut dec = store.decoder();
    let reps = 3;
    let mut best = f64::MAX;
    for _ in 0..reps {
        let t = Instant::now();
        for b in 0..store.num_blocks() {
            let in_block = (rows - (b * block_rows) as u64).min(block_rows as u64) as usize;
            let dst = &mut out[..in_block * row_bytes];
            dec.decode_block(b, dst).expect("decode");
            std::hint::black_box(dst);
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    assert_eq!(store.decode_all().expect("decode"), data, "round trip");
    let s = store.stored_bytes();
    json!({
        "kind": format!("{kind:?}"), "block_rows": block_rows, "coder": format!("{coder:?}"), "row_index": row_index,
        "ratio": store.ratio(), "stored": s.total(), "dense": store.dense_bytes(),
        "payload": s.payload, "digests": s.digests, "offsets": s.offsets, "tables": s.tables,
        "encode_mb_s_1t": mbps(data.len(), enc), "decode_mb_s_1t": mbps(data.len(), best),
    })
}

/// The seed's recipe: shuffle a block (no sign move), one zstd frame over it.
fn seed_recipe(
    data: &[u8],
    row_bytes: usize,
    size: ElementSize,
    block_rows: usize,
    level: i32,
) -> Value {
    let t = Instant::now();
    let payload: usize = data
        .chunks(block_rows * row_bytes)
        .map(|b| {
            zstd::bulk::compress(&compressme_shuffle::shuffle(size, b), level)
                .expect("zstd")
                .len()
        })
        .sum();
    let enc = t.elapsed().as_secs_f64();
    let blocks = data.len().div_ceil(block_rows * row_bytes);
    json!({
        "recipe": "seed: shuffle + one zstd frame per block", "level": level, "block_rows": block_rows,
        "ratio_payload_only": payload as f64 / data.len() as f64,
        "ratio_with_offsets_and_digests": (payload + blocks * 40) as f64 / data.len() as f64,
        "encode_mb_s_1t": mbps(data.len(), enc),
    })
}

fn lookup(table: &Tensor, label: &str, ids: Vec<u32>, reps: usize, row_index: bool) -> Value {
    let opts = PackOptions {
        row_index,
        ..PackOptions::default()
    };
    let packed = PackedFrozenEmbedding::new(table, &opts).expect("pack");
    let ids = Tensor::from_vec(ids, (32, 128), &Device::Cpu).expect("ids");
    let flat = ids.flatten_all().expect("flat");
    let p = median_time(reps, || {
        std::hint::black_box(packed.forward(&ids).expect("lookup"));
    });
    let i = median_time(reps, || {
        std::hint::black_box(
            table
                .index_select(&flat, 0)
                .expect("index_select")
                .reshape((32, 128, ()))
                .expect("reshape"),
        );
    });
    json!({
        "ids": label, "dtype": format!("{:?}", table.dtype()), "row_index": row_index, "packed_ms": p.as_secs_f64() * 1e3,
        "index_select_ms": i.as_secs_f64() * 1e3, "ratio": p.as_secs_f64() / i.as_secs_f64(),
    })
}

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().collect();
    let model = args
        .get(1)
        .ok_or("usage: lossless-report MODEL.safetensors OUT.json")?;
    let out = args
        .get(2)
        .ok_or("usage: lossless-report MODEL.safetensors OUT.json")?;
    let (f32s, shape) = load_tensor(std::path::Path::new(model), TABLE)?;
    let (rows, cols) = (shape[0] as u64, shape[1]);
    let bf16 = f32_to_bf16_bytes(&f32s);
    let cases = [
        (ValueKind::F32, &f32s, cols * 4, ElementSize::Four),
        (ValueKind::Bf16, &bf16, cols * 2, ElementSize::Two),
    ];

    // QUICK=1: only the default setting, for iterating on speed
    let quick = std::env::var_os("QUICK").is_some();
    let mut ours = Vec::new();
    let mut seed = Vec::new();
    for (kind, data, row_bytes, size) in cases {
        for block_rows in if quick {
            vec![16]
        } else {
            vec![4, 16, 64, 256]
        } {
            let mut coders = vec![
                Coder::SharedHuffman { max_tables: 4 },
                Coder::SharedRans { max_tables: 4 },
            ];
            if !quick {
                coders.push(Coder::Zstd { level: 1 });
            }
            if block_rows == 16 && !quick {
                coders.extend([
                    Coder::SharedHuffman { max_tables: 1 },
                    Coder::SharedHuffman { max_tables: 16 },
                    Coder::Zstd { level: 3 },
                    Coder::Zstd { level: 19 },
                ]);
            }
            for coder in coders {
                let m = measure(data, rows, row_bytes, kind, block_rows, coder, false);
                eprintln!("{m}");
                ours.push(m);
            }
            let m = measure(
                data,
                rows,
                row_bytes,
                kind,
                block_rows,
                Coder::default(),
                true,
            );
            eprintln!("{m}");
            ours.push(m);
        }
        for level in if quick { vec![] } else { vec![1, 3, 19] } {
            let s = seed_recipe(data, row_bytes, size, 16, level);
            eprintln!("{kind:?} {s}");
            seed.push(json!({"kind": format!("{kind:?}"), "result": s}));
        }
    }

    // hashing throughput: verify_all (SHA-256 of every block) on one thread and on all
    // cores, best of 3; the sha2 crate picks the CPU's SHA extensions at run time
    let store = BlockStore::encode(&f32s, rows, cols * 4, &EncodeOptions::new(ValueKind::F32))
        .map_err(|e| e.to_string())?;
    let stored = store.stored_bytes().payload as usize;
    let best_verify = || -> Result<f64, String> {
        let mut best = f64::MAX;
        for _ in 0..3 {
            let t = Instant::now();
            store.verify_all().map_err(|e| e.to_string())?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        Ok(mbps(stored, best))
    };
    let sha = one_thread(best_verify)?;
    let verify_all = best_verify()?;
    let t = Instant::now();
    let d: [u8; 32] = Sha256::digest(&f32s).into();
    std::hint::black_box(d);
    let sha_one_buffer = mbps(f32s.len(), t.elapsed().as_secs_f64());

    // lookups: 32x128 random ids, and 32x128 ids drawn from 64 distinct rows (repeats)
    let table = Tensor::from_raw_buffer(&f32s, DType::F32, &[rows as usize, cols], &Device::Cpu)
        .map_err(|e| e.to_string())?;
    let table_bf16 = table.to_dtype(DType::BF16).map_err(|e| e.to_string())?;
    let random = random_ids(32 * 128, rows, 7);
    let few: Vec<u32> = random_ids(64, rows, 9);
    let repeated: Vec<u32> = random_ids(32 * 128, 64, 11)
        .into_iter()
        .map(|i| few[i as usize])
        .collect();
    let lookups: Vec<Value> = one_thread(|| {
        let mut v = Vec::new();
        for row_index in [true, false] {
            v.push(lookup(
                &table,
                "32x128 random",
                random.clone(),
                101,
                row_index,
            ));
            v.push(lookup(
                &table,
                "32x128 repeated (64 distinct)",
                repeated.clone(),
                101,
                row_index,
            ));
            v.push(lookup(
                &table_bf16,
                "32x128 random",
                random.clone(),
                101,
                row_index,
            ));
        }
        v
    });
    for l in &lookups {
        eprintln!("{l}");
    }
    let report = json!({
        "table": TABLE, "rows": rows, "cols": cols, "ours": ours, "seed_recipe": seed,
        "sha256_mb_s_1t": sha, "verify_all_mb_s_all_cores": verify_all,
        "sha256_one_47mb_buffer_mb_s": sha_one_buffer, "lookups": lookups,
    });
    std::fs::write(
        out,
        serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?,
    )
    .map_err(|e| e.to_string())?;
    println!("wrote {out}");
    Ok(())
}
