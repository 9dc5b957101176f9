//! One row of 14-bit activations laid out for the VNNI tiers' 4-bit kernels
//! (`vpdpbusd`, unsigned bytes times signed bytes), which both the AVX-512 VNNI and the
//! AVX-VNNI tier read, and for the AVX-512 tier's 8-bit one ([`SplitX::new_bytes`]: the
//! same split and corrections, in the bytes layout of [`byte_source`]).
//!
//! # The layout
//! A pair of 16-byte runs of codes (64 weights, positions in nibble order: byte `b` of
//! run `r` holds position `32r + b` in its low nibble and `32r + 16 + b` in its high
//! one, both of class `b / 2`) is rearranged in registers so that byte `4L + t` of the
//! pair's 32 *low* nibbles is byte `2L + t mod 2` of run `t / 2`, and likewise for the
//! high nibbles: each 32-bit lane `L` of `vpdpbusd` then sums four products of class `L`
//! only, and the eight lanes are the pair's eight class sums with no fold. `x` is laid
//! out to match, split as `x = 256 · xh + xl` (`xl` in `-128..=127`, `xh` in
//! `-32..=32`); codes decode through their table plus 128 to unsigned bytes
//! `u = w + 128`, so `Σ w·x = Σ u·xl + 256 · Σ u·xh − 128 · Σ x`, and `128 · Σ x` per
//! group and class is worked out here once a product.
//!
//! Per chunk of 128 positions (two pairs) the split parts are stored as
//! `[pair 0 low nibbles, pair 1 low nibbles, pair 0 high, pair 1 high]`, 32 bytes each,
//! so a 512-bit kernel loads a chunk's low (or high) parts in one register and a 256-bit
//! kernel a pair's in one.

/// Weights per 64 bytes of 4-bit codes: the unit of the layout.
pub(super) const CHUNK: usize = 128;

/// Weights per pair of runs: the smallest group the kernels take.
pub(super) const PAIR: usize = 64;

/// Whether the 4-bit kernels take rows in groups of `group` (so a [`SplitX`] is worth
/// making for them).
pub(super) fn splits(group: usize) -> bool {
    group > 0 && group.is_multiple_of(PAIR)
}

/// One row of 14-bit activations in nibble order, split and laid out for `vpdpbusd`.
pub(super) struct SplitX {
    /// Low parts (signed), [`CHUNK`] a chunk (zero past the row).
    pub(super) xl: Vec<i8>,
    /// High parts, in the same layout.
    pub(super) xh: Vec<i8>,
    /// Per group of `group` positions, per class: `128 · Σ x`, what the codes' bias of
    /// 128 adds.
    pub(super) corr: Vec<i32>,
    pub(super) group: usize,
    /// Positions a byte of codes holds: 2 for 4-bit codes, 1 for 8-bit ones
    /// ([`SplitX::new_bytes`]).
    pub(super) per_byte: usize,
}

/// The position among 64 (natural order: 8-bit codes) that byte `i` of a vector of the
/// bytes layout holds: lane `L` (bytes `4L..4L + 4`) takes the pairs `2m, 2m + 1` and
/// `16 + 2m, 16 + 2m + 1` of the half `L / 8` (32 positions), `m = L mod 8`, so each lane
/// sums one class (`m`) and each 256-bit half is one run of 32 positions.
pub(super) const fn byte_source(i: usize) -> usize {
    let (lane, t) = (i / 4, i % 4);
    32 * (lane / 8) + 16 * (t / 2) + 2 * (lane % 8) + t % 2
}

/// [`byte_source`] as `vpermb`'s index: byte `i` of a vector of codes in the bytes layout
/// is byte `BYTE_ORDER[i]` of the stored codes.
pub(super) const BYTE_ORDER: [u8; 64] = {
    let mut o = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        o[i] = byte_source(i) as u8;
        i += 1;
    }
    o
};

/// The position in a chunk (nibble order) that byte `i` of the chunk's split layout
/// holds.
pub(super) fn split_source(i: usize) -> usize {
    let (high, pair, within) = (i / 64, (i / 32) % 2, i % 32);
    let (lane, t) = (within / 4, within % 4);
    PAIR * pair + 32 * (t / 2) + 16 * high + 2 * lane + t % 2
}

/// `x = 256 · h + l`, `l` in `-128..=127` (`|x| <= 8191`: `|h| <= 32`): `(l, h)`.
fn split(x: i16) -> (i8, i8) {
    let v = i32::from(x);
    let l = ((v + 128) & 0xff) - 128;
    (l as i8, ((v - l) >> 8) as i8)
}

impl SplitX {
    /// `x` (14-bit, nibble order) for rows multiplied in groups of `group` positions.
    pub(super) fn new(x: &[i16], group: usize) -> Self {
        let chunks = x.len().div_ceil(CHUNK);
        let (mut xl, mut xh) = (vec![0i8; chunks * CHUNK], vec![0i8; chunks * CHUNK]);
        for (i, (lo, hi)) in xl.iter_mut().zip(xh.iter_mut()).enumerate() {
            let src = CHUNK * (i / CHUNK) + split_source(i % CHUNK);
            (*lo, *hi) = split(x.get(src).copied().unwrap_or(0));
        }
        Self::with(x, xl, xh, group, 2)
    }

    /// `x` (14-bit, natural order) for rows of 8-bit codes multiplied in groups of `group`
    /// positions: the bytes layout ([`byte_source`]), 64 bytes a vector.
    pub(super) fn new_bytes(x: &[i16], group: usize) -> Self {
        let n = x.len().div_ceil(64) * 64;
        let (mut xl, mut xh) = (vec![0i8; n], vec![0i8; n]);
        for (i, (lo, hi)) in xl.iter_mut().zip(xh.iter_mut()).enumerate() {
            let src = 64 * (i / 64) + byte_source(i % 64);
            (*lo, *hi) = split(x.get(src).copied().unwrap_or(0));
        }
        Self::with(x, xl, xh, group, 1)
    }

    /// The corrections of `x` in groups of `group`, with the split parts.
    fn with(x: &[i16], xl: Vec<i8>, xh: Vec<i8>, group: usize, per_byte: usize) -> Self {
        let group = group.max(1);
        let mut corr = vec![0i32; x.len().div_ceil(group) * 8];
        // a group at a time (no division a position: at batch 1 this runs once a product)
        for ((g, part), c) in x.chunks(group).enumerate().zip(corr.chunks_exact_mut(8)) {
            for (j, &v) in part.iter().enumerate() {
                let p = g * group + j;
                c[(p % 16) / 2] += 128 * i32::from(v);
            }
        }
        Self {
            xl,
            xh,
            corr,
            group,
            per_byte,
        }
    }

    /// Whether this split covers rows of `row_bytes` bytes of codes in groups of `group`:
    /// the chunks and groups such a row reaches.
    pub(super) fn covers(&self, row_bytes: usize, group: usize) -> bool {
        let positions = self.per_byte * row_bytes;
        let unit = if self.per_byte == 2 { CHUNK } else { 64 };
        self.group == group
            && splits(group)
            && self.xl.len() >= positions.div_ceil(unit) * unit
            && self.xh.len() == self.xl.len()
            && self.corr.len() >= positions.div_ceil(group) * 8
    }
}

/// The in-lane byte order that turns a 128-bit lane holding eight code bytes of run A
/// then eight of run B into the layout's order: for each class `L` of the four, bytes
/// `2L, 2L + 1` of A, then of B.
pub(super) const PAIR_ORDER: [i8; 16] = [0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15];

#[cfg(test)]
mod tests {
    use super::*;

    /// Every position of a chunk appears once, and each lane of four bytes holds one
    /// class.
    #[test]
    fn the_layout_is_a_permutation_with_one_class_a_lane() {
        let mut seen = [false; CHUNK];
        for i in 0..CHUNK {
            let p = split_source(i);
            assert!(!seen[p], "position {p} twice");
            seen[p] = true;
            let lane_first = split_source(i - i % 4);
            assert_eq!((p % 16) / 2, (lane_first % 16) / 2, "byte {i}");
            // the eight lanes of a 32-byte part are the classes in order
            assert_eq!((p % 16) / 2, (i % 32) / 4, "byte {i}");
        }
        assert!(seen.iter().all(|&s| s));
    }

    /// The split parts give `x` back, the corrections are `128 · Σ x` per class.
    #[test]
    fn split_parts_rebuild_x() {
        let x: Vec<i16> = (0..300)
            .map(|i| ((i * 7919) % 16383 - 8191) as i16)
            .collect();
        let s = SplitX::new(&x, 64);
        for (i, (&l, &h)) in s.xl.iter().zip(&s.xh).enumerate() {
            let p = CHUNK * (i / CHUNK) + split_source(i % CHUNK);
            let want = x.get(p).map_or(0, |&v| i32::from(v));
            assert_eq!(256 * i32::from(h) + i32::from(l), want, "byte {i}");
        }
        let mut want = vec![0i32; 300usize.div_ceil(64) * 8];
        for (p, &v) in x.iter().enumerate() {
            want[p / 64 * 8 + (p % 16) / 2] += 128 * i32::from(v);
        }
        assert_eq!(s.corr, want);
        assert!(s.covers(150, 64));
        assert!(!s.covers(150, 128));
        assert!(!SplitX::new(&x, 32).covers(150, 32));
        assert_eq!(s.per_byte, 2);
    }

    /// The bytes layout: every position of a vector once, one class a lane, a half a run
    /// of 32; `BYTE_ORDER` is the same map; the parts give `x` back, the corrections are
    /// as for 4-bit codes; a split covers rows of as many bytes as positions.
    #[test]
    fn the_bytes_layout_is_a_permutation_with_one_class_a_lane() {
        let mut seen = [false; 64];
        for (i, &o) in BYTE_ORDER.iter().enumerate() {
            let p = byte_source(i);
            assert_eq!(usize::from(o), p);
            assert!(!seen[p], "position {p} twice");
            seen[p] = true;
            assert_eq!((p % 16) / 2, (i % 32) / 4, "byte {i}");
            assert_eq!(p / 32, i / 32, "byte {i}");
        }
        assert!(seen.iter().all(|&s| s));
        let x: Vec<i16> = (0..300)
            .map(|i| ((i * 7919) % 16383 - 8191) as i16)
            .collect();
        let s = SplitX::new_bytes(&x, 64);
        for (i, (&l, &h)) in s.xl.iter().zip(&s.xh).enumerate() {
            let want = x
                .get(64 * (i / 64) + byte_source(i % 64))
                .map_or(0, |&v| i32::from(v));
            assert_eq!(256 * i32::from(h) + i32::from(l), want, "byte {i}");
        }
        assert_eq!(s.corr, SplitX::new(&x, 64).corr);
        assert!(s.covers(300, 64));
        assert!(!s.covers(321, 64));
    }
}
