//! Exact properties, the fast kernel against the scalar reference, and bad input.

use compressme_quant::{
    Activations, Backend, Error, Format, GroupSize, Packed, Tier, error_bound, error_bound_block8,
    matmul, matmul_into, matmul_into_using, matmul_with, quantize, reference,
};
use proptest::prelude::*;

use crate::{Rng, all_formats, matrix};

fn format() -> impl Strategy<Value = Format> {
    prop::sample::select(all_formats())
}

/// Shapes across group boundaries: 1..=257 columns, odd lengths included.
fn case() -> impl Strategy<Value = (Format, usize, usize, u64)> {
    (
        format(),
        1usize..=6,
        prop_oneof![
            1usize..=257,
            Just(31),
            Just(32),
            Just(33),
            Just(63),
            Just(64),
            Just(65),
            Just(127),
            Just(128),
            Just(129)
        ],
        any::<u64>(),
    )
}

fn weights(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..rows * cols)
        .map(|_| (r.student_t(4) * 0.05) as f32)
        .collect()
}

/// The largest NF4 scale of row `r` (0 for other formats): what the kernels' rounded
/// codebook can be off by, per unit of code.
fn nf4_scale(q: &Packed, r: usize) -> f32 {
    let per_row = match q.format() {
        Format::Nf4 => 1,
        Format::Nf4Block(g) => q.cols().div_ceil(g.get()),
        _ => return 0.0,
    };
    q.scales()[r * per_row..(r + 1) * per_row]
        .iter()
        .fold(0f32, |m, v| m.max(*v))
}

fn dequantized(q: &Packed) -> Vec<f32> {
    let mut out = vec![0f32; q.rows() * q.cols()];
    q.dequantize_into(&mut out).unwrap();
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// Quantizing dequantized weights gives the same codes back, and the same weights.
    #[test]
    fn quantize_of_dequantize_is_the_identity((format, rows, cols, seed) in case()) {
        let q = quantize(&weights(rows, cols, seed), rows, cols, format).unwrap();
        let d = dequantized(&q);
        let q2 = quantize(&d, rows, cols, format).unwrap();
        prop_assert_eq!(q2.codes(), q.codes());
        prop_assert_eq!(dequantized(&q2), d);
    }

    /// The kernels that read packed rows stay within the stated bound of
    /// dequantize-then-multiply, on every backend; the SIMD and portable backends agree.
    #[test]
    fn matmul_matches_reference(
        (format, rows, cols, seed) in case(),
        batch in prop_oneof![0usize..=6, 8usize..=20],
    ) {
        let q = quantize(&weights(rows, cols, seed), rows, cols, format).unwrap();
        let x = weights(batch, cols, seed ^ 0xabc);
        let fast = matmul(&x, batch, &q).unwrap();
        let port = matmul_with(Backend::Portable, &x, batch, &q).unwrap();
        let slow = reference::matmul(&x, batch, &q).unwrap();
        prop_assert_eq!(fast.len(), batch * rows);
        prop_assert_eq!(port.len(), batch * rows);
        let w = dequantized(&q);
        for b in 0..batch {
            let xb = &x[b * cols..(b + 1) * cols];
            for r in 0..rows {
                let wr = &w[r * cols..(r + 1) * cols];
                let nf4 = nf4_scale(&q, r);
                let bound = error_bound(xb, wr, nf4);
                // the 4-bit formats take 8-bit activations (at every batch)
                let block8 = Activations::default_for(format) == Activations::Block8;
                let fast_bound = if block8 { bound.max(error_bound_block8(xb, wr, nf4)) } else { bound };
                let (f, p, s) = (fast[b * rows + r], port[b * rows + r], slow[b * rows + r]);
                prop_assert!((f - s).abs() <= fast_bound, "[{b}, {r}]: {f} vs {s}, bound {fast_bound}");
                prop_assert!((p - s).abs() <= bound, "[{b}, {r}]: {p} vs {s}, bound {bound}");
                // same integer sums, f32 in another order
                let mag: f32 = xb.iter().zip(wr).map(|(a, c)| (a * c).abs()).sum::<f32>()
                    + xb.iter().map(|a| a.abs()).sum::<f32>() * wr.iter().fold(0f32, |m, v| m.max(v.abs()));
                if !block8 {
                    prop_assert!((f - p).abs() <= 1e-5 * mag + 1e-30, "[{b}, {r}]: {f} vs {p}");
                }
            }
        }
    }

    /// One row of activations (generation: four weight rows a kernel call, codes read in
    /// place) gives the same bits as that row inside a larger batch (one weight row at a
    /// time against up to four `x` rows), on every backend, with 14-bit activations: the
    /// same integer sums, flushed and summed in the same order. (A batch of 8 or more
    /// runs the tiles, whose sums are flushed per group a lane: not these bits, and not
    /// drawn here.)
    #[test]
    fn one_row_gives_the_bits_of_that_row_in_a_batch(
        (format, _, cols, seed) in case(),
        rows in 1usize..=41,
        batch in 2usize..=6,
    ) {
        let q = quantize(&weights(rows, cols, seed), rows, cols, format).unwrap();
        let x = weights(batch, cols, seed ^ 0xdef);
        for backend in [Backend::Auto, Backend::Portable] {
            let run = |x: &[f32], batch: usize| {
                let mut y = vec![f32::NAN; batch * rows];
                matmul_into_using(backend, Activations::Fixed14, x, batch, &q, &mut y).unwrap();
                y
            };
            let (all, one) = (run(&x, batch), run(&x[..cols], 1));
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&one), bits(&all[..rows]), "{:?} {:?}", format, backend);
        }
    }

    /// With 8-bit activations a 4-bit format gives each row of `x` the same bits in a
    /// batch of any size, on every SIMD tier: a batch of 7 or less runs a weight row a
    /// lane, 8 or more the tiles (an `x` row a lane), the same exact block sums and the
    /// same f32 operations. So a prompt's last token and the token generated from it are
    /// multiplied alike.
    #[test]
    fn block8_gives_a_row_the_same_bits_in_a_batch_of_any_size(
        format in prop::sample::select(
            all_formats().into_iter().filter(|f| f.code_bits() == 4).collect::<Vec<_>>()
        ),
        rows in 1usize..=37,
        cols in prop_oneof![1usize..=300, Just(576), Just(1024), Just(1100)],
        batch in 1usize..=40,
        seed in any::<u64>(),
    ) {
        let q = quantize(&weights(rows, cols, seed), rows, cols, format).unwrap();
        let x = weights(batch, cols, seed ^ 0x0b17);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for tier in supported_tiers().into_iter().filter(|&t| t >= Tier::Avx2) {
            let run = |x: &[f32], batch: usize| {
                let mut y = vec![f32::NAN; batch * rows];
                matmul_into_using(Backend::Tier(tier), Activations::Block8, x, batch, &q, &mut y)
                    .unwrap();
                y
            };
            let all = run(&x, batch);
            for b in [0, batch / 2, batch - 1] {
                let one = run(&x[b * cols..(b + 1) * cols], 1);
                prop_assert_eq!(
                    bits(&one), bits(&all[b * rows..(b + 1) * rows]),
                    "{:?} on {}, row {} of {}", format, tier, b, batch
                );
            }
        }
    }

    /// Every SIMD tier this CPU runs gives the AVX2 tier's bits (the same exact integer
    /// sums, the same f32 operations on them), at every batch size and on rows long
    /// enough to reach the wide kernels, tails and odd group counts included. Tiers the
    /// CPU lacks are named on stderr as skipped.
    #[test]
    fn every_tier_gives_the_bits_of_the_avx2_tier(
        format in format(),
        rows in 1usize..=9,
        cols in prop_oneof![1usize..=700, Just(576), Just(1536), Just(1024), Just(2112)],
        batch in prop_oneof![Just(1usize), 0usize..=7, 8usize..=40],
        seed in any::<u64>(),
    ) {
        let q = quantize(&weights(rows, cols, seed), rows, cols, format).unwrap();
        let x = weights(batch, cols, seed ^ 0x5eed);
        let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        let tiers = supported_tiers();
        if !tiers.contains(&Tier::Avx2) {
            return Ok(());
        }
        let want = bits(matmul_with(Backend::Tier(Tier::Avx2), &x, batch, &q).unwrap());
        for tier in tiers.into_iter().filter(|&t| t > Tier::Avx2) {
            let got = bits(matmul_with(Backend::Tier(tier), &x, batch, &q).unwrap());
            prop_assert_eq!(&got, &want, "{:?} on {}", format, tier);
        }
    }

    /// 8-bit activations (every batch for the 4-bit formats, 8 and more for the others):
    /// every tier this CPU runs stays within `error_bound_block8` of
    /// dequantize-then-multiply, and every SIMD tier gives the AVX2 tier's bits (the same
    /// exact block sums, the same f32 operations).
    #[test]
    fn block8_activations_stay_in_their_bound_with_the_same_bits_on_every_tier(
        format in format(),
        rows in 1usize..=19,
        cols in prop_oneof![1usize..=300, Just(576), Just(1024), Just(1100)],
        batch in prop_oneof![1usize..=7, 8usize..=40],
        seed in any::<u64>(),
    ) {
        let q = quantize(&weights(rows, cols, seed), rows, cols, format).unwrap();
        let x = weights(batch, cols, seed ^ 0x8b17);
        let slow = reference::matmul(&x, batch, &q).unwrap();
        let w = dequantized(&q);
        let run = |b: Backend| {
            let mut y = vec![f32::NAN; batch * rows];
            matmul_into_using(b, Activations::Block8, &x, batch, &q, &mut y).unwrap();
            y
        };
        let tiers = supported_tiers();
        let want = tiers.contains(&Tier::Avx2).then(|| run(Backend::Tier(Tier::Avx2)));
        for tier in tiers {
            let got = run(Backend::Tier(tier));
            for b in 0..batch {
                let xb = &x[b * cols..(b + 1) * cols];
                for r in 0..rows {
                    let wr = &w[r * cols..(r + 1) * cols];
                    // the portable tier keeps 14-bit activations
                    let bound = error_bound_block8(xb, wr, nf4_scale(&q, r))
                        .max(error_bound(xb, wr, nf4_scale(&q, r)));
                    let (g, s) = (got[b * rows + r], slow[b * rows + r]);
                    prop_assert!((g - s).abs() <= bound, "{tier} [{b}, {r}]: {g} vs {s}, bound {bound}");
                }
            }
            if let (Some(want), true) = (&want, tier >= Tier::Avx2) {
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                prop_assert_eq!(bits(&got), bits(want), "{:?} on {}", format, tier);
            }
        }
    }

    /// Packed buffers from arbitrary bytes are refused or decode without a panic.
    #[test]
    fn decode_never_panics(
        format in format(),
        rows in 0usize..5,
        cols in 0usize..70,
        codes in prop::collection::vec(any::<u8>(), 0..400),
        scales in prop::collection::vec(any::<f32>(), 0..20),
        mins in prop::collection::vec(any::<f32>(), 0..20),
    ) {
        if let Ok(p) = Packed::from_parts(format, rows, cols, codes, scales, mins) {
            let _ = dequantized(&p);
            let _ = matmul(&vec![1.0; 2 * cols], 2, &p).unwrap();
            let _ = p.dequantize_rows(&[0, rows - 1]).unwrap();
        }
    }
}

#[test]
fn f16_and_bf16_round_trips_of_representable_values_are_bit_exact() {
    let mut r = Rng::new(5);
    let f16s: Vec<f32> = (0..1000)
        .map(|_| half::f16::from_f32((r.normal() * 3.0) as f32).to_f32())
        .collect();
    let bf16s: Vec<f32> = (0..1000)
        .map(|_| half::bf16::from_f32((r.normal() * 3.0) as f32).to_f32())
        .collect();
    for (format, w) in [(Format::F16, &f16s), (Format::Bf16, &bf16s)] {
        let back = dequantized(&quantize(w, 10, 100, format).unwrap());
        assert!(
            back.iter()
                .zip(w.iter())
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{format:?}"
        );
    }
    // round to nearest even: 1 + 2^-11 sits halfway between two f16 values
    let q = quantize(
        &[1.0 + 2f32.powi(-11), 1.0 + 3.0 * 2f32.powi(-11)],
        1,
        2,
        Format::F16,
    )
    .unwrap();
    assert_eq!(dequantized(&q), vec![1.0, 1.0 + 4.0 * 2f32.powi(-11)]);
}

#[test]
fn zero_rows_stay_exactly_zero_and_padding_rows_survive_lookups() {
    let mut w = matrix("gaussian", 6, 100, 1);
    w[..100].fill(0.0); // row 0: a padding row
    for format in all_formats() {
        let q = quantize(&w, 6, 100, format).unwrap();
        let rows = q.dequantize_rows(&[0, 3, 0]).unwrap();
        assert!(
            rows[..100]
                .iter()
                .chain(&rows[200..])
                .all(|&v| v.to_bits() == 0),
            "{format:?}"
        );
        assert_eq!(&rows[100..200], &dequantized(&q)[300..400], "{format:?}");
    }
}

#[test]
fn stored_bytes_count_codes_scales_and_minimums() {
    let w = matrix("gaussian", 3, 100, 2);
    let bytes = |f| quantize(&w, 3, 100, f).unwrap().stored_bytes();
    assert_eq!(bytes(Format::F16), 3 * 200);
    assert_eq!(bytes(Format::Bf16), 3 * 200);
    assert_eq!(bytes(Format::Int8), 3 * (100 + 4));
    assert_eq!(bytes(Format::Int8Rows), 3 * (100 + 4));
    assert_eq!(bytes(Format::Nf4), 3 * (50 + 4));
    // 100 columns: 2 groups of 64 (the second partial), 4 groups of 32, 1 of 128
    assert_eq!(bytes(Format::Nf4Block(GroupSize::G64)), 3 * (50 + 2 * 2));
    assert_eq!(bytes(Format::Nf4Block(GroupSize::G32)), 3 * (50 + 4 * 2));
    assert_eq!(bytes(Format::Int4Block(GroupSize::G128)), 3 * (50 + 2 + 2));
    assert_eq!(bytes(Format::Int8Block(GroupSize::G32)), 3 * (100 + 4 * 2));
    assert!((Format::Int8Block(GroupSize::G32).bits_per_weight(4096) - 8.5).abs() < 1e-12);
    assert!((Format::Nf4Block(GroupSize::G64).bits_per_weight(4096) - 4.25).abs() < 1e-12);
    assert!((Format::Int4Block(GroupSize::G32).bits_per_weight(4096) - 5.0).abs() < 1e-12);
    // odd row lengths: half a byte of padding per row
    assert_eq!(
        quantize(&w[..3 * 33], 3, 33, Format::Nf4)
            .unwrap()
            .codes()
            .len(),
        3 * 17
    );
}

#[test]
fn bad_input_is_an_error() {
    let e = quantize(&[1.0, f32::NAN, 0.0, 0.0], 2, 2, Format::Int8).unwrap_err();
    assert_eq!(e.to_string(), "weight 1 (row 0) is not finite: NaN");
    assert!(matches!(
        quantize(&[f32::INFINITY], 1, 1, Format::F16),
        Err(Error::NonFinite { .. })
    ));
    assert!(matches!(
        quantize(&[], 0, 4, Format::Nf4),
        Err(Error::Shape(_))
    ));
    assert!(matches!(
        quantize(&[1.0; 5], 2, 2, Format::Nf4),
        Err(Error::Shape(_))
    ));
    // a group range past f16
    assert!(matches!(
        quantize(&[1e6, -1e6], 1, 2, Format::Nf4Block(GroupSize::G32)),
        Err(Error::Unrepresentable { index: 0, .. })
    ));
    assert!(matches!(
        quantize(
            &[0.0, 1.0, 0.0, 1e6],
            2,
            2,
            Format::Int4Block(GroupSize::G32)
        ),
        Err(Error::Unrepresentable { index: 3, .. })
    ));
    // finite weights f16 would make infinite, named by index; bf16 holds them
    let e = quantize(&[1.0, 7e4, -1e6, 0.0], 2, 2, Format::F16).unwrap_err();
    let named = matches!(e, Error::Unrepresentable { index: 1, value, .. } if value == 7e4);
    assert!(named, "{e:?}");
    assert!(e.to_string().contains("does not fit f16"), "{e}");
    assert!(quantize(&[1.0, 7e4, -1e6, 0.0], 2, 2, Format::Bf16).is_ok());
    assert!(quantize(&[65504.0, -65504.0], 1, 2, Format::F16).is_ok());
    assert!(matches!(
        quantize(&[f32::MAX, 0.0], 1, 2, Format::Bf16),
        Err(Error::Unrepresentable { index: 0, .. })
    ));
    // an odd 4-bit row's spare nibble must be zero
    let ok = Packed::from_parts(
        Format::Nf4,
        2,
        3,
        vec![0x12, 0x03, 0x45, 0x06],
        vec![1.0; 2],
        vec![],
    );
    assert!(ok.is_ok());
    let spare = Packed::from_parts(
        Format::Nf4,
        2,
        3,
        vec![0x12, 0x03, 0x45, 0x16],
        vec![1.0; 2],
        vec![],
    );
    assert!(matches!(spare, Err(Error::Malformed(m)) if m.contains("row 1")));
    let q = quantize(&[1.0; 8], 2, 4, Format::Int8).unwrap();
    assert!(matches!(
        q.dequantize_rows(&[2]),
        Err(Error::RowOutOfRange { id: 2, rows: 2 })
    ));
    assert!(matches!(matmul(&[1.0; 3], 1, &q), Err(Error::Shape(_))));
    let mut y = [7.0f32; 3];
    let short = matmul_into(&[1.0; 4], 1, &q, &mut y);
    assert!(matches!(short, Err(Error::Shape(m)) if m.contains("3 values")));
    assert_eq!(y, [7.0; 3], "a refused call leaves the output alone");
    assert!(matches!(
        Packed::from_parts(Format::Int8, 2, 4, vec![0; 8], vec![1.0], vec![]),
        Err(Error::Malformed(_))
    ));
    assert!(matches!(
        Packed::from_parts(Format::Int8, 2, 4, vec![0; 8], vec![1.0, f32::NAN], vec![]),
        Err(Error::Malformed(_))
    ));
}

/// `matmul_into` overwrites whatever the output held with `matmul`'s bits, at batch 1 (the
/// rows written in place), in the small batches and on tiles.
#[test]
fn matmul_into_writes_the_bits_of_matmul() {
    let (rows, cols) = (40, 96);
    let w = matrix("gaussian", rows, cols, 11);
    let mut rng = Rng::new(5);
    for format in all_formats() {
        let q = quantize(&w, rows, cols, format).unwrap();
        for batch in [1, 5, 17] {
            let x: Vec<f32> = (0..batch * cols).map(|_| rng.normal() as f32).collect();
            let want = matmul(&x, batch, &q).unwrap();
            let mut y = vec![f32::NAN; batch * rows];
            matmul_into(&x, batch, &q, &mut y).unwrap();
            let same = want.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{format} batch {batch}");
        }
    }
}

#[test]
fn wire_tags_are_stable() {
    let tags: Vec<u8> = [
        Format::F16,
        Format::Bf16,
        Format::Int8,
        Format::Nf4,
        Format::Nf4Block(GroupSize::G64),
        Format::Int4Block(GroupSize::G64),
        Format::Int8Rows,
        Format::Int8Block(GroupSize::G32),
    ]
    .iter()
    .map(|f| f.tag())
    .collect();
    assert_eq!(tags, [1, 2, 3, 4, 5, 6, 7, 8]);
}

/// The tiers this CPU runs; the others are named on stderr as skipped (once a run), never
/// passed.
fn supported_tiers() -> Vec<Tier> {
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| {
        for t in Tier::ALL.into_iter().filter(|t| !t.supported()) {
            eprintln!("skipped: tier {t} (this CPU lacks {})", t.needs());
        }
    });
    Tier::ALL.into_iter().filter(|t| t.supported()).collect()
}

/// Every row length up to ten chunks of 128 weights, so every count of runs and pairs
/// and every partial last group meets each kernel's tail, at batch 1 (the wide 4-bit
/// kernels), 2 and 17 (the tiles of a batch of 8 or more, with a part block): every SIMD
/// tier gives the AVX2 tier's bits. (The proptest draws
/// these lengths too, but a given tail only now and then.)
#[test]
fn every_tier_gives_the_avx2_bits_at_every_row_length() {
    let tiers = supported_tiers();
    if !tiers.contains(&Tier::Avx2) {
        eprintln!("skipped: every_tier_gives_the_avx2_bits_at_every_row_length (no AVX2)");
        return;
    }
    let rows = 5;
    for format in all_formats() {
        for cols in 1usize..=1280 {
            if cols > 300 && !cols.is_multiple_of(32) && cols % 64 != 63 {
                continue;
            }
            let q = quantize(&weights(rows, cols, cols as u64), rows, cols, format).unwrap();
            for batch in [1, 2, 17] {
                let x = weights(batch, cols, 7 ^ cols as u64);
                let bits = |t: Tier| -> Vec<u32> {
                    let y = matmul_with(Backend::Tier(t), &x, batch, &q).unwrap();
                    y.into_iter().map(f32::to_bits).collect()
                };
                let want = bits(Tier::Avx2);
                for &tier in tiers.iter().filter(|&&t| t > Tier::Avx2) {
                    assert_eq!(
                        bits(tier),
                        want,
                        "{format:?}, {cols} columns, batch {batch}, {tier}"
                    );
                }
            }
        }
    }
}

/// A tier the CPU lacks is refused by name, not run on another; one it has runs.
#[test]
fn a_tier_the_cpu_lacks_is_refused_by_name() {
    let q = quantize(&weights(2, 64, 1), 2, 64, Format::Int8Rows).unwrap();
    let x = weights(1, 64, 2);
    for tier in Tier::ALL {
        let got = matmul_with(Backend::Tier(tier), &x, 1, &q);
        if tier.supported() {
            assert_eq!(got.unwrap().len(), 2, "{tier}");
        } else {
            eprintln!(
                "skipped running: tier {tier} (this CPU lacks {})",
                tier.needs()
            );
            let e = got.unwrap_err();
            assert!(matches!(e, Error::Kernel(_)), "{e:?}");
            assert!(e.to_string().contains(tier.name()), "{e}");
        }
        assert_eq!(Tier::from_name(tier.name()), Some(tier));
    }
    assert!(Tier::Portable.supported());
    assert!(Tier::best().supported());
    assert_eq!(Tier::from_name("avx1024"), None);
}

/// Rows long enough to need several `i32` flushes, at the largest codes and activations:
/// no lane overflows, on any backend or tier.
#[test]
fn long_rows_at_the_extremes_do_not_overflow() {
    // 4096: packed codes read directly at small batches; 4100: decoded rows
    for (format, cols) in all_formats()
        .into_iter()
        .flat_map(|f| [(f, 4096), (f, 4100)])
    {
        let rows = 3;
        for sign in [1.0f32, -1.0] {
            let w = vec![sign; rows * cols];
            let q = quantize(&w, rows, cols, format).unwrap();
            for (backend, batch) in supported_tiers()
                .into_iter()
                .map(Backend::Tier)
                .chain([Backend::Auto, Backend::Portable])
                .flat_map(|b| [(b, 1), (b, 2), (b, 6), (b, 9), (b, 17)])
            {
                let x = vec![1.0f32; batch * cols];
                let mut y = matmul_with(backend, &x, batch, &q).unwrap();
                let mut y8 = vec![0f32; y.len()];
                matmul_into_using(backend, Activations::Block8, &x, batch, &q, &mut y8).unwrap();
                y.extend(y8);
                for v in y {
                    let want = sign * cols as f32;
                    assert!(
                        (v - want).abs() <= 1e-3 * cols as f32,
                        "{format:?}: {v} vs {want}"
                    );
                }
            }
        }
    }
}

/// `COMPRESSME_ACTIVATIONS`' names read back, and 8-bit activations give other bits
/// than 14-bit ones where they apply (so the choice is really made): INT8 at a batch of 8
/// or more, and the same bits below it; a 4-bit format at every batch.
#[test]
fn activations_are_chosen_by_name_and_apply_where_they_say() {
    for a in [Activations::Auto, Activations::Fixed14, Activations::Block8] {
        assert_eq!(Activations::from_name(a.name()), Some(a));
    }
    assert_eq!(Activations::from_name("4"), None);
    let (rows, cols) = (16, 256);
    let simd = Tier::best() > Tier::Portable;
    for format in [Format::Int8, Format::Nf4] {
        let q = quantize(&matrix("gaussian", rows, cols, 3), rows, cols, format).unwrap();
        for batch in [1, 7, 8] {
            let x = matrix("gaussian", batch, cols, 4);
            let run = |a: Activations| {
                let mut y = vec![0f32; batch * rows];
                matmul_into_using(Backend::Auto, a, &x, batch, &q, &mut y).unwrap();
                y.into_iter().map(f32::to_bits).collect::<Vec<_>>()
            };
            let differ = run(Activations::Fixed14) != run(Activations::Block8);
            let applies = batch == 8 || format.code_bits() == 4;
            assert_eq!(differ, applies && simd, "{format:?}, batch {batch}");
        }
    }
    // the default: 8-bit activations for the 4-bit formats, 14-bit for the others
    for format in all_formats() {
        let want = if format.code_bits() == 4 {
            Activations::Block8
        } else {
            Activations::Fixed14
        };
        assert_eq!(Activations::default_for(format), want, "{format:?}");
    }
    if std::env::var_os("COMPRESSME_ACTIVATIONS").is_some() {
        eprintln!("skipped: the unset COMPRESSME_ACTIVATIONS default (it is set here)");
        return;
    }
    let x = matrix("gaussian", 8, cols, 5);
    for format in all_formats() {
        let q = quantize(&matrix("gaussian", rows, cols, 6), rows, cols, format).unwrap();
        let run = |a: Activations| {
            let mut y = vec![0f32; 8 * rows];
            matmul_into_using(Backend::Auto, a, &x, 8, &q, &mut y).unwrap();
            y.into_iter().map(f32::to_bits).collect::<Vec<_>>()
        };
        let auto = run(Activations::Auto);
        assert_eq!(auto, run(Activations::default_for(format)), "{format:?}");
        assert_eq!(
            matmul(&x, 8, &q)
                .unwrap()
                .into_iter()
                .map(f32::to_bits)
                .collect::<Vec<_>>(),
            auto
        );
    }
}

/// Activations below about 1e-35 (where `8191 / absmax` overflows f32) are multiplied as
/// any others, on every backend, tier and choice of activations: the same as the same
/// activations scaled up by `2^100`, scaled back (until stop 29 such a row overflowed an
/// `i32`: a panic in a debug build, wrong signs in a release build).
#[test]
fn tiny_activations_multiply_as_any_others() {
    let (rows, cols) = (5, 96);
    let w = matrix("gaussian", rows, cols, 11);
    let up = 2f32.powi(100);
    for format in all_formats() {
        let q = quantize(&w, rows, cols, format).unwrap();
        for batch in [1, 3, 9] {
            let x: Vec<f32> = matrix("gaussian", batch, cols, 12)
                .into_iter()
                .map(|v| v * 1e-38)
                .collect();
            let big: Vec<f32> = x.iter().map(|v| v * up).collect();
            for backend in supported_tiers()
                .into_iter()
                .map(Backend::Tier)
                .chain([Backend::Auto])
            {
                for a in [Activations::Fixed14, Activations::Block8] {
                    let run = |x: &[f32]| {
                        let mut y = vec![0f32; batch * rows];
                        matmul_into_using(backend, a, x, batch, &q, &mut y).unwrap();
                        y
                    };
                    let (small, large) = (run(&x), run(&big));
                    for (s, l) in small.iter().zip(&large) {
                        let s = f64::from(*s) * f64::from(up);
                        let l = f64::from(*l);
                        assert!(
                            (s - l).abs() <= 1e-4 * l.abs() + 1e-4,
                            "{format:?}, batch {batch}, {backend:?}, {a:?}: {s} vs {l}"
                        );
                    }
                }
            }
        }
    }
}

/// A NaN or infinite activation reaches the outputs of its own row, as it would in a
/// dense multiplication, and no other row.
#[test]
fn non_finite_activations_propagate_to_their_own_row() {
    let (rows, cols) = (4, 70);
    let w = matrix("gaussian", rows, cols, 9);
    for format in all_formats() {
        let q = quantize(&w, rows, cols, format).unwrap();
        let mut x = vec![0.5f32; 3 * cols];
        x[cols + 3] = f32::NAN;
        x[2 * cols + 5] = f32::INFINITY;
        for backend in [Backend::Auto, Backend::Portable] {
            let y = matmul_with(backend, &x, 3, &q).unwrap();
            assert!(y[..rows].iter().all(|v| v.is_finite()), "{format:?}");
            assert!(y[rows..2 * rows].iter().all(|v| v.is_nan()), "{format:?}");
            assert!(y[2 * rows..].iter().all(|v| !v.is_finite()), "{format:?}");
        }
        // a batch of 9 asking for 8-bit activations: the same
        let mut x9 = x.clone();
        x9.resize(9 * cols, -0.25);
        let mut y = vec![0f32; 9 * rows];
        matmul_into_using(Backend::Auto, Activations::Block8, &x9, 9, &q, &mut y).unwrap();
        assert!(y[..rows].iter().all(|v| v.is_finite()), "{format:?}");
        assert!(y[rows..2 * rows].iter().all(|v| v.is_nan()), "{format:?}");
        assert!(
            y[2 * rows..3 * rows].iter().all(|v| !v.is_finite()),
            "{format:?}"
        );
        assert!(y[3 * rows..].iter().all(|v| v.is_finite()), "{format:?}");
    }
}

/// Dequantization is the layout's definition, written out plainly here from the public
/// buffers: codes, scales, minimums.
#[test]
fn dequantize_follows_the_layout_definition() {
    for cols in [1usize, 31, 64, 65, 130] {
        let rows = 3;
        let w = weights(rows, cols, cols as u64);
        for format in all_formats() {
            let q = quantize(&w, rows, cols, format).unwrap();
            let got = dequantized(&q);
            let rb = format.row_code_bytes(cols);
            let nib = |r: usize, j: usize| {
                let b = q.codes()[r * rb + j / 2];
                if j.is_multiple_of(2) { b & 15 } else { b >> 4 }
            };
            for r in 0..rows {
                for j in 0..cols {
                    let want = match format {
                        Format::F16 => half::f16::from_bits(u16::from_le_bytes([
                            q.codes()[r * rb + 2 * j],
                            q.codes()[r * rb + 2 * j + 1],
                        ]))
                        .to_f32(),
                        Format::Bf16 => half::bf16::from_bits(u16::from_le_bytes([
                            q.codes()[r * rb + 2 * j],
                            q.codes()[r * rb + 2 * j + 1],
                        ]))
                        .to_f32(),
                        Format::Int8 | Format::Int8Rows => {
                            f32::from(q.codes()[r * rb + j] as i8) * q.scales()[r]
                        }
                        Format::Nf4 => {
                            compressme_quant::NF4_CODEBOOK[usize::from(nib(r, j))] * q.scales()[r]
                        }
                        Format::Nf4Block(g) => {
                            let gi = r * cols.div_ceil(g.get()) + j / g.get();
                            compressme_quant::NF4_CODEBOOK[usize::from(nib(r, j))] * q.scales()[gi]
                        }
                        Format::Int4Block(g) => {
                            let gi = r * cols.div_ceil(g.get()) + j / g.get();
                            q.mins()[gi] + f32::from(nib(r, j)) * q.scales()[gi]
                        }
                        Format::Int8Block(g) => {
                            let gi = r * cols.div_ceil(g.get()) + j / g.get();
                            f32::from(q.codes()[r * rb + j] as i8) * q.scales()[gi]
                        }
                        _ => unreachable!(),
                    };
                    assert_eq!(
                        got[r * cols + j].to_bits(),
                        want.to_bits(),
                        "{format} [{r}, {j}] of {cols}"
                    );
                }
            }
        }
    }
}

#[test]
fn format_names_read_back() {
    for f in all_formats() {
        assert_eq!(Format::parse(&f.to_string()).unwrap(), f);
    }
    for name in Format::NAMES {
        assert_eq!(Format::parse(name).unwrap().to_string(), name);
    }
    assert_eq!(
        Format::parse(" NF4-G64 ").unwrap(),
        Format::Nf4Block(GroupSize::G64)
    );
    let e = Format::parse("nf4-g48").unwrap_err().to_string();
    assert!(e.contains("nf4-g64") && e.contains("int8-rows"), "{e}");
}

/// Activation-aware rounding never does worse than absmax on the error it minimises, and
/// does better overall; it decodes like any packed matrix.
#[test]
fn weighted_rounding_beats_absmax_on_its_objective() {
    use compressme_quant::quantize_weighted;
    let (rows, cols) = (24, 256);
    let w = matrix("student-t", rows, cols, 4);
    let mut r = Rng::new(8);
    let imp: Vec<f32> = (0..cols)
        .map(|_| (r.student_t(3).abs() as f32).powi(2) + 1e-3)
        .collect();
    let weighted_err = |q: &Packed| -> f64 {
        let d = dequantized(q);
        w.chunks(cols)
            .zip(d.chunks(cols))
            .map(|(a, b)| {
                a.iter()
                    .zip(b)
                    .zip(&imp)
                    .map(|((x, y), i)| f64::from(*i) * f64::from(x - y).powi(2))
                    .sum::<f64>()
            })
            .sum()
    };
    for format in [
        Format::Nf4Block(GroupSize::G32),
        Format::Nf4Block(GroupSize::G64),
        Format::Int4Block(GroupSize::G64),
        Format::Int4Block(GroupSize::G128),
    ] {
        let plain = quantize(&w, rows, cols, format).unwrap();
        let aware = quantize_weighted(&w, rows, cols, format, &imp).unwrap();
        let (e0, e1) = (weighted_err(&plain), weighted_err(&aware));
        assert!(e1 < e0, "{format}: {e1} vs {e0}");
        assert_eq!(aware.stored_bytes(), plain.stored_bytes());
        // group by group it is never worse: rerun with one group's importance only
        let back = Packed::from_parts(
            format,
            rows,
            cols,
            aware.codes().to_vec(),
            aware.scales().to_vec(),
            aware.mins().to_vec(),
        )
        .unwrap();
        assert_eq!(dequantized(&back), dequantized(&aware));
    }
    // formats without groups, and importance of the wrong length, quantize as usual
    assert_eq!(
        quantize_weighted(&w, rows, cols, Format::Int8, &imp).unwrap(),
        quantize(&w, rows, cols, Format::Int8).unwrap()
    );
    assert_eq!(
        quantize_weighted(&w, rows, cols, Format::Nf4Block(GroupSize::G64), &imp[..3]).unwrap(),
        quantize(&w, rows, cols, Format::Nf4Block(GroupSize::G64)).unwrap()
    );
}

/// Activation-aware rounding runs its rows on all cores: the same codes and scales on
/// one thread as on several (checked against the order-free definition, row by row).
#[test]
fn weighted_rounding_does_not_depend_on_the_thread_count() {
    use compressme_quant::quantize_weighted;
    let (rows, cols) = (37, 320);
    let w = matrix("student-t", rows, cols, 11);
    let mut r = Rng::new(12);
    let imp: Vec<f32> = (0..cols)
        .map(|_| (r.student_t(3).abs() as f32).powi(2) + 1e-3)
        .collect();
    for format in [
        Format::Nf4Block(GroupSize::G64),
        Format::Int4Block(GroupSize::G64),
        Format::Int4Block(GroupSize::G128),
    ] {
        let on = |threads: usize| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
                .install(|| quantize_weighted(&w, rows, cols, format, &imp).unwrap())
        };
        let one = on(1);
        assert_eq!(one, on(4), "{format}");
        // each row alone gives that row: no row's result depends on another's
        for row in [0, 17, rows - 1] {
            let alone =
                quantize_weighted(&w[row * cols..(row + 1) * cols], 1, cols, format, &imp).unwrap();
            let rb = format.row_code_bytes(cols);
            let ng = one.scales().len() / rows;
            assert_eq!(
                alone.codes(),
                &one.codes()[row * rb..(row + 1) * rb],
                "{format}"
            );
            assert_eq!(
                alone.scales(),
                &one.scales()[row * ng..(row + 1) * ng],
                "{format}"
            );
        }
    }
}

/// `Int8Block`'s largest magnitude takes code ±127 even where its f16 scale is subnormal
/// and rounding to nearest would leave it at 126 (so requantizing keeps the scale).
#[test]
fn int8_block_gives_the_largest_weight_code_127_at_subnormal_scales() {
    let f = Format::Int8Block(GroupSize::G32);
    for v in [
        8.896_611_4e-4f32,
        -9.349_143e-4,
        1.135_642_8e-5,
        1.0e-3,
        0.05,
        -3.0,
    ] {
        let q = quantize(&[v, v / 3.0], 1, 2, f).unwrap();
        let want: u8 = if v > 0.0 { 127 } else { (-127i8) as u8 };
        assert_eq!(q.codes()[0], want, "{v}");
        let q2 = quantize(&dequantized(&q), 1, 2, f).unwrap();
        assert_eq!((q2.codes(), q2.scales()), (q.codes(), q.scales()), "{v}");
    }
}

/// Every product of `formats` on `shapes` (rows, columns) at `batches`, with random and
/// with extreme weights and activations, on the AMX tier against the AVX-512 VNNI tier's
/// bits, with `activations`: how many were compared, or `None` (said on stderr, with
/// `test`'s name) where the CPU or the operating system has no AMX.
fn amx_gives_the_avx512_bits(
    test: &str,
    formats: &[Format],
    shapes: &[(usize, usize)],
    batches: &[usize],
    activations: Activations,
) -> Option<usize> {
    if !Tier::Avx512Amx.supported() {
        eprintln!(
            "skipped: {test} (this CPU lacks {})",
            Tier::Avx512Amx.needs()
        );
        return None;
    }
    let mut ran = 0;
    for &format in formats {
        for &(rows, cols) in shapes {
            for extreme in [false, true] {
                let w = if extreme {
                    (0..rows * cols)
                        .map(|i| if i % 3 == 0 { -1.0 } else { 1.0 })
                        .collect()
                } else {
                    weights(rows, cols, (rows * cols) as u64)
                };
                let q = quantize(&w, rows, cols, format).unwrap();
                for &batch in batches {
                    let x: Vec<f32> = if extreme {
                        (0..batch * cols)
                            .map(|i| if i % 5 == 0 { -3.0 } else { 3.0 })
                            .collect()
                    } else {
                        weights(batch, cols, 11 ^ cols as u64)
                    };
                    let bits = |t: Tier| -> Vec<u32> {
                        let mut y = vec![0f32; batch * rows];
                        matmul_into_using(Backend::Tier(t), activations, &x, batch, &q, &mut y)
                            .unwrap();
                        y.into_iter().map(f32::to_bits).collect()
                    };
                    assert_eq!(
                        bits(Tier::Avx512Amx),
                        bits(Tier::Avx512Vnni),
                        "{format:?}, {rows} x {cols}, batch {batch}, extreme {extreme}"
                    );
                    ran += 1;
                }
            }
        }
    }
    Some(ran)
}

/// The AMX tiles give the AVX-512 VNNI tier's bits: whole tasks of 32 weight rows read in
/// place and a last part task, one flush and several (a part flush last), whole and part
/// blocks of 16 rows of `x`, and the largest codes and activations; skipped by name where
/// the CPU or the operating system has no AMX.
#[test]
fn the_amx_tiles_give_the_avx512_bits() {
    let ran = amx_gives_the_avx512_bits(
        "the_amx_tiles_give_the_avx512_bits",
        &[Format::Int8, Format::Int8Rows],
        &[(70, 64), (32, 1024), (33, 2112), (64, 4096), (7, 576)],
        &[8, 9, 16, 17, 32, 40],
        Activations::Auto,
    );
    if let Some(ran) = ran {
        assert_eq!(ran, 120);
    }
}

/// The AMX tiles for 8-bit activations give the AVX-512 VNNI tier's bits: every format
/// whose groups are whole blocks of 32 (the 4-bit ones by default, the 8-bit ones asked
/// for 8-bit activations), a last part task of weight rows, rows with a part last block,
/// one group and several, whole and part panels of 16 rows of `x`, and the largest codes
/// and activations; skipped by name where the CPU or the operating system has no AMX.
#[test]
fn the_amx_tiles_for_8_bit_activations_give_the_avx512_bits() {
    let formats: Vec<Format> = all_formats()
        .into_iter()
        .filter(|f| !matches!(f, Format::F16 | Format::Bf16))
        .collect();
    let ran = amx_gives_the_avx512_bits(
        "the_amx_tiles_for_8_bit_activations_give_the_avx512_bits",
        &formats,
        &[(70, 64), (17, 1000), (32, 4096), (7, 576)],
        &[8, 16, 17, 32, 40],
        Activations::Block8,
    );
    if let Some(ran) = ran {
        assert_eq!(ran, 12 * 4 * 2 * 5);
    }
}
