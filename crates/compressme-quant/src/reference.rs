//! Scalar references, kept forever as the definitions the fast paths are tested against.

use crate::{Packed, Result};

/// `y = x W^T` the plain way: dequantize all of `W`, then one f64 accumulator per output.
///
/// # Errors
/// [`crate::Error::Shape`] when `x` is not `batch * cols` long.
pub fn matmul(x: &[f32], batch: usize, w: &Packed) -> Result<Vec<f32>> {
    let (rows, cols) = (w.rows(), w.cols());
    crate::kernels::check_input(x, batch, cols)?;
    let mut dense = vec![0f32; rows * cols];
    w.dequantize_into(&mut dense)?;
    let mut y = vec![0f32; batch * rows];
    for (xb, yb) in x.chunks_exact(cols).zip(y.chunks_exact_mut(rows.max(1))) {
        for (wr, out) in dense.chunks_exact(cols).zip(yb.iter_mut()) {
            *out = xb
                .iter()
                .zip(wr)
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                .sum::<f64>() as f32;
        }
    }
    Ok(y)
}
