//! `cargo xtask fuzz [--seconds N] [--targets a,b]`: every fuzz target of `fuzz/` under
//! cargo-fuzz (libFuzzer, the nightly toolchain), each for N seconds (default 600),
//! seeded from the frozen fixtures and `fuzz/seeds/`. Prints one line per target
//! (executions, corpus size, crashes) and fails when any target found a crash: its
//! input is under `fuzz/artifacts/TARGET/`, to be committed as a regression test.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The targets and the fixture paths that seed each, from `fuzz/targets.txt` (which the
/// stable smoke test reads too).
fn targets(root: &Path) -> Result<Vec<(String, Vec<String>)>, String> {
    let path = root.join("fuzz/targets.txt");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(text
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .filter_map(|l| l.split_once(':'))
        .map(|(name, seeds)| {
            (
                name.trim().to_string(),
                seeds.split_whitespace().map(str::to_string).collect(),
            )
        })
        .collect())
}

/// Options of `cargo xtask fuzz`.
struct Options {
    seconds: u64,
    targets: Vec<String>,
}

fn options(args: &[String], all: &[(String, Vec<String>)]) -> Result<Options, String> {
    let mut o = Options {
        seconds: 600,
        targets: all.iter().map(|t| t.0.clone()).collect(),
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--seconds" => {
                o.seconds = it
                    .next()
                    .and_then(|s| s.parse().ok())
                    .ok_or("--seconds takes a number")?;
            }
            "--targets" => {
                let list = it.next().ok_or("--targets takes a comma-separated list")?;
                o.targets = list.split(',').map(str::to_string).collect();
                if let Some(bad) = o.targets.iter().find(|t| !all.iter().any(|k| k.0 == **t)) {
                    return Err(format!("no fuzz target `{bad}`"));
                }
            }
            other => return Err(format!("unknown option `{other}`")),
        }
    }
    Ok(o)
}

/// Copies every file under `src` (a file or a folder) into `dst`.
fn seed(root: &Path, src: &str, dst: &Path) -> Result<usize, String> {
    let p = root.join(src);
    let files: Vec<PathBuf> = if p.is_dir() {
        std::fs::read_dir(&p)
            .map_err(|e| format!("{}: {e}", p.display()))?
            .flatten()
            .map(|e| e.path())
            .filter(|f| f.is_file())
            .collect()
    } else {
        vec![p]
    };
    for f in &files {
        // named by folder and file, so two versions' `sample.cma` are two seeds
        let name = f.file_name().ok_or("a seed without a name")?;
        let folder = f.parent().and_then(Path::file_name).unwrap_or_default();
        let to = dst.join(format!(
            "{}-{}",
            folder.to_string_lossy(),
            name.to_string_lossy()
        ));
        std::fs::copy(f, to).map_err(|e| format!("{}: {e}", f.display()))?;
    }
    Ok(files.len())
}

/// The last libFuzzer status line's `#N` (executions) and `corp: N/...` (inputs).
fn stats(log: &str) -> (u64, u64) {
    let mut execs = 0;
    let mut corpus = 0;
    for line in log.lines().filter(|l| l.starts_with('#')) {
        if let Some(n) = line
            .trim_start_matches('#')
            .split_whitespace()
            .next()
            .and_then(|n| n.parse().ok())
        {
            execs = n;
        }
        if let Some(c) = line
            .split("corp: ")
            .nth(1)
            .and_then(|c| c.split('/').next())
            .and_then(|c| c.parse().ok())
        {
            corpus = c;
        }
    }
    (execs, corpus)
}

pub(crate) fn fuzz(root: &Path, args: &[String]) -> Result<(), String> {
    let all = targets(root)?;
    let o = options(args, &all)?;
    let fuzz_dir = root.join("fuzz");
    let mut failed = Vec::new();
    let mut lines = Vec::new();
    for (name, fixtures) in all.iter().filter(|t| o.targets.contains(&t.0)) {
        let corpus = fuzz_dir.join("corpus").join(name);
        std::fs::create_dir_all(&corpus).map_err(|e| format!("{}: {e}", corpus.display()))?;
        let mut seeds = 0;
        for f in fixtures {
            seeds += seed(root, f, &corpus)?;
        }
        let committed = fuzz_dir.join("seeds").join(name);
        if committed.is_dir() {
            seeds += seed(root, &format!("fuzz/seeds/{name}"), &corpus)?;
        }
        let artifacts = fuzz_dir.join("artifacts").join(name);
        std::fs::create_dir_all(&artifacts).map_err(|e| format!("{}: {e}", artifacts.display()))?;
        let before = std::fs::read_dir(&artifacts).map_or(0, Iterator::count);
        eprintln!("fuzz: {name} for {} s ({seeds} seeds)", o.seconds);
        let out = Command::new("cargo")
            .current_dir(&fuzz_dir)
            .args(["+nightly", "fuzz", "run", name])
            .arg(&corpus)
            .args([
                "--",
                &format!("-max_total_time={}", o.seconds),
                "-rss_limit_mb=2048",
                "-timeout=20",
                "-print_final_stats=1",
            ])
            .output()
            .map_err(|e| {
                format!("cannot start cargo +nightly fuzz (cargo install cargo-fuzz): {e}")
            })?;
        let log = String::from_utf8_lossy(&out.stderr);
        let (execs, corp) = stats(&log);
        let crashes = std::fs::read_dir(&artifacts).map_or(0, Iterator::count) - before;
        let line = format!(
            "{name}: {execs} executions in {} s, corpus {corp} inputs, {crashes} crashes{}",
            o.seconds,
            if out.status.success() {
                String::new()
            } else {
                format!(" (exit {})", out.status)
            }
        );
        eprintln!("fuzz: {line}");
        if !out.status.success() || crashes > 0 {
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            eprintln!("{}", tail.into_iter().rev().collect::<Vec<_>>().join("\n"));
            failed.push(name.to_string());
        }
        lines.push(line);
    }
    println!("{}", lines.join("\n"));
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "fuzz targets failed: {} (inputs under fuzz/artifacts/)",
            failed.join(", ")
        ))
    }
}
