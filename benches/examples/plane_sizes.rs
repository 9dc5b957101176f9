//! Where the lossless bytes go, plane by plane: every float tensor of a checkpoint with its
//! sign bit rotated and split into byte planes, each plane stored on its own in 64-row
//! blocks with Huffman tables (coded planes kept at 2% gain, the default, and at any gain)
//! and with rANS tables, against the plane's order-0 entropy per block.
//! `cargo run --release -p compressme-benches --example plane_sizes -- model.safetensors`
use compressme_artifact::{Checkpoint, Dtype, Limits};
use compressme_blockstore::{BlockStore, Coder, EncodeOptions, ValueKind};
use compressme_shuffle::ElementSize;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args()
        .nth(1)
        .ok_or("usage: plane_sizes CHECKPOINT")?;
    let ckpt = Checkpoint::open(std::path::Path::new(&path), &Limits::default())?;
    let entries: Vec<_> = ckpt.entries().cloned().collect();
    // per plane: raw, huffman 0.98, huffman 1.0, rans, block entropy (bits / 8)
    let mut sums = [[0f64; 5]; 4];
    let mut dense = 0u64;
    for e in &entries {
        let width = match e.dtype {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
            _ => continue,
        };
        let bytes = ckpt.read(&e.name)?;
        dense += bytes.len() as u64;
        let cols: usize = e.shape.iter().skip(1).product::<usize>().max(1);
        let rows = e.shape.first().copied().unwrap_or(1);
        if e.shape.len() < 2 || rows < 2 {
            continue;
        }
        let n = rows * cols;
        let mut planes = vec![vec![0u8; n]; width];
        for (i, c) in bytes.chunks_exact(width).enumerate() {
            let v: u32 = if width == 4 {
                u32::from_le_bytes([c[0], c[1], c[2], c[3]]).rotate_left(1)
            } else {
                u32::from(u16::from_le_bytes([c[0], c[1]]).rotate_left(1))
            };
            for (k, p) in planes.iter_mut().enumerate() {
                p[i] = (v >> (8 * k)) as u8;
            }
        }
        for (k, p) in planes.iter().enumerate() {
            let opts = |coder, frac| {
                let mut o = EncodeOptions::new(ValueKind::Bytes(ElementSize::One))
                    .block_rows(64)
                    .coder(coder);
                o.max_coded_fraction = frac;
                o
            };
            let t: u8 = std::env::var("TABLES")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(4);
            let huff = Coder::SharedHuffman { max_tables: t };
            let rans = Coder::SharedRans { max_tables: t };
            let size = |o: &EncodeOptions| -> Result<f64, Box<dyn std::error::Error>> {
                Ok(BlockStore::encode(p, rows as u64, cols, o)?
                    .stored_bytes()
                    .total() as f64)
            };
            let mut ent = 0f64;
            for b in p.chunks(64 * cols) {
                let mut h = [0u64; 256];
                for &x in b {
                    h[usize::from(x)] += 1;
                }
                let t = b.len() as f64;
                ent += h
                    .iter()
                    .filter(|&&c| c > 0)
                    .map(|&c| -(c as f64) * (c as f64 / t).log2())
                    .sum::<f64>()
                    / 8.0;
            }
            let s = &mut sums[width - 1 - k];
            s[0] += n as f64;
            s[1] += size(&opts(huff, 0.98))?;
            s[2] += size(&opts(huff, 1.0))?;
            s[3] += size(&opts(rans, 0.98))?;
            s[4] += ent;
        }
    }
    println!("dense {dense} bytes; per plane (0 = the exponent's), fractions of dense bytes:");
    println!("plane  raw      huffman(0.98)  huffman(any)  rans     entropy");
    let mut tot = [0f64; 5];
    for (k, s) in sums.iter().enumerate() {
        if s[0] == 0.0 {
            continue;
        }
        let f = |x: f64| x / dense as f64;
        println!(
            "{k}      {:.5}  {:.5}        {:.5}       {:.5}  {:.5}",
            f(s[0]),
            f(s[1]),
            f(s[2]),
            f(s[3]),
            f(s[4])
        );
        for (t, x) in tot.iter_mut().zip(s) {
            *t += x;
        }
    }
    let f = |x: f64| x / dense as f64;
    println!(
        "all    {:.5}  {:.5}        {:.5}       {:.5}  {:.5}",
        f(tot[0]),
        f(tot[1]),
        f(tot[2]),
        f(tot[3]),
        f(tot[4])
    );
    Ok(())
}
