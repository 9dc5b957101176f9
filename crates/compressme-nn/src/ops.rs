//! Small building blocks on candle-core tensors: differentiable ones for training (layer
//! norm, softmax), and one-pass inference operations for the decoders (attention, RMS norm,
//! sums, the gated product, rotary embedding) that give the bits of the candle chains they
//! replace without waking candle's thread pool.

use candle_core::{D, DType, Tensor};

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

/// RMS normalisation over the last dimension: `x / sqrt(mean(x²) + eps) * weight`, in one
/// pass a row (the mean of squares summed in eight running sums, in a fixed order).
///
/// # Errors
/// A `weight` whose length is not `x`'s last dimension; candle's.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let h = x.dims().last().copied().unwrap_or(0);
    let w = weight.to_vec1::<f32>()?;
    if h == 0 || w.len() != h {
        return Err(crate::Error::Shape(format!(
            "RMS norm of {:?} with a weight of {}",
            x.dims(),
            w.len()
        )));
    }
    let eps = eps as f32;
    let out = with_f32(x, |xs| {
        let mut out = Vec::with_capacity(xs.len());
        for row in xs.chunks_exact(h) {
            let d = (sum8(row, |v| v * v) / h as f32 + eps).sqrt();
            out.extend(row.iter().zip(&w).map(|(&v, &w)| v / d * w));
        }
        out
    })?;
    Ok(Tensor::from_vec(out, x.dims(), x.device())?)
}

/// `rows` is a range of the positions of a sequence of `n` (the rows of logits an
/// evaluation window asks a model for).
///
/// # Errors
/// [`crate::Error::Shape`] naming the range otherwise.
pub(crate) fn check_rows(rows: &std::ops::Range<usize>, n: usize) -> Result<()> {
    if rows.start > rows.end || rows.end > n {
        return Err(crate::Error::Shape(format!(
            "rows {}..{} of {n} positions",
            rows.start, rows.end
        )));
    }
    Ok(())
}

/// `x`'s elements as a `Vec<f32>` in row-major order, and its shape, for the one-pass
/// operations below; `None` for other dtypes, which take candle's ops instead.
fn f32_elements(x: &Tensor) -> Result<Option<Vec<f32>>> {
    if x.dtype() != DType::F32 {
        return Ok(None);
    }
    Ok(Some(x.flatten_all()?.to_vec1::<f32>()?))
}

/// `f` of `x`'s elements in row-major order, read where candle keeps them when `x` is a
/// contiguous f32 tensor in memory (no copy), else of a copy (converted to f32). For
/// inputs that are only read: a window's linears and element-wise operations copied
/// every input once before (about a tenth of a 512-token window's samples were copies).
/// `f` runs under candle's read lock of `x`'s storage, so it must not reach for a tensor's
/// storage itself (a second lock of the same storage on this thread may deadlock once a
/// writer waits): the callers here pass only slices and our own buffers.
pub(crate) fn with_f32<R>(x: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    {
        let (storage, layout) = x.storage_and_layout();
        if let (candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)), Some((a, b))) =
            (&*storage, layout.contiguous_offsets())
            && let Some(v) = v.get(a..b)
        {
            return Ok(f(v));
        }
    }
    let v = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    Ok(f(&v))
}

/// `f` of the elements of `a` and of `b` in row-major order, each read in place where
/// [`with_f32`] reads it so (a window's residual sums and gated products made their
/// output from a copy of one input before: a pass over memory more). `b` is read under
/// `a`'s read lock: a second read lock on this thread, which waits only behind a writer
/// of `a`'s storage, and nothing here writes a storage in place.
pub(crate) fn with_f32_pair<R>(
    a: &Tensor,
    b: &Tensor,
    f: impl FnOnce(&[f32], &[f32]) -> R,
) -> Result<R> {
    with_f32(a, |x| with_f32(b, |y| f(x, y)))?
}

/// The refusal of two tensors that an elementwise operation needs of one shape.
fn shapes_differ(what: &str, a: &Tensor, b: &Tensor) -> crate::Error {
    crate::Error::Shape(format!("{what} of {:?} and {:?}", a.dims(), b.dims()))
}

/// `a + b` for tensors of one shape, for inference: one pass on the calling thread, the
/// same bits as candle's `+` (which, on large tensors, wakes candle's thread pool; a
/// model that runs its own kernels keeps it asleep).
///
/// # Errors
/// Different shapes; candle's.
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.dims() != b.dims() {
        return Err(shapes_differ("a sum", a, b));
    }
    if (a.dtype(), b.dtype()) != (DType::F32, DType::F32) {
        return Ok((a + b)?);
    }
    let x = with_f32_pair(a, b, |x, y| x.iter().zip(y).map(|(&x, &y)| x + y).collect())?;
    Ok(Tensor::from_vec(x, a.dims(), a.device())?)
}

/// `silu(gate) · up` for tensors of one shape (the gated MLP's product), for inference:
/// one pass on the calling thread, `g / (1 + exp(-g)) · u` element by element, the
/// arithmetic of candle's `silu` and `*` and so their bits.
///
/// # Errors
/// Different shapes; candle's.
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if gate.dims() != up.dims() {
        return Err(shapes_differ("a gated product", gate, up));
    }
    if (gate.dtype(), up.dtype()) != (DType::F32, DType::F32) {
        return Ok((gate.silu()? * up)?);
    }
    let g = with_f32_pair(gate, up, |g, u| {
        g.iter()
            .zip(u)
            .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u)
            .collect()
    })?;
    Ok(Tensor::from_vec(g, gate.dims(), gate.device())?)
}

/// Rotary position embedding for inference: `x · cos + rotate_half(x) · sin` on the
/// leading `cos.dim(1)` features of each head of `x` `[b, h, t, hd]`, the rest passed
/// through (partial rotary), where `cos` and `sin` are `[t, rd]` and `rotate_half` of
/// `[x1, x2]` is `[-x2, x1]`. One pass on the calling thread, with the arithmetic of the
/// chain of candle ops it replaces (each product rounded, then the sum), so its bits.
///
/// # Errors
/// `cos` and `sin` not `[t, rd]` with `rd` even and at most `hd`; candle's.
pub fn rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (_, _, t, hd) = x.dims4()?;
    let (ct, rd) = cos.dims2()?;
    if ct != t || sin.dims() != cos.dims() || rd > hd || !rd.is_multiple_of(2) {
        return Err(crate::Error::Shape(format!(
            "rotary embedding of {:?} with cos {:?} and sin {:?}",
            x.dims(),
            cos.dims(),
            sin.dims()
        )));
    }
    let (Some(mut v), Some(c), Some(s)) =
        (f32_elements(x)?, f32_elements(cos)?, f32_elements(sin)?)
    else {
        return Err(crate::Error::Shape(format!(
            "rotary embedding of {:?} {:?} with {:?} tables",
            x.dtype(),
            x.dims(),
            cos.dtype()
        )));
    };
    let half = rd / 2;
    if hd > 0 && rd > 0 {
        let mut rot = vec![0f32; rd];
        for (i, head_row) in v.chunks_exact_mut(hd).enumerate() {
            let p = i % t;
            let (cr, sr) = (&c[p * rd..(p + 1) * rd], &s[p * rd..(p + 1) * rd]);
            let (x1, x2) = head_row[..rd].split_at(half);
            for j in 0..half {
                rot[j] = x1[j] * cr[j] + -x2[j] * sr[j];
                rot[half + j] = x2[j] * cr[half + j] + x1[j] * sr[half + j];
            }
            head_row[..rd].copy_from_slice(&rot);
        }
    }
    Ok(Tensor::from_vec(v, x.dims(), x.device())?)
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
        // the pieces added on this thread (`add`, candle's `+`'s bits): candle's `+` wakes
        // its thread pool, whose barrier spins beside a caller's other lanes
        sum = Some(match sum {
            None => part,
            Some(s) => add(&s, &part)?,
        });
        start += len;
    }
    sum.ok_or_else(|| crate::Error::Shape("empty matmul".into()))
}

/// Query positions a block of [`causal_attention`] takes at a time.
const QUERY_BLOCK: usize = 64;

/// Causal scaled dot-product attention with grouped-query heads, for inference:
/// `softmax(q kᵀ · scale + mask) v` for `q` `[b, heads, t, hd]` (the `t` positions after
/// `past` earlier ones) and `k`, `v` `[b, kv_heads, past + t, hd]`, where query head `h`
/// reads key head `h / (heads / kv_heads)` (consecutive, as transformers' `repeat_kv`
/// orders them). Returns `[b, t, heads * hd]`, the heads side by side.
///
/// It computes what the plain chain of candle ops computes (one `q kᵀ` of every query
/// against every key, a mask of `-inf`, softmax, `· v`), without its waste: queries go
/// 64 (`QUERY_BLOCK`) at a time, each block against only the keys its last query can see,
/// so a window of 512 computes 56% of the full product; the softmax runs in place over
/// the positions a query sees, one pass each for the maximum, the exponentials and the
/// scaling, and the masked positions are zeros that are never exponentiated. The products
/// go through [`matmul`], so every output is the same bits on every x86-64 CPU.
///
/// # Errors
/// Shapes that do not fit (`heads` not a multiple of `kv_heads`, keys not `past + t`
/// long, different head sizes), candle's.
pub fn causal_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    past: usize,
    scale: f64,
) -> Result<Tensor> {
    let (b, heads, t, hd) = q.dims4()?;
    let (kb, kvh, s, khd) = k.dims4()?;
    if kvh == 0
        || !heads.is_multiple_of(kvh)
        || kb != b
        || khd != hd
        || s != past + t
        || v.dims() != k.dims()
    {
        return Err(crate::Error::Shape(format!(
            "attention of queries {:?} past {past} over keys {:?} and values {:?}",
            q.dims(),
            k.dims(),
            v.dims()
        )));
    }
    let rep = heads / kvh;
    let q = q.contiguous()?.reshape((b, kvh, rep, t, hd))?;
    let (k, v) = (k.contiguous()?, v.contiguous()?);
    let scale = scale as f32;
    let mut blocks = Vec::with_capacity(t.div_ceil(QUERY_BLOCK));
    let mut i0 = 0;
    while i0 < t {
        let n = QUERY_BLOCK.min(t - i0);
        // keys the block's last query sees
        let len = past + i0 + n;
        let qb = q
            .narrow(3, i0, n)?
            .contiguous()?
            .reshape((b, kvh, rep * n, hd))?;
        let scores = matmul(&qb, &k.narrow(2, 0, len)?.t()?)?;
        let mut p = scores.flatten_all()?.to_vec1::<f32>()?;
        for (r, row) in p.chunks_exact_mut(len).enumerate() {
            // row r is query i0 + r % n, which sees keys 0..=past + i0 + r % n
            softmax_prefix(row, past + i0 + r % n + 1, scale);
        }
        let probs = Tensor::from_vec(p, (b, kvh, rep * n, len), q.device())?;
        let out = matmul(&probs, &v.narrow(2, 0, len)?)?;
        blocks.push(out.reshape((b, heads, n, hd))?);
        i0 += n;
    }
    let all = if blocks.len() == 1 {
        blocks.swap_remove(0)
    } else {
        Tensor::cat(&blocks, 2)?
    };
    Ok(all
        .transpose(1, 2)?
        .contiguous()?
        .reshape((b, t, heads * hd))?)
}

/// `row[..seen] * scale`, softmaxed in place; `row[seen..]` (positions the query must
/// not see) set to zero.
fn softmax_prefix(row: &mut [f32], seen: usize, scale: f32) {
    let (live, masked) = row.split_at_mut(seen.min(row.len()));
    masked.fill(0.0);
    // the maximum of the scaled scores is the scaled maximum (scale > 0)
    let max = max_f32(live) * scale;
    for x in live.iter_mut() {
        *x = exp_nonpositive(*x * scale - max);
    }
    let sum = sum8(live, |v| v);
    for x in live.iter_mut() {
        *x /= sum;
    }
}

/// The largest of `xs` (NaNs ignored; `-inf` for none), eight lanes at a time.
fn max_f32(xs: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let chunks = xs.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = if x > *a { x } else { *a };
        }
    }
    acc.into_iter()
        .chain(rest.iter().copied())
        .fold(f32::NEG_INFINITY, f32::max)
}

/// `e^x` for `x <= 0` (a softmax's shifted scores), within 2 ulp of the exact value for
/// `x` down to -87 and the same bits on every CPU: plain arithmetic that the compiler
/// vectorises (no library call, no fused multiply-add). `x` below -87 gives `e^-87`
/// (about 1.6e-38, which no sum of probabilities notices); a NaN stays a NaN.
#[inline]
fn exp_nonpositive(x: f32) -> f32 {
    // 1.5 * 2^23: adding it rounds to an integer held in the low bits of the mantissa
    const ROUND: f32 = 12_582_912.0;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = if x < -87.0 { -87.0 } else { x };
    let t = x * std::f32::consts::LOG2_E + ROUND;
    let n = t - ROUND;
    // x = n ln 2 + r, |r| <= ln 2 / 2, in two steps so that r stays exact
    let r = (x - n * LN2_HI) - n * LN2_LO;
    // Taylor to degree 7: the first term left out is below 6e-9 of the result
    let p = 1.0 / 5040.0;
    let p = p * r + 1.0 / 720.0;
    let p = p * r + 1.0 / 120.0;
    let p = p * r + 1.0 / 24.0;
    let p = p * r + 1.0 / 6.0;
    let p = p * r + 0.5;
    let p = p * r + 1.0;
    let p = p * r + 1.0;
    // 2^n from n's bits in t: n is in -126..=0, so n + 127 is a normal exponent
    let n_bits = t.to_bits().wrapping_sub(ROUND.to_bits()).wrapping_add(127) << 23;
    p * f32::from_bits(n_bits)
}

/// The sum of `f(x)` over `xs`, eight running sums added at the end (the order fixed,
/// so the same bits everywhere, and vectorised).
#[inline]
fn sum8(xs: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = xs.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += f(x);
        }
    }
    let mut sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for &x in rest {
        sum += f(x);
    }
    sum
}

#[cfg(test)]
mod tests {
    use candle_core::{D, Device};

    use super::*;

    /// `with_f32` gives the row-major elements `to_vec1` gives: of a whole tensor and of a
    /// narrowed one read in place (its offset), of a transposed one and another dtype
    /// through a copy.
    #[test]
    fn with_f32_reads_every_view_in_row_major_order() {
        let t = Tensor::arange(0f32, 24.0, &Device::Cpu)
            .unwrap()
            .reshape((2, 3, 4))
            .unwrap();
        let views = [
            t.clone(),
            t.narrow(0, 1, 1).unwrap(),
            t.transpose(1, 2).unwrap(),
            t.to_dtype(DType::F64).unwrap(),
        ];
        for x in &views {
            let want = x
                .to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            assert_eq!(
                with_f32(x, <[f32]>::to_vec).unwrap(),
                want,
                "{:?}",
                x.layout()
            );
        }
        assert_eq!(
            with_f32(&views[1], |v| v.first().copied()).unwrap(),
            Some(12.0)
        );
    }

    /// Deterministic values in about [-1, 1).
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// The plain chain of candle ops the fused attention replaces: every query against
    /// every key (key heads repeated), a mask of `-inf`, softmax, `· v`.
    fn plain_attention(q: &Tensor, k: &Tensor, v: &Tensor, past: usize, scale: f64) -> Tensor {
        let (b, heads, t, hd) = q.dims4().unwrap();
        let (_, kvh, s, _) = k.dims4().unwrap();
        let rep = heads / kvh;
        let repeat = |x: &Tensor| {
            x.unsqueeze(2)
                .unwrap()
                .expand((b, kvh, rep, s, hd))
                .unwrap()
                .reshape((b, heads, s, hd))
                .unwrap()
        };
        let (k, v) = (repeat(k), repeat(v));
        let scores = (q.matmul(&k.t().unwrap().contiguous().unwrap()).unwrap() * scale).unwrap();
        let mask: Vec<f32> = (0..t * s)
            .map(|i| {
                if i % s > past + i / s {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let mask = Tensor::from_vec(mask, (t, s), &Device::Cpu).unwrap();
        let probs = softmax_last(&scores.broadcast_add(&mask).unwrap()).unwrap();
        probs
            .matmul(&v)
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
            .reshape((b, t, heads * hd))
            .unwrap()
    }

    fn tensor(shape: (usize, usize, usize, usize), seed: u64, gain: f32) -> Tensor {
        let n = shape.0 * shape.1 * shape.2 * shape.3;
        let v: Vec<f32> = values(n, seed).into_iter().map(|x| x * gain).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    fn max_rel_diff(a: &Tensor, b: &Tensor) -> f32 {
        let (a, b) = (
            a.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            b.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        );
        assert_eq!(a.len(), b.len());
        let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
        a.iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs() / scale)
            .fold(0f32, f32::max)
    }

    #[test]
    fn fused_attention_is_the_plain_chain_of_ops() {
        // grouped heads, several query blocks with a partial last one, a batch of two,
        // and queries that follow cached positions (as in generation)
        for (b, heads, kvh, t, past, hd) in [
            (1, 6, 2, 150, 0, 16),
            (2, 4, 4, 65, 0, 8),
            (1, 9, 3, 1, 37, 64),
            (1, 6, 3, 70, 20, 16),
        ] {
            let s = past + t;
            // scores of several units, so the softmax is far from uniform
            let q = tensor((b, heads, t, hd), 1, 3.0);
            let k = tensor((b, kvh, s, hd), 2, 3.0);
            let v = tensor((b, kvh, s, hd), 3, 1.0);
            let scale = 1.0 / (hd as f64).sqrt();
            let fused = causal_attention(&q, &k, &v, past, scale).unwrap();
            assert_eq!(fused.dims(), &[b, t, heads * hd]);
            let plain = plain_attention(&q, &k, &v, past, scale);
            let d = max_rel_diff(&fused, &plain);
            assert!(d < 1e-5, "{b} {heads} {kvh} {t} {past}: {d}");
            // the first query sees only the first past + 1 keys: a value changed after
            // them does not reach it
            let mut vv = v.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let last = (s - 1) * hd;
            vv[last] += 100.0;
            let v2 = Tensor::from_vec(vv, v.dims(), &Device::Cpu).unwrap();
            let moved = causal_attention(&q, &k, &v2, past, scale).unwrap();
            let first = |x: &Tensor| {
                x.narrow(1, 0, 1)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
            };
            if t > 1 {
                assert_eq!(first(&moved), first(&fused));
            } else {
                assert_ne!(first(&moved), first(&fused));
            }
        }
    }

    #[test]
    fn fused_attention_refuses_shapes_that_do_not_fit() {
        let q = tensor((1, 6, 4, 8), 1, 1.0);
        let k = tensor((1, 4, 4, 8), 2, 1.0);
        assert!(
            causal_attention(&q, &k, &k, 0, 1.0).is_err(),
            "6 heads over 4"
        );
        let k = tensor((1, 2, 5, 8), 2, 1.0);
        assert!(
            causal_attention(&q, &k, &k, 0, 1.0).is_err(),
            "5 keys for 4 queries"
        );
        assert!(causal_attention(&q, &k, &k, 1, 1.0).is_ok());
        let v = tensor((1, 2, 5, 4), 3, 1.0);
        assert!(
            causal_attention(&q, &k, &v, 1, 1.0).is_err(),
            "values of another size"
        );
    }

    #[test]
    fn rms_norm_is_the_plain_chain_of_ops() {
        let x = tensor((1, 2, 7, 576), 5, 4.0).reshape((2, 7, 576)).unwrap();
        let w = Tensor::from_vec(values(576, 9), 576, &Device::Cpu).unwrap();
        let eps = 1e-5;
        let ms = x.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
        let plain = x
            .broadcast_div(&(ms + eps).unwrap().sqrt().unwrap())
            .unwrap()
            .broadcast_mul(&w)
            .unwrap();
        let fused = rms_norm(&x, &w, eps).unwrap();
        assert_eq!(fused.dims(), x.dims());
        assert!(max_rel_diff(&fused, &plain) < 1e-6);
        let short = Tensor::from_vec(values(575, 9), 575, &Device::Cpu).unwrap();
        assert!(rms_norm(&x, &short, eps).is_err());
    }

    fn same_bits(a: &Tensor, b: &Tensor) -> bool {
        a.dims() == b.dims()
            && a.flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .zip(&b.flatten_all().unwrap().to_vec1::<f32>().unwrap())
                .all(|(x, y)| x.to_bits() == y.to_bits())
    }

    /// The one-pass sum and gated product give candle's bits (its `+`, `silu` and `*`,
    /// with its thread pool on large tensors), on values from -40 to 40 and signed zeros,
    /// and refuse shapes that differ.
    #[test]
    fn sum_and_gated_product_are_candles_bits() {
        let mut g = values(3 * 5 * 1536, 11);
        g.iter_mut().step_by(7).for_each(|v| *v *= 40.0);
        g[0] = -0.0;
        g[1] = 0.0;
        let g = Tensor::from_vec(g, (3, 5, 1536), &Device::Cpu).unwrap();
        let u = tensor((1, 3, 5, 1536), 12, 3.0)
            .reshape((3, 5, 1536))
            .unwrap();
        assert!(same_bits(&add(&g, &u).unwrap(), &(&g + &u).unwrap()));
        assert!(same_bits(
            &silu_mul(&g, &u).unwrap(),
            &(g.silu().unwrap() * &u).unwrap()
        ));
        // one tensor twice (its storage read under its own read lock), and views of one
        // storage (a narrowed and a transposed one, read through a copy)
        assert!(same_bits(&add(&u, &u).unwrap(), &(&u + &u).unwrap()));
        let (front, back) = (u.narrow(0, 0, 1).unwrap(), u.narrow(0, 2, 1).unwrap());
        assert!(same_bits(
            &silu_mul(&front, &back).unwrap(),
            &(front.silu().unwrap() * &back).unwrap()
        ));
        let t = u.transpose(0, 1).unwrap();
        assert!(same_bits(&add(&t, &t).unwrap(), &(&t + &t).unwrap()));
        let other = u.narrow(2, 0, 1535).unwrap();
        assert!(add(&g, &other).is_err());
        assert!(silu_mul(&g, &other).is_err());
    }

    /// The chain of candle ops [`rotary`] replaces, as the decoder ran it.
    fn plain_rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
        let hd = x.dim(3).unwrap();
        let rd = cos.dim(1).unwrap();
        let rot = x.narrow(3, 0, rd).unwrap();
        let x1 = rot.narrow(3, 0, rd / 2).unwrap();
        let x2 = rot.narrow(3, rd / 2, rd / 2).unwrap();
        let rotated = Tensor::cat(&[&x2.neg().unwrap(), &x1], 3).unwrap();
        let out = (rot.broadcast_mul(cos).unwrap() + rotated.broadcast_mul(sin).unwrap()).unwrap();
        if rd == hd {
            out
        } else {
            Tensor::cat(&[&out, &x.narrow(3, rd, hd - rd).unwrap()], 3)
                .unwrap()
                .contiguous()
                .unwrap()
        }
    }

    /// [`rotary`] gives the plain chain's bits, full and partial (a quarter of each head
    /// rotated), a batch of two, several heads; tables that do not fit are refused.
    #[test]
    fn rotary_is_the_plain_chain_of_ops() {
        for (b, h, t, hd, rd) in [(1, 9, 37, 64, 64), (2, 3, 5, 64, 16), (1, 1, 1, 8, 8)] {
            let x = tensor((b, h, t, hd), 21, 2.0);
            let angles: Vec<f32> = (0..t * rd).map(|i| i as f32 * 0.37).collect();
            let cos: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
            let sin: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
            let cos = Tensor::from_vec(cos, (t, rd), &Device::Cpu).unwrap();
            let sin = Tensor::from_vec(sin, (t, rd), &Device::Cpu).unwrap();
            let fused = rotary(&x, &cos, &sin).unwrap();
            assert!(
                same_bits(&fused, &plain_rotary(&x, &cos, &sin)),
                "{b} {h} {t} {hd} {rd}"
            );
            if t > 1 {
                assert!(rotary(&x, &cos.narrow(0, 0, t - 1).unwrap(), &sin).is_err());
            }
        }
        let x = tensor((1, 2, 3, 8), 1, 1.0);
        let wide = Tensor::zeros((3, 10), DType::F32, &Device::Cpu).unwrap();
        assert!(rotary(&x, &wide, &wide).is_err());
        let odd = Tensor::zeros((3, 5), DType::F32, &Device::Cpu).unwrap();
        assert!(rotary(&x, &odd, &odd).is_err());
    }

    #[test]
    fn the_exponential_is_within_two_ulp() {
        let mut worst = 0f64;
        for i in 0..=200_000 {
            let x = -87.0 * i as f32 / 200_000.0;
            let got = exp_nonpositive(x);
            let want = f64::from(x).exp();
            let ulp =
                f64::from(f32::from_bits((want as f32).to_bits() + 1)) - f64::from(want as f32);
            worst = worst.max((f64::from(got) - want).abs() / ulp);
        }
        assert!(worst <= 2.0, "{worst} ulp");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert!(exp_nonpositive(f32::NAN).is_nan());
        let floor = exp_nonpositive(-87.0);
        assert!(floor > 0.0 && floor < 2e-38);
        assert_eq!(exp_nonpositive(-1e30), floor);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), floor);
    }

    #[test]
    fn softmax_of_a_prefix_sums_to_one_and_zeroes_the_rest() {
        let mut row = values(100, 4);
        softmax_prefix(&mut row, 37, 2.0);
        assert!(row[37..].iter().all(|&p| p == 0.0));
        let sum: f32 = row[..37].iter().sum();
        assert!((sum - 1.0).abs() < 1e-5, "{sum}");
        assert!(row[..37].iter().all(|&p| p > 0.0));
    }
}
