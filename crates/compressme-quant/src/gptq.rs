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
        let u = inverse_factor(gram, cols, damp)?;
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

/// `U` of [`GptqFactor::new`].
fn inverse_factor(gram: &[f64], n: usize, damp: f64) -> Result<Vec<f32>> {
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
            let (ri, rj) = (&m[i * n..i * n + j], &m[j * n..j * n + j]);
            let s = h - ri.iter().zip(rj).map(|(a, b)| a * b).sum::<f64>();
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
    // M⁻¹ row by row: row i = (e_i - Σ_{k<i} M[i][k] row k) / M[i][i]
    let mut x = vec![0f64; n * n];
    for i in 0..n {
        let (done, rest) = x.split_at_mut(i * n);
        let row = &mut rest[..n];
        row[i] = 1.0;
        for k in 0..i {
            let c = m[i * n + k];
            if c != 0.0 {
                for (r, &v) in row[..=k].iter_mut().zip(&done[k * n..k * n + k + 1]) {
                    *r -= c * v;
                }
            }
        }
        let d = m[i * n + i];
        for r in &mut row[..=i] {
            *r /= d;
        }
    }
    let mut u = vec![0f32; n * n];
    for i in 0..n {
        for j in i..n {
            u[i * n + j] = x[rev(i) * n + rev(j)] as f32;
        }
    }
    Ok(u)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Uᵀ U (H + λI)` is the identity, `U` is upper-triangular with a positive diagonal.
    #[test]
    fn the_factor_inverts_the_damped_gram_matrix() {
        let n = 37;
        // H = A Aᵀ + a little, from a fixed pseudo-random A (correlated columns)
        let mut s = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 11) as f64 / (1u64 << 53) as f64 - 0.5
        };
        let a: Vec<f64> = (0..n * 50).map(|_| next()).collect();
        let mut h = vec![0f64; n * n];
        for i in 0..n {
            for j in 0..n {
                h[i * n + j] = (0..50).map(|k| a[i * 50 + k] * a[j * 50 + k]).sum::<f64>()
                    + if i == j { 0.5 } else { 0.0 };
            }
        }
        let damp = 0.01;
        let u = inverse_factor(&h, n, damp).unwrap();
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

    #[test]
    fn bad_gram_matrices_are_refused() {
        assert!(matches!(
            inverse_factor(&[1.0; 3], 2, 0.01),
            Err(Error::Shape(_))
        ));
        assert!(matches!(
            inverse_factor(&[1.0, f64::NAN, f64::NAN, 1.0], 2, 0.01),
            Err(Error::Shape(_))
        ));
        assert!(matches!(
            inverse_factor(&[1.0, 0.0, 0.0, 1.0], 2, -1.0),
            Err(Error::Shape(_))
        ));
        // indefinite, undamped
        assert!(matches!(
            inverse_factor(&[1.0, 2.0, 2.0, 1.0], 2, 0.0),
            Err(Error::Shape(_))
        ));
        // a dead column gets a diagonal of one
        let u = inverse_factor(&[0.0, 0.0, 0.0, 4.0], 2, 0.0).unwrap();
        assert_eq!(u, vec![1.0, 0.0, 0.0, 0.5]);
    }
}
