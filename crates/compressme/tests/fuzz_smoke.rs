//! The fuzz smoke run, on the stable toolchain and without libFuzzer: every fuzz target's
//! body (`fuzz/bodies/NAME.rs`, the same code `cargo xtask fuzz` runs under libFuzzer) on
//! its seeds (`fuzz/targets.txt`'s fixtures and `fuzz/seeds/NAME/`) and then on seeded
//! random mutations of them (bit flips, extreme integers, truncation, splices), for a few
//! seconds a target. Tests run in the debug profile, so an unchecked overflow panics here.
//! A panic saves its input under the target's temporary folder and fails with its path.
//!
//! This is a smoke run, not a campaign: it has no coverage feedback. The campaign (at
//! least 10 minutes a target) is `cargo xtask fuzz`, recorded in `docs/BENCHMARKS.md`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[path = "../../../fuzz/bodies/artifact.rs"]
mod artifact;
#[path = "../../../fuzz/bodies/blockstore.rs"]
mod blockstore;
#[path = "../../../fuzz/bodies/gguf.rs"]
mod gguf;
#[path = "../../../fuzz/bodies/plan_json.rs"]
mod plan_json;
#[path = "../../../fuzz/bodies/profile_json.rs"]
mod profile_json;
#[path = "../../../fuzz/bodies/report_json.rs"]
mod report_json;
#[path = "../../../fuzz/bodies/tokenizer.rs"]
mod tokenizer;

/// Mutated inputs a target gets at most, and the time it may take for them.
const MUTATIONS: usize = 2_000;
const BUDGET: Duration = Duration::from_secs(3);

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every file under `p` (a file or a folder, not recursive).
fn files(p: &Path) -> Vec<PathBuf> {
    if p.is_dir() {
        let mut v: Vec<PathBuf> = std::fs::read_dir(p)
            .map(|d| {
                d.flatten()
                    .map(|e| e.path())
                    .filter(|f| f.is_file())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    } else if p.is_file() {
        vec![p.to_path_buf()]
    } else {
        Vec::new()
    }
}

/// The seed inputs of `name`, as `cargo xtask fuzz` gathers them.
fn seeds(name: &str) -> Vec<(String, Vec<u8>)> {
    let root = root();
    let list = std::fs::read_to_string(root.join("fuzz/targets.txt")).expect("fuzz/targets.txt");
    let fixtures: Vec<String> = list
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_once(':'))
        .find(|(n, _)| n.trim() == name)
        .map(|(_, s)| s.split_whitespace().map(str::to_string).collect())
        .unwrap_or_else(|| panic!("fuzz/targets.txt does not list `{name}`"));
    let mut paths: Vec<PathBuf> = fixtures.iter().flat_map(|f| files(&root.join(f))).collect();
    paths.extend(files(&root.join("fuzz/seeds").join(name)));
    paths
        .into_iter()
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p.display().to_string(), bytes)
        })
        .collect()
}

/// xorshift64*: a fixed sequence for a fixed seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Integers at the edges, little-endian, where a size or an offset may sit.
const EXTREMES: [u64; 8] = [
    0,
    1,
    0x7f,
    0xff,
    u32::MAX as u64,
    1 << 40,
    i64::MAX as u64,
    u64::MAX,
];

/// One to four random edits of `input`.
fn mutate(rng: &mut Rng, input: &[u8], other: &[u8]) -> Vec<u8> {
    let mut v = input.to_vec();
    for _ in 0..=rng.below(4) {
        let at = rng.below(v.len());
        match rng.below(6) {
            0 if !v.is_empty() => v[at] ^= 1 << rng.below(8),
            1 if !v.is_empty() => v[at] = [0, 0xff, 0x7f, 0x80][rng.below(4)],
            2 => {
                let x = EXTREMES[rng.below(EXTREMES.len())].to_le_bytes();
                let width = [1, 2, 4, 8][rng.below(4)];
                for (i, b) in x.iter().take(width).enumerate() {
                    if let Some(slot) = v.get_mut(at + i) {
                        *slot = *b;
                    }
                }
            }
            3 => v.truncate(at),
            4 if !other.is_empty() => {
                // splice a piece of another seed in
                let from = rng.below(other.len());
                let len = rng.below(64).min(other.len() - from);
                let piece = other[from..from + len].to_vec();
                v.splice(at..at, piece);
            }
            _ => {
                let len = rng.below(8);
                let at = at.min(v.len());
                v.splice(at..at, (0..len).map(|_| rng.next() as u8));
            }
        }
    }
    v
}

/// Runs `body` on every seed, then on mutations until [`MUTATIONS`] or [`BUDGET`].
fn smoke(name: &str, body: fn(&[u8])) {
    let seeds = seeds(name);
    assert!(!seeds.is_empty(), "`{name}` has no seeds");
    let fail = |what: &str, input: &[u8]| -> ! {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
        let path = dir.join(format!("fuzz-smoke-{name}.bin"));
        let _ = std::fs::write(&path, input);
        panic!(
            "fuzz target `{name}` panicked on {what}; the input is {}",
            path.display()
        );
    };
    let run = |input: &[u8]| std::panic::catch_unwind(|| body(input)).is_ok();
    for (path, bytes) in &seeds {
        if !run(bytes) {
            fail(&format!("seed {path}"), bytes);
        }
    }
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ name.len() as u64);
    let start = Instant::now();
    let mut ran = 0;
    while ran < MUTATIONS && start.elapsed() < BUDGET {
        let (_, a) = &seeds[rng.below(seeds.len())];
        let (_, b) = &seeds[rng.below(seeds.len())];
        let input = mutate(&mut rng, a, b);
        if !run(&input) {
            fail(&format!("mutation {ran}"), &input);
        }
        ran += 1;
    }
    eprintln!(
        "fuzz smoke `{name}`: {} seeds and {ran} mutations in {:.1} s, no panic",
        seeds.len(),
        start.elapsed().as_secs_f64()
    );
    assert!(ran > 0, "`{name}` ran no mutation");
}

#[test]
fn blockstore_smoke() {
    smoke("blockstore", blockstore::run);
}

#[test]
fn artifact_smoke() {
    smoke("artifact", artifact::run);
    let _ = std::fs::remove_dir_all(
        std::env::temp_dir().join(format!("cm-fuzz-artifact-{}", std::process::id())),
    );
}

#[test]
fn plan_json_smoke() {
    smoke("plan_json", plan_json::run);
}

#[test]
fn profile_json_smoke() {
    smoke("profile_json", profile_json::run);
}

#[test]
fn report_json_smoke() {
    smoke("report_json", report_json::run);
}

#[test]
fn gguf_smoke() {
    smoke("gguf", gguf::run);
}

#[test]
fn tokenizer_smoke() {
    smoke("tokenizer", tokenizer::run);
}

/// The harness itself: a body that panics fails the smoke run.
#[test]
#[should_panic(expected = "fuzz target `plan_json` panicked on seed")]
fn a_panicking_body_fails() {
    smoke("plan_json", |_| panic!("a deliberate panic"));
}

/// Every target in `fuzz/targets.txt` has a body and a smoke test here.
#[test]
fn every_target_is_smoked() {
    let list = std::fs::read_to_string(root().join("fuzz/targets.txt")).expect("targets.txt");
    let names: Vec<&str> = list
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_once(':').map(|(n, _)| n.trim()))
        .collect();
    let here = include_str!("fuzz_smoke.rs");
    for n in &names {
        assert!(
            here.contains(&format!("smoke(\"{n}\", {n}::run)")),
            "fuzz target `{n}` has no smoke test"
        );
        assert!(root().join(format!("fuzz/bodies/{n}.rs")).is_file());
    }
    assert_eq!(names.len(), 7, "{names:?}");
}
