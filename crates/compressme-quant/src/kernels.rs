//! Matrix multiplication that reads packed weights one row at a time.

use rayon::prelude::*;

use crate::{Error, Packed, Result};

/// Dot product with eight independent accumulators, so the compiler can vectorize it.
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for ((s, &p), &q) in acc.iter_mut().zip(x).zip(y) {
            *s += p * q;
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `x` must be `[batch, cols]`.
pub(crate) fn check_input(x: &[f32], batch: usize, cols: usize) -> Result<()> {
    if batch.checked_mul(cols) == Some(x.len()) {
        return Ok(());
    }
    let need = batch.saturating_mul(cols);
    Err(Error::Shape(format!(
        "x has {} values, [{batch}, {cols}] needs {need}",
        x.len()
    )))
}

/// `y = x W^T` for `x: [batch, cols]` and packed `W: [rows, cols]`, giving `[batch, rows]`.
///
/// Each output row's weights are decoded from the packed bytes into a row-sized buffer
/// (one per thread) and used for every input of the batch; `W` is never held in f32.
/// Output rows are spread over all cores.
///
/// # Errors
/// [`Error::Shape`] when `x` is not `batch * cols` long.
pub fn matmul(x: &[f32], batch: usize, w: &Packed) -> Result<Vec<f32>> {
    let (rows, cols) = (w.rows(), w.cols());
    check_input(x, batch, cols)?;
    // [rows, batch] first: each task owns whole output rows
    let mut yt = vec![0f32; rows * batch];
    if batch > 0 {
        yt.par_chunks_mut(batch).enumerate().for_each_init(
            || vec![0f32; cols],
            |buf, (r, out)| {
                w.decode_row(r, buf);
                for (o, xb) in out.iter_mut().zip(x.chunks_exact(cols)) {
                    *o = dot(xb, buf);
                }
            },
        );
    }
    let mut y = vec![0f32; batch * rows];
    for (r, col) in yt.chunks_exact(batch.max(1)).enumerate() {
        for (b, &v) in col.iter().enumerate() {
            if let Some(slot) = y.get_mut(b * rows + r) {
                *slot = v;
            }
        }
    }
    Ok(y)
}
