//! Tests on the real all-MiniLM-L6-v2 checkpoint, fetched by `cargo xtask fixtures` into
//! `cache/minilm/`. They fail, saying how to fetch it, when it is absent, unless
//! `COMPRESSME_SKIP_FIXTURES` is set (then they say they skipped).

use std::path::PathBuf;

use candle_core::{DType, Device, Module, Tensor};
use compressme_nn::{PackOptions, PackedFrozenEmbedding};

fn minilm() -> Option<PathBuf> {
    minilm_dir().map(|d| d.join("model.safetensors"))
}

/// The MiniLM folder, or `None` (with a printed reason) when it is absent and not required.
pub(crate) fn minilm_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("COMPRESSME_MINILM")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../cache/minilm"));
    let path = dir.join("model.safetensors");
    if path.exists() {
        return Some(dir);
    }
    assert!(
        std::env::var_os("COMPRESSME_SKIP_FIXTURES").is_some(),
        "{} is missing; run `cargo xtask fixtures` (or set COMPRESSME_SKIP_FIXTURES=1 to skip the tests that need it)",
        path.display()
    );
    eprintln!(
        "skipped (COMPRESSME_SKIP_FIXTURES): {} is absent",
        path.display()
    );
    None
}

#[test]
fn real_checkpoint_minilm_word_embeddings_every_row_exact() {
    let Some(path) = minilm() else { return };
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let view = st.tensor("embeddings.word_embeddings.weight").unwrap();
    assert_eq!(view.shape(), &[30522, 384]);
    let dev = Device::Cpu;
    let table = Tensor::from_raw_buffer(view.data(), DType::F32, &[30522, 384], &dev).unwrap();

    let packed = PackedFrozenEmbedding::new(&table, &PackOptions::default()).unwrap();
    // every row, byte for byte
    assert_eq!(packed.store().decode_all().unwrap(), view.data());
    // a lookup of every id in a scrambled order, as a [2, 15261] batch
    let mut ids: Vec<u32> = (0..30522u32).map(|i| (i * 7919) % 30522).collect();
    ids.swap(0, 1);
    let ids_t = Tensor::from_vec(ids.clone(), (2, 15261), &dev).unwrap();
    let out = packed.forward(&ids_t).unwrap();
    assert_eq!(out.dims(), &[2, 15261, 384]);
    let got: Vec<u8> = out
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let want: Vec<u8> = ids
        .iter()
        .flat_map(|&i| {
            view.data()[i as usize * 1536..(i as usize + 1) * 1536]
                .iter()
                .copied()
        })
        .collect();
    assert!(got == want, "lookup differs from the original rows");
    // and it is smaller. BENCHMARKS.md's figures come from the bench; these bounds only
    // guard against regressions: the row-indexed default against Blosc2's 0.819, the
    // compact layout against ZipNN called per 16-row block (0.8174)
    let r = packed.report();
    eprintln!(
        "MiniLM word embeddings f32, row-indexed: {} stored / {} dense = {:.4}",
        r.stored_bytes,
        r.dense_bytes,
        r.ratio()
    );
    assert!(r.ratio() < 0.819, "ratio {}", r.ratio());
    let compact = PackOptions {
        row_index: false,
        ..PackOptions::default()
    };
    let r = PackedFrozenEmbedding::assess(&table, &compact).unwrap();
    eprintln!("MiniLM word embeddings f32, compact: {:.4}", r.ratio());
    assert!(r.ratio() < 0.8174, "ratio {}", r.ratio());

    // the same table rounded to bf16
    let bf = table.to_dtype(DType::BF16).unwrap();
    let packed = PackedFrozenEmbedding::new(&bf, &PackOptions::default()).unwrap();
    let w = packed.weight().unwrap();
    assert_eq!(
        w.flatten_all()
            .unwrap()
            .to_vec1::<half::bf16>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect::<Vec<_>>(),
        bf.flatten_all()
            .unwrap()
            .to_vec1::<half::bf16>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect::<Vec<_>>()
    );
    eprintln!(
        "MiniLM word embeddings bf16, row-indexed: {:.4}",
        packed.report().ratio()
    );
    assert!(
        packed.report().ratio() < 0.673,
        "ratio {}",
        packed.report().ratio()
    );
    let r = PackedFrozenEmbedding::assess(&bf, &compact).unwrap();
    eprintln!("MiniLM word embeddings bf16, compact: {:.4}", r.ratio());
    assert!(r.ratio() < 0.6681, "ratio {}", r.ratio());
}
