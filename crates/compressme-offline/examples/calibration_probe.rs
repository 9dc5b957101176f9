//! The real-model benchmark's calibration stage alone: SmolLM2's f32 reference over the
//! first windows of 512 tokens of the calibration text, each linear's input reported
//! (`Decoder::observe`), the profile and every linear's input Gram matrix recorded as
//! `bench --model` records them. It prints the seconds and a SHA-256 of the profile's JSON
//! and of the matrices' bits, so two builds (or two lane counts) can be compared for speed
//! and checked for the same bits.
//!
//! ```sh
//! cargo build --release -p compressme-offline --example calibration_probe
//! target/release/examples/calibration_probe --windows 16 --lanes 2
//! ```

use std::time::Instant;

use candle_core::{Device, Tensor};
use compressme_nn::decoder::{Decoder, LanguageModel};
use compressme_profile::{ActivationRecorder, ProfileSettings};
use sha2::{Digest, Sha256};

const WINDOW: usize = 512;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut windows = 16;
    let mut lanes = 1;
    let mut grams = true;
    let mut model = String::from("cache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    let mut text = String::from("cache/austen/emma.txt");
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--windows" => windows = value()?.parse()?,
            "--lanes" => lanes = value()?.parse()?,
            "--model" => model = value()?,
            "--text" => text = value()?,
            "--no-grams" => grams = false,
            f => return Err(format!("{f}: not a flag of this probe").into()),
        }
    }
    let lm = LanguageModel::open(model.as_ref(), &Device::Cpu)?;
    let ids = lm.encode(&std::fs::read_to_string(&text)?)?;
    let batches: Vec<Tensor> = ids
        .chunks_exact(WINDOW)
        .take(windows)
        .map(|c| Tensor::new(c, &Device::Cpu).and_then(|t| t.unsqueeze(0)))
        .collect::<candle_core::Result<_>>()?;
    // the benchmark's candidates (its default configuration)
    let settings = ProfileSettings {
        candidates: compressme_offline::RealConfig::default().candidates,
        ..ProfileSettings::default()
    };
    let recorder = ActivationRecorder::new(settings).with_lanes(lanes);
    let forward = |m: &Decoder, ids: &Tensor| m.observe(ids);
    let t = Instant::now();
    let (profile, grams) = if grams {
        recorder.record_with_grams(&lm.model, &batches, forward)?
    } else {
        (
            recorder.record(&lm.model, &batches, forward)?,
            Default::default(),
        )
    };
    let seconds = t.elapsed().as_secs_f64();
    let mut h = Sha256::new();
    for (name, g) in &grams {
        h.update(name.as_bytes());
        for v in g {
            h.update(v.to_le_bytes());
        }
    }
    println!(
        "{} windows, {lanes} lanes: {seconds:.2} s; profile {}; {} Gram matrices {}",
        batches.len(),
        compressme_blockstore::hex(Sha256::digest(profile.to_json()?.as_bytes()).as_slice()),
        grams.len(),
        compressme_blockstore::hex(h.finalize().as_slice()),
    );
    Ok(())
}
