//! Integration tests for compressme-quant (one binary, topic modules).
#![allow(clippy::unwrap_used, clippy::indexing_slicing, missing_docs)] // tests

mod budgets;
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
    }
    v
}

/// A seeded generator (xorshift64*), so fixed matrices are the same on every machine.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    pub fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        ((self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    pub fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
    /// Student-t with `df` degrees of freedom: heavy tails.
    pub fn student_t(&mut self, df: usize) -> f64 {
        let chi2: f64 = (0..df).map(|_| self.normal().powi(2)).sum();
        self.normal() / (chi2 / df as f64).sqrt()
    }
}

/// The three fixed matrix kinds of the error budgets, `rows x cols`, weight-like scale.
pub fn matrix(kind: &str, rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..rows * cols)
        .map(|i| {
            let v = match kind {
                "gaussian" => r.normal(),
                "student-t" => r.student_t(3),
                // Gaussian rows where one weight in 64 is 20x larger
                "outliers" => r.normal() * if i % 64 == 7 { 20.0 } else { 1.0 },
                _ => unreachable!(),
            };
            (v * 0.02) as f32
        })
        .collect()
}

/// RMSE of `b` against `a`, relative to the RMS of `a`.
pub fn rel_rmse(a: &[f32], b: &[f32]) -> f64 {
    let err: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (f64::from(x) - f64::from(y)).powi(2))
        .sum();
    let rms: f64 = a.iter().map(|&x| f64::from(x).powi(2)).sum();
    (err / rms).sqrt()
}
