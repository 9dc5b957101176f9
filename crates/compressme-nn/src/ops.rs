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

/// Depth above which candle's f32 matmul (the `gemm` crate) may split its sums in a way
/// that depends on the CPU.
const GEMM_DEPTH: usize = 512;

/// `a · b` for `a: [..., m, k]` and `b: [..., k, n]` of the same rank (candle's `matmul`,
/// the same batch rules: a `b` broadcast over the batch makes one product of all of
/// `a`'s rows), with every output the same bits on every x86-64 CPU.
///
/// candle's CPU matmul calls the `gemm` crate, which blocks each sum over `k` into
/// pieces sized from the L1 cache it reads from sysfs: on a 32 KiB 8-way L1 a depth of
/// 576 is summed as two halves of 288 added together, on a 48 KiB 12-way L1 in one
/// piece, so the same model gives different logits on different machines and a
/// benchmark recorded on one does not replay on another. `gemm` never splits a depth of
/// 512 or less (its blocks are at least 512 deep), and a block's sum does not depend on
/// the CPU. So when `gemm` would block (depth over 512, its general path: at least 2 rows
/// and 2 columns, more than 64 of one), this splits `k` itself as `gemm` does with a
/// 512-deep block, `ceil(k / ceil(k / 512))` a piece, multiplies the pieces and adds them
/// in order; every other call goes to candle as it is (its paths there do not depend on
/// the cache). The result is what `gemm` computes on a CPU whose blocks are 512 deep (the
/// 32 KiB 8-way L1 of the machine the stored benchmark results were recorded on), on
/// every CPU.
///
/// # Errors
/// candle's (shapes that do not multiply).
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (ad, bd) = (a.dims(), b.dims());
    let (Some(&k), Some(&n)) = (ad.last(), bd.last()) else {
        return Ok(a.matmul(b)?);
    };
    let m = ad
        .len()
        .checked_sub(2)
        .and_then(|i| ad.get(i))
        .copied()
        .unwrap_or(1);
    // candle stacks the batches of `a` into one product's rows when `b` is the same for
    // every batch (and `a` is contiguous); the pieces below keep `a` contiguous for it
    let shared = b.stride().iter().rev().skip(2).all(|&s| s == 0);
    let rows = if shared {
        m * ad.iter().rev().skip(2).product::<usize>()
    } else {
        m
    };
    let blocked = k > GEMM_DEPTH && rows >= 2 && n >= 2 && (rows > 64 || n > 64);
    if !blocked || ad.len() != bd.len() {
        return Ok(a.matmul(b)?);
    }
    let piece = k.div_ceil(k.div_ceil(GEMM_DEPTH));
    let (ka, kb) = (ad.len() - 1, bd.len() - 2);
    let mut start = 0;
    let mut sum: Option<Tensor> = None;
    while start < k {
        let len = piece.min(k - start);
        let part = a
            .narrow(ka, start, len)?
            .matmul(&b.narrow(kb, start, len)?)?;
        sum = Some(match sum {
            None => part,
            Some(s) => (s + part)?,
        });
        start += len;
    }
    sum.ok_or_else(|| crate::Error::Shape("empty matmul".into()))
}
