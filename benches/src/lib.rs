//! Shared helpers for the benchmark binaries: loading the real table, random ids, timing.
//!
//! What it is not: a library for users; nothing here is part of compressme's API.
//!
//! # Example
//! ```
//! let ids = compressme_benches::random_ids(10, 100, 1);
//! assert!(ids.iter().all(|&i| i < 100));
//! ```
#![deny(missing_docs)]
#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

/// `n` pseudo-random ids below `rows` (xorshift64, fixed by `seed`).
#[must_use]
pub fn random_ids(n: usize, rows: u64, seed: u64) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % rows.max(1)) as u32
        })
        .collect()
}

/// Reads one tensor's raw bytes and shape from a safetensors file.
///
/// # Errors
/// When the file cannot be read or parsed, or the tensor is absent.
pub fn load_tensor(path: &std::path::Path, name: &str) -> Result<(Vec<u8>, Vec<usize>), String> {
    let bytes = std::fs::read(path)
        .map_err(|e| format!("{}: {e} (run `cargo xtask fixtures`)", path.display()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| e.to_string())?;
    let view = st.tensor(name).map_err(|e| format!("`{name}`: {e}"))?;
    Ok((view.data().to_vec(), view.shape().to_vec()))
}

/// f32 little-endian bytes rounded to bf16 (nearest even), little-endian.
#[must_use]
pub fn f32_to_bf16_bytes(f32s: &[u8]) -> Vec<u8> {
    f32s.chunks_exact(4)
        .flat_map(|c| {
            let u = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            let r = if (u & 0x7fff_ffff) > 0x7f80_0000 {
                (u >> 16) | 0x40
            } else {
                (u + 0x7fff + ((u >> 16) & 1)) >> 16
            };
            (r as u16).to_le_bytes()
        })
        .collect()
}

/// Median wall time of `reps` runs of `f` (after one warm-up run).
pub fn median_time(reps: usize, mut f: impl FnMut()) -> Duration {
    f();
    let v: Vec<Duration> = (0..reps.max(1))
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    let m = compressme_eval::median(v.iter().map(Duration::as_secs_f64).collect());
    Duration::try_from_secs_f64(m).unwrap_or_default()
}

/// The repository's `cache/minilm` folder (filled by `cargo xtask fixtures`).
#[must_use]
pub fn minilm_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../cache/minilm")
}

/// MiniLM as the model suite and `model-report` compare it: a lossless word-embedding
/// table, every linear as INT8, NF4 per row, and NF4 group 64, then dense; `None` (with a
/// message) when the checkpoint is absent.
#[must_use]
pub fn minilm_variants() -> Option<Vec<(&'static str, compressme_nn::Bert)>> {
    use compressme_nn::LlamaFormat;
    use compressme_nn::{Bert, Model, ModuleKind, PackOptions, Storage};
    use compressme_quant::{Format, GroupSize};
    let dir = minilm_dir();
    let Ok(dense) = Bert::from_dir(&dir, &candle_core::Device::Cpu) else {
        eprintln!(
            "benches: {} absent, skipping MiniLM (run `cargo xtask fixtures`)",
            dir.display()
        );
        return None;
    };
    let linears: Vec<String> = dense
        .modules()
        .into_iter()
        .filter(|m| m.kind == ModuleKind::Linear)
        .map(|m| m.name)
        .collect();
    let with = |changes: Vec<(String, Storage)>| -> Option<Bert> {
        let mut m = dense.clone();
        m.set_storage(&changes).ok()?;
        Some(m)
    };
    let all = |f: Format| -> Vec<(String, Storage)> {
        linears
            .iter()
            .map(|n| (n.clone(), Storage::Quant(f)))
            .collect()
    };
    Some(vec![
        (
            "lossless-embedding",
            with(vec![(
                "embeddings.word_embeddings".into(),
                Storage::Lossless(PackOptions::default()),
            )])?,
        ),
        ("int8-linears", with(all(Format::Int8))?),
        (
            "candle-q8_0-linears",
            with_candle(&dense, &linears, LlamaFormat::Q8_0)?,
        ),
        ("nf4-linears", with(all(Format::Nf4))?),
        (
            "nf4-g64-linears",
            with(all(Format::Nf4Block(GroupSize::G64)))?,
        ),
        (
            "candle-q4k-linears",
            with_candle(&dense, &linears, LlamaFormat::Q4K)?,
        ),
        ("dense", dense),
    ])
}

/// `dense` with every linear in `linears` given candle's quantized tensor of its weight in
/// `format` (or, on rows that are not a multiple of 256, the type llama.cpp's quantizer
/// falls back to: MiniLM's 384-wide rows take Q5_0 for Q4_K), run by candle's kernels.
fn with_candle(
    dense: &compressme_nn::Bert,
    linears: &[String],
    format: compressme_nn::LlamaFormat,
) -> Option<compressme_nn::Bert> {
    use compressme_nn::{Model, ModuleMut, ModuleRef, Weight, llama_qtensor};
    let mut m = dense.clone();
    for name in linears {
        let Some(ModuleRef::Linear(l)) = dense.module(name) else {
            return None;
        };
        let Weight::Dense(w) = l.weight() else {
            return None;
        };
        let (rows, cols) = w.dims2().ok()?;
        let values = w.flatten_all().ok()?.to_vec1::<f32>().ok()?;
        let q = llama_qtensor(&values, rows, cols, format.for_width(cols)).ok()?;
        let Some(ModuleMut::Linear(l)) = m.module_mut(name) else {
            return None;
        };
        l.set_weight(Weight::Ggml(std::sync::Arc::new(q))).ok()?;
    }
    Some(m)
}

/// The CPU's SIMD features that the kernel tiers use, as `lscpu` names them.
#[must_use]
pub fn cpu_features() -> String {
    let mut have = Vec::new();
    macro_rules! probe {
        ($($f:tt => $name:expr),*) => {
            $(if is_x86_feature_detected!($f) { have.push($name); })*
        };
    }
    probe!(
        "avx2" => "avx2", "fma" => "fma", "f16c" => "f16c", "avx512f" => "avx512f",
        "avx512bw" => "avx512bw", "avx512vl" => "avx512vl", "avx512vnni" => "avx512_vnni",
        "avx512bf16" => "avx512_bf16", "avxvnni" => "avx_vnni"
    );
    if have.is_empty() {
        "none of avx2 and up".into()
    } else {
        have.join(" ")
    }
}

pub use compressme_eval::{cosine, median};
