//! Intel AMX tiles for 8-bit codes in long groups (the per-row INT8 formats) at batches
//! of [`MIN_BATCH`] and more: the same exact group sums and the same f32 operations as
//! [`super::tiles`], so the same bits, on the CPU's matrix unit.
//!
//! # Layout
//! AMX multiplies tiles of 16 rows by 64 bytes: `tdpbssd` (signed by signed bytes) and
//! `tdpbsud` (signed by unsigned) add, for each of 16 x 16 outputs, 64 byte products into
//! an `i32`. The weights are the left tile as stored: 16 rows of codes, 64 columns a step,
//! read in place with the row length as stride (nothing is repacked). The right tile holds
//! 16 rows of `x` for the same 64 columns, four columns of one row side by side (unit
//! `q · 64 + 4l + j` is row `l`'s column `4q + j`), laid out once a product. Each 14-bit
//! activation `q` is split exactly into bytes, `q = 128 · h + u` with `u = q & 127` in
//! `0..=127` and `h = q >> 7` in `-64..=63`, so a group's sum is
//! `S = 128 · Σ c·h + Σ c·u`: one `tdpbssd` and one `tdpbsud` a step. Every sum is exact
//! (at most `1024 · 127 · 8191` in magnitude, below `2^31`).
//!
//! # Arithmetic (that of [`super::tiles`])
//! For weight row `r` and `x` row `b`: `acc = fma(S_f as f32, scale_f, acc)` over the
//! flushes of [`FLUSH`] columns in order, from `acc = 0`; then `y = acc · d_b`.
//!
//! # Safety
//! The tile registers are set up by `ldtilecfg` at the start of each task, on the thread
//! that runs it, and at its end the thread's configuration is given back as it was found
//! (`sttilecfg` first; `tilerelease` where there was none): candle's AMX kernels configure
//! a thread once and keep it, and a released or reshaped configuration under them would
//! fault or compute with the wrong shapes. The compiler never allocates the tile
//! registers, so they keep their values between the `asm!` blocks of a task. Linux lets a
//! process use them only after it asks (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), which
//! [`Token::detect`] does once; a token exists only after the CPU and the kernel both said
//! yes. Every tile load reads 16 rows of 64 bytes at the given stride, inside ranges the
//! safe wrapper checked first.
#![allow(unsafe_code)]

use std::arch::asm;
use std::sync::OnceLock;

use super::{FLUSH, FixedX, RowsView, avx512};

/// The smallest batch that runs here, the tiles' (a tile holds 16 rows of `x`; below 16 the
/// rest are zeros, and at 8 and 12 rows the tile unit still took 0.35-0.40x the time of
/// the AVX-512 VNNI tiles, 4096 x 4096, one thread).
pub(super) const MIN_BATCH: usize = super::tiles::MIN_BATCH;
/// Weight rows a task takes: two tiles.
const ROWS: usize = 32;
/// Rows of `x` a tile holds.
const LANES: usize = 16;
/// Columns a step.
const STEP: usize = 64;
/// Bytes of one tile.
const TILE: usize = 16 * STEP;

/// Proof that the CPU has AMX-TILE and AMX-INT8 besides the AVX-512 tier, and that the
/// operating system lets this process use them.
#[derive(Debug, Clone, Copy)]
pub(super) struct Token(());

impl Token {
    /// Asks once a process.
    pub(super) fn detect() -> Option<Self> {
        static OK: OnceLock<bool> = OnceLock::new();
        let ok = *OK.get_or_init(|| cpu_has_amx() && permitted());
        avx512::Token::detect().filter(|_| ok).map(|_| Self(()))
    }
}

/// CPUID leaf 7, sub-leaf 0: EDX bit 24 (AMX-TILE) and bit 25 (AMX-INT8).
fn cpu_has_amx() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    #[allow(unused_unsafe)]
    // SAFETY: CPUID exists on every x86_64 CPU; leaf 7 is asked only when leaf 0 lists it
    let edx = unsafe {
        if __cpuid(0).eax < 7 {
            return false;
        }
        __cpuid_count(7, 0).edx
    };
    edx & (1 << 24) != 0 && edx & (1 << 25) != 0
}

/// `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`: Linux's permission to use the
/// tile data, for the whole process.
#[cfg(target_os = "linux")]
fn permitted() -> bool {
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let ret: i64;
    // SAFETY: a system call that changes only this process's permitted state components;
    // it reads and writes no memory of ours
    unsafe {
        asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret == 0
}

#[cfg(not(target_os = "linux"))]
fn permitted() -> bool {
    false
}

/// Whether a product takes the AMX tiles: 8-bit codes (no table) summed [`FLUSH`] columns
/// at a time, rows of whole steps stored back to back, and a batch of at least
/// [`MIN_BATCH`].
pub(super) fn fits(view: &RowsView<'_>, kp: usize, batch: usize) -> bool {
    view.lut.is_none()
        && view.group == FLUSH
        && kp > 0
        && kp.is_multiple_of(STEP)
        && view.row_bytes == kp
        && batch >= MIN_BATCH
}

/// A tile configuration for `ldtilecfg`: palette 1, each tile's bytes a row and rows.
#[repr(C, align(64))]
pub(super) struct Config {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

impl Config {
    /// No configuration: what `sttilecfg` stores where none is loaded.
    const NONE: Self = Self {
        palette: 0,
        start_row: 0,
        reserved: [0; 14],
        colsb: [0; 16],
        rows: [0; 16],
    };

    /// Tiles `0..8` with `colsb[i]` bytes a row and `rows[i]` rows (0 and 0: unused); a
    /// shape past palette 1's limits (16 rows of 64 bytes, whole `i32`s) fails to compile
    /// where the configuration is a constant.
    pub(super) const fn new(colsb: [u16; 8], rows: [u8; 8]) -> Self {
        let mut c = Self {
            palette: 1,
            ..Self::NONE
        };
        let mut i = 0;
        while i < 8 {
            assert!(colsb[i] <= 64 && colsb[i].is_multiple_of(4) && rows[i] <= 16);
            c.colsb[i] = colsb[i];
            c.rows[i] = rows[i];
            i += 1;
        }
        c
    }
}

/// Eight tiles of 16 rows by 64 bytes.
const CONFIG: Config = Config::new([64; 8], [16; 8]);

/// A tile configuration loaded on this thread by [`Tiles::load`]; on drop the one found
/// before is given back (`ldtilecfg` of it, or `tilerelease` where there was none).
/// candle's AMX kernels configure a thread once and keep it, and a released or reshaped
/// configuration under them would fault or compute with the wrong shapes.
pub(super) struct Tiles {
    found: Config,
    /// Made and dropped on one thread.
    _thread: std::marker::PhantomData<*const ()>,
}

impl Tiles {
    /// Loads `config` on this thread, keeping what was there.
    pub(super) fn load(_: Token, config: &'static Config) -> Self {
        let mut found = Config::NONE;
        // SAFETY: the token proves AMX and Linux's permission; `sttilecfg` writes the 64
        // bytes of `found` (zeros when no configuration is loaded); `config` is within
        // palette 1's limits (`Config::new`)
        unsafe {
            asm!("sttilecfg [{0}]", in(reg) &mut found, options(nostack));
            asm!("ldtilecfg [{0}]", in(reg) config, options(nostack, readonly));
        }
        Self {
            found,
            _thread: std::marker::PhantomData,
        }
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: `load` ran on this thread (a `Tiles` is not `Send`), so AMX is there and
        // permitted; `found` is a configuration this CPU loaded before, or none
        unsafe {
            if self.found.palette == 0 {
                asm!("tilerelease", options(nostack, nomem));
            } else {
                asm!("ldtilecfg [{0}]", in(reg) &self.found, options(nostack, readonly));
            }
        }
    }
}

/// `x` split into high and low bytes in right-tile order: for block `k` of 16 rows and
/// step `s`, tile `k · steps + s` of each.
struct XTiles {
    steps: usize,
    hi: Vec<i8>,
    lo: Vec<u8>,
}

impl XTiles {
    fn new(fx: &FixedX, batch: usize) -> Self {
        let steps = fx.kp / STEP;
        let blocks = batch.div_ceil(LANES);
        let mut hi = vec![0i8; blocks * steps * TILE];
        let mut lo = vec![0u8; blocks * steps * TILE];
        for b in 0..batch {
            let (k, l) = (b / LANES, b % LANES);
            // four columns at a time: quad `c` is step `c / 16`'s unit row `c % 16`
            for (c, quad) in fx.row(b).chunks_exact(4).enumerate().take(steps * STEP / 4) {
                let at = (k * steps + c / 16) * TILE + (c % 16) * STEP + 4 * l;
                let (Some(h), Some(u)) = (hi.get_mut(at..at + 4), lo.get_mut(at..at + 4)) else {
                    continue;
                };
                for ((h, u), &q) in h.iter_mut().zip(u).zip(quad) {
                    // |q| <= 8191: q >> 7 is in -64..=63
                    *h = (q >> 7) as i8;
                    *u = (q & 127) as u8;
                }
            }
        }
        Self { steps, hi, lo }
    }
}

/// One flush's four tiles of sums, as stored: `[w0 · hi, w0 · lo, w1 · hi, w1 · lo]`, each
/// 16 weight rows by 16 rows of `x`.
type Sums = [[[i32; LANES]; 16]; 4];

/// Steps `s0..s1` of weight rows `w0` (16, at stride `ws`) and `w1` against `x` block
/// `xh`/`xl`, summed into `out`.
///
/// # Safety
/// The tiles configured ([`CONFIG`]) on this thread; `w0` and `w1` point at 16 rows of at
/// least `STEP · s1` bytes each at stride `ws`; `xh` and `xl` at `s1` tiles.
unsafe fn flush(
    w0: *const u8,
    w1: *const u8,
    ws: usize,
    xh: *const i8,
    xl: *const u8,
    (s0, s1): (usize, usize),
    out: &mut Sums,
) {
    // SAFETY: configured tiles (caller)
    unsafe {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            options(nostack, nomem)
        );
    }
    for s in s0..s1 {
        // SAFETY: every load is 16 rows of 64 bytes inside the ranges the caller vouched
        // for: weight rows at column `STEP · s`, `x` tile `s`
        unsafe {
            asm!(
                // each product issued as soon as its two tiles are loaded
                "tileloadd tmm4, [{w0} + {ws} * 1]",
                "tileloadd tmm6, [{xh} + {st} * 1]",
                "tdpbssd tmm0, tmm4, tmm6",
                "tileloadd tmm7, [{xl} + {st} * 1]",
                "tdpbsud tmm1, tmm4, tmm7",
                "tileloadd tmm5, [{w1} + {ws} * 1]",
                "tdpbssd tmm2, tmm5, tmm6",
                "tdpbsud tmm3, tmm5, tmm7",
                w0 = in(reg) w0.add(STEP * s),
                w1 = in(reg) w1.add(STEP * s),
                ws = in(reg) ws,
                xh = in(reg) xh.add(TILE * s),
                xl = in(reg) xl.add(TILE * s),
                st = in(reg) STEP,
                options(nostack, readonly)
            );
        }
    }
    let o = out.as_mut_ptr().cast::<u8>();
    // SAFETY: `out` is four tiles of 16 rows of 64 bytes, back to back
    unsafe {
        asm!(
            "tilestored [{o} + {st} * 1], tmm0",
            "tilestored [{o1} + {st} * 1], tmm1",
            "tilestored [{o2} + {st} * 1], tmm2",
            "tilestored [{o3} + {st} * 1], tmm3",
            o = in(reg) o,
            o1 = in(reg) o.add(TILE),
            o2 = in(reg) o.add(2 * TILE),
            o3 = in(reg) o.add(3 * TILE),
            st = in(reg) STEP,
            options(nostack)
        );
    }
}

/// `acc[r][l] = fma((128 · hi + lo) as f32, scales[r], acc[r][l])` for the 32 rows of a
/// flush: the tiles' flush, the same operations.
#[target_feature(enable = "avx512f,fma")]
fn add_flush(sums: &Sums, scales: &[f32; ROWS], acc: &mut [[f32; LANES]; ROWS]) {
    for (r, (a, &sc)) in acc.iter_mut().zip(scales).enumerate() {
        let (h, u) = (r / 16 * 2, r / 16 * 2 + 1);
        let (Some(hi), Some(lo)) = (sums[h].get(r % 16), sums[u].get(r % 16)) else {
            continue;
        };
        for ((o, &hv), &lv) in a.iter_mut().zip(hi).zip(lo) {
            *o = (((hv << 7) + lv) as f32).mul_add(sc, *o);
        }
    }
}

/// A thread's buffers: the last task's rows when they are fewer than [`ROWS`] (padded
/// with zero rows), each flush's scales of the task's rows, the sums and the accumulators.
struct Scratch {
    rows: Vec<u8>,
    scales: Vec<[f32; ROWS]>,
    sums: Box<Sums>,
    acc: Vec<[[f32; LANES]; ROWS]>,
}

/// `yt[r · batch + b] = (W x_b)_r` for a product [`fits`] took, as [`super::tiles::run`]
/// computes it (the same bits).
pub(super) fn run(
    t: Token,
    fx: &FixedX,
    batch: usize,
    view: &RowsView<'_>,
    rows: usize,
    macs: usize,
    yt: &mut [f32],
) {
    let kp = fx.kp;
    let xt = XTiles::new(fx, batch);
    let steps = xt.steps;
    let blocks = batch.div_ceil(LANES);
    let flushes = steps.div_ceil(FLUSH / STEP);
    super::run_tasks(
        yt,
        batch * ROWS,
        macs,
        || Scratch {
            rows: Vec::new(),
            scales: vec![[0.0; ROWS]; flushes],
            sums: Box::new([[[0; LANES]; 16]; 4]),
            acc: vec![[[0.0; LANES]; ROWS]; blocks],
        },
        |s, (task, out)| {
            let first = task * ROWS;
            let n = (out.len() / batch).min(rows.saturating_sub(first));
            // the task's rows in place when all 32 are stored, else copied after zeros
            let whole = view
                .codes
                .get(first * kp..(first + ROWS) * kp)
                .filter(|_| n == ROWS);
            let w: &[u8] = match whole {
                Some(w) => w,
                None => {
                    s.rows.clear();
                    s.rows.resize(ROWS * kp, 0);
                    let have = view.codes.get(first * kp..(first + n) * kp).unwrap_or(&[]);
                    if let Some(dst) = s.rows.get_mut(..have.len()) {
                        dst.copy_from_slice(have);
                    }
                    &s.rows
                }
            };
            // rows past `n` keep a scale from before: their outputs are not written
            for (r, row) in (first..first + n).enumerate() {
                let rs = view.scales_of(row);
                for (f, sc) in s.scales.iter_mut().enumerate() {
                    if let Some(o) = sc.get_mut(r) {
                        *o = rs.get(f);
                    }
                }
            }
            for a in &mut s.acc {
                *a = [[0.0; LANES]; ROWS];
            }
            let ok = w.len() == ROWS * kp
                && xt.hi.len() >= blocks * steps * TILE
                && xt.lo.len() >= blocks * steps * TILE;
            // true by construction (`w` is 32 rows, `xt` every block's tiles)
            debug_assert!(ok, "AMX task of {} bytes for {kp} columns", w.len());
            if ok {
                // the thread's configuration as found comes back when `tiles` drops:
                // another user of AMX on this thread (candle's Q4_K kernels configure a
                // thread once and keep it) finds its own shapes again, or none
                let tiles = Tiles::load(t, &CONFIG);
                // a flush's 32 rows (32 KB at most) read from memory for the first
                // block of `x` and from the caches for the others; each output's
                // flushes still in order
                for (f, sc) in s.scales.iter().enumerate() {
                    for (k, acc) in s.acc.iter_mut().enumerate() {
                        let s0 = f * (FLUSH / STEP);
                        let s1 = (s0 + FLUSH / STEP).min(steps);
                        // SAFETY: configured above; `w` is 32 rows of `kp = STEP · steps`
                        // bytes; blocks `k < blocks` of `steps` tiles each are in `xt`
                        unsafe {
                            flush(
                                w.as_ptr(),
                                w.as_ptr().add(16 * kp),
                                kp,
                                xt.hi.as_ptr().add(k * steps * TILE),
                                xt.lo.as_ptr().add(k * steps * TILE),
                                (s0, s1),
                                &mut s.sums,
                            );
                            add_flush(&s.sums, sc, acc);
                        }
                    }
                }
                drop(tiles);
            }
            for (r, yr) in out.chunks_exact_mut(batch).enumerate().take(n) {
                for (b, o) in yr.iter_mut().enumerate() {
                    let v = s
                        .acc
                        .get(b / LANES)
                        .and_then(|a| a.get(r))
                        .and_then(|a| a.get(b % LANES))
                        .copied()
                        .unwrap_or(0.0);
                    *o = v * fx.d.get(b).copied().unwrap_or(0.0);
                }
            }
        },
    );
}
