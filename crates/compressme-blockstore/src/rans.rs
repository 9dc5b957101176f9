//! rANS (range asymmetric numeral systems) coding of one byte plane with a shared
//! frequency table: what a Huffman code cannot do, spend a fraction of a bit on a symbol.
//!
//! A table gives every symbol it codes a frequency out of `2^12`; a plane is coded with
//! [`STATES`] interleaved 32-bit states (symbol `i` goes to state `i % 4`) that
//! renormalize by 16-bit words, as Fabian Giesen's `rans_word` does. Within a block's
//! plane this reaches the table's cross entropy to within a few bytes, where Huffman loses
//! up to a bit a symbol: about 0.03 bits a symbol on an exponent plane, and the whole
//! difference between 8 bits and the entropy (7.92-7.97 bits) on a mantissa plane, which
//! Huffman can only store raw.
//!
//! Stream bytes and table bytes come from a file, so every operation on them is checked
//! or wrapping (`arithmetic_side_effects` is denied) and no read goes unchecked.
#![deny(
    clippy::indexing_slicing,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::arithmetic_side_effects
)]

use crate::format::{get_varint, put_varint, varint_len};
use crate::{Error, Result};

/// Frequencies add up to `2^SCALE_BITS`.
pub(crate) const SCALE_BITS: u32 = 12;
/// The frequency total.
const TOTAL: u32 = 1 << SCALE_BITS;
/// The lower bound of a state; states live in `[LOW, 2^32)`.
const LOW: u32 = 1 << 16;
/// Interleaved states a plane is coded with.
pub(crate) const STATES: usize = 4;
/// Bytes of the final states that start a stream.
pub(crate) const STATE_BYTES: usize = 4 * STATES;

/// A normalized frequency table and what coding with it needs.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Table {
    /// Frequency of each symbol out of `TOTAL`; 0 for a symbol the table cannot code.
    freq: [u16; 256],
    /// Cumulative frequency below each symbol.
    cum: [u16; 256],
    /// What decoding looks up, per slot.
    dec: Box<DecodeTable>,
    /// Cost of each symbol in 1/65536 bits (`u32::MAX` when it has no frequency).
    cost: [u32; 256],
    /// What coding each symbol needs.
    enc: [EncodeSymbol; 256],
}

/// What the encoder needs to code one symbol.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
struct EncodeSymbol {
    /// `f * 2^20`: a state at or above it is renormalized before coding the symbol.
    bound: u64,
    /// With `l = ceil(log2 f)`, the multiplier `m = floor(2^(32 + l) / f) + 1` divides a
    /// state by the symbol's frequency `f`: `floor(x / f) = (x * m) >> (32 + l)` for every
    /// 32-bit `x` (Granlund and Montgomery's round-up method), so the encoder does not
    /// divide. `2^32 < m < 2^33`, so this keeps `m - 2^32` and computes
    /// `(x + ((x * (m - 2^32)) >> 32)) >> l` in 64 bits, which is the same number.
    m_low: u64,
    /// `l`.
    l: u32,
    /// `4096 - f`: coding takes `x` to `x + q * (4096 - f) + c` with `q = floor(x / f)`,
    /// which is `q * 4096 + (x - q * f) + c`.
    complement: u32,
    /// The cumulative frequency below the symbol, `c`.
    cum: u32,
}

/// Per slot (`x mod TOTAL`), in one allocation so that a decoding loop keeps one pointer.
/// Frequency and offset sit in arrays of their own (20 KB in all, as one array of both
/// packed in a `u32` was): a step then loads each as it is, where unpacking them took two
/// instructions more (1.96-2.03 against 2.14-2.21 ns a byte, one thread on AMD Zen 1).
#[derive(Clone, PartialEq, Eq)]
struct DecodeTable {
    /// The slot's symbol's frequency (1..=4096).
    freq: [u16; TOTAL as usize],
    /// The slot minus that symbol's cumulative frequency (below its frequency).
    offset: [u16; TOTAL as usize],
    /// The slot's symbol.
    symbols: [u8; TOTAL as usize],
    /// All three in one word for the vector decoders, which look up four slots at a time:
    /// frequency minus one in bits 0-11, offset in bits 12-23, symbol in bits 24-31.
    packed: [u32; TOTAL as usize],
}

impl std::fmt::Debug for Table {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("rans::Table")
            .field("symbols", &self.freq.iter().filter(|&&x| x > 0).count())
            .finish_non_exhaustive()
    }
}

impl Table {
    /// Normalizes counts to frequencies out of `2^12`, every counted symbol at least 1,
    /// rounding so the coded length grows least (integer arithmetic only, so the table
    /// does not depend on the platform). `None` when nothing was counted.
    pub(crate) fn from_counts(counts: &[u64; 256]) -> Option<Self> {
        let total: u128 = counts.iter().map(|&c| u128::from(c)).sum();
        if total == 0 {
            return None;
        }
        let t = u128::from(TOTAL);
        let mut f = [0u32; 256];
        for (fs, &c) in f.iter_mut().zip(counts) {
            if c > 0 {
                let c = u128::from(c);
                let share = c
                    .saturating_mul(t)
                    .saturating_add(total / 2)
                    .checked_div(total)
                    .unwrap_or(0);
                *fs = u32::try_from(share).unwrap_or(TOTAL).clamp(1, TOTAL);
            }
        }
        let mut sum: u32 = f.iter().sum();
        // move one unit at a time where it costs least: taking one from symbol s costs
        // about c_s / (f_s - 1/2) bits, giving one saves about c_s / (f_s + 1/2); compared
        // as fractions, c_a (2 f_b -+ 1) against c_b (2 f_a -+ 1), lower symbol on a tie
        while sum != TOTAL {
            let up = sum < TOTAL;
            let movable = |s: usize| {
                if up {
                    counts.get(s).copied().unwrap_or(0) > 0
                } else {
                    f.get(s).copied().unwrap_or(0) > 1
                }
            };
            let weight = |s: usize| {
                let d = wide32(&f, s).wrapping_mul(2);
                (
                    wide(counts, s),
                    if up {
                        d.wrapping_add(1)
                    } else {
                        d.wrapping_sub(1)
                    },
                )
            };
            // the best to move: the highest saving up, the lowest cost down
            let pick = (0..256).filter(|&s| movable(s)).reduce(|a, b| {
                let ((ca, da), (cb, db)) = (weight(a), weight(b));
                let order = ca.wrapping_mul(db).cmp(&cb.wrapping_mul(da));
                let b_better = if up { order.is_lt() } else { order.is_gt() };
                if b_better { b } else { a }
            });
            let s = pick.and_then(|s| f.get_mut(s))?;
            if up {
                *s = s.saturating_add(1);
                sum = sum.saturating_add(1);
            } else {
                *s = s.saturating_sub(1);
                sum = sum.saturating_sub(1);
            }
        }
        let mut freq = [0u16; 256];
        for (d, &s) in freq.iter_mut().zip(&f) {
            *d = u16::try_from(s).unwrap_or(0);
        }
        Self::from_freqs(freq)
    }

    /// Builds the coding tables from frequencies that add up to `2^12`.
    fn from_freqs(freq: [u16; 256]) -> Option<Self> {
        let sum: u32 = freq.iter().map(|&x| u32::from(x)).sum();
        if sum != TOTAL {
            return None;
        }
        let mut cum = [0u16; 256];
        let mut dec = Box::new(DecodeTable {
            freq: [0u16; TOTAL as usize],
            offset: [0u16; TOTAL as usize],
            symbols: [0u8; TOTAL as usize],
            packed: [0u32; TOTAL as usize],
        });
        let DecodeTable {
            freq: slot_freq,
            offset,
            symbols,
            packed,
        } = &mut *dec;
        let mut cost = [u32::MAX; 256];
        let mut at = 0u32;
        for (s, ((&fs, c), k)) in freq
            .iter()
            .zip(cum.iter_mut())
            .zip(cost.iter_mut())
            .enumerate()
        {
            *c = u16::try_from(at).unwrap_or(0);
            let fs = u32::from(fs);
            if fs == 0 {
                continue;
            }
            // bits = 12 - log2(f), in 1/65536 bits
            *k = ((f64::from(SCALE_BITS) - f64::from(fs).log2()) * 65536.0).round() as u32;
            for (j, (((sf, off), sym), pk)) in slot_freq
                .iter_mut()
                .zip(offset.iter_mut())
                .zip(symbols.iter_mut())
                .zip(packed.iter_mut())
                .skip(at as usize)
                .take(fs as usize)
                .enumerate()
            {
                // fs <= 4096 and j < 4096 fit in 16 bits, fs - 1 and j in 12
                *sf = fs as u16;
                *off = j as u16;
                *sym = s as u8;
                *pk = fs.wrapping_sub(1) | (j as u32) << 12 | (s as u32) << 24;
            }
            at = at.wrapping_add(fs);
        }
        let mut enc = [EncodeSymbol::default(); 256];
        for ((e, &f), &c) in enc.iter_mut().zip(&freq).zip(&cum) {
            let f = u64::from(f.max(1));
            // l = ceil(log2 f); m = floor(2^(32 + l) / f) + 1 < 2^33
            let l = 64u32.saturating_sub(f.saturating_sub(1).leading_zeros());
            let m = (1u64 << 32u32.saturating_add(l))
                .checked_div(f)
                .unwrap_or(0)
                .saturating_add(1);
            *e = EncodeSymbol {
                bound: f << 20,
                m_low: m.saturating_sub(1 << 32),
                l,
                // f <= 4096
                complement: TOTAL.saturating_sub(f as u32),
                cum: u32::from(c),
            };
        }
        Some(Self {
            freq,
            cum,
            dec,
            cost,
            enc,
        })
    }

    /// The serialized table: a 32-byte bitmap of the symbols it codes (symbol `s` is bit
    /// `s % 8` of byte `s / 8`), then each coded symbol's frequency minus one, in symbol
    /// order, as a minimal LEB128.
    pub(crate) fn to_bytes(&self, out: &mut Vec<u8>) {
        let mut bitmap = [0u8; 32];
        for (s, &f) in self.freq.iter().enumerate() {
            if f > 0
                && let Some(b) = bitmap.get_mut(s / 8)
            {
                *b |= 1 << (s % 8);
            }
        }
        out.extend_from_slice(&bitmap);
        for &f in self.freq.iter().filter(|&&f| f > 0) {
            put_varint(out, u64::from(f.saturating_sub(1)));
        }
    }

    /// The serialized length of [`Table::to_bytes`].
    pub(crate) fn serialized_len(&self) -> usize {
        32usize.saturating_add(
            self.freq
                .iter()
                .filter(|&&f| f > 0)
                .map(|&f| varint_len(u64::from(f.saturating_sub(1))))
                .sum::<usize>(),
        )
    }

    /// Parses a table at `*pos`, advancing it.
    ///
    /// # Errors
    /// [`Error::Malformed`] when the bytes run out, no symbol is coded, a frequency is out
    /// of range, or the frequencies do not add up to 4096.
    pub(crate) fn read(bytes: &[u8], pos: &mut usize) -> Result<Self> {
        let bad = |m: String| Error::Malformed(format!("rANS table: {m}"));
        let bitmap = bytes
            .get(*pos..pos.saturating_add(32))
            .ok_or_else(|| bad("truncated symbol bitmap".into()))?;
        *pos = pos.saturating_add(32);
        let mut freq = [0u16; 256];
        let mut sum = 0u32;
        for (s, f) in freq.iter_mut().enumerate() {
            let present = bitmap.get(s / 8).is_some_and(|b| b & (1 << (s % 8)) != 0);
            if !present {
                continue;
            }
            let v = get_varint(bytes, pos).map_err(|e| bad(e.to_string()))?;
            if v >= TOTAL as usize {
                return Err(bad(format!(
                    "symbol {s} has frequency {} > 4096",
                    v.saturating_add(1)
                )));
            }
            // v < 4096
            *f = u16::try_from(v.saturating_add(1)).unwrap_or(0);
            sum = sum.saturating_add(u32::from(*f));
        }
        if sum != TOTAL {
            return Err(bad(format!("frequencies add up to {sum}, not 4096")));
        }
        Self::from_freqs(freq).ok_or_else(|| bad("frequencies do not add up".into()))
    }

    /// Bits a block with these byte counts costs (rounded up; `u64::MAX` if the table
    /// cannot code one of its bytes), without the stream's state bytes.
    pub(crate) fn block_cost_bits(&self, counts: &[u32; 256]) -> u64 {
        let mut acc = 0u64;
        for (&c, &k) in counts.iter().zip(&self.cost) {
            if c == 0 {
                continue;
            }
            if k == u32::MAX {
                return u64::MAX;
            }
            acc = acc.saturating_add(u64::from(c).saturating_mul(u64::from(k)));
        }
        acc.div_ceil(1 << 16)
    }

    /// Codes `symbols` (every one with a frequency; callers check with
    /// [`Table::block_cost_bits`]) as a stream: the [`STATES`] final states, u32 each, then
    /// the renormalization words, u16 each, in the order a decoder reads them.
    pub(crate) fn encode(&self, symbols: &[u8], out: &mut Vec<u8>) {
        // at most one word a symbol: written at `nw` every time and kept when needed, so a
        // mantissa plane (a word about every other symbol) takes no unpredictable branch
        let mut words = vec![0u16; symbols.len().saturating_add(1)];
        let mut nw = 0usize;
        let mut x = [LOW; STATES];
        // symbols go in from last to first: the tail past the last whole quad first
        // (symbol i with state i mod 4), then each quad from its state 3 to its state 0,
        // the states in registers
        let quads = symbols.chunks_exact(STATES);
        let tail = quads.remainder();
        for (xj, &s) in x.iter_mut().zip(tail).rev() {
            self.put(xj, s, &mut words, &mut nw);
        }
        let [mut x0, mut x1, mut x2, mut x3] = x;
        for q in quads.rev() {
            if let &[s0, s1, s2, s3] = q {
                self.put(&mut x3, s3, &mut words, &mut nw);
                self.put(&mut x2, s2, &mut words, &mut nw);
                self.put(&mut x1, s1, &mut words, &mut nw);
                self.put(&mut x0, s0, &mut words, &mut nw);
            }
        }
        for xj in [x0, x1, x2, x3] {
            out.extend_from_slice(&xj.to_le_bytes());
        }
        words.truncate(nw);
        out.reserve(nw.saturating_mul(2));
        for w in words.iter().rev() {
            out.extend_from_slice(&w.to_le_bytes());
        }
    }

    /// Codes symbol `s` into state `*x`, first writing its low word at `words[*nw]` and
    /// counting it when the state must shrink to stay below 2^32 after coding.
    #[inline(always)]
    #[allow(clippy::indexing_slicing)] // a u8 indexes a 256-entry array: never out of range
    fn put(&self, x: &mut u32, s: u8, words: &mut [u16], nw: &mut usize) {
        let e = &self.enc[usize::from(s)];
        let v = *x;
        // keep the state below f * 2^20 so that it stays below 2^32 after coding (in 64
        // bits: a symbol with the whole range has f * 2^20 = 2^32)
        let need = u64::from(v) >= e.bound;
        if let Some(w) = words.get_mut(*nw) {
            *w = v as u16;
        }
        *nw = nw.wrapping_add(usize::from(need));
        let v = std::hint::select_unpredictable(need, v >> 16, v);
        let v64 = u64::from(v);
        let q = (v64.wrapping_add(v64.wrapping_mul(e.m_low) >> 32) >> e.l) as u32;
        *x = v
            .wrapping_add(q.wrapping_mul(e.complement))
            .wrapping_add(e.cum);
    }

    /// Decodes `out.len()` symbols from `stream`. When `exact`, the stream must end where
    /// they do and every state must be back at its start (what the encoder began with),
    /// which catches a stream cut or padded anywhere; a prefix is decoded with `exact`
    /// false.
    ///
    /// # Errors
    /// [`Error::Malformed`] for a stream shorter than its states, a state out of range, a
    /// stream that runs out, and (when `exact`) bytes left over or states not at their
    /// start.
    pub(crate) fn decode(&self, stream: &[u8], out: &mut [u8], exact: bool) -> Result<()> {
        let mut a = Lanes::new(self, stream)?;
        a.run(out);
        a.finish(exact)
    }
}

/// One stream for [`decode_many`]: its table, its bytes, where its symbols go (all of
/// them: as many as `out` holds) and whether it must end exactly there.
pub(crate) struct Job<'a> {
    pub(crate) table: &'a Table,
    pub(crate) stream: &'a [u8],
    pub(crate) out: &'a mut [u8],
    pub(crate) exact: bool,
}

/// Streams decoded together in one vector loop, at most.
pub(crate) const TOGETHER: usize = 6;

/// Decodes each job as [`Table::decode`] would, with the same symbols and the same
/// result, up to [`TOGETHER`] streams at a time in one loop where the CPU has AVX2 (one
/// stream's four states in a vector, the streams' steps side by side: a single stream's
/// steps wait on each other, several streams' do not).
pub(crate) fn decode_many(jobs: &mut [Job<'_>]) -> Vec<Result<()>> {
    decode_many_on(simd::Tier::detect(), jobs)
}

/// [`decode_many`] on a given tier (tests run every tier the CPU has).
pub(crate) fn decode_many_on(tier: simd::Tier, jobs: &mut [Job<'_>]) -> Vec<Result<()>> {
    let mut results = Vec::with_capacity(jobs.len());
    for group in jobs.chunks_mut(TOGETHER) {
        let mut lanes: Vec<Result<Lanes<'_>>> = group
            .iter()
            .map(|j| Lanes::new(j.table, j.stream))
            .collect();
        // streams whose start is valid go through the vector loop together, as far as
        // all of them have whole quads and four words left
        let mut ready: Vec<(&mut Lanes<'_>, &mut [u8])> = lanes
            .iter_mut()
            .zip(group.iter_mut())
            .filter_map(|(l, j)| l.as_mut().ok().map(|l| (l, &mut *j.out)))
            .collect();
        let quads = if ready.len() >= 2 {
            simd::advance(tier, &mut ready)
        } else {
            0
        };
        for (l, out) in ready {
            l.run(
                out.get_mut(quads.saturating_mul(STATES)..)
                    .unwrap_or(&mut []),
            );
        }
        for (l, j) in lanes.into_iter().zip(group.iter()) {
            results.push(l.and_then(|l| l.finish(j.exact)));
        }
    }
    results
}

/// The decoding state of one stream: four states, the words and the next word's index.
struct Lanes<'a> {
    x: [u32; STATES],
    p: usize,
    ws: &'a [[u8; 2]],
    dec: &'a DecodeTable,
}

impl<'a> Lanes<'a> {
    fn new(table: &'a Table, stream: &'a [u8]) -> Result<Self> {
        let (head, words) = stream
            .split_at_checked(STATE_BYTES)
            .ok_or_else(|| bad("shorter than its states"))?;
        if !words.len().is_multiple_of(2) {
            return Err(bad("odd number of word bytes"));
        }
        let mut x = [0u32; STATES];
        for (xj, b) in x.iter_mut().zip(head.chunks_exact(4)) {
            *xj = match b {
                &[a, b, c, d] => u32::from_le_bytes([a, b, c, d]),
                _ => 0,
            };
            if *xj < LOW {
                return Err(bad("a state below 2^16"));
            }
        }
        Ok(Self {
            x,
            p: 0,
            ws: words.as_chunks::<2>().0,
            dec: &table.dec,
        })
    }

    /// Decodes `out.len()` symbols: whole quads, then the rest.
    fn run(&mut self, out: &mut [u8]) {
        let d = self.dec;
        let ws = self.ws;
        // the states and the word index live in registers through the loop
        let [mut x0, mut x1, mut x2, mut x3] = self.x;
        let mut p = self.p;
        let mut quads = out.chunks_exact_mut(STATES);
        for q in &mut quads {
            if let [a, b, c, e] = q {
                *a = one(d, &mut x0, ws, &mut p);
                *b = one(d, &mut x1, ws, &mut p);
                *c = one(d, &mut x2, ws, &mut p);
                *e = one(d, &mut x3, ws, &mut p);
            }
        }
        self.x = [x0, x1, x2, x3];
        self.p = p;
        self.rest(quads.into_remainder());
    }

    /// The last symbols (fewer than four), from states 0, 1, ...
    fn rest(&mut self, out: &mut [u8]) {
        for (o, xj) in out.iter_mut().zip(self.x.iter_mut()) {
            *o = one(self.dec, xj, self.ws, &mut self.p);
        }
    }

    fn finish(&self, exact: bool) -> Result<()> {
        let nwords = self.ws.len();
        if self.p > nwords {
            return Err(bad("runs out before its symbols"));
        }
        if exact {
            if self.p != nwords {
                return Err(bad(&format!(
                    "{} unused words",
                    nwords.saturating_sub(self.p)
                )));
            }
            if self.x.iter().any(|&xj| xj != LOW) {
                return Err(bad("states do not return to their start"));
            }
        }
        Ok(())
    }
}

/// One decoding step of state `*x`: its symbol, with `*x` set to the state before it,
/// refilled with word `*p` of `ws` when it falls below 2^16, and `*p` counting that word.
/// A word past the end reads as 0 and still counts, which [`Lanes::finish`] checks.
///
/// The select is a conditional move, never a branch: a mantissa plane renormalizes about
/// every other symbol, at random. The word is read where it is, at the index the previous
/// steps left, and not from four words read ahead for the quad and shifted along: the
/// loop is bound by its instructions, not by that load's latency, and reading the word in
/// place takes three instructions a step fewer (2.20-2.33 against 1.86-2.08 ns a byte in
/// the table's former layout, one thread on AMD Zen 1).
#[inline(always)]
#[allow(clippy::indexing_slicing)] // `x & 4095` indexes 4096-entry arrays: never out of range
fn one(d: &DecodeTable, x: &mut u32, ws: &[[u8; 2]], p: &mut usize) -> u8 {
    let i = (*x & (TOTAL - 1)) as usize;
    let v = u32::from(d.freq[i])
        .wrapping_mul(*x >> SCALE_BITS)
        .wrapping_add(u32::from(d.offset[i]));
    let need = v < LOW;
    let word = ws.get(*p).map_or(0, |w| u32::from(u16::from_le_bytes(*w)));
    *x = std::hint::select_unpredictable(need, v.wrapping_shl(16) | word, v);
    *p = p.wrapping_add(usize::from(need));
    d.symbols[i]
}

/// The vector loops: one stream's four states in a 128-bit vector, up to [`TOGETHER`]
/// streams a step at a time side by side.
///
/// A step of state `x` is the scalar [`one`] on four states at once: look up the four
/// slots' packed entries, `v = f * (x >> 12) + offset`, then where `v < 2^16` take the
/// next words of the stream, in state order (the format's refill order), as `v << 16 |
/// word`. Each state's step depends on the one before it through a table lookup, a
/// multiply and the refill (about 30 cycles on AMD Zen 4); with six streams in flight the
/// core overlaps them, where one stream's four states alone wait on each other.
#[allow(unsafe_code)] // `target_feature` loops behind run-time detection; see each `# Safety`
pub(crate) mod simd {
    use super::{Lanes, STATES};

    /// Which loop runs.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub(crate) enum Tier {
        /// The scalar loop only.
        Portable,
        /// AVX2 (and SSE4.1's packed multiply): the refill words placed by a shuffle
        /// looked up from the four states' refill mask.
        Avx2,
        /// AVX-512 F and VL: the refill words placed by a masked expand.
        Avx512,
    }

    impl Tier {
        /// The best tier this CPU has, or a lower one that `COMPRESSME_RANS` names
        /// (`portable`, `avx2`; a tier the CPU lacks, or any other value, is ignored),
        /// decided once a process.
        pub(crate) fn detect() -> Self {
            static TIER: std::sync::OnceLock<Tier> = std::sync::OnceLock::new();
            *TIER.get_or_init(|| {
                let best = Self::best();
                match std::env::var("COMPRESSME_RANS").as_deref() {
                    Ok("portable") => Self::Portable,
                    Ok("avx2") if best != Self::Portable => Self::Avx2,
                    _ => best,
                }
            })
        }

        /// The best tier this CPU has.
        fn best() -> Self {
            #[cfg(target_arch = "x86_64")]
            {
                if std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                {
                    return Self::Avx512;
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    return Self::Avx2;
                }
            }
            Self::Portable
        }

        /// Every tier this CPU has, portable first.
        #[cfg(test)]
        pub(crate) fn available() -> Vec<Self> {
            match Self::best() {
                Self::Portable => vec![Self::Portable],
                Self::Avx2 => vec![Self::Portable, Self::Avx2],
                Self::Avx512 => vec![Self::Portable, Self::Avx2, Self::Avx512],
            }
        }
    }

    /// Advances every stream of `ready` (two to [`super::TOGETHER`]) by the same number
    /// of quads, as many as every output has and every stream has four words left for,
    /// and returns that number; the states and word indices are left where the scalar
    /// loop goes on from. On [`Tier::Portable`], 0.
    pub(super) fn advance(tier: Tier, ready: &mut [(&mut Lanes<'_>, &mut [u8])]) -> usize {
        match (tier, ready.len()) {
            #[cfg(target_arch = "x86_64")]
            (Tier::Avx2 | Tier::Avx512, 2) => group::<2>(tier, ready),
            #[cfg(target_arch = "x86_64")]
            (Tier::Avx2 | Tier::Avx512, 3) => group::<3>(tier, ready),
            #[cfg(target_arch = "x86_64")]
            (Tier::Avx2 | Tier::Avx512, 4) => group::<4>(tier, ready),
            #[cfg(target_arch = "x86_64")]
            (Tier::Avx2 | Tier::Avx512, 5) => group::<5>(tier, ready),
            #[cfg(target_arch = "x86_64")]
            (Tier::Avx2 | Tier::Avx512, 6) => group::<6>(tier, ready),
            _ => 0,
        }
    }

    /// The streams' pointers for the loop, then their states and indices back.
    #[cfg(target_arch = "x86_64")]
    fn group<const N: usize>(tier: Tier, ready: &mut [(&mut Lanes<'_>, &mut [u8])]) -> usize {
        let Ok(ready) = <&mut [(&mut Lanes<'_>, &mut [u8]); N]>::try_from(ready) else {
            return 0;
        };
        let quads = ready
            .iter()
            .map(|(_, o)| o.len() / STATES)
            .min()
            .unwrap_or(0);
        let mut g = Group::<N> {
            x: std::array::from_fn(|s| ready.get(s).map_or([0; STATES], |(l, _)| l.x)),
            p: std::array::from_fn(|s| ready.get(s).map_or(0, |(l, _)| l.p)),
            words: std::array::from_fn(|s| {
                ready
                    .get(s)
                    .map_or(std::ptr::null(), |(l, _)| l.ws.as_ptr().cast::<u8>())
            }),
            nwords: std::array::from_fn(|s| ready.get(s).map_or(0, |(l, _)| l.ws.len())),
            tables: std::array::from_fn(|s| {
                ready
                    .get(s)
                    .map_or(std::ptr::null(), |(l, _)| l.dec.packed.as_ptr())
            }),
            outs: std::array::from_fn(|s| {
                ready
                    .get_mut(s)
                    .map_or(std::ptr::null_mut(), |(_, o)| o.as_mut_ptr())
            }),
        };
        // SAFETY: the tier was detected on this CPU (`Tier::detect`, or a test's
        // `Tier::available`); every pointer comes from a live slice of the length given
        // beside it, each output has at least `quads` quads, and the loop reads words only
        // while four are left and looks up slots below 4096 in 4096-entry tables.
        let done = unsafe {
            match tier {
                Tier::Avx512 => g.run_avx512(quads),
                _ => g.run_avx2(quads),
            }
        };
        for ((l, _), (x, p)) in ready.iter_mut().zip(g.x.iter().zip(g.p)) {
            l.x = *x;
            l.p = p;
        }
        done
    }

    /// What the loop works on: per stream, its states, next word, words, table, output.
    #[cfg(target_arch = "x86_64")]
    struct Group<const N: usize> {
        x: [[u32; STATES]; N],
        p: [usize; N],
        words: [*const u8; N],
        nwords: [usize; N],
        tables: [*const u32; N],
        outs: [*mut u8; N],
    }

    /// For each refill mask (bit `j`: state `j` takes a word), the byte shuffle that puts
    /// the next words, in order, in the low half of the states that take one (zero
    /// elsewhere).
    #[cfg(target_arch = "x86_64")]
    #[allow(clippy::indexing_slicing)] // constant evaluation: an index out of range fails the build
    static REFILL: [[u8; 16]; 16] = {
        let mut l = [[0x80u8; 16]; 16];
        let mut m = 0;
        while m < 16 {
            let (mut j, mut c) = (0, 0u8);
            while j < 4 {
                if m & (1 << j) != 0 {
                    l[m][4 * j] = 2 * c;
                    l[m][4 * j + 1] = 2 * c + 1;
                    c += 1;
                }
                j += 1;
            }
            m += 1;
        }
        l
    };

    #[cfg(target_arch = "x86_64")]
    #[allow(
        clippy::indexing_slicing,
        clippy::arithmetic_side_effects,
        clippy::cast_possible_wrap,
        clippy::cast_sign_loss,
        clippy::needless_range_loop
    )]
    impl<const N: usize> Group<N> {
        /// The four slots' packed entries of a state vector, one scalar load each (faster
        /// than a gather on AMD Zen 4, and Zen 1's gathers are slow).
        ///
        /// # Safety
        /// `table` points to 4,096 entries; the CPU has AVX2.
        #[inline]
        #[target_feature(enable = "avx2,sse4.1")]
        unsafe fn entries(
            table: *const u32,
            x: std::arch::x86_64::__m128i,
        ) -> std::arch::x86_64::__m128i {
            use std::arch::x86_64::*;
            // SAFETY: each index is masked below 4096 and `table` has 4,096 entries
            unsafe {
                let idx = _mm_and_si128(x, _mm_set1_epi32(4095));
                let lo = _mm_cvtsi128_si64(idx) as u64;
                let hi = _mm_extract_epi64::<1>(idx) as u64;
                // each index is below 4096
                _mm_setr_epi32(
                    *table.add((lo & 0xfff) as usize) as i32,
                    *table.add(((lo >> 32) & 0xfff) as usize) as i32,
                    *table.add((hi & 0xfff) as usize) as i32,
                    *table.add(((hi >> 32) & 0xfff) as usize) as i32,
                )
            }
        }

        /// `f * (x >> 12) + offset` from the entries.
        #[inline]
        #[target_feature(enable = "avx2,sse4.1")]
        fn step(
            x: std::arch::x86_64::__m128i,
            e: std::arch::x86_64::__m128i,
        ) -> std::arch::x86_64::__m128i {
            use std::arch::x86_64::*;
            let m = _mm_set1_epi32(4095);
            let h = _mm_srli_epi32::<12>(x);
            let fm1 = _mm_and_si128(e, m);
            let off = _mm_and_si128(_mm_srli_epi32::<12>(e), m);
            // (f - 1) * h + h + offset
            _mm_add_epi32(_mm_mullo_epi32(fm1, h), _mm_add_epi32(h, off))
        }

        /// Each stream's next word and the end of its words, as pointers: the loops
        /// advance them with one scalar add a step (indices kept in an array were packed
        /// into a vector by the compiler and taken out again for every address: the
        /// loop took 0.66 ns a byte against 0.60-0.62, one thread on AMD Zen 4).
        fn word_pointers(&self) -> ([*const u8; N], [*const u8; N]) {
            // `nwords` words of two bytes follow `words[s]`, and `p[s]` of them are read
            let next = std::array::from_fn(|s| self.words[s].wrapping_add(2 * self.p[s]));
            let end = std::array::from_fn(|s| self.words[s].wrapping_add(2 * self.nwords[s]));
            (next, end)
        }

        /// How many of the `left` quads every stream has words for (a quad takes at most
        /// four words a stream): the loops check this once for a run of quads, not every
        /// stream every quad, and so stop where a check every quad would have stopped,
        /// at the first quad some stream has fewer than four words for.
        fn run_len(wp: &[*const u8; N], end: &[*const u8; N], left: usize) -> usize {
            let mut run = left;
            for s in 0..N {
                let words = (end[s] as usize).saturating_sub(wp[s] as usize) / 2;
                run = run.min(words / STATES);
            }
            run
        }

        /// The word indices back from the pointers.
        fn set_words(&mut self, wp: &[*const u8; N]) {
            for s in 0..N {
                self.p[s] = (wp[s] as usize).saturating_sub(self.words[s] as usize) / 2;
            }
        }

        /// # Safety
        /// The CPU has AVX2; the fields describe live buffers (see [`group`]); every
        /// output has at least `quads` quads.
        #[target_feature(enable = "avx2,sse4.1,popcnt")]
        unsafe fn run_avx2(&mut self, quads: usize) -> usize {
            use std::arch::x86_64::*;
            let zero = _mm_setzero_si128();
            let sym = _mm_setr_epi8(3, 7, 11, 15, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
            let mut xs = [zero; N];
            for s in 0..N {
                // SAFETY: an unaligned load of a `[u32; 4]`
                xs[s] = unsafe { _mm_loadu_si128(self.x[s].as_ptr().cast()) };
            }
            let (mut wp, end) = self.word_pointers();
            let mut q = 0;
            loop {
                let run = Self::run_len(&wp, &end, quads - q);
                if run == 0 {
                    break;
                }
                for _ in 0..run {
                    for s in 0..N {
                        // SAFETY: the table lookups are in range (`entries`); every stream
                        // has four words left at `wp` for each quad of the run
                        // (`run_len`); the output has more than `q` quads
                        unsafe {
                            let e = Self::entries(self.tables[s], xs[s]);
                            let v = Self::step(xs[s], e);
                            let need = _mm_cmpeq_epi32(_mm_srli_epi32::<16>(v), zero);
                            let m = _mm_movemask_ps(_mm_castsi128_ps(need)) as usize;
                            let w = _mm_loadl_epi64(wp[s].cast());
                            let w = _mm_shuffle_epi8(
                                w,
                                _mm_loadu_si128(REFILL[m & 15].as_ptr().cast()),
                            );
                            xs[s] =
                                _mm_blendv_epi8(v, _mm_or_si128(_mm_slli_epi32::<16>(v), w), need);
                            wp[s] = wp[s].add(2 * (m as u32).count_ones() as usize);
                            let out = _mm_cvtsi128_si32(_mm_shuffle_epi8(e, sym));
                            std::ptr::write_unaligned(self.outs[s].add(4 * q).cast::<i32>(), out);
                        }
                    }
                    q += 1;
                }
            }
            self.set_words(&wp);
            for s in 0..N {
                // SAFETY: an unaligned store to a `[u32; 4]`
                unsafe { _mm_storeu_si128(self.x[s].as_mut_ptr().cast(), xs[s]) };
            }
            q
        }

        /// # Safety
        /// The CPU has AVX-512 F and VL; as [`Group::run_avx2`] otherwise.
        #[target_feature(enable = "avx512f,avx512vl,avx2,sse4.1,popcnt")]
        unsafe fn run_avx512(&mut self, quads: usize) -> usize {
            use std::arch::x86_64::*;
            let low = _mm_set1_epi32(1 << 16);
            let sym = _mm_setr_epi8(3, 7, 11, 15, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
            let mut xs = [_mm_setzero_si128(); N];
            for s in 0..N {
                // SAFETY: an unaligned load of a `[u32; 4]`
                xs[s] = unsafe { _mm_loadu_si128(self.x[s].as_ptr().cast()) };
            }
            let (mut wp, end) = self.word_pointers();
            let mut q = 0;
            loop {
                let run = Self::run_len(&wp, &end, quads - q);
                if run == 0 {
                    break;
                }
                for _ in 0..run {
                    for s in 0..N {
                        // SAFETY: the table lookups are in range (`entries`); every stream
                        // has four words left at `wp` for each quad of the run
                        // (`run_len`); the output has more than `q` quads
                        unsafe {
                            let e = Self::entries(self.tables[s], xs[s]);
                            let v = Self::step(xs[s], e);
                            let k = _mm_cmplt_epu32_mask(v, low);
                            let w = _mm_cvtepu16_epi32(_mm_loadl_epi64(wp[s].cast()));
                            let w = _mm_maskz_expand_epi32(k, w);
                            xs[s] = _mm_or_si128(_mm_mask_slli_epi32::<16>(v, k, v), w);
                            wp[s] = wp[s].add(2 * u32::from(k).count_ones() as usize);
                            let out = _mm_cvtsi128_si32(_mm_shuffle_epi8(e, sym));
                            std::ptr::write_unaligned(self.outs[s].add(4 * q).cast::<i32>(), out);
                        }
                    }
                    q += 1;
                }
            }
            self.set_words(&wp);
            for s in 0..N {
                // SAFETY: an unaligned store to a `[u32; 4]`
                unsafe { _mm_storeu_si128(self.x[s].as_mut_ptr().cast(), xs[s]) };
            }
            q
        }
    }
}

/// A malformed stream, said so.
fn bad(m: &str) -> Error {
    Error::Malformed(format!("rANS stream: {m}"))
}

fn wide(counts: &[u64; 256], s: usize) -> u128 {
    u128::from(counts.get(s).copied().unwrap_or(0))
}

fn wide32(f: &[u32; 256], s: usize) -> u128 {
    u128::from(f.get(s).copied().unwrap_or(0))
}

#[cfg(test)]
#[allow(
    clippy::indexing_slicing,
    clippy::unwrap_used,
    clippy::arithmetic_side_effects
)]
mod tests {
    use super::*;

    fn counts_of(data: &[u8]) -> [u64; 256] {
        let mut c = [0u64; 256];
        for &b in data {
            c[usize::from(b)] += 1;
        }
        c
    }

    fn hist(data: &[u8]) -> [u32; 256] {
        counts_of(data).map(|c| c as u32)
    }

    fn lcg(n: usize, seed: u64) -> impl Iterator<Item = u64> {
        let mut s = seed;
        (0..n).map(move |_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            s >> 33
        })
    }

    #[test]
    fn round_trips_at_every_length_and_skew() {
        for n in [0usize, 1, 2, 3, 4, 5, 7, 64, 1000, 4099] {
            for skew in [1u64, 3, 40] {
                let data: Vec<u8> = lcg(n, n as u64 + skew)
                    .map(|r| ((r % 1000).pow(2) / (1000 * 1000 / 256) / skew) as u8)
                    .collect();
                let Some(t) = Table::from_counts(&counts_of(&data)) else {
                    assert!(data.is_empty());
                    continue;
                };
                let mut s = Vec::new();
                t.encode(&data, &mut s);
                let mut back = vec![0u8; n];
                t.decode(&s, &mut back, true).unwrap();
                assert_eq!(back, data, "n {n} skew {skew}");
                // a prefix decodes too
                let k = n / 2;
                let mut half = vec![0u8; k];
                t.decode(&s, &mut half, false).unwrap();
                assert_eq!(half, data[..k]);
                // the estimate is what the stream holds, within the states and a word a state
                let bits = t.block_cost_bits(&hist(&data));
                let body = (s.len() - STATE_BYTES) as u64 * 8;
                assert!(body <= bits + 64 && bits <= body + 64, "{body} vs {bits}");
            }
        }
    }

    #[test]
    fn reciprocals_divide_exactly() {
        let mut c = [0u64; 256];
        for (s, x) in c.iter_mut().enumerate() {
            *x = 1 + (s as u64 * 7919) % 1000;
        }
        c[3] = 1 << 40;
        let t = Table::from_counts(&c).unwrap();
        let xs = [
            0u32,
            1,
            2,
            4095,
            4096,
            65535,
            65536,
            1 << 31,
            u32::MAX - 1,
            u32::MAX,
        ]
        .into_iter()
        .chain(lcg(1_000, 3).map(|r| r as u32 ^ (r << 7) as u32));
        for x in xs {
            for f in 1..=4096u32 {
                let fs = u64::from(f);
                let l = 64 - (fs - 1).leading_zeros();
                let m = (1u64 << (32 + l)) / fs + 1;
                let q = ((u128::from(x) * u128::from(m)) >> (32 + l)) as u32;
                if q != x / f {
                    panic!("{x} / {f}: {q}");
                }
            }
        }
        // and the table's own
        for (s, &EncodeSymbol { m_low, l, .. }) in t.enc.iter().enumerate() {
            let f = u32::from(t.freq[s].max(1));
            for x in [u32::MAX, u32::MAX - 1, 1 << 20, 12345, 0, 1] {
                let x64 = u64::from(x);
                assert_eq!(((x64 + ((x64 * m_low) >> 32)) >> l) as u32, x / f);
            }
        }
        // every frequency, the split form against the 128-bit product
        for f in 1..=4096u64 {
            let l = 64 - (f - 1).leading_zeros();
            let m = (1u64 << (32 + l)) / f + 1;
            assert!(m > 1 << 32 && m < 1 << 33, "{f}");
            for x in [0u32, 1, 4095, 65535, 1 << 31, u32::MAX]
                .into_iter()
                .chain(lcg(64, f).map(|r| r as u32 ^ (r << 9) as u32))
            {
                let x64 = u64::from(x);
                let q = ((x64 + ((x64 * (m - (1 << 32))) >> 32)) >> l) as u32;
                assert_eq!(q, x / f as u32, "{x} / {f}");
            }
        }
    }

    #[test]
    fn frequencies_add_up_and_keep_every_symbol() {
        let mut c = [0u64; 256];
        c[0] = 1_000_000_000;
        for (s, x) in c.iter_mut().enumerate().skip(1) {
            *x = s as u64; // 255 rare symbols
        }
        let t = Table::from_counts(&c).unwrap();
        assert_eq!(t.freq.iter().map(|&f| u32::from(f)).sum::<u32>(), 4096);
        assert!(t.freq.iter().all(|&f| f >= 1));
        // one symbol takes the whole range
        let mut one = [0u64; 256];
        one[7] = 5;
        let t = Table::from_counts(&one).unwrap();
        assert_eq!(t.freq[7], 4096);
        let mut s = Vec::new();
        t.encode(&[7; 33], &mut s);
        let mut back = [0u8; 33];
        t.decode(&s, &mut back, true).unwrap();
        assert_eq!(back, [7; 33]);
        assert!(Table::from_counts(&[0; 256]).is_none());
    }

    #[test]
    fn near_uniform_bytes_cost_less_than_8_bits() {
        // a mantissa-like plane: entropy just under 8 bits, which Huffman stores raw
        let data: Vec<u8> = lcg(200_000, 9)
            .map(|r| {
                let u = (r % 65536) as f64 / 65536.0;
                (u.powf(1.15) * 256.0) as u8
            })
            .collect();
        let t = Table::from_counts(&counts_of(&data)).unwrap();
        let mut s = Vec::new();
        t.encode(&data, &mut s);
        let bits_a_symbol = (s.len() * 8) as f64 / data.len() as f64;
        assert!(bits_a_symbol < 7.99, "{bits_a_symbol}");
    }

    #[test]
    fn tables_serialize_and_refuse_bad_bytes() {
        let data: Vec<u8> = lcg(5000, 1).map(|r| (r % 37) as u8 * 3).collect();
        let t = Table::from_counts(&counts_of(&data)).unwrap();
        let mut b = Vec::new();
        t.to_bytes(&mut b);
        assert_eq!(b.len(), t.serialized_len());
        let mut pos = 0;
        assert_eq!(Table::read(&b, &mut pos).unwrap(), t);
        assert_eq!(pos, b.len());
        for cut in 0..b.len() {
            assert!(Table::read(&b[..cut], &mut 0).is_err(), "cut at {cut}");
        }
        // a frequency changed: the sum is off
        let mut off = b.clone();
        off[32] ^= 1;
        assert!(Table::read(&off, &mut 0).is_err());
        // no symbols at all
        assert!(Table::read(&[0u8; 32], &mut 0).is_err());
    }

    #[test]
    fn damaged_streams_are_errors_not_panics() {
        let data: Vec<u8> = lcg(3000, 5).map(|r| (r % 11) as u8).collect();
        let t = Table::from_counts(&counts_of(&data)).unwrap();
        let mut s = Vec::new();
        t.encode(&data, &mut s);
        let mut out = vec![0u8; data.len()];
        for cut in 0..s.len() {
            assert!(t.decode(&s[..cut], &mut out, true).is_err(), "cut at {cut}");
        }
        let mut longer = s.clone();
        longer.extend_from_slice(&[0, 0]);
        assert!(t.decode(&longer, &mut out, true).is_err());
        let mut caught = 0;
        for i in 0..s.len() {
            let mut d = s.clone();
            d[i] ^= 0x41;
            if t.decode(&d, &mut out, true).is_err() || out != data {
                caught += 1;
            }
        }
        assert_eq!(
            caught,
            s.len(),
            "every flipped byte changes the result or fails"
        );
    }

    /// Every tier the CPU has gives each stream exactly what `Table::decode` gives it, in
    /// groups of one to eight streams of different lengths, tables and skews, some cut or
    /// damaged, some decoded as prefixes.
    #[test]
    fn streams_decoded_together_match_one_at_a_time_on_every_tier() {
        let tiers = simd::Tier::available();
        for t in [simd::Tier::Avx2, simd::Tier::Avx512] {
            if !tiers.contains(&t) {
                eprintln!("rANS tier {t:?}: skipped, this CPU lacks it");
            }
        }
        let mut seed = 7u64;
        for round in 0..60usize {
            let k = 1 + round % 8;
            let mut streams = Vec::new();
            for j in 0..k {
                seed += 1;
                let n = match (round + j) % 5 {
                    0 => (seed % 9) as usize,
                    1 => 40 + (seed % 200) as usize,
                    _ => 3000 + (seed % 5000) as usize,
                };
                let skew = [1u64, 4, 60, 1000][(round + 3 * j) % 4];
                let data: Vec<u8> = lcg(n, seed)
                    .map(|r| ((r % 1000).pow(2) / (1000 * 1000 / 256) / skew) as u8)
                    .collect();
                let table = Table::from_counts(&counts_of(&data))
                    .or_else(|| Table::from_counts(&counts_of(&[0])))
                    .unwrap();
                let mut s = Vec::new();
                table.encode(&data, &mut s);
                // some streams cut, some damaged, some decoded as a prefix
                let mut exact = true;
                let mut want = data.len();
                match (round * 7 + j) % 11 {
                    0 if s.len() > 20 => s.truncate(s.len() - 3),
                    1 if s.len() > 40 => s[30] ^= 0x5a,
                    2 => s.extend_from_slice(&[1, 2]),
                    3 => {
                        exact = false;
                        want /= 2;
                    }
                    _ => {}
                }
                streams.push((table, s, want, exact));
            }
            let single: Vec<(Result<()>, Vec<u8>)> = streams
                .iter()
                .map(|(t, s, n, exact)| {
                    let mut out = vec![0u8; *n];
                    (t.decode(s, &mut out, *exact), out)
                })
                .collect();
            for &tier in &tiers {
                let mut outs: Vec<Vec<u8>> =
                    streams.iter().map(|(_, _, n, _)| vec![0u8; *n]).collect();
                let mut jobs: Vec<Job<'_>> = streams
                    .iter()
                    .zip(outs.iter_mut())
                    .map(|((table, stream, _, exact), out)| Job {
                        table,
                        stream,
                        out,
                        exact: *exact,
                    })
                    .collect();
                let results = decode_many_on(tier, &mut jobs);
                assert_eq!(results.len(), streams.len());
                for (j, ((r, out), (r1, out1))) in
                    results.iter().zip(&outs).zip(&single).enumerate()
                {
                    assert_eq!(
                        format!("{r:?}"),
                        format!("{r1:?}"),
                        "{tier:?}, round {round}, stream {j}"
                    );
                    if r1.is_ok() {
                        assert!(
                            out == out1,
                            "{tier:?}, round {round}, stream {j}: symbols differ"
                        );
                    }
                }
            }
        }
    }
}
