use compressme_blockstore::{BlockStore, Coder, EncodeOptions, Error, ValueKind};
use compressme_shuffle::ElementSize;
use proptest::prelude::*;

use crate::{naive_rows, store, weights_f32};

fn kind() -> impl Strategy<Value = ValueKind> {
    prop_oneof![
        Just(ValueKind::F32),
        Just(ValueKind::Bf16),
        Just(ValueKind::F16),
        Just(ValueKind::F64),
        Just(ValueKind::Bytes(ElementSize::One)),
        Just(ValueKind::Bytes(ElementSize::Four)),
    ]
}

fn coder() -> impl Strategy<Value = (Coder, bool)> {
    prop_oneof![
        (1u8..=4, any::<bool>())
            .prop_map(|(max_tables, row_index)| (Coder::SharedHuffman { max_tables }, row_index)),
        (1u8..=4, any::<bool>())
            .prop_map(|(max_tables, row_index)| (Coder::SharedRans { max_tables }, row_index)),
        (1u8..=16, any::<bool>())
            .prop_map(|(max_tables, row_index)| (Coder::Mixed { max_tables }, row_index)),
        (1i32..=3).prop_map(|level| (Coder::Zstd { level }, false)),
    ]
}

/// Rows at and around multiples of the block size: k*b - 1, k*b, k*b + 1.
fn shape() -> impl Strategy<Value = (usize, usize, usize)> {
    (1usize..=9, 0usize..=3, 0usize..=2, 1usize..=12).prop_map(|(block_rows, k, d, cols)| {
        let rows = (k * block_rows + d)
            .saturating_sub(1)
            .max(usize::from(k == 0 && d == 0));
        (block_rows, rows, cols)
    })
}

/// Arbitrary bit patterns: NaN payloads, signed zeros, subnormals and infinities included.
fn table(rows: usize, row_bytes: usize) -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), rows * row_bytes),
        // low-entropy bytes, so coded and constant modes are exercised too
        prop::collection::vec(
            prop_oneof![Just(0u8), Just(0x80), Just(0x3f), Just(0x7f), Just(0xff)],
            rows * row_bytes
        ),
    ]
}

fn ids(rows: usize) -> BoxedStrategy<Vec<u64>> {
    let r = rows as u64;
    if r == 0 {
        return Just(Vec::new()).boxed();
    }
    prop_oneof![
        prop::collection::vec(0..r, 0..40),
        (0..r, 1..4u64).prop_map(move |(start, step)| (start..r).step_by(step as usize).collect()),
        Just(Vec::new()),
    ]
    .boxed()
}

/// kind, (coder, row index), block rows, rows, row bytes, table bytes, ids
type Case = (
    ValueKind,
    (Coder, bool),
    usize,
    usize,
    usize,
    Vec<u8>,
    Vec<u64>,
);

fn case() -> impl Strategy<Value = Case> {
    (kind(), coder(), shape()).prop_flat_map(|(kind, coder, (block_rows, rows, cols))| {
        let row_bytes = cols * kind.element_size().bytes();
        (
            Just(kind),
            Just(coder),
            Just(block_rows),
            Just(rows),
            Just(row_bytes),
            table(rows, row_bytes),
            ids(rows),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn roundtrip((kind, coder, block_rows, rows, row_bytes, data, ids) in case()) {
        let (coder, row_index) = coder;
        let opts = EncodeOptions::new(kind).block_rows(block_rows).coder(coder).row_index(row_index);
        let s = BlockStore::encode(&data, rows as u64, row_bytes, &opts).unwrap();
        prop_assert_eq!(s.decode_all().unwrap(), data.clone());
        let mut out = vec![0u8; ids.len() * row_bytes];
        s.decode_rows(&ids, &mut out).unwrap();
        prop_assert_eq!(out, naive_rows(&data, row_bytes, &ids));
        // serialized and loaded again: same bytes out, same bytes in
        let bytes = s.to_bytes();
        prop_assert_eq!(bytes.len() as u64, s.stored_bytes().total());
        let again = BlockStore::from_bytes(&bytes).unwrap();
        prop_assert_eq!(again.to_bytes(), bytes);
        prop_assert_eq!(again.decode_all().unwrap(), data);
    }

    #[test]
    fn deterministic((kind, coder, block_rows, rows, row_bytes, data, _ids) in case()) {
        let (coder, row_index) = coder;
        let a = store(&data, rows as u64, row_bytes, kind, block_rows, coder).to_bytes();
        let mut opts = EncodeOptions::new(kind).block_rows(block_rows).coder(coder).row_index(row_index);
        let a = if row_index { BlockStore::encode(&data, rows as u64, row_bytes, &opts).unwrap().to_bytes() } else { a };
        opts.parallel = false;
        let b = BlockStore::encode(&data, rows as u64, row_bytes, &opts).unwrap().to_bytes();
        prop_assert_eq!(a, b);
    }
}

#[test]
fn special_values_survive_bit_for_bit() {
    let specials: Vec<u32> = vec![
        0x7fc0_0001,
        0xffc0_0000,
        0x7f80_0001,
        0xff81_2345, // NaNs with payloads, quiet and signalling
        0x0000_0000,
        0x8000_0000, // +0, -0
        0x0000_0001,
        0x807f_ffff, // subnormals
        0x7f80_0000,
        0xff80_0000, // infinities
        0x3f80_0000,
        0x7f7f_ffff,
        0x0080_0000,
        0xbf80_0000,
    ];
    let data: Vec<u8> = specials
        .iter()
        .cycle()
        .take(14 * 40)
        .flat_map(|v| v.to_le_bytes())
        .collect();
    for coder in [Coder::default(), Coder::Zstd { level: 3 }] {
        let s = store(&data, 40, 14 * 4, ValueKind::F32, 16, coder);
        assert_eq!(s.decode_all().unwrap(), data);
    }
}

#[test]
fn compresses_weight_like_data_and_counts_every_byte() {
    let data = weights_f32(256, 64, 7);
    let s = store(&data, 256, 256, ValueKind::F32, 16, Coder::default());
    let b = s.stored_bytes();
    assert_eq!(b.digests, 32 * 16);
    assert_eq!(b.offsets, 4 * 16);
    assert_eq!(b.total(), s.to_bytes().len() as u64);
    assert!(s.ratio() < 0.95, "ratio {}", s.ratio());
    assert_eq!(s.dense_bytes(), data.len() as u64);
}

#[test]
fn incompressible_data_grows_and_says_so() {
    let data: Vec<u8> = (0..16 * 64u32)
        .flat_map(|i| i.wrapping_mul(2_654_435_761).to_le_bytes())
        .collect();
    let s = store(&data, 16, 256, ValueKind::F32, 16, Coder::default());
    assert!(
        s.ratio() > 1.0,
        "random bytes cannot shrink, ratio {}",
        s.ratio()
    );
}

#[test]
fn bad_requests_are_errors_and_write_nothing() {
    let data = weights_f32(20, 4, 1);
    let s = store(&data, 20, 16, ValueKind::F32, 8, Coder::default());
    let mut out = vec![0xaau8; 3 * 16];
    let err = s.decode_rows(&[1, 20, 2], &mut out).unwrap_err();
    assert!(matches!(err, Error::RowOutOfRange { id: 20, rows: 20 }));
    assert_eq!(
        err.to_string(),
        "row 20 out of range for a table of 20 rows"
    );
    assert!(out.iter().all(|&b| b == 0xaa));
    let err = s.decode_rows(&[1], &mut out).unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)), "{err}");
}

#[test]
fn bad_options_are_errors() {
    let data = vec![0u8; 12];
    let enc = |rows: u64, rb: usize, o: EncodeOptions| {
        BlockStore::encode(&data, rows, rb, &o).unwrap_err()
    };
    let f32o = EncodeOptions::new(ValueKind::F32);
    assert!(
        enc(3, 4, f32o.clone().block_rows(0))
            .to_string()
            .contains("block_rows")
    );
    assert!(enc(2, 6, f32o.clone()).to_string().contains("whole number"));
    assert!(
        enc(4, 4, f32o.clone())
            .to_string()
            .contains("12 bytes given for 4 rows")
    );
    assert!(
        enc(3, 4, f32o.clone().coder(Coder::Zstd { level: 0 }))
            .to_string()
            .contains("zstd level")
    );
    assert!(
        enc(
            3,
            4,
            f32o.clone().coder(Coder::SharedHuffman { max_tables: 17 })
        )
        .to_string()
        .contains("max_tables")
    );
}

#[test]
fn empty_and_zero_width_tables() {
    for (rows, rb) in [(0u64, 8usize), (5, 0), (0, 0)] {
        let data = vec![0u8; rows as usize * rb];
        let s = store(&data, rows, rb, ValueKind::F32, 4, Coder::default());
        assert_eq!(s.decode_all().unwrap(), data);
        let again = BlockStore::from_bytes(&s.to_bytes()).unwrap();
        assert_eq!(again.rows(), rows);
        let mut out = vec![0u8; 2 * rb];
        if rows > 0 {
            s.decode_rows(&[0, rows - 1], &mut out).unwrap();
        }
    }
}
