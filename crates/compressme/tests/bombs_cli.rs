//! Decompression bombs: artifacts whose every seal is valid but whose one lossless tensor
//! claims far more than it stores (every byte plane of every block constant, 8 bytes a
//! block). `inspect` shows them with a warning; `verify` and `unpack` refuse them before
//! decoding, quickly and in little memory; with the limit raised, `verify` decodes a
//! piece at a time. One test in this binary, so the children's peak memory is its own.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, missing_docs)] // tests
// one call to getrusage, for the children's peak memory (std has no safe way to read it)
#![allow(unsafe_code)]

#[allow(dead_code)] // each test binary uses part of the shared helpers
mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use common::{Scratch, run};

use compressme::artifact::recipe::{
    FORMAT_KEY, FORMAT_NAME, RECIPE_KEY, RECIPE_SHA_KEY, Recipe, StorageRecipe, TensorRecipe,
    VERSION, VERSION_KEY, sha256_hex,
};
use compressme::artifact::{Dtype, Planned, header_bytes};
use sha2::{Digest, Sha256};

fn tmp(name: &str) -> Scratch {
    Scratch::new(&format!("cm-bombs-{name}"))
}

/// A block store of f32 rows (value kind tag 1) whose every block has all four byte
/// planes constant 0, sealed as the format says: block digests over each block's
/// bytes, the index digest (returned, in hex, for the recipe) over everything before the
/// payload.
fn constant_store(rows: u64, cols: u64, block_rows: u32) -> (Vec<u8>, String) {
    let nb = rows.div_ceil(u64::from(block_rows)) as usize;
    let block = [1u8, 0, 1, 0, 1, 0, 1, 0]; // (constant, 0) for each plane
    let mut b = Vec::new();
    b.extend_from_slice(b"CMBLOCKS");
    b.extend_from_slice(&1u16.to_le_bytes());
    b.extend_from_slice(&[1, 0]); // f32, no flags
    b.extend_from_slice(&block_rows.to_le_bytes());
    b.extend_from_slice(&rows.to_le_bytes());
    b.extend_from_slice(&(cols * 4).to_le_bytes());
    b.extend_from_slice(&[0, 0, 0, 0]); // no shared tables for any plane
    for _ in 0..nb {
        b.extend_from_slice(&(block.len() as u32).to_le_bytes());
    }
    let digest: [u8; 32] = Sha256::digest(block).into();
    for _ in 0..nb {
        b.extend_from_slice(&digest);
    }
    let index: [u8; 32] = Sha256::digest(&b).into();
    b.extend_from_slice(&index);
    for _ in 0..nb {
        b.extend_from_slice(&block);
    }
    (b, compressme_blockstore::hex(&index))
}

/// An artifact holding one such tensor `w` `[rows, cols]` f32, every seal valid (the
/// whole-tensor digest is that of all-zero bytes, computed only when `zero_digest`).
fn bomb(path: &Path, rows: u64, cols: u64, block_rows: u32, zero_digest: bool) -> u64 {
    let (store, index) = constant_store(rows, cols, block_rows);
    let dense = rows * cols * 4;
    let sha = if zero_digest {
        let mut h = Sha256::new();
        let zeros = vec![0u8; 1 << 20];
        for _ in 0..dense / (1 << 20) {
            h.update(&zeros);
        }
        compressme_blockstore::hex(&h.finalize())
    } else {
        "0".repeat(64)
    };
    let recipe = Recipe {
        format: FORMAT_NAME.into(),
        version: VERSION,
        tool: "a test".into(),
        tensors: vec![TensorRecipe {
            name: "w".into(),
            dtype: "F32".into(),
            shape: vec![rows as usize, cols as usize],
            sha256: Some(sha),
            xxh3_128: None,
            storage: StorageRecipe::Lossless {
                block_rows: block_rows as usize,
                rows,
                row_bytes: cols * 4,
                coder: "huffman".into(),
                row_index: false,
                element_size: 4,
                block_sha256: Vec::new(),
                index_sha256: Some(index),
            },
        }],
        output_head_policy: None,
        plan_sha256: None,
        calibration_sha256: None,
        tokenizer_sha256: None,
        source_metadata: BTreeMap::new(),
        source_header_sha256: None,
    };
    let json = serde_json::to_string(&recipe).unwrap();
    let mut md = BTreeMap::new();
    md.insert(FORMAT_KEY.to_string(), FORMAT_NAME.to_string());
    md.insert(VERSION_KEY.to_string(), VERSION.to_string());
    md.insert(RECIPE_SHA_KEY.to_string(), sha256_hex(json.as_bytes()));
    md.insert(RECIPE_KEY.to_string(), json);
    let planned = [Planned {
        name: "cm.blocks/w".into(),
        dtype: Dtype::U8,
        shape: vec![store.len()],
        len: store.len() as u64,
    }];
    let mut file = header_bytes(&planned, &md).unwrap();
    file.extend_from_slice(&store);
    std::fs::write(path, &file).unwrap();
    file.len() as u64
}

/// The largest resident set of any child this process has waited for, bytes.
fn children_peak_rss() -> u64 {
    // SAFETY: getrusage writes one `rusage` into the zeroed struct we own.
    let mut r: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to that struct.
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut r) }, 0);
    r.ru_maxrss as u64 * 1024
}

#[test]
fn decompression_bombs_are_refused_before_decoding() {
    let d = tmp("bombs");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    // 1 TiB in 4,096 blocks of 1,024 rows (the report's 463 KB file)
    let tib = d.join("tib.cma");
    let size = bomb(&tib, 4_194_304, 65_536, 1024, false);
    assert!(size < 500_000, "{size}");
    // 8 GiB in 32 blocks: a few KB
    let gib8 = d.join("gib8.cma");
    let size = bomb(&gib8, 32_768, 65_536, 1024, false);
    assert!(size < 5_000, "{size}");

    // inspect reads no payload: it shows the file and warns
    let (ok, out, err) = run(&["inspect", &s(&tib)]);
    assert!(ok, "{err}");
    assert!(out.contains("1099511627776"), "{out}");
    assert!(err.contains("decompression bomb looks like this"), "{err}");
    assert!(
        err.contains("`verify` and `unpack` refuse this file"),
        "{err}"
    );

    for (file, why) in [
        (
            &tib,
            "tensor `w` decoded is 1099511627776 bytes, over the bound",
        ),
        (&gib8, "decodes to 8589934592 bytes from"),
    ] {
        for cmd in ["verify", "unpack"] {
            let out_file = d.join("out.safetensors");
            let t = Instant::now();
            let (ok, _, err) = if cmd == "verify" {
                run(&[cmd, &s(file)])
            } else {
                run(&[cmd, &s(file), "-o", &s(&out_file)])
            };
            let took = t.elapsed();
            assert!(!ok, "{cmd} {} succeeded", file.display());
            assert!(err.contains(why), "{cmd}: {err}");
            eprintln!("{cmd} {}: {took:?}: {}", file.display(), err.trim());
            assert!(took < Duration::from_secs(1), "{cmd} took {took:?}");
            assert!(!out_file.exists(), "{cmd} left an output");
            assert_eq!(
                std::fs::read_dir(&d).unwrap().count(),
                2,
                "{cmd} left a file behind"
            );
        }
    }
    let peak = children_peak_rss();
    assert!(peak < 64 << 20, "a child peaked at {peak} bytes");

    // a tighter service limit refuses a smaller claim too
    let small = d.join("small.cma");
    bomb(&small, 4096, 16_384, 256, true); // 256 MiB, all zeros
    let (ok, _, err) = run(&["verify", &s(&small), "--max-decoded", "128MiB"]);
    assert!(!ok);
    assert!(err.contains("over the bound of 134217728"), "{err}");
    // and raised limits accept a degenerate but honest tensor, decoded a piece at a
    // time: the digest of 256 MiB of zeros matches, in bounded memory
    let (ok, out, err) = run(&["verify", &s(&small), "--max-expansion", "100000000"]);
    assert!(ok, "{err}");
    assert!(out.contains(": ok:"), "{out}");
    let peak = children_peak_rss();
    assert!(
        peak < 200 << 20,
        "verify of a 256 MiB tensor peaked at {peak} bytes"
    );
}
