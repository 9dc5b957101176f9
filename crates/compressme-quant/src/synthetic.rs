//! Seeded, weight-like matrices for error budgets and benchmarks, the same on every machine,
//! and the relative RMSE they are judged by.

/// The kinds of fixed matrix the error budgets use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatrixKind {
    /// Gaussian weights.
    Gaussian,
    /// Heavy-tailed Student-t weights with 3 degrees of freedom.
    StudentT,
    /// Gaussian weights where one in 64 is 20 times larger.
    Outliers,
}

impl MatrixKind {
    /// Every kind, in report order.
    pub const ALL: [Self; 3] = [Self::Gaussian, Self::StudentT, Self::Outliers];

    /// A short name for reports.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Gaussian => "gaussian",
            Self::StudentT => "student-t",
            Self::Outliers => "outliers",
        }
    }
}

/// A small seeded generator (xorshift64*), Box-Muller normals and Student-t draws.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed`.
    #[must_use]
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in (0, 1).
    pub fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Standard normal.
    pub fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }

    /// Student-t with `df` degrees of freedom.
    pub fn student_t(&mut self, df: usize) -> f64 {
        let chi2: f64 = (0..df).map(|_| self.normal().powi(2)).sum();
        self.normal() / (chi2 / df as f64).sqrt()
    }
}

/// A `[rows, cols]` matrix of `kind`, scaled like trained weights (sigma 0.02).
#[must_use]
pub fn matrix(kind: MatrixKind, rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..rows * cols)
        .map(|i| {
            let v = match kind {
                MatrixKind::Gaussian => r.normal(),
                MatrixKind::StudentT => r.student_t(3),
                MatrixKind::Outliers => r.normal() * if i % 64 == 7 { 20.0 } else { 1.0 },
            };
            (v * 0.02) as f32
        })
        .collect()
}

/// RMSE of `approx` against `exact`, relative to the RMS of `exact`.
#[must_use]
pub fn rel_rmse(exact: &[f32], approx: &[f32]) -> f64 {
    let err: f64 = exact
        .iter()
        .zip(approx)
        .map(|(&x, &y)| (f64::from(x) - f64::from(y)).powi(2))
        .sum();
    let rms: f64 = exact.iter().map(|&x| f64::from(x).powi(2)).sum();
    if rms == 0.0 {
        err.sqrt()
    } else {
        (err / rms).sqrt()
    }
}
