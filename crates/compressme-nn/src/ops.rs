//! Small differentiable building blocks on candle-core tensors.

use candle_core::{D, Tensor};

use crate::Result;

/// Layer normalisation over the last dimension.
#[derive(Debug, Clone)]
pub struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f64,
}

impl LayerNorm {
    /// `weight` and `bias` of the normalised width.
    #[must_use]
    pub fn new(weight: Tensor, bias: Tensor, eps: f64) -> Self {
        Self { weight, bias, eps }
    }

    /// Normalises `x` over its last dimension.
    ///
    /// # Errors
    /// candle's.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mean = x.mean_keepdim(D::Minus1)?;
        let centred = x.broadcast_sub(&mean)?;
        let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = centred.broadcast_div(&(var + self.eps)?.sqrt()?)?;
        Ok(normed
            .broadcast_mul(&self.weight)?
            .broadcast_add(&self.bias)?)
    }

    /// Bytes of its parameters (f32).
    #[must_use]
    pub fn bytes(&self) -> u64 {
        (4 * (self.weight.elem_count() + self.bias.elem_count())) as u64
    }

    /// The parameters.
    #[must_use]
    pub fn params(&self) -> [&Tensor; 2] {
        [&self.weight, &self.bias]
    }
}

/// Softmax over the last dimension (the maximum is subtracted first).
///
/// # Errors
/// candle's.
pub fn softmax_last(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    Ok(e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?)
}

/// Log-softmax over the last dimension.
///
/// # Errors
/// candle's.
pub fn log_softmax_last(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let shifted = x.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    Ok(shifted.broadcast_sub(&lse)?)
}

/// Splits `[b, t, heads * dh]` into `[b, heads, t, dh]` (contiguous).
///
/// # Errors
/// candle's.
pub fn split_heads(x: &Tensor, heads: usize) -> Result<Tensor> {
    let (b, t, w) = x.dims3()?;
    Ok(x.reshape((b, t, heads, w / heads))?
        .transpose(1, 2)?
        .contiguous()?)
}

/// Joins `[b, heads, t, dh]` back into `[b, t, heads * dh]`.
///
/// # Errors
/// candle's.
pub fn join_heads(x: &Tensor) -> Result<Tensor> {
    let (b, h, t, dh) = x.dims4()?;
    Ok(x.transpose(1, 2)?.contiguous()?.reshape((b, t, h * dh))?)
}
