//! Byte shuffle and unshuffle: group byte *k* of every element together, as Blosc does.
//!
//! Trained float weights compress poorly as a stream of whole values, but their bytes
//! fall into planes with very different statistics: the exponent byte of an `f32` takes a
//! handful of values, the low mantissa bytes are close to random. [`shuffle`] turns a
//! buffer of `n` elements of `size` bytes into `size` planes of `n` bytes each, so that a
//! coder can treat each plane on its own; [`unshuffle`] puts the bytes back.
//!
//! What this crate is: a pure permutation of bytes for element sizes 1, 2, 4 and 8
//! ([`ElementSize`]), over any byte length. A tail that is not a whole element is copied
//! as is, as Blosc does. A scalar reference ([`scalar`]) is kept forever, and the default
//! entry points use a chunked fast path that is property-tested against it.
//!
//! What it is not: a compressor, and not aware of floating point. Bit-level transforms
//! (moving the sign bit) live in `compressme-blockstore`.
//!
//! # Example
//! ```
//! use compressme_shuffle::{shuffle, unshuffle, ElementSize};
//!
//! let values = [1.0f32, -2.5, 3.25];
//! let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
//! let planes = shuffle(ElementSize::Four, &bytes);
//! // plane 3 holds the most significant byte (sign and top exponent bits) of each value
//! assert_eq!(&planes[9..12], &[0x3f, 0xc0, 0x40]);
//! assert_eq!(unshuffle(ElementSize::Four, &planes), bytes);
//! ```
#![forbid(unsafe_code)]
#![deny(missing_docs)]

use std::fmt;

/// The size in bytes of one element; the number of byte planes a shuffle makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ElementSize {
    /// 1 byte (`u8`, `i8`): shuffling is a copy.
    One,
    /// 2 bytes (`f16`, `bf16`).
    Two,
    /// 4 bytes (`f32`).
    Four,
    /// 8 bytes (`f64`).
    Eight,
}

impl ElementSize {
    /// The element size in bytes.
    #[must_use]
    pub const fn bytes(self) -> usize {
        match self {
            Self::One => 1,
            Self::Two => 2,
            Self::Four => 4,
            Self::Eight => 8,
        }
    }
}

impl TryFrom<usize> for ElementSize {
    type Error = ShuffleError;

    fn try_from(value: usize) -> Result<Self, Self::Error> {
        match value {
            1 => Ok(Self::One),
            2 => Ok(Self::Two),
            4 => Ok(Self::Four),
            8 => Ok(Self::Eight),
            other => Err(ShuffleError::UnsupportedElementSize(other)),
        }
    }
}

/// What can go wrong: only caller mistakes, never data.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ShuffleError {
    /// The element size is not 1, 2, 4 or 8.
    UnsupportedElementSize(usize),
    /// Source and destination lengths differ.
    LengthMismatch {
        /// Bytes in the source.
        src: usize,
        /// Bytes in the destination.
        dst: usize,
    },
}

impl fmt::Display for ShuffleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::UnsupportedElementSize(n) => {
                write!(
                    f,
                    "element size {n} is not supported (expected 1, 2, 4 or 8)"
                )
            }
            Self::LengthMismatch { src, dst } => {
                write!(f, "source has {src} bytes but destination has {dst}")
            }
        }
    }
}

impl std::error::Error for ShuffleError {}

/// Shuffles `src` into a new buffer of the same length.
#[must_use]
pub fn shuffle(size: ElementSize, src: &[u8]) -> Vec<u8> {
    let mut dst = vec![0u8; src.len()];
    fast::shuffle(size, src, &mut dst);
    dst
}

/// Unshuffles `src` (as made by [`shuffle`]) into a new buffer of the same length.
#[must_use]
pub fn unshuffle(size: ElementSize, src: &[u8]) -> Vec<u8> {
    let mut dst = vec![0u8; src.len()];
    fast::unshuffle(size, src, &mut dst);
    dst
}

/// Shuffles `src` into `dst`, which must have the same length.
///
/// # Errors
/// [`ShuffleError::LengthMismatch`] when the lengths differ; `dst` is then untouched.
pub fn shuffle_into(size: ElementSize, src: &[u8], dst: &mut [u8]) -> Result<(), ShuffleError> {
    check_len(src, dst)?;
    fast::shuffle(size, src, dst);
    Ok(())
}

/// Unshuffles `src` into `dst`, which must have the same length.
///
/// # Errors
/// [`ShuffleError::LengthMismatch`] when the lengths differ; `dst` is then untouched.
pub fn unshuffle_into(size: ElementSize, src: &[u8], dst: &mut [u8]) -> Result<(), ShuffleError> {
    check_len(src, dst)?;
    fast::unshuffle(size, src, dst);
    Ok(())
}

fn check_len(src: &[u8], dst: &[u8]) -> Result<(), ShuffleError> {
    if src.len() == dst.len() {
        Ok(())
    } else {
        Err(ShuffleError::LengthMismatch {
            src: src.len(),
            dst: dst.len(),
        })
    }
}

/// The scalar reference implementation, kept forever as the definition of the permutation.
///
/// Plane `k` of the output holds byte `k` of every whole element, in element order; the
/// bytes after the last whole element are copied unchanged to the end.
pub mod scalar {
    use super::{ElementSize, ShuffleError, check_len};

    /// Reference shuffle: one byte at a time.
    ///
    /// # Errors
    /// [`ShuffleError::LengthMismatch`] when the lengths differ.
    pub fn shuffle_into(size: ElementSize, src: &[u8], dst: &mut [u8]) -> Result<(), ShuffleError> {
        check_len(src, dst)?;
        let s = size.bytes();
        let n = src.len() / s;
        for (i, element) in src.chunks_exact(s).enumerate() {
            for (k, &byte) in element.iter().enumerate() {
                dst[k * n + i] = byte;
            }
        }
        dst[n * s..].copy_from_slice(&src[n * s..]);
        Ok(())
    }

    /// Reference unshuffle: one byte at a time.
    ///
    /// # Errors
    /// [`ShuffleError::LengthMismatch`] when the lengths differ.
    pub fn unshuffle_into(
        size: ElementSize,
        src: &[u8],
        dst: &mut [u8],
    ) -> Result<(), ShuffleError> {
        check_len(src, dst)?;
        let s = size.bytes();
        let n = src.len() / s;
        for (i, element) in dst.chunks_exact_mut(s).enumerate() {
            for (k, byte) in element.iter_mut().enumerate() {
                *byte = src[k * n + i];
            }
        }
        dst[n * s..].copy_from_slice(&src[n * s..]);
        Ok(())
    }
}

/// The fast path: fixed-size chunks of `LANES` elements with compile-time strides, which
/// LLVM turns into vector shuffles. Safe code only; lengths are checked by the callers.
mod fast {
    use super::ElementSize;

    /// Elements handled per inner step; 16 keeps every plane write a whole 16-byte vector.
    const LANES: usize = 16;

    pub(super) fn shuffle(size: ElementSize, src: &[u8], dst: &mut [u8]) {
        match size {
            ElementSize::One => dst.copy_from_slice(src),
            ElementSize::Two => shuffle_n::<2>(src, dst),
            ElementSize::Four => shuffle_n::<4>(src, dst),
            ElementSize::Eight => shuffle_n::<8>(src, dst),
        }
    }

    pub(super) fn unshuffle(size: ElementSize, src: &[u8], dst: &mut [u8]) {
        match size {
            ElementSize::One => dst.copy_from_slice(src),
            ElementSize::Two => unshuffle_n::<2>(src, dst),
            ElementSize::Four => unshuffle_n::<4>(src, dst),
            ElementSize::Eight => unshuffle_n::<8>(src, dst),
        }
    }

    fn shuffle_n<const N: usize>(src: &[u8], dst: &mut [u8]) {
        let n = src.len() / N;
        let (body, tail) = dst.split_at_mut(n * N);
        tail.copy_from_slice(&src[n * N..]);
        let mut planes: [&mut [u8]; N] = split_planes::<N>(body, n);
        let whole = n / LANES * LANES;
        let (src_body, src_rest) = src[..n * N].split_at(whole * N);
        for (c, chunk) in src_body.chunks_exact(LANES * N).enumerate() {
            for (k, plane) in planes.iter_mut().enumerate() {
                let out: &mut [u8; LANES] = (&mut plane[c * LANES..(c + 1) * LANES])
                    .try_into()
                    .unwrap_or_else(|_| unreachable!("plane chunk has LANES bytes"));
                for (j, o) in out.iter_mut().enumerate() {
                    *o = chunk[j * N + k];
                }
            }
        }
        for (i, element) in src_rest.chunks_exact(N).enumerate() {
            for (k, plane) in planes.iter_mut().enumerate() {
                plane[whole + i] = element[k];
            }
        }
    }

    fn unshuffle_n<const N: usize>(src: &[u8], dst: &mut [u8]) {
        let n = src.len() / N;
        let (body, tail) = dst.split_at_mut(n * N);
        tail.copy_from_slice(&src[n * N..]);
        let planes: [&[u8]; N] = std::array::from_fn(|k| &src[k * n..(k + 1) * n]);
        let whole = n / LANES * LANES;
        let (dst_body, dst_rest) = body.split_at_mut(whole * N);
        for (c, chunk) in dst_body.chunks_exact_mut(LANES * N).enumerate() {
            let ins: [&[u8; LANES]; N] = std::array::from_fn(|k| {
                (&planes[k][c * LANES..(c + 1) * LANES])
                    .try_into()
                    .unwrap_or_else(|_| unreachable!("plane chunk has LANES bytes"))
            });
            for (j, element) in chunk.chunks_exact_mut(N).enumerate() {
                for (k, byte) in element.iter_mut().enumerate() {
                    *byte = ins[k][j];
                }
            }
        }
        for (i, element) in dst_rest.chunks_exact_mut(N).enumerate() {
            for (k, byte) in element.iter_mut().enumerate() {
                *byte = planes[k][whole + i];
            }
        }
    }

    fn split_planes<const N: usize>(body: &mut [u8], n: usize) -> [&mut [u8]; N] {
        let mut rest = body;
        std::array::from_fn(|_| {
            let (plane, tail) = std::mem::take(&mut rest).split_at_mut(n);
            rest = tail;
            plane
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn element_size() -> impl Strategy<Value = ElementSize> {
        prop_oneof![
            Just(ElementSize::One),
            Just(ElementSize::Two),
            Just(ElementSize::Four),
            Just(ElementSize::Eight),
        ]
    }

    fn bytes() -> impl Strategy<Value = Vec<u8>> {
        prop::collection::vec(any::<u8>(), 0..1100)
    }

    proptest! {
        #[test]
        fn roundtrip(size in element_size(), src in bytes()) {
            prop_assert_eq!(unshuffle(size, &shuffle(size, &src)), src);
        }

        #[test]
        fn shuffle_matches_scalar(size in element_size(), src in bytes()) {
            let mut want = vec![0u8; src.len()];
            scalar::shuffle_into(size, &src, &mut want).unwrap();
            prop_assert_eq!(shuffle(size, &src), want);
        }

        #[test]
        fn unshuffle_matches_scalar(size in element_size(), src in bytes()) {
            let mut want = vec![0u8; src.len()];
            scalar::unshuffle_into(size, &src, &mut want).unwrap();
            prop_assert_eq!(unshuffle(size, &src), want);
        }
    }

    #[test]
    fn planes_and_tail_are_where_the_spec_says() {
        // 2 whole f32 elements and a 3-byte tail
        let src = [0, 1, 2, 3, 10, 11, 12, 13, 20, 21, 22];
        assert_eq!(
            shuffle(ElementSize::Four, &src),
            [0, 10, 1, 11, 2, 12, 3, 13, 20, 21, 22]
        );
    }

    #[test]
    fn length_mismatch_is_an_error_and_leaves_dst_alone() {
        let mut dst = [7u8; 3];
        let err = shuffle_into(ElementSize::Two, &[1, 2, 3, 4], &mut dst).unwrap_err();
        assert_eq!(err, ShuffleError::LengthMismatch { src: 4, dst: 3 });
        assert_eq!(err.to_string(), "source has 4 bytes but destination has 3");
        assert_eq!(dst, [7; 3]);
        assert!(matches!(
            unshuffle_into(ElementSize::Eight, &[0; 8], &mut []),
            Err(ShuffleError::LengthMismatch { src: 8, dst: 0 })
        ));
    }

    #[test]
    fn element_size_from_usize() {
        assert_eq!(ElementSize::try_from(4), Ok(ElementSize::Four));
        assert_eq!(
            ElementSize::try_from(3),
            Err(ShuffleError::UnsupportedElementSize(3))
        );
        for s in [1, 2, 4, 8] {
            assert_eq!(ElementSize::try_from(s).map(ElementSize::bytes), Ok(s));
        }
    }
}
