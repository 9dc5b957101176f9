//! Length-limited canonical Huffman codes over bytes, shared across blocks.
//!
//! A table is 256 code lengths (0..=[`MAX_LEN`]); codes are canonical (sorted by length,
//! then symbol) and written least-significant bit first, bit-reversed, so that the decoder
//! indexes a `2^MAX_LEN` lookup table with the next bits of the stream.
//!
//! Tables are parsed from a file ([`CodeLengths::from_nibbles`]) and streams are read from
//! one, so `arithmetic_side_effects` is denied here. It is allowed, each with its bound,
//! only on the encoder (which codes the tool's own bytes) and on the decoder's inner loops,
//! whose counters are bounded by construction (at most 64 bits in the accumulator, codes
//! of at most `MAX_LEN` bits, four lookups a refill) and whose writes go through `get`.
#![deny(
    clippy::indexing_slicing,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::arithmetic_side_effects
)]

use crate::{Error, Result};

/// Longest code; also the lookup table's index width.
pub(crate) const MAX_LEN: u8 = 12;
const TABLE_SIZE: usize = 1 << MAX_LEN;

/// Code lengths for the 256 byte values; 0 means the symbol has no code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CodeLengths(pub(crate) [u8; 256]);

impl CodeLengths {
    /// Builds lengths from counts: symbols that occur get a code of at most `MAX_LEN` bits,
    /// symbols that never occur get none.
    #[allow(clippy::arithmetic_side_effects)] // encoder: tree depths < 256, counts of 256 slots
    pub(crate) fn from_counts(counts: &[u64; 256]) -> Self {
        let used = counts.iter().filter(|&&c| c > 0).count();
        if used <= 1 {
            // a single symbol still needs one bit per occurrence to be a prefix code
            let mut lens = [0u8; 256];
            let s = counts.iter().position(|&c| c > 0).unwrap_or(0);
            if let Some(l) = lens.get_mut(s) {
                *l = 1;
            }
            return Self(lens);
        }
        // floor rare counts at 2^-14 of the total, so the length limit rarely binds
        let total: u64 = counts.iter().sum();
        let floor = (total >> 14).max(1);
        // Huffman tree by repeated merging of the two lightest nodes; ties by node index,
        // so the result is deterministic. Two queues instead of a heap: the leaves sorted
        // by (weight, index), and the merged nodes, which are made in order of weight
        // with rising indices, so the lighter of the two heads is always the lightest
        // node left, as a heap would give it (the same tree, tie for tie).
        let mut parent: Vec<usize> = vec![usize::MAX; 511];
        let mut leaves: Vec<(u64, usize)> = counts
            .iter()
            .enumerate()
            .filter(|&(_, &c)| c > 0)
            .map(|(s, &c)| (c.max(floor), s))
            .collect();
        leaves.sort_unstable();
        let mut merged: Vec<(u64, usize)> = Vec::with_capacity(leaves.len());
        let (mut li, mut mi) = (0usize, 0usize);
        fn lightest(
            leaves: &[(u64, usize)],
            merged: &[(u64, usize)],
            li: &mut usize,
            mi: &mut usize,
        ) -> Option<(u64, usize)> {
            match (leaves.get(*li), merged.get(*mi)) {
                (Some(&l), Some(&m)) if l <= m => {
                    *li += 1;
                    Some(l)
                }
                (_, Some(&m)) => {
                    *mi += 1;
                    Some(m)
                }
                (Some(&l), None) => {
                    *li += 1;
                    Some(l)
                }
                (None, None) => None,
            }
        }
        // n leaves take n - 1 merges; merged nodes are numbered from 256
        for next in (256..).take(leaves.len().saturating_sub(1)) {
            let a = lightest(&leaves, &merged, &mut li, &mut mi);
            let b = lightest(&leaves, &merged, &mut li, &mut mi);
            let (Some((wa, a)), Some((wb, b))) = (a, b) else {
                break;
            };
            for child in [a, b] {
                if let Some(p) = parent.get_mut(child) {
                    *p = next;
                }
            }
            merged.push((wa.saturating_add(wb), next));
        }
        let mut depth = [0u32; 256];
        for (s, d) in depth
            .iter_mut()
            .enumerate()
            .filter(|&(s, _)| counts.get(s).is_some_and(|&c| c > 0))
        {
            let mut node = s;
            let mut n = 0;
            while let Some(&p) = parent.get(node) {
                if p == usize::MAX {
                    break;
                }
                node = p;
                n += 1;
            }
            *d = n;
        }
        // Enforce the length limit (as miniz does): clamp, then repair the Kraft sum.
        let max = u32::from(MAX_LEN);
        let mut num = [0u32; 64];
        for &d in depth.iter().filter(|&&d| d > 0) {
            if let Some(slot) = num.get_mut(d.min(max) as usize) {
                *slot += 1;
            }
        }
        let mut kraft: u64 = (1..=max)
            .map(|l| u64::from(num.get(l as usize).copied().unwrap_or(0)) << (max - l))
            .sum();
        while kraft > 1u64 << max {
            if let Some(slot) = num.get_mut(max as usize) {
                *slot -= 1;
            }
            for l in (1..max).rev() {
                if num.get(l as usize).copied().unwrap_or(0) > 0 {
                    if let Some(slot) = num.get_mut(l as usize) {
                        *slot -= 1;
                    }
                    if let Some(slot) = num.get_mut(l as usize + 1) {
                        *slot += 2;
                    }
                    break;
                }
            }
            kraft -= 1;
        }
        // Hand the lengths out again: most frequent symbol gets the shortest code.
        let mut order: Vec<usize> = (0..256)
            .filter(|&s| counts.get(s).is_some_and(|&c| c > 0))
            .collect();
        // keys are unique (count, then index): an unstable sort gives the same order
        order.sort_unstable_by(|&a, &b| counts.get(b).cmp(&counts.get(a)).then(a.cmp(&b)));
        let mut lens = [0u8; 256];
        let mut it = order.into_iter();
        for l in 1..=max {
            for _ in 0..num.get(l as usize).copied().unwrap_or(0) {
                if let Some(s) = it.next()
                    && let Some(slot) = lens.get_mut(s)
                {
                    *slot = l as u8;
                }
            }
        }
        Self(lens)
    }

    /// Bits to code a histogram with these lengths; `u64::MAX` when a symbol that occurs
    /// has no code.
    #[allow(clippy::arithmetic_side_effects)] // encoder: a block's counts x 12 bits fit u64
    #[cfg(test)]
    pub(crate) fn cost_bits(&self, counts: &[u64; 256]) -> u64 {
        // branch-free so it vectorizes: clustering calls this for every block and table
        let mut bits = 0u64;
        let mut uncodable = 0u64;
        for (&c, &l) in counts.iter().zip(self.0.iter()) {
            bits += c * u64::from(l);
            uncodable |= c * u64::from(l == 0);
        }
        if uncodable != 0 { u64::MAX } else { bits }
    }

    /// [`CodeLengths::cost_bits`] of one block's counts, in 32-bit lanes (eight to an AVX2
    /// register, where 64-bit products need emulating): a block holds at most 2^28 bytes
    /// and a code is at most 15 bits, so the sum stays below 2^32. Compiled for AVX2
    /// where the CPU has it: the baseline x86-64 build has no 32-bit vector multiply
    /// (SSE2 emulates it with two 64-bit ones and shuffles), and table clustering calls
    /// this for every block against every table (7% of a `pack` of MiniLM f32).
    pub(crate) fn block_cost_bits(&self, counts: &[u32; 256]) -> u64 {
        #[cfg(target_arch = "x86_64")]
        if let Some(bits) = avx2::block_cost_bits(&self.0, counts) {
            return bits;
        }
        block_cost_bits_body(&self.0, counts)
    }

    /// Serialized form: 128 bytes, two 4-bit lengths per byte, low nibble first.
    pub(crate) fn to_nibbles(&self) -> [u8; 128] {
        let mut out = [0u8; 128];
        for (o, pair) in out.iter_mut().zip(self.0.chunks_exact(2)) {
            if let [lo, hi] = pair {
                *o = lo | (hi << 4);
            }
        }
        out
    }

    /// Parses and validates the serialized form: lengths in 0..=MAX_LEN, at least one code,
    /// and a prefix code (Kraft sum at most one). Empty decode slots are caught by the decoder.
    pub(crate) fn from_nibbles(bytes: &[u8]) -> Result<Self> {
        if bytes.len() != 128 {
            return Err(Error::Malformed(format!(
                "code table has {} bytes, expected 128",
                bytes.len()
            )));
        }
        let mut lens = [0u8; 256];
        for (pair, &b) in lens.chunks_exact_mut(2).zip(bytes) {
            if let [lo, hi] = pair {
                *lo = b & 0x0f;
                *hi = b >> 4;
            }
        }
        let mut kraft = 0u64;
        for &l in lens.iter().filter(|&&l| l > 0) {
            if l > MAX_LEN {
                return Err(Error::Malformed(format!(
                    "code length {l} outside 0..={MAX_LEN}"
                )));
            }
            // l <= MAX_LEN (checked above), 256 terms of at most 2^11
            kraft = kraft.saturating_add(1u64 << MAX_LEN.saturating_sub(l));
        }
        if kraft == 0 || kraft > TABLE_SIZE as u64 {
            return Err(Error::Malformed("code table is not a prefix code".into()));
        }
        Ok(Self(lens))
    }

    /// Canonical codes, bit-reversed for LSB-first writing.
    fn reversed_codes(&self) -> [u16; 256] {
        let mut count = [0u16; MAX_LEN as usize + 2];
        for &l in &self.0 {
            if let Some(c) = count.get_mut(l as usize) {
                *c = c.saturating_add(1); // at most 256
            }
        }
        count[0] = 0; // symbols without a code take no code space
        let mut next = [0u16; MAX_LEN as usize + 2];
        let mut code = 0u16;
        for l in 1..=MAX_LEN as usize {
            // a prefix code's canonical codes fit MAX_LEN + 1 bits (Kraft sum <= 1)
            let prev = count.get(l.saturating_sub(1)).copied().unwrap_or(0);
            code = code.wrapping_add(prev).wrapping_shl(1);
            if let Some(n) = next.get_mut(l) {
                *n = code;
            }
        }
        let mut out = [0u16; 256];
        for (s, &l) in self.0.iter().enumerate().filter(|&(_, &l)| l > 0) {
            let Some(n) = next.get_mut(l as usize) else {
                continue;
            };
            let c = *n;
            *n = n.wrapping_add(1);
            if let Some(o) = out.get_mut(s) {
                *o = c
                    .reverse_bits()
                    .wrapping_shr(16u32.saturating_sub(u32::from(l)));
            }
        }
        out
    }
}

/// An encoder for one table.
pub(crate) struct Encoder {
    /// `code | length << 16` per symbol: one lookup a symbol.
    table: [u32; 256],
}

impl Encoder {
    pub(crate) fn new(lengths: &CodeLengths) -> Self {
        // Canonical code assignment for lengths that start at 1: `count[0]` is zero.
        let codes = lengths.reversed_codes();
        let mut table = [0u32; 256];
        for ((t, &c), &l) in table.iter_mut().zip(codes.iter()).zip(lengths.0.iter()) {
            *t = u32::from(c) | u32::from(l) << 16;
        }
        Self { table }
    }

    /// Appends the coded bytes of `symbols` to `out`: two symbols (at most 24 bits)
    /// between checks for a whole 32-bit word, written into room made up front (at most
    /// `MAX_LEN` bits a symbol), so the loop neither grows the vector nor checks its
    /// capacity.
    #[allow(clippy::arithmetic_side_effects)] // n < 32 + 2 * MAX_LEN bits between flushes
    pub(crate) fn encode(&self, symbols: &[u8], out: &mut Vec<u8>) {
        let start = out.len();
        let room = (symbols.len() * usize::from(MAX_LEN)).div_ceil(8) + 8;
        out.resize(start + room, 0);
        let Some(buf) = out.get_mut(start..) else {
            return;
        };
        let mut at = 0usize;
        let mut acc: u64 = 0;
        let mut n: u32 = 0;
        // a u8 indexes 256 entries: the check folds away
        let code = |s: u8| self.table.get(usize::from(s)).copied().unwrap_or(0);
        let mut pairs = symbols.chunks_exact(2);
        for p in &mut pairs {
            let [x, y] = [p.first(), p.get(1)].map(|v| v.copied().unwrap_or(0));
            let (a, b) = (code(x), code(y));
            acc |= u64::from(a & 0xffff) << n;
            n += a >> 16;
            acc |= u64::from(b & 0xffff) << n;
            n += b >> 16;
            if n >= 32 {
                if let Some(w) = buf.get_mut(at..at + 4) {
                    w.copy_from_slice(&(acc as u32).to_le_bytes());
                }
                at += 4;
                acc >>= 32;
                n -= 32;
            }
        }
        for &s in pairs.remainder() {
            let a = code(s);
            acc |= u64::from(a & 0xffff) << n;
            n += a >> 16;
        }
        while n > 0 {
            if let Some(w) = buf.get_mut(at) {
                *w = acc as u8;
            }
            at += 1;
            acc >>= 8;
            n = n.saturating_sub(8);
        }
        out.truncate(start + at);
    }
}

/// Decoding tables indexed by the next `MAX_LEN` bits of the stream: `single` gives one
/// (symbol, length); `multi` gives as many whole codes (up to 4) as fit in those bits, so
/// a low-entropy plane (an exponent plane averages under 3 bits a symbol) decodes about
/// three to four symbols per lookup.
pub(crate) struct Decoder {
    /// `symbol | length << 8`; length 0 marks bits that no code starts with.
    single: Box<[u16; TABLE_SIZE]>,
    /// `symbols (4 bytes) | count << 32 | total length << 36`; an empty slot is `EMPTY`:
    /// it consumes `MAX_LEN` bits and one symbol, so the fast loop always makes progress,
    /// and its flag bit is checked once at the end.
    multi: Box<[u64; TABLE_SIZE]>,
}

impl std::fmt::Debug for Decoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("huffman::Decoder")
    }
}

/// Symbols a `multi` entry emits; at most this many bytes are written per lookup.
const MULTI: usize = 4;
/// Flag bit of an empty `multi` slot (count 1, length `MAX_LEN`).
const EMPTY_FLAG: u64 = 1 << 48;
const EMPTY: u64 = EMPTY_FLAG | 1 << 32 | (MAX_LEN as u64) << 36;

impl Decoder {
    // from a parsed table: lengths <= MAX_LEN, slots < TABLE_SIZE, at most MULTI symbols
    #[allow(clippy::arithmetic_side_effects)]
    pub(crate) fn new(lengths: &CodeLengths) -> Self {
        let codes = lengths.reversed_codes();
        let mut single = Box::new([0u16; TABLE_SIZE]);
        for s in (0..256usize).filter(|&s| lengths.0.get(s).is_some_and(|&l| l > 0)) {
            let l = lengths.0.get(s).copied().unwrap_or(MAX_LEN);
            let c = codes.get(s).copied().unwrap_or(0) as usize;
            let entry = (s as u16) | (u16::from(l) << 8);
            let mut i = c;
            while i < TABLE_SIZE {
                if let Some(e) = single.get_mut(i) {
                    *e = entry;
                }
                i += 1 << l;
            }
        }
        let mut multi = Box::new([0u64; TABLE_SIZE]);
        for (i, m) in multi.iter_mut().enumerate() {
            let (mut x, mut left, mut syms, mut count, mut total) =
                (i, u32::from(MAX_LEN), 0u64, 0u64, 0u64);
            while (count as usize) < MULTI {
                let e = single.get(x).copied().unwrap_or(0);
                let l = u32::from(e >> 8);
                // a code is known only if all its bits are among the bits looked at
                if l == 0 || l > left {
                    break;
                }
                syms |= u64::from(e & 0xff) << (8 * count);
                count += 1;
                total += u64::from(l);
                x >>= l;
                left -= l;
            }
            *m = if count == 0 {
                EMPTY
            } else {
                syms | count << 32 | total << 36
            };
        }
        Self { single, multi }
    }

    /// Decodes the first `out.len()` symbols of `stream`; with `exact`, they must be all of
    /// it (no whole byte left over).
    ///
    /// # Errors
    /// [`Error::Malformed`] when the stream ends before the symbols do, holds bits no code
    /// starts with, or (with `exact`) has bytes left.
    pub(crate) fn decode(&self, stream: &[u8], out: &mut [u8], exact: bool) -> Result<()> {
        let mut st = Bits::new(stream);
        let mut flags = 0u64;
        let p = self.fast(&mut st, out, 0, &mut flags);
        self.finish(&mut st, out, p, flags, exact)
    }

    /// Decodes two independent streams at once: two dependency chains keep the CPU busy
    /// where one would wait on each table lookup. Same contract as [`Decoder::decode`] for
    /// each pair of stream and output.
    #[allow(clippy::arithmetic_side_effects)] // window offsets < out.len(), via `get`
    pub(crate) fn decode_pair(
        &self,
        a: (&[u8], &mut [u8], bool),
        b: (&[u8], &mut [u8], bool),
    ) -> Result<()> {
        let (stream_a, out_a, exact_a) = a;
        let (stream_b, out_b, exact_b) = b;
        let (mut sa, mut sb) = (Bits::new(stream_a), Bits::new(stream_b));
        let (mut pa, mut pb) = (0usize, 0usize);
        let (mut fa, mut fb) = (0u64, 0u64);
        while let (Some(wa), Some(wb)) = (
            out_a.get_mut(pa..pa + WINDOW),
            out_b.get_mut(pb..pb + WINDOW),
        ) {
            sa.refill();
            sb.refill();
            let (mut qa, mut qb) = (0usize, 0usize);
            for _ in 0..LOOKUPS {
                self.step(&mut sa, wa, &mut qa, &mut fa);
                self.step(&mut sb, wb, &mut qb, &mut fb);
            }
            pa += qa;
            pb += qb;
        }
        let pa = self.fast(&mut sa, out_a, pa, &mut fa);
        let pb = self.fast(&mut sb, out_b, pb, &mut fb);
        self.finish(&mut sa, out_a, pa, fa, exact_a)?;
        self.finish(&mut sb, out_b, pb, fb, exact_b)
    }

    /// One `multi` lookup: up to `MULTI` symbols into `window[*q..]`.
    #[inline(always)]
    #[allow(clippy::arithmetic_side_effects)] // q < WINDOW; l <= MAX_LEN <= bits after refill
    fn step(&self, st: &mut Bits<'_>, window: &mut [u8], q: &mut usize, flags: &mut u64) {
        let e = self
            .multi
            .get((st.acc & MASK) as usize)
            .copied()
            .unwrap_or(EMPTY);
        *flags |= e;
        if let Some(dst) = window.get_mut(*q..*q + MULTI) {
            dst.copy_from_slice(&e.to_le_bytes()[..MULTI]);
        }
        let l = ((e >> 36) & 0xf) as u32;
        *q += ((e >> 32) & 7) as usize;
        st.acc >>= l;
        st.bits -= l;
    }

    /// The fast loop from `out[p..]`: one refill (at least 56 bits) then `LOOKUPS` lookups
    /// of at most 12 bits, written through a `WINDOW`-byte window (one bounds check per
    /// refill). Returns how far it got; the rest is for `finish`.
    #[allow(clippy::arithmetic_side_effects)] // p < out.len(), via `get`
    fn fast(&self, st: &mut Bits<'_>, out: &mut [u8], mut p: usize, flags: &mut u64) -> usize {
        while let Some(window) = out.get_mut(p..p + WINDOW) {
            st.refill();
            let mut q = 0usize;
            for _ in 0..LOOKUPS {
                self.step(st, window, &mut q, flags);
            }
            p += q;
        }
        p
    }

    /// The last symbols one at a time, then the checks.
    fn finish(
        &self,
        st: &mut Bits<'_>,
        out: &mut [u8],
        p: usize,
        flags: u64,
        exact: bool,
    ) -> Result<()> {
        let empty = || Error::Malformed("coded plane holds bits that no code starts with".into());
        if flags & EMPTY_FLAG != 0 {
            return Err(empty());
        }
        for o in out.iter_mut().skip(p) {
            st.refill();
            let e = self
                .single
                .get((st.acc & MASK) as usize)
                .copied()
                .unwrap_or(0);
            let l = u32::from(e >> 8);
            if l == 0 {
                return Err(empty());
            }
            *o = e as u8;
            // a refill leaves at least 56 bits; a code takes at most MAX_LEN
            st.acc = st.acc.wrapping_shr(l);
            st.bits = st.bits.saturating_sub(l);
        }
        let consumed = (st.pos as u64)
            .saturating_mul(8)
            .saturating_sub(u64::from(st.bits));
        let available = (st.stream.len() as u64).saturating_mul(8);
        let Some(left) = available.checked_sub(consumed) else {
            return Err(Error::Malformed(
                "coded plane is shorter than its symbols".into(),
            ));
        };
        if exact && left >= 8 {
            return Err(Error::Malformed("coded plane has trailing bytes".into()));
        }
        Ok(())
    }
}

const MASK: u64 = (TABLE_SIZE - 1) as u64;
/// Lookups per refill: 4 x 12 bits fit in the 56 a refill guarantees.
const LOOKUPS: usize = 4;
/// Output bytes one refill can produce.
const WINDOW: usize = LOOKUPS * MULTI;

/// An LSB-first bit reader; past the end of the stream it reads zeros, and `finish` checks
/// that no bit past the end was consumed.
struct Bits<'a> {
    stream: &'a [u8],
    /// Bytes loaded into `acc` so far (including zeros past the end).
    pos: usize,
    acc: u64,
    /// Valid, unconsumed bits in `acc`.
    bits: u32,
}

impl<'a> Bits<'a> {
    fn new(stream: &'a [u8]) -> Self {
        Self {
            stream,
            pos: 0,
            acc: 0,
            bits: 0,
        }
    }

    /// Tops `acc` up to at least 56 bits.
    #[inline(always)]
    #[allow(clippy::arithmetic_side_effects)] // bits <= 64; pos grows by at most 8 a call
    fn refill(&mut self) {
        if let Some(word) = self.stream.get(self.pos..self.pos + 8) {
            let mut w = [0u8; 8];
            w.copy_from_slice(word);
            self.acc |= u64::from_le_bytes(w) << self.bits;
            self.pos += ((63 - self.bits) >> 3) as usize;
            self.bits |= 56;
        } else {
            while self.bits <= 56 {
                self.acc |= u64::from(self.stream.get(self.pos).copied().unwrap_or(0)) << self.bits;
                self.pos += 1;
                self.bits += 8;
            }
        }
    }
}

/// [`CodeLengths::block_cost_bits`], whatever the instruction set it is compiled for.
#[inline(always)]
fn block_cost_bits_body(lens: &[u8; 256], counts: &[u32; 256]) -> u64 {
    let mut bits = 0u32;
    let mut uncodable = 0u32;
    for (&c, &l) in counts.iter().zip(lens.iter()) {
        bits = bits.wrapping_add(c.wrapping_mul(u32::from(l)));
        uncodable |= c.wrapping_mul(u32::from(l == 0));
    }
    if uncodable != 0 {
        u64::MAX
    } else {
        u64::from(bits)
    }
}

/// [`block_cost_bits_body`] compiled for AVX2.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)] // one `target_feature` function, called only where the CPU has it
mod avx2 {
    /// The cost, or `None` where the CPU lacks AVX2.
    pub(super) fn block_cost_bits(lens: &[u8; 256], counts: &[u32; 256]) -> Option<u64> {
        if !std::arch::is_x86_feature_detected!("avx2") {
            return None;
        }
        // SAFETY: the CPU has AVX2, checked just above
        let bits = unsafe { imp(lens, counts) };
        Some(bits)
    }

    #[target_feature(enable = "avx2")]
    fn imp(lens: &[u8; 256], counts: &[u32; 256]) -> u64 {
        super::block_cost_bits_body(lens, counts)
    }
}

#[cfg(test)]
#[allow(
    clippy::indexing_slicing,
    clippy::unwrap_used,
    clippy::arithmetic_side_effects
)] // tests index fixed arrays and count small numbers
mod tests {
    use super::*;

    #[test]
    fn block_costs_are_the_same_on_every_instruction_set() {
        let mut r = 12345u64;
        let mut next = || {
            r = r.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            r >> 33
        };
        for case in 0..200 {
            let mut lens = [0u8; 256];
            let mut counts = [0u32; 256];
            for (l, c) in lens.iter_mut().zip(counts.iter_mut()) {
                *l = (next() % 16) as u8;
                // every tenth case leaves some bytes without a code
                if *l == 0 && case % 10 != 0 {
                    *l = 1;
                }
                *c = (next() % (1 << 20)) as u32 * u32::from(next() % 3 != 0);
            }
            let portable = block_cost_bits_body(&lens, &counts);
            assert_eq!(CodeLengths(lens).block_cost_bits(&counts), portable);
            #[cfg(target_arch = "x86_64")]
            if let Some(simd) = avx2::block_cost_bits(&lens, &counts) {
                assert_eq!(simd, portable);
            } else {
                eprintln!("skipped: the CPU has no AVX2");
            }
        }
    }

    /// The tree depths a binary heap gives (lightest two first, ties by node index): what
    /// `from_counts` built before its two queues, kept to show they agree tie for tie.
    fn heap_depths(counts: &[u64; 256]) -> [u32; 256] {
        use std::cmp::Reverse;
        use std::collections::BinaryHeap;
        let total: u64 = counts.iter().sum();
        let floor = (total >> 14).max(1);
        let mut parent = vec![usize::MAX; 511];
        let mut heap: BinaryHeap<Reverse<(u64, usize)>> = counts
            .iter()
            .enumerate()
            .filter(|&(_, &c)| c > 0)
            .map(|(s, &c)| Reverse((c.max(floor), s)))
            .collect();
        let mut next = 256;
        while heap.len() > 1 {
            let (Some(Reverse((wa, a))), Some(Reverse((wb, b)))) = (heap.pop(), heap.pop()) else {
                break;
            };
            parent[a] = next;
            parent[b] = next;
            heap.push(Reverse((wa + wb, next)));
            next += 1;
        }
        let mut depth = [0u32; 256];
        for s in (0..256).filter(|&s| counts[s] > 0) {
            let mut node = s;
            while parent[node] != usize::MAX {
                node = parent[node];
                depth[s] += 1;
            }
        }
        depth
    }

    proptest::proptest! {
        #[test]
        fn two_queues_build_the_heaps_tree(
            counts in proptest::collection::vec(0u64..50, 256),
            scale in 1u64..1000,
        ) {
            // small counts make many ties; the scale makes some weights equal to sums
            let mut c = [0u64; 256];
            for (x, &v) in c.iter_mut().zip(&counts) {
                *x = v * scale;
            }
            if c.iter().filter(|&&x| x > 0).count() > 1 {
                let max = u32::from(MAX_LEN);
                let depths = heap_depths(&c);
                let lens = CodeLengths::from_counts(&c);
                // where the length limit does not bind, as many symbols get each length
                // as the tree has leaves at that depth (the lengths are then handed out
                // by frequency)
                if depths.iter().all(|&d| d <= max) {
                    let mut want = [0u32; 16];
                    let mut got = [0u32; 16];
                    for s in 0..256 {
                        want[depths[s] as usize] += 1;
                        got[usize::from(lens.0[s])] += 1;
                    }
                    proptest::prop_assert_eq!(want, got);
                }
            }
        }
    }

    fn counts_of(data: &[u8]) -> [u64; 256] {
        let mut c = [0u64; 256];
        for &b in data {
            c[b as usize] += 1;
        }
        c
    }

    #[test]
    fn lengths_are_limited_and_complete() {
        let mut counts = [0u64; 256];
        for (i, c) in counts.iter_mut().enumerate() {
            *c = 1u64 << (i % 40); // very skewed: unlimited Huffman would go past 12
        }
        let lens = CodeLengths::from_counts(&counts);
        assert!(lens.0.iter().all(|&l| (1..=MAX_LEN).contains(&l)));
        // the 12-bit limit binds hard on this distribution: stay within 5% of entropy
        let total: u64 = counts.iter().sum();
        let h: f64 = counts
            .iter()
            .map(|&c| {
                let p = c as f64 / total as f64;
                -p * p.log2()
            })
            .sum();
        let bits = lens.cost_bits(&counts) as f64 / total as f64;
        assert!(bits < h * 1.05, "{bits} bits/symbol against entropy {h}");
        let back = CodeLengths::from_nibbles(&lens.to_nibbles()).unwrap();
        assert_eq!(back, lens);
    }

    #[test]
    fn roundtrip_skewed_and_uniform() {
        let skewed: Vec<u8> = (0..10_000u32).map(|i| (i * i % 7) as u8 + 120).collect();
        let uniform: Vec<u8> = (0..10_001u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
            .collect();
        for data in [skewed, uniform, vec![], vec![3]] {
            let lens = CodeLengths::from_counts(&counts_of(&data));
            let mut coded = Vec::new();
            Encoder::new(&lens).encode(&data, &mut coded);
            assert_eq!(
                coded.len() as u64,
                lens.cost_bits(&counts_of(&data)).div_ceil(8)
            );
            let mut out = vec![0u8; data.len()];
            Decoder::new(&lens).decode(&coded, &mut out, true).unwrap();
            assert_eq!(out, data);
        }
    }

    #[test]
    fn truncated_stream_is_an_error() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8).collect();
        let lens = CodeLengths::from_counts(&counts_of(&data));
        let mut coded = Vec::new();
        Encoder::new(&lens).encode(&data, &mut coded);
        let mut out = vec![0u8; data.len()];
        let err = Decoder::new(&lens)
            .decode(&coded[..coded.len() - 2], &mut out, true)
            .unwrap_err();
        assert!(matches!(err, Error::Malformed(_)), "{err}");
    }

    #[test]
    fn codes_are_prefix_free_with_unused_symbols_and_long_codes() {
        // 216 unused symbols (as in an exponent plane) and lengths up to the limit
        let mut counts = [0u64; 256];
        for (i, c) in counts.iter_mut().enumerate().skip(100).take(40) {
            *c = 1 + (1u64 << (i % 23));
        }
        let lens = CodeLengths::from_counts(&counts);
        assert!(lens.0.contains(&MAX_LEN));
        let codes = lens.reversed_codes();
        let used: Vec<(u16, u8)> = (0..256)
            .filter(|&s| lens.0[s] > 0)
            .map(|s| (codes[s], lens.0[s]))
            .collect();
        for &(c, l) in &used {
            assert!(u32::from(c) < 1 << l, "code {c:#x} does not fit {l} bits");
        }
        for (i, &(a, la)) in used.iter().enumerate() {
            for &(b, lb) in &used[i + 1..] {
                let l = la.min(lb);
                let mask = (1u16 << l) - 1;
                assert_ne!(a & mask, b & mask, "one code is a prefix of another");
            }
        }
    }

    #[test]
    fn bad_tables_are_rejected() {
        assert!(CodeLengths::from_nibbles(&[0x11; 128]).is_err()); // 256 codes of length 1
        assert!(CodeLengths::from_nibbles(&[0x88; 127]).is_err());
        assert!(CodeLengths::from_nibbles(&[0; 128]).is_err()); // no code at all
        assert!(CodeLengths::from_nibbles(&[0x88; 128]).is_ok()); // 256 codes of length 8
    }

    #[test]
    fn geometric_source_is_near_entropy() {
        let mut counts = [0u64; 256];
        for i in 0..20i32 {
            counts[100 + i as usize] = (1e7 * 0.6f64.powi(i)) as u64;
        }
        let lens = CodeLengths::from_counts(&counts);
        let total: u64 = counts.iter().sum();
        let h: f64 = counts
            .iter()
            .filter(|&&c| c > 0)
            .map(|&c| {
                let p = c as f64 / total as f64;
                -p * p.log2()
            })
            .sum();
        let bits = lens.cost_bits(&counts) as f64 / total as f64;
        // Huffman's own loss on a source whose top symbol has p = 0.4 is about 0.08 bits
        assert!(bits < h + 0.1, "{bits} bits/symbol against entropy {h}");
        assert_eq!(lens.0[0], 0, "a symbol that never occurs gets no code");
        assert_eq!(
            lens.cost_bits(&{
                let mut c = [0u64; 256];
                c[0] = 1;
                c
            }),
            u64::MAX
        );
    }

    #[test]
    fn empty_slot_in_a_long_stream_is_an_error_not_a_hang() {
        // an incomplete table: one code "0"; a stream of 1 bits starts no code. 100 symbols
        // take the fast loop, which must still make progress and report the empty slot.
        let mut counts = [0u64; 256];
        counts[7] = 5;
        let lens = CodeLengths::from_counts(&counts);
        let mut out = [0u8; 100];
        let err = Decoder::new(&lens)
            .decode(&[0xff; 40], &mut out, false)
            .unwrap_err();
        assert!(matches!(err, Error::Malformed(_)), "{err}");
        let mut other = [0u8; 100];
        let err = Decoder::new(&lens)
            .decode_pair(
                (&[0xff; 40], &mut out, false),
                (&[0x00; 40], &mut other, false),
            )
            .unwrap_err();
        assert!(matches!(err, Error::Malformed(_)), "{err}");
    }

    #[test]
    fn empty_slot_is_an_error_not_garbage() {
        let mut counts = [0u64; 256];
        counts[7] = 5;
        let lens = CodeLengths::from_counts(&counts); // one code: "0"; "1" starts nothing
        let mut out = [0u8; 4];
        assert!(Decoder::new(&lens).decode(&[0x00], &mut out, true).is_ok());
        assert_eq!(out, [7; 4]);
        assert!(Decoder::new(&lens).decode(&[0x0f], &mut out, true).is_err());
    }
}
