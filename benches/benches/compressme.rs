//! One criterion binary, a suite per crate: `cargo bench -p compressme-benches`.
//! Suites are named `group/variant/size`; every suite measures a peer in the same run
//! (memcpy, plain `index_select`), since absolute times drift on a shared machine.
//!
//! Uses the real MiniLM word-embedding table when `cargo xtask fixtures` has fetched it,
//! otherwise a generated weight-like table of the same shape.
#![allow(missing_docs)] // criterion's macros generate undocumented items

use std::hint::black_box;
use std::path::Path;

use candle_core::{DType, Device, Module, Tensor};
use compressme_benches::{f32_to_bf16_bytes, load_tensor, random_ids};
use compressme_blockstore::{BlockStore, EncodeOptions, ValueKind};
use compressme_nn::{PackOptions, PackedFrozenEmbedding};
use compressme_shuffle::{ElementSize, scalar, shuffle_into, unshuffle_into};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};

const ROWS: usize = 30522;
const COLS: usize = 384;

/// The MiniLM table, or a generated stand-in of the same shape (Gaussian-like values).
fn table_f32() -> Vec<u8> {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../cache/minilm/model.safetensors");
    if let Ok((bytes, _)) = load_tensor(&model, "embeddings.word_embeddings.weight") {
        return bytes;
    }
    eprintln!(
        "benches: {} absent, using a generated table",
        model.display()
    );
    let mut x = 0x2545_f491_4f6c_dd1du64;
    (0..ROWS * COLS)
        .flat_map(|_| {
            let mut s = 0.0f32;
            for _ in 0..4 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                s += (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            }
            (s * 0.05).to_le_bytes()
        })
        .collect()
}

fn shuffle_suite(c: &mut Criterion) {
    let src: Vec<u8> = (0..1 << 20)
        .map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let mut dst = vec![0u8; src.len()];
    let mut g = c.benchmark_group("shuffle");
    g.throughput(Throughput::Bytes(src.len() as u64));
    for size in [ElementSize::Two, ElementSize::Four] {
        let n = size.bytes();
        g.bench_function(BenchmarkId::new(format!("fast-{n}"), "1MiB"), |b| {
            b.iter(|| shuffle_into(size, black_box(&src), &mut dst))
        });
        g.bench_function(
            BenchmarkId::new(format!("unshuffle-fast-{n}"), "1MiB"),
            |b| b.iter(|| unshuffle_into(size, black_box(&src), &mut dst)),
        );
        g.bench_function(BenchmarkId::new(format!("scalar-{n}"), "1MiB"), |b| {
            b.iter(|| scalar::shuffle_into(size, black_box(&src), &mut dst))
        });
    }
    g.bench_function(BenchmarkId::new("memcpy", "1MiB"), |b| {
        b.iter(|| dst.copy_from_slice(black_box(&src)))
    });
    g.finish();
}

fn blockstore_suite(c: &mut Criterion) {
    let f32s = table_f32();
    // 4096 rows (6 MiB f32) keep one iteration short
    let rows = 4096usize;
    let f32s = &f32s[..rows * COLS * 4];
    let bf16 = f32_to_bf16_bytes(f32s);
    let mut g = c.benchmark_group("blockstore");
    g.sample_size(20);
    for (name, kind, data, row_bytes) in [
        ("f32", ValueKind::F32, f32s, COLS * 4),
        ("bf16", ValueKind::Bf16, bf16.as_slice(), COLS * 2),
    ] {
        g.throughput(Throughput::Bytes(data.len() as u64));
        let mut opts = EncodeOptions::new(kind);
        opts.parallel = false;
        g.bench_function(
            BenchmarkId::new(format!("encode-1t/{name}"), "16rows"),
            |b| b.iter(|| BlockStore::encode(black_box(data), rows as u64, row_bytes, &opts)),
        );
        let store = BlockStore::encode(data, rows as u64, row_bytes, &opts).expect("encode");
        let mut out = vec![0u8; 16 * row_bytes];
        g.bench_function(
            BenchmarkId::new(format!("decode-1t/{name}"), "16rows"),
            |b| {
                let mut dec = store.decoder();
                b.iter(|| {
                    for blk in 0..store.num_blocks() {
                        dec.decode_block(blk, &mut out).expect("decode");
                    }
                })
            },
        );
        g.bench_function(
            BenchmarkId::new(format!("verify-all/{name}"), "16rows"),
            |b| b.iter(|| store.verify_all()),
        );
        g.bench_function(BenchmarkId::new(format!("memcpy/{name}"), "16rows"), |b| {
            let mut copy = vec![0u8; data.len()];
            b.iter(|| copy.copy_from_slice(black_box(data)))
        });
    }
    g.finish();
}

fn embedding_suite(c: &mut Criterion) {
    let f32s = table_f32();
    let dev = Device::Cpu;
    let table = Tensor::from_raw_buffer(&f32s, DType::F32, &[ROWS, COLS], &dev).expect("table");
    let packed = PackedFrozenEmbedding::new(&table, &PackOptions::default()).expect("pack");
    let compact = PackedFrozenEmbedding::new(
        &table,
        &PackOptions {
            row_index: false,
            ..PackOptions::default()
        },
    )
    .expect("pack");
    let few = random_ids(64, ROWS as u64, 9);
    let cases = [
        ("random", random_ids(32 * 128, ROWS as u64, 7)),
        (
            "repeated",
            random_ids(32 * 128, 64, 11)
                .into_iter()
                .map(|i| few[i as usize])
                .collect(),
        ),
    ];
    let mut g = c.benchmark_group("embedding");
    g.throughput(Throughput::Bytes((32 * 128 * COLS * 4) as u64));
    for (name, ids) in cases {
        let ids = Tensor::from_vec(ids, (32, 128), &dev).expect("ids");
        let flat = ids.flatten_all().expect("flat");
        g.bench_function(
            BenchmarkId::new(format!("packed-row-index/{name}"), "32x128"),
            |b| b.iter(|| packed.forward(black_box(&ids))),
        );
        g.bench_function(
            BenchmarkId::new(format!("packed-compact/{name}"), "32x128"),
            |b| b.iter(|| compact.forward(black_box(&ids))),
        );
        g.bench_function(
            BenchmarkId::new(format!("index_select/{name}"), "32x128"),
            |b| {
                b.iter(|| {
                    table
                        .index_select(black_box(&flat), 0)
                        .and_then(|t| t.reshape((32, 128, COLS)))
                })
            },
        );
    }
    g.finish();
}

/// `y = x W^T` for W 4096 x 4096 at batch 1 and 32: our packed formats against dense f32
/// (candle's `x.matmul(&w.t())`, its fast path) and candle's `QMatMul` for llama.cpp's
/// formats. Run with `RAYON_NUM_THREADS=1` to compare one thread to one thread (candle and
/// our kernels both take their thread count from it).
fn quant_suite(c: &mut Criterion) {
    use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
    use compressme_quant::synthetic::{MatrixKind, matrix};
    use compressme_quant::{Format, GroupSize, matmul, quantize};
    const N: usize = 4096;
    let dev = Device::Cpu;
    let w = matrix(MatrixKind::Gaussian, N, N, 1);
    let wt = Tensor::from_slice(&w, (N, N), &dev).expect("w");
    let mut g = c.benchmark_group("quant");
    g.sample_size(10);
    g.throughput(Throughput::Bytes((N * N * 4) as u64));
    g.bench_function(BenchmarkId::new("quantize/nf4-g64", "4096x4096"), |b| {
        b.iter(|| quantize(black_box(&w), N, N, Format::Nf4Block(GroupSize::G64)))
    });
    for batch in [1usize, 32] {
        let x = matrix(MatrixKind::Gaussian, batch, N, 2);
        let xt = Tensor::from_slice(&x, (batch, N), &dev).expect("x");
        let size = format!("4096x4096/b{batch}");
        g.bench_function(BenchmarkId::new("dense-f32-candle", &size), |b| {
            b.iter(|| xt.matmul(&wt.t().expect("t")))
        });
        for (name, dtype) in [
            ("q8_0", GgmlDType::Q8_0),
            ("q4_0", GgmlDType::Q4_0),
            ("q4k", GgmlDType::Q4K),
            ("q6k", GgmlDType::Q6K),
        ] {
            let qm = QMatMul::from_qtensor(QTensor::quantize(&wt, dtype).expect("quantize"))
                .expect("qmatmul");
            g.bench_function(BenchmarkId::new(format!("candle-{name}"), &size), |b| {
                b.iter(|| qm.forward(black_box(&xt)))
            });
        }
        for (name, format) in [
            ("int8", Format::Int8),
            ("nf4-g64", Format::Nf4Block(GroupSize::G64)),
            ("int4-g64", Format::Int4Block(GroupSize::G64)),
            ("f16", Format::F16),
        ] {
            let q = quantize(&w, N, N, format).expect("quantize");
            g.bench_function(BenchmarkId::new(format!("ours-{name}"), &size), |b| {
                b.iter(|| matmul(black_box(&x), batch, &q))
            });
        }
    }
    g.finish();
}

/// MiniLM forward passes: dense against a lossless word-embedding table and our quantized
/// linears, for 32 sequences of 128 tokens and for one 12-token sentence. Run with
/// `RAYON_NUM_THREADS=1` for one thread against one thread.
fn model_suite(c: &mut Criterion) {
    let Some(variants) = compressme_benches::minilm_variants() else {
        return;
    };
    let dev = Device::Cpu;
    let mut g = c.benchmark_group("model");
    g.sample_size(10);
    for (b, t) in [(32usize, 128usize), (1, 12)] {
        let ids = Tensor::from_vec(random_ids(b * t, 30522, 5), (b, t), &dev).expect("ids");
        let mask = ids.ones_like().expect("mask");
        // candle's formats are in `model-report`: its Q4_K (Q5_0 on MiniLM's rows) takes
        // about 40 s a 32 x 128 forward, too slow for ten samples
        for (name, m) in variants.iter().filter(|(n, _)| !n.starts_with("candle-")) {
            g.bench_function(
                BenchmarkId::new(format!("minilm/{name}"), format!("{b}x{t}")),
                |bench| bench.iter(|| m.forward(black_box(&ids), None, &mask).expect("forward")),
            );
        }
    }
    g.finish();
}

criterion_group!(
    benches,
    shuffle_suite,
    blockstore_suite,
    embedding_suite,
    quant_suite,
    model_suite
);
criterion_main!(benches);
