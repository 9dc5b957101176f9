//! Packed `Linear` and `Embedding` against their dense definitions.

use candle_core::{DType, Device, Tensor};
use compressme_nn::{
    DIRECT_MAX_ROWS, Embedding, Hooks, KERNEL_CHUNK_ROWS, KERNEL_MIN_WEIGHTS, Linear, PackOptions,
    Storage, Table, Weight,
};
use compressme_quant::synthetic::{MatrixKind, matrix};
use compressme_quant::{Format, GroupSize, error_bound, error_bound_block8};

fn packed_linear(format: Format, out: usize, inp: usize) -> (Linear, Vec<f32>) {
    let dev = Device::Cpu;
    let w = Tensor::from_vec(matrix(MatrixKind::StudentT, out, inp, 3), (out, inp), &dev).unwrap();
    let b = Tensor::from_vec(matrix(MatrixKind::Gaussian, 1, out, 4), out, &dev).unwrap();
    let mut l = Linear::new("test.linear", w, Some(b), Hooks::default()).unwrap();
    let new = l.prepare(&Storage::Quant(format), &dev).unwrap();
    assert!(matches!(new, Weight::Packed(_)));
    l.set_weight(new).unwrap();
    let deq = l.weight_f32().unwrap();
    (l, deq)
}

/// Small batches (packed kernels) and large ones (packed kernels a chunk of rows at a time,
/// or dequantized tiles and candle's kernel) all compute `x W^T + b` for the dequantized
/// `W`, for 2-D and 3-D inputs.
#[test]
fn packed_linear_matches_its_dequantized_weights() {
    // a layer below KERNEL_MIN_WEIGHTS (dequantized tiles above DIRECT_MAX_ROWS rows) and
    // one above it (the kernels, a chunk of rows a call)
    const { assert!(70 * 96 < KERNEL_MIN_WEIGHTS && 300 * 256 >= KERNEL_MIN_WEIGHTS) };
    for (format, (out, inp)) in [
        Format::Int8,
        Format::Nf4,
        Format::Nf4Block(GroupSize::G32),
        Format::Int4Block(GroupSize::G64),
        Format::F16,
    ]
    .into_iter()
    .flat_map(|f| [(f, (70, 96)), (f, (300, 256))])
    {
        let (l, deq) = packed_linear(format, out, inp);
        let dev = Device::Cpu;
        let wt = Tensor::from_vec(deq.clone(), (out, inp), &dev).unwrap();
        let bias = l.bias().unwrap().clone();
        for rows in [
            1usize,
            3,
            DIRECT_MAX_ROWS,
            DIRECT_MAX_ROWS + 1,
            100,
            2 * KERNEL_CHUNK_ROWS + 5,
        ] {
            let xv = matrix(MatrixKind::Gaussian, rows, inp, rows as u64);
            let x = Tensor::from_vec(xv.clone(), (rows, inp), &dev).unwrap();
            let want = x
                .matmul(&wt.t().unwrap())
                .unwrap()
                .broadcast_add(&bias)
                .unwrap();
            let got = l.forward(&x).unwrap();
            let (w2, g2) = (
                want.to_vec2::<f32>().unwrap(),
                got.to_vec2::<f32>().unwrap(),
            );
            for (i, (a, b)) in w2.iter().zip(&g2).enumerate() {
                for (r, (p, q)) in a.iter().zip(b).enumerate() {
                    let nf4 = if matches!(format, Format::Nf4 | Format::Nf4Block(_)) {
                        10.0
                    } else {
                        0.0
                    };
                    let (xr, wr) = (&xv[i * inp..(i + 1) * inp], &deq[r * inp..(r + 1) * inp]);
                    // the 4-bit formats round activations to 8 bits a block (every batch)
                    let block8 = if format.code_bits() == 4 {
                        error_bound_block8(xr, wr, nf4)
                    } else {
                        0.0
                    };
                    let bound = error_bound(xr, wr, nf4).max(block8) + 1e-4;
                    assert!(
                        (p - q).abs() <= bound,
                        "{format} rows {rows} [{i},{r}]: {p} vs {q}"
                    );
                }
            }
            // the same rows as [batch, seq, in]
            if rows % 2 == 0 {
                let x3 = x.reshape((2, rows / 2, inp)).unwrap();
                let y3 = l.forward(&x3).unwrap();
                assert_eq!(y3.dims(), &[2, rows / 2, out]);
            }
        }
    }
}

/// On every SIMD tier a layer of `KERNEL_MIN_WEIGHTS` weights or more runs the packed
/// kernels at every batch, in every format, F16 and BF16 included: its output above
/// `DIRECT_MAX_ROWS` rows is the kernels' own, bit for bit, so a model's outputs are the
/// same on every CPU with AVX2 (the tiers give the same bits; dequantized tiles and
/// candle's kernel, which F16/BF16 used below AVX-512, do not).
#[test]
fn large_layers_run_the_kernels_at_every_batch_in_every_format() {
    use compressme_quant::{Tier, kernel_tier, matmul_into};
    let tier = kernel_tier().unwrap();
    if tier == Tier::Portable {
        eprintln!(
            "skipped: large_layers_run_the_kernels_at_every_batch_in_every_format needs a SIMD tier (this process runs {tier:?})"
        );
        return;
    }
    let dev = Device::Cpu;
    let (out, inp, rows) = (300, 256, DIRECT_MAX_ROWS + 68);
    const { assert!(300 * 256 >= KERNEL_MIN_WEIGHTS && DIRECT_MAX_ROWS + 68 <= KERNEL_CHUNK_ROWS) };
    for format in [
        Format::F16,
        Format::Bf16,
        Format::Int8,
        Format::Nf4Block(GroupSize::G64),
    ] {
        let w =
            Tensor::from_vec(matrix(MatrixKind::StudentT, out, inp, 3), (out, inp), &dev).unwrap();
        let mut l = Linear::new("test.linear", w, None, Hooks::default()).unwrap();
        let new = l.prepare(&Storage::Quant(format), &dev).unwrap();
        l.set_weight(new).unwrap();
        let Weight::Packed(p) = l.weight() else {
            panic!("{format}: not packed");
        };
        let xv = matrix(MatrixKind::Gaussian, rows, inp, 7);
        let mut want = vec![0f32; rows * out];
        matmul_into(&xv, rows, p, &mut want).unwrap();
        let x = Tensor::from_vec(xv, (rows, inp), &dev).unwrap();
        let got = l.forward(&x).unwrap().flatten_all().unwrap();
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&got.to_vec1::<f32>().unwrap()),
            bits(&want),
            "{format} on {tier:?}, {rows} rows"
        );
    }
}

#[test]
fn embedding_storages_return_the_table_dtype_and_keep_zero_rows() {
    let dev = Device::Cpu;
    let mut v = matrix(MatrixKind::Gaussian, 50, 24, 5);
    v[..24].fill(0.0); // a padding row
    let table = Tensor::from_vec(v, (50, 24), &dev)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let ids = Tensor::new(&[[0u32, 7], [49, 0]], &dev).unwrap();
    let mut e = Embedding::new("emb", table.clone(), Hooks::default()).unwrap();
    let dense = e.forward(&ids).unwrap();
    for storage in [
        Storage::Lossless(PackOptions::default()),
        Storage::Quant(Format::Int8Rows),
    ] {
        let t = e.prepare(&storage).unwrap();
        let lossless = matches!(t, Table::Lossless(_));
        let mut e2 = e.clone();
        e2.set_table(t);
        let got = e2.forward(&ids).unwrap();
        assert_eq!(got.dtype(), DType::BF16);
        assert_eq!(got.dims(), &[2, 2, 24]);
        let g = got
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let d = dense
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert!(g[..24].iter().all(|x| x.to_bits() == 0), "padding row");
        if lossless {
            assert_eq!(g, d);
        } else {
            assert!(
                g.iter()
                    .zip(&d)
                    .all(|(a, b)| (a - b).abs() <= 0.02 * b.abs().max(0.1))
            );
        }
    }
    // any quantized format serves lookups: the rows asked for, dequantized
    let nf4 = e.prepare(&Storage::Quant(Format::Nf4)).unwrap();
    assert_eq!(nf4.describe(), "nf4");
    e.set_table(e.prepare(&Storage::Dense).unwrap());
    let past_end = e.forward(&Tensor::new(&[50u32], &dev).unwrap());
    assert!(past_end.is_err());
}

/// `ops::matmul` gives, on whatever CPU runs the test, the bits of a definition that
/// names no CPU: each output the in-order `fma` sum of each piece of the depth (pieces of
/// `ceil(k / ceil(k / 512))` where `gemm`'s general path would block the sum, of 512
/// where its small path blocks it), the pieces added in order. candle's own matmul
/// blocks by the L1 cache's size, so on some CPUs it differs from this. (`b` row-major
/// `[k, n]` here: for it `gemm` sums each block in order; for other layouts its
/// microkernels order a block's sum their own way, which is fixed when the crate is
/// compiled and so is the same on every CPU too.)
#[test]
fn matmul_gives_the_same_bits_on_every_cpu() {
    use candle_core::{Device, Tensor};
    let mut s = 7u64;
    let mut next = || {
        s = s
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    };
    // (m, k, n, piece): the general path at 576 and 1536 deep, the small path (both
    // sides at most 64), and a depth gemm never splits
    for (m, k, n, piece) in [
        (130, 576, 96, 288),
        (2, 1536, 70, 512),
        (40, 1100, 40, 512),
        (100, 300, 80, 300),
    ] {
        let a: Vec<f32> = (0..m * k).map(|_| next()).collect();
        let b: Vec<f32> = (0..n * k).map(|_| next()).collect();
        let at = Tensor::from_slice(&a, (m, k), &Device::Cpu).unwrap();
        let bt = Tensor::from_slice(&b, (n, k), &Device::Cpu).unwrap();
        let bt = bt.t().unwrap().contiguous().unwrap();
        let got: Vec<f32> = compressme_nn::ops::matmul(&at, &bt)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let mut same = 0;
        for i in 0..m {
            for j in 0..n {
                let mut total: Option<f32> = None;
                for lo in (0..k).step_by(piece) {
                    let mut acc = 0f32;
                    for t in lo..(lo + piece).min(k) {
                        acc = a[i * k + t].mul_add(b[j * k + t], acc);
                    }
                    total = Some(total.map_or(acc, |v| v + acc));
                }
                same += usize::from(total.unwrap().to_bits() == got[i * n + j].to_bits());
            }
        }
        assert_eq!(same, m * n, "({m}, {k}, {n}) in pieces of {piece}");
    }
}
