//! llama.cpp's weight formats through candle's GGUF types, for putting them beside ours on
//! the same weights. Shapes are checked before candle is called: some of its quantizers
//! panic on shapes they do not support.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use std::sync::Arc;

use compressme_quant::{GgmlKind, GgmlMatrix};

use crate::{Error, Model, ModuleMut, Result, Weight};

/// Which of candle's quantized-matmul kernels this CPU gets: candle 0.11 picks one at
/// run time (`avx512-vnni` and `avx-vnni` repack Q8_0/Q4_K/Q6_K into tiles and multiply
/// with `vpdpbusd`; `avx2`; `portable` otherwise), and their arithmetic differs, so the
/// likelihoods of a model run by candle's formats are reproducible only on the same tier.
#[must_use]
pub fn candle_kernel_tier() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vnni") {
            return "avx512-vnni";
        }
        if is_x86_feature_detected!("avxvnni") && is_x86_feature_detected!("avx2") {
            return "avx-vnni";
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return "avx2";
        }
    }
    "portable"
}

/// The llama.cpp formats compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LlamaFormat {
    /// 8-bit, one f16 scale per 32 weights: 8.5 bits a weight.
    Q8_0,
    /// 4-bit, one f16 scale per 32 weights: 4.5 bits a weight.
    Q4_0,
    /// 4-bit, one f16 scale and one f16 minimum per 32 weights: 5 bits a weight (the layout
    /// of our `int4-g32`).
    Q4_1,
    /// 4-bit K-quant, super-blocks of 256 with 6-bit sub-block scales and minimums: 4.5 bits.
    Q4K,
    /// 6-bit K-quant, super-blocks of 256: 6.5625 bits a weight.
    Q6K,
    /// 5-bit, one f16 scale per 32 weights: 5.5 bits a weight (llama.cpp's fallback for
    /// Q4_K on rows that are not a multiple of 256).
    Q5_0,
}

impl LlamaFormat {
    /// Every format compared.
    pub const ALL: [Self; 6] = [
        Self::Q8_0,
        Self::Q4_0,
        Self::Q4_1,
        Self::Q4K,
        Self::Q6K,
        Self::Q5_0,
    ];

    /// candle's type for the format.
    #[must_use]
    pub fn ggml(self) -> GgmlDType {
        match self {
            Self::Q8_0 => GgmlDType::Q8_0,
            Self::Q4_0 => GgmlDType::Q4_0,
            Self::Q4_1 => GgmlDType::Q4_1,
            Self::Q4K => GgmlDType::Q4K,
            Self::Q6K => GgmlDType::Q6K,
            Self::Q5_0 => GgmlDType::Q5_0,
        }
    }

    /// The format a row of `cols` weights gets: this one, or, for a K-quant on rows
    /// that are not a multiple of 256, the type llama.cpp's quantizer falls back to
    /// (`Q4_K` -> `Q5_0`, `Q6_K` -> `Q8_0`).
    #[must_use]
    pub fn for_width(self, cols: usize) -> Self {
        match self {
            Self::Q4K if !cols.is_multiple_of(256) => Self::Q5_0,
            Self::Q6K if !cols.is_multiple_of(256) => Self::Q8_0,
            f => f,
        }
    }

    /// The name llama.cpp gives it (`q8_0`, `q4_k`, ...).
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Q8_0 => "q8_0",
            Self::Q4_0 => "q4_0",
            Self::Q4_1 => "q4_1",
            Self::Q4K => "q4_k",
            Self::Q6K => "q6_k",
            Self::Q5_0 => "q5_0",
        }
    }

    /// Weights a block spans along a row; a row's length must be a multiple of it.
    #[must_use]
    pub fn block(self) -> usize {
        self.ggml().block_size()
    }
}

/// Weights quantized to a llama.cpp format and back.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaQuantized {
    /// Bytes candle's quantized tensor keeps.
    pub stored_bytes: usize,
    /// The weights dequantized again, row-major.
    pub dequantized: Vec<f32>,
}

/// Quantizes row-major `[rows, cols]` weights to `format` with candle and dequantizes them.
///
/// # Errors
/// [`Error::NotEligible`] when a row's length is not a multiple of the format's block (256
/// for K-quants, 32 otherwise), the shape does not fit the data, or a weight is not finite;
/// candle errors otherwise.
pub fn llama_quantize(
    w: &[f32],
    rows: usize,
    cols: usize,
    format: LlamaFormat,
) -> Result<LlamaQuantized> {
    let q = llama_qtensor(w, rows, cols, format)?;
    let dequantized = q
        .dequantize(&Device::Cpu)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    Ok(LlamaQuantized {
        stored_bytes: q.storage_size_in_bytes(),
        dequantized,
    })
}

/// Quantizes row-major `[rows, cols]` weights to `format` as candle's quantized tensor
/// (for [`crate::Weight::Ggml`] or a GGUF file), after the checks candle would otherwise
/// panic on.
///
/// # Errors
/// As [`llama_quantize`].
pub fn llama_qtensor(w: &[f32], rows: usize, cols: usize, format: LlamaFormat) -> Result<QTensor> {
    if rows == 0 || cols == 0 || rows.checked_mul(cols) != Some(w.len()) {
        return Err(Error::NotEligible(format!(
            "{} weights do not make a [{rows}, {cols}] matrix",
            w.len()
        )));
    }
    if !cols.is_multiple_of(format.block()) {
        return Err(Error::NotEligible(format!(
            "{format:?} needs rows whose length is a multiple of {}, got {cols}",
            format.block()
        )));
    }
    if w.iter().any(|v| !v.is_finite()) {
        return Err(Error::NotEligible("weights must be finite".into()));
    }
    let t = Tensor::from_slice(w, (rows, cols), &Device::Cpu)?;
    Ok(QTensor::quantize(&t, format.ggml())?)
}

/// Puts a [`GgmlMatrix`] beside the candle weights of `model`'s linears that candle
/// multiplies one output at a time ([`crate::Weight::GgmlReplica`]), so that their
/// products give candle's bits in a fraction of its time: every Q5_0 weight (candle 0.11
/// has no SIMD path for Q5_0, the type llama.cpp's quantizer gives rows whose length is
/// not a multiple of 256 in a Q4_K model), and the Q8_0 weights candle does not repack
/// into its VNNI tiles (rows whose length is not a multiple of 256, or a row count not a
/// multiple of 16: never repacked, whatever its tier), which it runs on its AVX2 dot
/// product. Returns how many it replaced: none unless the kernel tier is AVX-512 VNNI or
/// the AMX tier above it, the only tiers with a faster path (and a CPU where candle takes
/// its AVX2 path).
///
/// For scoring quality only: a model whose speed stands for candle's keeps candle's
/// kernels.
///
/// # Errors
/// [`Error::Quant`] when `COMPRESSME_KERNEL` names a tier this CPU lacks or candle's
/// bytes are not Q5_0 blocks of the tensor's shape; candle's errors reading them.
pub fn replicate_ggml<M: Model + ?Sized>(model: &mut M) -> Result<usize> {
    if compressme_quant::kernel_tier()? < compressme_quant::Tier::Avx512Vnni {
        return Ok(0);
    }
    let mut replaced = 0;
    for name in model.module_names() {
        let Some(ModuleMut::Linear(l)) = model.module_mut(&name) else {
            continue;
        };
        let Weight::Ggml(q) = l.weight() else {
            continue;
        };
        let (rows, cols) = q.shape().dims2()?;
        let kind = match q.dtype() {
            GgmlDType::Q5_0 => GgmlKind::Q5_0,
            // candle repacks these into its VNNI tiles (`repack_x86::select`)
            GgmlDType::Q8_0 if !(cols.is_multiple_of(256) && rows.is_multiple_of(16)) => {
                GgmlKind::Q8_0
            }
            _ => continue,
        };
        let m = GgmlMatrix::from_blocks(kind, &q.data()?, rows, cols)?;
        let w = Weight::GgmlReplica(Arc::clone(q), Arc::new(m));
        l.set_weight(w)?;
        replaced += 1;
    }
    Ok(replaced)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_candle_cannot_take_are_refused_before_calling_it() {
        let w = vec![0.5f32; 2 * 100];
        let e = llama_quantize(&w, 2, 100, LlamaFormat::Q4K).unwrap_err();
        assert!(e.to_string().contains("multiple of 256"), "{e}");
        assert!(llama_quantize(&w, 2, 100, LlamaFormat::Q8_0).is_err());
        assert!(llama_quantize(&w[..10], 2, 100, LlamaFormat::Q8_0).is_err());
        assert!(llama_quantize(&[f32::NAN; 32], 1, 32, LlamaFormat::Q8_0).is_err());
    }

    /// Q5_0 and Q8_0 layers on their replicas against candle's own kernels, on every tier
    /// this CPU runs: the same bits, at one row and at a batch (candle's two paths). The
    /// Q8_0 bits are those of candle's AVX2 kernel, which it runs where the CPU has AVX2
    /// and FMA.
    #[test]
    fn ggml_replicas_give_candles_bits_on_every_tier() {
        use crate::{Hooks, Linear, Weight};
        use compressme_quant::{Backend, Tier};
        let avx2 = Tier::Avx2.supported();
        for (format, kind) in [
            (LlamaFormat::Q5_0, GgmlKind::Q5_0),
            (LlamaFormat::Q8_0, GgmlKind::Q8_0),
        ] {
            if kind == GgmlKind::Q8_0 && !avx2 {
                eprintln!("skipped: the Q8_0 replica (candle runs its scalar Q8_0 loop here)");
                continue;
            }
            let (rows, cols) = (40, 576);
            let w: Vec<f32> = (0..rows * cols)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 100.0 * (1.0 + (i % 7) as f32))
                .collect();
            let q = Arc::new(llama_qtensor(&w, rows, cols, format).unwrap());
            let m = GgmlMatrix::from_blocks(kind, &q.data().unwrap(), rows, cols).unwrap();
            let dense = Tensor::from_slice(&w, (rows, cols), &Device::Cpu).unwrap();
            let mut l = Linear::new("l", dense, None, Hooks::default()).unwrap();
            l.set_weight(Weight::Ggml(Arc::clone(&q))).unwrap();
            for batch in [1, 9] {
                let xv: Vec<f32> = (0..batch * cols)
                    .map(|i| (i as f32 * 0.37).sin() * (1 + i % 5) as f32)
                    .collect();
                let x = Tensor::from_slice(&xv, (1, batch, cols), &Device::Cpu).unwrap();
                let candle: Vec<u32> = l
                    .forward(&x)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
                    .into_iter()
                    .map(f32::to_bits)
                    .collect();
                for tier in Tier::ALL.into_iter().filter(|t| t.supported()) {
                    let got: Vec<u32> = m
                        .matmul_with(Backend::Tier(tier), &xv, batch)
                        .unwrap()
                        .into_iter()
                        .map(f32::to_bits)
                        .collect();
                    assert_eq!(got, candle, "{kind:?}, tier {tier} at batch {batch}");
                }
            }
            let mut r = l.clone();
            r.set_weight(Weight::GgmlReplica(Arc::clone(&q), Arc::new(m)))
                .unwrap();
            let name = format!("candle {:?} (replica)", format.ggml()).to_lowercase();
            assert_eq!(r.weight().describe(), name);
            assert_eq!(r.stored_bytes(), l.stored_bytes());
        }
    }

    /// candle's AMX Q4_K kernel (a batch of 32 or more) configures a thread's tiles once
    /// and keeps them; both of our AMX paths (INT8 per row, and NF4-g64 with 8-bit
    /// activations), run on the same thread between two of its products, give the
    /// configuration back as they found it, so candle's second product is its first's bits
    /// (with the tiles released after ours, candle's next product dies with SIGILL, and so
    /// does this test; with ours left loaded, candle's bits here did not change, so this
    /// test does not see a configuration merely left reshaped). Skipped by name without AMX.
    #[test]
    fn our_amx_tiles_leave_candles_tiles_as_they_were() {
        use crate::{Hooks, Linear};
        use compressme_quant::{Backend, Format, GroupSize, Tier, matmul_with, quantize};
        if !Tier::Avx512Amx.supported() {
            eprintln!(
                "skipped: our_amx_tiles_leave_candles_tiles_as_they_were (this CPU lacks {})",
                Tier::Avx512Amx.needs()
            );
            return;
        }
        let (rows, cols, batch) = (64, 512, 32);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 100.0)
            .collect();
        let dense = Tensor::from_slice(&w, (rows, cols), &Device::Cpu).unwrap();
        let mut l = Linear::new("l", dense, None, Hooks::default()).unwrap();
        l.set_weight(Weight::Ggml(Arc::new(
            llama_qtensor(&w, rows, cols, LlamaFormat::Q4K).unwrap(),
        )))
        .unwrap();
        let xv: Vec<f32> = (0..batch * cols).map(|i| (i as f32 * 0.37).sin()).collect();
        let x = Tensor::from_slice(&xv, (1, batch, cols), &Device::Cpu).unwrap();
        let candle = || -> Vec<u32> {
            let y = l.forward(&x).unwrap().flatten_all().unwrap();
            y.to_vec1::<f32>()
                .unwrap()
                .into_iter()
                .map(f32::to_bits)
                .collect()
        };
        // both of our AMX paths: INT8 per row (14-bit activations) and NF4-g64 (8-bit)
        for format in [Format::Int8, Format::Nf4Block(GroupSize::G64)] {
            let q = quantize(&w, rows, cols, format).unwrap();
            let ours = || matmul_with(Backend::Tier(Tier::Avx512Amx), &xv, batch, &q).unwrap();
            // one thread: candle's block of 32 rows and our product on this thread
            compressme_quant::single_threaded(|| {
                let want = candle();
                let y = ours();
                assert_eq!(candle(), want, "{format:?}");
                assert_eq!(ours(), y, "{format:?}");
                assert_eq!(candle(), want, "{format:?}");
            });
        }
    }

    #[test]
    fn a_linear_runs_candle_quantized_weights() {
        use crate::{Hooks, Linear, Weight};
        let (rows, cols) = (8, 64);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 100.0)
            .collect();
        let dense = Tensor::from_slice(&w, (rows, cols), &Device::Cpu).unwrap();
        let bias = Tensor::from_slice(&[0.5f32; 8], 8, &Device::Cpu).unwrap();
        let mut l = Linear::new("l", dense, Some(bias), Hooks::default()).unwrap();
        let x = Tensor::from_vec(
            (0..3 * cols)
                .map(|i| (i as f32 * 0.13).sin())
                .collect::<Vec<f32>>(),
            (1, 3, cols),
            &Device::Cpu,
        )
        .unwrap();
        let want = l
            .forward(&x)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let q = llama_qtensor(&w, rows, cols, LlamaFormat::Q8_0).unwrap();
        l.set_weight(Weight::Ggml(std::sync::Arc::new(q))).unwrap();
        assert_eq!(l.weight().describe(), "candle q8_0");
        assert_eq!(l.stored_bytes(), (rows * cols / 32 * 34 + 4 * rows) as u64);
        let y = l.forward(&x).unwrap();
        assert_eq!(y.dims(), &[1, 3, rows]);
        let got = y.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let err = want
            .iter()
            .zip(&got)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(err > 0.0 && err < 0.05, "max error {err}");
        let back = l.weight_f32().unwrap();
        assert_eq!(back.len(), rows * cols);
        // a weight of another shape is refused
        let other = llama_qtensor(&w, cols, rows, LlamaFormat::Q8_0);
        assert!(other.is_err(), "8 is not a multiple of 32");
        let wide = llama_qtensor(&vec![0.1; 4 * 64], 4, 64, LlamaFormat::Q8_0).unwrap();
        assert!(
            l.set_weight(Weight::Ggml(std::sync::Arc::new(wide)))
                .is_err()
        );
    }

    #[test]
    fn q8_0_round_trip_is_close_and_bytes_are_counted() {
        let w: Vec<f32> = (0..2 * 256)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 100.0)
            .collect();
        let q = llama_quantize(&w, 2, 256, LlamaFormat::Q8_0).unwrap();
        // 34 bytes per 32 weights
        assert_eq!(q.stored_bytes, 2 * 256 / 32 * 34);
        let err = w
            .iter()
            .zip(&q.dequantized)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(err < 0.5 / 127.0 + 1e-6, "max error {err}");
    }
}
