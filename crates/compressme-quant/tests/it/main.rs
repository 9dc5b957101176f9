//! Integration tests for compressme-quant (one binary, topic modules).
#![allow(clippy::unwrap_used, clippy::indexing_slicing, missing_docs)] // tests

mod budgets;
mod ggml;
mod gptq;
mod properties;

use compressme_quant::{Format, GroupSize};

/// Every format, with each group size for the blockwise ones.
pub fn all_formats() -> Vec<Format> {
    let mut v = vec![
        Format::F16,
        Format::Bf16,
        Format::Int8,
        Format::Nf4,
        Format::Int8Rows,
    ];
    for g in [GroupSize::G32, GroupSize::G64, GroupSize::G128] {
        v.push(Format::Nf4Block(g));
        v.push(Format::Int4Block(g));
        v.push(Format::Int8Block(g));
    }
    v
}

pub use compressme_quant::synthetic::{Rng, rel_rmse};

/// The fixed matrices of the budgets, by name.
pub fn matrix(kind: &str, rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    use compressme_quant::synthetic::MatrixKind;
    let kind = MatrixKind::ALL
        .into_iter()
        .find(|k| k.name() == kind)
        .unwrap();
    compressme_quant::synthetic::matrix(kind, rows, cols, seed)
}
