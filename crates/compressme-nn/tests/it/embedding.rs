use candle_core::{DType, Device, Module, Tensor, Var};
use compressme_nn::{Error, PackOptions, PackedFrozenEmbedding};
use proptest::prelude::*;

/// The raw bytes of a tensor, for byte-for-byte comparison.
fn bytes_of(t: &Tensor) -> Vec<u8> {
    let flat = t.flatten_all().unwrap();
    match t.dtype() {
        DType::F32 => flat
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .flat_map(|v| v.to_bits().to_le_bytes())
            .collect(),
        DType::BF16 => flat
            .to_vec1::<half::bf16>()
            .unwrap()
            .iter()
            .flat_map(|v| v.to_bits().to_le_bytes())
            .collect(),
        DType::F16 => flat
            .to_vec1::<half::f16>()
            .unwrap()
            .iter()
            .flat_map(|v| v.to_bits().to_le_bytes())
            .collect(),
        other => panic!("{other:?}"),
    }
}

fn table_from_bits(bits: &[u32], rows: usize, dim: usize, dtype: DType) -> Tensor {
    let dev = Device::Cpu;
    match dtype {
        DType::F32 => {
            let bytes: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
            Tensor::from_raw_buffer(&bytes, DType::F32, &[rows, dim], &dev).unwrap()
        }
        _ => {
            let bytes: Vec<u8> = bits
                .iter()
                .flat_map(|b| (*b as u16).to_le_bytes())
                .collect();
            Tensor::from_raw_buffer(&bytes, dtype, &[rows, dim], &dev).unwrap()
        }
    }
}

fn expected(table: &Tensor, ids: &Tensor) -> Vec<u8> {
    let flat: Vec<u32> = ids
        .flatten_all()
        .unwrap()
        .to_dtype(DType::U32)
        .unwrap()
        .to_vec1()
        .unwrap();
    let idx = Tensor::new(flat.as_slice(), &Device::Cpu).unwrap();
    bytes_of(&table.index_select(&idx, 0).unwrap())
}

fn case() -> impl Strategy<Value = (DType, usize, usize, usize, Vec<u32>, Vec<u32>, Vec<usize>)> {
    (
        prop_oneof![Just(DType::F32), Just(DType::BF16), Just(DType::F16)],
        1usize..=5,
        1usize..=3,
        1usize..=3,
        1usize..=9,
    )
        .prop_flat_map(|(dtype, block_rows, k, d, dim)| {
            let rows = (k * block_rows + d).saturating_sub(2).max(1); // k*b-1, k*b, k*b+1
            (
                Just(dtype),
                Just(block_rows),
                Just(rows),
                Just(dim),
                prop::collection::vec(any::<u32>(), rows * dim), // arbitrary bit patterns
                prop::collection::vec(0..rows as u32, 0..24),
                prop_oneof![Just(vec![]), Just(vec![2usize]), Just(vec![3, 2])],
            )
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn forward_matches_index_select((dtype, block_rows, rows, dim, bits, ids, lead) in case()) {
        let table = table_from_bits(&bits, rows, dim, dtype);
        let packed = PackedFrozenEmbedding::new(&table, &PackOptions { block_rows, ..PackOptions::default() }).unwrap();
        // shape the ids: leading dims `lead` when they fit, else flat
        let n = ids.len();
        let shape: Vec<usize> = if lead.iter().product::<usize>() == n && !lead.is_empty() { lead } else { vec![n] };
        let ids_t = Tensor::from_vec(ids.clone(), shape.clone(), &Device::Cpu).unwrap();
        let out = packed.forward(&ids_t).unwrap();
        let mut want_shape = shape.clone();
        want_shape.push(dim);
        prop_assert_eq!(out.dims(), want_shape.as_slice());
        prop_assert_eq!(out.dtype(), dtype);
        prop_assert_eq!(bytes_of(&out), expected(&table, &ids_t));
        // i64 ids give the same bytes
        let ids64 = Tensor::from_vec(ids.iter().map(|&i| i64::from(i)).collect::<Vec<_>>(), shape, &Device::Cpu).unwrap();
        prop_assert_eq!(bytes_of(&packed.forward(&ids64).unwrap()), bytes_of(&out));
        // the full snapshot is the table
        prop_assert_eq!(bytes_of(&packed.weight().unwrap()), bytes_of(&table));
    }
}

#[test]
fn strided_ids_and_empty_ids() {
    let table = Tensor::arange(0f32, 40.0 * 3.0, &Device::Cpu)
        .unwrap()
        .reshape((40, 3))
        .unwrap();
    let packed = PackedFrozenEmbedding::new(&table, &PackOptions::default()).unwrap();
    // a transposed (non-contiguous) id tensor
    let ids = Tensor::new(&[[1u32, 2, 3], [30, 31, 39]], &Device::Cpu)
        .unwrap()
        .t()
        .unwrap();
    assert!(!ids.is_contiguous());
    let out = packed.forward(&ids).unwrap();
    assert_eq!(out.dims(), &[3, 2, 3]);
    assert_eq!(bytes_of(&out), expected(&table, &ids.contiguous().unwrap()));
    let empty = Tensor::zeros((0,), DType::U32, &Device::Cpu).unwrap();
    assert_eq!(packed.forward(&empty).unwrap().dims(), &[0, 3]);
    let empty2 = Tensor::zeros((4, 0), DType::I64, &Device::Cpu).unwrap();
    assert_eq!(packed.forward(&empty2).unwrap().dims(), &[4, 0, 3]);
}

#[test]
fn ineligible_tables_say_why() {
    let dev = Device::Cpu;
    let err = |t: &Tensor| {
        PackedFrozenEmbedding::new(t, &PackOptions::default())
            .unwrap_err()
            .to_string()
    };
    assert!(
        err(&Tensor::zeros((2, 3, 4), DType::F32, &dev).unwrap()).contains("expected a 2-D table")
    );
    assert!(
        err(&Tensor::zeros((4, 3), DType::F32, &dev)
            .unwrap()
            .t()
            .unwrap())
        .contains("not contiguous")
    );
    assert!(err(&Tensor::zeros((4, 3), DType::U32, &dev).unwrap()).contains("not a float type"));
    let var = Var::zeros((4, 3), DType::F32, &dev).unwrap();
    assert!(err(var.as_tensor()).contains("trainable variable"));
    let bad = PackedFrozenEmbedding::new(
        &Tensor::zeros((4, 3), DType::F32, &dev).unwrap(),
        &PackOptions {
            block_rows: 0,
            ..PackOptions::default()
        },
    );
    assert!(bad.unwrap_err().to_string().contains("block_rows"));
}

#[test]
fn bad_ids_are_errors() {
    let table = Tensor::zeros((10, 4), DType::F32, &Device::Cpu).unwrap();
    let packed = PackedFrozenEmbedding::new(&table, &PackOptions::default()).unwrap();
    let e = packed
        .lookup(&Tensor::new(&[1u32, 10], &Device::Cpu).unwrap())
        .unwrap_err();
    let out_of_range = compressme_blockstore::Error::RowOutOfRange { id: 10, rows: 10 };
    assert_eq!(e.to_string(), out_of_range.to_string());
    assert!(matches!(e, Error::Store(_)), "{e}");
    let e = packed
        .lookup(&Tensor::new(&[-1i64], &Device::Cpu).unwrap())
        .unwrap_err();
    assert!(matches!(e, Error::NegativeId(-1)), "{e}");
    let e = packed
        .lookup(&Tensor::new(&[1f32], &Device::Cpu).unwrap())
        .unwrap_err();
    assert!(matches!(e, Error::UnsupportedIds(_)), "{e}");
    // through the candle Module trait the error is a candle error carrying the message
    let e = packed
        .forward(&Tensor::new(&[11u32], &Device::Cpu).unwrap())
        .unwrap_err();
    assert!(e.to_string().contains("row 11 out of range"), "{e}");
}

#[test]
fn snapshot_is_independent_and_source_is_copied() {
    let dev = Device::Cpu;
    let var = Var::new(&[[1f32, 2.0], [3.0, 4.0]], &dev).unwrap();
    let frozen = var.as_tensor().detach().copy().unwrap();
    let packed = PackedFrozenEmbedding::new(&frozen, &PackOptions::default()).unwrap();
    // changing the source after packing does not reach the packed table
    var.set(&Tensor::new(&[[9f32, 9.0], [9.0, 9.0]], &dev).unwrap())
        .unwrap();
    // changing a snapshot does not either
    let snap = packed.weight().unwrap();
    let changed = (snap + 1.0).unwrap();
    assert_eq!(
        changed.to_vec2::<f32>().unwrap(),
        vec![vec![2.0, 3.0], vec![4.0, 5.0]]
    );
    assert_eq!(
        packed.weight().unwrap().to_vec2::<f32>().unwrap(),
        vec![vec![1.0, 2.0], vec![3.0, 4.0]]
    );
}

#[test]
fn small_tables_grow_and_the_report_says_so() {
    let table = Tensor::new(&[[0.123f32, -4.5], [7.25, 1e-3]], &Device::Cpu).unwrap();
    let r = PackedFrozenEmbedding::assess(&table, &PackOptions::default()).unwrap();
    assert_eq!(r.dense_bytes, 16);
    assert!(
        !r.pays(),
        "a 16-byte table cannot pay for a 32-byte digest: {r:?}"
    );
    assert!(r.ratio() > 1.0);
}

#[test]
fn zstd_option_and_verify_on_decode() {
    let table = Tensor::arange(0f32, 64.0, &Device::Cpu)
        .unwrap()
        .reshape((16, 4))
        .unwrap();
    let mut packed = PackedFrozenEmbedding::new(&table, &PackOptions::zstd(4, 3)).unwrap();
    packed.set_verify_on_decode(true);
    let ids = Tensor::new(&[15u32, 0, 7], &Device::Cpu).unwrap();
    assert_eq!(
        bytes_of(&packed.forward(&ids).unwrap()),
        expected(&table, &ids)
    );
}
