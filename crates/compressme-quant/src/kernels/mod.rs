//! Matrix multiplication that reads packed weights directly.
//!
//! See [`matmul`] for the arithmetic and its error bound.

use crate::{Error, Format, Packed, Result};

#[cfg(target_arch = "x86_64")]
/// A tier's copies of plain-Rust functions written for the compiler's vectors (each
/// `#[inline(always)]`, with no fused multiply-add written, so every copy gives the same
/// bits): for each `name = path(args) -> ret`, a safe `name(token, args)` that runs
/// `path` compiled with `$features`, which the tier's `Token` proves.
macro_rules! tier_copies {
    ($features:literal: $($name:ident = $path:path, ($($arg:ident: $ty:ty),*) -> $ret:ty;)*) => {$(
        #[doc = concat!("[`", stringify!($path), "`] built for this tier's vectors.")]
        pub(super) fn $name(_: Token, $($arg: $ty),*) -> $ret {
            #[target_feature(enable = $features)]
            fn vectors($($arg: $ty),*) -> $ret {
                $path($($arg),*)
            }
            // SAFETY: the token exists only where the CPU has `$features`; `vectors`
            // reads nothing but its safe arguments.
            unsafe { vectors($($arg),*) }
        }
    )*};
}

/// The copies [`tier_copies`] makes, listed once for every tier that makes them.
#[cfg(target_arch = "x86_64")]
macro_rules! vector_copies {
    ($features:literal) => {
        tier_copies! { $features:
            candidate_errors = crate::format::candidate_errors_lanes,
                (group: &[f32], imp: &[f32], trial: &[f32; crate::format::CANDIDATES], nf4: bool, min: f32)
                -> [f64; crate::format::CANDIDATES];
            gptq_block = crate::format::gptq_block_lanes,
                (block: &[f32], cols: usize, format: crate::Format, u: &[f32], diag: &[f32])
                -> crate::Result<Vec<crate::format::GptqRow>>;
            inverse_factor = crate::gptq::inverse_factor_lanes,
                (gram: &[f64], n: usize, damp: f64) -> crate::Result<Vec<f32>>;
            log_softmax = crate::softmax::log_softmax_lanes, (logits: &[f32], out: &mut [f64]) -> ();
            exp_all = crate::softmax::exp_lanes::<f32>, (v: &[f32], out: &mut [f64]) -> ();
            exp_all_f64 = crate::softmax::exp_lanes::<f64>, (v: &[f64], out: &mut [f64]) -> ();
            kl_sum = crate::softmax::kl_lanes::<f32>, (p: &[f32], ep: &[f64], q: &[f64]) -> f64;
            kl_sum_f64 = crate::softmax::kl_lanes::<f64>, (p: &[f64], ep: &[f64], q: &[f64]) -> f64;
            argmax = crate::softmax::argmax_lanes::<f32>, (v: &[f32]) -> usize;
            argmax_f64 = crate::softmax::argmax_lanes::<f64>, (v: &[f64]) -> usize;
            all_finite = crate::kernels::all_finite_lanes, (x: &[f32]) -> bool;
        }
    };
}

/// Runs `$name($args)` on the widest tier the CPU has ([`vector_copies`]), the plain
/// `$fallback` elsewhere: each tier's copy is the same code, so the bits do not depend
/// on which runs.
macro_rules! widest {
    ($name:ident($($arg:expr),*) else $fallback:path) => {{
        #[cfg(target_arch = "x86_64")]
        {
            if let Some(t) = avx512::Token::detect() {
                return avx512::$name(t, $($arg),*);
            }
            if let Some(t) = avx2::Token::detect() {
                return avx2::$name(t, $($arg),*);
            }
        }
        $fallback($($arg),*)
    }};
}

#[cfg(target_arch = "x86_64")]
/// Runs `$body` (an expression over arrays `$codes` and `$scales` of rows) on the rows
/// from `$first`, four at a time, then one at a time for the rest: the body is expanded
/// for both array lengths.
macro_rules! in_quads {
    ($v:expr, $first:expr, $out:expr, |$codes:ident, $scales:ident| $body:expr) => {{
        let (v, first) = ($v, $first);
        for (i, quad) in $out.chunks_mut(4).enumerate() {
            let r = first + 4 * i;
            if let Ok(quad) = <&mut [f32; 4]>::try_from(&mut *quad) {
                let $codes = [0, 1, 2, 3].map(|k| v.codes_of(r + k));
                let $scales = [0, 1, 2, 3].map(|k| v.scales_of(r + k));
                *quad = $body;
            } else {
                for (k, o) in quad.iter_mut().enumerate() {
                    let $codes = [v.codes_of(r + k)];
                    let $scales = [v.scales_of(r + k)];
                    [*o] = $body;
                }
            }
        }
    }};
}

#[cfg(target_arch = "x86_64")]
#[macro_use]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod amx8;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod avxvnni;
pub(crate) mod ggml;
mod pool;
mod portable;

pub use pool::{in_lanes, single_threaded};
#[cfg(target_arch = "x86_64")]
mod rows8;
#[cfg(target_arch = "x86_64")]
mod split;
#[cfg(target_arch = "x86_64")]
mod tiles;
#[cfg(target_arch = "x86_64")]
mod tiles8;

/// Largest magnitude of a rounded activation: 14-bit fixed point.
pub(crate) const X_MAX: f32 = 8191.0;
/// Per-row formats flush their `i32` sums to f32 this often (no `i32` lane can overflow:
/// 64 pairs of `127 · 8191` products).
const FLUSH: usize = 1024;
/// Weights per step of the integer kernel.
const STEP: usize = 16;
/// Weights per 16 bytes of 4-bit codes: the unit of nibble order.
const NIBBLE_BLOCK: usize = 32;
/// Output rows a task takes.
const ROWS_PER_TASK: usize = 16;
/// Columns of `x` that share one step under [`Activations::Block8`].
const BLOCK8: usize = 32;

/// The NF4 codebook times 127, rounded: the kernels' view of NF4 codes.
pub const NF4_I8: [i8; 16] = [
    -127, -88, -67, -50, -36, -23, -12, 0, 10, 20, 31, 43, 56, 71, 92, 127,
];
/// INT4 codes are their own values.
const INT4_I8: [i8; 16] = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15];

/// Which implementation runs the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Backend {
    /// The tier [`kernel_tier`] picks: the fastest the CPU supports, unless
    /// `COMPRESSME_KERNEL` names another.
    Auto,
    /// Plain Rust, the same arithmetic: what runs on CPUs without AVX2, kept selectable
    /// so tests can hold the SIMD path to it.
    Portable,
    /// A named tier; [`matmul_with`] refuses it by name when the CPU lacks it.
    Tier(Tier),
}

/// A set of kernels for one instruction-set level, chosen at run time. Every SIMD tier
/// gives the same bits for the same product (each computes the same exact `i32` group
/// sums and runs the same f32 operations on them), so a tier changes speed, never
/// results; the portable tier computes the same integer sums and accumulates them in f32
/// in a plainer order (within the same [`error_bound`]). A batch of 8 or more runs on
/// tiles on every SIMD tier (see [`matmul`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum Tier {
    /// Plain Rust.
    Portable,
    /// AVX2, FMA and F16C: 14-bit activations times codes widened to 16 bits
    /// (`vpmaddwd`).
    Avx2,
    /// AVX-VNNI (256-bit `vpdpwssd` and `vpdpbusd`, VEX-encoded: CPUs without AVX-512
    /// have it from Alder Lake on) on top of the AVX2 tier: 4-bit codes at batch 1, in
    /// groups of 64 or more, a pair of runs a step as bytes against the activations split
    /// into high and low bytes; 8-bit codes at batch 2 and up with no separate add.
    /// Everything else (8-bit codes at batch 1 among it, where `vpdpwssd` measured no
    /// faster) runs the AVX2 tier's code. Batches of 8 and more run the tiles with the
    /// 256-bit `vpdpwssd`.
    AvxVnni,
    /// AVX-512 F/BW/VL and AVX-512 VNNI on top of the AVX2 tier: 4-bit codes at batch
    /// 1, in groups of 64, of whole 128s or per row, as bytes against the activations
    /// split into high and low bytes (`vpdpbusd`, 64 products an instruction); 8-bit
    /// codes in long groups (the per-row formats) at batch 2 and up, widened to 16 bits
    /// 32 at a time (`vpdpwssd`); F16/BF16 at batch 2 and up in tiles of 4 weight rows by
    /// 8 rows of `x`. Where those measured no faster (8-bit codes at batch 1, 4-bit groups
    /// of 32, short groups at batch 2 and up, F16/BF16 at batch 1) it runs the AVX2 tier's
    /// code.
    Avx512Vnni,
    /// The AVX-512 VNNI tier with Intel's AMX tiles (AMX-TILE and AMX-INT8, Sapphire
    /// Rapids on; Linux must grant the process the tile state) at batches of 8 and more:
    /// 8-bit codes in long groups (the per-row INT8 formats) with 14-bit activations,
    /// each split exactly into a signed high and an unsigned low byte, 16 x 16 x 64
    /// products a `tdpbssd` or `tdpbsud`, the weights read in place; and every format
    /// under [`Activations::Block8`] (the 4-bit ones by default), 16 x 16 x 32 products a
    /// `tdpbssd`, the weights decoded a task at a time into a block-major copy. The same
    /// bits as the AVX-512 VNNI tier; everything else runs its code.
    Avx512Amx,
}

impl Tier {
    /// Every tier, slowest first.
    pub const ALL: [Self; 5] = [
        Self::Portable,
        Self::Avx2,
        Self::AvxVnni,
        Self::Avx512Vnni,
        Self::Avx512Amx,
    ];

    /// The name `COMPRESSME_KERNEL` takes.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Portable => "portable",
            Self::Avx2 => "avx2",
            Self::AvxVnni => "avx-vnni",
            Self::Avx512Vnni => "avx512-vnni",
            Self::Avx512Amx => "avx512-amx",
        }
    }

    /// The tier a name stands for.
    #[must_use]
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.name() == name)
    }

    /// The CPU features the tier needs, as `lscpu` names them.
    #[must_use]
    pub fn needs(self) -> &'static str {
        match self {
            Self::Portable => "nothing",
            Self::Avx2 => "avx2, fma, f16c",
            Self::AvxVnni => "avx2, fma, f16c, avx_vnni",
            Self::Avx512Vnni => "avx2, fma, f16c, avx512f, avx512bw, avx512vl, avx512_vnni",
            Self::Avx512Amx => {
                "avx2, fma, f16c, avx512f, avx512bw, avx512vl, avx512_vnni, amx_tile, amx_int8 (and Linux's permission)"
            }
        }
    }

    /// Whether this CPU runs the tier.
    #[must_use]
    pub fn supported(self) -> bool {
        Isa::of(self).is_some()
    }

    /// The fastest tier this CPU runs.
    #[must_use]
    pub fn best() -> Self {
        Self::ALL
            .into_iter()
            .rev()
            .find(|t| t.supported())
            .unwrap_or(Self::Portable)
    }
}

impl std::fmt::Display for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The tier [`Backend::Auto`] runs: `COMPRESSME_KERNEL` when it is set (read once a
/// process), otherwise [`Tier::best`].
///
/// # Errors
/// [`Error::Kernel`] when `COMPRESSME_KERNEL` names no tier, or one this CPU lacks.
pub fn kernel_tier() -> Result<Tier> {
    static CHOSEN: std::sync::OnceLock<std::result::Result<Tier, String>> =
        std::sync::OnceLock::new();
    CHOSEN
        .get_or_init(|| match std::env::var("COMPRESSME_KERNEL") {
            Err(_) => Ok(Tier::best()),
            Ok(name) => match Tier::from_name(name.trim()) {
                None => Err(format!(
                    "COMPRESSME_KERNEL={name}: no such tier (one of {})",
                    Tier::ALL.map(Tier::name).join(", ")
                )),
                Some(t) if !t.supported() => Err(format!(
                    "COMPRESSME_KERNEL={name}: this CPU lacks what the tier needs ({})",
                    t.needs()
                )),
                Some(t) => Ok(t),
            },
        })
        .clone()
        .map_err(Error::Kernel)
}

/// How the integer kernels round activations on the SIMD tiers (the portable tier and
/// F16/BF16 always run 14-bit activations).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Activations {
    /// What [`activations_for`] picks for the weights' format: `COMPRESSME_ACTIVATIONS`
    /// when it is set, otherwise [`Activations::default_for`] (8-bit activations for the
    /// 4-bit formats, 14-bit for the 8-bit ones).
    Auto,
    /// Each row of `x` in 14-bit fixed point with one step a row: the error
    /// [`error_bound`] states.
    Fixed14,
    /// Each block of 32 values of a row in 8 bits with its own step, as llama.cpp's and
    /// candle's Q8 activations: the tiles multiply bytes by bytes (`vpdpbusd` on the VNNI
    /// tiers, 64 products an instruction on AVX-512 against 32 for 14-bit activations),
    /// within [`error_bound_block8`]. A row of `x` gives the same bits in a batch of any
    /// size for the 4-bit formats (batches of 7 or less run their own kernel with the
    /// tiles' arithmetic); the 8-bit formats take 8-bit activations at batches of 8 and
    /// more only. Formats whose groups are not whole blocks of 32 keep 14-bit activations.
    Block8,
}

impl Activations {
    /// The name `COMPRESSME_ACTIVATIONS` takes: `14`, `8` or `auto`.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Fixed14 => "14",
            Self::Block8 => "8",
        }
    }

    /// The choice a name stands for (`14`, `8` or `auto`).
    #[must_use]
    pub fn from_name(name: &str) -> Option<Self> {
        [Self::Auto, Self::Fixed14, Self::Block8]
            .into_iter()
            .find(|a| a.name() == name)
    }

    /// The default for a format, where its error budget allows 8 bits: the 4-bit
    /// formats, whose own rounding dominates, take [`Activations::Block8`] (on
    /// SmolLM2-135M it added 1-2% to NF4-g64's KL divergence from the f32 model); the
    /// 8-bit formats keep [`Activations::Fixed14`] (8-bit activations multiplied
    /// INT8-g32's KL by 3.8 there, to candle Q8_0's level); F16 and BF16 multiply in f32.
    #[must_use]
    pub fn default_for(format: Format) -> Self {
        if format.code_bits() == 4 {
            Self::Block8
        } else {
            Self::Fixed14
        }
    }
}

/// Whether the kernels may build in-memory layouts of a matrix (today `rows8`'s tiled
/// layout and `avx512::tile_bytes`', see [`Packed::layout_bytes`]): unless
/// `COMPRESSME_REPACK` is `0` (read once a process).
#[cfg(target_arch = "x86_64")]
fn repack() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("COMPRESSME_REPACK").map_or(true, |v| v.trim() != "0"))
}

/// The activations [`Activations::Auto`] runs for `format`: `COMPRESSME_ACTIVATIONS`
/// (`14` or `8`, for every format; read once a process) when it is set to one of them,
/// otherwise [`Activations::default_for`].
///
/// # Errors
/// [`Error::Kernel`] when `COMPRESSME_ACTIVATIONS` names no choice.
pub fn activations_for(format: Format) -> Result<Activations> {
    static CHOSEN: std::sync::OnceLock<std::result::Result<Activations, String>> =
        std::sync::OnceLock::new();
    let chosen = CHOSEN
        .get_or_init(|| match std::env::var("COMPRESSME_ACTIVATIONS") {
            Err(_) => Ok(Activations::Auto),
            Ok(name) => Activations::from_name(name.trim())
                .ok_or_else(|| format!("COMPRESSME_ACTIVATIONS={name}: not one of 14, 8, auto")),
        })
        .clone()
        .map_err(Error::Kernel)?;
    Ok(match chosen {
        Activations::Auto => Activations::default_for(format),
        a => a,
    })
}

/// The fewest 8-bit codes (weights) a matrix has for the AVX-512 tier's batch-1 `vpdpbusd`
/// kernel ([`avx512`]'s `byte_rows_imp`): below it, splitting `x` each product costs more
/// than the kernel saves. `tier_probe int8 3000 all 1 auto N` on Zen 5, one thread, that
/// kernel against the AVX2 code: N = 576 0.010 against 0.007 ms, 1,024 0.021 against
/// 0.019, 1,536 0.041 both, 2,048 0.067 against 0.069, 3,072 0.130 against 0.146, 4,096
/// 0.238 against 0.259. On Zen 4 that kernel is not used at all
/// ([`avx512::double_pumped`]).
#[cfg(target_arch = "x86_64")]
const SPLIT8_MIN_CODES: usize = 1 << 22;

/// [`crate::format::candidate_errors_lanes`] compiled for the widest vectors the CPU has.
pub(crate) fn candidate_errors(
    group: &[f32],
    imp: &[f32],
    trial: &[f32; crate::format::CANDIDATES],
    nf4: bool,
    min: f32,
) -> [f64; crate::format::CANDIDATES] {
    widest!(candidate_errors(group, imp, trial, nf4, min) else crate::format::candidate_errors_lanes)
}

/// [`crate::format::gptq_block_lanes`] compiled for the widest vectors the CPU has.
pub(crate) fn gptq_block(
    block: &[f32],
    cols: usize,
    format: Format,
    u: &[f32],
    diag: &[f32],
) -> Result<Vec<crate::format::GptqRow>> {
    widest!(gptq_block(block, cols, format, u, diag) else crate::format::gptq_block_lanes)
}

/// [`crate::gptq::inverse_factor_lanes`] compiled for the widest vectors the CPU has.
pub(crate) fn inverse_factor(gram: &[f64], n: usize, damp: f64) -> Result<Vec<f32>> {
    widest!(inverse_factor(gram, n, damp) else crate::gptq::inverse_factor_lanes)
}

/// [`crate::softmax::log_softmax_lanes`] compiled for the widest vectors the CPU has.
pub(crate) fn log_softmax(logits: &[f32], out: &mut [f64]) {
    widest!(log_softmax(logits, out) else crate::softmax::log_softmax_lanes)
}

/// [`crate::softmax::exp_lanes`] (f32 values) compiled for the widest vectors the CPU has.
pub(crate) fn exp_all(v: &[f32], out: &mut [f64]) {
    widest!(exp_all(v, out) else crate::softmax::exp_lanes::<f32>)
}

/// [`crate::softmax::exp_lanes`] (f64 values) compiled for the widest vectors the CPU has.
pub(crate) fn exp_all_f64(v: &[f64], out: &mut [f64]) {
    widest!(exp_all_f64(v, out) else crate::softmax::exp_lanes::<f64>)
}

/// [`crate::softmax::kl_lanes`] (f32 log-probabilities) compiled for the widest vectors
/// the CPU has.
pub(crate) fn kl_sum(p: &[f32], ep: &[f64], q: &[f64]) -> f64 {
    widest!(kl_sum(p, ep, q) else crate::softmax::kl_lanes::<f32>)
}

/// [`crate::softmax::kl_lanes`] (f64 log-probabilities) compiled for the widest vectors
/// the CPU has.
pub(crate) fn kl_sum_f64(p: &[f64], ep: &[f64], q: &[f64]) -> f64 {
    widest!(kl_sum_f64(p, ep, q) else crate::softmax::kl_lanes::<f64>)
}

/// [`crate::softmax::argmax_lanes`] (f32) compiled for the widest vectors the CPU has.
pub(crate) fn argmax(v: &[f32]) -> usize {
    widest!(argmax(v) else crate::softmax::argmax_lanes::<f32>)
}

/// [`crate::softmax::argmax_lanes`] (f64) compiled for the widest vectors the CPU has.
pub(crate) fn argmax_f64(v: &[f64]) -> usize {
    widest!(argmax_f64(v) else crate::softmax::argmax_lanes::<f64>)
}

/// The instruction set a call runs with.
#[derive(Debug, Clone, Copy)]
enum Isa {
    #[cfg(target_arch = "x86_64")]
    Avx2(avx2::Token),
    #[cfg(target_arch = "x86_64")]
    AvxVnni(avxvnni::Token),
    #[cfg(target_arch = "x86_64")]
    Avx512(avx512::Token),
    Portable,
}

impl Isa {
    /// The tier's instruction set, when the CPU has it.
    fn of(tier: Tier) -> Option<Self> {
        match tier {
            Tier::Portable => Some(Self::Portable),
            #[cfg(target_arch = "x86_64")]
            Tier::Avx2 => avx2::Token::detect().map(Self::Avx2),
            #[cfg(target_arch = "x86_64")]
            Tier::AvxVnni => avxvnni::Token::detect().map(Self::AvxVnni),
            #[cfg(target_arch = "x86_64")]
            Tier::Avx512Vnni => avx512::Token::detect().map(Self::Avx512),
            #[cfg(target_arch = "x86_64")]
            Tier::Avx512Amx => avx512::Token::detect()
                .and_then(avx512::Token::with_amx)
                .map(Self::Avx512),
            #[cfg(not(target_arch = "x86_64"))]
            _ => None,
        }
    }

    fn pick(backend: Backend) -> Result<Self> {
        let tier = match backend {
            Backend::Auto => kernel_tier()?,
            Backend::Portable => Tier::Portable,
            Backend::Tier(t) => t,
        };
        Self::of(tier).ok_or_else(|| {
            Error::Kernel(format!(
                "kernel tier {tier}: this CPU lacks what it needs ({})",
                tier.needs()
            ))
        })
    }

    /// The code that runs batches of [`tiles::MIN_BATCH`] and more, on the SIMD tiers.
    #[cfg(target_arch = "x86_64")]
    fn tiles(self) -> Option<tiles::Kind> {
        match self {
            Self::Avx2(t) => Some(tiles::Kind::Avx2(t)),
            Self::AvxVnni(t) => Some(tiles::Kind::AvxVnni(t)),
            Self::Avx512(t) => Some(tiles::Kind::Avx512(t)),
            Self::Portable => None,
        }
    }

    /// `x` prepared once a product for [`Isa::dot_rows`] on this tier.
    fn row_input<'x>(self, x: &'x [i16], v: &RowsView<'_>) -> RowX<'x> {
        match self {
            #[cfg(target_arch = "x86_64")]
            Self::Avx512(_) | Self::AvxVnni(_) if v.lut.is_some() && split::splits(v.group) => {
                RowX {
                    x,
                    split: Some(split::SplitX::new(x, v.group)),
                }
            }
            // 8-bit codes: the AVX-512 tier's `vpdpbusd` kernel, which needs `vpermb`, on a
            // matrix large enough to pay for splitting `x`
            Self::Avx512(_)
                if v.lut.is_none()
                    && split::splits(v.group)
                    && v.codes.len() >= SPLIT8_MIN_CODES
                    && avx512::vbmi()
                    && !avx512::double_pumped() =>
            {
                RowX {
                    x,
                    split: Some(split::SplitX::new_bytes(x, v.group)),
                }
            }
            _ => RowX {
                x,
                #[cfg(target_arch = "x86_64")]
                split: None,
            },
        }
    }

    /// `Σ_g scales[g] · Σ_{j in g} w_j x_j` for each `x` row (`N` of them).
    fn dot_groups<const N: usize>(
        self,
        w: &[i8],
        xs: [&[i16]; N],
        group: usize,
        scales: &[f32],
    ) -> [f32; N] {
        match self {
            #[cfg(target_arch = "x86_64")]
            Self::Avx2(t) => avx2::dot_groups(t, w, xs, group, scales),
            #[cfg(target_arch = "x86_64")]
            Self::AvxVnni(t) => avxvnni::dot_groups(t, w, xs, group, scales),
            #[cfg(target_arch = "x86_64")]
            Self::Avx512(t) => avx512::dot_groups(t, w, xs, group, scales),
            Self::Portable => portable::dot_groups(w, xs, group, scales),
        }
    }

    /// [`Isa::dot_groups`] reading 4-bit codes (whole 16-byte runs) through `lut` as it
    /// goes, against `x` rows in nibble order.
    fn dot_nibbles<const N: usize>(
        self,
        codes: &[u8],
        lut: &[i8; 16],
        xs: [&[i16]; N],
        group: usize,
        scales: &[f32],
    ) -> [f32; N] {
        match self {
            #[cfg(target_arch = "x86_64")]
            Self::Avx2(t) => avx2::dot_nibbles(t, codes, lut, xs, group, scales),
            #[cfg(target_arch = "x86_64")]
            Self::AvxVnni(t) => avx2::dot_nibbles(t.avx2(), codes, lut, xs, group, scales),
            #[cfg(target_arch = "x86_64")]
            Self::Avx512(t) => avx2::dot_nibbles(t.avx2(), codes, lut, xs, group, scales),
            Self::Portable => portable::dot_nibbles(codes, lut, xs, group, scales),
        }
    }

    /// Rows `first..first + out.len()` of an integer matrix against one fixed-point `x`
    /// row, reading the stored codes in place: each the same bits as [`Isa::dot_groups`]
    /// or [`Isa::dot_nibbles`] gives for that row.
    fn dot_rows(self, v: &RowsView<'_>, first: usize, x: &RowX<'_>, out: &mut [f32]) {
        match self {
            #[cfg(target_arch = "x86_64")]
            Self::Avx2(t) => avx2::dot_rows(t, v, first, x.x, out),
            #[cfg(target_arch = "x86_64")]
            Self::AvxVnni(t) => avxvnni::dot_rows(t, v, first, x.x, x.split.as_ref(), out),
            #[cfg(target_arch = "x86_64")]
            Self::Avx512(t) => avx512::dot_rows(t, v, first, x.x, x.split.as_ref(), out),
            Self::Portable => portable::dot_rows(v, first, x.x, out),
        }
    }

    /// 4-bit indices through `lut` into `out` in nibble order: for each run of 16 bytes,
    /// their 16 low nibbles, then their 16 high nibbles (a shorter last run leaves gaps).
    fn decode_nibbles(self, codes: &[u8], lut: &[i8; 16], out: &mut [i8]) {
        match self {
            #[cfg(target_arch = "x86_64")]
            Self::Avx2(t) => avx2::decode_nibbles(t, codes, lut, out),
            #[cfg(target_arch = "x86_64")]
            Self::AvxVnni(t) => avx2::decode_nibbles(t.avx2(), codes, lut, out),
            #[cfg(target_arch = "x86_64")]
            Self::Avx512(t) => avx2::decode_nibbles(t.avx2(), codes, lut, out),
            Self::Portable => portable::decode_nibbles(codes, lut, out),
        }
    }

    /// `Σ a_j b_j` in f32.
    fn dot_f32(self, a: &[f32], b: &[f32]) -> f32 {
        match self {
            #[cfg(target_arch = "x86_64")]
            Self::Avx2(t) => avx2::dot_f32(t, a, b),
            #[cfg(target_arch = "x86_64")]
            Self::AvxVnni(t) => avx2::dot_f32(t.avx2(), a, b),
            #[cfg(target_arch = "x86_64")]
            Self::Avx512(t) => avx2::dot_f32(t.avx2(), a, b),
            Self::Portable => portable::dot_f32(a, b),
        }
    }

    /// `Σ_j half(codes_j) · x_j` for each `x` row; `bf16` picks the half format.
    fn dot_half<const N: usize>(self, codes: &[u8], bf16: bool, xs: [&[f32]; N]) -> [f32; N] {
        match self {
            #[cfg(target_arch = "x86_64")]
            Self::Avx2(t) => avx2::dot_half(t, codes, bf16, xs),
            #[cfg(target_arch = "x86_64")]
            Self::AvxVnni(t) => avx2::dot_half(t.avx2(), codes, bf16, xs),
            #[cfg(target_arch = "x86_64")]
            Self::Avx512(t) => avx2::dot_half(t.avx2(), codes, bf16, xs),
            Self::Portable => portable::dot_half(codes, bf16, xs),
        }
    }
}

/// `x` must be `[batch, cols]`.
pub(crate) fn check_input(x: &[f32], batch: usize, cols: usize) -> Result<()> {
    if batch.checked_mul(cols) == Some(x.len()) {
        return Ok(());
    }
    let need = batch.saturating_mul(cols);
    Err(Error::Shape(format!(
        "x has {} values, [{batch}, {cols}] needs {need}",
        x.len()
    )))
}

/// Dot product with eight independent accumulators, so the compiler can vectorize it.
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for ((s, &p), &q) in acc.iter_mut().zip(x).zip(y) {
            *s += p * q;
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// One row of `x` for [`Isa::dot_rows`], with what the tier prepared from it.
struct RowX<'x> {
    x: &'x [i16],
    #[cfg(target_arch = "x86_64")]
    split: Option<split::SplitX>,
}

/// Rows of `x` rounded to 14-bit fixed point, each padded with zeros to `kp` values.
///
/// For the 4-bit formats each block of 32 values is stored in nibble order (the 16 even
/// positions, then the 16 odd ones), the order in which a 16-byte run of packed codes
/// yields its low and then its high nibbles, so decoding needs no interleave.
struct FixedX {
    kp: usize,
    q: Vec<i16>,
    /// One step per row: `x ≈ d · q`.
    d: Vec<f32>,
}

/// `q.round().clamp(-X_MAX, X_MAX) as i16` for a finite `q` (rounding half away from
/// zero), without a call to the C library's `roundf`, so the loop vectorizes: `q` is at
/// most a little past `X_MAX` in magnitude, so its truncation is exact in `i32`, and
/// so is `q - trunc(q)` in f32 (two values less than 1 apart).
#[inline(always)]
fn round_fixed(q: f32) -> i16 {
    // a no-op for the values the kernels make; keeps any other value's truncation in range
    let q = q.clamp(-(X_MAX + 1.0), X_MAX + 1.0);
    let t = q as i32;
    let frac = q - t as f32;
    let r = t + i32::from(frac >= 0.5) - i32::from(frac <= -0.5);
    r.clamp(-(X_MAX as i32), X_MAX as i32) as i16
}

/// `(pre, inv)` so that `(v · pre) · inv` is `v · max / absmax` for `|v| <= absmax`
/// without overflow: `pre = 1` (the product is then `v · inv` exactly) unless `max / absmax`
/// is infinite (an `absmax` below about `max / 3.4e38`, subnormal activations), when `v`
/// and `absmax` are first scaled by `2^100`, exactly.
#[inline(always)]
fn prescale(absmax: f32, max: f32) -> (f32, f32) {
    let inv = max / absmax;
    if inv.is_finite() {
        (1.0, inv)
    } else {
        let pre = f32::from_bits((127 + 100) << 23);
        (pre, max / (absmax * pre))
    }
}

/// Where value `j` of a row goes in nibble order.
fn nibble_slot(j: usize) -> usize {
    let (block, i) = (j / NIBBLE_BLOCK, j % NIBBLE_BLOCK);
    block * NIBBLE_BLOCK + (i % 2) * (NIBBLE_BLOCK / 2) + i / 2
}

/// Values (of `x` rounded for a product, or of its output transposed) from which that
/// work is shared on the kernel pool's threads: below it one thread, where sharing (a
/// few microseconds) would be a large part of it.
const SHARE_MIN_VALUES: usize = 1 << 15;

/// One finite row of `x` rounded to 14-bit fixed point into `out` (in nibble order when
/// `nibbles`: each block of 32, its even positions, then its odd ones); its step. The
/// SIMD tiers run the same code compiled for their instructions (element by element, so
/// the same bits: nothing here is reassociated or fused).
fn fixed_row(isa: Isa, row: &[f32], out: &mut [i16], nibbles: bool) -> f32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512(t) => avx512::fixed_row(t, row, out, nibbles),
        #[cfg(target_arch = "x86_64")]
        Isa::AvxVnni(t) => avx2::fixed_row(t.avx2(), row, out, nibbles),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2(t) => avx2::fixed_row(t, row, out, nibbles),
        Isa::Portable => fixed_row_body(row, out, nibbles),
    }
}

/// [`fixed_row`]'s code, inlined into each tier's copy.
#[inline(always)]
fn fixed_row_body(row: &[f32], out: &mut [i16], nibbles: bool) -> f32 {
    let absmax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
    if absmax > 0.0 {
        let (pre, inv) = prescale(absmax, X_MAX);
        let fixed = |v: f32| round_fixed((v * pre) * inv);
        if nibbles {
            let blocks = row.chunks_exact(NIBBLE_BLOCK);
            let tail = blocks.remainder();
            for (block, o) in blocks.zip(out.chunks_exact_mut(NIBBLE_BLOCK)) {
                let (even, odd) = o.split_at_mut(NIBBLE_BLOCK / 2);
                for ((e, d), v) in even.iter_mut().zip(odd).zip(block.chunks_exact(2)) {
                    (*e, *d) = (fixed(v[0]), fixed(v[1]));
                }
            }
            let done = row.len() - tail.len();
            for (j, &v) in tail.iter().enumerate() {
                if let Some(o) = out.get_mut(nibble_slot(done + j)) {
                    *o = fixed(v);
                }
            }
        } else {
            for (o, &v) in out.iter_mut().zip(row) {
                *o = fixed(v);
            }
        }
    }
    absmax / X_MAX
}

impl FixedX {
    /// `None` when a value is not finite. Rows are independent, so a large `x` is rounded
    /// a run of rows at a time on the kernel pool's threads, with the same bits.
    fn new(isa: Isa, x: &[f32], batch: usize, cols: usize, nibbles: bool) -> Option<Self> {
        let pad = if nibbles { NIBBLE_BLOCK } else { STEP };
        let kp = cols.div_ceil(pad) * pad;
        let mut q = vec![0i16; batch * kp];
        let mut d = vec![0f32; batch];
        if kp == 0 {
            return Some(Self { kp, q, d });
        }
        let finite = std::sync::atomic::AtomicBool::new(true);
        // rows `first..` of x into `q` and `d`
        let rows = |first: usize, (q, d): (&mut [i16], &mut [f32])| {
            for (i, (out, scale)) in q.chunks_exact_mut(kp).zip(d).enumerate() {
                let b = first + i;
                let Some(row) = x.get(b * cols..(b + 1) * cols) else {
                    return;
                };
                if !all_finite(row) {
                    finite.store(false, std::sync::atomic::Ordering::Relaxed);
                    return;
                }
                *scale = fixed_row(isa, row, out, nibbles);
            }
        };
        let per = batch.div_ceil(4 * pool::threads()).max(1);
        let parts = q.chunks_mut(per * kp).zip(d.chunks_mut(per)).collect();
        let share = batch.saturating_mul(cols) >= SHARE_MIN_VALUES;
        pool::each(share, parts, &|i, part| rows(i * per, part));
        finite.into_inner().then_some(Self { kp, q, d })
    }

    fn row(&self, b: usize) -> &[i16] {
        self.q.get(b * self.kp..(b + 1) * self.kp).unwrap_or(&[])
    }

    /// Per row, the sum of `q` over each group of `group` columns (for `Int4Block`'s
    /// minimums), as f32 (exact: at most 128 · 8191 in magnitude).
    fn group_sums(&self, group: usize, groups: usize) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.d.len() * groups);
        for b in 0..self.d.len() {
            let row = self.row(b);
            out.extend(
                row.chunks(group)
                    .take(groups)
                    .map(|c| c.iter().map(|&v| i32::from(v)).sum::<i32>() as f32),
            );
        }
        out
    }
}

/// A weight row in the kernels' integer view: `w_j = scales[j / group] · codes[j]`
/// (+ `mins[j / group]`).
struct IntRow {
    codes: Vec<i8>,
    group: usize,
    scales: Vec<f32>,
    /// The table of a 4-bit format.
    lut: Option<&'static [i8; 16]>,
}

impl IntRow {
    fn new(kp: usize) -> Self {
        Self {
            codes: vec![0; kp],
            group: FLUSH,
            scales: Vec::new(),
            lut: None,
        }
    }

    /// Takes row `r` of `w` (an integer format): its scales, and its codes unless `decode`
    /// is false (a 4-bit row then stays packed for [`Isa::dot_nibbles`]).
    fn load(&mut self, isa: Isa, w: &Packed, r: usize, decode: bool) {
        let cols = w.cols();
        let rb = w.format().row_code_bytes(cols);
        let codes = w.codes().get(r * rb..(r + 1) * rb).unwrap_or(&[]);
        let kp = self.codes.len();
        let v = RowsView::new(w, kp);
        let scales = v.scales_of(r);
        (self.group, self.lut) = (v.group, v.lut);
        self.scales.clear();
        self.scales.extend(scales.values());
        // a long row's successor into L2 while this one is multiplied: the hardware's
        // stream stops at each 4 KiB page, and a row of 4,096 8-bit codes is a page (INT8
        // per row, one thread on AMD Zen 4, best of 30, three alternations: from memory,
        // batch 2, 11008 x 4096 2.92-2.95 ms against 4.42-4.45 without, 4096 x 11008
        // 4.18-4.47 against 4.58-4.87; batch 4 6.31-6.77 against 7.58-8.05 and 6.08-6.36
        // against 6.50-6.79; from L3, 4096 x 4096, 2-3% slower: 1.06-1.20 against
        // 1.02-1.09 at batch 2, 1.78-1.79 against 1.70-1.74 at batch 4; short rows keep
        // the hardware's stream alone)
        #[cfg(target_arch = "x86_64")]
        if avx2::long_row(rb) {
            avx2::prefetch_l2(w.codes().get((r + 1) * rb..(r + 2) * rb).unwrap_or(&[]));
        }
        match (w.format(), self.lut) {
            (Format::Int8 | Format::Int8Rows | Format::Int8Block(_), _) => {
                for (o, &c) in self.codes.iter_mut().zip(codes) {
                    *o = c as i8;
                }
            }
            (_, Some(lut)) if decode => isa.decode_nibbles(codes, lut, &mut self.codes),
            _ => {}
        }
        // Positions past the row's codes (padding nibbles, or codes left from the previous
        // row) meet zeros in x, so they add nothing.
    }
}

/// The scale of each group of one weight row, as the integer kernels apply it to the
/// group's `i32` sum.
#[derive(Debug, Clone, Copy)]
enum RowScales<'a> {
    /// Blockwise formats: the stored scales, each times `k` (`1 / 127` for NF4's table).
    Groups(&'a [f32], f32),
    /// Per-row formats: the row's one scale, for each of `n` flushes of [`FLUSH`] columns.
    Row(f32, usize),
}

impl RowScales<'_> {
    fn len(self) -> usize {
        match self {
            Self::Groups(s, _) => s.len(),
            Self::Row(_, n) => n,
        }
    }

    fn get(self, g: usize) -> f32 {
        match self {
            Self::Groups(s, k) => s.get(g).map_or(0.0, |v| v * k),
            Self::Row(s, n) => {
                if g < n {
                    s
                } else {
                    0.0
                }
            }
        }
    }

    /// Every group's scale, in order.
    fn values(self) -> impl Iterator<Item = f32> {
        (0..self.len()).map(move |g| self.get(g))
    }
}

/// An integer matrix in the kernels' view, worked out once a product: each row's stored
/// codes and scales, the group size and, for a 4-bit format, the table its codes index.
#[derive(Debug, Clone, Copy)]
struct RowsView<'a> {
    codes: &'a [u8],
    scales: &'a [f32],
    row_bytes: usize,
    group: usize,
    lut: Option<&'static [i8; 16]>,
    rule: ScaleRule,
}

/// How a row's scales come from the stored ones.
#[derive(Debug, Clone, Copy)]
enum ScaleRule {
    /// `per_row` stored scales a row, each times `k`.
    Groups { per_row: usize, k: f32 },
    /// One stored scale a row, divided by `div`, for each of `flushes` flushes (per-row
    /// formats sum [`FLUSH`] columns at a time).
    Row { div: f32, flushes: usize },
}

impl<'a> RowsView<'a> {
    /// `w` (an integer format) with rows of `kp` padded columns.
    fn new(w: &'a Packed, kp: usize) -> Self {
        let flushes = kp.div_ceil(FLUSH);
        let (group, lut, rule) = match w.format() {
            Format::Nf4Block(g) => (
                g.get(),
                Some(&NF4_I8),
                ScaleRule::Groups {
                    per_row: w.cols().div_ceil(g.get()),
                    k: 1.0 / 127.0,
                },
            ),
            Format::Int8Block(g) => (
                g.get(),
                None,
                ScaleRule::Groups {
                    per_row: w.cols().div_ceil(g.get()),
                    k: 1.0,
                },
            ),
            Format::Int4Block(g) => (
                g.get(),
                Some(&INT4_I8),
                ScaleRule::Groups {
                    per_row: w.cols().div_ceil(g.get()),
                    k: 1.0,
                },
            ),
            Format::Nf4 => (
                FLUSH,
                Some(&NF4_I8),
                ScaleRule::Row {
                    div: 127.0,
                    flushes,
                },
            ),
            Format::Int8 | Format::Int8Rows => (FLUSH, None, ScaleRule::Row { div: 1.0, flushes }),
            Format::F16 | Format::Bf16 => (
                FLUSH,
                None,
                ScaleRule::Row {
                    div: 1.0,
                    flushes: 0,
                },
            ),
        };
        Self {
            codes: w.codes(),
            scales: w.scales(),
            row_bytes: w.format().row_code_bytes(w.cols()),
            group,
            lut,
            rule,
        }
    }

    /// Whether rows `first..first + count` are whole rows of codes, each a multiple of 16
    /// bytes: what the SIMD row kernels load.
    #[cfg(target_arch = "x86_64")]
    fn whole_rows(&self, first: usize, count: usize) -> bool {
        self.row_bytes.is_multiple_of(16)
            && first
                .checked_add(count)
                .and_then(|end| end.checked_mul(self.row_bytes))
                .is_some_and(|end| end <= self.codes.len())
    }

    /// Row `r`'s codes (empty past the end).
    #[inline]
    fn codes_of(&self, r: usize) -> &'a [u8] {
        let rb = self.row_bytes;
        self.codes.get(r * rb..(r + 1) * rb).unwrap_or(&[])
    }

    /// Row `r`'s scales.
    #[inline]
    fn scales_of(&self, r: usize) -> RowScales<'a> {
        match self.rule {
            ScaleRule::Groups { per_row, k } => RowScales::Groups(
                self.scales
                    .get(r * per_row..(r + 1) * per_row)
                    .unwrap_or(&[]),
                k,
            ),
            ScaleRule::Row { div, flushes } => {
                RowScales::Row(self.scales.get(r).copied().unwrap_or(0.0) / div, flushes)
            }
        }
    }
}

/// `y = x W^T` for `x: [batch, cols]` and packed `W: [rows, cols]`, giving `[batch, rows]`.
///
/// Reads the packed bytes directly; `W` is never held in f32. Output rows are spread over
/// all cores (the kernels' own pool, as many threads as rayon's; see `pool`).
///
/// # Arithmetic
/// - **Integer formats** (`Int8`, `Int8Rows`, `Int8Block`, `Nf4`, `Nf4Block`, `Int4Block`): each row of
///   `x` is rounded once to 14-bit fixed point (`x ≈ d · q`, `d = absmax / 8191`, `q` an
///   `i16`). Each weight row is read as small integer codes `c` with float scales per group
///   (`w = s_g · c`, plus the group minimum for `Int4Block`): INT8 codes as they are stored,
///   4-bit indices through a 16-entry table (for NF4 the codebook times 127, rounded, as
///   llama.cpp's IQ4_NL does). Products `c · q` are summed exactly in `i32` over each group
///   (16 at a time with AVX2's `vpmaddwd`), then scaled and accumulated in f32. Up to four
///   rows of `x` share each decoded weight: at batch 4 or less 4-bit codes are expanded in
///   registers as they are read; batches of 5 to 7 decode each weight row once into a
///   small reused buffer (one per thread) and run every row of `x` against it. A single
///   row of `x` (generation) runs against four weight rows a call instead, reading their
///   stored codes in place and prefetching the rows that follow; each output is the same
///   bits as the same row inside a batch of 7 or less. A batch of 8 or more runs on
///   *tiles* on the SIMD tiers (`x` transposed once so that a vector holds 16 or 8 of its
///   rows, each weight row widened once and its pairs of codes broadcast against it, eight
///   weight rows a call): each group's sum for one output is a single `i32`, and the
///   groups are accumulated in order with one `fma` each, so these outputs are not the
///   same bits as at batch 7 or less, but are within the same bound and the same on every
///   SIMD tier.
/// - **8-bit activations** ([`Activations::Block8`], the default for the 4-bit formats at
///   every batch on the SIMD tiers): each block of 32 values of an `x` row is rounded to 8
///   bits with its own step (`x ≈ s_c · q`, `s_c = absmax_c / 127`); each block's byte
///   products are summed exactly in `i32` (`vpdpbusd` on the VNNI tiers) and accumulated
///   `fma(sum, s_c, ·)` a block and `fma(·, scale, ·)` a group, the same bits on every SIMD
///   tier, within [`error_bound_block8`]. A batch of 8 or more runs the tiles (an `x` row a
///   vector lane); a batch of 7 or less reads the stored codes in place, a weight row a
///   lane, with the same arithmetic: for the 4-bit formats a row of `x` gives the same
///   output bits alone, in a batch of 7 or in a batch of 500 (unless another row of the
///   batch holds a NaN or an infinity, which sends the whole batch to the 14-bit path).
///   The 8-bit formats keep 14-bit activations unless asked ([`matmul_into_using`],
///   `COMPRESSME_ACTIVATIONS`), and asked, take 8 bits at batches of 8 and more only.
/// - **`F16` and `Bf16`** are converted to f32 eight at a time (F16C) and multiplied in
///   f32: they store less, they do not compute less.
/// - A row of `x` holding NaN or infinity is multiplied in f32 against each decoded row,
///   so non-finite values propagate as a dense multiplication would.
///
/// The integer path differs from [`crate::reference::matmul`] (exact dequantize-then-f64)
/// by the rounding of `x` (at most `absmax(x_b) / 16382` a value) and, for NF4, of the
/// codebook (at most `0.47 / 127` of the scale a weight); [`error_bound`] gives the bound
/// for one output, and the tests hold the kernels to it.
///
/// Runs on the [`Tier`] [`kernel_tier`] picks (checked at run time: AVX-512 VNNI, AVX2 +
/// FMA + F16C, or portable Rust); every tier gives the same bits.
///
/// # Errors
/// [`Error::Shape`] when `x` is not `batch * cols` long.
pub fn matmul(x: &[f32], batch: usize, w: &Packed) -> Result<Vec<f32>> {
    matmul_with(Backend::Auto, x, batch, w)
}

/// [`matmul`] on a chosen [`Backend`].
///
/// # Errors
/// [`Error::Shape`] when `x` is not `batch * cols` long; [`Error::Kernel`] when the
/// backend names a tier this CPU lacks (or `COMPRESSME_KERNEL` does, for
/// [`Backend::Auto`]).
pub fn matmul_with(backend: Backend, x: &[f32], batch: usize, w: &Packed) -> Result<Vec<f32>> {
    check_input(x, batch, w.cols())?;
    let mut y = vec![0f32; batch * w.rows()];
    matmul_into_with(backend, x, batch, w, &mut y)?;
    Ok(y)
}

/// [`matmul`] into `y` (`batch * rows` long, row-major `[batch, rows]`), which it
/// overwrites: the same bits, without allocating the output (a caller that runs a large
/// batch in chunks writes each chunk's rows in place).
///
/// # Errors
/// [`Error::Shape`] when `x` is not `batch * cols` long or `y` not `batch * rows`;
/// [`Error::Kernel`] as for [`matmul_with`].
pub fn matmul_into(x: &[f32], batch: usize, w: &Packed, y: &mut [f32]) -> Result<()> {
    matmul_into_with(Backend::Auto, x, batch, w, y)
}

/// [`matmul_into`] on a chosen [`Backend`].
///
/// # Errors
/// As for [`matmul_into`].
pub fn matmul_into_with(
    backend: Backend,
    x: &[f32],
    batch: usize,
    w: &Packed,
    y: &mut [f32],
) -> Result<()> {
    matmul_into_using(backend, Activations::Auto, x, batch, w, y)
}

/// [`matmul_into`] on a chosen [`Backend`] with chosen [`Activations`].
///
/// # Errors
/// As for [`matmul_into`]; [`Error::Kernel`] also when `activations` is
/// [`Activations::Auto`] and `COMPRESSME_ACTIVATIONS` names no choice.
pub fn matmul_into_using(
    backend: Backend,
    activations: Activations,
    x: &[f32],
    batch: usize,
    w: &Packed,
    y: &mut [f32],
) -> Result<()> {
    let (rows, cols) = (w.rows(), w.cols());
    check_input(x, batch, cols)?;
    if Some(y.len()) != batch.checked_mul(rows) {
        return Err(Error::Shape(format!(
            "the output holds {} values, not {batch} x {rows}",
            y.len()
        )));
    }
    let isa = Isa::pick(backend)?;
    let activations = match activations {
        Activations::Auto => activations_for(w.format())?,
        a => a,
    };
    if batch == 0 {
        return Ok(());
    }
    let half = matches!(w.format(), Format::F16 | Format::Bf16);
    let block8 =
        activations == Activations::Block8 && !half && block8_runs(isa, w, batch) && all_finite(x);
    let nibbles = w.format().code_bits() == 4;
    let fixed = if half || block8 {
        None
    } else {
        FixedX::new(isa, x, batch, cols, nibbles)
    };
    let rows_of = |yt: &mut [f32]| match fixed {
        _ if half => half_rows(isa, x, batch, w, yt),
        _ if block8 => int_rows_block8(isa, x, batch, w, yt),
        Some(fx) => int_rows(isa, &fx, batch, w, yt),
        None => f32_rows(x, batch, w, yt),
    };
    if batch == 1 {
        // [rows, 1] is already [1, rows]
        y.fill(0.0);
        rows_of(y);
        return Ok(());
    }
    // [rows, batch] first: each task owns whole output rows
    let mut yt = vec![0f32; rows * batch];
    rows_of(&mut yt);
    transpose_into(isa, &yt, rows, batch, y);
    Ok(())
}

/// `yt` (`[rows, batch]`) into `y` (`[batch, rows]`), a tile of 16 x 16 at a time through
/// a local buffer, so each read and each write is a contiguous run of up to 16 values;
/// large outputs on the kernel pool's threads, a run of rows of `y` a piece; on the
/// AVX-512 tier a whole tile in registers (the values moved as they are).
fn transpose_into(isa: Isa, yt: &[f32], rows: usize, batch: usize, y: &mut [f32]) {
    const T: usize = 16;
    if rows == 0 || batch == 0 {
        return;
    }
    // rows of `y` a piece: whole tiles, four pieces a thread where the batch allows
    let per = (batch.div_ceil(4 * pool::threads()).div_ceil(T) * T).max(T);
    #[cfg(target_arch = "x86_64")]
    let wide = match isa {
        Isa::Avx512(t) => Some(t),
        _ => None,
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    // rows p·per.. of y, a tile of T of them at a time
    let piece = |p: usize, ys: &mut [f32]| {
        let mut tile = [[0f32; T]; T];
        for (t, src) in yt.chunks(T * batch).enumerate() {
            let r0 = t * T;
            for (s, yb) in ys.chunks_mut(T * rows).enumerate() {
                let b0 = p * per + s * T;
                let nb = yb.len() / rows;
                // a whole tile in registers
                #[cfg(target_arch = "x86_64")]
                if let Some(token) = wide
                    && nb == T
                    && src.len() == T * batch
                    && let (Some(from), Some(to)) = (src.get(b0..), yb.get_mut(r0..))
                    && avx512::transpose16(token, from, batch, to, rows)
                {
                    continue;
                }
                // read: a run of each of up to T rows of `yt`
                let mut nr = 0;
                for (row, col) in tile.iter_mut().zip(src.chunks_exact(batch)) {
                    for (o, &v) in row.iter_mut().zip(col.get(b0..b0 + nb).unwrap_or(&[])) {
                        *o = v;
                    }
                    nr += 1;
                }
                // write: a run of each row of `y` (a column of `y` at a stride of a power
                // of two would put its lines in one cache set)
                for i in 0..nb {
                    if let Some(out) = yb.get_mut(i * rows + r0..i * rows + r0 + nr) {
                        for (o, row) in out.iter_mut().zip(&tile) {
                            *o = row[i];
                        }
                    }
                }
            }
        }
    };
    let share = y.len() >= SHARE_MIN_VALUES;
    pool::each(share, y.chunks_mut(per * rows).collect(), &piece);
}

/// Calls `f(first, rows, n)` for the batch four rows at a time; `rows` past `n` are empty.
fn in_fours<'a, T: ?Sized + 'a>(
    batch: usize,
    row: impl Fn(usize) -> &'a T,
    mut f: impl FnMut(usize, [&'a T; 4], usize),
) {
    let mut b = 0;
    while b < batch {
        let n = (batch - b).min(4);
        f(b, [row(b), row(b + 1), row(b + 2), row(b + 3)], n);
        b += n;
    }
}

fn int_rows(isa: Isa, fx: &FixedX, batch: usize, w: &Packed, yt: &mut [f32]) {
    let cols = w.cols();
    let asym = matches!(w.format(), Format::Int4Block(_));
    let (group, groups) = match w.format().group() {
        Some(g) => (g, cols.div_ceil(g)),
        None => (FLUSH, 0),
    };
    let xsums = if asym {
        fx.group_sums(group, groups)
    } else {
        Vec::new()
    };
    // a small batch reads 4-bit codes straight from the packed row (whole 16-byte runs)
    let rb = w.format().row_code_bytes(cols);
    let four_bit = w.format().code_bits() == 4;
    let fused = batch <= 4 && four_bit && rb.is_multiple_of(16);
    // INT4's minimums: `Σ_g min_g · Σ_{j in g} x_j` added to weight row `r`'s dot with
    // `x` row `b`
    let with_mins = |v: f32, r: usize, b: usize| {
        let mins = w.mins().get(r * groups..(r + 1) * groups);
        let sums = xsums.get(b * groups..(b + 1) * groups);
        match (mins, sums) {
            (Some(m), Some(sx)) if asym => v + isa.dot_f32(m, sx),
            _ => v,
        }
    };
    // one row of x (generation): four weight rows at a time read the stored codes in
    // place and share each load of x
    if batch == 1 && (fused || (!four_bit && cols.is_multiple_of(STEP))) {
        let d = fx.d.first().copied().unwrap_or(0.0);
        let view = RowsView::new(w, fx.kp);
        let x = isa.row_input(fx.row(0), &view);
        // 8-bit codes with `x` split into bytes (the AVX-512 tier): read from the tiled
        // layout, built on the first such product
        #[cfg(target_arch = "x86_64")]
        let tiled = match (isa, &x.split) {
            (Isa::Avx512(_), Some(sx)) if view.lut.is_none() && sx.per_byte == 1 && repack() => {
                Some(
                    &*w.layouts
                        .tiled
                        .get_or_init(|| avx512::tile_bytes(&view, w.rows()))
                        .codes,
                )
            }
            _ => None,
        };
        run_tasks(
            yt,
            ROWS_PER_TASK,
            w.rows() * cols,
            || (),
            |(), (task, out)| {
                let first = task * ROWS_PER_TASK;
                #[cfg(target_arch = "x86_64")]
                let done = match (isa, tiled, &x.split) {
                    (Isa::Avx512(t), Some(tl), Some(sx)) => {
                        avx512::byte_tile(t, tl, &view, first, sx, out)
                    }
                    _ => false,
                };
                #[cfg(not(target_arch = "x86_64"))]
                let done = false;
                if !done {
                    isa.dot_rows(&view, first, &x, out);
                }
                for (k, o) in out.iter_mut().enumerate() {
                    *o = with_mins(*o, first + k, 0) * d;
                }
            },
        );
        return;
    }
    // eight rows of x and more: sixteen weight rows a panel, one row a lane
    #[cfg(target_arch = "x86_64")]
    if batch >= tiles::MIN_BATCH {
        let view = RowsView::new(w, fx.kp);
        let macs = batch * w.rows() * cols;
        // the AMX tier's matrix unit, for 8-bit codes in long groups (the same bits)
        if let Isa::Avx512(t) = isa
            && let Some(a) = t.amx()
            && amx::fits(&view, fx.kp, batch)
        {
            amx::run(a, fx, batch, &view, w.rows(), macs, yt);
            return;
        }
        if let (Some(kind), true) = (isa.tiles(), tiles::fits(&view, fx.kp)) {
            // INT4's minimums: the same term `with_mins` adds
            let mins = |r: usize, b: usize| with_mins(0.0, r, b);
            let mins: Option<&(dyn Fn(usize, usize) -> f32 + Sync)> =
                if asym { Some(&mins) } else { None };
            tiles::run(kind, fx, batch, &view, w.rows(), macs, yt, mins);
            return;
        }
    }
    run_tasks(
        yt,
        batch * ROWS_PER_TASK,
        batch * w.rows() * cols,
        || IntRow::new(fx.kp),
        |row, (task, out)| {
            for (i, yr) in out.chunks_exact_mut(batch).enumerate() {
                let r = task * ROWS_PER_TASK + i;
                row.load(isa, w, r, !fused);
                let packed = w.codes().get(r * rb..(r + 1) * rb).unwrap_or(&[]);
                in_fours(
                    batch,
                    |b| fx.row(b),
                    |b0, [a, b, c, d], n| {
                        let (w8, g, s) = (&row.codes, row.group, &row.scales);
                        let dots = match (fused, row.lut) {
                            (true, Some(t)) => match n {
                                1 => pad(isa.dot_nibbles(packed, t, [a], g, s)),
                                2 => pad(isa.dot_nibbles(packed, t, [a, b], g, s)),
                                3 => pad(isa.dot_nibbles(packed, t, [a, b, c], g, s)),
                                _ => isa.dot_nibbles(packed, t, [a, b, c, d], g, s),
                            },
                            _ => match n {
                                1 => pad(isa.dot_groups(w8, [a], g, s)),
                                2 => pad(isa.dot_groups(w8, [a, b], g, s)),
                                3 => pad(isa.dot_groups(w8, [a, b, c], g, s)),
                                _ => isa.dot_groups(w8, [a, b, c, d], g, s),
                            },
                        };
                        for (k, &v) in dots.iter().take(n).enumerate() {
                            let b = b0 + k;
                            if let (Some(o), Some(&d)) = (yr.get_mut(b), fx.d.get(b)) {
                                *o = with_mins(v, r, b) * d;
                            }
                        }
                    },
                );
            }
        },
    );
}

/// Whether [`Activations::Block8`] runs for `w` at `batch` on `isa`: a SIMD tier, groups
/// of whole blocks of 32 (or one scale a row), and a batch the tiles take (8 or more) or
/// a 4-bit format (any batch).
fn block8_runs(isa: Isa, w: &Packed, batch: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    if isa.tiles().is_some() {
        let view = RowsView::new(w, w.cols());
        return match batch {
            0..=rows8::MAX_BATCH => rows8::fits(&view),
            _ => tiles8::fits(&view),
        };
    }
    let _ = (isa, w, batch);
    false
}

/// Whether every value of `x` is finite, on the widest vectors the CPU has
/// ([`all_finite_lanes`]).
fn all_finite(x: &[f32]) -> bool {
    widest!(all_finite(x) else all_finite_lanes)
}

/// Whether every value of `x` is finite: a test without branches over each run of 256
/// values (which the compiler turns into vectors; `all` alone stops at each value and
/// took 4% of a SmolLM2 window), stopping at the first run with one that is not.
#[inline(always)]
pub(crate) fn all_finite_lanes(x: &[f32]) -> bool {
    x.chunks(256)
        .all(|run| run.iter().fold(true, |ok, v| ok & v.is_finite()))
}

/// An integer matrix against rows of finite `x` rounded to 8 bits a block (see
/// [`Activations::Block8`]): 8 or more on the tiles, fewer a weight row a lane (the same
/// bits); `yt` is `[rows, batch]`.
fn int_rows_block8(isa: Isa, x: &[f32], batch: usize, w: &Packed, yt: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if let Some(kind) = isa.tiles() {
        let cols = w.cols();
        let kp = cols.div_ceil(BLOCK8) * BLOCK8;
        let view = RowsView::new(w, kp);
        // INT4's minimums, one a group of each row
        let mins = matches!(w.format(), Format::Int4Block(_)).then(|| w.mins());
        // the AMX tier's matrix unit, for the batches the tiles take (the same bits)
        if let tiles::Kind::Avx512(t) = kind
            && let Some(a) = t.amx()
            && amx8::fits(&view, batch)
        {
            amx8::run(a, kind, x, batch, &view, cols, w.rows(), yt, mins);
            return;
        }
        if batch <= rows8::MAX_BATCH {
            let layouts = repack().then_some(&w.layouts);
            rows8::run(kind, x, batch, &view, cols, w.rows(), yt, mins, layouts);
        } else {
            tiles8::run(kind, x, batch, &view, cols, w.rows(), yt, mins);
        }
        return;
    }
    // not reached: `block8_runs` is false off the SIMD tiers
    let _ = isa;
    f32_rows(x, batch, w, yt);
}

/// Multiply-adds below which a call stays on the calling thread: sharing a product costs
/// a few microseconds with the pool's workers awake, as much as the smallest layers'
/// whole product. SmolLM2's NF4-g64 generation on two threads (`generation_speed`, 3-5
/// rounds): 51.5-61.6 tokens a second with this threshold at 2M multiply-adds (where it
/// stood with rayon, whose sleeping workers cost tens of microseconds to wake), 67.5-82.1
/// at 32K, 64K or 128K (within noise of each other); 128K keeps its 576 x 192 products
/// (110K) on one thread, and a many-core machine from splitting tiny products many ways.
const PARALLEL_MIN_MACS: usize = 1 << 17;

/// Runs `f(state, (index, piece))` over `chunk`-sized pieces of `out`: on the kernel
/// pool's threads ([`pool`]) when there are several and `macs` is large enough to pay for
/// sharing the work, otherwise in order on this thread. Shared, the pieces go out in
/// contiguous runs (four a thread), so a thread reads weight rows in order and its
/// prefetches of the rows below land on its own next rows; `init` makes one state a run.
fn run_tasks<S>(
    out: &mut [f32],
    chunk: usize,
    macs: usize,
    init: impl Fn() -> S + Sync + Send,
    f: impl Fn(&mut S, (usize, &mut [f32])) + Sync + Send,
) {
    let chunk = chunk.max(1);
    let tasks = out.len().div_ceil(chunk);
    let threads = if macs < PARALLEL_MIN_MACS {
        1
    } else {
        pool::threads()
    };
    if threads < 2 || tasks < 2 {
        let mut state = init();
        for piece in out.chunks_mut(chunk).enumerate() {
            f(&mut state, piece);
        }
        return;
    }
    let runs = (4 * threads).min(tasks);
    let per_run = tasks.div_ceil(runs);
    // each run's slice of `out`, taken once by whichever thread runs it
    pool::each(
        true,
        out.chunks_mut(per_run * chunk).collect(),
        &|i, slice| {
            let mut state = init();
            for (k, piece) in slice.chunks_mut(chunk).enumerate() {
                f(&mut state, (i * per_run + k, piece));
            }
        },
    );
}

fn pad<const N: usize>(v: [f32; N]) -> [f32; 4] {
    let mut out = [0f32; 4];
    for (o, x) in out.iter_mut().zip(v) {
        *o = x;
    }
    out
}

fn half_rows(isa: Isa, x: &[f32], batch: usize, w: &Packed, yt: &mut [f32]) {
    let cols = w.cols();
    let bf16 = matches!(w.format(), Format::Bf16);
    let rb = w.format().row_code_bytes(cols);
    #[cfg(target_arch = "x86_64")]
    let quads = avx2::long_row(rb);
    #[cfg(target_arch = "x86_64")]
    match (isa, batch >= 2) {
        (Isa::Avx512(t), true) => return half_tiles(t, x, batch, w, yt),
        (Isa::Avx2(t), true) => return half_pairs(t, x, batch, w, yt),
        (Isa::AvxVnni(t), true) => return half_pairs(t.avx2(), x, batch, w, yt),
        // long rows, four at a time (short ones stream better from memory one at a time)
        (Isa::Avx512(t), false) if quads => return half_quads(t.avx2(), x, w, yt),
        (Isa::Avx2(t), false) if quads => return half_quads(t, x, w, yt),
        (Isa::AvxVnni(t), false) if quads => return half_quads(t.avx2(), x, w, yt),
        _ => {}
    }
    run_tasks(
        yt,
        batch,
        batch * w.rows() * cols,
        || (),
        |(), (r, yr)| {
            let codes = w.codes().get(r * rb..(r + 1) * rb).unwrap_or(&[]);
            half_row(
                isa,
                codes,
                bf16,
                batch,
                |b| x.get(b * cols..(b + 1) * cols),
                yr,
            );
        },
    );
}

/// One weight row's F16/BF16 `codes` against every row of `x` (`xrow(b)`, empty past the
/// end), four a call, into `yr`.
fn half_row<'a>(
    isa: Isa,
    codes: &[u8],
    bf16: bool,
    batch: usize,
    xrow: impl Fn(usize) -> Option<&'a [f32]>,
    yr: &mut [f32],
) {
    in_fours(
        batch,
        |b| xrow(b).unwrap_or(&[]),
        |b0, [a, b, c, d], n| {
            let dots = match n {
                1 => pad(isa.dot_half(codes, bf16, [a])),
                2 => pad(isa.dot_half(codes, bf16, [a, b])),
                3 => pad(isa.dot_half(codes, bf16, [a, b, c])),
                _ => isa.dot_half(codes, bf16, [a, b, c, d]),
            };
            for (o, v) in yr.iter_mut().skip(b0).zip(dots.iter().take(n)) {
                *o = *v;
            }
        },
    );
}

/// [`half_rows`] on the 256-bit tiers, batch 2 and up: two weight rows a task, each `x`
/// vector loaded once for both (against up to four `x` rows a call: eight accumulators),
/// which the loads bounded (one weight row against four `x` rows loads five vectors for
/// four `fma`s). The same bits as one row at a time: each output's head is the same
/// chain of `fma`s ([`avx2::dot_half_rows`]) and its tail the same portable sum.
#[cfg(target_arch = "x86_64")]
fn half_pairs(t: avx2::Token, x: &[f32], batch: usize, w: &Packed, yt: &mut [f32]) {
    let cols = w.cols();
    let bf16 = matches!(w.format(), Format::Bf16);
    let rb = w.format().row_code_bytes(cols);
    let body = cols / 8 * 8;
    let xrow = |b: usize| x.get(b * cols..(b + 1) * cols).unwrap_or(&[]);
    let codes_of = |r: usize| w.codes().get(r * rb..(r + 1) * rb).unwrap_or(&[]);
    let narrow = Isa::Avx2(t);
    run_tasks(
        yt,
        batch * 2,
        batch * w.rows() * cols,
        || (),
        |(), (task, out)| {
            let r0 = task * 2;
            if out.len() < 2 * batch {
                // an odd last row: one row at a time
                let xr = |b: usize| x.get(b * cols..(b + 1) * cols);
                return half_row(narrow, codes_of(r0), bf16, batch, xr, out);
            }
            let codes = [codes_of(r0), codes_of(r0 + 1)];
            let tails = codes.map(|c| c.get(2 * body..).unwrap_or(&[]));
            in_fours(batch, xrow, |b0, [a, b, c, d], n| {
                let heads = match n {
                    1 => avx2::dot_half_rows(t, codes, bf16, [a], body).map(|h| h.map(pad)),
                    2 => avx2::dot_half_rows(t, codes, bf16, [a, b], body).map(|h| h.map(pad)),
                    3 => avx2::dot_half_rows(t, codes, bf16, [a, b, c], body).map(|h| h.map(pad)),
                    _ => avx2::dot_half_rows(t, codes, bf16, [a, b, c, d], body),
                };
                let xs = [a, b, c, d];
                for (k, yr) in out.chunks_exact_mut(batch).enumerate().take(2) {
                    let head = heads.map(|h| h[k]);
                    for i in 0..n {
                        let Some(o) = yr.get_mut(b0 + i) else {
                            continue;
                        };
                        *o = match head {
                            // dot_half's own order: the head, then the tail added
                            Some(h) => {
                                let xt = xs[i].get(body..).unwrap_or(&[]);
                                let [v] = portable::dot_half(tails[k], bf16, [xt]);
                                h[i] + v
                            }
                            None => {
                                let [v] = narrow.dot_half(codes[k], bf16, [xs[i]]);
                                v
                            }
                        };
                    }
                }
            });
        },
    );
}

/// [`half_rows`] at batch 1 on the SIMD tiers: four weight rows a call, so four `fma`
/// chains run side by side where one row's single chain waits on each `fma`'s latency
/// (the chains are the rows' own, so the same bits as one row at a time: each row's head
/// over the first `cols / 8 * 8` columns, then [`avx2::dot_half`]'s portable tail added).
/// The rows that do not make a whole four at a task's end go one at a time. Only for rows
/// whose four make more than `NEAR_AHEAD` (8 KiB): shorter rows stream better from memory
/// one at a time, one sequential stream, where four rows a call are four (SmolLM2 in F16,
/// 576- and 1536-wide rows, generation on one thread of AMD Zen 4: 40.7-44.2 tokens a
/// second with every row four at a time, 47.5-49.2 one at a time, although a 1536 x 576
/// product alone in cache took 0.044 ms against 0.102).
#[cfg(target_arch = "x86_64")]
fn half_quads(t: avx2::Token, x: &[f32], w: &Packed, y: &mut [f32]) {
    let cols = w.cols();
    let bf16 = matches!(w.format(), Format::Bf16);
    let rb = w.format().row_code_bytes(cols);
    let body = cols / 8 * 8;
    let codes_of = |r: usize| w.codes().get(r * rb..(r + 1) * rb).unwrap_or(&[]);
    let narrow = Isa::Avx2(t);
    let x_tail = x.get(body..).unwrap_or(&[]);
    run_tasks(
        y,
        ROWS_PER_TASK,
        w.rows() * cols,
        || (),
        |(), (task, out)| {
            let r0 = task * ROWS_PER_TASK;
            for (i, quad) in out.chunks_mut(4).enumerate() {
                let r = r0 + 4 * i;
                let codes = [0, 1, 2, 3].map(|k| codes_of(r + k));
                let heads = match quad.len() {
                    4 => avx2::dot_half_rows(t, codes, bf16, [x], body),
                    _ => None,
                };
                for (k, o) in quad.iter_mut().enumerate() {
                    *o = match heads {
                        // dot_half's own order: the head, then the tail added
                        Some(h) => {
                            let tail = codes[k].get(2 * body..).unwrap_or(&[]);
                            let [v] = portable::dot_half(tail, bf16, [x_tail]);
                            h[k][0] + v
                        }
                        None => {
                            let [v] = narrow.dot_half(codes[k], bf16, [x]);
                            v
                        }
                    };
                }
            }
        },
    );
}

/// Weight rows a task of [`half_tiles`] takes, and pairs of `x` rows a kernel call.
#[cfg(target_arch = "x86_64")]
const HALF_ROWS: usize = 4;
#[cfg(target_arch = "x86_64")]
const HALF_PAIRS: usize = 4;

/// [`half_rows`] on the AVX-512 tier, batch 2 and up: four weight rows a task, against
/// up to four pairs of `x` rows a call (16 accumulators), each weight converted once for
/// eight `x` rows; an odd last `x` row runs the AVX2 kernel. The same bits as
/// [`half_rows`] on the AVX2 tier.
#[cfg(target_arch = "x86_64")]
fn half_tiles(t: avx512::Token, x: &[f32], batch: usize, w: &Packed, yt: &mut [f32]) {
    let cols = w.cols();
    let bf16 = matches!(w.format(), Format::Bf16);
    let rb = w.format().row_code_bytes(cols);
    let body = cols / 8 * 8;
    let pairs = batch / 2;
    // pair p: rows 2p and 2p + 1, eight values of each in turn
    let mut x2 = vec![0f32; pairs * 2 * body];
    for (p, out) in x2.chunks_exact_mut(2 * body.max(1)).enumerate().take(pairs) {
        let (a, b) = (2 * p * cols, (2 * p + 1) * cols);
        for (s, o) in out.chunks_exact_mut(16).enumerate() {
            let (lo, hi) = o.split_at_mut(8);
            lo.copy_from_slice(x.get(a + 8 * s..a + 8 * s + 8).unwrap_or(&[0.0; 8]));
            hi.copy_from_slice(x.get(b + 8 * s..b + 8 * s + 8).unwrap_or(&[0.0; 8]));
        }
    }
    let pair = |p: usize| x2.get(2 * body * p..2 * body * (p + 1)).unwrap_or(&[]);
    let xrow = |b: usize| x.get(b * cols..(b + 1) * cols).unwrap_or(&[]);
    let codes_of = |r: usize| w.codes().get(r * rb..(r + 1) * rb).unwrap_or(&[]);
    // the AVX2 kernel's tail: the columns past `body`, added to the head sum
    let tail = |codes: &[u8], b: usize| {
        let [v] = portable::dot_half(
            codes.get(2 * body..).unwrap_or(&[]),
            bf16,
            [xrow(b).get(body..).unwrap_or(&[])],
        );
        v
    };
    let narrow = Isa::Avx2(t.avx2());
    run_tasks(
        yt,
        batch * HALF_ROWS,
        batch * w.rows() * cols,
        || (),
        |(), (task, out)| {
            let r0 = task * HALF_ROWS;
            let n = out.len() / batch;
            let mut p0 = 0;
            while p0 < pairs {
                let np = (pairs - p0).min(HALF_PAIRS);
                // each (row, pair) head, as [row][pair][0 or 1]
                let mut heads = [[[0f32; 2]; HALF_PAIRS]; HALF_ROWS];
                let mut done = false;
                if n == HALF_ROWS {
                    let codes = [0, 1, 2, 3].map(|k| codes_of(r0 + k));
                    macro_rules! tile {
                        ($p:literal) => {{
                            let xs: [&[f32]; $p] = std::array::from_fn(|k| pair(p0 + k));
                            if let Some(h) = avx512::dot_half_tile(t, codes, bf16, xs, body) {
                                for (dst, src) in heads.iter_mut().zip(h) {
                                    dst[..$p].copy_from_slice(&src);
                                }
                                done = true;
                            }
                        }};
                    }
                    match np {
                        1 => tile!(1),
                        2 => tile!(2),
                        3 => tile!(3),
                        _ => tile!(4),
                    }
                }
                if !done {
                    for (k, dst) in heads.iter_mut().enumerate().take(n) {
                        for (q, d) in dst.iter_mut().enumerate().take(np) {
                            let xs = [pair(p0 + q)];
                            if let Some([[h]]) =
                                avx512::dot_half_tile(t, [codes_of(r0 + k)], bf16, xs, body)
                            {
                                *d = h;
                            }
                        }
                    }
                }
                for ((k, yr), hk) in out.chunks_exact_mut(batch).enumerate().zip(&heads) {
                    let codes = codes_of(r0 + k);
                    for (q, hq) in hk.iter().enumerate().take(np) {
                        for (half, h) in hq.iter().enumerate() {
                            let b = 2 * (p0 + q) + half;
                            if let Some(o) = yr.get_mut(b) {
                                *o = h + tail(codes, b);
                            }
                        }
                    }
                }
                p0 += np;
            }
            if batch % 2 == 1 {
                let b = batch - 1;
                for (k, yr) in out.chunks_exact_mut(batch).enumerate() {
                    if let Some(o) = yr.get_mut(b) {
                        [*o] = narrow.dot_half(codes_of(r0 + k), bf16, [xrow(b)]);
                    }
                }
            }
        },
    );
}

/// Non-finite activations: decode each row to f32 and multiply in f32.
fn f32_rows(x: &[f32], batch: usize, w: &Packed, yt: &mut [f32]) {
    let cols = w.cols();
    run_tasks(
        yt,
        batch,
        batch * w.rows() * cols,
        || vec![0f32; cols],
        |buf, (r, out)| {
            w.decode_row(r, buf);
            for (o, xb) in out.iter_mut().zip(x.chunks_exact(cols)) {
                *o = dot(xb, buf);
            }
        },
    );
}

/// How far [`matmul`] may be from [`crate::reference::matmul`] for one output: the
/// rounding of `x` to 14 bits, the NF4 codebook rounded to 1/127 steps, and f32
/// accumulation (`x` is one row of activations, `w` the dequantized weight row, `scale`
/// the largest NF4 scale of the row, 0 for other formats).
#[must_use]
pub fn error_bound(x: &[f32], w: &[f32], nf4_scale: f32) -> f32 {
    let absmax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let dx = absmax / (2.0 * X_MAX);
    let dw = nf4_scale * 0.4663 / 127.0;
    let (mut sw, mut sx, mut mag) = (0f64, 0f64, 0f64);
    for (&a, &b) in x.iter().zip(w) {
        sw += f64::from(b.abs());
        sx += f64::from(a.abs());
        mag += f64::from((a * b).abs());
    }
    let n = x.len() as f64;
    let wmax = w.iter().fold(0f32, |m, v| m.max(v.abs()));
    // f32 sums: INT4's step and minimum terms may each be as large as max|w| sum|x|
    let big = mag + sx * f64::from(wmax);
    (sw * f64::from(dx) * 1.01 + (sx + n * f64::from(dx)) * f64::from(dw) + big * 1e-5) as f32
        + 1e-30
}

/// [`error_bound`] for [`Activations::Block8`]: `x` rounded to 8 bits per block of 32
/// (at most `absmax(block) / 254` a value) in place of 14 bits per row.
#[must_use]
pub fn error_bound_block8(x: &[f32], w: &[f32], nf4_scale: f32) -> f32 {
    let dw = nf4_scale * 0.4663 / 127.0;
    let (mut sdx, mut sx, mut sdxw, mut mag) = (0f64, 0f64, 0f64, 0f64);
    for (xb, wb) in x.chunks(BLOCK8).zip(w.chunks(BLOCK8)) {
        let dx = f64::from(xb.iter().fold(0f32, |m, v| m.max(v.abs()))) / 254.0;
        for (&a, &b) in xb.iter().zip(wb) {
            sdxw += f64::from(b.abs()) * dx;
            sdx += dx;
            sx += f64::from(a.abs());
            mag += f64::from((a * b).abs());
        }
    }
    let wmax = w.iter().fold(0f32, |m, v| m.max(v.abs()));
    // f32 sums: INT4's step and minimum terms may each be as large as max|w| sum|x|
    let big = mag + sx * f64::from(wmax);
    (sdxw * 1.01 + (sx + sdx) * f64::from(dw) + big * 1e-5) as f32 + 1e-30
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A product shared over the kernel pool's threads (its weight rows, the rounding of
    /// its activations, the transposition of its output) gives the bits of the same
    /// product on one thread: inside a pool job the pool is busy, so the inner product
    /// runs all of it in order on the calling thread.
    #[test]
    fn products_on_the_pool_give_the_bits_of_one_thread() {
        let (rows, cols) = (1024, 2048);
        let w = crate::synthetic::matrix(crate::synthetic::MatrixKind::Gaussian, rows, cols, 5);
        for format in ["nf4-g64", "int8", "int4-g64", "bf16"] {
            let p = crate::quantize(&w, rows, cols, Format::parse(format).unwrap()).unwrap();
            // 32 and 64: the activations rounded and the output transposed on the pool
            // too (32K values and more)
            for batch in [1, 3, 32, 64] {
                assert!(batch * rows * cols >= PARALLEL_MIN_MACS);
                let x = crate::synthetic::matrix(
                    crate::synthetic::MatrixKind::Gaussian,
                    batch,
                    cols,
                    6,
                );
                let shared = matmul(&x, batch, &p).unwrap();
                let alone = std::sync::Mutex::new(Vec::new());
                pool::run(2, &|i| {
                    if i == 0 {
                        *alone.lock().unwrap() = matmul(&x, batch, &p).unwrap();
                    }
                });
                let alone = alone.into_inner().unwrap();
                assert_eq!(shared.len(), alone.len());
                assert!(
                    shared
                        .iter()
                        .zip(&alone)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{format} batch {batch}"
                );
            }
        }
    }

    /// INT8 per row and in groups of 64 at batch 1, read from the tiled layout
    /// (`avx512::byte_tile`), gives the bits of the rows read as stored
    /// (`avx512::dot_rows`, the AVX-512 and AVX2 code), on
    /// rows with and without a partial last vector, groups that end inside a row, tiles
    /// that reach past the matrix, outlier weights and `x` at the ends of its 14 bits.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn int8_rows_from_the_tiled_layout_give_the_stored_layouts_bits() {
        let (Some(t), true) = (avx512::Token::detect(), avx512::vbmi()) else {
            eprintln!(
                "skipped: int8_rows_from_the_tiled_layout_give_the_stored_layouts_bits \
                 (this CPU lacks AVX-512 VNNI or VBMI)"
            );
            return;
        };
        let isa = Isa::Avx512(t);
        let cases = [(16, 64, 1), (33, 1008, 2), (40, 2112, 3), (17, 4096, 4)];
        for ((rows, cols, seed), format) in cases
            .into_iter()
            .flat_map(|c| [Format::Int8, Format::Int8Block(crate::GroupSize::G64)].map(|f| (c, f)))
        {
            let w =
                crate::synthetic::matrix(crate::synthetic::MatrixKind::Outliers, rows, cols, seed);
            let p = crate::quantize(&w, rows, cols, format).unwrap();
            let mut x =
                crate::synthetic::matrix(crate::synthetic::MatrixKind::StudentT, 1, cols, seed);
            // the row's extremes, so the 14-bit values reach both ends
            x[0] = x.iter().fold(0f32, |a, v| a.max(v.abs())) * 1.5;
            x[cols / 2] = -x[0];
            let fx = FixedX::new(isa, &x, 1, cols, false).unwrap();
            let view = RowsView::new(&p, fx.kp);
            let sx = split::SplitX::new_bytes(fx.row(0), view.group);
            let tiled = avx512::tile_bytes(&view, rows);
            for first in (0..rows).step_by(16) {
                let n = (rows - first).min(16);
                let mut want = vec![0f32; n];
                avx512::dot_rows(t, &view, first, fx.row(0), Some(&sx), &mut want);
                let mut got = vec![f32::NAN; n];
                assert!(avx512::byte_tile(
                    t,
                    &tiled.codes,
                    &view,
                    first,
                    &sx,
                    &mut got
                ));
                for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        w.to_bits(),
                        "{format} {rows} x {cols}, row {}",
                        first + k
                    );
                }
            }
        }
        // through `matmul`: a matrix of 4M weights gets the layout on its first product at
        // batch 1 (where the tier splits `x` into bytes: not on Zen 4) and gives the AVX2
        // tier's bits, the first product and the next
        let (rows, cols) = (1024, 4096);
        let w = crate::synthetic::matrix(crate::synthetic::MatrixKind::Outliers, rows, cols, 5);
        let p = crate::quantize(&w, rows, cols, Format::Int8).unwrap();
        let x = crate::synthetic::matrix(crate::synthetic::MatrixKind::StudentT, 1, cols, 6);
        let want = matmul_with(Backend::Tier(Tier::Avx2), &x, 1, &p).unwrap();
        for _ in 0..2 {
            let got = matmul_with(Backend::Tier(Tier::Avx512Vnni), &x, 1, &p).unwrap();
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(g, w)| g.to_bits() == w.to_bits())
            );
        }
        assert_eq!(
            p.layout_bytes() > 0,
            repack() && !avx512::double_pumped(),
            "the tiled layout is built where the tier splits x"
        );
    }

    /// The output's transposition from `[rows, batch]` to `[batch, rows]` puts every value
    /// in its place: shapes with and without whole 16 x 16 tiles, and outputs large enough
    /// to be shared over the pool.
    #[test]
    fn the_output_transposition_puts_every_value_in_its_place() {
        for (rows, batch) in [
            (1, 1),
            (16, 16),
            (17, 15),
            (33, 48),
            (48, 33),
            (576, 512),
            (1000, 40),
        ] {
            let yt: Vec<f32> = (0..rows * batch).map(|i| i as f32 + 0.5).collect();
            // every tier this CPU has (AVX-512's whole tiles in registers)
            for isa in Tier::ALL.into_iter().filter_map(Isa::of) {
                let mut y = vec![f32::NAN; rows * batch];
                transpose_into(isa, &yt, rows, batch, &mut y);
                for r in 0..rows {
                    for b in 0..batch {
                        assert_eq!(
                            y[b * rows + r].to_bits(),
                            yt[r * batch + b].to_bits(),
                            "{rows} x {batch}: row {r}, batch row {b}"
                        );
                    }
                }
            }
        }
    }

    /// Every tier's copy of the candidate-scale errors of activation-aware rounding gives
    /// the bits of the one-weight-one-scale definition, on groups that hit the NF4
    /// midpoints and the INT4 half steps exactly, with zeros, signed zeros, subnormals and
    /// weights far outside the scale (codes clamped); tiers the CPU lacks say so.
    #[test]
    fn candidate_errors_give_the_one_by_one_bits_on_every_tier() {
        use crate::format::{
            CANDIDATES, NF4_CODEBOOK, SCALE_GRID, candidate_errors_lanes,
            candidate_errors_one_by_one,
        };
        type ErrorsFn = dyn Fn(&[f32], &[f32], &[f32; CANDIDATES], bool, f32) -> [f64; CANDIDATES];
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        let mut cases = Vec::new();
        for case in 0..400 {
            let base = 0.01 + next().abs() * 0.2;
            let mut trial = [base; CANDIDATES];
            for (t, f) in trial.iter_mut().skip(1).zip(SCALE_GRID) {
                *t = half::f16::from_f32(base * f).to_f32();
            }
            let min = -base * 7.0 * (1.0 + next());
            let group: Vec<f32> = (0..64)
                .map(|j| match (case + j) % 9 {
                    // an NF4 midpoint or an INT4 half step of the base scale exactly
                    0 => (NF4_CODEBOOK[j % 15] + NF4_CODEBOOK[j % 15 + 1]) / 2.0 * base,
                    1 => min + (j % 16) as f32 * base + 0.5 * base,
                    2 => [0.0, -0.0, 1e-40, -1e-40][j % 4],
                    3 => next() * 100.0,
                    _ => next() * base * 2.0,
                })
                .collect();
            let imp: Vec<f32> = (0..64).map(|_| next() + 0.6).collect();
            cases.push((group, imp, trial, min));
        }
        let run = |name: &str, f: &ErrorsFn| {
            for (group, imp, trial, min) in &cases {
                for nf4 in [true, false] {
                    let want = candidate_errors_one_by_one(group, imp, trial, nf4, *min);
                    let got = f(group, imp, trial, nf4, *min);
                    assert!(
                        want.iter()
                            .zip(&got)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{name}, nf4 {nf4}: {got:?} against {want:?}"
                    );
                }
            }
        };
        run("portable", &candidate_errors_lanes);
        run("dispatched", &candidate_errors);
        #[cfg(target_arch = "x86_64")]
        {
            match avx2::Token::detect() {
                Some(t) => run("avx2", &move |g, i, tr, n, m| {
                    avx2::candidate_errors(t, g, i, tr, n, m)
                }),
                None => eprintln!("skipped: the AVX2 copy (this CPU lacks AVX2)"),
            }
            match avx512::Token::detect() {
                Some(t) => run("avx512", &move |g, i, tr, n, m| {
                    avx512::candidate_errors(t, g, i, tr, n, m)
                }),
                None => eprintln!("skipped: the AVX-512 copy (this CPU lacks AVX-512 VNNI)"),
            }
        }
    }

    /// The AVX-512 tier's 8-bit batch-1 kernel (`vpdpbusd` on the codes as stored, which
    /// `matmul` runs on large matrices only) gives the AVX2 code's bits, called directly
    /// on small ones: per-row and group-64 scales, one and several groups, part vectors,
    /// four rows and one, extreme codes and activations.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_avx512_byte_kernel_gives_the_avx2_bits() {
        let test = "the_avx512_byte_kernel_gives_the_avx2_bits";
        let (Some(t), Some(t2)) = (avx512::Token::detect(), avx2::Token::detect()) else {
            eprintln!("skipped: {test} (this CPU lacks AVX-512 VNNI)");
            return;
        };
        if !avx512::vbmi() {
            eprintln!("skipped: {test} (this CPU lacks AVX-512 VBMI)");
            return;
        }
        let rows = 5;
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for format in [Format::Int8, Format::Int8Block(crate::GroupSize::G64)] {
            // short rows (the next rows prefetched a line a step) and long ones (past
            // `avx2::NEAR_AHEAD`: the far hints), whole vectors and a masked last one
            for cols in [16, 48, 64, 80, 1024, 1040, 2112, 4128] {
                let (q, x) = spread_matrix(rows, cols, format);
                let fx = FixedX::new(Isa::Portable, &x, 1, cols, false).unwrap();
                let view = RowsView::new(&q, fx.kp);
                let sx = split::SplitX::new_bytes(fx.row(0), view.group);
                assert!(sx.covers(view.row_bytes, view.group), "{format:?} {cols}");
                let (mut want, mut got) = (vec![0f32; rows], vec![0f32; rows]);
                avx2::dot_rows(t2, &view, 0, fx.row(0), &mut want);
                avx512::dot_rows(t, &view, 0, fx.row(0), Some(&sx), &mut got);
                assert_eq!(bits(&got), bits(&want), "{format:?}, {cols} columns");
                assert!(want.iter().all(|v| *v != 0.0), "{format:?}, {cols} columns");
            }
        }
    }

    /// A `rows x cols` matrix in `format` and one `x` row, both spread over `[-1, 1)` and
    /// `[-2, 2)` by fixed strides (no two neighbours alike).
    fn spread_matrix(rows: usize, cols: usize, format: Format) -> (Packed, Vec<f32>) {
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 2001) as f32) / 1000.0 - 1.0)
            .collect();
        let x = (0..cols)
            .map(|i| ((i * 104_729 % 2001) as f32) / 500.0 - 2.0)
            .collect();
        (crate::quantize(&w, rows, cols, format).unwrap(), x)
    }

    /// F16 and BF16 at batch 1 give each row's bits from the one-row kernel, four rows a
    /// call (`half_quads`, the rows past 1,024 columns) or one: row counts that leave a part
    /// four at a task's end, columns with and without a tail past the last 8.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn half_rows_four_at_a_time_give_one_row_at_a_time_bits() {
        let Some(t) = avx2::Token::detect() else {
            eprintln!("skipped: half_rows_four_at_a_time_give_one_row_at_a_time_bits (no AVX2)");
            return;
        };
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for format in [Format::F16, Format::Bf16] {
            for (rows, cols) in [
                (1, 5),
                (5, 8),
                (7, 13),
                (18, 37),
                (33, 64),
                (21, 1031),
                (9, 4100),
            ] {
                let (q, x) = spread_matrix(rows, cols, format);
                let rb = format.row_code_bytes(cols);
                let bf16 = format == Format::Bf16;
                let want: Vec<f32> = q
                    .codes()
                    .chunks_exact(rb)
                    .map(|row| avx2::dot_half(t, row, bf16, [&x[..]])[0])
                    .collect();
                for tier in [Tier::Avx2, Tier::best()] {
                    let got = crate::matmul_with(Backend::Tier(tier), &x, 1, &q).unwrap();
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{format:?}, {rows} x {cols}, {tier}"
                    );
                }
            }
        }
    }

    /// The rounding without `roundf` is `round`, then the clamp, on every value an
    /// activation can reach, halves and the neighbours of halves included.
    #[test]
    fn round_fixed_is_round_then_clamp() {
        let want = |q: f32| q.round().clamp(-X_MAX, X_MAX) as i16;
        let mut q = -8200.0f32;
        while q <= 8200.0 {
            for v in [
                q,
                q + 0.5,
                f32::from_bits((q + 0.5).to_bits() + 1),
                f32::from_bits((q + 0.5).to_bits().wrapping_sub(1)),
            ] {
                assert_eq!(round_fixed(v), want(v), "{v}");
                assert_eq!(round_fixed(-v), want(-v), "{}", -v);
            }
            q += 1.0;
        }
        for bits in (0..u32::MAX).step_by(9973) {
            let v = f32::from_bits(bits);
            if v.is_finite() {
                assert_eq!(round_fixed(v), want(v), "{v}");
            }
        }
        // far out of range: clamped, no overflow
        assert_eq!(round_fixed(f32::INFINITY), X_MAX as i16);
        assert_eq!(round_fixed(f32::NEG_INFINITY), -(X_MAX as i16));
        assert_eq!(round_fixed(f32::NAN), 0);
    }

    /// Rows whose largest value is subnormal or nearly so round as any other row: the
    /// largest to the largest code, the others in proportion (no overflow, no panic).
    #[test]
    fn tiny_activations_round_in_proportion() {
        for absmax in [f32::from_bits(1), 1e-40, 3e-39, 1e-36, 2e-35, 1e-30] {
            let x = [absmax, -absmax, absmax / 2.0, 0.0];
            let fx = FixedX::new(Isa::Portable, &x, 1, 4, false).unwrap();
            let q = fx.row(0);
            assert_eq!((q[0], q[1], q[3]), (8191, -8191, 0), "{absmax:e}");
            // a half of a subnormal is not always exact: against the value it is
            let want = (f64::from(x[2]) / f64::from(absmax) * 8191.0).round();
            assert!(
                (f64::from(q[2]) - want).abs() <= 1.0,
                "{absmax:e}: {}",
                q[2]
            );
            assert_eq!(fx.d[0], absmax / X_MAX);
        }
        // a normal row: no pre-scaling
        assert_eq!(prescale(2.0, X_MAX), (1.0, X_MAX / 2.0));
    }

    /// `FixedX` rows are each value times `8191 / absmax`, rounded half away from zero,
    /// in nibble order for the 4-bit formats.
    #[test]
    fn fixed_x_is_the_rounded_row_in_its_order() {
        let cols = 100;
        let x: Vec<f32> = (0..3 * cols)
            .map(|i| {
                ((i * 7919 % 1013) as f32 - 506.5) * 0.37 + if i % 17 == 0 { 0.5 } else { 0.0 }
            })
            .collect();
        for nibbles in [false, true] {
            let fx = FixedX::new(Isa::Portable, &x, 3, cols, nibbles).unwrap();
            for (b, row) in x.chunks_exact(cols).enumerate() {
                let absmax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
                let inv = X_MAX / absmax;
                for (j, &v) in row.iter().enumerate() {
                    let slot = if nibbles { nibble_slot(j) } else { j };
                    let want = (v * inv).round().clamp(-X_MAX, X_MAX) as i16;
                    assert_eq!(
                        fx.row(b)[slot],
                        want,
                        "row {b}, column {j}, nibbles {nibbles}"
                    );
                }
            }
        }
    }

    #[test]
    fn nf4_i8_is_the_codebook_times_127_rounded() {
        for (&c, &q) in crate::NF4_CODEBOOK.iter().zip(&NF4_I8) {
            assert_eq!((c * 127.0).round() as i8, q);
            assert!((c * 127.0 - f32::from(q)).abs() <= 0.4663);
        }
    }
}
