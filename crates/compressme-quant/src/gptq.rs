//! The linear algebra of GPTQ rounding (Frantar et al., 2022): from a layer's input Gram
//! matrix `H = Σ x xᵀ` (over calibration tokens), the upper-triangular `U` with
//! `Uᵀ U = (H + λI)⁻¹`, whose rows tell how a rounding error in one column is best
//! spread over the columns after it ([`GptqFactor`]). [`crate::quantize_gptq`] does the
//! rounding.
//!
//! Computed in f64 without a general inverse: with `P` the reversal of the columns'
//! order and `M` the lower Cholesky factor of `P (H + λI) P`, `U = P M⁻¹ P`
//! (`Uᵀ U = P M⁻ᵀ M⁻¹ P = P (P (H + λI) P)⁻¹ P = (H + λI)⁻¹`, and reversing both the
//! rows and the columns of a lower-triangular matrix makes it upper-triangular). The
//! Cholesky factor with a positive diagonal is unique, so this is the `U` the paper's
//! `cholesky(inverse(H), upper=True)` gives.

use crate::{Error, Result};

/// The factor GPTQ rounds a layer's weights with: `U` (row-major `cols x cols`,
/// upper-triangular, f32) with `Uᵀ U = (H + λI)⁻¹` for the layer's input Gram matrix
/// `H`. It depends on the inputs only, so layers that read the same input (a block's
/// query, key and value projections) can share one, and every format and plan rounds
/// with the same factor.
#[derive(Debug, Clone, PartialEq)]
pub struct GptqFactor {
    cols: usize,
    u: Vec<f32>,
    /// `H`'s diagonal: each input channel's Σ x², the weights of a scale search.
    diag: Vec<f32>,
}

impl GptqFactor {
    /// The factor for the Gram matrix `gram` (row-major `cols x cols`, symmetric:
    /// `Σ x xᵀ` over calibration inputs), damped by `damp` times the mean of its diagonal
    /// (0.01 in the paper). A column that never saw a non-zero input (a zero diagonal
    /// entry) is given a diagonal of 1 first, as the paper does.
    ///
    /// # Errors
    /// [`Error::Shape`] for a `gram` that is not `cols x cols`, a non-finite entry, a
    /// negative or non-finite `damp`, or a matrix that is not positive definite even
    /// after damping.
    pub fn new(gram: &[f64], cols: usize, damp: f64) -> Result<Self> {
        let u = crate::kernels::inverse_factor(gram, cols, damp)?;
        let diag = (0..cols)
            .map(|i| gram.get(i * cols + i).copied().unwrap_or(0.0) as f32)
            .collect();
        Ok(Self { cols, u, diag })
    }

    /// The layer's input width.
    #[must_use]
    pub const fn cols(&self) -> usize {
        self.cols
    }

    /// `U`, row-major.
    pub(crate) fn u(&self) -> &[f32] {
        &self.u
    }

    /// `H`'s diagonal.
    pub(crate) fn diag(&self) -> &[f32] {
        &self.diag
    }
}

/// `U` of [`GptqFactor::new`]. Inlined into each kernel tier's copy
/// (`crate::kernels::inverse_factor`), whose vectors widen [`dot`]; every tier gives the
/// same bits.
#[inline(always)]
pub(crate) fn inverse_factor_lanes(gram: &[f64], n: usize, damp: f64) -> Result<Vec<f32>> {
    if n == 0 || n.checked_mul(n) != Some(gram.len()) {
        return Err(Error::Shape(format!(
            "a Gram matrix of {} entries for {n} columns",
            gram.len()
        )));
    }
    if !(damp.is_finite() && damp >= 0.0) {
        return Err(Error::Shape(format!(
            "damping {damp} is not a finite non-negative number"
        )));
    }
    if let Some(v) = gram.iter().find(|v| !v.is_finite()) {
        return Err(Error::Shape(format!("the Gram matrix holds {v}")));
    }
    let at = |i: usize, j: usize| gram.get(i * n + j).copied().unwrap_or(0.0);
    let diag: Vec<f64> = (0..n)
        .map(|i| if at(i, i) == 0.0 { 1.0 } else { at(i, i) })
        .collect();
    let lambda = damp * diag.iter().sum::<f64>() / n as f64;
    // the reversed, damped matrix, then its lower Cholesky factor in place (row by row:
    // each entry a dot product of two rows' leading parts, contiguous)
    let rev = |i: usize| n - 1 - i;
    let mut m = vec![0f64; n * n];
    for i in 0..n {
        for j in 0..=i {
            let h = if i == j {
                diag[rev(i)] + lambda
            } else {
                at(rev(i), rev(j))
            };
            let s = h - dot(&m[i * n..i * n + j], &m[j * n..j * n + j]);
            m[i * n + j] = if i == j {
                if !(s > 0.0 && s.is_finite()) {
                    return Err(Error::Shape(format!(
                        "the Gram matrix is not positive definite (pivot {s} at column {})",
                        rev(i)
                    )));
                }
                s.sqrt()
            } else {
                s / m[j * n + j]
            };
        }
    }
    // M⁻¹ by forward substitution, a column at a time, kept transposed so that every
    // entry is again a dot product of contiguous runs: with `t[j]` column j of M⁻¹,
    // `t[j][i] = (δ_ij - Σ_{j<=k<i} M[i][k] t[j][k]) / M[i][i]` for i >= j
    let mut t = vec![0f64; n * n];
    for j in 0..n {
        for i in j..n {
            let s = dot(&m[i * n + j..i * n + i], &t[j * n + j..j * n + i]);
            let e = if i == j { 1.0 } else { 0.0 };
            t[j * n + i] = (e - s) / m[i * n + i];
        }
    }
    // U[i][j] = M⁻¹[rev i][rev j] = t[rev j][rev i]
    let mut u = vec![0f32; n * n];
    for i in 0..n {
        for j in i..n {
            u[i * n + j] = t[rev(j) * n + rev(i)] as f32;
        }
    }
    Ok(u)
}

/// `Σ a_k b_k` in sixteen interleaved partial sums, added in a fixed order at the end:
/// the compiler keeps them in vector registers as independent chains (a single running
/// sum waits on each add), and the result is the same on every machine and tier.
#[inline(always)]
fn dot(a: &[f64], b: &[f64]) -> f64 {
    let mut acc = [0f64; 16];
    let ((a16, ra), (b16, rb)) = (a.as_chunks::<16>(), b.as_chunks::<16>());
    let tail: f64 = ra.iter().zip(rb).map(|(x, y)| x * y).sum();
    for (x, y) in a16.iter().zip(b16) {
        for ((s, &x), &y) in acc.iter_mut().zip(x).zip(y) {
            *s += x * y;
        }
    }
    // halves added lane by lane down to one
    let mut width = acc.len();
    while width > 1 {
        width /= 2;
        let (lo, hi) = acc.split_at_mut(width);
        for (l, h) in lo.iter_mut().zip(hi.iter()) {
            *l += *h;
        }
    }
    acc[0] + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fixed pseudo-random numbers in [-0.5, 0.5) (xorshift) from a non-zero seed.
    fn uniform(mut s: u64) -> impl FnMut() -> f64 {
        move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 11) as f64 / (1u64 << 53) as f64 - 0.5
        }
    }

    /// `Uᵀ U (H + λI)` is the identity, `U` is upper-triangular with a positive diagonal.
    #[test]
    fn the_factor_inverts_the_damped_gram_matrix() {
        let n = 37;
        // H = A Aᵀ + a little, from a fixed pseudo-random A (correlated columns)
        let mut next = uniform(0x9e37_79b9_7f4a_7c15);
        let a: Vec<f64> = (0..n * 50).map(|_| next()).collect();
        let mut h = vec![0f64; n * n];
        for i in 0..n {
            for j in 0..n {
                h[i * n + j] = (0..50).map(|k| a[i * 50 + k] * a[j * 50 + k]).sum::<f64>()
                    + if i == j { 0.5 } else { 0.0 };
            }
        }
        let damp = 0.01;
        let u = inverse_factor_lanes(&h, n, damp).unwrap();
        let lambda = damp * (0..n).map(|i| h[i * n + i]).sum::<f64>() / n as f64;
        for i in 0..n {
            for j in 0..n {
                let uij = f64::from(u[i * n + j]);
                if j < i {
                    assert_eq!(uij, 0.0, "U[{i}][{j}] below the diagonal");
                }
                if i == j {
                    assert!(uij > 0.0, "U[{i}][{i}] = {uij}");
                }
                // (Uᵀ U (H + λI))[i][j]
                let mut v = 0.0;
                for k in 0..n {
                    let utu: f64 = (0..n)
                        .map(|l| f64::from(u[l * n + i]) * f64::from(u[l * n + k]))
                        .sum();
                    v += utu * (h[k * n + j] + if k == j { lambda } else { 0.0 });
                }
                let want = if i == j { 1.0 } else { 0.0 };
                assert!((v - want).abs() < 1e-4, "({i}, {j}): {v}");
            }
        }
    }

    /// Every kernel tier's copy of the factor and of the lockstep block gives the bits of
    /// the plain code, and a block gives each row the bits of that row run alone, for
    /// every format.
    #[test]
    fn gptq_blocks_give_every_row_its_own_bits_on_every_tier() {
        let (rows, cols) = (11, 150);
        let mut next = uniform(0x2545_f491_4f6c_dd1d);
        // correlated inputs: each channel a running mix of the one before
        let tokens = 40;
        let mut x = vec![0f64; tokens * cols];
        for t in 0..tokens {
            let mut prev = 0.0;
            for c in 0..cols {
                prev = 0.8 * prev + next();
                x[t * cols + c] = prev;
            }
        }
        let mut h = vec![0f64; cols * cols];
        for t in 0..tokens {
            for i in 0..cols {
                for j in 0..cols {
                    h[i * cols + j] += x[t * cols + i] * x[t * cols + j];
                }
            }
        }
        let f = GptqFactor::new(&h, cols, 0.01).unwrap();
        assert_eq!(f.u(), inverse_factor_lanes(&h, cols, 0.01).unwrap());
        let w: Vec<f32> = (0..rows * cols).map(|_| next() as f32).collect();
        for format in crate::Format::ALL {
            let block = crate::kernels::gptq_block(&w, cols, format, f.u(), f.diag()).unwrap();
            let plain = crate::format::gptq_block_lanes(&w, cols, format, f.u(), f.diag());
            assert_eq!(block, plain.unwrap(), "{format}");
            for (r, got) in block.iter().enumerate() {
                let alone = crate::format::gptq_block_lanes(
                    &w[r * cols..(r + 1) * cols],
                    cols,
                    format,
                    f.u(),
                    f.diag(),
                )
                .unwrap();
                assert_eq!(alone.len(), 1);
                assert_eq!(&alone[0], got, "{format}, row {r}");
            }
        }
    }

    #[test]
    fn bad_gram_matrices_are_refused() {
        assert!(matches!(
            inverse_factor_lanes(&[1.0; 3], 2, 0.01),
            Err(Error::Shape(_))
        ));
        assert!(matches!(
            inverse_factor_lanes(&[1.0, f64::NAN, f64::NAN, 1.0], 2, 0.01),
            Err(Error::Shape(_))
        ));
        assert!(matches!(
            inverse_factor_lanes(&[1.0, 0.0, 0.0, 1.0], 2, -1.0),
            Err(Error::Shape(_))
        ));
        // indefinite, undamped
        assert!(matches!(
            inverse_factor_lanes(&[1.0, 2.0, 2.0, 1.0], 2, 0.0),
            Err(Error::Shape(_))
        ));
        // a dead column gets a diagonal of one
        let u = inverse_factor_lanes(&[0.0, 0.0, 0.0, 4.0], 2, 0.0).unwrap();
        assert_eq!(u, vec![1.0, 0.0, 0.0, 0.5]);
    }
}
