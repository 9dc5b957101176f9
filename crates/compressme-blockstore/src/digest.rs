//! SHA-256 of many independent byte strings: block digests four at a time, and byte
//! streams fed in pieces four at a time.
//!
//! One SHA-256 is a chain: each of its rounds needs the last, and on a CPU with the SHA
//! extensions a single message runs at the latency of `sha256rnds2` (1.8 GB/s a core on
//! AMD Zen 4 and Zen 5, the `sha2` crate's own SHA-NI code), with most of the unit idle. A
//! store's blocks are independent messages, so [`sha256_many`] runs four of them in
//! lockstep, their rounds interleaved (3.3 GB/s a core on the same CPUs). [`Sha256Streams`]
//! does the same for messages that arrive in pieces (the whole-tensor digests of tensors
//! decoded side by side). The digests are SHA-256's, tested against the `sha2` crate on
//! every length around the padding boundaries; where the CPU lacks the SHA extensions (or
//! `COMPRESSME_SHA=scalar`), each message goes through `sha2`.
//!
//! The crate's only `unsafe`: the SHA-NI intrinsics, behind a run-time check, on 64-byte
//! arrays whose bounds the types carry.
#![allow(unsafe_code)]

use sha2::{Digest, Sha256};

/// Messages hashed in lockstep.
const LANES: usize = 4;

/// The SHA-256 digest of each message, in order: four messages at a time in lockstep
/// (for as many blocks as all four have) where the CPU has the SHA extensions, and a
/// remainder of two or three in a lockstep of its own.
#[must_use]
pub fn sha256_many(msgs: &[&[u8]]) -> Vec<[u8; 32]> {
    let mut out = Vec::with_capacity(msgs.len());
    let mut groups = msgs.chunks_exact(LANES);
    #[cfg(target_arch = "x86_64")]
    if shani::available() {
        for g in &mut groups {
            if let Ok(g) = <&[&[u8]; LANES]>::try_from(g) {
                out.extend(shani::digests(g));
            }
        }
        // a remainder of two or three in lockstep too: one chain alone waits on its
        // rounds' latency, two already fill the SHA unit about as well as four (a piece
        // of three blocks per lane, as a 22 KB-row tensor's 4 MiB pieces are, hashed one
        // chain at a time was 8% of `verify`'s samples on the 4 GiB checkpoint)
        let rest = groups.remainder();
        if let Ok(g) = <&[&[u8]; 3]>::try_from(rest) {
            out.extend(shani::digests(g));
            return out;
        }
        if let Ok(g) = <&[&[u8]; 2]>::try_from(rest) {
            out.extend(shani::digests(g));
            return out;
        }
    }
    for g in groups.by_ref() {
        out.extend(g.iter().map(|m| -> [u8; 32] { Sha256::digest(m).into() }));
    }
    out.extend(
        groups
            .remainder()
            .iter()
            .map(|m| -> [u8; 32] { Sha256::digest(m).into() }),
    );
    out
}

/// SHA-256 of several byte streams at once, each fed in pieces: the whole 64-byte blocks
/// of the pieces given to one [`update`](Sha256Streams::update) are hashed four streams
/// at a time in lockstep where the CPU has the SHA extensions (about 1.8x as fast as one
/// stream after another), each stream alone where the others have run out. A stream's
/// digest is the SHA-256 of everything fed to it since it was last
/// [finished](Sha256Streams::finish), whatever the pieces' lengths.
pub struct Sha256Streams {
    lanes: Vec<Lane>,
}

/// One stream's running state.
enum Lane {
    /// SHA-NI: the chaining state, a partial block and the bytes fed so far.
    #[cfg(target_arch = "x86_64")]
    Ni {
        state: [u32; 8],
        buf: [u8; 64],
        len: usize,
        total: u64,
    },
    /// The `sha2` crate, one stream at a time.
    Soft(Sha256),
}

impl Lane {
    fn new(ni: bool) -> Self {
        #[cfg(target_arch = "x86_64")]
        if ni {
            return Lane::Ni {
                state: shani::H0,
                buf: [0; 64],
                len: 0,
                total: 0,
            };
        }
        let _ = ni;
        Lane::Soft(Sha256::new())
    }
}

impl std::fmt::Debug for Sha256Streams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sha256Streams")
            .field("streams", &self.lanes.len())
            .finish_non_exhaustive()
    }
}

impl Sha256Streams {
    /// `streams` empty streams.
    #[must_use]
    pub fn new(streams: usize) -> Self {
        #[cfg(target_arch = "x86_64")]
        let ni = shani::available();
        #[cfg(not(target_arch = "x86_64"))]
        let ni = false;
        Self::with_lockstep(streams, ni)
    }

    /// [`Sha256Streams::new`], choosing the SHA-NI lockstep code (`ni`, where the CPU has
    /// it) or `sha2` per stream: so tests cover both on one CPU.
    fn with_lockstep(streams: usize, ni: bool) -> Self {
        #[cfg(target_arch = "x86_64")]
        let ni = ni && shani::available();
        Self {
            lanes: (0..streams).map(|_| Lane::new(ni)).collect(),
        }
    }

    /// How many streams there are.
    #[must_use]
    pub fn streams(&self) -> usize {
        self.lanes.len()
    }

    /// Feeds `pieces[i]` to stream `i` (an empty piece feeds nothing); pieces beyond the
    /// number of streams are ignored.
    pub fn update(&mut self, pieces: &[&[u8]]) {
        #[cfg(target_arch = "x86_64")]
        let mut whole: Vec<(usize, &[[u8; 64]])> = Vec::with_capacity(pieces.len());
        for (i, (lane, piece)) in self.lanes.iter_mut().zip(pieces).enumerate() {
            match lane {
                Lane::Soft(h) => h.update(piece),
                #[cfg(target_arch = "x86_64")]
                Lane::Ni {
                    state,
                    buf,
                    len,
                    total,
                } => {
                    *total = total.wrapping_add(piece.len() as u64);
                    let mut rest: &[u8] = piece;
                    if *len > 0 {
                        // complete the partial block first
                        let take = (64 - *len).min(rest.len());
                        let (head, tail) = rest.split_at(take);
                        if let Some(b) = buf.get_mut(*len..*len + take) {
                            b.copy_from_slice(head);
                        }
                        *len += take;
                        rest = tail;
                        if *len == 64 {
                            shani::compress_one(state, buf);
                            *len = 0;
                        }
                    }
                    let (blocks, tail) = rest.as_chunks::<64>();
                    if !tail.is_empty() {
                        // `len` is 0 here: `rest` is non-empty only after a full block
                        if let Some(b) = buf.get_mut(..tail.len()) {
                            b.copy_from_slice(tail);
                        }
                        *len = tail.len();
                    }
                    if !blocks.is_empty() {
                        whole.push((i, blocks));
                    }
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        self.lockstep(&mut whole);
    }

    /// Runs every stream's whole blocks in `whole` (stream, blocks) through the
    /// compression, four streams at a time for as many blocks as all four have, then
    /// whatever is left in smaller groups.
    #[cfg(target_arch = "x86_64")]
    fn lockstep(&mut self, whole: &mut [(usize, &[[u8; 64]])]) {
        loop {
            // the streams with blocks left, longest first, so groups stay full longest
            whole.sort_by_key(|(_, b)| std::cmp::Reverse(b.len()));
            let active = whole.iter().take_while(|(_, b)| !b.is_empty()).count();
            if active == 0 {
                return;
            }
            let group = active.min(LANES);
            let Some(g) = whole.get_mut(..group) else {
                return;
            };
            let common = g.iter().map(|(_, b)| b.len()).min().unwrap_or(0);
            let mut states = [shani::H0; LANES];
            for (s, (i, _)) in states.iter_mut().zip(g.iter()) {
                if let Some(Lane::Ni { state, .. }) = self.lanes.get(*i) {
                    *s = *state;
                }
            }
            let blocks: Vec<&[[u8; 64]]> = g.iter().map(|(_, b)| *b).collect();
            shani::compress_lanes(&mut states, &blocks, common);
            for (s, (i, b)) in states.iter().zip(g.iter_mut()) {
                if let Some(Lane::Ni { state, .. }) = self.lanes.get_mut(*i) {
                    *state = *s;
                }
                *b = b.get(common..).unwrap_or(&[]);
            }
        }
    }

    /// The digest of stream `i` (of everything fed to it since it was created or last
    /// finished), which starts again empty; `None` if there is no stream `i`.
    pub fn finish(&mut self, i: usize) -> Option<[u8; 32]> {
        let lane = self.lanes.get_mut(i)?;
        match lane {
            Lane::Soft(h) => Some(h.finalize_reset().into()),
            #[cfg(target_arch = "x86_64")]
            Lane::Ni {
                state,
                buf,
                len,
                total,
            } => {
                let d = shani::finish(state, buf.get(..*len).unwrap_or(&[]), *total);
                *lane = Lane::new(true);
                Some(d)
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod shani {
    use std::arch::x86_64::{
        __m128i, _mm_add_epi32, _mm_alignr_epi8, _mm_blend_epi16, _mm_loadu_si128, _mm_set_epi64x,
        _mm_sha256msg1_epu32, _mm_sha256msg2_epu32, _mm_sha256rnds2_epu32, _mm_shuffle_epi8,
        _mm_shuffle_epi32, _mm_storeu_si128,
    };

    use super::LANES;

    /// SHA-256's round constants.
    const K: [u32; 64] = [
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
        0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
        0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
        0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
        0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
        0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
        0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
        0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
        0xc67178f2,
    ];
    /// SHA-256's initial state.
    pub(super) const H0: [u32; 8] = [
        0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab,
        0x5be0cd19,
    ];

    /// Whether this CPU has the SHA extensions (and SSSE3 and SSE4.1, which the kernel's
    /// shuffles use), decided once; `COMPRESSME_SHA=scalar` says no.
    pub(super) fn available() -> bool {
        static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *OK.get_or_init(|| {
            std::env::var("COMPRESSME_SHA").map_or(true, |v| v != "scalar")
                && is_x86_feature_detected!("sha")
                && is_x86_feature_detected!("ssse3")
                && is_x86_feature_detected!("sse4.1")
        })
    }

    /// One message cut into 64-byte blocks: its whole blocks in place, then the last
    /// bytes with SHA-256's padding (one or two blocks).
    struct Blocks<'a> {
        whole: &'a [[u8; 64]],
        tail: [[u8; 64]; 2],
        tail_blocks: usize,
    }

    impl<'a> Blocks<'a> {
        fn new(m: &'a [u8]) -> Self {
            let (whole, rest) = m.as_chunks::<64>();
            let mut tail = [[0u8; 64]; 2];
            let flat = tail.as_flattened_mut();
            let r = rest.len(); // < 64
            if let Some(t) = flat.get_mut(..r) {
                t.copy_from_slice(rest);
            }
            if let Some(b) = flat.get_mut(r) {
                *b = 0x80;
            }
            // the bit length ends the last block: one block if it fits after the 0x80
            let tail_blocks = if r < 56 { 1 } else { 2 };
            let bits = (m.len() as u64).wrapping_mul(8).to_be_bytes();
            if let Some(t) = flat.get_mut(64 * tail_blocks - 8..64 * tail_blocks) {
                t.copy_from_slice(&bits);
            }
            Self {
                whole,
                tail,
                tail_blocks,
            }
        }

        fn len(&self) -> usize {
            self.whole.len() + self.tail_blocks
        }

        fn get(&self, b: usize) -> &[u8; 64] {
            match self.whole.get(b) {
                Some(x) => x,
                None => self.tail.get(b - self.whole.len()).unwrap_or(&self.tail[0]),
            }
        }
    }

    /// Compresses one block into `state`.
    pub(super) fn compress_one(state: &mut [u32; 8], block: &[u8; 64]) {
        sha2::block_api::compress256(state, std::slice::from_ref(block));
    }

    /// Compresses blocks `0..count` of each of `blocks` (one slice a stream, the first
    /// `blocks.len()` of `states`, at most four), in lockstep.
    pub(super) fn compress_lanes(
        states: &mut [[u32; 8]; LANES],
        blocks: &[&[[u8; 64]]],
        count: usize,
    ) {
        let count = blocks.iter().map(|b| b.len()).fold(count, usize::min);
        let zero = [0u8; 64];
        let at = |j: usize, b: usize| -> &[u8; 64] {
            blocks.get(j).and_then(|s| s.get(b)).unwrap_or(&zero)
        };
        macro_rules! run {
            ($n:literal) => {{
                let mut s: [[u32; 8]; $n] = std::array::from_fn(|j| states[j]);
                // SAFETY: as in `compress_one`.
                unsafe {
                    compress(&mut s, at, 0..count);
                }
                states[..$n].copy_from_slice(&s);
            }};
        }
        match blocks.len() {
            0 => {}
            // one stream alone: `sha2`'s own SHA-NI code, faster than a lockstep of one
            1 => {
                if let Some(b) = blocks.first().and_then(|b| b.get(..count)) {
                    sha2::block_api::compress256(&mut states[0], b);
                }
            }
            2 => run!(2),
            3 => run!(3),
            _ => run!(4),
        }
    }

    /// The digest of a stream whose chaining `state` has taken every whole block and whose
    /// last `tail` bytes (fewer than 64) are left, `total` bytes in all.
    pub(super) fn finish(state: &[u32; 8], tail: &[u8], total: u64) -> [u8; 32] {
        let mut last = [[0u8; 64]; 2];
        let flat = last.as_flattened_mut();
        let r = tail.len().min(63);
        if let (Some(t), Some(src)) = (flat.get_mut(..r), tail.get(..r)) {
            t.copy_from_slice(src);
        }
        if let Some(b) = flat.get_mut(r) {
            *b = 0x80;
        }
        let n = if r < 56 { 1 } else { 2 };
        let bits = total.wrapping_mul(8).to_be_bytes();
        if let Some(t) = flat.get_mut(64 * n - 8..64 * n) {
            t.copy_from_slice(&bits);
        }
        let mut s = *state;
        for b in last.iter().take(n) {
            compress_one(&mut s, b);
        }
        let mut d = [0u8; 32];
        for (o, w) in d.chunks_exact_mut(4).zip(s) {
            o.copy_from_slice(&w.to_be_bytes());
        }
        d
    }

    /// The digests of `N` messages (two to four), in lockstep for as many blocks as all
    /// have, then each alone.
    pub(super) fn digests<const N: usize>(msgs: &[&[u8]; N]) -> [[u8; 32]; N] {
        let blocks = msgs.map(Blocks::new);
        let mut states = [H0; N];
        let common = blocks.iter().map(Blocks::len).min().unwrap_or(0);
        // SAFETY: `available` checked SHA, SSSE3 and SSE4.1 before this module is used.
        unsafe {
            compress(&mut states, |j, b| blocks[j].get(b), 0..common);
        }
        for (j, b) in blocks.iter().enumerate() {
            let mut one = [states[j]];
            // SAFETY: as above.
            unsafe {
                compress(&mut one, |_, k| b.get(k), common..b.len());
            }
            states[j] = one[0];
        }
        states.map(|s| {
            let mut d = [0u8; 32];
            for (o, w) in d.chunks_exact_mut(4).zip(s) {
                o.copy_from_slice(&w.to_be_bytes());
            }
            d
        })
    }

    /// Runs blocks `range` of `N` messages through SHA-256's compression, in lockstep;
    /// `block(j, b)` is message `j`'s block `b`. Intel's SHA-NI sequence, one message's
    /// rounds interleaved with the others'.
    ///
    /// # Safety
    /// The CPU has SHA, SSSE3 and SSE4.1.
    #[target_feature(enable = "sha,ssse3,sse4.1")]
    unsafe fn compress<'a, const N: usize>(
        states: &mut [[u32; 8]; N],
        block: impl Fn(usize, usize) -> &'a [u8; 64],
        range: std::ops::Range<usize>,
    ) {
        let load = |p: &[u8; 16]| -> __m128i {
            // SAFETY: `p` is 16 readable bytes.
            unsafe { _mm_loadu_si128(p.as_ptr().cast()) }
        };
        let kv = |i: usize| -> __m128i {
            let k = K.as_chunks::<4>().0[i];
            // SAFETY: `k` is 16 readable bytes.
            unsafe { _mm_loadu_si128(k.as_ptr().cast()) }
        };
        let bswap = _mm_set_epi64x(0x0c0d_0e0f_0809_0a0b, 0x0405_0607_0001_0203);
        let zero = _mm_set_epi64x(0, 0);
        // ABEF and CDGH, the order `sha256rnds2` keeps the state in
        let mut s0 = [zero; N];
        let mut s1 = [zero; N];
        for j in 0..N {
            let (abcd, efgh) = states[j].split_at(4);
            // SAFETY: each half is 4 u32s, 16 readable bytes.
            let (abcd, efgh) = unsafe {
                (
                    _mm_loadu_si128(abcd.as_ptr().cast()),
                    _mm_loadu_si128(efgh.as_ptr().cast()),
                )
            };
            let t = _mm_shuffle_epi32::<0xB1>(abcd);
            let h = _mm_shuffle_epi32::<0x1B>(efgh);
            s0[j] = _mm_alignr_epi8::<8>(t, h);
            s1[j] = _mm_blend_epi16::<0xF0>(h, t);
        }
        for b in range {
            let (a0, a1) = (s0, s1);
            let mut m = [[zero; 4]; N];
            for i in 0..16 {
                for j in 0..N {
                    let w = if i < 4 {
                        let bytes = block(j, b).as_chunks::<16>().0[i];
                        _mm_shuffle_epi8(load(&bytes), bswap)
                    } else {
                        let t = _mm_add_epi32(
                            _mm_sha256msg1_epu32(m[j][i % 4], m[j][(i + 1) % 4]),
                            _mm_alignr_epi8::<4>(m[j][(i + 3) % 4], m[j][(i + 2) % 4]),
                        );
                        _mm_sha256msg2_epu32(t, m[j][(i + 3) % 4])
                    };
                    m[j][i % 4] = w;
                    let msg = _mm_add_epi32(w, kv(i));
                    s1[j] = _mm_sha256rnds2_epu32(s1[j], s0[j], msg);
                    s0[j] = _mm_sha256rnds2_epu32(s0[j], s1[j], _mm_shuffle_epi32::<0x0E>(msg));
                }
            }
            for j in 0..N {
                s0[j] = _mm_add_epi32(s0[j], a0[j]);
                s1[j] = _mm_add_epi32(s1[j], a1[j]);
            }
        }
        for j in 0..N {
            let t = _mm_shuffle_epi32::<0x1B>(s0[j]);
            let h = _mm_shuffle_epi32::<0xB1>(s1[j]);
            let (abcd, efgh) = states[j].split_at_mut(4);
            // SAFETY: each half is 4 u32s, 16 writable bytes.
            unsafe {
                _mm_storeu_si128(abcd.as_mut_ptr().cast(), _mm_blend_epi16::<0xF0>(t, h));
                _mm_storeu_si128(efgh.as_mut_ptr().cast(), _mm_alignr_epi8::<8>(h, t));
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::indexing_slicing, clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn digests_are_sha256_at_every_length_around_the_padding() {
        let data: Vec<u8> = (0..5000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        // lengths on both sides of every boundary: 55/56 (one or two padding blocks), 64
        let mut lens: Vec<usize> = (0..=200).collect();
        lens.extend([447, 448, 511, 512, 513, 1000, 4095, 4096, 4097, 5000]);
        // groups of four with different lengths (the lockstep part, then each alone), and
        // a remainder of one to three
        for shift in 0..4 {
            let msgs: Vec<&[u8]> = lens
                .iter()
                .enumerate()
                .map(|(i, &n)| &data[(i * 7 + shift) % 50..][..n.min(4950)])
                .collect();
            // 211 messages less `shift`: remainders of three, two, one and none
            let msgs = &msgs[..msgs.len() - shift];
            let got = sha256_many(msgs);
            assert_eq!(got.len(), msgs.len());
            for (m, d) in msgs.iter().zip(&got) {
                let want: [u8; 32] = Sha256::digest(m).into();
                assert_eq!(d, &want, "length {}", m.len());
            }
        }
        assert!(sha256_many(&[]).is_empty());
        #[cfg(target_arch = "x86_64")]
        if !shani::available() {
            eprintln!(
                "note: the SHA-NI path is off here (no SHA extensions, or COMPRESSME_SHA=scalar): only the sha2 path was tested"
            );
        }
    }

    /// Streams fed in pieces of every awkward length give `sha2`'s digests, on the
    /// lockstep code and on `sha2` per stream, and a finished stream starts again empty.
    #[test]
    fn streams_in_pieces_are_sha256() {
        let data: Vec<u8> = (0..40_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
            .collect();
        let piece_lens = [
            0usize, 1, 55, 56, 63, 64, 65, 127, 128, 129, 200, 640, 1000, 4096, 7,
        ];
        for ni in [true, false] {
            for streams in 1..=6 {
                let mut h = Sha256Streams::with_lockstep(streams, ni);
                assert_eq!(h.streams(), streams);
                let mut fed: Vec<Vec<u8>> = vec![Vec::new(); streams];
                let mut at = vec![0usize; streams];
                for round in 0..40 {
                    let pieces: Vec<&[u8]> = (0..streams)
                        .map(|i| {
                            let n = piece_lens[(round * 7 + i * 3) % piece_lens.len()];
                            let start = (at[i] + i * 977) % 30_000;
                            at[i] += n;
                            &data[start..start + n]
                        })
                        .collect();
                    h.update(&pieces);
                    for (f, p) in fed.iter_mut().zip(&pieces) {
                        f.extend_from_slice(p);
                    }
                    // now and then a stream ends and starts again
                    if round % 9 == 4 {
                        let i = round % streams;
                        let want: [u8; 32] = Sha256::digest(&fed[i]).into();
                        assert_eq!(
                            h.finish(i),
                            Some(want),
                            "ni {ni}, {streams} streams, round {round}"
                        );
                        fed[i].clear();
                    }
                }
                for (i, f) in fed.iter().enumerate() {
                    let want: [u8; 32] = Sha256::digest(f).into();
                    assert_eq!(
                        h.finish(i),
                        Some(want),
                        "ni {ni}, stream {i} of {streams}, {} bytes",
                        f.len()
                    );
                    let empty: [u8; 32] = Sha256::digest([]).into();
                    assert_eq!(h.finish(i), Some(empty));
                }
                assert_eq!(h.finish(streams), None);
            }
        }
    }
}
