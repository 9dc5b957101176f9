//! The serialized layout (version 1), as specified in `docs/FORMAT.md`, and its checks.
//!
//! Bytes handed to [`BlockStore::from_bytes`] are treated as hostile: every size is checked
//! against what is actually present before anything is allocated from it, block lengths
//! must tile the payload exactly, and every block is verified against its digest.
//! Every size comes from the bytes, so every operation on one is checked
//! (`arithmetic_side_effects` is denied here).
#![deny(
    clippy::indexing_slicing,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::arithmetic_side_effects
)]

use rayon::prelude::*;
use sha2::{Digest, Sha256};

use crate::encode::{decoders_for, num_blocks};
use crate::error::hex;
use crate::huffman::CodeLengths;
use crate::{BlockStore, Error, Result, StoredBytes, ValueKind};

/// First bytes of every serialized store.
pub const MAGIC: [u8; 8] = *b"CMBLOCKS";
/// The version a store without rANS tables is written as; it reads versions listed in
/// `SUPPORTED`.
pub(crate) const VERSION: u16 = 1;
/// The version a store with a plane of rANS tables is written as: each plane's tables
/// are preceded by a byte saying which kind they are.
pub(crate) const VERSION_RANS: u16 = 2;
const SUPPORTED: &str = "1, 2";
/// Table kinds (version 2).
const TABLES_HUFFMAN: u8 = 0;
const TABLES_RANS: u8 = 1;
/// Fixed part of the header.
pub(crate) const FIXED_HEADER: usize = 32;
/// The SHA-256 over everything before the payload.
const INDEX_DIGEST: u64 = 32;
/// Largest raw block (rows x row bytes) accepted: 256 MiB.
pub(crate) const MAX_BLOCK_BYTES: usize = 1 << 28;
/// Most shared tables per plane.
pub(crate) const MAX_TABLES: usize = 16;
/// Bytes per shared table.
const TABLE_BYTES: usize = 128;

/// Plane mode tags (wire values; retired tags leave gaps).
pub(crate) const MODE_RAW: u8 = 0;
pub(crate) const MODE_CONST: u8 = 1;
pub(crate) const MODE_ZSTD: u8 = 2;
/// `MODE_HUFFMAN + t` codes a plane with shared table `t` (0..16) as one bit stream.
pub(crate) const MODE_HUFFMAN: u8 = 16;
/// `MODE_HUFFMAN_ROWS + t` codes each row of the plane as its own byte-aligned stream with
/// table `t`, after a table of u16 row lengths, so a lookup decodes only the rows it asks for.
pub(crate) const MODE_HUFFMAN_ROWS: u8 = 32;
/// `MODE_RANS + t` codes a plane with shared rANS table `t` (version 2).
pub(crate) const MODE_RANS: u8 = 48;

pub(crate) fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Bytes [`put_varint`] writes for `v`.
pub(crate) const fn varint_len(mut v: u64) -> usize {
    let mut n: usize = 1;
    while v >= 0x80 {
        v >>= 7;
        n = n.saturating_add(1);
    }
    n
}

/// Reads a LEB128 value of at most 4 bytes (< 2^28, more than any block holds), in its
/// minimal encoding (no final zero byte after a continuation).
pub(crate) fn get_varint(bytes: &[u8], pos: &mut usize) -> Result<usize> {
    let mut v = 0usize;
    for (i, shift) in [0u32, 7, 14, 21].into_iter().enumerate() {
        let b = *bytes
            .get(*pos)
            .ok_or_else(|| Error::Malformed("varint runs past the block".into()))?;
        // `get` succeeded, so `*pos < bytes.len()`
        *pos = pos.saturating_add(1);
        v |= usize::from(b & 0x7f).wrapping_shl(shift);
        if b & 0x80 == 0 {
            // minimal: a last byte of zero after others adds nothing
            if i > 0 && b == 0 {
                return Err(Error::Malformed("LEB128 length is not minimal".into()));
            }
            return Ok(v);
        }
    }
    Err(Error::Malformed("varint longer than 4 bytes".into()))
}

pub(crate) fn stored_bytes(s: &BlockStore) -> StoredBytes {
    let planes = s.tables.len() as u64;
    StoredBytes {
        header: (FIXED_HEADER as u64)
            .saturating_add(planes)
            .saturating_add(INDEX_DIGEST),
        tables: s
            .tables
            .iter()
            .map(|t| t.len().saturating_mul(TABLE_BYTES) as u64)
            .chain(s.rans.iter().flatten().map(|t| t.serialized_len() as u64))
            .fold(0, u64::saturating_add)
            // version 2: a kind byte a plane
            .saturating_add(if s.has_rans() { planes } else { 0 }),
        offsets: (s.digests.len() as u64).saturating_mul(4),
        digests: (s.digests.len() as u64).saturating_mul(32),
        payload: s.payload.len() as u64,
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        let (slice, end) = end
            .and_then(|e| Some((self.bytes.get(self.pos..e)?, e)))
            .ok_or_else(|| {
                Error::Malformed(format!(
                    "truncated: {what} needs {n} bytes, {} left",
                    self.left()
                ))
            })?;
        self.pos = end;
        Ok(slice)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }

    fn left(&self) -> usize {
        self.bytes.len().saturating_sub(self.pos)
    }
}

impl BlockStore {
    /// Serializes the store (deterministic: the same store gives the same bytes): the
    /// [index](BlockStore::index_bytes), then the [payload](BlockStore::payload).
    #[must_use]
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = self.index_bytes();
        out.extend_from_slice(self.payload.as_slice());
        out
    }

    /// The coded blocks, back to back: what follows the index in the serialized form.
    #[must_use]
    pub fn payload(&self) -> &[u8] {
        self.payload.as_slice()
    }

    /// Everything the serialized form holds before the payload: header, tables, block
    /// lengths, block digests and the index digest (so a writer can stream a store
    /// without copying its payload).
    #[must_use]
    pub fn index_bytes(&self) -> Vec<u8> {
        let mut out = self.index_prefix();
        out.extend_from_slice(&self.index_digest);
        out
    }

    /// The index digest: the SHA-256 of everything the serialized form holds before it
    /// (header, tables, block lengths and block digests), so it seals every block digest.
    /// A serialized store ends its index with it; an artifact's recipe (version 2) records
    /// it instead of each block's digest.
    #[must_use]
    pub fn index_digest(&self) -> [u8; 32] {
        self.index_digest
    }

    /// The serialized index up to (not including) its digest.
    pub(crate) fn index_prefix(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&MAGIC);
        let v2 = self.has_rans();
        out.extend_from_slice(&if v2 { VERSION_RANS } else { VERSION }.to_le_bytes());
        out.push(self.kind.tag());
        out.push(0); // flags: none defined in versions 1 and 2
        out.extend_from_slice(&(self.block_rows as u32).to_le_bytes());
        out.extend_from_slice(&self.rows.to_le_bytes());
        out.extend_from_slice(&(self.row_bytes as u64).to_le_bytes());
        for (plane, rans) in self.tables.iter().zip(&self.rans) {
            if rans.is_empty() {
                if v2 {
                    out.push(TABLES_HUFFMAN);
                }
                out.push(plane.len() as u8);
                for t in plane {
                    out.extend_from_slice(&t.to_nibbles());
                }
            } else {
                out.push(TABLES_RANS);
                out.push(rans.len() as u8);
                for t in rans {
                    t.to_bytes(&mut out);
                }
            }
        }
        for w in self.offsets.windows(2) {
            if let [a, b] = w {
                out.extend_from_slice(&(b.saturating_sub(*a) as u32).to_le_bytes());
            }
        }
        for d in &self.digests {
            out.extend_from_slice(d);
        }
        out
    }

    /// Parses a serialized store and verifies every block (on all cores). The payload is
    /// copied; [`BlockStore::from_shared`] reads it in place.
    ///
    /// # Errors
    /// [`Error::Malformed`] for anything that does not follow the layout (truncation,
    /// bad tags, block lengths that do not tile the payload, trailing bytes),
    /// [`Error::UnsupportedVersion`], and [`Error::ChecksumMismatch`] naming the block.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let store = Self::parse(std::sync::Arc::new(bytes.to_vec()))?;
        store.verify_all()?;
        Ok(store)
    }

    /// Parses a serialized store that stays where it is (a memory map, a shared buffer):
    /// the index and its digest are checked now, as [`BlockStore::from_bytes`] does, and
    /// each block's digest every time the block is decoded ([`BlockStore::verify_on_decode`]
    /// is on), so every block is checked before its bytes are used and a caller that
    /// decodes a piece at a time hashes each block while it is in cache. Nothing is
    /// copied.
    ///
    /// # Errors
    /// As [`BlockStore::from_bytes`], except that a corrupt block is reported when it is
    /// decoded (or by [`BlockStore::verify_all`]).
    pub fn from_shared(bytes: crate::SharedBytes) -> Result<Self> {
        let mut store = Self::parse(bytes)?;
        store.lazy = true;
        Ok(store)
    }

    fn parse(owner: crate::SharedBytes) -> Result<Self> {
        let bytes: &[u8] = (*owner).as_ref();
        let mut r = Reader { bytes, pos: 0 };
        if r.array::<8>("magic")? != MAGIC {
            return Err(Error::Malformed("not a block store (bad magic)".into()));
        }
        let version = u16::from_le_bytes(r.array::<2>("version")?);
        if version != VERSION && version != VERSION_RANS {
            return Err(Error::UnsupportedVersion {
                found: version,
                supported: SUPPORTED,
            });
        }
        let [tag, flags] = r.array::<2>("kind and flags")?;
        let kind = ValueKind::from_tag(tag)
            .ok_or_else(|| Error::Malformed(format!("unknown value kind tag {tag}")))?;
        if flags != 0 {
            return Err(Error::Malformed(format!("unknown flags {flags:#04x}")));
        }
        let block_rows = u32::from_le_bytes(r.array::<4>("block rows")?) as usize;
        let rows = u64::from_le_bytes(r.array::<8>("rows")?);
        let row_bytes = u64::from_le_bytes(r.array::<8>("row bytes")?);
        let e = kind.element_size().bytes();
        let row_bytes = usize::try_from(row_bytes)
            .ok()
            .filter(|rb| rb.is_multiple_of(e))
            .ok_or_else(|| {
                Error::Malformed(format!(
                    "row of {row_bytes} bytes is not a whole number of {e}-byte elements"
                ))
            })?;
        if block_rows == 0
            || block_rows
                .checked_mul(row_bytes)
                .is_none_or(|b| b > MAX_BLOCK_BYTES)
        {
            return Err(Error::Malformed(format!(
                "block of {block_rows} rows of {row_bytes} bytes is out of range"
            )));
        }
        if usize::try_from(rows)
            .ok()
            .and_then(|r| r.checked_mul(row_bytes))
            .is_none()
        {
            return Err(Error::Malformed(format!(
                "{rows} rows of {row_bytes} bytes overflow"
            )));
        }
        let mut tables = Vec::with_capacity(e);
        let mut rans = Vec::with_capacity(e);
        for plane in 0..e {
            let kind = if version == VERSION_RANS {
                let [kind] = r.array::<1>("table kind")?;
                kind
            } else {
                TABLES_HUFFMAN
            };
            let [count] = r.array::<1>("table count")?;
            if usize::from(count) > MAX_TABLES {
                return Err(Error::Malformed(format!(
                    "plane {plane} has {count} tables (at most {MAX_TABLES})"
                )));
            }
            let mut ts = Vec::with_capacity(usize::from(count));
            let mut rs = Vec::with_capacity(usize::from(count));
            match kind {
                TABLES_HUFFMAN => {
                    for _ in 0..count {
                        ts.push(CodeLengths::from_nibbles(
                            r.take(TABLE_BYTES, "code table")?,
                        )?);
                    }
                }
                TABLES_RANS if count > 0 => {
                    for _ in 0..count {
                        rs.push(std::sync::Arc::new(crate::rans::Table::read(
                            r.bytes, &mut r.pos,
                        )?));
                    }
                }
                TABLES_RANS => {
                    return Err(Error::Malformed(format!(
                        "plane {plane} says rANS tables but has none"
                    )));
                }
                other => {
                    return Err(Error::Malformed(format!(
                        "plane {plane} has unknown table kind {other}"
                    )));
                }
            }
            tables.push(ts);
            rans.push(rs);
        }
        if version == VERSION_RANS && rans.iter().all(Vec::is_empty) {
            return Err(Error::Malformed(
                "version 2 store without rANS tables (written as version 1)".into(),
            ));
        }
        let nb = num_blocks(rows, block_rows);
        // cap before allocating: the index alone needs 36 bytes per block
        if nb
            .checked_mul(36)
            .and_then(|need| need.checked_add(32))
            .is_none_or(|need| need > r.left())
        {
            return Err(Error::Malformed(format!(
                "{nb} blocks need an index of {} bytes, {} left",
                nb.saturating_mul(36),
                r.left()
            )));
        }
        // block_rows x row_bytes <= MAX_BLOCK_BYTES and nb x 36 fit (both checked above)
        let max_block = block_rows
            .saturating_mul(row_bytes)
            .saturating_add(e.saturating_mul(8))
            .saturating_add(16);
        let mut offsets = Vec::with_capacity(nb.saturating_add(1));
        offsets.push(0usize);
        let lens = r.take(nb.saturating_mul(4), "block lengths")?;
        let mut end = 0usize;
        for (b, l) in lens.chunks_exact(4).enumerate() {
            let mut w = [0u8; 4];
            w.copy_from_slice(l);
            let l = u32::from_le_bytes(w) as usize;
            if l > max_block {
                return Err(Error::BadBlock {
                    block: b,
                    reason: format!("length {l} exceeds the largest possible {max_block}"),
                });
            }
            end = end
                .checked_add(l)
                .ok_or_else(|| Error::Malformed("block lengths overflow".into()))?;
            offsets.push(end);
        }
        let digests: Vec<[u8; 32]> = r
            .take(nb.saturating_mul(32), "digests")?
            .chunks_exact(32)
            .map(|d| {
                let mut a = [0u8; 32];
                a.copy_from_slice(d);
                a
            })
            .collect();
        let sealed = bytes.get(..r.pos).unwrap_or(&[]);
        let actual: [u8; 32] = Sha256::digest(sealed).into();
        let expected = r.array::<32>("index digest")?;
        if actual != expected {
            return Err(Error::IndexChecksumMismatch {
                expected: hex(&expected),
                actual: hex(&actual),
            });
        }
        if end != r.left() {
            return Err(Error::Malformed(format!(
                "block lengths add up to {end} bytes but the payload has {}",
                r.left()
            )));
        }
        let start = r.pos;
        r.take(end, "payload")?;
        let payload = crate::Payload::shared(owner.clone(), start, r.pos);
        let store = Self {
            kind,
            rows,
            row_bytes,
            block_rows,
            decoders: decoders_for(&tables),
            tables,
            rans,
            offsets,
            digests,
            index_digest: expected,
            payload,
            verify_on_decode: false,
            lazy: false,
        };
        Ok(store)
    }

    /// Whether a plane has rANS tables (the store is then version 2).
    pub(crate) fn has_rans(&self) -> bool {
        self.rans.iter().any(|r| !r.is_empty())
    }

    /// The coded bytes of one block.
    pub(crate) fn block_bytes(&self, block: usize) -> Result<&[u8]> {
        let (Some(&a), Some(&b)) = (
            self.offsets.get(block),
            self.offsets.get(block.saturating_add(1)),
        ) else {
            return Err(Error::Malformed(format!("block {block} does not exist")));
        };
        self.payload
            .as_slice()
            .get(a..b)
            .ok_or_else(|| Error::BadBlock {
                block,
                reason: "offsets outside the payload".into(),
            })
    }

    /// Checks one block against its SHA-256 digest.
    ///
    /// # Errors
    /// [`Error::ChecksumMismatch`] naming the block and both digests.
    pub fn verify_block(&self, block: usize) -> Result<()> {
        let bytes = self.block_bytes(block)?;
        self.check_digest(block, &Sha256::digest(bytes).into())
    }

    /// `actual` against block `block`'s recorded digest.
    fn check_digest(&self, block: usize, actual: &[u8; 32]) -> Result<()> {
        let expected = self
            .digests
            .get(block)
            .ok_or_else(|| Error::Malformed(format!("block {block} has no digest")))?;
        if actual == expected {
            Ok(())
        } else {
            Err(Error::ChecksumMismatch {
                block,
                expected: hex(expected),
                actual: hex(actual),
            })
        }
    }

    /// Checks every block against its digest, on all cores; reports the lowest failing block.
    ///
    /// # Errors
    /// [`Error::ChecksumMismatch`] for the first block (by index) that fails.
    pub fn verify_all(&self) -> Result<()> {
        self.verify_blocks(0..self.num_blocks())
    }

    /// Checks blocks `blocks` against their digests, on all cores, four blocks' digests
    /// computed at once (where the CPU has the SHA extensions, four messages in lockstep
    /// run about 1.8x as fast as one after another); reports the lowest failing block.
    ///
    /// # Errors
    /// [`Error::ChecksumMismatch`] for the first block (by index) that fails;
    /// [`Error::Malformed`] for a block that does not exist.
    pub fn verify_blocks(&self, blocks: std::ops::Range<usize>) -> Result<()> {
        let failures: Vec<Error> = (0..blocks.len().div_ceil(4))
            .into_par_iter()
            .flat_map_iter(|g| {
                let first = blocks.start.saturating_add(g.saturating_mul(4));
                self.verify_four(first..first.saturating_add(4).min(blocks.end))
            })
            .collect();
        failures.into_iter().next().map_or(Ok(()), Err)
    }

    /// Checks `blocks` (at most four) against their digests, hashed at once; the errors in
    /// block order.
    fn verify_four(&self, blocks: std::ops::Range<usize>) -> Vec<Error> {
        let bytes: Vec<Result<&[u8]>> = blocks.clone().map(|b| self.block_bytes(b)).collect();
        let found: Vec<&[u8]> = bytes
            .iter()
            .filter_map(|r| r.as_ref().ok().copied())
            .collect();
        let mut digests = crate::digest::sha256_many(&found).into_iter();
        blocks
            .zip(bytes)
            .filter_map(|(b, r)| match r {
                Err(e) => Some(e),
                Ok(_) => digests.next().and_then(|d| self.check_digest(b, &d).err()),
            })
            .collect()
    }

    /// Flips one payload byte (tests and corruption drills only).
    #[doc(hidden)]
    pub fn corrupt_payload_byte_for_tests(&mut self, index: usize) {
        let mut bytes = self.payload.as_slice().to_vec();
        if let Some(b) = bytes.get_mut(index) {
            *b ^= 0x5a;
        }
        self.payload = crate::Payload::owned(bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::get_varint;

    #[test]
    fn leb128_is_minimal_and_at_most_4_bytes() {
        let read = |b: &[u8]| get_varint(b, &mut 0);
        assert_eq!(read(&[0x00]).ok(), Some(0));
        assert_eq!(read(&[0x7f]).ok(), Some(127));
        assert_eq!(read(&[0x80, 0x01]).ok(), Some(128));
        assert_eq!(read(&[0xff, 0xff, 0xff, 0x7f]).ok(), Some((1 << 28) - 1));
        // the same values padded with zero groups are refused
        assert!(read(&[0x80, 0x00]).is_err());
        assert!(read(&[0xff, 0x80, 0x80, 0x00]).is_err());
        // five bytes, and a value that runs off the end
        assert!(read(&[0x80, 0x80, 0x80, 0x80, 0x01]).is_err());
        assert!(read(&[0x80]).is_err());
    }
}
