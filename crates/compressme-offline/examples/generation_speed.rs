//! Generation speed of stored SmolLM2 variants, measured as `bench --model` measures it but
//! without the evaluation: each sample a fresh `compressme bench-probe` child process
//! (greedy, 128 new tokens after the first 64 tokens of the held-out text), variants and
//! thread counts interleaved round by round, ratios to the first variant taken per round.
//!
//! ```sh
//! cargo build --release -p compressme
//! cargo run --release -p compressme-offline --example generation_speed -- \
//!     --rounds 5 target/offline/f32.cma target/offline/nf4-g64.cma target/offline/int8.cma \
//!     target/offline/candle-q8_0.gguf target/offline/candle-q4_k.gguf
//! ```
//!
//! A `.gguf` file named `candle-FORMAT.gguf` (as the benchmark writes them) runs on
//! candle's kernels in that format; every other file is one of our artifacts.

mod common;

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use candle_core::Device;
use compressme_nn::decoder::LanguageModel;
use compressme_offline::{ProbeRequest, ProbeResult};

const PROMPT_TOKENS: usize = 64;
const NEW_TOKENS: usize = 128;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut threads = vec![1usize, 2];
    let common::Args {
        rounds,
        model,
        text,
        files,
    } = common::args(3, |flag, rest| {
        if flag != "--threads" {
            return Ok(false);
        }
        threads = rest
            .next()
            .ok_or("--threads needs a value")?
            .split(',')
            .map(str::parse)
            .collect::<Result<_, _>>()?;
        Ok(true)
    })?;
    let exe = std::env::current_exe()?
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join("compressme"))
        .ok_or("no target directory")?;
    if !exe.exists() {
        return Err(format!(
            "{} is missing: cargo build --release -p compressme",
            exe.display()
        )
        .into());
    }
    let lm = LanguageModel::open(&model, &Device::Cpu)?;
    let mut prompt = lm.encode(&std::fs::read_to_string(&text)?)?;
    prompt.truncate(PROMPT_TOKENS);
    drop(lm);

    // tokens a second: [file][threads][round]
    let mut speed = vec![vec![Vec::new(); threads.len()]; files.len()];
    for round in 0..rounds {
        for (i, file) in files.iter().enumerate() {
            for (j, &t) in threads.iter().enumerate() {
                let r = probe(&exe, file, &prompt, t)?;
                let tps = r.generated as f64 / r.generate_seconds;
                eprintln!(
                    "round {}: {} on {t} thread(s): {tps:.1} tok/s",
                    round + 1,
                    file.display()
                );
                speed[i][j].push(tps);
            }
        }
    }
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_default();
    println!(
        "{cpu}; {rounds} interleaved rounds, {} prompt tokens, {NEW_TOKENS} new; median tok/s and the median over rounds of the ratio to {}",
        prompt.len(),
        files[0].display()
    );
    print!("\n| variant |");
    for t in &threads {
        print!(" tok/s, {t} thread(s) | / first |");
    }
    print!("\n| --- |");
    for _ in &threads {
        print!(" ---: | ---: |");
    }
    println!();
    for (file, per_thread) in files.iter().zip(&speed) {
        print!(
            "| {} |",
            file.file_name().unwrap_or_default().to_string_lossy()
        );
        for (samples, first) in per_thread.iter().zip(&speed[0]) {
            let ratios: Vec<f64> = samples.iter().zip(first).map(|(a, b)| a / b).collect();
            print!(
                " {:.1} | {:.2}x |",
                compressme_eval::median(samples.clone()),
                compressme_eval::median(ratios)
            );
        }
        println!();
    }
    Ok(())
}

/// One sample in a fresh child process on `threads` threads.
fn probe(
    exe: &Path,
    file: &Path,
    prompt: &[u32],
    threads: usize,
) -> Result<ProbeResult, Box<dyn std::error::Error>> {
    let req = ProbeRequest {
        file: file.to_path_buf(),
        candle: common::candle_name(file),
        window: Vec::new(),
        prompt: prompt.to_vec(),
        max_new: NEW_TOKENS,
    };
    let mut child = Command::new(exe)
        .arg("bench-probe")
        .env("RAYON_NUM_THREADS", threads.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    child
        .stdin
        .take()
        .ok_or("no stdin")?
        .write_all(&serde_json::to_vec(&req)?)?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        return Err(format!("bench-probe on {} failed", file.display()).into());
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}
