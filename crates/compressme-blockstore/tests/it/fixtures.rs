//! Frozen files of every format version: they must decode forever.
//! `COMPRESSME_BLESS=1 cargo test -p compressme-blockstore` writes them (only for a new version).

use std::path::PathBuf;

use compressme_blockstore::{BlockStore, Coder, EncodeOptions, Error, ValueKind};

use crate::{store, weights_f32};

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/blockstore/v1")
}

fn cases() -> Vec<(&'static str, Vec<u8>, BlockStore)> {
    let f32s = weights_f32(37, 12, 11);
    let bf16: Vec<u8> = f32s.chunks_exact(4).flat_map(|c| [c[2], c[3]]).collect();
    // small integers as f32: the two low mantissa bytes are zero, so those planes are constant
    let ints: Vec<u8> = (0..37 * 12)
        .flat_map(|i| ((i % 50) as f32).to_le_bytes())
        .collect();
    vec![
        (
            "f32_huffman.cmbs",
            f32s.clone(),
            store(&f32s, 37, 48, ValueKind::F32, 16, Coder::default()),
        ),
        (
            "bf16_huffman.cmbs",
            bf16.clone(),
            store(&bf16, 37, 24, ValueKind::Bf16, 4, Coder::default()),
        ),
        (
            "f32_zstd.cmbs",
            f32s.clone(),
            store(&f32s, 37, 48, ValueKind::F32, 16, Coder::Zstd { level: 3 }),
        ),
        (
            "f32_constant_planes.cmbs",
            ints.clone(),
            store(&ints, 37, 48, ValueKind::F32, 16, Coder::default()),
        ),
        (
            "f32_huffman_rows.cmbs",
            f32s.clone(),
            BlockStore::encode(
                &f32s,
                37,
                48,
                &EncodeOptions::new(ValueKind::F32)
                    .block_rows(8)
                    .row_index(true),
            )
            .unwrap(),
        ),
    ]
}

#[test]
fn v1_fixtures_decode_forever() {
    for (name, data, fresh) in cases() {
        let path = dir().join(name);
        if std::env::var_os("COMPRESSME_BLESS").is_some() {
            std::fs::create_dir_all(dir()).unwrap();
            std::fs::write(&path, fresh.to_bytes()).unwrap();
        }
        let frozen = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        decodes_and_refuses_its_corrupt_variant(name, &frozen, &data);
    }
}

/// A frozen store decodes to `data`, and with the last payload byte flipped (its corrupt
/// variant) it is refused, naming the last block.
fn decodes_and_refuses_its_corrupt_variant(name: &str, frozen: &[u8], data: &[u8]) {
    let s = BlockStore::from_bytes(frozen).unwrap();
    assert_eq!(s.decode_all().unwrap(), data, "{name}");
    let mut bad = frozen.to_vec();
    *bad.last_mut().unwrap() ^= 0x01;
    let last_block = s.num_blocks() - 1;
    let Err(Error::ChecksumMismatch { block, .. }) = BlockStore::from_bytes(&bad) else {
        panic!("{name}: the corrupt variant was accepted or misreported");
    };
    assert_eq!(block, last_block, "{name}");
}

/// Block store version 2 (a plane with rANS tables). Written only when a file is missing
/// and `COMPRESSME_BLESS=1`: a frozen file is never rewritten.
#[test]
fn v2_fixtures_decode_forever() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/blockstore/v2");
    let f32s = weights_f32(200, 32, 5);
    let bf16: Vec<u8> = f32s.chunks_exact(4).flat_map(|c| [c[2], c[3]]).collect();
    let rans = Coder::SharedRans { max_tables: 4 };
    let cases = [
        (
            "f32_rans.cmbs",
            f32s.clone(),
            store(&f32s, 200, 128, ValueKind::F32, 64, rans),
        ),
        (
            "bf16_rans.cmbs",
            bf16.clone(),
            store(&bf16, 200, 64, ValueKind::Bf16, 64, rans),
        ),
    ];
    for (name, data, fresh) in cases {
        let path = dir.join(name);
        if !path.exists() && std::env::var_os("COMPRESSME_BLESS").is_some() {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(&path, fresh.to_bytes()).unwrap();
        }
        let frozen = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_eq!(
            &frozen[8..10],
            &2u16.to_le_bytes(),
            "{name} is a version 2 store"
        );
        // today's encoder writes the same blocks; since 2026-12-02 it leaves out the
        // Huffman tables no block is coded with (128 bytes each), which the frozen file
        // still carries, so only the table section may be smaller
        let old = BlockStore::from_bytes(&frozen).unwrap();
        let (a, b) = (fresh.stored_bytes(), old.stored_bytes());
        assert_eq!(
            (a.header, a.offsets, a.digests, a.payload),
            (b.header, b.offsets, b.digests, b.payload),
            "{name}: the encoder's blocks changed"
        );
        assert!(a.tables <= b.tables, "{name}: more table bytes than before");
        assert_eq!(fresh.decode_all().unwrap(), data, "{name}");
        decodes_and_refuses_its_corrupt_variant(name, &frozen, &data);
    }
}
