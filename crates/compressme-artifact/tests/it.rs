//! Round trips, determinism, bounds and a corruption sweep over a small artifact.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, missing_docs)] // tests

use std::path::{Path, PathBuf};

use compressme_artifact::{
    Artifact, Dtype, Durability, Error, Limits, Storage, WholeDigest, Writer, unpack,
};
use compressme_blockstore::Coder;
use compressme_quant::{Format, GroupSize};

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("cm-artifact-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Weight-like f32 bytes (plus NaN payloads, signed zeros, subnormals, infinities).
fn weights(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut v: Vec<f32> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x % 20001) as f32 - 10000.0) * 1e-5
        })
        .collect();
    let specials = [
        f32::from_bits(0x7fc0_1234),
        f32::from_bits(0xffa0_0001),
        -0.0,
        f32::from_bits(1),
        f32::INFINITY,
    ];
    for (i, s) in specials.iter().enumerate() {
        if let Some(slot) = v.get_mut(i * 7) {
            *slot = *s;
        }
    }
    v.iter().flat_map(|f| f.to_le_bytes()).collect()
}

fn bf16(bytes: &[u8]) -> Vec<u8> {
    bytes.chunks_exact(4).flat_map(|c| [c[2], c[3]]).collect()
}

/// The safetensors header's length (bytes after the 8-byte prefix).
fn header_len(bytes: &[u8]) -> usize {
    u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize
}

/// The artifact the tests share: lossless f32 and bf16 (specials included), a tensor
/// too small to pack, a quantized matrix, and an i64 tensor kept dense.
fn write_sample(path: &Path) -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)> {
    write_sample_with(path, WholeDigest::default())
}

/// [`write_sample`] with the lossless tensors' whole-tensor digest `digest` (SHA-256:
/// artifact version 2, as the frozen versions 1 to 3 were written).
fn write_sample_with(
    path: &Path,
    digest: WholeDigest,
) -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)> {
    let mut quant_src: Vec<u8> = weights(48 * 64, 9);
    // quantization refuses non-finite weights: use finite values there
    for c in quant_src.chunks_exact_mut(4) {
        let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        if !v.is_finite() {
            c.copy_from_slice(&0.5f32.to_le_bytes());
        }
    }
    let tensors = vec![
        (
            "emb.weight".to_string(),
            Dtype::F32,
            vec![200, 48],
            weights(200 * 48, 1),
        ),
        (
            "emb16.weight".to_string(),
            Dtype::Bf16,
            vec![100, 64],
            bf16(&weights(100 * 64, 2)),
        ),
        ("norm.bias".to_string(), Dtype::F32, vec![8], weights(8, 3)),
        (
            "layer.0.weight".to_string(),
            Dtype::F32,
            vec![48, 64],
            quant_src,
        ),
        (
            "position_ids".to_string(),
            Dtype::I64,
            vec![1, 16],
            (0i64..16).flat_map(i64::to_le_bytes).collect(),
        ),
    ];
    let mut w = Writer::create(path).unwrap();
    w.set_whole_digest(digest);
    w.recipe_mut()
        .source_metadata
        .insert("format".into(), "pt".into());
    for (name, dtype, shape, bytes) in &tensors {
        match name.as_str() {
            "layer.0.weight" => {
                w.add_quantized(name, *dtype, shape, bytes, Format::Nf4Block(GroupSize::G32))
                    .unwrap();
            }
            "position_ids" => {
                w.add_dense(name, *dtype, shape, bytes).unwrap();
            }
            _ => {
                w.add_lossless(name, *dtype, shape, bytes, 16, Coder::default())
                    .unwrap();
            }
        }
    }
    let s = w.finish().unwrap();
    assert_eq!((s.tensors, s.quantized), (5, 1));
    tensors
}

#[test]
fn round_trip_is_exact_and_deterministic() {
    let d = tmp("rt");
    let (a, b) = (d.join("a.cma"), d.join("b.cma"));
    let tensors = write_sample(&a);
    write_sample(&b);
    assert_eq!(
        std::fs::read(&a).unwrap(),
        std::fs::read(&b).unwrap(),
        "not deterministic"
    );
    let mut art = Artifact::open(&a, &Limits::default()).unwrap();
    let s = art.verify().unwrap();
    assert_eq!(s.lossless, 2);
    assert_eq!(
        s.dense, 2,
        "the 8-value bias does not pay and is kept dense"
    );
    for (name, _, _, bytes) in &tensors {
        let (got, exact) = art.read_tensor(name).unwrap();
        if name == "layer.0.weight" {
            assert!(!exact);
            assert_eq!(got.len(), bytes.len());
        } else {
            assert!(exact);
            assert!(got == *bytes, "{name} differs");
        }
    }
    // unpack writes a plain safetensors file the safetensors crate reads
    let out = d.join("out.safetensors");
    unpack(&mut art, &out, Durability::Synced, |_, _| {}).unwrap();
    let raw = std::fs::read(&out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&raw).unwrap();
    for (name, _, shape, bytes) in &tensors {
        let v = st.tensor(name).unwrap();
        assert_eq!(v.shape(), shape.as_slice());
        if name != "layer.0.weight" {
            assert!(v.data() == bytes.as_slice(), "{name}");
        }
    }
    let (_, md) = safetensors::SafeTensors::read_metadata(&raw).unwrap();
    assert_eq!(md.metadata().as_ref().unwrap().get("format").unwrap(), "pt");
    // no temporary files are left
    let left: Vec<_> = std::fs::read_dir(&d)
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.file_name())
        .collect();
    assert_eq!(left.len(), 3, "{left:?}");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_failed_writer_leaves_nothing_behind() {
    let d = tmp("fail");
    let p = d.join("x.cma");
    {
        let mut w = Writer::create(&p).unwrap();
        w.add_dense("a", Dtype::F32, &[2], &[0; 8]).unwrap();
        assert!(
            w.add_dense("a", Dtype::F32, &[2], &[0; 8]).is_err(),
            "a name twice"
        );
        assert!(
            w.add_dense("b", Dtype::F32, &[3], &[0; 8]).is_err(),
            "bytes that do not fit"
        );
        assert!(
            w.add_dense("cm.blocks/x", Dtype::U8, &[1], &[0]).is_err(),
            "reserved name"
        );
        let nan = f32::NAN.to_le_bytes().repeat(4);
        assert!(
            w.add_quantized("q", Dtype::F32, &[2, 2], &nan, Format::Int8)
                .is_err()
        );
        assert!(
            w.add_quantized("v", Dtype::F32, &[4], &[0; 16], Format::Int8)
                .is_err(),
            "1-D"
        );
    }
    assert_eq!(std::fs::read_dir(&d).unwrap().count(), 0);
    std::fs::remove_dir_all(&d).unwrap();
}

/// Opens and verifies; `Ok` only when both succeed.
fn check(path: &Path, limits: &Limits) -> Result<(), Error> {
    let a = Artifact::open(path, limits)?;
    a.verify()?;
    Ok(())
}

/// Flip one byte at many positions across every region, and truncate at many lengths:
/// each is an error, none panics.
#[test]
fn corruption_sweep_every_case_is_an_error() {
    let d = tmp("sweep");
    let good = d.join("good.cma");
    write_sample(&good);
    let bytes = std::fs::read(&good).unwrap();
    let header_len = header_len(&bytes);
    let n = bytes.len();
    let bad = d.join("bad.cma");
    let limits = Limits::default();
    // every byte of the length and the first 2 KiB of header, then a stride through the rest
    let mut positions: Vec<usize> = (0..(8 + header_len).min(2048)).collect();
    positions.extend((2048..8 + header_len).step_by(7));
    positions.extend((8 + header_len..n).step_by(3));
    let (mut flips, mut truncs) = (0, 0);
    let mut kinds = std::collections::BTreeMap::<String, usize>::new();
    for &p in &positions {
        let mut b = bytes.clone();
        b[p] ^= 0xff;
        std::fs::write(&bad, &b).unwrap();
        let e = check(&bad, &limits).expect_err(&format!(
            "flip at {p} of {n} (header {header_len}) went unnoticed"
        ));
        let kind = format!("{e:?}")
            .split([' ', '{', '('])
            .next()
            .unwrap()
            .to_string();
        *kinds.entry(kind).or_default() += 1;
        flips += 1;
    }
    for len in (0..n).step_by(5).chain([n - 1]) {
        std::fs::write(&bad, &bytes[..len]).unwrap();
        assert!(check(&bad, &limits).is_err(), "truncated to {len}");
        truncs += 1;
    }
    println!(
        "corruption sweep over a {n}-byte artifact (header {header_len}): {flips} byte flips and {truncs} truncations, all errors; by kind: {kinds:?}"
    );
    assert!(flips > 1000 && truncs > 500);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn sizes_are_bounded_before_allocation() {
    let d = tmp("bounds");
    let good = d.join("good.cma");
    write_sample(&good);
    let mut b = std::fs::read(&good).unwrap();
    // a header length of 2^62: refused before anything is allocated
    b[..8].copy_from_slice(&(1u64 << 62).to_le_bytes());
    let p = d.join("huge.cma");
    std::fs::write(&p, &b).unwrap();
    let e = Artifact::open(&p, &Limits::default());
    assert!(matches!(e, Err(Error::NotSafetensors { .. })), "{e:?}");
    // a header inside the file but past the caller's bound
    let limits = Limits {
        max_header: 100,
        ..Limits::default()
    };
    let e = Artifact::open(&good, &limits);
    assert!(matches!(e, Err(Error::TooLarge { .. })), "{e:?}");
    // the caller's bound on the whole file
    let limits = Limits {
        max_total: 1000,
        ..Limits::default()
    };
    assert!(matches!(
        Artifact::open(&good, &limits),
        Err(Error::TooLarge { .. })
    ));
    let limits = Limits {
        max_tensor: 100,
        ..Limits::default()
    };
    assert!(matches!(
        Artifact::open(&good, &limits),
        Err(Error::TooLarge { .. })
    ));
    let limits = Limits {
        max_tensors: 2,
        ..Limits::default()
    };
    assert!(matches!(
        Artifact::open(&good, &limits),
        Err(Error::TooLarge { .. })
    ));
    std::fs::remove_dir_all(&d).unwrap();
}

fn fixture_dir(version: u32) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("../../fixtures/artifact/v{version}"))
}

/// Writes the sample (its lossless tensors' whole-tensor digests `digest`) and its corrupt
/// variants into `dir` (only under `COMPRESSME_BLESS=1`, for a folder without them).
fn bless(dir: &Path, digest: WholeDigest) {
    let sample = dir.join("sample.cma");
    std::fs::create_dir_all(dir).unwrap();
    write_sample_with(&sample, digest);
    let good = std::fs::read(&sample).unwrap();
    let header_len = header_len(&good);
    let mut b = good.clone();
    let last = b.len() - 100;
    b[last] ^= 0x01;
    std::fs::write(dir.join("flipped_payload.cma"), &b).unwrap();
    let mut b = good.clone();
    b[8 + header_len / 2] ^= 0x01;
    std::fs::write(dir.join("flipped_header.cma"), &b).unwrap();
    std::fs::write(dir.join("truncated.cma"), &good[..good.len() - 1]).unwrap();
    let version = Artifact::open(&sample, &Limits::default())
        .unwrap()
        .recipe()
        .version;
    let text = String::from_utf8_lossy(&good[8..8 + header_len]).replace(
        &format!("\"compressme.version\":\"{version}\""),
        "\"compressme.version\":\"9\"",
    );
    let mut b = (text.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(text.as_bytes());
    b.extend_from_slice(&good[8 + header_len..]);
    std::fs::write(dir.join("bad_version.cma"), &b).unwrap();
}

/// Since 2026-12-02 the block store encoder leaves out code tables no block is coded with:
/// a lossless store written today is the frozen one less those 128-byte tables (the same
/// header, block lengths, digest count and payload bytes; a block's mode byte may name a
/// renumbered table), so it decodes to the same bytes and only its index digest differs.
fn same_store_but_unused_tables(frozen: &Artifact, today: &Artifact, name: &str) {
    use compressme_artifact::Stored;
    let (Ok(Stored::Lossless(a)), Ok(Stored::Lossless(b))) =
        (frozen.read_stored(name), today.read_stored(name))
    else {
        panic!("{name} is lossless in both");
    };
    let (x, y) = (a.stored_bytes(), b.stored_bytes());
    assert_eq!(
        (x.header, x.offsets, x.digests, x.payload),
        (y.header, y.offsets, y.digests, y.payload),
        "{name}: the blocks changed"
    );
    assert!(
        y.tables <= x.tables && (x.tables - y.tables) % 128 == 0,
        "{name}: {} -> {} table bytes",
        x.tables,
        y.tables
    );
    assert_eq!(a.decode_all().unwrap(), b.decode_all().unwrap(), "{name}");
}

/// The frozen artifact's entries and today's: the same tensors in the same order, dense
/// and packed payloads of the same bytes, block stores no larger, by whole tables.
fn same_entries_but_unused_tables(frozen: &Artifact, today: &Artifact) {
    assert_eq!(frozen.entries().len(), today.entries().len());
    for (e1, e2) in frozen.entries().iter().zip(today.entries()) {
        assert_eq!((&e1.name, e1.dtype), (&e2.name, e2.dtype));
        let (n1, n2) = (e1.end - e1.begin, e2.end - e2.begin);
        if e1.name.starts_with("cm.blocks/") {
            assert!(
                n2 <= n1 && (n1 - n2) % 128 == 0,
                "{}: {n1} -> {n2}",
                e1.name
            );
        } else {
            assert_eq!((&e1.shape, n1), (&e2.shape, n2), "{}", e1.name);
        }
    }
}

/// The frozen artifact's recipe and today's agree but for the tool and, where a store left
/// out unused tables ([`same_store_but_unused_tables`], checked here), its index digest.
fn same_recipe_but_unused_tables(frozen: &Artifact, today: &Artifact) {
    use compressme_artifact::StorageRecipe;
    let (mut r1, mut r2) = (frozen.recipe().clone(), today.recipe().clone());
    r1.tool.clone_from(&r2.tool);
    for (t1, t2) in r1.tensors.iter_mut().zip(r2.tensors.iter_mut()) {
        if let (
            StorageRecipe::Lossless {
                index_sha256: a, ..
            },
            StorageRecipe::Lossless {
                index_sha256: b, ..
            },
        ) = (&mut t1.storage, &mut t2.storage)
        {
            same_store_but_unused_tables(frozen, today, &t1.name);
            *a = None;
            *b = None;
        }
    }
    assert_eq!(
        r1, r2,
        "writer output changed: a format change needs a new version"
    );
}

/// A frozen version's files: the sample opens, verifies and decodes to the bytes the
/// sample was made from, with the same payload tensors as today's writer produces; its
/// corrupt variants fail the way they always have.
fn check_frozen(version: u32) -> (Artifact, Artifact) {
    let dir = fixture_dir(version);
    let sample = dir.join("sample.cma");
    let a = Artifact::open(&sample, &Limits::default()).unwrap();
    assert_eq!(a.recipe().version, version);
    let s = a.verify().unwrap();
    assert_eq!((s.tensors, s.lossless, s.quantized, s.dense), (5, 2, 1, 2));
    let fresh = tmp(&format!("fixture-v{version}")).join("fresh.cma");
    // versions 1 to 3 hold SHA-256 whole-tensor digests, version 4 XXH3-128s
    let digest = if version >= 4 {
        WholeDigest::Xxh3
    } else {
        WholeDigest::Sha256
    };
    let tensors = write_sample_with(&fresh, digest);
    let today = Artifact::open(&fresh, &Limits::default()).unwrap();
    // the block-store format did not change: the same payload tensors (less unused tables)
    same_entries_but_unused_tables(&a, &today);
    for (name, _, _, bytes) in &tensors {
        let (got, exact) = a.read_tensor(name).unwrap();
        if exact {
            assert!(got == *bytes, "{name}");
        }
    }
    let open = |f: &str| Artifact::open(&dir.join(f), &Limits::default()).and_then(|a| a.verify());
    let e = open("flipped_payload.cma");
    let ok = matches!(e, Err(Error::Blocks { .. } | Error::Digest { .. }));
    assert!(ok, "{e:?}");
    // the writer's check (no decoding) catches it too
    let e = Artifact::open(&dir.join("flipped_payload.cma"), &Limits::default())
        .and_then(|a| a.check_stored());
    let ok = matches!(e, Err(Error::Blocks { .. } | Error::Digest { .. }));
    assert!(ok, "{e:?}");
    assert_eq!(a.check_stored().unwrap(), a.verify().unwrap());
    let e = open("flipped_header.cma");
    assert!(e.is_err(), "{e:?}");
    let e = open("truncated.cma");
    assert!(matches!(e, Err(Error::NotSafetensors { .. })), "{e:?}");
    let e = open("bad_version.cma");
    assert!(matches!(e, Err(Error::UnsupportedVersion { .. })), "{e:?}");
    std::fs::remove_dir_all(fresh.parent().unwrap()).unwrap();
    (a, today)
}

/// Version 1 stays readable forever. Its recipe lists every block's digest: each equals
/// the digest of the same block in today's store, whose index digest today's recipe
/// (version 2) records instead.
#[test]
fn frozen_v1_fixtures() {
    use compressme_artifact::StorageRecipe;
    let (old, today) = check_frozen(1);
    for (t1, t2) in old
        .recipe()
        .tensors
        .clone()
        .iter()
        .zip(&today.recipe().tensors)
    {
        assert_eq!(
            (&t1.name, &t1.shape, &t1.sha256),
            (&t2.name, &t2.shape, &t2.sha256)
        );
        if let (
            StorageRecipe::Lossless { block_sha256, .. },
            StorageRecipe::Lossless { index_sha256, .. },
        ) = (&t1.storage, &t2.storage)
        {
            let Ok(compressme_artifact::Stored::Lossless(store)) = old.read_stored(&t1.name) else {
                panic!("{} is lossless", t1.name);
            };
            let digests: Vec<String> = store
                .block_digests()
                .iter()
                .map(|d| compressme_artifact::recipe::hex(d))
                .collect();
            assert_eq!(&digests, block_sha256);
            assert!(index_sha256.is_some() && block_sha256.len() >= 2);
            same_store_but_unused_tables(&old, &today, &t1.name);
        } else {
            assert_eq!(t1.storage, t2.storage, "{}", t1.name);
        }
    }
}

/// Version 2 (the version this build writes) stays readable forever, and today's writer
/// still produces its recipe (less unused code tables, see `same_store_but_unused_tables`). Regenerate only with `COMPRESSME_BLESS=1`, and only
/// for a new version's folder.
#[test]
fn frozen_v2_fixtures() {
    if std::env::var_os("COMPRESSME_BLESS").is_some() && !fixture_dir(2).join("sample.cma").exists()
    {
        bless(&fixture_dir(2), WholeDigest::Sha256);
    }
    let (frozen, today) = check_frozen(2);
    same_recipe_but_unused_tables(&frozen, &today);
}

/// Version 4 (since 2026-12-06: lossless tensors' whole-tensor digests XXH3-128, the
/// source header optional) stays readable forever, and today's writer still produces its
/// recipe. `sample.cma` and its corrupt variants as in version 2; `source.cma`, version
/// 3's frozen `source.safetensors` packed with its header recorded, unpacks to that file
/// byte for byte. Written only when missing, under `COMPRESSME_BLESS=1`.
#[test]
fn frozen_v4_fixtures() {
    let dir = fixture_dir(4);
    let src = fixture_dir(3).join("source.safetensors");
    if std::env::var_os("COMPRESSME_BLESS").is_some() && !dir.join("sample.cma").exists() {
        bless(&dir, WholeDigest::Xxh3);
        pack_recording_header(&src, &dir.join("source.cma"), WholeDigest::Xxh3);
    }
    let (frozen, today) = check_frozen(4);
    same_recipe_but_unused_tables(&frozen, &today);
    for t in &frozen.recipe().tensors {
        let lossless = matches!(
            t.storage,
            compressme_artifact::StorageRecipe::Lossless { .. }
        );
        assert_eq!(t.xxh3_128.is_some(), lossless, "{}", t.name);
    }
    assert!(frozen.source_header().is_none());
    // with the source header recorded
    let mut a = Artifact::open(&dir.join("source.cma"), &Limits::default()).unwrap();
    assert_eq!(a.recipe().version, 4);
    assert!(a.source_header().is_some());
    let s = a.verify().unwrap();
    assert_eq!((s.tensors, s.lossless, s.dense), (4, 2, 2));
    let d = tmp("fixture-v4-source");
    let back = d.join("back.safetensors");
    unpack(&mut a, &back, Durability::Cached, |_, _| {}).unwrap();
    assert!(std::fs::read(&back).unwrap() == std::fs::read(&src).unwrap());
    let fresh = d.join("fresh.cma");
    pack_recording_header(&src, &fresh, WholeDigest::Xxh3);
    let today = Artifact::open(&fresh, &Limits::default()).unwrap();
    same_recipe_but_unused_tables(&a, &today);
    same_entries_but_unused_tables(&a, &today);
    std::fs::remove_dir_all(&d).unwrap();
}

/// The `int8-gG` formats (added to version 2 in stop 22): an f32 matrix whose rows end in a
/// short group, and a bf16 one, both at groups of 32.
type Sample = Vec<(String, Dtype, Vec<usize>, Vec<u8>)>;

/// Opens the frozen version-2 fixture `name` (written by `write` only when it is missing
/// and `COMPRESSME_BLESS=1`), writes the sample again with today's writer, and checks both
/// have the same recipe (which seals every payload's digest) and entries, less unused code tables. Returns the
/// frozen artifact, the sample's tensors and today's file (its folder is the caller's to
/// remove).
fn frozen_matches_today(name: &str, write: fn(&Path) -> Sample) -> (Artifact, Sample, PathBuf) {
    let frozen = fixture_dir(2).join(name);
    if std::env::var_os("COMPRESSME_BLESS").is_some() && !frozen.exists() {
        write(&frozen);
    }
    let fresh = tmp(name.trim_end_matches(".cma")).join("fresh.cma");
    let tensors = write(&fresh);
    let a = Artifact::open(&frozen, &Limits::default()).unwrap();
    let today = Artifact::open(&fresh, &Limits::default()).unwrap();
    same_recipe_but_unused_tables(&a, &today);
    same_entries_but_unused_tables(&a, &today);
    (a, tensors, fresh)
}

fn write_int8_block_sample(path: &Path) -> Sample {
    let finite = |mut b: Vec<u8>| {
        for c in b.chunks_exact_mut(4) {
            if !f32::from_le_bytes([c[0], c[1], c[2], c[3]]).is_finite() {
                c.copy_from_slice(&0.25f32.to_le_bytes());
            }
        }
        b
    };
    let tensors = vec![
        (
            "a.weight".to_string(),
            Dtype::F32,
            vec![7, 40],
            finite(weights(7 * 40, 11)),
        ),
        (
            "b.weight".to_string(),
            Dtype::Bf16,
            vec![5, 64],
            bf16(&finite(weights(5 * 64, 12))),
        ),
    ];
    let mut w = Writer::create(path).unwrap();
    for (name, dtype, shape, bytes) in &tensors {
        w.add_quantized(
            name,
            *dtype,
            shape,
            bytes,
            Format::Int8Block(GroupSize::G32),
        )
        .unwrap();
    }
    w.finish().unwrap();
    tensors
}

/// `int8-g32` as first written stays readable forever, and today's writer still writes it
/// the same recipe and payloads. Regenerate only with `COMPRESSME_BLESS=1` when the file is missing.
#[test]
fn frozen_int8_block_fixture() {
    let (a, tensors, fresh) = frozen_matches_today("int8_g32.cma", write_int8_block_sample);
    let s = a.verify().unwrap();
    assert_eq!((s.tensors, s.quantized), (2, 2));
    for (name, dtype, shape, bytes) in &tensors {
        let t = a.recipe().tensors.iter().find(|t| &t.name == name).unwrap();
        assert_eq!(t.shape, *shape);
        let ok = matches!(&t.storage, compressme_artifact::StorageRecipe::Quant { format, .. } if format == "int8-g32");
        assert!(ok, "{:?}", t.storage);
        let (got, exact) = a.read_tensor(name).unwrap();
        assert!(!exact);
        // within half a step of each group's scale (absmax / 127), bf16's rounding aside
        let f = |b: &[u8]| -> Vec<f32> {
            match dtype {
                Dtype::F32 => b
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
                _ => b
                    .chunks_exact(2)
                    .map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16))
                    .collect(),
            }
        };
        let (want, got) = (f(bytes), f(&got));
        let cols = shape[1];
        for (r, (wr, gr)) in want.chunks(cols).zip(got.chunks(cols)).enumerate() {
            for (wg, gg) in wr.chunks(32).zip(gr.chunks(32)) {
                let step = wg.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
                for (w, g) in wg.iter().zip(gg) {
                    assert!(
                        (w - g).abs() <= step * 0.51 + w.abs() / 128.0,
                        "{name} row {r}: {w} -> {g}"
                    );
                }
            }
        }
    }
    std::fs::remove_dir_all(fresh.parent().unwrap()).unwrap();
}

/// A sharded checkpoint is read through its index JSON, from the folder or the index.
#[test]
fn sharded_checkpoints_read_through_their_index() {
    use compressme_artifact::Checkpoint;
    let d = tmp("shards");
    let a: Vec<u8> = weights(64, 1);
    let b: Vec<u8> = weights(32, 2);
    let shard = |name: &str, tensor: &str, bytes: &[u8], n: usize| {
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![n], bytes).unwrap();
        safetensors::serialize_to_file(vec![(tensor.to_string(), view)], None, &d.join(name))
            .unwrap();
    };
    shard("model-00001-of-00002.safetensors", "a.weight", &a, 64);
    shard("model-00002-of-00002.safetensors", "b.weight", &b, 32);
    std::fs::write(
        d.join("model.safetensors.index.json"),
        r#"{"metadata": {}, "weight_map": {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    for path in [d.clone(), d.join("model.safetensors.index.json")] {
        let c = Checkpoint::open(&path, &Limits::default()).unwrap();
        let names: Vec<String> = c.entries().map(|e| e.name.clone()).collect();
        assert_eq!(names, ["a.weight", "b.weight"]);
        assert!(c.read("a.weight").unwrap() == a);
        assert!(c.read("b.weight").unwrap() == b);
        assert_eq!(c.largest(), 256);
    }
    // an index pointing outside its folder, or naming no shards, is refused
    std::fs::write(
        d.join("bad.index.json"),
        r#"{"weight_map": {"x": "../x.safetensors"}}"#,
    )
    .unwrap();
    assert!(Checkpoint::open(&d.join("bad.index.json"), &Limits::default()).is_err());
    std::fs::write(d.join("empty.index.json"), r#"{"weight_map": {}}"#).unwrap();
    assert!(Checkpoint::open(&d.join("empty.index.json"), &Limits::default()).is_err());
    std::fs::remove_dir_all(&d).unwrap();
}

/// Rewrites the recipe of the artifact at `src` into `dst` with `edit`, sealed again (a
/// correct recipe digest), payload unchanged: what a hostile writer can do.
fn reseal(src: &Path, dst: &Path, edit: impl Fn(&mut compressme_artifact::Recipe)) {
    let bytes = std::fs::read(src).unwrap();
    let n = header_len(&bytes);
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let md = header["__metadata__"].as_object_mut().unwrap();
    let mut recipe: compressme_artifact::Recipe =
        serde_json::from_str(md["compressme.recipe"].as_str().unwrap()).unwrap();
    edit(&mut recipe);
    let json = serde_json::to_string(&recipe).unwrap();
    md.insert(
        "compressme.recipe_sha256".into(),
        compressme_artifact::recipe::sha256_hex(json.as_bytes()).into(),
    );
    md.insert("compressme.recipe".into(), json.into());
    let mut h = serde_json::to_vec(&header).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(dst, out).unwrap();
}

/// The name of the first tensor of `a` whose storage `pick` accepts.
fn first_tensor(
    a: &Artifact,
    pick: impl Fn(&compressme_artifact::StorageRecipe) -> bool,
) -> String {
    a.recipe()
        .tensors
        .iter()
        .find(|t| pick(&t.storage))
        .unwrap()
        .name
        .clone()
}

/// Sizes read from a file at the extremes of their types are refused as errors, not
/// overflows (this test runs in the debug profile, where an overflow panics).
#[test]
fn extreme_sizes_are_errors_not_overflows() {
    use compressme_artifact::StorageRecipe;
    let d = tmp("extreme");
    let good = d.join("good.cma");
    write_sample(&good);
    let bad = d.join("bad.cma");
    let a = Artifact::open(&good, &Limits::default()).unwrap();
    let quant = first_tensor(&a, |s| matches!(s, StorageRecipe::Quant { .. }));
    let lossless = first_tensor(&a, |s| matches!(s, StorageRecipe::Lossless { .. }));
    let dense = first_tensor(&a, |s| matches!(s, StorageRecipe::Dense));
    let big = [1usize << 61, (1 << 62) + 1, usize::MAX / 2, usize::MAX];
    for cols in big {
        for format in ["f16", "int8", "nf4", "nf4-g32", "int4-g128"] {
            // a quantized tensor claiming `cols` near the top of usize
            reseal(&good, &bad, |r| {
                let t = r.tensors.iter_mut().find(|t| t.name == quant).unwrap();
                t.shape = vec![1, cols];
                if let StorageRecipe::Quant {
                    rows,
                    cols: c,
                    format: f,
                    ..
                } = &mut t.storage
                {
                    *rows = 1;
                    *c = cols;
                    *f = format.into();
                }
            });
            let e = check(&bad, &Limits::default());
            let refused = matches!(e, Err(Error::Recipe { .. }));
            assert!(refused, "{format} {cols}: {e:?}");
        }
        // a shape whose element count overflows, on each kind of storage
        for name in [&quant, &lossless, &dense] {
            reseal(&good, &bad, |r| {
                let t = r.tensors.iter_mut().find(|t| &t.name == name).unwrap();
                t.shape = vec![cols, cols];
            });
            assert!(check(&bad, &Limits::default()).is_err(), "{name} {cols}");
        }
        // a lossless tensor claiming huge rows or blocks
        reseal(&good, &bad, |r| {
            let t = r.tensors.iter_mut().find(|t| t.name == lossless).unwrap();
            if let StorageRecipe::Lossless {
                rows,
                block_rows,
                row_bytes,
                ..
            } = &mut t.storage
            {
                *rows = cols as u64;
                *block_rows = cols;
                *row_bytes = u64::MAX;
            }
        });
        assert!(check(&bad, &Limits::default()).is_err(), "lossless {cols}");
    }
    std::fs::remove_dir_all(&d).unwrap();
}

/// A recipe whose block size disagrees with the store's, with digests that still pair
/// up, is refused (the digests are paired only when their counts agree); a dense
/// tensor whose bytes differ from its digest is refused when it is read, not only by
/// `verify`.
#[test]
fn every_read_checks_what_it_pairs() {
    use compressme_artifact::{StorageRecipe, Stored};
    let d = tmp("pairs");
    let good = d.join("good.cma");
    write_sample(&good);
    let bad = d.join("bad.cma");
    // version 1 (the frozen sample): block digests listed in the recipe
    let v1 = fixture_dir(1).join("sample.cma");
    let a = Artifact::open(&v1, &Limits::default()).unwrap();
    let (lossless, br, rows, digests) = a
        .recipe()
        .tensors
        .iter()
        .find_map(|t| match &t.storage {
            StorageRecipe::Lossless {
                block_rows,
                rows,
                block_sha256,
                ..
            } if block_sha256.len() >= 2 => {
                Some((t.name.clone(), *block_rows, *rows, block_sha256.clone()))
            }
            _ => None,
        })
        .unwrap();
    // twice the block size: half the blocks; the first digests kept, so a zip pairs them
    reseal(&v1, &bad, |r| {
        let t = r.tensors.iter_mut().find(|t| t.name == lossless).unwrap();
        if let StorageRecipe::Lossless {
            block_rows,
            block_sha256,
            ..
        } = &mut t.storage
        {
            *block_rows = 2 * br;
            *block_sha256 = digests[..rows.div_ceil(2 * br as u64) as usize].to_vec();
        }
    });
    let b = Artifact::open(&bad, &Limits::default()).unwrap();
    let e = b.read_stored(&lossless).map(|_| ());
    assert!(matches!(e, Err(Error::Invalid { .. })), "{e:?}");
    // version 2: the same change, and an index digest that is not the store's
    let a = Artifact::open(&good, &Limits::default()).unwrap();
    for wrong_index in [false, true] {
        reseal(&good, &bad, |r| {
            let t = r.tensors.iter_mut().find(|t| t.name == lossless).unwrap();
            if let StorageRecipe::Lossless {
                block_rows,
                index_sha256,
                ..
            } = &mut t.storage
            {
                if wrong_index {
                    *index_sha256 = Some("cd".repeat(32));
                } else {
                    *block_rows = 2 * br;
                }
            }
        });
        let b = Artifact::open(&bad, &Limits::default()).unwrap();
        let e = b.read_stored(&lossless).map(|_| ());
        if wrong_index {
            assert!(matches!(e, Err(Error::Digest { .. })), "{e:?}");
        } else {
            assert!(matches!(e, Err(Error::Invalid { .. })), "{e:?}");
        }
        assert!(b.verify().is_err());
    }
    // a version-2 recipe that lists block digests, or a version-1 one with an index
    // digest, is refused when opened
    reseal(&good, &bad, |r| {
        let t = r.tensors.iter_mut().find(|t| t.name == lossless).unwrap();
        if let StorageRecipe::Lossless { block_sha256, .. } = &mut t.storage {
            block_sha256.clone_from(&digests);
        }
    });
    let e = Artifact::open(&bad, &Limits::default()).map(drop);
    assert!(matches!(e, Err(Error::Recipe { .. })), "{e:?}");
    reseal(&v1, &bad, |r| {
        let t = r.tensors.iter_mut().find(|t| t.name == lossless).unwrap();
        if let StorageRecipe::Lossless { index_sha256, .. } = &mut t.storage {
            *index_sha256 = Some("cd".repeat(32));
        }
    });
    let e = Artifact::open(&bad, &Limits::default()).map(drop);
    assert!(matches!(e, Err(Error::Recipe { .. })), "{e:?}");
    // a dense tensor's digest replaced: reading it fails, naming it
    let dense = first_tensor(&a, |s| matches!(s, StorageRecipe::Dense));
    reseal(&good, &bad, |r| {
        let t = r.tensors.iter_mut().find(|t| t.name == dense).unwrap();
        t.sha256 = Some("ab".repeat(32));
    });
    let b = Artifact::open(&bad, &Limits::default()).unwrap();
    let e = b.read_stored(&dense).map(|_| ());
    assert!(matches!(e, Err(Error::Digest { .. })), "{e:?}");
    let g = Artifact::open(&good, &Limits::default()).unwrap();
    assert!(matches!(g.read_stored(&dense), Ok(Stored::Dense(_))));
    std::fs::remove_dir_all(&d).unwrap();
}

/// Rewrites the safetensors header of `src` into `dst` with `edit` on its text (the
/// data section unchanged), the length field set to the new text's length.
fn rewrite_header(src: &Path, dst: &Path, edit: impl Fn(&str) -> String) {
    let bytes = std::fs::read(src).unwrap();
    let n = header_len(&bytes);
    let text = std::str::from_utf8(&bytes[8..8 + n]).unwrap();
    let h = edit(text);
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(h.as_bytes());
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(dst, out).unwrap();
}

/// Pads header text with spaces to a multiple of 8.
fn pad8(mut h: String) -> String {
    while !h.len().is_multiple_of(8) {
        h.push(' ');
    }
    h
}

/// What FORMAT.md says a reader MUST refuse, each refused: a key given twice, a header
/// not padded with spaces to 8, tensors out of order, a whole-tensor digest on a
/// quantized tensor, a payload tensor of two dimensions.
#[test]
fn the_specs_musts_are_enforced() {
    use compressme_artifact::StorageRecipe;
    let d = tmp("musts");
    let good = d.join("good.cma");
    write_sample(&good);
    let bad = d.join("bad.cma");
    let refused = |what: &str| {
        let e = check(&bad, &Limits::default());
        assert!(e.is_err(), "{what} was accepted");
        e.unwrap_err().to_string()
    };
    // the good file passes through the helpers unchanged
    rewrite_header(&good, &bad, |h| h.to_string());
    check(&bad, &Limits::default()).unwrap();
    reseal(&good, &bad, |_| {});
    check(&bad, &Limits::default()).unwrap();

    rewrite_header(&good, &bad, |h| {
        pad8(
            h.trim_end()
                .replacen('{', r#"{"__metadata__":{"format":"x"},"#, 1),
        )
    });
    assert!(refused("a duplicate key").contains("appears twice"));
    rewrite_header(&good, &bad, |h| {
        let body = h.trim_end();
        // a payload tensor's entry (no nested objects) given again at the front
        let start = body.find("\"cm.").unwrap();
        let end = start + body[start..].find('}').unwrap() + 1;
        pad8(format!("{{{},{}", &body[start..end], &body[1..]))
    });
    assert!(refused("a tensor given twice").contains("appears twice"));
    rewrite_header(&good, &bad, |h| {
        let mut t = h.trim_end().to_string();
        t.push('\n');
        while !t.len().is_multiple_of(8) {
            t.push(' ');
        }
        t
    });
    assert!(refused("a newline in the padding").contains("padded"));
    rewrite_header(&good, &bad, |h| {
        let mut t = h.trim_end().to_string();
        if t.len().is_multiple_of(8) {
            t.push(' ');
        }
        t
    });
    assert!(refused("a header not a multiple of 8").contains("padded"));
    reseal(&good, &bad, |r| r.tensors.reverse());
    assert!(refused("unsorted tensors").contains("sorted"));
    // the first tensor stored as `kind` ("dense", "lossless" or "quant")
    let first = |r: &mut compressme_artifact::Recipe, kind: &str| -> usize {
        r.tensors
            .iter()
            .position(|t| match t.storage {
                StorageRecipe::Dense => kind == "dense",
                StorageRecipe::Lossless { .. } => kind == "lossless",
                StorageRecipe::Quant { .. } => kind == "quant",
            })
            .unwrap()
    };
    let (sha, xxh) = (|| Some("ab".repeat(32)), || Some("ab".repeat(16)));
    // each case: the tensor's kind, its `sha256` and `xxh3_128`, what the refusal says
    let cases = [
        ("quant", sha(), None, "no whole-tensor digest"),
        ("quant", None, xxh(), "no whole-tensor digest"),
        ("dense", sha(), xxh(), "no xxh3_128"),
        // version 4: a lossless tensor's whole-tensor digest is an XXH3-128, nothing else
        ("lossless", sha(), xxh(), "needs an xxh3_128"),
        ("lossless", sha(), None, "needs an xxh3_128"),
        ("lossless", None, Some("ab".repeat(15)), "32 hex digits"),
    ];
    for (kind, sha256, xxh3_128, says) in cases {
        reseal(&good, &bad, |r| {
            let i = first(r, kind);
            r.tensors[i].sha256.clone_from(&sha256);
            r.tensors[i].xxh3_128.clone_from(&xxh3_128);
        });
        let e = refused(&format!("{kind}: sha256 {sha256:?}, xxh3_128 {xxh3_128:?}"));
        assert!(e.contains(says), "{kind}: {e}");
    }
    let v4 = std::fs::read(&good).unwrap();
    let as_v2 = reseal_metadata(&v4, |md| {
        use compressme_artifact::recipe::{RECIPE_KEY, VERSION_KEY};
        md.insert(VERSION_KEY.into(), "2".into());
        let recipe = md[RECIPE_KEY]
            .as_str()
            .unwrap()
            .replacen("\"version\":4", "\"version\":2", 1);
        md.insert(RECIPE_KEY.into(), recipe.into());
    });
    std::fs::write(&bad, as_v2).unwrap();
    assert!(refused("version 2 with XXH3-128s").contains("needs a SHA-256"));
    // a well-formed XXH3-128 that is not the tensor's: the file opens, reading it fails
    reseal(&good, &bad, |r| {
        let i = first(r, "lossless");
        let mut x = r.tensors[i].xxh3_128.take().unwrap().into_bytes();
        x[31] = if x[31] == b'0' { b'1' } else { b'0' };
        r.tensors[i].xxh3_128 = Some(String::from_utf8(x).unwrap());
    });
    let a = Artifact::open(&bad, &Limits::default()).unwrap();
    let e = a.verify();
    assert!(matches!(e, Err(Error::Digest { .. })), "{e:?}");
    rewrite_header(&good, &bad, |h| {
        let at = h.find("\"cm.codes/").unwrap();
        let shape = at + h[at..].find("\"shape\":[").unwrap() + "\"shape\":[".len();
        pad8(format!("{}1,{}", &h[..shape], h[shape..].trim_end()))
    });
    assert!(refused("a two-dimensional payload").contains("one dimension"));
    std::fs::remove_dir_all(&d).unwrap();
}

/// Reading in place (every read now maps the file) gives what a plain copy of the file's
/// bytes gives: each lossless store parsed from the mapped file against the same bytes
/// read with `std::fs::read` and parsed by the copying parser, stored bytes and decoded
/// rows alike.
#[test]
fn mapped_reads_equal_copied_reads() {
    let path = tmp("mapped").join("sample.cma");
    let tensors = write_sample(&path);
    let a = Artifact::open(&path, &Limits::default()).unwrap();
    let raw = std::fs::read(&path).unwrap();
    let header_len = header_len(&raw);
    let data = &raw[8 + header_len..];
    let mut lossless = 0;
    for (name, _, _, bytes) in &tensors {
        match a.read_stored(name).unwrap() {
            compressme_artifact::Stored::Lossless(mapped) => {
                let e = a
                    .entries()
                    .iter()
                    .find(|e| e.name == compressme_artifact::blocks_name(name))
                    .unwrap();
                let copied = compressme_blockstore::BlockStore::from_bytes(
                    &data[e.begin as usize..e.end as usize],
                )
                .unwrap();
                assert_eq!(mapped.payload(), copied.payload(), "{name}");
                assert_eq!(mapped.index_digest(), copied.index_digest(), "{name}");
                let (m, c) = (mapped.decode_all().unwrap(), copied.decode_all().unwrap());
                assert!(m == c && m == *bytes, "{name}");
                lossless += 1;
            }
            compressme_artifact::Stored::Dense(b) => assert!(b == *bytes, "{name}"),
            compressme_artifact::Stored::Quantized(_) => {}
        }
    }
    assert_eq!(lossless, 2);
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
}

/// A file cut short after it was opened: a tensor past the new end is an error naming
/// it, whether it is read (16 KiB or less) or mapped; the tensors before the cut still read.
#[test]
fn a_file_cut_short_after_opening_is_an_error() {
    use compressme_artifact::SafetensorsFile;
    let d = tmp("cut-short");
    let path = d.join("m.safetensors");
    let (large, small) = (weights(16384, 3), weights(256, 4));
    let f32s = safetensors::Dtype::F32;
    // in the file in this order: the small tensor last
    safetensors::serialize_to_file(
        vec![
            (
                "a.large".to_string(),
                safetensors::tensor::TensorView::new(f32s, vec![16384], &large).unwrap(),
            ),
            (
                "b.small".to_string(),
                safetensors::tensor::TensorView::new(f32s, vec![256], &small).unwrap(),
            ),
        ],
        None,
        &path,
    )
    .unwrap();
    let f = SafetensorsFile::open(&path, &Limits::default()).unwrap();
    let entry = |n: &str| f.entry(n).unwrap().clone();
    assert!(*f.map(&entry("a.large")).unwrap() == *large);
    assert!(*f.map(&entry("b.small")).unwrap() == *small);
    let len = std::fs::metadata(&path).unwrap().len();
    let cut = |to: u64| {
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(to)
            .unwrap();
    };
    cut(len - 8);
    let e = f.map(&entry("b.small")).unwrap_err().to_string();
    assert!(e.contains("b.small") && e.contains("past the end"), "{e}");
    assert!(*f.map(&entry("a.large")).unwrap() == *large);
    cut(len - small.len() as u64 - 8);
    let e = f.map(&entry("a.large")).unwrap_err().to_string();
    assert!(e.contains("a.large") && e.contains("past the end"), "{e}");
    std::fs::remove_dir_all(&d).unwrap();
}

/// A writer that reserves the header's room writes each payload once, straight into the
/// artifact: with the room `header_room` gives, the header is padded into it; with too
/// little room, the payloads move up. Either way the file opens, verifies and holds the
/// same payload bytes as the plain writer's.
#[test]
fn a_reserved_header_room_gives_the_same_artifact_padded() {
    let d = tmp("room");
    let plain = d.join("plain.cma");
    let tensors = write_sample(&plain);
    let plain_art = Artifact::open(&plain, &Limits::default()).unwrap();
    let storage = |name: &str| {
        let t = plain_art.tensor(name).unwrap();
        match &t.storage {
            compressme_artifact::StorageRecipe::Dense => Storage::Dense,
            compressme_artifact::StorageRecipe::Lossless {
                block_rows,
                row_index,
                ..
            } => Storage::Lossless {
                block_rows: *block_rows,
                coder: compressme_blockstore::Coder::default(),
                row_index: *row_index,
                digest: WholeDigest::default(),
            },
            compressme_artifact::StorageRecipe::Quant { format, .. } => Storage::Quantized {
                format: compressme_quant::Format::parse(format).unwrap(),
                importance: Vec::new(),
            },
        }
    };
    let plain_bytes = std::fs::read(&plain).unwrap();
    let data_of = |b: &[u8]| b[8 + header_len(b)..].to_vec();
    for room in [None, Some(16u64)] {
        let path = d.join(format!("room-{room:?}.cma"));
        let mut w = Writer::create(&path).unwrap();
        w.recipe_mut()
            .source_metadata
            .insert("format".into(), "pt".into());
        let storages: Vec<Storage> = tensors.iter().map(|(n, ..)| storage(n)).collect();
        let plan: Vec<(&str, Dtype, &[usize], &Storage)> = tensors
            .iter()
            .zip(&storages)
            .map(|((n, dt, s, _), st)| (n.as_str(), *dt, s.as_slice(), st))
            .collect();
        let bound = w.header_room(&plan).unwrap();
        w.reserve_header(room.unwrap_or(bound)).unwrap();
        // only before the first tensor
        assert!(w.reserve_header(bound).is_err());
        for ((name, dtype, shape, bytes), st) in tensors.iter().zip(&storages) {
            let input = compressme_artifact::Input::Borrowed(bytes);
            let p = Writer::prepare(name, *dtype, shape, input, st).unwrap();
            w.commit(p).unwrap();
        }
        w.finish().unwrap();
        let a = Artifact::open(&path, &Limits::default()).unwrap();
        a.verify().unwrap();
        assert_eq!(a.entries(), plain_art.entries());
        let got = std::fs::read(&path).unwrap();
        assert!(data_of(&got) == data_of(&plain_bytes), "{room:?}");
        let header_len = header_len(&got) as u64;
        match room {
            // the bound held: the header fills the room, the excess spaces
            None => {
                assert_eq!(header_len + 8, bound);
                let plain_header = plain_bytes.len() - data_of(&plain_bytes).len();
                assert!(
                    (bound as usize) < plain_header + 2048,
                    "{bound} {plain_header}"
                );
            }
            // too little room: moved up, the header as the plain writer's
            Some(_) => assert!(got == plain_bytes),
        }
    }
    std::fs::remove_dir_all(&d).unwrap();
}

/// `unpack` checks what it writes against the whole-tensor digests, not block by block:
/// a corrupt block (resealed or not) still fails it, naming the tensor, and nothing is
/// left at the destination; `verify` names the block.
#[test]
fn unpack_refuses_a_corrupt_block_and_leaves_nothing() {
    let d = tmp("unpack-corrupt");
    let good = d.join("good.cma");
    write_sample(&good);
    let raw = std::fs::read(&good).unwrap();
    let header_len = header_len(&raw);
    let a = Artifact::open(&good, &Limits::default()).unwrap();
    let e = a
        .entries()
        .iter()
        .find(|e| e.name == compressme_artifact::blocks_name("emb.weight"))
        .unwrap()
        .clone();
    // a byte in the last quarter of the blob: past the index, inside a block
    let at = 8 + header_len + (e.begin + (e.end - e.begin) * 7 / 8) as usize;
    let mut bad = raw.clone();
    bad[at] ^= 0x10;
    let bad_path = d.join("bad.cma");
    std::fs::write(&bad_path, &bad).unwrap();
    let mut b = Artifact::open(&bad_path, &Limits::default()).unwrap();
    let out = d.join("out.safetensors");
    let err = unpack(&mut b, &out, Durability::Cached, |_, _| {}).unwrap_err();
    assert!(err.to_string().contains("emb.weight"), "{err}");
    assert!(!out.exists());
    let left: Vec<_> = std::fs::read_dir(&d)
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.file_name())
        .collect();
    assert_eq!(left.len(), 2, "{left:?}");
    let v = b.verify().unwrap_err().to_string();
    assert!(v.contains("emb.weight") && v.contains("block"), "{v}");
    std::fs::remove_dir_all(&d).unwrap();
}

fn write_rans_sample(path: &Path) -> Sample {
    let tensors = vec![
        (
            "a.weight".to_string(),
            Dtype::F32,
            vec![96, 40],
            weights(96 * 40, 21),
        ),
        (
            "b.weight".to_string(),
            Dtype::Bf16,
            vec![80, 64],
            bf16(&weights(80 * 64, 22)),
        ),
    ];
    let mut w = Writer::create(path).unwrap();
    // as first written: the whole-tensor digests SHA-256 (artifact version 2)
    w.set_whole_digest(WholeDigest::Sha256);
    for (name, dtype, shape, bytes) in &tensors {
        w.add_lossless(
            name,
            *dtype,
            shape,
            bytes,
            32,
            Coder::SharedRans { max_tables: 4 },
        )
        .unwrap();
    }
    w.finish().unwrap();
    tensors
}

/// Lossless tensors in block store version 2 (rANS tables) inside artifact version 2, as
/// first written, stay readable forever, and today's writer still writes the same recipe
/// and payloads. Regenerate only with `COMPRESSME_BLESS=1` when the file is missing.
#[test]
fn frozen_rans_fixture() {
    let (a, tensors, fresh) = frozen_matches_today("rans.cma", write_rans_sample);
    let s = a.verify().unwrap();
    assert_eq!((s.tensors, s.lossless), (2, 2));
    let bytes = std::fs::read(fixture_dir(2).join("rans.cma")).unwrap();
    for (name, _, _, want) in &tensors {
        let t = a.recipe().tensors.iter().find(|t| &t.name == name).unwrap();
        let ok = matches!(&t.storage, compressme_artifact::StorageRecipe::Lossless { coder, .. } if coder == "rans");
        assert!(ok, "{:?}", t.storage);
        let (got, exact) = a.read_tensor(name).unwrap();
        assert!(exact);
        assert_eq!(&got, want, "{name}");
    }
    // both stores are block store version 2: "CMBLOCKS" then version 2
    let v2 = bytes
        .windows(10)
        .filter(|w| w == b"CMBLOCKS\x02\x00")
        .count();
    assert_eq!(v2, 2);
    std::fs::remove_dir_all(fresh.parent().unwrap()).unwrap();
}

#[test]
fn large_writes_are_whole_and_in_place() {
    // writes go to the kernel in pieces (`WRITE_CHUNK`, 256 KiB): appends and positioned
    // writes of several pieces and a part piece land byte for byte where they belong
    let d = tmp("chunks");
    let dest = d.join("out.bin");
    let a = weights(700_001, 3); // 2.8 MB: ten pieces and a part one
    let b = weights(300_000, 4);
    let mut f = compressme_artifact::AtomicFile::create(&dest).unwrap();
    f.write_all(&a[..5]).unwrap();
    f.write_all(&a[5..]).unwrap();
    // past the end (the file grows), then over the middle of what was appended
    let end = a.len() as u64;
    f.write_all_at(end + 3, &b).unwrap();
    f.write_all_at(1_000_003, &b).unwrap();
    f.commit().unwrap();
    let got = std::fs::read(&dest).unwrap();
    let mut want = a.clone();
    want.extend_from_slice(&[0, 0, 0]);
    want.extend_from_slice(&b);
    want[1_000_003..1_000_003 + b.len()].copy_from_slice(&b);
    assert_eq!(got.len(), want.len());
    assert!(got == want, "the file differs from what was written");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn dropping_written_ranges_from_the_cache_loses_nothing() {
    // `unpack`'s output: ranges written at their offsets, out of order as its lanes write
    // them, and everything more than 128 MiB behind waited on and dropped from the page
    // cache as the file grows; the file still holds every byte where it was written
    let d = tmp("drop-behind");
    let dest = d.join("out.bin");
    let piece: usize = 1 << 20;
    let pieces = 200; // 200 MiB: past `KEEP_BEHIND`, so ranges are dropped
    let mut f = compressme_artifact::AtomicFile::create(&dest).unwrap();
    f.set_drop_behind();
    f.write_all(b"head").unwrap();
    let fill = |i: usize| -> Vec<u8> {
        (0..piece)
            .map(|j| (i.wrapping_mul(31) ^ j.wrapping_mul(7)) as u8)
            .collect()
    };
    // four lanes, each through its own quarter of the file
    let quarter = pieces / 4;
    for step in 0..quarter {
        for lane in 0..4 {
            let i = lane * quarter + step;
            f.write_all_at(4 + (i * piece) as u64, &fill(i)).unwrap();
        }
    }
    f.commit().unwrap();
    let got = std::fs::read(&dest).unwrap();
    assert_eq!(got.len(), 4 + pieces * piece);
    assert_eq!(&got[..4], b"head");
    for i in 0..pieces {
        let at = 4 + i * piece;
        assert!(got[at..at + piece] == fill(i)[..], "piece {i} differs");
    }
    std::fs::remove_dir_all(&d).unwrap();
}

/// A safetensors file written by hand the way other tools write them: tensors in an order
/// of their own (not by name), `__metadata__` first, the header padded with spaces to
/// `pad` (8 as the safetensors crate does; 1 for none). Returns its bytes.
fn foreign_safetensors(pad: usize) -> Vec<u8> {
    let tensors: Vec<(&str, &str, Vec<usize>, Vec<u8>)> = vec![
        (
            "position_ids",
            "I64",
            vec![1, 16],
            (0i64..16).flat_map(i64::to_le_bytes).collect(),
        ),
        ("z.weight", "F32", vec![64, 48], weights(64 * 48, 11)),
        ("a.bias", "F32", vec![5], weights(5, 12)),
        (
            "m.weight",
            "BF16",
            vec![40, 64],
            bf16(&weights(40 * 64, 13)),
        ),
    ];
    let mut json = String::from(r#"{"__metadata__":{"format":"pt","note":"made by hand"}"#);
    let mut at = 0;
    for (name, dtype, shape, bytes) in &tensors {
        let end = at + bytes.len();
        json.push_str(&format!(
            r#","{name}":{{"dtype":"{dtype}","shape":{shape:?},"data_offsets":[{at},{end}]}}"#
        ));
        at = end;
    }
    json.push('}');
    while !json.len().is_multiple_of(pad) {
        json.push(' ');
    }
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(json.as_bytes());
    for (_, _, _, bytes) in &tensors {
        out.extend_from_slice(bytes);
    }
    out
}

/// Packs the one-file checkpoint at `src` into `dest` as `compressme pack --lossless`
/// does: floats in row blocks, the rest dense, the source header recorded (version 3
/// with SHA-256 whole-tensor digests, version 4 with XXH3-128).
fn pack_recording_header(src: &Path, dest: &Path, digest: WholeDigest) {
    let c = compressme_artifact::Checkpoint::open(src, &Limits::default()).unwrap();
    let mut w = Writer::create(dest).unwrap();
    w.set_whole_digest(digest);
    w.recipe_mut().source_metadata = c.metadata().clone();
    w.set_source_header(c.source_header().unwrap()).unwrap();
    for e in c.entries() {
        let bytes = c.read(&e.name).unwrap();
        if e.dtype.is_float() {
            w.add_lossless(&e.name, e.dtype, &e.shape, &bytes, 16, Coder::default())
                .unwrap();
        } else {
            w.add_dense(&e.name, e.dtype, &e.shape, &bytes).unwrap();
        }
    }
    w.finish().unwrap();
}

/// Version 3: a one-file checkpoint in another tool's tensor order, header padded or not,
/// unpacks to the same file, byte for byte; before version 3 (no header recorded) the
/// tensors are the same but the file is not.
#[test]
fn version_3_unpacks_the_source_file_byte_for_byte() {
    let d = tmp("v3-exact");
    for pad in [8, 1] {
        let src = d.join(format!("src{pad}.safetensors"));
        let original = foreign_safetensors(pad);
        assert_eq!(header_len(&original).is_multiple_of(8), pad == 8);
        std::fs::write(&src, &original).unwrap();
        let art = d.join(format!("a{pad}.cma"));
        pack_recording_header(&src, &art, WholeDigest::Sha256);
        let mut a = Artifact::open(&art, &Limits::default()).unwrap();
        assert_eq!(a.recipe().version, 3);
        assert_eq!(
            a.source_header(),
            Some(&original[8..8 + header_len(&original)])
        );
        let back = d.join(format!("back{pad}.safetensors"));
        unpack(&mut a, &back, Durability::Cached, |_, _| {}).unwrap();
        assert!(std::fs::read(&back).unwrap() == original, "pad {pad}");
    }
    // the same tensors without the header recorded: version 2, tensors in name order
    let c = compressme_artifact::Checkpoint::open(&d.join("src8.safetensors"), &Limits::default())
        .unwrap();
    let art = d.join("v2.cma");
    let mut w = Writer::create(&art).unwrap();
    for e in c.entries() {
        w.add_dense(&e.name, e.dtype, &e.shape, &c.read(&e.name).unwrap())
            .unwrap();
    }
    w.finish().unwrap();
    let mut a = Artifact::open(&art, &Limits::default()).unwrap();
    assert_eq!((a.recipe().version, a.source_header()), (2, None));
    let back = d.join("v2.safetensors");
    unpack(&mut a, &back, Durability::Cached, |_, _| {}).unwrap();
    let (got, want) = (std::fs::read(&back).unwrap(), foreign_safetensors(8));
    assert!(got != want, "a version-2 unpack writes its own header");
    let again = compressme_artifact::Checkpoint::open(&back, &Limits::default()).unwrap();
    for e in c.entries() {
        assert!(
            again.read(&e.name).unwrap() == c.read(&e.name).unwrap(),
            "{}",
            e.name
        );
    }
    std::fs::remove_dir_all(&d).unwrap();
}

/// The writer refuses a source header that does not describe the tensors added (one
/// missing, one of another shape, one not in the header, a header that is not JSON): its
/// reopening check, a reader's, fails and nothing is left behind.
#[test]
fn a_source_header_must_describe_the_tensors() {
    let d = tmp("v3-mismatch");
    let src = d.join("src.safetensors");
    std::fs::write(&src, foreign_safetensors(8)).unwrap();
    let c = compressme_artifact::Checkpoint::open(&src, &Limits::default()).unwrap();
    let header = c.source_header().unwrap().to_vec();
    let write = |skip: Option<&str>, reshape: Option<&str>, extra: bool| {
        let dest = d.join("x.cma");
        let mut w = Writer::create(&dest).unwrap();
        w.set_source_header(&header).unwrap();
        for e in c.entries() {
            if Some(e.name.as_str()) == skip {
                continue;
            }
            let mut shape = e.shape.clone();
            if Some(e.name.as_str()) == reshape {
                shape.reverse();
            }
            w.add_dense(&e.name, e.dtype, &shape, &c.read(&e.name).unwrap())
                .unwrap();
        }
        if extra {
            w.add_dense("extra", Dtype::U8, &[3], &[1, 2, 3]).unwrap();
        }
        let r = w.finish();
        if r.is_err() {
            let left: Vec<_> = std::fs::read_dir(&d)
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            assert_eq!(
                left,
                ["src.safetensors"],
                "nothing is left behind on refusal"
            );
        }
        r
    };
    for (skip, reshape, extra) in [
        (Some("a.bias"), None, false),
        (None, Some("z.weight"), false),
        (None, None, true),
    ] {
        let e = write(skip, reshape, extra);
        assert!(matches!(e, Err(Error::Recipe { .. })), "{e:?}");
    }
    assert!(write(None, None, false).is_ok());
    let dest = d.join("y.cma");
    let mut w = Writer::create(&dest).unwrap();
    assert!(matches!(
        w.set_source_header(&[0xff, 0xfe]),
        Err(Error::Invalid { .. })
    ));
    w.set_source_header(b"not json").unwrap();
    w.add_dense("a", Dtype::U8, &[1], &[0]).unwrap();
    assert!(matches!(w.finish(), Err(Error::Recipe { .. })));
    assert!(!dest.exists());
    std::fs::remove_dir_all(&d).unwrap();
}

/// `bytes` with `from` replaced by `to` (the same length) once, inside the header.
fn replace_in_header(bytes: &[u8], from: &str, to: &str) -> Vec<u8> {
    assert_eq!(from.len(), to.len());
    let n = header_len(bytes);
    let text = std::str::from_utf8(&bytes[8..8 + n]).unwrap();
    assert!(text.contains(from), "{from} not in the header");
    let mut out = bytes[..8].to_vec();
    out.extend_from_slice(text.replacen(from, to, 1).as_bytes());
    out.extend_from_slice(&bytes[8 + n..]);
    out
}

/// The artifact's own header rewritten with its recipe re-sealed after `edit`: a file an
/// attacker made consistent everywhere but where `edit` put a lie.
fn reseal_metadata(
    bytes: &[u8],
    edit: impl Fn(&mut serde_json::Map<String, serde_json::Value>),
) -> Vec<u8> {
    use compressme_artifact::recipe::{RECIPE_KEY, RECIPE_SHA_KEY, sha256_hex};
    let n = header_len(bytes);
    let mut header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let md = header
        .get_mut("__metadata__")
        .unwrap()
        .as_object_mut()
        .unwrap();
    edit(md);
    let recipe = md[RECIPE_KEY].as_str().unwrap().to_string();
    md.insert(RECIPE_SHA_KEY.into(), sha256_hex(recipe.as_bytes()).into());
    let mut text = serde_json::to_string(&header).unwrap();
    while !text.len().is_multiple_of(8) {
        text.push(' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    out.extend_from_slice(&bytes[8 + n..]);
    out
}

/// A reader refuses a version-3 file whose source header was changed, is missing, or
/// names other tensors, and a version-2 file that carries one.
#[test]
fn a_tampered_source_header_is_refused() {
    use compressme_artifact::recipe::{RECIPE_KEY, SOURCE_HEADER_KEY, sha256_hex};
    let d = tmp("v3-tamper");
    let src = d.join("src.safetensors");
    std::fs::write(&src, foreign_safetensors(8)).unwrap();
    let art = d.join("a.cma");
    pack_recording_header(&src, &art, WholeDigest::Sha256);
    let good = std::fs::read(&art).unwrap();
    let open = |bytes: &[u8]| {
        let p = d.join("t.cma");
        std::fs::write(&p, bytes).unwrap();
        Artifact::open(&p, &Limits::default())
    };
    assert!(open(&good).is_ok());
    // one digit of an offset inside the recorded header: its digest no longer matches
    let e = open(&replace_in_header(&good, "[0,128]", "[0,129]"));
    assert!(matches!(e, Err(Error::Digest { .. })), "{e:?}");
    // the header gone
    let e = open(&reseal_metadata(&good, |md| {
        md.remove(SOURCE_HEADER_KEY);
    }));
    assert!(matches!(e, Err(Error::Recipe { .. })), "{e:?}");
    // a header re-sealed in the recipe but naming a tensor the recipe does not have
    let e = open(&reseal_metadata(&good, |md| {
        let text = md[SOURCE_HEADER_KEY]
            .as_str()
            .unwrap()
            .replacen("a.bias", "b.bias", 1);
        let recipe = md[RECIPE_KEY].as_str().unwrap().replacen(
            &sha256_hex(md[SOURCE_HEADER_KEY].as_str().unwrap().as_bytes()),
            &sha256_hex(text.as_bytes()),
            1,
        );
        md.insert(SOURCE_HEADER_KEY.into(), text.into());
        md.insert(RECIPE_KEY.into(), recipe.into());
    }));
    assert!(matches!(e, Err(Error::Recipe { .. })), "{e:?}");
    // version 2 with a source header
    let e = open(&reseal_metadata(&good, |md| {
        md.insert("compressme.version".into(), "2".into());
        let recipe = md[RECIPE_KEY]
            .as_str()
            .unwrap()
            .replacen("\"version\":3", "\"version\":2", 1);
        md.insert(RECIPE_KEY.into(), recipe.into());
    }));
    assert!(matches!(e, Err(Error::Recipe { .. })), "{e:?}");
    std::fs::remove_dir_all(&d).unwrap();
}

/// Version 3's frozen files: `source.safetensors` (a checkpoint in another tool's order),
/// `sample.cma` packed from it, and corrupt variants. The sample opens, verifies and
/// unpacks to the source byte for byte, and today's writer gives the same recipe.
/// Written only when missing, under `COMPRESSME_BLESS=1`.
#[test]
fn frozen_v3_fixtures() {
    let dir = fixture_dir(3);
    let (src, sample) = (dir.join("source.safetensors"), dir.join("sample.cma"));
    if std::env::var_os("COMPRESSME_BLESS").is_some() && !sample.exists() {
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(&src, foreign_safetensors(8)).unwrap();
        pack_recording_header(&src, &sample, WholeDigest::Sha256);
        let good = std::fs::read(&sample).unwrap();
        std::fs::write(
            dir.join("flipped_source_header.cma"),
            replace_in_header(&good, "[0,128]", "[0,129]"),
        )
        .unwrap();
        std::fs::write(dir.join("truncated.cma"), &good[..good.len() - 1]).unwrap();
        std::fs::write(
            dir.join("bad_version.cma"),
            replace_in_header(
                &good,
                "\"compressme.version\":\"3\"",
                "\"compressme.version\":\"9\"",
            ),
        )
        .unwrap();
    }
    let original = std::fs::read(&src).unwrap();
    assert!(
        original == foreign_safetensors(8),
        "the frozen source changed"
    );
    let mut a = Artifact::open(&sample, &Limits::default()).unwrap();
    assert_eq!(a.recipe().version, 3);
    let s = a.verify().unwrap();
    // `a.bias` (20 bytes) stays dense: a block store would not be smaller
    assert_eq!((s.tensors, s.lossless, s.dense), (4, 2, 2));
    let d = tmp("fixture-v3");
    let back = d.join("back.safetensors");
    unpack(&mut a, &back, Durability::Cached, |_, _| {}).unwrap();
    assert!(std::fs::read(&back).unwrap() == original);
    let fresh = d.join("fresh.cma");
    pack_recording_header(&src, &fresh, WholeDigest::Sha256);
    let today = Artifact::open(&fresh, &Limits::default()).unwrap();
    same_recipe_but_unused_tables(&a, &today);
    same_entries_but_unused_tables(&a, &today);
    let open = |f: &str| Artifact::open(&dir.join(f), &Limits::default());
    let e = open("flipped_source_header.cma");
    assert!(matches!(e, Err(Error::Digest { .. })), "{e:?}");
    let e = open("truncated.cma");
    assert!(matches!(e, Err(Error::NotSafetensors { .. })), "{e:?}");
    let e = open("bad_version.cma");
    assert!(matches!(e, Err(Error::UnsupportedVersion { .. })), "{e:?}");
    std::fs::remove_dir_all(&d).unwrap();
}

/// Tensors larger than a streaming piece, written with smaller ones: `verify` and `unpack`
/// read the large ones side by side in lanes and the small ones four at a time
/// (`read/lanes.rs`). Returns the tensors as written.
fn write_lanes_sample(
    path: &Path,
    digest: WholeDigest,
) -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)> {
    let cols = 256;
    let piece_rows = compressme_artifact::STREAM_PIECE / (cols * 4);
    let mut tensors = Vec::new();
    // five tensors over a piece, of different lengths (so lanes end at different rounds)
    for (i, extra) in [100usize, 400, 900, 3, 2000].into_iter().enumerate() {
        let rows = piece_rows + extra;
        tensors.push((
            format!("large.{i}.weight"),
            Dtype::F32,
            vec![rows, cols],
            weights(rows * cols, 40 + i as u64),
        ));
    }
    // one under a piece but over the 512 KiB a small tensor streams by (version 4): read
    // in several pieces
    let rows = piece_rows / 2 + 37;
    tensors.push((
        "medium.weight".to_string(),
        Dtype::F32,
        vec![rows, cols],
        weights(rows * cols, 50),
    ));
    for i in 0..6 {
        tensors.push((
            format!("small.{i}.weight"),
            Dtype::F32,
            vec![30 + 17 * i, 64],
            weights((30 + 17 * i) * 64, 60 + i as u64),
        ));
    }
    tensors.push((
        "ids".to_string(),
        Dtype::I64,
        vec![40],
        (0i64..40).flat_map(i64::to_le_bytes).collect(),
    ));
    let mut w = Writer::create(path).unwrap();
    w.set_whole_digest(digest);
    for (name, dtype, shape, bytes) in &tensors {
        if name == "ids" {
            w.add_dense(name, *dtype, shape, bytes).unwrap();
        } else {
            w.add_lossless(name, *dtype, shape, bytes, 16, Coder::default())
                .unwrap();
        }
    }
    w.finish().unwrap();
    tensors
}

/// A byte inside tensor `name`'s blocks (past its block store's index) flipped.
fn flip_in_blocks(raw: &mut [u8], a: &Artifact, name: &str) {
    let e = a
        .entries()
        .iter()
        .find(|e| e.name == compressme_artifact::blocks_name(name))
        .unwrap()
        .clone();
    let at = 8 + header_len(raw) + (e.begin + (e.end - e.begin) * 7 / 8) as usize;
    raw[at] ^= 0x10;
}

/// Both kinds of whole-tensor digest: SHA-256s (version 2) hashed in lockstep, XXH3-128s
/// (version 4) lane by lane, and a small tensor's streamed a piece at a time.
#[test]
fn tensors_read_side_by_side_give_the_same_bytes_on_any_thread_count() {
    lanes_case(WholeDigest::Sha256, "lanes-sha256");
    lanes_case(WholeDigest::Xxh3, "lanes-xxh3");
}

fn lanes_case(digest: WholeDigest, dir: &str) {
    let d = tmp(dir);
    let path = d.join("a.cma");
    let tensors = write_lanes_sample(&path, digest);
    let version = Artifact::open(&path, &Limits::default())
        .unwrap()
        .recipe()
        .version;
    assert_eq!(version, if digest == WholeDigest::Xxh3 { 4 } else { 2 });
    let pool = |n: usize| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .unwrap()
    };
    let mut outs = Vec::new();
    for threads in [1, 2, 3] {
        let mut a = Artifact::open(&path, &Limits::default()).unwrap();
        let mut want: Vec<(String, u64)> = tensors
            .iter()
            .map(|t| (t.0.clone(), t.3.len() as u64))
            .collect();
        want.sort();
        for stored in [false, true] {
            let mut seen = Vec::new();
            // from this thread, not a pool's: `check_stored` runs on `pipeline::ordered_light`,
            // whose calling thread waits on results
            let progress = |name: &str, n: u64| seen.push((name.to_string(), n));
            let s = if stored {
                a.check_stored_with(progress)
            } else {
                a.verify_with(progress)
            }
            .unwrap();
            assert_eq!((s.tensors, s.lossless, s.dense), (13, 12, 1));
            seen.sort();
            assert_eq!(
                seen, want,
                "progress names every tensor once, with its bytes"
            );
        }
        let s = pool(threads).install(|| a.verify()).unwrap();
        assert_eq!((s.tensors, s.lossless, s.dense), (13, 12, 1));
        let out = d.join(format!("out{threads}.safetensors"));
        let mut seen = Vec::new();
        pool(threads)
            .install(|| {
                unpack(&mut a, &out, Durability::Cached, |name, _| {
                    seen.push(name.to_string());
                })
            })
            .unwrap();
        seen.sort();
        let mut want: Vec<String> = tensors.iter().map(|t| t.0.clone()).collect();
        want.sort();
        assert_eq!(seen, want, "progress names every tensor once");
        outs.push(std::fs::read(&out).unwrap());
    }
    assert!(
        outs[0] == outs[1] && outs[1] == outs[2],
        "output depends on the thread count"
    );
    let st = safetensors::SafeTensors::deserialize(&outs[0]).unwrap();
    for (name, _, shape, bytes) in &tensors {
        let v = st.tensor(name).unwrap();
        assert_eq!(v.shape(), shape.as_slice());
        assert!(v.data() == bytes.as_slice(), "{name}");
    }

    // a corrupt block in a large tensor, and one in a small tensor as well: the large
    // one is named, on every thread count (the first pass's failure comes first)
    let raw = std::fs::read(&path).unwrap();
    let a = Artifact::open(&path, &Limits::default()).unwrap();
    let mut one = raw.clone();
    flip_in_blocks(&mut one, &a, "large.2.weight");
    let mut both = one.clone();
    flip_in_blocks(&mut both, &a, "small.4.weight");
    let mut small = raw.clone();
    flip_in_blocks(&mut small, &a, "small.4.weight");
    // seven eighths of the way into its blocks: in a later piece than the first
    let mut medium = raw.clone();
    flip_in_blocks(&mut medium, &a, "medium.weight");
    for (bytes, named) in [
        (&one, "large.2.weight"),
        (&both, "large.2.weight"),
        (&small, "small.4.weight"),
        (&medium, "medium.weight"),
    ] {
        let bad = d.join("bad.cma");
        std::fs::write(&bad, bytes).unwrap();
        for threads in [1, 2] {
            let mut b = Artifact::open(&bad, &Limits::default()).unwrap();
            let v = pool(threads)
                .install(|| b.verify())
                .unwrap_err()
                .to_string();
            assert!(
                v.contains(named) && v.contains("block"),
                "{threads} threads: {v}"
            );
            let out = d.join("bad-out.safetensors");
            let e = pool(threads)
                .install(|| unpack(&mut b, &out, Durability::Cached, |_, _| {}))
                .unwrap_err()
                .to_string();
            assert!(e.contains(named), "{threads} threads: {e}");
            assert!(!out.exists());
        }
    }
    // the recipe re-sealed with a wrong whole-tensor digest for a large tensor (read in
    // lanes), a small one (read four at a time) and one a small tensor's pieces stream
    // (with XXH3): each named
    for name in ["large.2.weight", "small.4.weight", "medium.weight"] {
        let bad = d.join("bad-digest.cma");
        reseal(&path, &bad, |r| {
            let t = r.tensors.iter_mut().find(|t| t.name == name).unwrap();
            let field = match digest {
                WholeDigest::Xxh3 => t.xxh3_128.as_mut(),
                WholeDigest::Sha256 => t.sha256.as_mut(),
            };
            let hex = field.unwrap();
            let last = if hex.ends_with('0') { "1" } else { "0" };
            hex.replace_range(hex.len() - 1.., last);
        });
        let b = Artifact::open(&bad, &Limits::default()).unwrap();
        let e = b.verify();
        // the digest error, naming this tensor
        let named = match &e {
            Err(Error::Digest { tensor, .. }) => tensor == name,
            _ => false,
        };
        assert!(named, "{e:?}");
    }
    std::fs::remove_dir_all(&d).unwrap();
}

/// `Writer::prepare_many` (whole-tensor digests in lockstep) gives each tensor what
/// `Writer::prepare` gives it alone: the same file byte for byte, the same errors in the
/// same places, dense entries where blocks do not pay or a tensor is empty, and tensors of
/// unequal lengths (the lockstep runs past the shortest).
#[test]
fn preparing_many_lossless_tensors_gives_what_one_by_one_gives() {
    let d = tmp("prepare-many");
    let mut noise = 0x9e37_79b9_7f4a_7c15u64;
    let random: Vec<u8> = (0..32 * 16 * 4)
        .map(|_| {
            noise ^= noise << 13;
            noise ^= noise >> 7;
            noise ^= noise << 17;
            noise as u8
        })
        .collect();
    let tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = vec![
        ("a".into(), Dtype::F32, vec![64, 32], weights(64 * 32, 1)),
        (
            "b".into(),
            Dtype::Bf16,
            vec![16, 8],
            bf16(&weights(16 * 8, 3)),
        ),
        ("c".into(), Dtype::F32, vec![0, 4], Vec::new()),
        ("d".into(), Dtype::F32, vec![32, 16], random),
        ("e".into(), Dtype::F32, vec![3, 3], vec![0u8; 8]),
        ("cm.x".into(), Dtype::F32, vec![4, 4], weights(16, 2)),
        ("f".into(), Dtype::F32, vec![50, 24], weights(50 * 24, 5)),
        ("g".into(), Dtype::F32, vec![40, 256], weights(40 * 256, 7)),
    ];
    for storage in [
        Storage::Lossless {
            block_rows: 8,
            coder: Coder::default(),
            row_index: false,
            digest: WholeDigest::default(),
        },
        Storage::Dense,
    ] {
        let mut files = Vec::new();
        let mut errors = Vec::new();
        for many in [false, true] {
            let path = d.join(format!("many-{many}.cma"));
            let results: Vec<_> = if many {
                let input: Vec<_> = tensors
                    .iter()
                    .map(|(n, dt, s, b)| {
                        (
                            n.clone(),
                            *dt,
                            s.clone(),
                            compressme_artifact::Input::Borrowed(b),
                        )
                    })
                    .collect();
                Writer::prepare_many(input, &storage)
            } else {
                tensors
                    .iter()
                    .map(|(n, dt, s, b)| {
                        let input = compressme_artifact::Input::Borrowed(b);
                        Writer::prepare(n, *dt, s, input, &storage)
                    })
                    .collect()
            };
            assert_eq!(results.len(), tensors.len());
            let mut w = Writer::create(&path).unwrap();
            let mut errs = Vec::new();
            let mut kinds = Vec::new();
            for r in results {
                match r {
                    Ok(p) => kinds.push(w.commit(p).unwrap().storage),
                    Err(e) => errs.push(e.to_string()),
                }
            }
            w.finish().unwrap();
            Artifact::open(&path, &Limits::default())
                .unwrap()
                .verify()
                .unwrap();
            if matches!(storage, Storage::Lossless { .. }) {
                // the sample covers each way: coded, kept dense, refused
                assert!(kinds.iter().any(|k| k == "lossless"), "{kinds:?}");
                assert!(kinds.iter().any(|k| k == "dense"), "{kinds:?}");
            }
            files.push(std::fs::read(&path).unwrap());
            errors.push(errs);
        }
        assert_eq!(errors[0].len(), 2, "{:?}", errors[0]);
        assert_eq!(errors[0], errors[1]);
        assert!(files[0] == files[1], "{storage:?}");
    }
    std::fs::remove_dir_all(&d).unwrap();
}
