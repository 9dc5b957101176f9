//! Writes a sharded bf16 safetensors checkpoint of about 4 GiB shaped like a 7B Llama's
//! first ten layers (embedding 32000 x 4096; per layer q, k, v, o 4096 x 4096, gate and
//! up 11008 x 4096, down 4096 x 11008, two norms), for the checkpoint-scale figures:
//! `cargo xtask bigcheckpoint` runs
//! `cargo run --release -p compressme-benches --example bigcheckpoint -- MINILM OUT_DIR [LAYERS]`.
//!
//! Values are real weights' values: each row takes a random row of one of
//! all-MiniLM-L6-v2's weight matrices (cycling through them tensor by tensor) and draws
//! its values from that row at random (with replacement, a fixed seed), rounded to bf16
//! (nearest even): a real layer's exponent and mantissa statistics, rows shuffled, and
//! no repeated runs for a general-purpose compressor to find. Written a few rows
//! at a time: the process holds one source matrix and a row, never a tensor.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use compressme_artifact::{Checkpoint, Dtype, Limits, Planned, header_bytes};
use compressme_benches::f32_to_bf16_bytes;

const HIDDEN: usize = 4096;
const FFN: usize = 11008;
const VOCAB: usize = 32000;

/// splitmix64: a fixed, dependency-free sequence.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (minilm, out) = match args.as_slice() {
        [m, o] | [m, o, _] => (Path::new(m), Path::new(o)),
        _ => return Err("usage: bigcheckpoint MINILM OUT_DIR [LAYERS]".into()),
    };
    let layers: usize = args.get(2).map_or(Ok(10), |l| l.parse())?;
    // the source rows: every 2-D f32 weight of MiniLM, as bf16 bytes
    let ckpt = Checkpoint::open(minilm, &Limits::default())?;
    let sources: Vec<(usize, Vec<u8>)> = ckpt
        .entries()
        .filter(|e| e.dtype == Dtype::F32 && e.shape.len() == 2 && e.name.contains("layer"))
        .map(|e| Ok((e.shape[1], f32_to_bf16_bytes(&ckpt.read(&e.name)?))))
        .collect::<Result<_, compressme_artifact::Error>>()?;
    let norms: Vec<Vec<u8>> = ckpt
        .entries()
        .filter(|e| {
            e.dtype == Dtype::F32 && e.shape.len() == 1 && e.name.ends_with("LayerNorm.weight")
        })
        .map(|e| Ok(f32_to_bf16_bytes(&ckpt.read(&e.name)?)))
        .collect::<Result<_, compressme_artifact::Error>>()?;
    if sources.is_empty() || norms.is_empty() {
        return Err(format!("{} has no layer weights", minilm.display()).into());
    }
    let mut tensors: Vec<(String, Vec<usize>)> =
        vec![("model.embed_tokens.weight".into(), vec![VOCAB, HIDDEN])];
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        for m in ["q_proj", "k_proj", "v_proj", "o_proj"] {
            tensors.push((format!("{p}.self_attn.{m}.weight"), vec![HIDDEN, HIDDEN]));
        }
        tensors.push((format!("{p}.mlp.gate_proj.weight"), vec![FFN, HIDDEN]));
        tensors.push((format!("{p}.mlp.up_proj.weight"), vec![FFN, HIDDEN]));
        tensors.push((format!("{p}.mlp.down_proj.weight"), vec![HIDDEN, FFN]));
        tensors.push((format!("{p}.input_layernorm.weight"), vec![HIDDEN]));
        tensors.push((format!("{p}.post_attention_layernorm.weight"), vec![HIDDEN]));
    }
    // two shards: the embedding and the first half of the layers, then the rest
    let split = 1 + 9 * layers.div_ceil(2);
    let shards = [
        &tensors[..split.min(tensors.len())],
        &tensors[split.min(tensors.len())..],
    ];
    std::fs::create_dir_all(out)?;
    let mut rng = Rng(0x5eed);
    let mut weight_map = BTreeMap::new();
    let mut total = 0u64;
    let mut which = 0usize;
    for (s, shard) in shards.iter().enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", s + 1);
        let planned: Vec<Planned> = shard
            .iter()
            .map(|(n, shape)| Planned {
                name: n.clone(),
                dtype: Dtype::Bf16,
                shape: shape.clone(),
                len: (shape.iter().product::<usize>() * 2) as u64,
            })
            .collect();
        let mut meta = BTreeMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        let header = header_bytes(&planned, &meta)?;
        let tmp = out.join(format!(".{file}.tmp"));
        let mut w = std::io::BufWriter::with_capacity(4 << 20, std::fs::File::create(&tmp)?);
        w.write_all(&header)?;
        for (name, shape) in shard.iter() {
            let cols = *shape.last().unwrap_or(&0);
            let rows: usize = shape.iter().rev().skip(1).product();
            let mut row = Vec::with_capacity(cols * 2);
            if shape.len() == 1 {
                let n = &norms[which % norms.len()];
                while row.len() < cols * 2 {
                    row.extend_from_slice(&n[..n.len().min(cols * 2 - row.len())]);
                }
                w.write_all(&row)?;
            } else {
                let (src_cols, src) = &sources[which % sources.len()];
                let src_rows = src.len() / (src_cols * 2);
                for _ in 0..rows {
                    // one source row per row, its values drawn at random (with
                    // replacement): a real row's statistics, no repeated runs
                    let r = (rng.next() % src_rows as u64) as usize;
                    let src_row = &src[r * src_cols * 2..(r + 1) * src_cols * 2];
                    row.clear();
                    while row.len() < cols * 2 {
                        let x = rng.next();
                        for k in 0..4 {
                            let c = ((x >> (16 * k)) & 0xffff) as usize % src_cols;
                            row.extend_from_slice(&src_row[2 * c..2 * c + 2]);
                        }
                    }
                    row.truncate(cols * 2);
                    w.write_all(&row)?;
                }
            }
            which += 1;
            weight_map.insert(name.clone(), file.clone());
            total += (rows * cols * 2) as u64;
        }
        w.flush()?;
        drop(w);
        std::fs::rename(&tmp, out.join(&file))?;
        println!("{}: {} tensors", out.join(&file).display(), shard.len());
    }
    let map: Vec<String> = weight_map
        .iter()
        .map(|(k, v)| format!("    \"{k}\": \"{v}\""))
        .collect();
    let index = format!(
        "{{\n  \"metadata\": {{\"total_size\": {total}}},\n  \"weight_map\": {{\n{}\n  }}\n}}\n",
        map.join(",\n")
    );
    std::fs::write(out.join("model.safetensors.index.json"), index)?;
    println!(
        "{}: {} tensors, {total} bytes ({:.2} GiB) of bf16",
        out.display(),
        tensors.len(),
        total as f64 / (1u64 << 30) as f64
    );
    Ok(())
}
