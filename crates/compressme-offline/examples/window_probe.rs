//! Evaluation windows of stored SmolLM2 variants in one process, as `bench --model` scores
//! them: windows of 512 tokens of the held-out text at stride 256, each giving the logits
//! of its last 256 positions. Each variant is loaded once and runs one window to warm up;
//! then the variants take turns, one window each a round. It prints each variant's median
//! seconds a window and an FNV-1a digest of every logit's bits, so two builds can be
//! compared for speed and checked for the same bits.
//!
//! ```sh
//! cargo build --release -p compressme-offline --example window_probe
//! RAYON_NUM_THREADS=1 taskset -c 1 target/release/examples/window_probe --rounds 5 \
//!     target/real/nf4-g64.cma target/real/budget-4.5.cma
//! ```
//!
//! A `.gguf` file named `candle-FORMAT.gguf` (as the benchmark writes them) runs on
//! candle's kernels in that format, or with `--replica` as the benchmark scores it (its
//! Q5_0 and unrepacked Q8_0 linears on our replica of candle's kernels,
//! `compressme_nn::replicate_ggml`: the same bits); every other file is one of our
//! artifacts.

mod common;

use std::time::Instant;

use candle_core::Device;
use compressme_nn::decoder::LanguageModel;

const WINDOW: usize = 512;
const STRIDE: usize = 256;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut replica = false;
    let common::Args {
        rounds,
        model,
        text,
        files,
    } = common::args(5, |flag, _| {
        Ok(flag == "--replica" && {
            replica = true;
            true
        })
    })?;
    let lm = LanguageModel::open(&model, &Device::Cpu)?;
    let ids = lm.encode(&std::fs::read_to_string(&text)?)?;
    let window = |k: usize| -> Result<&[u32], Box<dyn std::error::Error>> {
        let at = k * STRIDE;
        ids.get(at..at + WINDOW)
            .ok_or_else(|| format!("{} has too few tokens", text.display()).into())
    };
    let mut models = Vec::new();
    for f in &files {
        let candle = common::candle_name(f)
            .map(|n| compressme_offline::candle_format(&n))
            .transpose()?;
        let mut m = compressme_offline::load_variant(f, candle)?;
        if replica && candle.is_some() {
            compressme_nn::replicate_ggml(&mut m)?;
        }
        m.logit_rows_at(window(0)?, STRIDE..WINDOW)?;
        models.push(m);
    }
    let mut seconds = vec![Vec::new(); files.len()];
    let mut digests = vec![0xcbf2_9ce4_8422_2325_u64; files.len()];
    for round in 0..rounds {
        for (i, m) in models.iter().enumerate() {
            let w = window(round + 1)?;
            let t = Instant::now();
            let rows = m.logit_rows_at(w, STRIDE..WINDOW)?;
            seconds[i].push(t.elapsed().as_secs_f64());
            for v in rows.iter().flatten() {
                for b in v.to_bits().to_le_bytes() {
                    digests[i] = (digests[i] ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
                }
            }
        }
    }
    for ((f, mut s), d) in files.iter().zip(seconds).zip(digests) {
        s.sort_by(f64::total_cmp);
        let median = s.get(s.len() / 2).copied().unwrap_or(f64::NAN);
        println!(
            "{}: median {median:.3} s a window ({} rounds, {:.3}-{:.3}), logits digest {d:016x}",
            f.display(),
            s.len(),
            s.first().copied().unwrap_or(f64::NAN),
            s.last().copied().unwrap_or(f64::NAN)
        );
    }
    Ok(())
}
