//! Intel AMX tiles for [`super::Activations::Block8`] at batches of [`MIN_BATCH`] and
//! more: the integer formats whose groups are whole blocks of 32 columns (the 4-bit
//! formats by default, the 8-bit ones when asked), with the same exact block sums and the
//! same f32 operations as [`super::tiles8`], so the same bits, on the CPU's matrix unit.
//!
//! # Layout
//! A block of 32 columns is one `tdpbssd` (signed by signed bytes) of a left tile of 16
//! weight rows by the block's 32 codes and a right tile of 16 rows of `x`. The codes are
//! signed as the format's table gives them (not biased: AMX multiplies signed bytes by
//! signed bytes). A task's 16 weight rows are decoded once, two rows at a time, into a
//! block-major copy: block `c`'s 16 rows of 32 codes are 512 bytes at `512 c`, a left tile
//! read in order (16 rows read in place at a power-of-two row length all fall in one set
//! of the first-level cache). The right tile
//! is the block's 8 four-byte units of the [`super::tiles8::Panel`] of 16 rows of `x`, as
//! the VNNI tiers lay it out (unit `u`, lane `l`: row `l`'s bytes `4u..4u + 4`), so `x` is
//! laid out once for every tier.
//!
//! The products go a group of columns at a time and, within it, a panel of `x` at a time,
//! so the 16 x 16 group sums being made stay in registers (a panel's running totals are
//! touched once a group). Each product's sums are stored [`LAG`] products after its issue
//! (four sum tiles take turns: the tile unit runs in order, and a store straight after its
//! product waited for all of it) into one of four line-aligned buffers, and folded with the
//! block's steps one product later still (vector loads straight after a tile store waited
//! for it). On the Intel Xeon of `docs/BENCHMARKS.md` a product here took about 40 ns
//! (about 5 of them the `tdpbssd`, whose time does not depend on its depth, so a block of
//! 32 uses half of it).
//!
//! # Arithmetic (that of [`super::tiles8`], to the bit)
//! For weight row `r` and `x` row `b`: the block's exact sum `S = Σ c_j q_j` (at most
//! `32 · 128 · 127` in magnitude); `a_g = fma(S as f32, s, a_g)` over the group's blocks in
//! order, from `a_g = 0`; `acc = fma(a_g, w_g, acc)` over the groups in order, from
//! `acc = 0`; then `Int4Block`'s minimums, as [`super::tiles8::run`] adds them.
//!
//! # Safety
//! Every tile instruction runs between [`super::amx::Tiles::load`] of [`CONFIG`] and its
//! drop, on the thread that loaded it; the compiler never allocates the tile registers,
//! so they keep their values between the `asm!` blocks. Every tile load reads inside
//! ranges the safe wrapper checked first (512 bytes of the block-major codes, 8 rows of 64
//! bytes of a panel), and every tile store writes one of the task's four 1 KB buffers of
//! sums.
#![allow(unsafe_code)]

use std::arch::asm;
use std::arch::x86_64::{
    __m512, __m512i, _mm_loadu_si128, _mm512_broadcast_i32x4, _mm512_cvtepi32_ps, _mm512_fmadd_ps,
    _mm512_load_ps, _mm512_loadu_ps, _mm512_loadu_si512, _mm512_set1_ps, _mm512_setzero_ps,
    _mm512_shuffle_i64x2, _mm512_store_ps, _mm512_store_si512,
};

use super::RowsView;
use super::amx::{Config, Tiles, Token};
use super::tiles::{Ahead, Kind, next_codes};
use super::tiles8::{Minimums, Panel, group_blocks, nibble_blocks};

/// The smallest batch that runs here: that of the VNNI tiles (below 16 a tile's other
/// rows of `x` are zeros).
pub(super) const MIN_BATCH: usize = super::tiles::MIN_BATCH;
/// Weight rows a tile, and a task.
const ROWS: usize = 16;
/// Rows of `x` a tile.
const LANES: usize = 16;
/// Columns a block, a product's depth.
const BLOCK: usize = super::BLOCK8;
/// Blocks decoded at a time: 64 bytes of a 4-bit row, 128 of an 8-bit one.
const CHUNK: usize = 4;
/// Products between a product's issue and the store of its sums.
const LAG: usize = 2;

/// Tiles 0 to 3: the sums of four products in turn (16 rows of 16 `i32`); 4 and 5: the
/// weights of two products in turn (16 rows of 32 codes); 6 and 7: `x` of two products in
/// turn (8 units of 16 rows' four bytes).
static CONFIG: Config = Config::new(
    [64, 64, 64, 64, 32, 32, 64, 64],
    [16, 16, 16, 16, 16, 16, 8, 8],
);

/// Two weight rows' 32 codes of one block, side by side: a line of a left tile.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([i8; 64]);

/// One product's 16 x 16 sums as stored: weight row `r`, lane `l` (each row a line: a
/// tile store across lines took several times as long).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Sums([[i32; LANES]; ROWS]);

/// A panel's running sums: `.0[r]` is weight row `r` against the panel's 16 rows of `x`.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Acc([[f32; LANES]; ROWS]);

impl Acc {
    const ZERO: Self = Self([[0.0; LANES]; ROWS]);
}

/// Product `i` on sum tile `i % 4`: a block's weight tile at `w` (512 bytes in order)
/// by `x`'s tile at `xq` (8 rows of 64 bytes in order), through tiles `4 + i % 2` and
/// `6 + i % 2`.
///
/// # Safety
/// [`CONFIG`] loaded on this thread; `w` points at 512 bytes and `xq` at 8 · 16 units.
#[inline(always)]
unsafe fn issue(i: usize, w: *const i8, xq: *const u32) {
    macro_rules! issue {
        ($sum:literal, $w:literal, $x:literal) => {
            asm!(
                concat!("tilezero tmm", $sum),
                concat!("tileloadd tmm", $w, ", [{w} + {ws} * 1]"),
                concat!("tileloadd tmm", $x, ", [{x} + {xs} * 1]"),
                concat!("tdpbssd tmm", $sum, ", tmm", $w, ", tmm", $x),
                w = in(reg) w,
                ws = in(reg) BLOCK,
                x = in(reg) xq,
                xs = in(reg) 64usize,
                options(nostack, readonly)
            )
        };
    }
    // SAFETY: configured tiles, and loads inside the ranges (caller)
    unsafe {
        match i % 4 {
            0 => issue!("0", "4", "6"),
            1 => issue!("1", "5", "7"),
            2 => issue!("2", "4", "6"),
            _ => issue!("3", "5", "7"),
        }
    }
}

/// Product `i`'s sums, from sum tile `i % 4`, into `out`.
///
/// # Safety
/// [`CONFIG`] loaded on this thread, and product `i` issued on it and its sum tile not
/// issued again since.
#[inline(always)]
unsafe fn store(i: usize, out: &mut Sums) {
    let o = out.0.as_mut_ptr().cast::<u8>();
    macro_rules! store {
        ($sum:literal) => {
            asm!(
                concat!("tilestored [{o} + {st} * 1], tmm", $sum),
                o = in(reg) o,
                st = in(reg) 64usize,
                options(nostack)
            )
        };
    }
    // SAFETY: configured tiles; `out` is 16 rows of 64 bytes
    unsafe {
        match i % 4 {
            0 => store!("0"),
            1 => store!("1"),
            2 => store!("2"),
            _ => store!("3"),
        }
    }
}

/// A product in flight: its block, its panel, and the group it ends (if it is its
/// panel's last block of a group).
#[derive(Clone, Copy, Default)]
struct Item {
    c: usize,
    k: usize,
    ends: Option<usize>,
}

/// 16 weight rows (`tiled`, block-major; `scales`, `groups` a row) against every panel
/// `panels[k]` (its units and steps), into `acc[k]` (zeroed first).
///
/// # Safety
/// [`CONFIG`] loaded on this thread; AVX-512 F present; `tiled` holds `8 · blocks` lines,
/// `scales` `16 · blocks.div_ceil(gblocks)` values (`gblocks > 0`), each panel
/// `8 · 16 · blocks` units and `16 · blocks` steps, and `acc` a value for each panel.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn pass(
    tiled: &[Line],
    scales: &[f32],
    blocks: usize,
    gblocks: usize,
    panels: &[(&[u32], &[f32])],
    sums: &mut [Sums; 4],
    acc: &mut [Acc],
    ahead: &mut Ahead,
) {
    let groups = blocks.div_ceil(gblocks);
    acc.fill(Acc::ZERO);
    let mut ga = [_mm512_setzero_ps(); ROWS];
    let mut ring = [Item::default(); 4];
    let mut issued = 0;
    // product `p`'s sums out of its tile, `LAG` products after its issue
    let put = |p: usize, sums: &mut [Sums; 4]| {
        // SAFETY: configured; product p was issued `LAG` products ago, and its sum tile
        // not issued again since (four take turns)
        unsafe { store(p, &mut sums[p % 4]) };
    };
    // product `p`'s stored sums into `ga` one product later (vector loads straight
    // after the tile store waited for it), and `ga` into its panel's `acc` at a group's
    // end
    let mut fold = |p: usize, it: Item, ga: &mut [__m512; ROWS], sums: &[Sums; 4]| {
        // SAFETY: block c < blocks: sixteen steps from 16c are in panel k's steps
        let sv = unsafe { _mm512_loadu_ps(panels[it.k].1.as_ptr().add(LANES * it.c)) };
        for (a, row) in ga.iter_mut().zip(&sums[p % 4].0) {
            // SAFETY: a row of 16 `i32`s
            let s = unsafe { _mm512_loadu_si512(row.as_ptr().cast()) };
            *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), sv, *a);
        }
        if let (Some(g), Some(a)) = (it.ends, acc.get_mut(it.k)) {
            for (r, (a, x)) in a.0.iter_mut().zip(ga.iter_mut()).enumerate() {
                // SAFETY: row r < 16 has `groups` scales, g < groups; a row of 16
                // aligned `f32`s
                unsafe {
                    let w = *scales.get_unchecked(r * groups + g);
                    let v = _mm512_fmadd_ps(*x, _mm512_set1_ps(w), _mm512_load_ps(a.as_ptr()));
                    _mm512_store_ps(a.as_mut_ptr(), v);
                }
                *x = _mm512_setzero_ps();
            }
        }
    };
    for g in 0..groups {
        let (c0, c1) = (g * gblocks, ((g + 1) * gblocks).min(blocks));
        for (k, &(xq, _)) in panels.iter().enumerate() {
            for c in c0..c1 {
                ahead.step();
                // SAFETY: configured (caller); block c < blocks: lines 8c..8c + 8 of
                // `tiled`, and units 8c..8c + 8 of panel k's 16 lanes
                unsafe {
                    issue(
                        issued,
                        tiled.as_ptr().add(8 * c).cast(),
                        xq.as_ptr().add(8 * LANES * c),
                    );
                }
                let ends = (c + 1 == c1).then_some(g);
                ring[issued % 4] = Item { c, k, ends };
                issued += 1;
                if let Some(p) = issued.checked_sub(LAG + 1) {
                    put(p, sums);
                }
                if let Some(p) = issued.checked_sub(LAG + 2) {
                    fold(p, ring[p % 4], &mut ga, sums);
                }
            }
        }
    }
    for p in issued.saturating_sub(LAG)..issued {
        put(p, sums);
    }
    for p in issued.saturating_sub(LAG + 1)..issued {
        fold(p, ring[p % 4], &mut ga, sums);
    }
}

/// Rows `first..first + n` (`n <= 16`, the rest zeros) of `view` into `out`, block-major
/// ([`Line`] `8c + p` holds rows `2p` and `2p + 1` of block `c`), the codes as the kernels'
/// integer view has them (a 4-bit format's through its table, unbiased).
fn decode(t: Token, view: &RowsView<'_>, first: usize, n: usize, blocks: usize, out: &mut [Line]) {
    let _ = t;
    let row = |r: usize| if r < n { view.codes_of(first + r) } else { &[] };
    // code bytes a chunk of CHUNK blocks takes
    let per = if view.lut.is_some() { 16 } else { 32 } * CHUNK;
    let table = view.lut.copied().unwrap_or([0; 16]);
    for p in 0..ROWS / 2 {
        let (r0, r1) = (row(2 * p), row(2 * p + 1));
        for j in 0..blocks.div_ceil(CHUNK) {
            let whole = CHUNK * (j + 1) <= blocks
                && r0.len() >= per * (j + 1)
                && r1.len() >= per * (j + 1)
                && out.len() >= 8 * CHUNK * (j + 1);
            if whole {
                // SAFETY: the token proves AVX-512 F and BW; `whole` checked both rows'
                // chunk and the chunk's lines `8 · 4j + p + 8b` for b < 4
                unsafe {
                    let (c0, c1) = (r0.as_ptr().add(per * j), r1.as_ptr().add(per * j));
                    let o = out.as_mut_ptr().add(8 * CHUNK * j + p);
                    match view.lut {
                        Some(_) => chunk_nibbles(c0, c1, &table, o),
                        None => chunk_bytes(c0, c1, o),
                    }
                }
                continue;
            }
            // a part chunk (a row's end, or rows past the matrix): a block at a time
            let mut v = [[0i8; CHUNK * BLOCK]; 2];
            for (vr, r) in v.iter_mut().zip([r0, r1]) {
                let codes = r.get(per * j..).unwrap_or(&[]);
                let codes = codes.get(..per).unwrap_or(codes);
                match view.lut {
                    Some(lut) => super::portable::decode_nibbles(codes, lut, vr),
                    None => {
                        for (o, &c) in vr.iter_mut().zip(codes) {
                            *o = c as i8;
                        }
                    }
                }
            }
            for b in 0..CHUNK.min(blocks - CHUNK * j) {
                if let Some(line) = out.get_mut(8 * (CHUNK * j + b) + p) {
                    line.0[..BLOCK].copy_from_slice(&v[0][BLOCK * b..BLOCK * (b + 1)]);
                    line.0[BLOCK..].copy_from_slice(&v[1][BLOCK * b..BLOCK * (b + 1)]);
                }
            }
        }
    }
}

/// Two rows' four blocks as lines: block `b`'s line at `out + 8b` is row 0's 32 codes,
/// then row 1's.
///
/// # Safety
/// AVX-512 F present; `out`, `out + 8`, `out + 16`, `out + 24` are lines.
#[target_feature(enable = "avx512f")]
unsafe fn put_lines(x01: [__m512i; 2], x23: [__m512i; 2], out: *mut Line) {
    // SAFETY: the four lines (caller), 64-byte aligned
    unsafe {
        _mm512_store_si512(out.cast(), _mm512_shuffle_i64x2::<0x44>(x01[0], x01[1]));
        _mm512_store_si512(
            out.add(8).cast(),
            _mm512_shuffle_i64x2::<0xEE>(x01[0], x01[1]),
        );
        _mm512_store_si512(
            out.add(16).cast(),
            _mm512_shuffle_i64x2::<0x44>(x23[0], x23[1]),
        );
        _mm512_store_si512(
            out.add(24).cast(),
            _mm512_shuffle_i64x2::<0xEE>(x23[0], x23[1]),
        );
    }
}

/// Two 4-bit rows' 64 code bytes each (four blocks) through `lut`, as [`put_lines`] puts
/// them; each 16-byte run gives its block's low nibbles' values, then its high ones'.
///
/// # Safety
/// AVX-512 F and BW present; `c0` and `c1` point at 64 bytes; `out` as for [`put_lines`].
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn chunk_nibbles(c0: *const u8, c1: *const u8, lut: &[i8; 16], out: *mut Line) {
    // SAFETY: `lut` is 16 bytes
    let table = _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(lut.as_ptr().cast()) });
    let split = |c: *const u8| {
        // SAFETY: 64 bytes at `c` (caller)
        nibble_blocks(table, unsafe { _mm512_loadu_si512(c.cast()) })
    };
    let ((a01, a23), (b01, b23)) = (split(c0), split(c1));
    // SAFETY: the lines (caller)
    unsafe { put_lines([a01, b01], [a23, b23], out) };
}

/// Two 8-bit rows' 128 code bytes each (four blocks), as [`put_lines`] puts them.
///
/// # Safety
/// AVX-512 F present; `c0` and `c1` point at 128 bytes; `out` as for [`put_lines`].
#[target_feature(enable = "avx512f")]
unsafe fn chunk_bytes(c0: *const u8, c1: *const u8, out: *mut Line) {
    // SAFETY: 128 bytes at each (caller), and the lines
    unsafe {
        let (a01, a23) = (
            _mm512_loadu_si512(c0.cast()),
            _mm512_loadu_si512(c0.add(64).cast()),
        );
        let (b01, b23) = (
            _mm512_loadu_si512(c1.cast()),
            _mm512_loadu_si512(c1.add(64).cast()),
        );
        put_lines([a01, b01], [a23, b23], out);
    }
}

/// Whether a product takes these tiles: what [`super::tiles8`] takes, at a batch of at
/// least [`MIN_BATCH`].
pub(super) fn fits(view: &RowsView<'_>, batch: usize) -> bool {
    super::tiles8::fits(view) && batch >= MIN_BATCH
}

/// A thread's buffers.
struct Scratch {
    tiled: Vec<Line>,
    scales: Vec<f32>,
    sums: Box<[Sums; 4]>,
    acc: Vec<Acc>,
}

/// The whole product, as [`super::tiles8::run`] computes it (the same bits): `yt` is
/// `[rows, batch]`, `mins` `Int4Block`'s minimums; `kind` is the AVX-512 tier below.
#[allow(clippy::too_many_arguments)]
pub(super) fn run(
    t: Token,
    kind: Kind,
    x: &[f32],
    batch: usize,
    view: &RowsView<'_>,
    cols: usize,
    rows: usize,
    yt: &mut [f32],
    mins: Option<&[f32]>,
) {
    let panel = Panel::new(x, batch, cols, view.lut.is_some(), LANES, kind);
    let (kp, blocks) = (panel.kp, panel.blocks());
    let gblocks = group_blocks(view, blocks);
    let groups = blocks.div_ceil(gblocks);
    let panels = batch.div_ceil(LANES);
    let minimums = Minimums::new(&panel, batch, gblocks, mins);
    // every panel's units and steps, checked once: `Panel::new` made each of `LANES` rows
    let parts: Vec<(&[u32], &[f32])> = (0..panels)
        .map(|k| panel.block(k))
        .filter(|(xq, step, _)| xq.len() >= kp / 4 * LANES && step.len() >= blocks * LANES)
        .map(|(xq, step, _)| (xq, step))
        .collect();
    if parts.len() != panels {
        // not reached: `Panel::new` made every panel
        debug_assert!(false, "a panel short of {kp} columns");
        return;
    }
    super::run_tasks(
        yt,
        batch * ROWS,
        batch * rows * cols,
        || Scratch {
            tiled: vec![Line([0; 64]); 8 * blocks],
            scales: vec![0.0; ROWS * groups],
            sums: Box::new([Sums([[0; LANES]; ROWS]); 4]),
            acc: vec![Acc::ZERO; panels],
        },
        |s, (task, out)| {
            let first = task * ROWS;
            let n = (out.len() / batch).min(rows.saturating_sub(first));
            decode(t, view, first, n, blocks, &mut s.tiled);
            for (r, sc) in s.scales.chunks_exact_mut(groups.max(1)).enumerate() {
                let rs = view.scales_of(first + r);
                for (g, o) in sc.iter_mut().enumerate() {
                    *o = if r < n { rs.get(g) } else { 0.0 };
                }
            }
            let mut ahead = Ahead::new(next_codes(view, first), panels * blocks);
            let tiles = Tiles::load(t, &CONFIG);
            // SAFETY: `tiles` holds CONFIG on this thread; the token proves AVX-512;
            // `tiled` is `8 · blocks` lines, `scales` 16 rows of `groups`, every panel's
            // ranges were checked above and `acc` has one value a panel
            unsafe {
                pass(
                    &s.tiled,
                    &s.scales,
                    blocks,
                    gblocks,
                    &parts,
                    &mut s.sums,
                    &mut s.acc,
                    &mut ahead,
                );
            }
            for (k, acc) in s.acc.iter().enumerate() {
                for (r, lanes) in acc.0.iter().enumerate().take(n) {
                    let Some(ys) = out.get_mut(r * batch + k * LANES..(r + 1) * batch) else {
                        continue;
                    };
                    for (o, &l) in ys.iter_mut().zip(lanes) {
                        *o = l;
                    }
                }
            }
            drop(tiles);
            minimums.add_rows(kind, first, n, out);
        },
    );
}
