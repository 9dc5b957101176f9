//! Named error budgets: relative RMSE of each format on fixed generated matrices.

use compressme_quant::{Format, GroupSize, quantize};

use crate::{all_formats, matrix, rel_rmse};

/// The largest relative RMSE each format may show on each matrix kind (256 x 512).
fn budget(format: Format, kind: &str) -> f64 {
    BUDGETS
        .iter()
        .find(|(f, k, _)| *f == format && *k == kind)
        .map_or_else(|| panic!("no budget for {format:?} on {kind}"), |b| b.2)
}

const G32: GroupSize = GroupSize::G32;
const G64: GroupSize = GroupSize::G64;
const G128: GroupSize = GroupSize::G128;

#[rustfmt::skip]
const BUDGETS: &[(Format, &str, f64)] = &[
    (Format::F16, "gaussian", BUDGET_F16), (Format::F16, "student-t", BUDGET_F16), (Format::F16, "outliers", BUDGET_F16),
    (Format::Bf16, "gaussian", BUDGET_BF16), (Format::Bf16, "student-t", BUDGET_BF16), (Format::Bf16, "outliers", BUDGET_BF16),
    (Format::Int8, "gaussian", 0.0083), (Format::Int8, "student-t", 0.025), (Format::Int8, "outliers", 0.035),
    (Format::Int8Rows, "gaussian", 0.0083), (Format::Int8Rows, "student-t", 0.025), (Format::Int8Rows, "outliers", 0.035),
    (Format::Nf4, "gaussian", 0.112), (Format::Nf4, "student-t", 0.248), (Format::Nf4, "outliers", 0.327),
    (Format::Nf4Block(G32), "gaussian", 0.096), (Format::Nf4Block(G32), "student-t", 0.112), (Format::Nf4Block(G32), "outliers", 0.133),
    (Format::Nf4Block(G64), "gaussian", 0.102), (Format::Nf4Block(G64), "student-t", 0.136), (Format::Nf4Block(G64), "outliers", 0.186),
    (Format::Nf4Block(G128), "gaussian", 0.105), (Format::Nf4Block(G128), "student-t", 0.166), (Format::Nf4Block(G128), "outliers", 0.239),
    (Format::Int4Block(G32), "gaussian", 0.087), (Format::Int4Block(G32), "student-t", 0.111), (Format::Int4Block(G32), "outliers", 0.122),
    (Format::Int4Block(G64), "gaussian", 0.099), (Format::Int4Block(G64), "student-t", 0.146), (Format::Int4Block(G64), "outliers", 0.173),
    (Format::Int4Block(G128), "gaussian", 0.11), (Format::Int4Block(G128), "student-t", 0.185), (Format::Int4Block(G128), "outliers", 0.256),
    (Format::Int8Block(G32), "gaussian", 0.0056), (Format::Int8Block(G32), "student-t", 0.0088), (Format::Int8Block(G32), "outliers", 0.0125),
    (Format::Int8Block(G64), "gaussian", 0.0062), (Format::Int8Block(G64), "student-t", 0.0113), (Format::Int8Block(G64), "outliers", 0.0176),
    (Format::Int8Block(G128), "gaussian", 0.0068), (Format::Int8Block(G128), "student-t", 0.0144), (Format::Int8Block(G128), "outliers", 0.0228),
];
/// Half precision keeps 11 significant bits: relative error at most 2^-12 a weight.
const BUDGET_F16: f64 = 2.5e-4;
/// bfloat16 keeps 8: at most 2^-9 a weight.
const BUDGET_BF16: f64 = 2.0e-3;

#[test]
fn every_format_stays_within_its_error_budget() {
    let mut report = String::new();
    let mut over = Vec::new();
    for kind in ["gaussian", "student-t", "outliers"] {
        let w = matrix(kind, 256, 512, 42);
        for format in all_formats() {
            let q = quantize(&w, 256, 512, format).unwrap();
            let mut back = vec![0f32; w.len()];
            q.dequantize_into(&mut back).unwrap();
            let e = rel_rmse(&w, &back);
            report.push_str(&format!("{kind:10} {format:?}: {e:.5}\n"));
            if e > budget(format, kind) {
                over.push(format!(
                    "{kind} {format:?}: {e:.5} > {}",
                    budget(format, kind)
                ));
            }
        }
    }
    eprintln!("{report}");
    assert!(over.is_empty(), "over budget:\n{}", over.join("\n"));
}
