use compressme_blockstore::{BlockStore, Coder, Error, ValueKind};
use proptest::prelude::*;
use sha2::{Digest, Sha256};

use crate::{store, weights_f32};

fn sample() -> (Vec<u8>, BlockStore) {
    let data = weights_f32(50, 8, 3);
    let s = store(&data, 50, 32, ValueKind::F32, 16, Coder::default());
    (data, s)
}

/// Where the digests and payload start in a serialized store (layout v1, see FORMAT.md).
fn regions(bytes: &[u8], planes: usize, blocks: usize) -> (usize, usize) {
    let mut pos = 32;
    for _ in 0..planes {
        let count = bytes[pos] as usize;
        pos += 1 + 128 * count;
    }
    let digests = pos + 4 * blocks;
    // the index digest (32 bytes) sits between the block digests and the payload
    (digests, digests + 32 * blocks + 32)
}

/// Rewrites every digest so the (tampered) payload passes its checksum: what a hostile
/// writer could do. Decoding must still fail cleanly, never panic.
fn reseal(bytes: &mut [u8], planes: usize, blocks: usize) {
    let (digests, payload) = regions(bytes, planes, blocks);
    let mut lens = Vec::new();
    for b in 0..blocks {
        let p = digests - 4 * blocks + 4 * b;
        lens.push(u32::from_le_bytes(bytes[p..p + 4].try_into().unwrap()) as usize);
    }
    let mut start = payload;
    for (b, len) in lens.into_iter().enumerate() {
        let d: [u8; 32] = Sha256::digest(&bytes[start..start + len]).into();
        bytes[digests + 32 * b..digests + 32 * (b + 1)].copy_from_slice(&d);
        start += len;
    }
    let index: [u8; 32] = Sha256::digest(&bytes[..payload - 32]).into();
    bytes[payload - 32..payload].copy_from_slice(&index);
}

#[test]
fn a_flipped_table_or_index_byte_is_caught() {
    let (_, s) = sample();
    let bytes = s.to_bytes();
    let (digests, payload) = regions(&bytes, 4, s.num_blocks());
    // a code table nibble, a block length, a block digest, the index digest itself
    for at in [33, digests - 4, digests + 5, payload - 1] {
        let mut bad = bytes.clone();
        bad[at] ^= 0x10;
        let err = BlockStore::from_bytes(&bad).unwrap_err();
        // refused because the index or a block is damaged (not, say, as an unknown version)
        use Error::{BadBlock, IndexChecksumMismatch, Malformed};
        let damaged = matches!(
            err,
            IndexChecksumMismatch { .. } | Malformed(_) | BadBlock { .. }
        );
        assert!(damaged, "byte {at}: {err}");
    }
    let mut bad = bytes.clone();
    bad[digests + 5] ^= 0x10;
    assert!(matches!(
        BlockStore::from_bytes(&bad),
        Err(Error::IndexChecksumMismatch { .. })
    ));
}

#[test]
fn flipped_payload_byte_names_the_block() {
    let (_, s) = sample();
    let bytes = s.to_bytes();
    let (_, payload) = regions(&bytes, 4, s.num_blocks());
    // a byte inside the second block
    let second = payload + (bytes.len() - payload) / 2;
    let mut bad = bytes.clone();
    bad[second] ^= 1;
    let err = BlockStore::from_bytes(&bad).unwrap_err();
    let Error::ChecksumMismatch {
        block,
        expected,
        actual,
    } = &err
    else {
        panic!("{err}")
    };
    assert!(*block == 1 || *block == 2, "{err}");
    assert_ne!(expected, actual);
    assert!(
        err.to_string()
            .starts_with(&format!("block {block} fails its SHA-256 check"))
    );
}

#[test]
fn a_shared_store_reads_in_place_and_checks_each_block_when_decoded() {
    let (data, s) = sample();
    let bytes = s.to_bytes();
    // read in place: the same rows, and always checked on decode
    let shared = BlockStore::from_shared(std::sync::Arc::new(bytes.clone())).unwrap();
    assert!(shared.verify_on_decode());
    assert_eq!(shared.decode_all().unwrap(), data);
    assert_eq!(shared.index_digest(), s.index_digest());
    // a flipped payload byte: loading checks only the index, the block fails when decoded
    let (_, payload) = regions(&bytes, 4, s.num_blocks());
    let mut bad = bytes.clone();
    bad[payload + 2] ^= 1;
    let mut lazy = BlockStore::from_shared(std::sync::Arc::new(bad.clone())).unwrap();
    // turning per-decode checks off does not skip the blocks never checked
    lazy.set_verify_on_decode(false);
    let mut out = vec![0u8; 32];
    let err = lazy.decode_rows(&[0], &mut out).unwrap_err();
    let Error::ChecksumMismatch { block: 0, .. } = err else {
        panic!("expected block 0's checksum to fail: {err}")
    };
    lazy.decode_rows(&[40], &mut out).unwrap();
    assert!(matches!(
        lazy.verify_all(),
        Err(Error::ChecksumMismatch { block: 0, .. })
    ));
    // and a flipped index byte is refused at load, as by `from_bytes`
    let mut bad_index = bytes;
    bad_index[40] ^= 1;
    assert!(BlockStore::from_shared(std::sync::Arc::new(bad_index)).is_err());
}

#[test]
fn verify_on_decode_catches_corruption_in_memory() {
    let (_, mut s) = sample();
    s.corrupt_payload_byte_for_tests(3);
    assert!(matches!(
        s.verify_all(),
        Err(Error::ChecksumMismatch { block: 0, .. })
    ));
    s.set_verify_on_decode(true);
    let mut out = vec![0u8; 32];
    let err = s.decode_rows(&[0], &mut out).unwrap_err();
    let first_block = matches!(err, Error::ChecksumMismatch { block: 0, .. });
    assert!(first_block, "{err}");
    // rows of other blocks still decode
    s.decode_rows(&[40], &mut out).unwrap();
}

#[test]
fn every_truncation_is_an_error() {
    let (_, s) = sample();
    let bytes = s.to_bytes();
    for len in 0..bytes.len() {
        assert!(
            BlockStore::from_bytes(&bytes[..len]).is_err(),
            "prefix of {len} bytes accepted"
        );
    }
    let mut longer = bytes.clone();
    longer.push(0);
    assert!(matches!(
        BlockStore::from_bytes(&longer),
        Err(Error::Malformed(_))
    ));
}

#[test]
fn header_fields_are_checked() {
    let (_, s) = sample();
    let bytes = s.to_bytes();
    let with = |at: usize, v: u8| {
        let mut b = bytes.clone();
        b[at] = v;
        BlockStore::from_bytes(&b).unwrap_err()
    };
    assert!(with(0, b'X').to_string().contains("bad magic"));
    assert!(matches!(
        with(8, 3),
        Error::UnsupportedVersion { found: 3, .. }
    ));
    // a version 1 store relabelled 2: its first table count is read as a table kind
    let relabelled = with(8, 2);
    let refused = !matches!(relabelled, Error::UnsupportedVersion { .. });
    assert!(refused, "{relabelled}");
    assert!(
        with(10, 99)
            .to_string()
            .contains("unknown value kind tag 99")
    );
    assert!(with(11, 1).to_string().contains("unknown flags"));
    // a row count claiming far more blocks than the bytes hold: refused before allocating
    // (before the index digest is even looked at)
    let mut huge = bytes.clone();
    huge[16..24].copy_from_slice(&(u64::MAX / 64).to_le_bytes());
    assert!(BlockStore::from_bytes(&huge).is_err());
}

proptest! {
    #[test]
    fn decode_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..2000)) {
        let _ = BlockStore::from_bytes(&bytes);
        let mut with_magic = compressme_blockstore::MAGIC.to_vec();
        with_magic.extend_from_slice(&[1, 0]);
        with_magic.extend_from_slice(&bytes);
        let _ = BlockStore::from_bytes(&with_magic);
    }

    /// Hostile code tables (incomplete, over-long, garbage) behind a valid index digest:
    /// loading or decoding may fail, but never panics or hangs.
    #[test]
    fn resealed_table_tampering_never_panics_or_hangs(flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8)) {
        let (_, s) = sample();
        let mut bytes = s.to_bytes();
        let (digests, payload) = regions(&bytes, 4, s.num_blocks());
        let tables_end = digests - 4 * s.num_blocks();
        // the table bytes: after each plane's count byte
        let mut table_bytes = Vec::new();
        let mut pos = 32;
        for _ in 0..4 {
            let count = bytes[pos] as usize;
            table_bytes.extend(pos + 1..pos + 1 + 128 * count);
            pos += 1 + 128 * count;
        }
        prop_assert_eq!(pos, tables_end);
        prop_assume!(!table_bytes.is_empty());
        for (at, v) in flips {
            bytes[table_bytes[at.index(table_bytes.len())]] = v;
        }
        let index: [u8; 32] = Sha256::digest(&bytes[..payload - 32]).into();
        bytes[payload - 32..payload].copy_from_slice(&index);
        if let Ok(t) = BlockStore::from_bytes(&bytes) {
            let _ = t.decode_all();
            let mut out = vec![0u8; 3 * 32];
            let _ = t.decode_rows(&[0, 17, 49], &mut out);
        }
    }

    #[test]
    fn resealed_tampering_never_panics(flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6)) {
        let (_, s) = sample();
        let mut bytes = s.to_bytes();
        let (_, payload) = regions(&bytes, 4, s.num_blocks());
        for (at, v) in flips {
            let i = payload + at.index(bytes.len() - payload);
            bytes[i] = v;
        }
        reseal(&mut bytes, 4, s.num_blocks());
        if let Ok(t) = BlockStore::from_bytes(&bytes) {
            let _ = t.decode_all();
            let mut out = vec![0u8; 3 * 32];
            let _ = t.decode_rows(&[0, 17, 49], &mut out);
        }
    }
}

/// A version 2 store (rANS planes): every flipped byte is refused by a digest, and with
/// block digests skipped the decoder returns an error or other bytes, never panics.
#[test]
fn rans_store_corruption_is_an_error_not_a_panic() {
    let data = weights_f32(96, 32, 8);
    let s = store(
        &data,
        96,
        128,
        ValueKind::F32,
        32,
        Coder::SharedRans { max_tables: 2 },
    );
    let bytes = s.to_bytes();
    assert_eq!(&bytes[8..10], &2u16.to_le_bytes(), "a version 2 store");
    let payload_start = bytes.len() - s.stored_bytes().payload as usize;
    let mut unchecked = 0;
    for i in 0..bytes.len() {
        let mut b = bytes.clone();
        b[i] ^= 0x24;
        assert!(
            BlockStore::from_bytes(&b).is_err(),
            "byte {i} flipped was accepted"
        );
        if i >= payload_start {
            let shared: compressme_blockstore::SharedBytes = std::sync::Arc::new(b);
            let mut lazy = BlockStore::from_shared(shared).unwrap();
            lazy.skip_block_digests();
            if lazy.decode_all().is_ok_and(|d| d == data) {
                unchecked += 1;
            }
        }
    }
    // without the digests, only flips in a Huffman stream's zero padding bits (which the
    // decoder does not check) give the data back; every rANS stream byte matters
    // (`rans::tests::damaged_streams_are_errors_not_panics`); the digests catch them all
    assert!(
        unchecked <= 2 * s.num_blocks(),
        "{unchecked} flips undetected"
    );
}

#[test]
fn verify_blocks_names_the_lowest_failing_block_of_its_range() {
    // 37 blocks of 2 rows: nine groups of four digests and one of one
    let data = weights_f32(74, 8, 5);
    let s = store(&data, 74, 32, ValueKind::F32, 2, Coder::default());
    assert_eq!(s.num_blocks(), 37);
    let bytes = s.to_bytes();
    let (digests, payload) = regions(&bytes, 4, 37);
    let mut starts = vec![payload];
    for b in 0..37 {
        let p = digests - 4 * 37 + 4 * b;
        let len = u32::from_le_bytes(bytes[p..p + 4].try_into().unwrap()) as usize;
        starts.push(starts[b] + len);
    }
    // two bad blocks: in one group of four, in neighbouring groups, far apart, the last
    // block alone, block 0
    for bad in [[5usize, 6], [4, 7], [3, 4], [9, 30], [36, 36], [0, 13]] {
        let mut flipped = bytes.clone();
        flipped[starts[bad[0]]] ^= 1;
        if bad[1] != bad[0] {
            flipped[starts[bad[1]]] ^= 1;
        }
        // read in place: loading checks the index digest only
        let st = BlockStore::from_shared(std::sync::Arc::new(flipped)).unwrap();
        let (lo, hi) = (bad[0].min(bad[1]), bad[0].max(bad[1]));
        let named = |r: Result<(), Error>| match r {
            Err(Error::ChecksumMismatch { block, .. }) => Some(block),
            Ok(()) => None,
            Err(e) => panic!("{bad:?}: {e}"),
        };
        assert_eq!(named(st.verify_all()), Some(lo), "{bad:?}");
        assert_eq!(named(st.verify_blocks(0..lo)), None, "{bad:?}");
        assert_eq!(named(st.verify_blocks(lo..37)), Some(lo), "{bad:?}");
        let after = (hi > lo).then_some(hi);
        assert_eq!(named(st.verify_blocks(lo + 1..37)), after, "{bad:?}");
        assert_eq!(named(st.verify_blocks(hi + 1..37)), None, "{bad:?}");
    }
    // a range past the last block is an error, not a pass
    assert!(s.verify_blocks(30..38).is_err());
    s.verify_blocks(0..37).unwrap();
    s.verify_blocks(5..5).unwrap();
}

/// `decode_blocks` prepares up to `BLOCKS_TOGETHER` blocks side by side and decodes their
/// rANS planes together: it gives the bytes, and on damaged blocks the first error, that
/// `decode_block` one block after another gives, whatever the range.
#[test]
fn blocks_decoded_together_give_what_one_by_one_gives() {
    use compressme_blockstore::BLOCKS_TOGETHER;
    let (rows, cols) = (40 * 16 + 5, 256);
    let data = weights_f32(rows, cols, 11);
    let s = store(
        &data,
        rows as u64,
        cols * 4,
        ValueKind::F32,
        16,
        Coder::default(),
    );
    let n = s.num_blocks();
    assert!(n > 2 * BLOCKS_TOGETHER);
    let bytes = s.to_bytes();
    let rb = cols * 4;
    let one_by_one = |st: &BlockStore, r: std::ops::Range<usize>| -> Result<Vec<u8>, String> {
        let mut dec = st.decoder();
        let mut out = Vec::new();
        for b in r {
            let mut buf = vec![0u8; ((b + 1) * 16).min(rows).saturating_sub(b * 16) * rb];
            dec.decode_block(b, &mut buf).map_err(|e| e.to_string())?;
            out.extend_from_slice(&buf);
        }
        Ok(out)
    };
    let together = |st: &BlockStore, r: std::ops::Range<usize>| -> Result<Vec<u8>, String> {
        let end_row = (r.end * 16).min(rows);
        let mut out = vec![0u8; (end_row - (r.start * 16).min(end_row)) * rb];
        st.decoder()
            .decode_blocks(r, &mut out)
            .map_err(|e| e.to_string())?;
        Ok(out)
    };
    for r in [
        0..n,
        1..n,
        3..17,
        5..6,
        n - 1..n,
        0..0,
        7..7 + BLOCKS_TOGETHER,
    ] {
        let got = together(&s, r.clone()).unwrap();
        let want = &data[(r.start * 16).min(rows) * rb..(r.end * 16).min(rows) * rb];
        let first = got.iter().zip(want).position(|(a, b)| a != b);
        assert!(
            got == want,
            "{r:?}: first difference at byte {first:?} (block {:?})",
            first.map(|i| i / (16 * rb))
        );
        assert!(got == one_by_one(&s, r.clone()).unwrap(), "{r:?}");
    }
    let mut out = vec![0u8; 3];
    assert!(matches!(
        s.decoder().decode_blocks(0..1, &mut out),
        Err(Error::InvalidInput(_))
    ));
    assert!(matches!(
        s.decoder().decode_blocks(n - 1..n + 1, &mut out),
        Err(Error::InvalidInput(_))
    ));
    // damage: with digests checked (the lowest bad block's digest is named) and skipped
    // (the decoder's own errors, or other bytes)
    let payload_start = bytes.len() - s.stored_bytes().payload as usize;
    let payload = bytes.len() - payload_start;
    let mut differing = 0;
    for (i, flips) in [
        vec![payload / 3],
        vec![payload / 2, payload / 2 + 900],
        vec![payload - 5],
        vec![10, payload / 4, payload / 4 + 1],
        vec![payload / 7, payload / 7 * 5],
    ]
    .into_iter()
    .enumerate()
    {
        let mut b = bytes.clone();
        for f in flips {
            b[payload_start + f] ^= 0x24 + i as u8;
        }
        let shared: compressme_blockstore::SharedBytes = std::sync::Arc::new(b);
        let checked = BlockStore::from_shared(shared.clone()).unwrap();
        let mut unchecked = BlockStore::from_shared(shared).unwrap();
        unchecked.skip_block_digests();
        for st in [&checked, &unchecked] {
            for r in [0..n, 2..n - 3] {
                let (a, b) = (together(st, r.clone()), one_by_one(st, r.clone()));
                assert!(
                    a == b,
                    "case {i}, {r:?}: {:?} against {:?}",
                    a.as_ref().err(),
                    b.as_ref().err()
                );
                differing += usize::from(
                    a.as_ref().ok()
                        != Some(&data[(r.start * 16) * rb..(r.end * 16).min(rows) * rb].to_vec()),
                );
            }
        }
    }
    assert!(
        differing >= 10,
        "the flips were noticed ({differing} of 20)"
    );
}
