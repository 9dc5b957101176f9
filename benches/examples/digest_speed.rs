//! Whole-tensor digest speed, one thread: SHA-256 one message at a time (`sha2`), SHA-256
//! of four messages in lockstep (`compressme_blockstore::sha256_many`, SHA-NI where the CPU
//! has it), and XXH3-128 (artifact version 4's whole-tensor digest), one message at a time
//! and fed in 4 MiB pieces as `verify` feeds it:
//! `taskset -c 1 cargo run --release -p compressme-benches --example digest_speed`.
//!
//! Four messages of 64 MiB of pseudo-random bytes; best of 5 passes; GB/s of bytes hashed.
use std::time::Instant;

use sha2::Digest;

fn best(mut f: impl FnMut() -> u8) -> f64 {
    let mut t = f64::INFINITY;
    let mut sink = 0u8;
    for _ in 0..5 {
        let t0 = Instant::now();
        sink ^= f();
        t = t.min(t0.elapsed().as_secs_f64());
    }
    std::hint::black_box(sink);
    t
}

fn main() {
    let n = 64usize << 20;
    let mut s = 7u64;
    let msgs: Vec<Vec<u8>> = (0..4)
        .map(|_| {
            (0..n)
                .map(|_| {
                    s = s
                        .wrapping_mul(6_364_136_223_846_793_005)
                        .wrapping_add(1_442_695_040_888_963_407);
                    (s >> 56) as u8
                })
                .collect()
        })
        .collect();
    let total = (4 * n) as f64;
    let gbs = |t: f64| total / t / 1e9;
    let one = best(|| {
        msgs.iter()
            .map(|m| sha2::Sha256::digest(m)[0])
            .fold(0, |a, b| a ^ b)
    });
    let slices: Vec<&[u8]> = msgs.iter().map(Vec::as_slice).collect();
    let four = best(|| {
        compressme_blockstore::sha256_many(&slices)
            .iter()
            .fold(0, |a, d| a ^ d[0])
    });
    let xxh = best(|| {
        msgs.iter()
            .map(|m| xxhash_rust::xxh3::xxh3_128(m) as u8)
            .fold(0, |a, b| a ^ b)
    });
    let xxh_pieces = best(|| {
        msgs.iter()
            .map(|m| {
                let mut h = xxhash_rust::xxh3::Xxh3::new();
                for p in m.chunks(4 << 20) {
                    h.update(p);
                }
                h.digest128() as u8
            })
            .fold(0, |a, b| a ^ b)
    });
    println!("4 x {} MiB, best of 5, one thread:", n >> 20);
    println!(
        "SHA-256, one message at a time (sha2)     {:6.2} GB/s",
        gbs(one)
    );
    println!(
        "SHA-256, four in lockstep (sha256_many)   {:6.2} GB/s",
        gbs(four)
    );
    println!(
        "XXH3-128, one message at a time           {:6.2} GB/s",
        gbs(xxh)
    );
    println!(
        "XXH3-128, fed in 4 MiB pieces             {:6.2} GB/s",
        gbs(xxh_pieces)
    );
}
