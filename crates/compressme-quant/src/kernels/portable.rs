//! The kernels in plain Rust: the same arithmetic as the AVX2 versions (exact `i32` sums
//! per group, f32 after), for CPUs without AVX2 and for tests.

use half::{bf16, f16};

pub(super) fn dot_groups<const N: usize>(
    w: &[i8],
    xs: [&[i16]; N],
    group: usize,
    scales: &[f32],
) -> [f32; N] {
    let mut out = [0f32; N];
    for (g, &s) in scales.iter().enumerate() {
        let (lo, hi) = (g * group, ((g + 1) * group).min(w.len()));
        let wg = w.get(lo..hi).unwrap_or(&[]);
        for (o, x) in out.iter_mut().zip(xs) {
            let xg = x.get(lo..hi).unwrap_or(&[]);
            let sum: i32 = wg
                .iter()
                .zip(xg)
                .map(|(&a, &b)| i32::from(a) * i32::from(b))
                .sum();
            *o += sum as f32 * s;
        }
    }
    out
}

pub(super) fn decode_nibbles(codes: &[u8], lut: &[i8; 16], out: &mut [i8]) {
    for (run, block) in codes.chunks(16).zip(out.chunks_mut(32)) {
        let (lo, hi) = block.split_at_mut(block.len().min(16));
        for (i, &b) in run.iter().enumerate() {
            if let Some(o) = lo.get_mut(i) {
                *o = lut[usize::from(b & 0x0f)];
            }
            if let Some(o) = hi.get_mut(i) {
                *o = lut[usize::from(b >> 4)];
            }
        }
    }
}

pub(super) fn dot_half<const N: usize>(codes: &[u8], bf16: bool, xs: [&[f32]; N]) -> [f32; N] {
    let mut out = [0f32; N];
    for (j, c) in codes.chunks_exact(2).enumerate() {
        let bits = u16::from_le_bytes([c[0], c[1]]);
        let v = if bf16 {
            bf16::from_bits(bits).to_f32()
        } else {
            f16::from_bits(bits).to_f32()
        };
        for (o, x) in out.iter_mut().zip(xs) {
            *o += v * x.get(j).copied().unwrap_or(0.0);
        }
    }
    out
}

pub(super) fn dot_nibbles<const N: usize>(
    codes: &[u8],
    lut: &[i8; 16],
    xs: [&[i16]; N],
    group: usize,
    scales: &[f32],
) -> [f32; N] {
    let mut w = vec![0i8; 2 * codes.len()];
    decode_nibbles(codes, lut, &mut w);
    dot_groups(&w, xs, group, scales)
}

pub(super) fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    super::dot(a, b)
}

/// Rows `first..first + out.len()` of an integer matrix against one `x` row, one at a
/// time.
pub(super) fn dot_rows(v: &super::RowsView<'_>, first: usize, x: &[i16], out: &mut [f32]) {
    for (k, o) in out.iter_mut().enumerate() {
        let (codes, scales) = (
            v.codes_of(first + k),
            v.scales_of(first + k).values().collect::<Vec<_>>(),
        );
        [*o] = match v.lut {
            Some(lut) => dot_nibbles(codes, lut, [x], v.group, &scales),
            None => {
                let row: Vec<i8> = codes.iter().map(|&c| c as i8).collect();
                dot_groups(&row, [x], v.group, &scales)
            }
        };
    }
}
