//! One to seven rows of `x` against a 4-bit matrix with 8-bit activations
//! ([`super::Activations::Block8`]): the generation path. The arithmetic is that of
//! [`super::tiles8`] to the bit, so a row of `x` gives the same output whether it is
//! multiplied alone or inside a batch of any size; only the layout differs: a vector lane
//! here is a *weight* row, where the tiles give a lane to each row of `x`.
//!
//! # How
//! Each weight row's codes are read as stored, a chunk at a time: 64 bytes (128 columns,
//! four blocks of 32) on AVX-512, 32 bytes (two blocks) on the 256-bit tiers. The chunk's
//! low and high nibbles go through the format's table (biased to unsigned bytes on the
//! VNNI tiers) and meet `x`, laid out once a product so that each chunk's low-nibble
//! values come first and its high-nibble values second ([`ChunkedX`]): two `vpdpbusd`
//! give 128 products, four lanes for each block. One chunk of each of 16 weight rows
//! (eight on the 256-bit tiers) is read in turn, each chunk prefetched for the next tile;
//! their product vectors stay in registers and are added and transposed until one vector
//! holds one block's exact sum for every row, a row a lane: the `S` of [`super::tiles8`].
//! (Reading each row whole before the next, with the products kept in a buffer, took
//! 1.18x the time on AVX-512 and up to 1.9x on AVX-VNNI.) The rest is its float
//! arithmetic, a lane a row: `a_g = fma(S, s, a_g)` a block, `acc = fma(a_g, w_g, acc)` a
//! group, `Int4Block`'s minimums added last.
//!
//! On the AVX-512 tier a matrix can also be read in a tiled layout built at its first
//! product ([`tile`]): each 64-byte vector holds four bytes of each of 16 rows, a lane a
//! row, so four bytes of `x`, broadcast, meet it, and a block's four vectors give its 16
//! row sums with no transposition. Where the CPU has AVX-512 VBMI, the nibbles go through
//! the table with `vpermb` (no mask: it reads six bits of an index and the table repeats
//! every 16 bytes); the same bytes as `vpshufb`.
//!
//! Nothing is widened or copied to memory: at batch 1 the codes are read once, in place,
//! 64 products an instruction (the 14-bit path splits each activation into two bytes and
//! needs two).
//!
//! Every `unsafe` here is one of two things: calling a `#[target_feature]` function, which
//! a token makes sound (it exists only after the CPU was seen to have the features), or an
//! unaligned load or store inside a range the caller checked first.
#![allow(unsafe_code)]

use std::arch::x86_64::{
    __m256, __m256i, __m512, __m512i, _MM_HINT_T0, _mm_loadu_si128, _mm_prefetch, _mm256_add_epi16,
    _mm256_add_epi32, _mm256_and_si256, _mm256_broadcastsi128_si256, _mm256_cmpgt_epi32,
    _mm256_cvtepi32_ps, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_loadu_si256, _mm256_madd_epi16,
    _mm256_maddubs_epi16, _mm256_maskload_ps, _mm256_mul_ps, _mm256_permute2f128_ps,
    _mm256_permute2x128_si256, _mm256_set1_epi8, _mm256_set1_epi16, _mm256_set1_epi32,
    _mm256_set1_ps, _mm256_setr_epi32, _mm256_setzero_ps, _mm256_setzero_si256,
    _mm256_shuffle_epi8, _mm256_shuffle_ps, _mm256_sign_epi8, _mm256_srli_epi16, _mm256_storeu_ps,
    _mm256_sub_epi32, _mm256_unpackhi_epi32, _mm256_unpackhi_epi64, _mm256_unpackhi_ps,
    _mm256_unpacklo_epi32, _mm256_unpacklo_epi64, _mm256_unpacklo_ps, _mm512_add_epi32,
    _mm512_and_si512, _mm512_andnot_si512, _mm512_broadcast_i32x4, _mm512_castpd_ps,
    _mm512_castps_pd, _mm512_cvtepi32_ps, _mm512_cvtph_ps, _mm512_dpbusd_epi32, _mm512_fmadd_ps,
    _mm512_loadu_ps, _mm512_loadu_si512, _mm512_maskz_loadu_ps, _mm512_mul_ps,
    _mm512_permutexvar_epi8, _mm512_set1_epi8, _mm512_set1_epi32, _mm512_set1_ps,
    _mm512_setzero_ps, _mm512_setzero_si512, _mm512_shuffle_epi8, _mm512_shuffle_f32x4,
    _mm512_shuffle_i32x4, _mm512_srai_epi32, _mm512_srli_epi16, _mm512_storeu_ps, _mm512_sub_epi32,
    _mm512_unpackhi_epi32, _mm512_unpackhi_epi64, _mm512_unpackhi_pd, _mm512_unpackhi_ps,
    _mm512_unpacklo_epi32, _mm512_unpacklo_epi64, _mm512_unpacklo_pd, _mm512_unpacklo_ps,
};

use super::tiles::{Kind, ROWS};
use super::tiles8::{Codes, Minimums, Panel, group_blocks, quads_avxvnni};
use super::{RowsView, ScaleRule};
use crate::format::{Layouts, Tiled};

/// Columns of `x` that share one 8-bit step.
const BLOCK: usize = super::BLOCK8;
/// The largest batch that runs here (larger ones run the tiles).
pub(super) const MAX_BATCH: usize = super::tiles::MIN_BATCH - 1;
/// Rows of `x` one kernel call takes.
const XR: usize = 4;
/// Whether a matrix runs here: a 4-bit format on whole blocks (see [`super::tiles8::fits`]).
pub(super) fn fits(view: &RowsView<'_>) -> bool {
    view.lut.is_some() && super::tiles8::fits(view)
}

/// One row of `x` in the order a tier's chunks read it: for chunk `h` of `per` blocks,
/// the low-nibble half (16 values) of each of its blocks, then each block's high-nibble
/// half; blocks past the row are zeros.
struct ChunkedX {
    bytes: Vec<i8>,
    /// `|bytes|`, for the AVX2 tier's unsigned operand.
    abs: Vec<i8>,
}

impl ChunkedX {
    /// Row `b` of `panel` (built with one lane, in nibble order) in chunks of `per` blocks.
    fn new(panel: &Panel, b: usize, per: usize) -> Self {
        let (units, _, _) = panel.block(b);
        let blocks = panel.blocks();
        let chunks = blocks.div_ceil(per);
        let mut bytes = vec![0i8; chunks * per * BLOCK];
        let half = BLOCK / 2;
        for c in 0..blocks {
            let (h, k) = (c / per, c % per);
            let block = units.get(c * BLOCK / 4..(c + 1) * BLOCK / 4).unwrap_or(&[]);
            let vals = block.iter().flat_map(|u| u.to_le_bytes().map(|v| v as i8));
            for (i, v) in vals.enumerate() {
                let at = h * per * BLOCK + (i / half) * per * half + k * half + i % half;
                if let Some(o) = bytes.get_mut(at) {
                    *o = v;
                }
            }
        }
        let abs = bytes.iter().map(|v| v.wrapping_abs()).collect();
        Self { bytes, abs }
    }
}

/// Up to [`XR`] rows of `x` for one kernel call: each row's chunked bytes, steps and the
/// biased codes' `128 · Σ q` per block.
struct Xs<'a, const N: usize> {
    bytes: [&'a [i8]; N],
    abs: [&'a [i8]; N],
    step: [&'a [f32]; N],
    bias: [&'a [i32]; N],
}

/// The scales of a task's 16 weight rows, read by the kernels 16 groups at a time and
/// transposed in registers (one vector a group, a lane a row).
#[derive(Debug, Clone, Copy)]
enum TileScales<'a> {
    /// Blockwise formats: row `r`'s scale of group `g` is `all[start[r] + g] · k`.
    Groups {
        all: &'a [f32],
        start: [usize; ROWS],
        k: f32,
    },
    /// Per-row formats (one group): each row's scale.
    Row([f32; ROWS]),
    /// Blockwise formats in the tiled layout: row `r`'s scale of group `g` is the f16
    /// `half[16g + r]` times `k` (the same value as [`TileScales::Groups`] gives: the scales
    /// are f16s, so the conversion is exact).
    Tiled { half: &'a [u16], k: f32 },
}

impl<'a> TileScales<'a> {
    /// Rows `first..first + n` of `view` (rows past `n` read row `first`'s; their
    /// outputs are not kept), or `half`, the tile's scales in the tiled layout.
    fn new(view: &RowsView<'a>, first: usize, n: usize, half: Option<&'a [u16]>) -> Self {
        let row = |r: usize| first + if r < n { r } else { 0 };
        match view.rule {
            ScaleRule::Groups { k, .. } if let Some(half) = half => Self::Tiled { half, k },
            ScaleRule::Groups { per_row, k } => Self::Groups {
                all: view.scales,
                start: std::array::from_fn(|r| row(r).saturating_mul(per_row)),
                k,
            },
            ScaleRule::Row { .. } => {
                Self::Row(std::array::from_fn(|r| view.scales_of(row(r)).get(0)))
            }
        }
    }

    /// Whether every row's `groups` scales are inside `all`.
    fn fit(&self, groups: usize) -> bool {
        match self {
            Self::Groups { all, start, .. } => start
                .iter()
                .all(|&s| s.checked_add(groups).is_some_and(|end| end <= all.len())),
            Self::Row(_) => true,
            Self::Tiled { half, .. } => groups
                .checked_mul(ROWS)
                .is_some_and(|need| need <= half.len()),
        }
    }

    /// Row `r`'s scale of group `g`, as the kernels read it (0 where none is stored, as
    /// [`super::RowScales::get`] gives).
    fn get(&self, r: usize, g: usize) -> f32 {
        match *self {
            Self::Groups { all, start, k } => start
                .get(r)
                .and_then(|&s| all.get(s.checked_add(g)?))
                .map_or(0.0, |v| v * k),
            Self::Row(v) => v.get(r).copied().unwrap_or(0.0),
            Self::Tiled { half, k } => half
                .get(g.saturating_mul(ROWS).saturating_add(r))
                .map_or(0.0, |&h| half::f16::from_bits(h).to_f32() * k),
        }
    }
}

/// The whole product for `batch <= MAX_BATCH` rows of finite `x`: `yt` is `[rows, batch]`;
/// the same outputs, bit for bit, as [`super::tiles8::run`] gives each row of `x` (see
/// there for `mins`). `layouts` is the matrix's, where it may keep a tiled layout: the
/// AVX-512 tier builds one there on its first product ([`tile`]) and reads it after.
#[allow(clippy::too_many_arguments)]
pub(super) fn run(
    kind: Kind,
    x: &[f32],
    batch: usize,
    view: &RowsView<'_>,
    cols: usize,
    rows: usize,
    yt: &mut [f32],
    mins: Option<&[f32]>,
    layouts: Option<&Layouts>,
) {
    let Some(lut) = view.lut else {
        return;
    };
    let panel = Panel::new(x, batch, cols, true, 1, kind);
    let blocks = panel.blocks();
    let gblocks = group_blocks(view, blocks);
    let mut shape = Shape::new(kind, lut, blocks, gblocks, view.row_bytes);
    // the tiled layout ([`tile`]), the AVX-512 tier's: its chunks, a whole tile for every
    // task
    let span = view.row_bytes.div_ceil(64) * ROWS * 64;
    let tiles = rows.div_ceil(ROWS);
    let tiled = match kind {
        Kind::Avx512(_) => layouts.map(|l| l.tiled.get_or_init(|| tile(view, rows, mins))),
        Kind::AvxVnni(_) | Kind::Avx2(_) => None,
    }
    .filter(|t| view.row_bytes.div_ceil(64) == blocks.div_ceil(4) && t.codes.len() == tiles * span);
    if tiled.is_some() {
        shape.stride = ROWS * 64;
    }
    // and its scales, a tile's `per_row · ROWS`
    let scale_span = match view.rule {
        ScaleRule::Groups { per_row, .. } => per_row * ROWS,
        ScaleRule::Row { .. } => 0,
    };
    let half = tiled
        .and_then(|t| t.scales.as_deref())
        .filter(|h| h.len() == tiles * scale_span);
    // and `Int4Block`'s minimums, laid out as its scales
    let tile_mins = tiled
        .and_then(|t| t.mins.as_deref())
        .filter(|m| m.len() == tiles * scale_span);
    let chunked: Vec<ChunkedX> = (0..batch)
        .map(|b| ChunkedX::new(&panel, b, shape.per))
        .collect();
    let minimums = Minimums::new(&panel, batch, gblocks, mins);
    super::run_tasks(
        yt,
        batch * ROWS,
        batch * rows * cols,
        || (),
        |(), (task, out)| {
            let first = task * ROWS;
            let n = (out.len() / batch.max(1)).min(rows.saturating_sub(first));
            if n == 0 {
                return;
            }
            let tile_half = half.and_then(|h| h.get(task * scale_span..(task + 1) * scale_span));
            let scales = TileScales::new(view, first, n, tile_half);
            // rows past the matrix read its first row of the task (their outputs are not
            // kept), so every row of a kernel call has the same length
            let codes: [&[u8]; ROWS] = match tiled.map(|t| &*t.codes) {
                // row r's chunk h at (h · ROWS + r) · 64 of its tile: the kernel reads at
                // a stride of ROWS · 64
                Some(t) => {
                    let tile = t.get(task * span..(task + 1) * span).unwrap_or(&[]);
                    std::array::from_fn(|r| tile.get(r * 64..).unwrap_or(&[]))
                }
                None => std::array::from_fn(|r| view.codes_of(first + if r < n { r } else { 0 })),
            };
            let mut b0 = 0;
            while b0 < batch {
                let m = (batch - b0).min(XR);
                let sums = match m {
                    1 => widen(dots::<1>(
                        kind, &shape, &codes, &chunked, &panel, b0, &scales,
                    )),
                    2 => widen(dots::<2>(
                        kind, &shape, &codes, &chunked, &panel, b0, &scales,
                    )),
                    3 => widen(dots::<3>(
                        kind, &shape, &codes, &chunked, &panel, b0, &scales,
                    )),
                    _ => widen(dots::<4>(
                        kind, &shape, &codes, &chunked, &panel, b0, &scales,
                    )),
                };
                for (k, s) in sums.iter().take(m).enumerate() {
                    let b = b0 + k;
                    for (r, &v) in s.iter().take(n).enumerate() {
                        if let Some(o) = out.get_mut(r * batch + b) {
                            *o = v;
                        }
                    }
                }
                b0 += m;
            }
            match tile_mins.and_then(|m| m.get(task * scale_span..(task + 1) * scale_span)) {
                Some(tm) => minimums.add_terms_tile(kind, tm, first, n, out),
                None => minimums.add_rows(kind, first, n, out),
            }
        },
    );
}

/// How far ahead in its own row the AVX-512 tier prefetches a chunk on AMD's CPUs: two
/// cache lines (see [`Shape`]'s `ahead`).
const SAME_ROW_AHEAD: usize = 128;

/// Whether the CPU is AMD's (`cpuid` leaf 0's vendor string), read once: it picks only
/// a prefetch distance, never the arithmetic.
fn amd() -> bool {
    super::avx512::amd_family().is_some()
}

/// How far ahead the AVX-512 tier prefetches in the tiled layout: two chunks of a tile's
/// 16 rows.
const TILED_AHEAD: usize = 2 * ROWS * 64;

/// The tiled layout of a 4-bit matrix (`rows` rows of `view.row_bytes` codes): for tile
/// `t` (rows `16t..16t + 16`), chunk `h` (bytes `64h..64h + 64` of a row), four bytes `q`
/// of the chunk (bytes `4q..4q + 4`, `q < 16`) and row `r` of the tile, those four bytes at
/// `((t · chunks + h) · 16 + q) · 64 + 4r`, `chunks` the row's bytes over 64 rounded up;
/// zeros past a row's end and for rows past the matrix. So each 64-byte vector holds four
/// bytes of each of the tile's 16 rows, a lane a row: the AVX-512 kernel reads one stream
/// in order where the storage layout is sixteen (one a row), meets each vector with four
/// bytes of `x` broadcast, and gets a block's 16 row sums in one vector, with no
/// transposition (at 4096 x 4096 NF4-g64 on Zen 5, one thread, in cache: 0.213-0.223 ms
/// with whole 64-byte chunks a row side by side, against 0.268-0.291 in the storage
/// layout; 0.176-0.182 with these lanes and `vpermb`; at batches of 3 and 7, 0.43-0.47x
/// the time of the whole-chunk version, whose sixteen rows' sums spilled from registers). A blockwise format's group scales, when every one is exactly an f16 (as the
/// format stores them), come too, as f16 bits, a vector a group: for tile `t`, group `g`
/// and row `r` at `(t · groups + g) · 16 + r` (half the bytes of the f32s, and no
/// transposition); `Int4Block`'s minimums (`mins`) likewise, as f32s, so a tile's terms
/// are summed 16 rows a vector.
pub(super) fn tile(view: &RowsView<'_>, rows: usize, mins: Option<&[f32]>) -> Tiled {
    let chunks = view.row_bytes.div_ceil(64);
    let span = chunks * ROWS * 64;
    let tiles = rows.div_ceil(ROWS);
    let mut codes = vec![0u8; tiles * span];
    // tile `t`'s codes into `tile`
    let fill = |t: usize, tile: &mut [u8]| {
        for h in 0..chunks {
            for r in 0..ROWS {
                let row = view.codes_of(t * ROWS + r);
                let piece = row.get(64 * h..(64 * h + 64).min(row.len())).unwrap_or(&[]);
                // bytes 4q..4q + 4 of the row's chunk into lane r of the chunk's vector q
                for (q, four) in piece.chunks(4).enumerate() {
                    let at = (h * ROWS + q) * 64 + 4 * r;
                    if let Some(o) = tile.get_mut(at..at + four.len()) {
                        o.copy_from_slice(four);
                    }
                }
            }
        }
    };
    fill_tiles(&mut codes, span, &fill);
    let (scales, mins) = match view.rule {
        ScaleRule::Groups { per_row, .. } => {
            let exact = |v: &f32| half::f16::from_f32(*v).to_f32().to_bits() == v.to_bits();
            (
                Some(view.scales)
                    .filter(|s| s.iter().all(exact))
                    .and_then(|s| by_tile(s, rows, per_row, |v| half::f16::from_f32(v).to_bits())),
                // `Int4Block`'s minimums, for [`Minimums::add_terms_tile`]
                mins.and_then(|m| by_tile(m, rows, per_row, |v| v)),
            )
        }
        ScaleRule::Row { .. } => (None, None),
    };
    Tiled {
        codes: codes.into_boxed_slice(),
        scales,
        mins,
    }
}

/// `codes`, whole tiles of `span` bytes, each filled by `fill(t, tile)`: on the kernels'
/// pool, runs of whole tiles, from 1 MB of codes (about 0.7 ms on one thread: 4096 x 4096
/// NF4-g64's 8.4 MB took about 6 ms). What [`tile`] and the 8-bit tiled layout
/// (`avx512::tile_bytes`) build on.
pub(super) fn fill_tiles(codes: &mut [u8], span: usize, fill: &(dyn Fn(usize, &mut [u8]) + Sync)) {
    let tiles = codes.len() / span.max(1);
    let threads = super::pool::threads();
    let per_run = tiles.div_ceil(4 * threads).max(1);
    let runs: Vec<&mut [u8]> = codes.chunks_mut((per_run * span).max(1)).collect();
    super::pool::each(
        threads > 1 && tiles * span >= 1 << 20,
        runs,
        &|i, run: &mut [u8]| {
            for (k, tile) in run.chunks_exact_mut(span.max(1)).enumerate() {
                fill(i * per_run + k, tile);
            }
        },
    );
}

/// `all`, `rows` rows of `per_row` values, regrouped a tile at a time, a vector a group:
/// row `16t + r`'s value `g` at `(t · per_row + g) · 16 + r`, through `f` (zeros for rows
/// past the matrix); `None` where `all` is not that long.
fn by_tile<T: Copy, U: Copy + Default>(
    all: &[T],
    rows: usize,
    per_row: usize,
    f: impl Fn(T) -> U,
) -> Option<Box<[U]>> {
    if all.len() != rows.checked_mul(per_row)? {
        return None;
    }
    let mut out = vec![U::default(); rows.div_ceil(ROWS) * per_row * ROWS];
    for (i, o) in out.iter_mut().enumerate() {
        let (t, g, r) = (i / (per_row * ROWS), i / ROWS % per_row, i % ROWS);
        if let Some(&v) = all.get((t * ROWS + r) * per_row + g) {
            *o = f(v);
        }
    }
    Some(out.into_boxed_slice())
}

/// What every kernel call of a product shares.
struct Shape {
    blocks: usize,
    gblocks: usize,
    /// Blocks a chunk.
    per: usize,
    /// The format's table, biased by 128 on the VNNI tiers.
    table: [i8; 16],
    /// The format's table.
    lut: [i8; 16],
    /// How far ahead of a chunk its row is prefetched, in bytes. Where it was measured
    /// best: the same chunk of the next tile (`ROWS` rows below, the tile a thread reads
    /// next) on the Intel Xeon (4096 x 4096 NF4-g64, one thread: 0.64-0.68 ms against
    /// 0.77-1.4 ms for 512 or 2,048 bytes ahead in the same row) and on every 256-bit
    /// tier (on Zen 5 they measured the same with either); two lines ahead in the same row
    /// ([`SAME_ROW_AHEAD`]) for the AVX-512 tier on AMD's CPUs (Zen 5: 0.27-0.28 ms
    /// against 0.32-0.33 for the next tile and 0.29-0.30 for no prefetch; 256 or 512
    /// bytes ahead within noise of 128).
    ahead: usize,
    /// Bytes from a row's chunk to its next: 64 in the storage layout, `ROWS · 64` in the
    /// tiled one (the AVX-512 tier only).
    stride: usize,
    /// Whether the table is the identity (INT4's): the AVX2 tier then reads the codes as
    /// they are, as unsigned bytes ([`pair_linear_avx2`]), and so does the AVX-512 one
    /// (`tile_avx512_linear`).
    linear: bool,
}

impl Shape {
    /// `kind`'s view of a product over `blocks` blocks of `x`, `gblocks` a group, rows of
    /// `row_bytes` codes read through `lut`.
    fn new(kind: Kind, lut: &[i8; 16], blocks: usize, gblocks: usize, row_bytes: usize) -> Self {
        let (per, biased) = match kind {
            Kind::Avx512(_) => (4, true),
            Kind::AvxVnni(_) => (2, true),
            Kind::Avx2(_) => (2, false),
        };
        Self {
            blocks,
            gblocks,
            per,
            table: if biased {
                lut.map(|v| v ^ i8::MIN)
            } else {
                *lut
            },
            lut: *lut,
            ahead: match kind {
                Kind::Avx512(_) if amd() => SAME_ROW_AHEAD,
                _ => ROWS * row_bytes,
            },
            stride: 64,
            linear: Codes::of(Some(lut)) == Codes::Linear,
        }
    }
}

fn widen<const N: usize>(v: [[f32; ROWS]; N]) -> [[f32; ROWS]; XR] {
    let mut out = [[0f32; ROWS]; XR];
    for (o, r) in out.iter_mut().zip(v) {
        *o = r;
    }
    out
}

/// Sixteen weight rows (`codes`, all of one length) against rows `b0..b0 + N` of `x`:
/// `out[k][r]` is weight row `r` against `x` row `b0 + k`, before `Int4Block`'s minimums.
#[allow(clippy::too_many_arguments)]
fn dots<const N: usize>(
    kind: Kind,
    shape: &Shape,
    codes: &[&[u8]; ROWS],
    chunked: &[ChunkedX],
    panel: &Panel,
    b0: usize,
    scales: &TileScales<'_>,
) -> [[f32; ROWS]; N] {
    let (blocks, gblocks, per) = (shape.blocks, shape.gblocks, shape.per);
    let chunk_bytes = per * BLOCK;
    let chunks = blocks.div_ceil(per);
    let groups = blocks.div_ceil(gblocks.max(1));
    let xs: Option<Xs<'_, N>> = (|| {
        let mut bytes = [&[][..]; N];
        let mut abs = [&[][..]; N];
        let mut step = [&[][..]; N];
        let mut bias = [&[][..]; N];
        for k in 0..N {
            let (_, s, o) = panel.block(b0 + k);
            let row = chunked.get(b0 + k)?;
            bytes[k] = row.bytes.get(..chunks * chunk_bytes)?;
            abs[k] = row.abs.get(..chunks * chunk_bytes)?;
            step[k] = s.get(..blocks)?;
            bias[k] = o.get(..blocks)?;
        }
        Some(Xs {
            bytes,
            abs,
            step,
            bias,
        })
    })();
    // the tiled layout: every row's last chunk in place
    let tiled_fit = shape.stride == 64
        || codes
            .iter()
            .all(|r| r.len() >= chunks.saturating_sub(1) * shape.stride + 64);
    let ok = gblocks > 0 && scales.fit(groups) && tiled_fit;
    let (Some(xs), true) = (xs, ok) else {
        return reference(shape, codes, panel, b0, scales);
    };
    let mut out = [[0f32; ROWS]; N];
    // SAFETY (every call below): the token in `kind` proves the features; `xs` holds
    // `chunks` whole chunks a row and a step and bias a block, and every row's scales are
    // in `scales`; the kernels load a row's codes in place only where the row holds the
    // whole chunk, and copy it otherwise.
    match kind {
        Kind::Avx512(_) => {
            // SAFETY: above
            unsafe {
                match (shape.stride == 64, super::avx512::vbmi()) {
                    (true, _) if shape.linear => {
                        tile_avx512_linear::<N, false>(shape, codes, &xs, scales, &mut out);
                    }
                    (false, _) if shape.linear => {
                        tile_avx512_linear::<N, true>(shape, codes, &xs, scales, &mut out);
                    }
                    (true, false) => tile_avx512::<N, false>(shape, codes, &xs, scales, &mut out),
                    (false, false) => tile_avx512::<N, true>(shape, codes, &xs, scales, &mut out),
                    (true, true) => {
                        tile_avx512_vbmi::<N, false>(shape, codes, &xs, scales, &mut out);
                    }
                    (false, true) => {
                        tile_avx512_vbmi::<N, true>(shape, codes, &xs, scales, &mut out);
                    }
                }
            };
        }
        Kind::AvxVnni(_) | Kind::Avx2(_) => {
            for half in 0..2 {
                // SAFETY: above
                unsafe {
                    match kind {
                        Kind::AvxVnni(_) => {
                            tile_avxvnni(shape, codes, &xs, scales, half, &mut out);
                        }
                        _ if shape.linear => {
                            tile_avx2_linear(shape, codes, &xs, scales, half, &mut out);
                        }
                        _ => tile_avx2(shape, codes, &xs, scales, half, &mut out),
                    }
                }
            }
        }
    }
    out
}

/// [`dots`] in plain Rust from the panel (nibble order: a block's slot `i < 16` meets the
/// low nibble of its run's byte `i`, slot `16 + i` the high one), the definition the SIMD
/// kernels are held to.
fn reference<const N: usize>(
    shape: &Shape,
    codes: &[&[u8]; ROWS],
    panel: &Panel,
    b0: usize,
    scales: &TileScales<'_>,
) -> [[f32; ROWS]; N] {
    let (blocks, gblocks) = (shape.blocks, shape.gblocks.max(1));
    let mut out = [[0f32; ROWS]; N];
    for (k, o) in out.iter_mut().enumerate() {
        let (units, step, _) = panel.block(b0 + k);
        let q = |j: usize| {
            let unit = units.get(j / 4).copied().unwrap_or(0);
            i32::from((unit >> (8 * (j % 4))) as u8 as i8)
        };
        for (r, acc) in o.iter_mut().enumerate() {
            // byte j of the row: in the storage layout, at j of the row; in the tiled one
            // ([`tile`], `codes[0]` the tile's start), chunk j / 64's vector (j % 64) / 4,
            // lane r
            let code = |c: usize, i: usize| {
                let j = 16 * c + i;
                let at = if shape.stride == 64 {
                    codes[r].get(j)
                } else {
                    codes[0].get(j / 64 * shape.stride + j % 64 / 4 * 64 + 4 * r + j % 4)
                };
                at.copied().unwrap_or(0)
            };
            let w = |v: u8| i32::from(shape.lut[usize::from(v & 15)]);
            for g in 0..blocks.div_ceil(gblocks) {
                let mut a = 0f32;
                for c in g * gblocks..((g + 1) * gblocks).min(blocks) {
                    let sum: i32 = (0..16)
                        .map(|i| {
                            let b = code(c, i);
                            w(b) * q(BLOCK * c + i) + w(b >> 4) * q(BLOCK * c + 16 + i)
                        })
                        .sum();
                    a = (sum as f32).mul_add(step.get(c).copied().unwrap_or(0.0), a);
                }
                *acc = a.mul_add(scales.get(r, g), *acc);
            }
        }
    }
    out
}

/// Bytes `at..at + LEN` of `row` as a pointer: in place when the row holds them, otherwise
/// copied into `buf` with zeros past the row's end.
#[inline(always)]
fn chunk_ptr<const LEN: usize>(row: &[u8], at: usize, buf: &mut [u8; LEN]) -> *const u8 {
    match row.get(at..at + LEN) {
        Some(s) => s.as_ptr(),
        None => {
            *buf = [0; LEN];
            let tail = row.get(at..).unwrap_or(&[]);
            for (o, &v) in buf.iter_mut().zip(tail) {
                *o = v;
            }
            buf.as_ptr()
        }
    }
}

/// The 16 rows' scales of groups `g0..g0 + 16` (those below `groups`), a vector a group,
/// lane `r` row `r`'s: each row's 16 read in one masked load, then transposed.
///
/// # Safety
/// AVX-512 F present; for [`TileScales::Groups`], `start[r] + groups` at most `all`'s
/// length for every row, and `g0 < groups`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
unsafe fn scales_512(s: &TileScales<'_>, g0: usize, groups: usize) -> [__m512; 16] {
    match s {
        TileScales::Groups { all, start, k } => {
            let n = (groups - g0).min(16);
            let mask: u16 = if n >= 16 { u16::MAX } else { (1u16 << n) - 1 };
            let mut r = [_mm512_setzero_ps(); 16];
            for (v, &at) in r.iter_mut().zip(start) {
                let ptr = all.as_ptr().wrapping_add(at + g0);
                // the next 16 groups' scales: a hint, which never faults
                _mm_prefetch::<_MM_HINT_T0>(ptr.wrapping_add(16).cast());
                // SAFETY: the row's groups g0..g0 + n are inside `all` (caller); the masked
                // load reads only those lanes
                *v = unsafe { _mm512_maskz_loadu_ps(mask, ptr) };
            }
            let mut out = transpose_16(&r);
            let kv = _mm512_set1_ps(*k);
            for v in &mut out {
                *v = _mm512_mul_ps(*v, kv);
            }
            out
        }
        TileScales::Row(v) => {
            let mut out = [_mm512_setzero_ps(); 16];
            // SAFETY: 16 f32
            out[0] = unsafe { _mm512_loadu_ps(v.as_ptr()) };
            out
        }
        TileScales::Tiled { half, k } => {
            // a vector a group already: 16 f16s, one a row, converted exactly
            let kv = _mm512_set1_ps(*k);
            let mut out = [_mm512_setzero_ps(); 16];
            for (j, v) in out.iter_mut().enumerate().take(groups - g0) {
                // SAFETY: group g0 + j < groups, whose 16 scales `half` holds (caller)
                let h = unsafe { _mm256_loadu_si256(half.as_ptr().add((g0 + j) * ROWS).cast()) };
                *v = _mm512_mul_ps(_mm512_cvtph_ps(h), kv);
            }
            out
        }
    }
}

/// A 16 x 16 transpose: lane `r` of vector `j` from lane `j` of vector `r`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
fn transpose_16(r: &[__m512; 16]) -> [__m512; 16] {
    // (plain loops: closures here are not inlined into the caller's features)
    let mut t = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    // u[4i + e], 128-bit lane l: rows 4i..4i + 4, element 4l + e
    let mut u = [_mm512_setzero_ps(); 16];
    for i in 0..4 {
        for h in 0..2 {
            let a = _mm512_castps_pd(t[4 * i + h]);
            let b = _mm512_castps_pd(t[4 * i + 2 + h]);
            u[4 * i + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
            u[4 * i + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        }
    }
    let mut out = [_mm512_setzero_ps(); 16];
    for e in 0..4 {
        let v0 = _mm512_shuffle_f32x4::<0b01_00_01_00>(u[e], u[4 + e]);
        let v1 = _mm512_shuffle_f32x4::<0b11_10_11_10>(u[e], u[4 + e]);
        let v2 = _mm512_shuffle_f32x4::<0b01_00_01_00>(u[8 + e], u[12 + e]);
        let v3 = _mm512_shuffle_f32x4::<0b11_10_11_10>(u[8 + e], u[12 + e]);
        out[e] = _mm512_shuffle_f32x4::<0b10_00_10_00>(v0, v2);
        out[4 + e] = _mm512_shuffle_f32x4::<0b11_01_11_01>(v0, v2);
        out[8 + e] = _mm512_shuffle_f32x4::<0b10_00_10_00>(v1, v3);
        out[12 + e] = _mm512_shuffle_f32x4::<0b11_01_11_01>(v1, v3);
    }
    out
}

/// Rows `8 · half..8 · half + 8`'s scales of groups `g0..g0 + 8`, as [`scales_512`].
///
/// # Safety
/// AVX2 present, `half < 2`; for [`TileScales::Groups`], `start[r] + groups` at most
/// `all`'s length for every row, and `g0 < groups`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn scales_256(s: &TileScales<'_>, g0: usize, groups: usize, half: usize) -> [__m256; 8] {
    match s {
        TileScales::Groups { all, start, k } => {
            let n = (groups - g0).min(8) as i32;
            let mask = _mm256_cmpgt_epi32(
                _mm256_set1_epi32(n),
                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            );
            let mut r = [_mm256_setzero_ps(); 8];
            for (v, &at) in r.iter_mut().zip(&start[8 * half..]) {
                let ptr = all.as_ptr().wrapping_add(at + g0);
                // the next 8 groups' scales: a hint, which never faults
                _mm_prefetch::<_MM_HINT_T0>(ptr.wrapping_add(8).cast());
                // SAFETY: the row's groups g0..g0 + n are inside `all` (caller); the masked
                // load reads only those lanes
                *v = unsafe { _mm256_maskload_ps(ptr, mask) };
            }
            let kv = _mm256_set1_ps(*k);
            let mut t = [_mm256_setzero_ps(); 8];
            for i in 0..4 {
                t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
                t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
            }
            // u[4i + e], 128-bit lane l: rows 4i..4i + 4, element 4l + e
            let mut u = [_mm256_setzero_ps(); 8];
            for i in 0..2 {
                for h in 0..2 {
                    let (a, b) = (t[4 * i + h], t[4 * i + 2 + h]);
                    u[4 * i + 2 * h] = _mm256_shuffle_ps::<0x44>(a, b);
                    u[4 * i + 2 * h + 1] = _mm256_shuffle_ps::<0xee>(a, b);
                }
            }
            let mut out = [_mm256_setzero_ps(); 8];
            for e in 0..4 {
                out[e] = _mm256_mul_ps(_mm256_permute2f128_ps::<0x20>(u[e], u[4 + e]), kv);
                out[4 + e] = _mm256_mul_ps(_mm256_permute2f128_ps::<0x31>(u[e], u[4 + e]), kv);
            }
            out
        }
        TileScales::Row(v) => {
            let mut out = [_mm256_setzero_ps(); 8];
            // SAFETY: 8 of the 16 f32 (half < 2)
            out[0] = unsafe { _mm256_loadu_ps(v.as_ptr().add(8 * half)) };
            out
        }
        // (the tiled layout is the AVX-512 tier's; this is only the definition's value)
        TileScales::Tiled { .. } => {
            let mut out = [_mm256_setzero_ps(); 8];
            for (j, v) in out.iter_mut().enumerate().take(groups - g0) {
                let lanes: [f32; 8] = std::array::from_fn(|r| s.get(8 * half + r, g0 + j));
                // SAFETY: 8 f32
                *v = unsafe { _mm256_loadu_ps(lanes.as_ptr()) };
            }
            out
        }
    }
}

/// Sixteen vectors, one a weight row, each with four lanes for each of four blocks
/// (lanes `4k..4k + 4` block `k`), added and transposed into four vectors, one a block,
/// lane `r` row `r`'s sum (exact: `i32` additions).
///
/// # Safety
/// AVX-512 F present.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
unsafe fn transpose_add_16(p: &[__m512i; ROWS]) -> [__m512i; 4] {
    // pairs of rows: per 128-bit lane k, [a0 + a2, b0 + b2, a1 + a3, b1 + b3]
    let mut q = [_mm512_setzero_si512(); 8];
    for (j, v) in q.iter_mut().enumerate() {
        let (a, b) = (p[2 * j], p[2 * j + 1]);
        *v = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    }
    // fours of rows: per 128-bit lane k, block k's sums of rows 4j..4j + 4
    let mut r = [_mm512_setzero_si512(); 4];
    for (j, v) in r.iter_mut().enumerate() {
        let (c, d) = (q[2 * j], q[2 * j + 1]);
        *v = _mm512_add_epi32(_mm512_unpacklo_epi64(c, d), _mm512_unpackhi_epi64(c, d));
    }
    // a 4 x 4 transpose of 128-bit lanes
    let t0 = _mm512_shuffle_i32x4::<0b01_00_01_00>(r[0], r[1]);
    let t1 = _mm512_shuffle_i32x4::<0b11_10_11_10>(r[0], r[1]);
    let t2 = _mm512_shuffle_i32x4::<0b01_00_01_00>(r[2], r[3]);
    let t3 = _mm512_shuffle_i32x4::<0b11_10_11_10>(r[2], r[3]);
    [
        _mm512_shuffle_i32x4::<0b10_00_10_00>(t0, t2),
        _mm512_shuffle_i32x4::<0b11_01_11_01>(t0, t2),
        _mm512_shuffle_i32x4::<0b10_00_10_00>(t1, t3),
        _mm512_shuffle_i32x4::<0b11_01_11_01>(t1, t3),
    ]
}

/// The AVX-512 kernel over a tile of 16 weight rows: `$name`, with `$features`, turning a
/// chunk of codes into its low- and high-nibble bytes through the table with
/// `$nibbles(codes, table, 0x0f)`. Two instances: `vpshufb` on the nibbles masked to 4 bits,
/// and, where the CPU has AVX-512 VBMI, `vpermb` (which reads 6 bits of each index, and
/// the table is repeated in all four 16-byte lanes, so no mask is needed: three
/// instructions for the pair instead of five). The same bytes either way. With `$linear`
/// (INT4's identity table, [`Shape::linear`]) the codes are unsigned as they are: no
/// table and no bias, and in the tiled layout a high nibble is left in place (`16 · code`,
/// one `vpandn`) and its block's sum shifted back by 4, exactly (4096 x 4096 INT4-g64 at
/// batch 1 on Zen 4, one thread, best of 300, three interleaved runs: 0.243-0.244 ms
/// against 0.252-0.253 through the table). A group's scales in the tiled layout are read
/// and converted at the group's end, not sixteen groups at a time into an array that lives
/// on the stack (NF4-g64, the same runs' kind: 0.232-0.242 against 0.262-0.265 ms).
macro_rules! tile_512 {
    ($name:ident, $features:literal, $nibbles:expr, $linear:literal) => {
        /// # Safety
        /// AVX-512 F, BW, VL and VNNI and FMA present; `xs` holds `blocks.div_ceil(4)` chunks of
        /// 128 bytes a row and `blocks` steps and biases; every row's scales are in `scales`;
        /// `shape.per` is 4 and `shape.gblocks > 0`; when `TILED`, `codes` are in the tiled
        /// layout (`codes[q]` starts at vector `q` of the tile's first chunk, and chunk `h`'s
        /// is `ROWS · 64 · h` further, see [`tile`]) and every `codes[q]` holds
        /// `(blocks.div_ceil(4) - 1) · ROWS · 64 + 64` bytes.
        #[target_feature(enable = $features)]
        unsafe fn $name<const N: usize, const TILED: bool>(
            shape: &Shape,
            codes: &[&[u8]; ROWS],
            xs: &Xs<'_, N>,
            scales: &TileScales<'_>,
            out: &mut [[f32; ROWS]; N],
        ) {
            let (blocks, gblocks) = (shape.blocks, shape.gblocks);
            // SAFETY: the table is 16 bytes
            let table16 = unsafe { _mm_loadu_si128(shape.table.as_ptr().cast()) };
            let table = _mm512_broadcast_i32x4(table16);
            let low = _mm512_set1_epi8(0x0f);
            let groups = blocks.div_ceil(gblocks);
            // the group being summed, and its blocks still to come
            let (mut g, mut left) = (0, gblocks);
            let mut sbuf = [_mm512_setzero_ps(); 16];
            let mut acc = [_mm512_setzero_ps(); N];
            let mut ga = [_mm512_setzero_ps(); N];
            let mut buf = [0u8; 64];
            let chunks = blocks.div_ceil(4);
            // chunks every row holds whole: read in place (all of them in the tiled layout)
            let full = if TILED {
                chunks
            } else {
                codes
                    .iter()
                    .map(|r| r.len() / 64)
                    .min()
                    .unwrap_or(0)
                    .min(chunks)
            };
            // chunk after chunk: in the tiled layout each vector of codes holds four bytes of
            // each of the 16 rows, which meet four bytes of `x`, broadcast, so a lane sums
            // one row and a block's four vectors give its 16 rows' sums directly; in the
            // storage layout each of the 16 rows' products is kept in registers and
            // transposed at once
            for h in 0..chunks {
                let t = if TILED {
                    // block i: vectors 4i..4i + 4, the low and the high nibbles' sums
                    let mut t = [[_mm512_setzero_si512(); 4]; N];
                    for i in 0..4 {
                        let mut sl = [_mm512_setzero_si512(); N];
                        let mut sh = [_mm512_setzero_si512(); N];
                        for q in 4 * i..4 * i + 4 {
                            let at = codes[q].as_ptr().wrapping_add(ROWS * 64 * h);
                            // a hint only: it never faults, past the tile's end included
                            _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(TILED_AHEAD).cast());
                            // SAFETY: codes[q] holds (chunks - 1) · ROWS · 64 + 64 bytes
                            // (caller)
                            let v = unsafe { _mm512_loadu_si512(at.cast()) };
                            // a linear format's high nibbles stay in place: `16 · code`
                            let (lo, hi) = if $linear {
                                (_mm512_and_si512(v, low), _mm512_andnot_si512(low, v))
                            } else {
                                $nibbles(v, table, low)
                            };
                            for k in 0..N {
                                // SAFETY: chunk h's 128 bytes are in each row of `xs`
                                unsafe {
                                    let x = xs.bytes[k].as_ptr().add(128 * h + 4 * q).cast::<i32>();
                                    let xl = _mm512_set1_epi32(x.read_unaligned());
                                    let xh = _mm512_set1_epi32(x.add(16).read_unaligned());
                                    sl[k] = _mm512_dpbusd_epi32(sl[k], lo, xl);
                                    sh[k] = _mm512_dpbusd_epi32(sh[k], hi, xh);
                                }
                            }
                        }
                        for k in 0..N {
                            // exact: a multiple of 16 shifted back
                            let sh = if $linear {
                                _mm512_srai_epi32::<4>(sh[k])
                            } else {
                                sh[k]
                            };
                            t[k][i] = _mm512_add_epi32(sl[k], sh);
                        }
                    }
                    t
                } else {
                    let mut p = [[_mm512_setzero_si512(); ROWS]; N];
                    for (r, row) in codes.iter().enumerate() {
                        let v = if h < full {
                            let at = row.as_ptr().wrapping_add(64 * h);
                            // a hint only: it never faults, past the row's end included
                            _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(shape.ahead).cast());
                            // SAFETY: h < full: the row holds bytes 64h..64h + 64
                            unsafe { _mm512_loadu_si512(at.cast()) }
                        } else {
                            let ptr = chunk_ptr(row, 64 * h, &mut buf);
                            // SAFETY: `chunk_ptr` gives 64 readable bytes
                            unsafe { _mm512_loadu_si512(ptr.cast()) }
                        };
                        let (lo, hi) = if $linear {
                            (
                                _mm512_and_si512(v, low),
                                _mm512_and_si512(_mm512_srli_epi16::<4>(v), low),
                            )
                        } else {
                            $nibbles(v, table, low)
                        };
                        #[allow(clippy::needless_range_loop)]
                        for k in 0..N {
                            // SAFETY: chunk h's 128 bytes are in each row of `xs`
                            unsafe {
                                let x = xs.bytes[k].as_ptr().add(128 * h);
                                let xlo = _mm512_loadu_si512(x.cast());
                                let xhi = _mm512_loadu_si512(x.add(64).cast());
                                let s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xlo);
                                p[k][r] = _mm512_dpbusd_epi32(s, hi, xhi);
                            }
                        }
                    }
                    let mut t = [[_mm512_setzero_si512(); 4]; N];
                    for k in 0..N {
                        // SAFETY: AVX-512 F present
                        t[k] = unsafe { transpose_add_16(&p[k]) };
                    }
                    t
                };
                for i in 0..4.min(blocks - 4 * h) {
                    let c = 4 * h + i;
                    for (k, tk) in t.iter().enumerate() {
                        let (b, st) = (xs.bias[k], xs.step[k]);
                        // SAFETY: c < blocks: each row of `xs` holds a bias and a step for it
                        let (bias, step) = unsafe { (*b.get_unchecked(c), *st.get_unchecked(c)) };
                        // a linear format's codes are unsigned as they are: no bias
                        let exact = if $linear {
                            tk[i]
                        } else {
                            _mm512_sub_epi32(tk[i], _mm512_set1_epi32(bias))
                        };
                        let s = _mm512_set1_ps(step);
                        ga[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), s, ga[k]);
                    }
                    left -= 1;
                    if left == 0 || c + 1 == blocks {
                        let w = if let TileScales::Tiled { half, k } = scales {
                            let at = half.as_ptr().wrapping_add(g * ROWS);
                            // SAFETY: g < groups, whose 16 scales `half` holds (caller)
                            let h16 = unsafe { _mm256_loadu_si256(at.cast()) };
                            _mm512_mul_ps(_mm512_cvtph_ps(h16), _mm512_set1_ps(*k))
                        } else {
                            if g % 16 == 0 {
                                // SAFETY: g < groups, whose scales every row holds (caller)
                                sbuf = unsafe { scales_512(scales, g, groups) };
                            }
                            sbuf[g % 16]
                        };
                        for k in 0..N {
                            acc[k] = _mm512_fmadd_ps(ga[k], w, acc[k]);
                            ga[k] = _mm512_setzero_ps();
                        }
                        (g, left) = (g + 1, gblocks);
                    }
                }
            }
            for (o, v) in out.iter_mut().zip(acc) {
                // SAFETY: 16 f32
                unsafe { _mm512_storeu_ps(o.as_mut_ptr(), v) };
            }
        }
    };
}

tile_512!(
    tile_avx512,
    "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma",
    |v: __m512i, table: __m512i, low: __m512i| (
        _mm512_shuffle_epi8(table, _mm512_and_si512(v, low)),
        _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16::<4>(v), low))
    ),
    false
);
tile_512!(
    tile_avx512_vbmi,
    "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma",
    |v: __m512i, table: __m512i, _low: __m512i| (
        _mm512_permutexvar_epi8(v, table),
        _mm512_permutexvar_epi8(_mm512_srli_epi16::<4>(v), table)
    ),
    false
);
tile_512!(
    tile_avx512_linear,
    "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma",
    |v: __m512i, table: __m512i, low: __m512i| (
        _mm512_shuffle_epi8(table, _mm512_and_si512(v, low)),
        _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16::<4>(v), low))
    ),
    true
);

/// Eight vectors, one a weight row, each with four lanes for each of two blocks, added
/// and transposed into two vectors, one a block, lane `r` row `r`'s sum.
///
/// # Safety
/// AVX2 present.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn transpose_add_8(p: &[__m256i; 8]) -> [__m256i; 2] {
    let mut q = [_mm256_setzero_si256(); 4];
    for (j, v) in q.iter_mut().enumerate() {
        let (a, b) = (p[2 * j], p[2 * j + 1]);
        *v = _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
    }
    let mut r = [_mm256_setzero_si256(); 2];
    for (j, v) in r.iter_mut().enumerate() {
        let (c, d) = (q[2 * j], q[2 * j + 1]);
        *v = _mm256_add_epi32(_mm256_unpacklo_epi64(c, d), _mm256_unpackhi_epi64(c, d));
    }
    [
        _mm256_permute2x128_si256::<0x20>(r[0], r[1]),
        _mm256_permute2x128_si256::<0x31>(r[0], r[1]),
    ]
}

/// A 256-bit kernel over weight rows `8 · half..8 · half + 8`: `$name`, with `$features`,
/// turning a chunk of codes into its low- and high-nibble weights with
/// `$nibbles(codes, table, 0x0f)`, summing them against `x` with `$pair(lo, hi, x_lo, x_hi,
/// |x_lo|, |x_hi|)` (four products a 32-bit lane) and taking `$unbias` (the biased codes'
/// `128 · Σ q`, or nothing) off each block's sum.
macro_rules! tile_256 {
    ($name:ident, $features:literal, $nibbles:expr, $pair:expr, $unbias:expr) => {
        /// # Safety
        /// The features present; `xs` holds `blocks.div_ceil(2)` chunks of 64 bytes a row
        /// and `blocks` steps and biases; every row's scales are in `scales`;
        /// `shape.per` is 2,
        /// `shape.gblocks > 0` and `half < 2`.
        #[target_feature(enable = $features)]
        unsafe fn $name<const N: usize>(
            shape: &Shape,
            codes: &[&[u8]; ROWS],
            xs: &Xs<'_, N>,
            scales: &TileScales<'_>,
            half: usize,
            out: &mut [[f32; ROWS]; N],
        ) {
            let (blocks, gblocks) = (shape.blocks, shape.gblocks);
            // SAFETY: the table is 16 bytes
            let table = _mm256_broadcastsi128_si256(unsafe {
                _mm_loadu_si128(shape.table.as_ptr().cast())
            });
            let low = _mm256_set1_epi8(0x0f);
            let groups = blocks.div_ceil(gblocks);
            // the group being summed, and its blocks still to come
            let (mut g, mut left) = (0, gblocks);
            let mut sbuf = [_mm256_setzero_ps(); 8];
            let mut acc = [_mm256_setzero_ps(); N];
            let mut ga = [_mm256_setzero_ps(); N];
            let mut buf = [0u8; 32];
            let chunks = blocks.div_ceil(2);
            // chunks every row holds whole (the rows are of one length): read in place
            let full = codes
                .iter()
                .skip(8 * half)
                .take(8)
                .map(|r| r.len() / 32)
                .min()
                .unwrap_or(0)
                .min(chunks);
            // chunk after chunk, each of the 8 rows' products kept in registers and
            // transposed at once
            for h in 0..chunks {
                let mut p = [[_mm256_setzero_si256(); 8]; N];
                #[allow(clippy::needless_range_loop)]
                for r in 0..8 {
                    let row = codes[8 * half + r];
                    let v = if h < full {
                        let at = row.as_ptr().wrapping_add(32 * h);
                        if h % 2 == 0 {
                            // a hint only: it never faults, past the row's end included
                            _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(shape.ahead).cast());
                        }
                        // SAFETY: h < full: the row holds bytes 32h..32h + 32
                        unsafe { _mm256_loadu_si256(at.cast()) }
                    } else {
                        let ptr = chunk_ptr(row, 32 * h, &mut buf);
                        // SAFETY: `chunk_ptr` gives 32 readable bytes
                        unsafe { _mm256_loadu_si256(ptr.cast()) }
                    };
                    let (lo, hi) = $nibbles(v, table, low);
                    for k in 0..N {
                        // SAFETY: chunk h's 64 bytes are in each row of `xs` (and of its
                        // `abs`)
                        unsafe {
                            let x = xs.bytes[k].as_ptr().add(64 * h);
                            let a = xs.abs[k].as_ptr().add(64 * h);
                            let xlo = _mm256_loadu_si256(x.cast());
                            let xhi = _mm256_loadu_si256(x.add(32).cast());
                            let alo = _mm256_loadu_si256(a.cast());
                            let ahi = _mm256_loadu_si256(a.add(32).cast());
                            p[k][r] = $pair(lo, hi, xlo, xhi, alo, ahi);
                        }
                    }
                }
                let mut t = [[_mm256_setzero_si256(); 2]; N];
                for k in 0..N {
                    // SAFETY: AVX2 present
                    t[k] = unsafe { transpose_add_8(&p[k]) };
                }
                for i in 0..2.min(blocks - 2 * h) {
                    let c = 2 * h + i;
                    for k in 0..N {
                        let exact = $unbias(t[k][i], _mm256_set1_epi32(xs.bias[k][c]));
                        let s = _mm256_set1_ps(xs.step[k][c]);
                        ga[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), s, ga[k]);
                    }
                    left -= 1;
                    if left == 0 || c + 1 == blocks {
                        if g % 8 == 0 {
                            // SAFETY: g < groups, whose scales every row holds (caller),
                            // and half < 2
                            sbuf = unsafe { scales_256(scales, g, groups, half) };
                        }
                        let w = sbuf[g % 8];
                        for k in 0..N {
                            acc[k] = _mm256_fmadd_ps(ga[k], w, acc[k]);
                            ga[k] = _mm256_setzero_ps();
                        }
                        (g, left) = (g + 1, gblocks);
                    }
                }
            }
            for (o, v) in out.iter_mut().zip(acc) {
                // SAFETY: lanes 8 · half..8 · half + 8 of the 16
                unsafe { _mm256_storeu_ps(o.as_mut_ptr().add(8 * half), v) };
            }
        }
    };
}

/// A chunk's low- and high-nibble codes through the format's table.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn nibbles_table(v: __m256i, table: __m256i, low: __m256i) -> (__m256i, __m256i) {
    let lo = _mm256_shuffle_epi8(table, _mm256_and_si256(v, low));
    let hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16::<4>(v), low));
    (lo, hi)
}

/// A chunk's low- and high-nibble codes as they are: for a format whose table is the
/// identity (INT4), the same bytes [`nibbles_table`] gives, without the lookups.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn nibbles_linear(v: __m256i, _table: __m256i, low: __m256i) -> (__m256i, __m256i) {
    (
        _mm256_and_si256(v, low),
        _mm256_and_si256(_mm256_srli_epi16::<4>(v), low),
    )
}

/// In each 32-bit lane, the four products of signed codes `w` and signed activations `x`,
/// given `|x|` as `a` (AVX2): `|x|` as unsigned bytes times `w` with `x`'s sign, exact
/// pairs in `i16` (`|w| <= 127` on this tier's unbiased tables, `|x| <= 127`), then
/// quads. One instruction fewer a step than [`super::tiles8::quads_avx2`], which takes both
/// absolute value and sign from the codes.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn quads_signed_avx2(w: __m256i, x: __m256i, a: __m256i) -> __m256i {
    let pairs = _mm256_maddubs_epi16(a, _mm256_sign_epi8(w, x));
    _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))
}

/// Both halves of a chunk by [`quads_signed_avx2`].
#[inline]
#[target_feature(enable = "avx2,fma")]
fn pair_signed_avx2(
    lo: __m256i,
    hi: __m256i,
    xlo: __m256i,
    xhi: __m256i,
    alo: __m256i,
    ahi: __m256i,
) -> __m256i {
    _mm256_add_epi32(
        quads_signed_avx2(lo, xlo, alo),
        quads_signed_avx2(hi, xhi, ahi),
    )
}

/// Both halves of a chunk of codes in `0..=15` (a linear format's, see [`nibbles_linear`])
/// against signed `x` (AVX2): the codes are the unsigned operand of `vpmaddubsw` as they
/// are, so no sign is moved, and the two halves' pairs are added in `i16` before one
/// widening (a pair is at most `2 · 15 · 127 = 3,810` in magnitude, two of them 7,620: no
/// rounding or saturation anywhere, so the same sums as [`pair_signed_avx2`]).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn pair_linear_avx2(
    lo: __m256i,
    hi: __m256i,
    xlo: __m256i,
    xhi: __m256i,
    _alo: __m256i,
    _ahi: __m256i,
) -> __m256i {
    let pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
    _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))
}

/// Both halves of a chunk by [`quads_avxvnni`], without the `|x|` it does not need.
#[inline]
#[target_feature(enable = "avx2,fma,avxvnni")]
fn pair_biased_avxvnni(
    lo: __m256i,
    hi: __m256i,
    xlo: __m256i,
    xhi: __m256i,
    _alo: __m256i,
    _ahi: __m256i,
) -> __m256i {
    quads_avxvnni(quads_avxvnni(_mm256_setzero_si256(), lo, xlo), hi, xhi)
}

/// No bias to take off (the AVX2 tier's codes are signed, or linear and unsigned).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn unbias_none(s: __m256i, _b: __m256i) -> __m256i {
    s
}

/// The biased codes' `128 · Σ q` taken off a block's sum (the VNNI tier).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn unbias_128(s: __m256i, b: __m256i) -> __m256i {
    _mm256_sub_epi32(s, b)
}

tile_256!(
    tile_avx2,
    "avx2,fma",
    nibbles_table,
    pair_signed_avx2,
    unbias_none
);
tile_256!(
    tile_avx2_linear,
    "avx2,fma",
    nibbles_linear,
    pair_linear_avx2,
    unbias_none
);
tile_256!(
    tile_avxvnni,
    "avx2,fma,avxvnni",
    nibbles_table,
    pair_biased_avxvnni,
    unbias_128
);

#[cfg(test)]
mod tests {
    use super::super::tiles::tests::{values, xorshift};
    use super::*;

    /// A layout of 1 MB or more is built on the kernels' pool, in runs of tiles: every
    /// chunk lands where the layout says, whichever thread wrote it.
    #[test]
    fn a_large_tiled_layout_has_every_chunk_in_place() {
        use crate::{Format, GroupSize, quantize};
        let (rows, cols) = (32 * ROWS + 3, 4096);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 2001) as f32) / 1000.0 - 1.0)
            .collect();
        let q = quantize(&w, rows, cols, Format::Nf4Block(GroupSize::G64)).unwrap();
        let view = RowsView::new(&q, cols);
        let tiled = tile(&view, rows, None);
        let chunks = view.row_bytes.div_ceil(64);
        assert!(tiled.codes.len() >= 1 << 20);
        for t in 0..rows.div_ceil(ROWS) {
            for h in 0..chunks {
                for r in 0..ROWS {
                    let row = view.codes_of(t * ROWS + r);
                    let want = row.get(64 * h..64 * h + 64).unwrap_or(&[0; 64]);
                    for (q, four) in want.chunks(4).enumerate() {
                        let at = ((t * chunks + h) * ROWS + q) * 64 + 4 * r;
                        assert_eq!(
                            &tiled.codes[at..at + 4],
                            four,
                            "tile {t} chunk {h} row {r} bytes {}",
                            4 * q
                        );
                    }
                }
            }
        }
    }

    /// The tiled layout ([`tile`]: codes, and f16 group scales) gives the storage layout's bits: on the AVX-512
    /// tier ([`run`] with and without it, 1 to 7 rows of `x`, a part chunk and a part tile,
    /// every 4-bit format with its own tables and minimums), and through the plain-Rust
    /// definition (which [`dots`] falls back to) on every tier.
    #[test]
    fn the_tiled_layout_gives_the_storage_layouts_bits() {
        use crate::{Format, GroupSize, quantize};
        let kinds =
            super::super::tiles::tests::kinds("the_tiled_layout_gives_the_storage_layouts_bits");
        let mut next = xorshift(0x1234_5679);
        let (rows, cols) = (2 * ROWS + 5, 9 * BLOCK - 5);
        let w = values(&mut next, rows * cols, 7, 2.0);
        let x = values(&mut next, MAX_BATCH * cols, 9, 3.5);
        let bits = |v: &[f32]| -> Vec<u32> { v.iter().map(|f| f.to_bits()).collect() };
        for format in [
            Format::Nf4,
            Format::Nf4Block(GroupSize::G32),
            Format::Nf4Block(GroupSize::G64),
            Format::Int4Block(GroupSize::G64),
        ] {
            let q = quantize(&w, rows, cols, format).unwrap();
            let kp = cols.div_ceil(BLOCK) * BLOCK;
            let view = RowsView::new(&q, kp);
            // INT4's minimums (the other formats have none)
            let mins = Some(q.mins()).filter(|m| !m.is_empty());
            let tiled = tile(&view, rows, mins);
            assert_eq!(
                tiled.codes.len(),
                rows.div_ceil(ROWS) * view.row_bytes.div_ceil(64) * ROWS * 64
            );
            // the blockwise formats' scales come too (they are f16s), the per-row ones not
            let per_row = match view.rule {
                ScaleRule::Groups { per_row, .. } => per_row,
                ScaleRule::Row { .. } => 0,
            };
            assert_eq!(
                tiled.scales.as_ref().map(|h| h.len()),
                (per_row > 0).then_some(rows.div_ceil(ROWS) * per_row * ROWS),
                "{format:?}"
            );
            for &kind in &kinds {
                let Kind::Avx512(_) = kind else {
                    continue;
                };
                // the layout `run` builds on its first product and reads after
                let layouts = Layouts::default();
                for batch in 1..=MAX_BATCH {
                    let xb = &x[..batch * cols];
                    let mut plain = vec![0f32; rows * batch];
                    let mut tile = vec![0f32; rows * batch];
                    run(kind, xb, batch, &view, cols, rows, &mut plain, mins, None);
                    run(
                        kind,
                        xb,
                        batch,
                        &view,
                        cols,
                        rows,
                        &mut tile,
                        mins,
                        Some(&layouts),
                    );
                    assert_eq!(bits(&tile), bits(&plain), "{format:?} batch {batch}");
                    assert!(plain.iter().any(|&v| v != 0.0), "{format:?} batch {batch}");
                }
                let built = layouts.tiled.get().map(|t| t.codes.clone());
                assert_eq!(built, Some(tiled.codes.clone()), "{format:?}");
            }
            // the definition, reading either layout (the panel's bytes are every kind's)
            let Some(&widest) = kinds.last() else {
                return;
            };
            let panel = Panel::new(&x, MAX_BATCH, cols, true, 1, widest);
            let blocks = panel.blocks();
            let gblocks = group_blocks(&view, blocks);
            let body = &tiled.codes[..];
            let span = view.row_bytes.div_ceil(64) * ROWS * 64;
            let lut = view.lut.unwrap();
            for &kind in &kinds {
                let mut shape = Shape::new(kind, lut, blocks, gblocks, view.row_bytes);
                for first in [0, ROWS, 2 * ROWS] {
                    let n = (rows - first).min(ROWS);
                    let scales = TileScales::new(&view, first, n, None);
                    let half = tiled.scales.as_deref().map(|h| {
                        let span = per_row * ROWS;
                        &h[first / ROWS * span..(first / ROWS + 1) * span]
                    });
                    let tiled_scales = TileScales::new(&view, first, n, half);
                    let codes: [&[u8]; ROWS] =
                        std::array::from_fn(|r| view.codes_of(first + if r < n { r } else { 0 }));
                    let tile = &body[first / ROWS * span..(first / ROWS + 1) * span];
                    let in_tiles: [&[u8]; ROWS] = std::array::from_fn(|r| &tile[r * 64..]);
                    shape.stride = 64;
                    let want = reference::<3>(&shape, &codes, &panel, 1, &scales);
                    shape.stride = ROWS * 64;
                    let got = reference::<3>(&shape, &in_tiles, &panel, 1, &tiled_scales);
                    for k in 0..3 {
                        assert_eq!(
                            bits(&got[k][..n]),
                            bits(&want[k][..n]),
                            "{format:?} {kind:?} rows {first}"
                        );
                    }
                }
            }
        }
    }

    /// Every kind of kernel the CPU runs gives the bits of [`reference`], for 1 to 4 rows
    /// of `x`, on the per-row and blockwise 4-bit formats (a part chunk and a part tile
    /// included), at the extreme codes' weights and activations.
    #[test]
    fn simd_rows8_give_the_reference_bits() {
        use crate::{Format, GroupSize, quantize};
        let kinds = super::super::tiles::tests::kinds("simd_rows8_give_the_reference_bits");
        let mut next = xorshift(0x2545_f491);
        let (rows, cols) = (ROWS + 3, 9 * BLOCK - 5);
        let w = values(&mut next, rows * cols, 7, 2.0);
        let x = values(&mut next, XR * cols, 6, 3.5);
        for format in [
            Format::Nf4,
            Format::Nf4Block(GroupSize::G32),
            Format::Nf4Block(GroupSize::G128),
            Format::Int4Block(GroupSize::G64),
        ] {
            let q = quantize(&w, rows, cols, format).unwrap();
            let Some(&widest) = kinds.last() else {
                return;
            };
            let panel = Panel::new(&x, XR, cols, true, 1, widest);
            let view = RowsView::new(&q, panel.kp);
            assert!(fits(&view), "{format:?}");
            let blocks = panel.blocks();
            let gblocks = match view.rule {
                ScaleRule::Row { .. } => blocks,
                ScaleRule::Groups { .. } => view.group / BLOCK,
            };
            for &kind in &kinds {
                let lut = view.lut.unwrap();
                let shape = Shape::new(kind, lut, blocks, gblocks, view.row_bytes);
                assert_eq!(shape.linear, matches!(format, Format::Int4Block(_)));
                let chunked: Vec<ChunkedX> = (0..XR)
                    .map(|b| ChunkedX::new(&panel, b, shape.per))
                    .collect();
                for first in [0, ROWS] {
                    let n = (rows - first).min(ROWS);
                    let scales = TileScales::new(&view, first, n, None);
                    let codes: [&[u8]; ROWS] =
                        std::array::from_fn(|r| view.codes_of(first + if r < n { r } else { 0 }));
                    let bits = |v: &[[f32; ROWS]]| -> Vec<u32> {
                        v.iter().flatten().map(|f| f.to_bits()).collect()
                    };
                    let args = (&shape, &codes, &chunked[..], &panel, &scales);
                    let got = dots::<1>(kind, args.0, args.1, args.2, args.3, 2, args.4);
                    let want = reference::<1>(&shape, &codes, &panel, 2, &scales);
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{format:?} {kind:?} rows {first}, N 1"
                    );
                    let got = dots::<4>(kind, args.0, args.1, args.2, args.3, 0, args.4);
                    let want = reference::<4>(&shape, &codes, &panel, 0, &scales);
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{format:?} {kind:?} rows {first}, N 4"
                    );
                }
            }
        }
    }

    /// The chunked row holds each block's low-nibble half, then its high-nibble half, per
    /// chunk, and zeros past the row.
    #[test]
    fn chunked_x_is_each_chunks_halves_in_order() {
        let cols = 5 * BLOCK - 3;
        let mut next = xorshift(0x51ed_270b);
        let x: Vec<f32> = (0..cols).map(|_| (next() % 255) as f32 - 127.0).collect();
        let kinds = super::super::tiles::tests::kinds("chunked_x_is_each_chunks_halves_in_order");
        let Some(&widest) = kinds.last() else {
            return;
        };
        let panel = Panel::new(&x, 1, cols, true, 1, widest);
        let (units, _, _) = panel.block(0);
        let natural: Vec<i8> = units
            .iter()
            .flat_map(|u| u.to_le_bytes().map(|v| v as i8))
            .collect();
        for per in [2, 4] {
            let got = ChunkedX::new(&panel, 0, per).bytes;
            assert_eq!(got.len(), 5usize.div_ceil(per) * per * BLOCK);
            for (i, &v) in got.iter().enumerate() {
                let (h, rest) = (i / (per * BLOCK), i % (per * BLOCK));
                let (side, k, j) = (rest / (per * 16), (rest % (per * 16)) / 16, rest % 16);
                let c = h * per + k;
                let want = natural.get(c * BLOCK + side * 16 + j).copied().unwrap_or(0);
                assert_eq!(v, want, "per {per}, byte {i}");
            }
        }
    }
}
