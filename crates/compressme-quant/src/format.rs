//! The formats, their layouts in memory, quantization and dequantization.
//!
//! Sizes reach here from files (through [`Packed::from_parts`]): every operation on one is
//! checked or saturating (`arithmetic_side_effects` is denied). A packed matrix has
//! `rows, cols >= 1` and buffers whose lengths were checked against them, so an index
//! below `rows x cols` never saturates.
#![deny(
    clippy::indexing_slicing,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::arithmetic_side_effects
)]

use half::{bf16, f16};
use rayon::prelude::*;

use crate::gptq::GptqFactor;
use crate::{Error, Result};

/// The QLoRA 4-bit NormalFloat codebook (Dettmers et al., 2023), ascending; index 7 is 0.
pub const NF4_CODEBOOK: [f32; 16] = [
    -1.0,
    -0.696_192_8,
    -0.525_073_05,
    -0.394_917_5,
    -0.284_441_38,
    -0.184_773_43,
    -0.091_050_036,
    0.0,
    0.079_580_3,
    0.160_930_2,
    0.246_112_3,
    0.337_915_24,
    0.440_709_83,
    0.562_617,
    0.722_956_84,
    1.0,
];

/// Weights per scale in the blockwise 4-bit formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GroupSize {
    /// 32 weights a group.
    G32,
    /// 64 weights a group.
    G64,
    /// 128 weights a group.
    G128,
}

impl GroupSize {
    /// Weights a group.
    #[must_use]
    pub const fn get(self) -> usize {
        match self {
            Self::G32 => 32,
            Self::G64 => 64,
            Self::G128 => 128,
        }
    }
}

/// A storage format. Wire tags ([`Format::tag`]) are explicit and stable, never the
/// declaration order; a retired tag leaves a gap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Format {
    /// IEEE half precision, round to nearest even. 16 bits a weight.
    F16,
    /// bfloat16, round to nearest even. 16 bits a weight.
    Bf16,
    /// Symmetric INT8, one f32 scale (absmax / 127) per row. 8 bits a weight + 32 a row.
    Int8,
    /// NF4 codebook, one f32 absmax scale per row, two indices a byte (low nibble first);
    /// an odd row ends in half a byte. 4 bits a weight + 32 a row.
    Nf4,
    /// NF4 codebook with one f16 absmax scale per group (bitsandbytes-style blockwise).
    Nf4Block(GroupSize),
    /// Asymmetric uniform 4-bit: per group an f16 minimum and an f16 step
    /// ((max - min) / 15); a weight is `min + q * step`, `q` in 0..=15.
    Int4Block(GroupSize),
    /// INT8 rows for embedding tables: as `Int8`, and an all-zero row stays exactly zero.
    Int8Rows,
    /// Symmetric INT8 with one f16 scale (absmax / 127) per group: llama.cpp's Q8_0 at
    /// groups of 32 (8.5 bits a weight). Codes as `Int8`, scales as `Nf4Block`.
    Int8Block(GroupSize),
}

impl Format {
    /// Every format, every group size.
    pub const ALL: [Self; 13] = [
        Self::F16,
        Self::Bf16,
        Self::Int8,
        Self::Nf4,
        Self::Nf4Block(GroupSize::G32),
        Self::Nf4Block(GroupSize::G64),
        Self::Nf4Block(GroupSize::G128),
        Self::Int4Block(GroupSize::G32),
        Self::Int4Block(GroupSize::G64),
        Self::Int4Block(GroupSize::G128),
        Self::Int8Block(GroupSize::G32),
        Self::Int8Block(GroupSize::G64),
        Self::Int8Block(GroupSize::G128),
    ];

    /// Wire tag of the format (the group size is a separate field).
    #[must_use]
    pub const fn tag(self) -> u8 {
        match self {
            Self::F16 => 1,
            Self::Bf16 => 2,
            Self::Int8 => 3,
            Self::Nf4 => 4,
            Self::Nf4Block(_) => 5,
            Self::Int4Block(_) => 6,
            Self::Int8Rows => 7,
            Self::Int8Block(_) => 8,
        }
    }

    /// Weights per group for the blockwise formats.
    #[must_use]
    pub const fn group(self) -> Option<usize> {
        match self {
            Self::Nf4Block(g) | Self::Int4Block(g) | Self::Int8Block(g) => Some(g.get()),
            _ => None,
        }
    }

    /// Bits of one weight's code (scales and minimums not counted): 16, 8 or 4.
    #[must_use]
    pub const fn code_bits(self) -> usize {
        match self {
            Self::F16 | Self::Bf16 => 16,
            Self::Int8 | Self::Int8Rows | Self::Int8Block(_) => 8,
            Self::Nf4 | Self::Nf4Block(_) | Self::Int4Block(_) => 4,
        }
    }

    /// Bytes of codes for one row of `cols` weights (an odd 4-bit row ends in half a byte).
    #[must_use]
    pub const fn row_code_bytes(self, cols: usize) -> usize {
        // saturating: a size read from a file must not overflow (it is then refused as
        // not matching the bytes present)
        cols.saturating_mul(self.code_bits()).div_ceil(8)
    }

    /// Scales (and minimums) kept per row, and bytes each.
    const fn row_params(self, cols: usize) -> (usize, usize, usize) {
        match self {
            Self::F16 | Self::Bf16 => (0, 0, 0),
            Self::Int8 | Self::Int8Rows | Self::Nf4 => (1, 4, 0),
            Self::Nf4Block(g) | Self::Int8Block(g) => (cols.div_ceil(g.get()), 2, 0),
            Self::Int4Block(g) => (cols.div_ceil(g.get()), 2, cols.div_ceil(g.get())),
        }
    }

    /// Bytes a `[rows, cols]` matrix takes in this format: codes, scales and minimums at
    /// their stored width (what [`Packed::stored_bytes`] reports once quantized).
    #[must_use]
    pub const fn stored_bytes(self, rows: usize, cols: usize) -> usize {
        let (n, size, mins) = self.row_params(cols);
        rows.saturating_mul(
            self.row_code_bytes(cols)
                .saturating_add(n.saturating_mul(size))
                .saturating_add(mins.saturating_mul(2)),
        )
    }

    /// Whether weights whose largest magnitude is `max_abs` stay finite in this format:
    /// f16 codes, and the f16 scales and minimums of the blockwise formats, stop at
    /// 65,504 (a group's step is at most 2 · 65,504 / 15; `Int8Block`'s scale is its
    /// group's largest magnitude / 127); bf16 at its largest finite value. For finite
    /// weights, what [`quantize`] refuses with [`Error::Unrepresentable`] is exactly what this says does not hold, except for
    /// `Int4Block`, where it is conservative (its minimum is a group's smallest value,
    /// which may fit where the largest magnitude does not).
    #[must_use]
    pub fn holds(self, max_abs: f32) -> bool {
        match self {
            Self::F16 | Self::Nf4Block(_) | Self::Int4Block(_) => {
                f16::from_f32(max_abs).is_finite()
            }
            Self::Bf16 => bf16::from_f32(max_abs).is_finite(),
            Self::Int8Block(_) => f16::from_f32(max_abs / 127.0).is_finite(),
            Self::Int8 | Self::Int8Rows | Self::Nf4 => max_abs.is_finite(),
        }
    }

    /// Stored bits a weight for rows of `cols` weights (codes, scales, minimums).
    #[must_use]
    pub fn bits_per_weight(self, cols: usize) -> f64 {
        let (n, size, mins) = self.row_params(cols);
        let bytes = self
            .row_code_bytes(cols)
            .saturating_add(n.saturating_mul(size))
            .saturating_add(mins.saturating_mul(2));
        8.0 * bytes as f64 / cols.max(1) as f64
    }
}

impl std::fmt::Display for Format {
    /// The names [`Format::parse`] reads: `f16`, `bf16`, `int8`, `nf4`, `nf4-g64`,
    /// `int4-g64`, `int8-rows`, `int8-g32`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::F16 => f.write_str("f16"),
            Self::Bf16 => f.write_str("bf16"),
            Self::Int8 => f.write_str("int8"),
            Self::Nf4 => f.write_str("nf4"),
            Self::Nf4Block(g) => write!(f, "nf4-g{}", g.get()),
            Self::Int4Block(g) => write!(f, "int4-g{}", g.get()),
            Self::Int8Rows => f.write_str("int8-rows"),
            Self::Int8Block(g) => write!(f, "int8-g{}", g.get()),
        }
    }
}

impl Format {
    /// Every format name [`Format::parse`] accepts.
    pub const NAMES: [&'static str; 14] = [
        "f16",
        "bf16",
        "int8",
        "nf4",
        "nf4-g32",
        "nf4-g64",
        "nf4-g128",
        "int4-g32",
        "int4-g64",
        "int4-g128",
        "int8-rows",
        "int8-g32",
        "int8-g64",
        "int8-g128",
    ];

    /// Reads a format name as [`Format`]'s `Display` writes it (case-insensitive).
    ///
    /// # Errors
    /// [`Error::Shape`] naming the accepted names.
    pub fn parse(name: &str) -> Result<Self> {
        let lower = name.trim().to_ascii_lowercase();
        let group = |g: &str| match g {
            "32" => Some(GroupSize::G32),
            "64" => Some(GroupSize::G64),
            "128" => Some(GroupSize::G128),
            _ => None,
        };
        let f = match lower.as_str() {
            "f16" | "fp16" => Some(Self::F16),
            "bf16" => Some(Self::Bf16),
            "int8" => Some(Self::Int8),
            "nf4" => Some(Self::Nf4),
            "int8-rows" => Some(Self::Int8Rows),
            other => {
                if let Some(g) = other.strip_prefix("nf4-g") {
                    group(g).map(Self::Nf4Block)
                } else if let Some(g) = other.strip_prefix("int4-g") {
                    group(g).map(Self::Int4Block)
                } else if let Some(g) = other.strip_prefix("int8-g") {
                    group(g).map(Self::Int8Block)
                } else {
                    None
                }
            }
        };
        f.ok_or_else(|| {
            Error::Shape(format!(
                "unknown format `{name}` (known: {})",
                Self::NAMES.join(", ")
            ))
        })
    }
}

/// A `[rows, cols]` weight matrix in one format.
#[derive(Debug, Clone, PartialEq)]
pub struct Packed {
    format: Format,
    rows: usize,
    cols: usize,
    /// Row-major codes, `row_code_bytes(cols)` a row.
    codes: Vec<u8>,
    /// Per row (Int8, Int8Rows, Nf4) or per group (blockwise), row-major.
    scales: Vec<f32>,
    /// Int4Block's per-group minimums.
    mins: Vec<f32>,
    /// Layouts of the codes the kernels build in memory on first use.
    pub(crate) layouts: Layouts,
}

/// Layouts of a matrix's codes that the kernels build in memory on first use, for speed:
/// never stored, never compared (two matrices with the same codes are equal whatever was
/// built), and counted by [`Packed::layout_bytes`].
#[derive(Clone, Default)]
pub(crate) struct Layouts {
    /// A 4-bit format's codes (and group scales and minimums) a tile of 16 rows at a time,
    /// for the AVX-512 kernel of batches of 1 to 7 (`kernels::rows8`); or an 8-bit format's
    /// codes (per row, or in groups of 64 or more) a tile of 16 rows at a time in the class
    /// order, biased to unsigned bytes, for the AVX-512 kernel of batch 1
    /// (`kernels::avx512::tile_bytes`).
    pub(crate) tiled: std::sync::OnceLock<Tiled>,
}

/// A matrix's codes, group scales and minimums a tile of 16 rows at a time
/// (`kernels::rows8`'s `tile`).
#[derive(Clone)]
pub(crate) struct Tiled {
    /// For tile `t`, chunk `h` (64 bytes of a row) and row `r`: `((t · chunks + h) · 16 + r)
    /// · 64`.
    pub(crate) codes: Box<[u8]>,
    /// The group scales as f16 bits, for tile `t`, group `g` and row `r` at `(t · groups +
    /// g) · 16 + r`; `None` for the per-row formats and where a scale is not exactly an f16.
    pub(crate) scales: Option<Box<[u16]>>,
    /// `Int4Block`'s minimums as f32, in the scales' order; `None` for other formats.
    pub(crate) mins: Option<Box<[f32]>>,
}

impl Layouts {
    /// Bytes built so far.
    fn bytes(&self) -> usize {
        self.tiled.get().map_or(0, |t| {
            t.codes
                .len()
                .saturating_add(t.scales.as_ref().map_or(0, |s| s.len().saturating_mul(2)))
                .saturating_add(t.mins.as_ref().map_or(0, |m| m.len().saturating_mul(4)))
        })
    }
}

impl PartialEq for Layouts {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl std::fmt::Debug for Layouts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Layouts {{ bytes: {} }}", self.bytes())
    }
}

/// For each byte, its low and high nibble's codebook values.
const fn pair_table(values: [f32; 16]) -> [[f32; 2]; 256] {
    let mut t = [[0.0; 2]; 256];
    let mut i = 0;
    while i < 256 {
        #[allow(clippy::indexing_slicing)] // i < 256 and both nibbles < 16
        {
            t[i] = [values[i & 15], values[i >> 4]];
        }
        #[allow(clippy::arithmetic_side_effects)] // i < 256
        {
            i += 1;
        }
    }
    t
}

const NF4_PAIRS: [[f32; 2]; 256] = pair_table(NF4_CODEBOOK);
const INT4_PAIRS: [[f32; 2]; 256] = pair_table([
    0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
]);

/// Two weights a byte (low nibble first) through `pairs`, then `f`; an odd `out` takes
/// only the last byte's low nibble.
fn decode_pairs(codes: &[u8], out: &mut [f32], pairs: &[[f32; 2]; 256], f: impl Fn(f32) -> f32) {
    let half = out.len() / 2;
    let mut chunks = out.chunks_exact_mut(2);
    for (o, &b) in (&mut chunks).zip(codes) {
        let [lo, hi] = pairs.get(usize::from(b)).copied().unwrap_or_default();
        o.copy_from_slice(&[f(lo), f(hi)]);
    }
    if let (Some(last), Some(&b)) = (chunks.into_remainder().first_mut(), codes.get(half)) {
        *last = f(pairs.get(usize::from(b)).map_or(0.0, |p| p[0]));
    }
}

fn nf4_index(v: f32) -> u8 {
    // midpoints between neighbouring codebook values decide the nearest
    let mut idx = 0u8;
    for pair in NF4_CODEBOOK.windows(2) {
        if let [a, b] = pair
            && v > (a + b) / 2.0
        {
            idx = idx.saturating_add(1);
        }
    }
    idx
}

/// `x` rounded half away from zero and clamped to 0..=15 (0 for NaN): the code
/// `x.round().clamp(0.0, 15.0) as u8` gives, without the library call `round` is on
/// x86-64's baseline (clamping first gives the same code, and on `0..=15` rounding is the
/// integer part plus one where the fraction, exact there, is at least a half).
fn int4_code(x: f32) -> u8 {
    let y = x.clamp(0.0, 15.0);
    let t = y as u8;
    t.saturating_add(u8::from(y - f32::from(t) >= 0.5))
}

fn f16_round(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

/// Index `j` of row `r` of rows of `n` (saturating: within a packed matrix it never does).
const fn flat(r: usize, n: usize, j: usize) -> usize {
    r.saturating_mul(n).saturating_add(j)
}

/// Row `r`'s range in a buffer of rows of `n` (saturating, so past the end it is refused by
/// the `get` it feeds, never wrapped into range).
const fn row_span(r: usize, n: usize) -> std::ops::Range<usize> {
    flat(r, n, 0)..flat(r.saturating_add(1), n, 0)
}

fn set_nibble(codes: &mut [u8], j: usize, q: u8) {
    if let Some(b) = codes.get_mut(j / 2) {
        if j.is_multiple_of(2) {
            *b = (*b & 0xf0) | (q & 0x0f);
        } else {
            *b = (*b & 0x0f) | (q << 4);
        }
    }
}

/// `values / scale`, rounded and clamped to ±127 (an f16 scale may round below
/// absmax / 127), as two's complement bytes; all zeros for a zero scale.
fn int8_codes(values: &[f32], scale: f32, out: &mut [u8]) {
    for (o, &v) in out.iter_mut().zip(values) {
        let q = if scale > 0.0 {
            (v / scale).round().clamp(-127.0, 127.0)
        } else {
            0.0
        };
        *o = (q as i8) as u8;
    }
}

/// Quantizes row-major `[rows, cols]` f32 weights.
///
/// # Errors
/// [`Error::Shape`] when `w.len() != rows * cols` or a dimension is zero,
/// [`Error::NonFinite`] for the first NaN or infinite weight, and
/// [`Error::Unrepresentable`] for a finite weight the format would make infinite (f16
/// past 65,504; a blockwise group whose scale or minimum does not fit f16).
pub fn quantize(w: &[f32], rows: usize, cols: usize, format: Format) -> Result<Packed> {
    if rows == 0 || cols == 0 {
        return Err(Error::Shape(format!(
            "cannot quantize an empty [{rows}, {cols}] matrix"
        )));
    }
    if rows.checked_mul(cols) != Some(w.len()) {
        return Err(Error::Shape(format!(
            "{} weights given for [{rows}, {cols}]",
            w.len()
        )));
    }
    if let Some((index, &value)) = w.iter().enumerate().find(|(_, v)| !v.is_finite()) {
        return Err(Error::NonFinite {
            index,
            row: index.checked_div(cols).unwrap_or(0),
            value,
        });
    }
    let unrepresentable = |index: usize, value: f32, reason: String| Error::Unrepresentable {
        format: format.to_string(),
        index,
        value,
        reason,
    };
    // a finite weight must stay finite: f16 stops at 65,504, and bf16 rounds the very
    // largest f32 values up to infinity (the blockwise formats' scales are checked per
    // group below)
    if matches!(format, Format::F16 | Format::Bf16)
        && let Some(i) = w.iter().position(|v| !format.holds(v.abs()))
    {
        let v = w.get(i).copied().unwrap_or(0.0);
        return Err(unrepresentable(
            i,
            v,
            format!("it rounds to infinity in {format}"),
        ));
    }
    let rb = format.row_code_bytes(cols);
    let mut codes = vec![0u8; rows.saturating_mul(rb)];
    let mut scales = Vec::new();
    let mut mins = Vec::new();
    for (r, (row, out)) in w
        .chunks_exact(cols)
        .zip(codes.chunks_exact_mut(rb))
        .enumerate()
    {
        // a group scale past f16's range: the group's largest weight, by flat index
        let scale_err = |gi: usize, g: usize, group: &[f32]| {
            // the first of the largest (max_by keeps the last, so from the end)
            let (j, v) = group
                .iter()
                .enumerate()
                .rev()
                .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
                .map_or((0, 0.0), |(j, &v)| (j, v));
            unrepresentable(
                flat(r, cols, gi.saturating_mul(g).saturating_add(j)),
                v,
                "its group's scale is past f16's range".into(),
            )
        };
        match format {
            Format::F16 => {
                for (o, &v) in out.chunks_exact_mut(2).zip(row) {
                    o.copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
                }
            }
            Format::Bf16 => {
                for (o, &v) in out.chunks_exact_mut(2).zip(row) {
                    o.copy_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes());
                }
            }
            Format::Int8 | Format::Int8Rows => {
                let absmax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
                let scale = absmax / 127.0;
                int8_codes(row, scale, out);
                scales.push(scale);
            }
            Format::Int8Block(g) => {
                for (gi, (group, out)) in
                    row.chunks(g.get()).zip(out.chunks_mut(g.get())).enumerate()
                {
                    let absmax = group.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let scale =
                        f16_scale(absmax / 127.0).ok_or_else(|| scale_err(gi, g.get(), group))?;
                    // Among the smallest (subnormal) f16 scales, rounding to nearest may
                    // leave the largest weight short of code 127; the next f16 down
                    // reaches it. So the largest magnitude always takes code ±127, and
                    // quantizing the dequantized weights gives the same scale back.
                    let scale = if scale > 0.0 && (absmax / scale).round() < 127.0 {
                        f16::from_bits(f16::from_f32(scale).to_bits().saturating_sub(1)).to_f32()
                    } else {
                        scale
                    };
                    int8_codes(group, scale, out);
                    scales.push(scale);
                }
            }
            Format::Nf4 => {
                let absmax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
                for (j, &v) in row.iter().enumerate() {
                    let q = if absmax > 0.0 {
                        nf4_index(v / absmax)
                    } else {
                        7
                    };
                    set_nibble(out, j, q);
                }
                scales.push(absmax);
            }
            Format::Nf4Block(g) => {
                for (gi, group) in row.chunks(g.get()).enumerate() {
                    let absmax = group.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let scale = f16_scale(absmax).ok_or_else(|| scale_err(gi, g.get(), group))?;
                    for (j, &v) in group.iter().enumerate() {
                        let q = if scale > 0.0 { nf4_index(v / scale) } else { 7 };
                        set_nibble(out, gi.saturating_mul(g.get()).saturating_add(j), q);
                    }
                    scales.push(scale);
                }
            }
            Format::Int4Block(g) => {
                for (gi, group) in row.chunks(g.get()).enumerate() {
                    let lo = group.iter().fold(f32::INFINITY, |m, &v| m.min(v));
                    let hi = group.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                    let min = f16_scale(lo.abs())
                        .ok_or_else(|| scale_err(gi, g.get(), group))?
                        .copysign(lo);
                    // a constant group (a one-weight tail group, say) has no step: every
                    // weight is the minimum, and requantizing gives the same codes
                    let step = if hi > lo {
                        f16_scale((hi - min).max(0.0) / 15.0)
                            .ok_or_else(|| scale_err(gi, g.get(), group))?
                    } else {
                        0.0
                    };
                    for (j, &v) in group.iter().enumerate() {
                        let q = if step > 0.0 {
                            int4_code((v - min) / step)
                        } else {
                            0
                        };
                        set_nibble(out, gi.saturating_mul(g.get()).saturating_add(j), q);
                    }
                    scales.push(step);
                    mins.push(min);
                }
            }
        }
    }
    Ok(Packed {
        format,
        rows,
        cols,
        codes,
        scales,
        mins,
        layouts: Layouts::default(),
    })
}

/// Scale factors tried per group by [`quantize_weighted`], 1.0 (plain absmax) included.
pub const SCALE_GRID: [f32; 15] = [
    0.80, 0.825, 0.85, 0.875, 0.90, 0.925, 0.95, 0.975, 1.0, 1.025, 1.05, 1.075, 1.10, 1.125, 1.15,
];

/// Activation-aware rounding for the blockwise 4-bit formats, as llama.cpp's imatrix
/// quantization does: each group's scale is chosen from [`SCALE_GRID`] times its absmax
/// scale (for `Int4Block`, times its step, the minimum kept) to minimise
/// `Σ_j importance[j] · (w_j - q(w_j))²`, where `importance` holds one weight per column
/// (the per-channel mean x² of the layer's input). Other formats, and an `importance`
/// of the wrong length, quantize exactly as [`quantize`] does.
///
/// # Errors
/// As [`quantize`].
pub fn quantize_weighted(
    w: &[f32],
    rows: usize,
    cols: usize,
    format: Format,
    importance: &[f32],
) -> Result<Packed> {
    let mut p = quantize(w, rows, cols, format)?;
    let Some(g) = format.group().filter(|_| format.code_bits() == 4) else {
        return Ok(p);
    };
    if importance.len() != cols {
        return Ok(p);
    }
    let rb = format.row_code_bytes(cols);
    let ng = cols.div_ceil(g);
    let nf4 = matches!(format, Format::Nf4Block(_));
    if p.scales.len() != rows.saturating_mul(ng) || p.codes.len() != rows.saturating_mul(rb) {
        return Ok(p); // not the layout `quantize` makes: left as it made it
    }
    let mins = &p.mins;
    // rows are independent: each row's scales and codes are its own, so the rows run on
    // all cores and the result does not depend on how many
    p.scales
        .par_chunks_mut(ng.max(1))
        .zip(p.codes.par_chunks_mut(rb.max(1)))
        .zip(w.par_chunks_exact(cols.max(1)))
        .enumerate()
        .for_each(|(r, ((scales, codes), row))| {
            for (gi, (group, imp)) in row.chunks(g).zip(importance.chunks(g)).enumerate() {
                let min = mins.get(flat(r, ng, gi)).copied();
                let Some(&base) = scales.get(gi) else {
                    continue;
                };
                if base <= 0.0 {
                    continue;
                }
                let code = |v: f32, s: f32| -> (u8, f32) {
                    if nf4 {
                        let q = nf4_index(v / s);
                        (
                            q,
                            NF4_CODEBOOK.get(usize::from(q)).copied().unwrap_or(0.0) * s,
                        )
                    } else {
                        let m = min.unwrap_or(0.0);
                        let q = int4_code((v - m) / s);
                        (q, m + f32::from(q) * s)
                    }
                };
                // the base scale, then each grid candidate (f16-rounded; `None` where it
                // is not a positive finite f16): every candidate's weighted error summed in
                // one pass over the group, each sum in the weights' order
                let mut cands = [None; 1 + SCALE_GRID.len()];
                cands[0] = Some(base);
                for (c, f) in cands.iter_mut().skip(1).zip(SCALE_GRID) {
                    let s = f16_round(base * f);
                    *c = (s.is_finite() && s > 0.0).then_some(s);
                }
                let trial = cands.map(|c| c.unwrap_or(base));
                let errs =
                    crate::kernels::candidate_errors(group, imp, &trial, nf4, min.unwrap_or(0.0));
                let mut best = (errs[0], base);
                for (c, &e) in cands.iter().zip(&errs).skip(1) {
                    if let Some(s) = *c
                        && e < best.0
                    {
                        best = (e, s);
                    }
                }
                let s = best.1;
                if let Some(slot) = scales.get_mut(gi) {
                    *slot = s;
                }
                for (j, &v) in group.iter().enumerate() {
                    set_nibble(codes, flat(gi, g, j), code(v, s).0);
                }
            }
        });
    Ok(p)
}

/// GPTQ rounding (Frantar et al., 2022) for the integer formats: each row's weights are
/// rounded one column at a time, and each column's rounding error, divided by the
/// factor's diagonal, is taken off the columns after it in proportion to the factor's
/// row (`U` with `Uᵀ U = (H + λI)⁻¹`, see [`GptqFactor`]), so that the layer's output on
/// inputs with Gram matrix `H` (`Σ x xᵀ` over calibration tokens) changes as little as
/// rounding allows.
///
/// A group's scale (and INT4's minimum) is the one [`quantize_weighted`] chooses for the
/// group's weights as they stand when its first column is reached (errors of earlier
/// columns taken off), against `H`'s diagonal (each input channel's Σ x²); a per-row
/// format's scale is the row's absmax, taken before any rounding. The layout, scales
/// and codes are those of `format`, so anything that reads it reads this; only which
/// code each weight gets differs. With a diagonal `H` no error spreads, and the result
/// is [`quantize_weighted`]'s with `H`'s diagonal as the importance, bit for bit. F16
/// and BF16 have no scale to fit and are returned as [`quantize`] makes them. Rows are
/// independent and run on all cores; the result does not depend on how many.
///
/// # Errors
/// As [`quantize`]; [`Error::Shape`] for a factor of another width.
pub fn quantize_gptq(
    w: &[f32],
    rows: usize,
    cols: usize,
    format: Format,
    factor: &GptqFactor,
) -> Result<Packed> {
    // checks the weights (its errors name the weight in the matrix) and lays out the
    // buffers the rows below fill
    let mut p = quantize(w, rows, cols, format)?;
    if format.code_bits() == 16 {
        return Ok(p);
    }
    if factor.cols() != cols {
        return Err(Error::Shape(format!(
            "a GPTQ factor for {} columns given for {cols}",
            factor.cols()
        )));
    }
    let ng = cols.div_ceil(format.group().unwrap_or(cols).max(1));
    let rb = format.row_code_bytes(cols);
    // each row's scales, minimums and codes, rows in blocks of GPTQ_ROWS run in lockstep
    let done: Vec<Vec<GptqRow>> = w
        .par_chunks(cols.saturating_mul(GPTQ_ROWS))
        .map(|block| crate::kernels::gptq_block(block, cols, format, factor.u(), factor.diag()))
        .collect::<Result<_>>()?;
    let put = |dst: Option<&mut [f32]>, src: &[f32]| {
        for (d, s) in dst.into_iter().flatten().zip(src) {
            *d = *s;
        }
    };
    for (r, (scales, mins, codes)) in done.into_iter().flatten().enumerate() {
        put(p.scales.get_mut(row_span(r, ng)), &scales);
        put(p.mins.get_mut(row_span(r, ng)), &mins);
        for (d, c) in p
            .codes
            .get_mut(row_span(r, rb))
            .into_iter()
            .flatten()
            .zip(&codes)
        {
            *d = *c;
        }
    }
    Ok(p)
}

/// Rows of [`quantize_gptq`] run in lockstep, a block at a time: each column's row of
/// `U` is read once a block, while it is in the first-level cache, instead of once a row.
pub(crate) const GPTQ_ROWS: usize = 8;

/// One row of [`quantize_gptq`]'s result: its scales, minimums and codes.
pub(crate) type GptqRow = (Vec<f32>, Vec<f32>, Vec<u8>);

/// [`quantize_gptq`] on one block of up to [`GPTQ_ROWS`] rows (`block`, row-major, `cols`
/// a row) with the factor's `u` and `diag`, the rows in lockstep: a group's scales for
/// every row of the block, then column by column each row's code and the spread of its
/// error. Each row's operations and their order are those of the row alone. Inlined into
/// each kernel tier's copy (`crate::kernels::gptq_block`), whose vectors widen the
/// spread; with no fused multiply-add written here, every tier gives the same bits.
#[inline(always)]
pub(crate) fn gptq_block_lanes(
    block: &[f32],
    cols: usize,
    format: Format,
    u: &[f32],
    diag: &[f32],
) -> Result<Vec<GptqRow>> {
    struct Row {
        w: Vec<f32>,
        scales: Vec<f32>,
        mins: Vec<f32>,
        codes: Vec<u8>,
        scale: f32,
        min: f32,
    }
    let g = format.group().unwrap_or(cols).max(1);
    let with_min = matches!(format, Format::Int4Block(_));
    let mut rows: Vec<Row> = block
        .chunks_exact(cols)
        .map(|original| Row {
            w: original.to_vec(),
            scales: Vec::with_capacity(cols.div_ceil(g)),
            mins: Vec::new(),
            codes: vec![0u8; format.row_code_bytes(cols)],
            scale: 0.0,
            min: 0.0,
        })
        .collect();
    for (gi, imp) in diag.chunks(g).enumerate() {
        let c0 = gi.saturating_mul(g);
        let end = c0.saturating_add(imp.len());
        for r in &mut rows {
            let group = r.w.get(c0..end).unwrap_or_default();
            let one = quantize_weighted(group, 1, group.len(), format, imp)?;
            r.scale = one.scales.first().copied().unwrap_or(0.0);
            r.min = one.mins.first().copied().unwrap_or(0.0);
            r.scales.push(r.scale);
            if with_min {
                r.mins.push(r.min);
            }
        }
        for i in c0..end {
            let Some(ui) = u.get(row_span(i, cols)) else {
                continue;
            };
            let next = i.saturating_add(1);
            for r in &mut rows {
                let Some(&v) = r.w.get(i) else {
                    continue;
                };
                let (s, m) = (r.scale, r.min);
                let (q, d) = match format {
                    Format::Nf4 | Format::Nf4Block(_) => {
                        let q = if s > 0.0 { nf4_index(v / s) } else { 7 };
                        let c = NF4_CODEBOOK.get(usize::from(q)).copied().unwrap_or(0.0);
                        (q, c * s)
                    }
                    Format::Int4Block(_) => {
                        let q = if s > 0.0 { int4_code((v - m) / s) } else { 0 };
                        (q, m + f32::from(q) * s)
                    }
                    _ => {
                        let q = if s > 0.0 {
                            (v / s).round().clamp(-127.0, 127.0)
                        } else {
                            0.0
                        };
                        ((q as i8) as u8, q * s)
                    }
                };
                if format.code_bits() == 4 {
                    set_nibble(&mut r.codes, i, q);
                } else if let Some(c) = r.codes.get_mut(i) {
                    *c = q;
                }
                // the error, spread over the columns after this one
                let (Some(&uii), Some(after), Some(rest)) =
                    (ui.get(i), ui.get(next..), r.w.get_mut(next..))
                else {
                    continue;
                };
                let e = (v - d) / uii;
                if e != 0.0 {
                    for (x, &f) in rest.iter_mut().zip(after) {
                        *x -= e * f;
                    }
                }
            }
        }
    }
    Ok(rows
        .into_iter()
        .map(|r| (r.scales, r.mins, r.codes))
        .collect())
}

/// The candidate scales [`quantize_weighted`] tries per group: the base scale and each
/// of [`SCALE_GRID`]'s.
pub(crate) const CANDIDATES: usize = 1 + SCALE_GRID.len();

/// The midpoints between neighbouring NF4 codebook values, as [`nf4_index`] computes them.
const NF4_MIDS: [f32; 15] = {
    let mut m = [0f32; 15];
    let mut i = 0;
    while i < 15 {
        #[allow(clippy::indexing_slicing, clippy::arithmetic_side_effects)] // i < 15
        {
            m[i] = (NF4_CODEBOOK[i] + NF4_CODEBOOK[i + 1]) / 2.0;
            i += 1;
        }
    }
    m
};

/// Each candidate scale's error `Σ_j imp[j] · (v_j - q(v_j))²` over one group, every sum
/// in the weights' order: for NF4 (`nf4`) the nearest codebook value times the scale, for
/// `Int4Block` `min` plus the rounded step count times the scale. The same arithmetic as
/// [`nf4_index`] and [`int4_code`] one weight and scale at a time, laid out with the
/// candidates side by side so that each step is one operation over all of them (the
/// compiler's vectors): the nearest NF4 value is the last codebook value whose lower
/// midpoint the weight exceeds, the count [`nf4_index`] takes. Inlined into each kernel
/// tier's copy (`crate::kernels::candidate_errors`), which the vectors widen; with no
/// fused multiply-add written here, every tier gives the same bits.
#[inline(always)]
pub(crate) fn candidate_errors_lanes(
    group: &[f32],
    imp: &[f32],
    trial: &[f32; CANDIDATES],
    nf4: bool,
    min: f32,
) -> [f64; CANDIDATES] {
    let mut errs = [0f64; CANDIDATES];
    let mut near = [0f32; CANDIDATES];
    for (&v, &i) in group.iter().zip(imp) {
        if nf4 {
            let x: [f32; CANDIDATES] = trial.map(|s| v / s);
            let mut cb = [NF4_CODEBOOK[0]; CANDIDATES];
            for (&mid, &next) in NF4_MIDS.iter().zip(NF4_CODEBOOK.iter().skip(1)) {
                for (c, &xk) in cb.iter_mut().zip(&x) {
                    if xk > mid {
                        *c = next;
                    }
                }
            }
            for ((q, &c), &s) in near.iter_mut().zip(&cb).zip(trial) {
                *q = c * s;
            }
        } else {
            for (q, &s) in near.iter_mut().zip(trial) {
                *q = min + f32::from(int4_code((v - min) / s)) * s;
            }
        }
        let i = f64::from(i);
        for (e, &q) in errs.iter_mut().zip(&near) {
            let d = f64::from(v - q);
            *e += i * d * d;
        }
    }
    errs
}

/// A non-negative value rounded to f16, refusing what f16 cannot hold.
/// `v` rounded to f16, or `None` past f16's range.
fn f16_scale(v: f32) -> Option<f32> {
    let s = f16_round(v);
    s.is_finite().then_some(s)
}

impl Packed {
    /// Builds packed weights from their buffers, checking that they fit the format and
    /// shape (lengths, finite scales), as a reader of untrusted bytes must.
    ///
    /// # Errors
    /// [`Error::Malformed`] naming what does not fit.
    pub fn from_parts(
        format: Format,
        rows: usize,
        cols: usize,
        codes: Vec<u8>,
        scales: Vec<f32>,
        mins: Vec<f32>,
    ) -> Result<Self> {
        let (n_scales, _, n_mins) = format.row_params(cols);
        let want = |what: &str, got: usize, per_row: usize| -> Result<()> {
            match rows.checked_mul(per_row) {
                Some(w) if w == got => Ok(()),
                _ => Err(Error::Malformed(format!(
                    "{what}: {got} for {rows} rows of {per_row}"
                ))),
            }
        };
        if rows == 0 || cols == 0 {
            return Err(Error::Malformed(format!("empty shape [{rows}, {cols}]")));
        }
        want("codes", codes.len(), format.row_code_bytes(cols))?;
        want("scales", scales.len(), n_scales)?;
        want("minimums", mins.len(), n_mins)?;
        if let Some(s) = scales.iter().chain(&mins).find(|s| !s.is_finite()) {
            return Err(Error::Malformed(format!("scale {s} is not finite")));
        }
        // a 4-bit row of odd length ends in half a byte: its spare high nibble is zero
        let rb = format.row_code_bytes(cols);
        if format.code_bits() == 4
            && cols % 2 == 1
            && rb > 0
            && let Some(r) = codes
                .chunks_exact(rb)
                .position(|row| row.last().is_some_and(|b| b >> 4 != 0))
        {
            return Err(Error::Malformed(format!(
                "row {r}: the spare nibble after its last code is not zero"
            )));
        }
        Ok(Self {
            format,
            rows,
            cols,
            codes,
            scales,
            mins,
            layouts: Layouts::default(),
        })
    }

    /// The format.
    #[must_use]
    pub fn format(&self) -> Format {
        self.format
    }

    /// Output features (rows).
    #[must_use]
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features (columns).
    #[must_use]
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The code bytes, row-major.
    #[must_use]
    pub fn codes(&self) -> &[u8] {
        &self.codes
    }

    /// The scales (per row or per group, row-major).
    #[must_use]
    pub fn scales(&self) -> &[f32] {
        &self.scales
    }

    /// `Int4Block`'s per-group minimums (empty otherwise).
    #[must_use]
    pub fn mins(&self) -> &[f32] {
        &self.mins
    }

    /// Every byte kept: codes, plus scales and minimums at their stored width (f32 per
    /// row, f16 per group).
    #[must_use]
    pub fn stored_bytes(&self) -> usize {
        let (_, size, _) = self.format.row_params(self.cols);
        self.codes
            .len()
            .saturating_add(self.scales.len().saturating_mul(size))
            .saturating_add(self.mins.len().saturating_mul(2))
    }

    /// Bytes of the in-memory layouts the kernels have built for this matrix so far,
    /// beyond [`Packed::stored_bytes`]: 0 until a product builds one. Today one: on a CPU
    /// whose best tier is AVX-512 VNNI, the first product of a 4-bit matrix at a batch of 1
    /// to 7 copies its codes a tile of 16 rows at a time (one stream for the kernel to
    /// read instead of sixteen): as many bytes as the codes, plus a blockwise format's
    /// scales at their stored f16 width and `Int4Block`'s minimums as f32; likewise the
    /// first product at batch 1 of an INT8 matrix (per row, or in groups of 64 or more) of
    /// 4M weights or more, where the CPU has AVX-512 VBMI (its codes, rows rounded up to 64
    /// bytes and to 16 rows);
    /// `COMPRESSME_REPACK=0` turns it off. The outputs are the same bits either way.
    #[must_use]
    pub fn layout_bytes(&self) -> usize {
        self.layouts.bytes()
    }

    /// Bytes of the same matrix in f32.
    #[must_use]
    pub fn dense_bytes(&self) -> usize {
        self.rows.saturating_mul(self.cols).saturating_mul(4)
    }

    /// Decodes row `r` into `out` (`cols` values).
    pub(crate) fn decode_row(&self, r: usize, out: &mut [f32]) {
        let rb = self.format.row_code_bytes(self.cols);
        let codes = self.codes.get(row_span(r, rb)).unwrap_or(&[]);
        let out = out.get_mut(..self.cols).unwrap_or(&mut []);
        match self.format {
            Format::F16 => {
                let mut bits = [0u16; 64];
                for (o, c) in out.chunks_mut(64).zip(codes.chunks(128)) {
                    for (b, pair) in bits.iter_mut().zip(c.chunks_exact(2)) {
                        if let &[lo, hi] = pair {
                            *b = u16::from_le_bytes([lo, hi]);
                        }
                    }
                    // F16C when the CPU has it (detected at run time by `half`)
                    let n = o.len();
                    if let Some(src) = bits.get(..n) {
                        use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
                        src.reinterpret_cast::<f16>().convert_to_f32_slice(o);
                    }
                }
            }
            Format::Bf16 => {
                for (o, c) in out.iter_mut().zip(codes.chunks_exact(2)) {
                    if let &[lo, hi] = c {
                        *o = bf16::from_bits(u16::from_le_bytes([lo, hi])).to_f32();
                    }
                }
            }
            // INT8 per row is one group of `cols`
            Format::Int8 | Format::Int8Rows | Format::Int8Block(_) => {
                let g = self.format.group().unwrap_or(self.cols).max(1);
                let scales = self
                    .scales
                    .get(row_span(r, self.cols.div_ceil(g)))
                    .unwrap_or(&[]);
                for ((o, c), &s) in out.chunks_mut(g).zip(codes.chunks(g)).zip(scales) {
                    for (v, &b) in o.iter_mut().zip(c) {
                        *v = f32::from(b as i8) * s;
                    }
                }
            }
            Format::Nf4 => {
                let s = self.scales.get(r).copied().unwrap_or(0.0);
                decode_pairs(codes, out, &NF4_PAIRS, |v| v * s);
            }
            Format::Nf4Block(g) => {
                let ng = self.cols.div_ceil(g.get());
                let scales = self.scales.get(row_span(r, ng)).unwrap_or(&[]);
                // groups are an even number of weights: each starts on a byte
                for ((o, c), &s) in out
                    .chunks_mut(g.get())
                    .zip(codes.chunks(g.get() / 2))
                    .zip(scales)
                {
                    decode_pairs(c, o, &NF4_PAIRS, |v| v * s);
                }
            }
            Format::Int4Block(g) => {
                let ng = self.cols.div_ceil(g.get());
                let scales = self.scales.get(row_span(r, ng)).unwrap_or(&[]);
                let mins = self.mins.get(row_span(r, ng)).unwrap_or(&[]);
                for (((o, c), &s), &m) in out
                    .chunks_mut(g.get())
                    .zip(codes.chunks(g.get() / 2))
                    .zip(scales)
                    .zip(mins)
                {
                    decode_pairs(c, o, &INT4_PAIRS, |v| m + v * s);
                }
            }
        }
    }

    /// Dequantizes the whole matrix into `out` (`rows * cols` values).
    ///
    /// # Errors
    /// [`Error::Shape`] when `out` has the wrong length.
    pub fn dequantize_into(&self, out: &mut [f32]) -> Result<()> {
        let n = self.rows.saturating_mul(self.cols);
        if out.len() != n {
            return Err(Error::Shape(format!(
                "output has {} values, need {}",
                out.len(),
                n
            )));
        }
        for (r, row) in out.chunks_exact_mut(self.cols).enumerate() {
            self.decode_row(r, row);
        }
        Ok(())
    }

    /// Dequantizes the rows from `start` on into `out` (a whole number of rows): a tile of
    /// the matrix into a caller's reused buffer.
    ///
    /// # Errors
    /// [`Error::Shape`] when `out` is not a whole number of rows or runs past the end.
    pub fn dequantize_range_into(&self, start: usize, out: &mut [f32]) -> Result<()> {
        let n = out.len().checked_div(self.cols).unwrap_or(0);
        if !out.len().is_multiple_of(self.cols) || start.saturating_add(n) > self.rows {
            return Err(Error::Shape(format!(
                "{} values from row {start} are not whole rows of [{}, {}]",
                out.len(),
                self.rows,
                self.cols
            )));
        }
        for (i, row) in out.chunks_exact_mut(self.cols).enumerate() {
            self.decode_row(start.saturating_add(i), row);
        }
        Ok(())
    }

    /// Dequantizes rows `ids` (any order, repeats allowed), one after another: an
    /// embedding lookup that touches only the requested rows.
    ///
    /// # Errors
    /// [`Error::RowOutOfRange`] for the first id past the end.
    pub fn dequantize_rows(&self, ids: &[usize]) -> Result<Vec<f32>> {
        if let Some(&id) = ids.iter().find(|&&id| id >= self.rows) {
            return Err(Error::RowOutOfRange {
                id,
                rows: self.rows,
            });
        }
        let mut out = vec![0f32; ids.len().saturating_mul(self.cols)];
        for (&id, row) in ids.iter().zip(out.chunks_exact_mut(self.cols)) {
            self.decode_row(id, row);
        }
        Ok(out)
    }
}

/// [`candidate_errors_lanes`] as `quantize_weighted` computed it before the candidates
/// were laid side by side: one weight and one scale at a time, through [`nf4_index`] and
/// [`int4_code`]. The definition the tiers are held to.
#[cfg(test)]
pub(crate) fn candidate_errors_one_by_one(
    group: &[f32],
    imp: &[f32],
    trial: &[f32; CANDIDATES],
    nf4: bool,
    min: f32,
) -> [f64; CANDIDATES] {
    let mut errs = [0f64; CANDIDATES];
    for (&v, &i) in group.iter().zip(imp) {
        for (e, &s) in errs.iter_mut().zip(trial) {
            let q = if nf4 {
                NF4_CODEBOOK
                    .get(usize::from(nf4_index(v / s)))
                    .copied()
                    .unwrap_or(f32::NAN)
                    * s
            } else {
                min + f32::from(int4_code((v - min) / s)) * s
            };
            let d = f64::from(v - q);
            *e += f64::from(i) * d * d;
        }
    }
    errs
}

#[cfg(test)]
mod tests {
    #[test]
    fn int4_codes_are_rounding_then_clamping() {
        let mut probes: Vec<f32> = (-400..=4000).map(|i| i as f32 / 200.0).collect();
        for k in 0..=16u8 {
            let h = f32::from(k) + 0.5;
            probes.extend([
                h,
                f32::from_bits(h.to_bits() + 1),
                f32::from_bits(h.to_bits() - 1),
                f32::from(k),
            ]);
        }
        probes.extend([
            0.5 - f32::EPSILON / 4.0,
            -0.0,
            -0.5,
            -0.49,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            1e30,
            -1e30,
            f32::MIN_POSITIVE,
        ]);
        for x in probes {
            assert_eq!(super::int4_code(x), x.round().clamp(0.0, 15.0) as u8, "{x}");
        }
    }
}
