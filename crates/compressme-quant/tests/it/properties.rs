//! Exact properties, the fast kernel against the scalar reference, and bad input.

use compressme_quant::{Error, Format, GroupSize, Packed, matmul, quantize, reference};
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

    /// The kernel that reads packed rows matches dequantize-then-multiply.
    #[test]
    fn matmul_matches_reference((format, rows, cols, seed) in case(), batch in 0usize..=4) {
        let q = quantize(&weights(rows, cols, seed), rows, cols, format).unwrap();
        let x = weights(batch, cols, seed ^ 0xabc);
        let fast = matmul(&x, batch, &q).unwrap();
        let slow = reference::matmul(&x, batch, &q).unwrap();
        prop_assert_eq!(fast.len(), batch * rows);
        let w = dequantized(&q);
        for b in 0..batch {
            for r in 0..rows {
                // f32 sums in another order: bound the difference by the sum of magnitudes
                let mag: f32 = (0..cols).map(|i| (x[b * cols + i] * w[r * cols + i]).abs()).sum();
                let (f, s) = (fast[b * rows + r], slow[b * rows + r]);
                prop_assert!((f - s).abs() <= 1e-5 * mag + 1e-30, "[{b}, {r}]: {f} vs {s}");
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
        Err(Error::Shape(_))
    ));
    let q = quantize(&[1.0; 8], 2, 4, Format::Int8).unwrap();
    assert!(matches!(
        q.dequantize_rows(&[2]),
        Err(Error::RowOutOfRange { id: 2, rows: 2 })
    ));
    assert!(matches!(matmul(&[1.0; 3], 1, &q), Err(Error::Shape(_))));
    assert!(matches!(
        Packed::from_parts(Format::Int8, 2, 4, vec![0; 8], vec![1.0], vec![]),
        Err(Error::Malformed(_))
    ));
    assert!(matches!(
        Packed::from_parts(Format::Int8, 2, 4, vec![0; 8], vec![1.0, f32::NAN], vec![]),
        Err(Error::Malformed(_))
    ));
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
    ]
    .iter()
    .map(|f| f.tag())
    .collect();
    assert_eq!(tags, [1, 2, 3, 4, 5, 6, 7]);
}
