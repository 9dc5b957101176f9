//! Quantization error of our formats and llama.cpp's (through candle) on the same fixed
//! matrices: `cargo run --release -p compressme-benches --bin quant-report`.
//! Prints a markdown table: stored bits a weight and relative RMSE per matrix kind.

use compressme_nn::{LlamaFormat, llama_quantize};
use compressme_quant::synthetic::{MatrixKind, matrix, rel_rmse};
use compressme_quant::{Format, GroupSize, quantize};

const ROWS: usize = 256;
const COLS: usize = 512;

fn main() -> Result<(), String> {
    let mats: Vec<Vec<f32>> = MatrixKind::ALL
        .iter()
        .map(|&k| matrix(k, ROWS, COLS, 42))
        .collect();
    let n = (ROWS * COLS) as f64;
    println!("| format | stored bits a weight | Gaussian | Student-t (3) | outlier rows |");
    println!("| --- | --- | --- | --- | --- |");
    let mut ours = vec![Format::F16, Format::Bf16, Format::Int8, Format::Nf4];
    for g in [GroupSize::G32, GroupSize::G64, GroupSize::G128] {
        ours.extend([Format::Nf4Block(g), Format::Int4Block(g)]);
    }
    for f in ours {
        let mut row = Vec::new();
        let mut bits = 0.0;
        for w in &mats {
            let q = quantize(w, ROWS, COLS, f).map_err(|e| e.to_string())?;
            let mut back = vec![0f32; w.len()];
            q.dequantize_into(&mut back).map_err(|e| e.to_string())?;
            row.push(rel_rmse(w, &back));
            bits = 8.0 * q.stored_bytes() as f64 / n;
        }
        println!(
            "| ours {f:?} | {bits:.4} | {:.5} | {:.5} | {:.5} |",
            row[0], row[1], row[2]
        );
    }
    for f in LlamaFormat::ALL {
        let mut row = Vec::new();
        let mut bits = 0.0;
        for w in &mats {
            let q = llama_quantize(w, ROWS, COLS, f).map_err(|e| e.to_string())?;
            row.push(rel_rmse(w, &q.dequantized));
            bits = 8.0 * q.stored_bytes as f64 / n;
        }
        println!(
            "| llama.cpp {f:?} (candle) | {bits:.4} | {:.5} | {:.5} | {:.5} |",
            row[0], row[1], row[2]
        );
    }
    Ok(())
}
