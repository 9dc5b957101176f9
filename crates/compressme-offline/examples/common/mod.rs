//! What the SmolLM2 variant probes share: their arguments, and which of candle's formats a
//! stored variant's file runs on.

use std::error::Error;
use std::path::{Path, PathBuf};

/// A probe's arguments: `--rounds N`, `--model PATH` (the tokenizer's source, SmolLM2's
/// GGUF by default), `--text PATH` (the held-out text, *Persuasion* by default), the
/// variant files, and what the probe's own flags took.
pub(crate) struct Args {
    pub(crate) rounds: usize,
    pub(crate) model: PathBuf,
    pub(crate) text: PathBuf,
    pub(crate) files: Vec<PathBuf>,
}

/// The command line, with `rounds` rounds unless it says otherwise; `own(flag, rest)`
/// takes a flag this module does not know (reading its value from `rest`) and says whether
/// it did, else the flag is refused.
pub(crate) fn args(
    rounds: usize,
    mut own: impl FnMut(&str, &mut dyn Iterator<Item = String>) -> Result<bool, Box<dyn Error>>,
) -> Result<Args, Box<dyn Error>> {
    let mut a = Args {
        rounds,
        model: PathBuf::from("cache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
        text: PathBuf::from("cache/austen/persuasion.txt"),
        files: Vec::new(),
    };
    let mut rest = std::env::args().skip(1);
    while let Some(flag) = rest.next() {
        match flag.as_str() {
            "--rounds" => a.rounds = rest.next().ok_or("--rounds needs a value")?.parse()?,
            "--model" => a.model = rest.next().ok_or("--model needs a value")?.into(),
            "--text" => a.text = rest.next().ok_or("--text needs a value")?.into(),
            f if f.starts_with("--") => {
                if !own(f, &mut rest)? {
                    return Err(format!("{f}: not a flag of this probe").into());
                }
            }
            _ => a.files.push(PathBuf::from(flag)),
        }
    }
    if a.files.is_empty() {
        return Err("name at least one variant file".into());
    }
    Ok(a)
}

/// The candle format a variant's file runs on: `FORMAT` for a `.gguf` file named
/// `candle-FORMAT.gguf` (as the benchmark writes them); `None` for one of our artifacts.
pub(crate) fn candle_name(file: &Path) -> Option<String> {
    let stem = file.file_stem()?.to_str()?;
    match file.extension().and_then(|e| e.to_str()) {
        Some("gguf") => stem.strip_prefix("candle-").map(str::to_string),
        _ => None,
    }
}
