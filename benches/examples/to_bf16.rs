//! Writes a checkpoint with every f32 tensor rounded to bf16 (nearest even), for the bf16
//! lossless figures: `cargo run --release -p compressme-benches --example to_bf16 -- IN OUT`.

use compressme_artifact::{Checkpoint, Dtype, Limits};
use compressme_benches::f32_to_bf16_bytes;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [input, output] = args.as_slice() else {
        return Err("usage: to_bf16 IN OUT".into());
    };
    let ckpt = Checkpoint::open(std::path::Path::new(input), &Limits::default())?;
    let entries: Vec<_> = ckpt.entries().cloned().collect();
    let mut owned = Vec::new();
    for e in &entries {
        let bytes = ckpt.read(&e.name)?;
        let (dtype, bytes) = if e.dtype == Dtype::F32 {
            (safetensors::Dtype::BF16, f32_to_bf16_bytes(&bytes))
        } else if e.dtype == Dtype::I64 {
            (safetensors::Dtype::I64, bytes)
        } else {
            return Err(format!("{}: {:?} not handled", e.name, e.dtype).into());
        };
        owned.push((e.name.clone(), dtype, e.shape.clone(), bytes));
    }
    let views = owned
        .iter()
        .map(|(n, d, s, b)| {
            Ok((
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b)?,
            ))
        })
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    safetensors::serialize_to_file(views, None, std::path::Path::new(output))?;
    println!("{output}: {} tensors", owned.len());
    Ok(())
}
