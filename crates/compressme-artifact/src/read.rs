//! Reading: [`Artifact::open`] (everything [`crate::validate`] checks, before any payload
//! is read), tensors as stored or decoded, each verified as it is read, and
//! [`Artifact::verify`], which streams large tensors a piece at a time, four side by side
//! so their whole-tensor digests run in lockstep (`lanes`). Sizes come from the
//! file: every operation on one is checked (`arithmetic_side_effects` is denied).
#![deny(clippy::arithmetic_side_effects)]

use std::path::Path;
use std::sync::Arc;

use sha2::Digest;

use compressme_blockstore::BlockStore;
use compressme_quant::{Format, Packed};

use crate::convert::{from_f32, to_f32, value_kind};
use crate::recipe::{Recipe, StorageRecipe, TensorRecipe, hex};
use crate::st::{Dtype, Entry, Limits, Mapped, SafetensorsFile};
use crate::validate::{
    SourceHeader, blocks_name, check_decoded, codes_name, decoded_bytes, mins_name, payload_names,
    scales_name,
};
use crate::{Error, Result};

mod lanes;

/// What a verification checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct Summary {
    /// Original tensors.
    pub tensors: usize,
    /// Of them, stored losslessly in blocks.
    pub lossless: usize,
    /// Of them, quantized.
    pub quantized: usize,
    /// Of them, dense.
    pub dense: usize,
    /// Blocks whose digest was checked.
    pub blocks: usize,
    /// Bytes the originals take.
    pub dense_bytes: u64,
    /// Bytes of the payload tensors.
    pub stored_bytes: u64,
    /// Bytes of the file.
    pub file_bytes: u64,
}

/// A tensor as the artifact stores it.
#[derive(Debug)]
pub enum Stored {
    /// The original bytes.
    Dense(Vec<u8>),
    /// Verified row blocks.
    Lossless(BlockStore),
    /// Packed codes and scales.
    Quantized(Packed),
}

/// An open artifact: header, recipe and payload checked against each other before any
/// payload is read.
#[derive(Debug)]
pub struct Artifact {
    file: SafetensorsFile,
    recipe: Recipe,
    file_bytes: u64,
    source: Option<SourceHeader>,
}

impl Artifact {
    /// Opens an artifact and checks, before reading any payload: the safetensors header
    /// (every size against `limits`), the format name and version, the recipe's fields,
    /// and that the recipe and the payload tensors match one to one (names, dtypes,
    /// lengths, block counts).
    ///
    /// # Errors
    /// [`Error::NotSafetensors`], [`Error::TooLarge`], [`Error::NotArtifact`],
    /// [`Error::UnsupportedVersion`], [`Error::Recipe`] naming the tensor.
    pub fn open(path: &Path, limits: &Limits) -> Result<Self> {
        let file = SafetensorsFile::open(path, limits)?;
        let file_bytes = std::fs::metadata(path)
            .map_err(|source| Error::Io {
                path: path.to_path_buf(),
                source,
            })?
            .len();
        let (recipe, source) = crate::validate::recipe(path, &file, limits)?;
        Ok(Self {
            file,
            recipe,
            file_bytes,
            source,
        })
    }

    /// Version 3: the source file's header text (after its length prefix), checked
    /// against the recipe's digest and tensors at open; [`crate::unpack`] writes it and
    /// lays the tensors out at its offsets. `None` before version 3.
    #[must_use]
    pub fn source_header(&self) -> Option<&[u8]> {
        self.source.as_ref()?;
        self.file
            .metadata()
            .get(crate::recipe::SOURCE_HEADER_KEY)
            .map(String::as_bytes)
    }

    /// The source header's tensors, by offset (see [`Artifact::source_header`]).
    pub(crate) fn source_entries(&self) -> Option<&[Entry]> {
        self.source.as_ref().map(|s| s.entries.as_slice())
    }

    /// The recipe.
    #[must_use]
    pub fn recipe(&self) -> &Recipe {
        &self.recipe
    }

    /// The file's payload tensors.
    #[must_use]
    pub fn entries(&self) -> &[Entry] {
        self.file.entries()
    }

    /// Bytes of the file.
    #[must_use]
    pub fn file_bytes(&self) -> u64 {
        self.file_bytes
    }

    /// The recipe entry of `name`.
    #[must_use]
    pub fn tensor(&self, name: &str) -> Option<&TensorRecipe> {
        self.recipe.tensors.iter().find(|t| t.name == name)
    }

    /// Bytes of the payload tensors that store `t`.
    #[must_use]
    pub fn stored_bytes(&self, t: &TensorRecipe) -> u64 {
        payload_names(t)
            .iter()
            .filter_map(|n| self.file.entry(n))
            .map(Entry::len)
            .fold(0, u64::saturating_add)
    }

    /// What tensor `t` decodes to and what its payload stores, in bytes: their ratio is
    /// what [`Limits::max_expansion`] bounds (beyond about 20x only constant byte planes
    /// get; `inspect` warns there).
    #[must_use]
    pub fn expansion(&self, t: &TensorRecipe) -> (u64, u64) {
        (decoded_bytes(t).unwrap_or(u64::MAX), self.stored_bytes(t))
    }

    /// Whether `limits`' decoded-size bounds accept this artifact (what
    /// [`Artifact::open`] checks), without opening it again: `inspect` opens without
    /// them and reports what they would do.
    ///
    /// # Errors
    /// [`Error::TooLarge`], [`Error::Expansion`].
    pub fn check_limits(&self, limits: &Limits) -> Result<()> {
        check_decoded(self.file.path(), &self.file, &self.recipe, limits)
    }

    fn read_entry(&self, name: &str) -> Result<Vec<u8>> {
        Ok(self.map_entry(name)?.into_vec())
    }

    fn map_entry(&self, name: &str) -> Result<Mapped> {
        let e = self
            .file
            .entry(name)
            .ok_or_else(|| Error::MissingTensor(name.into()))?;
        self.file.map(e)
    }

    /// Payload `name` as f32 values (empty when the format has none), its stored bytes
    /// fed to `digest`.
    fn read_floats(&self, name: &str, digest: &mut sha2::Sha256) -> Result<Vec<f32>> {
        let Some(e) = self.file.entry(name) else {
            return Ok(Vec::new());
        };
        let bytes = self.file.map(e)?;
        digest.update(&bytes);
        Ok(to_f32(e.dtype, &bytes))
    }

    /// Reads tensor `name` as stored, verified: dense bytes against the recipe's
    /// whole-tensor SHA-256; lossless blocks against their digests and against the
    /// recipe's block digests (the same block size and count); packed buffers against
    /// the recipe's payload digest and their format.
    ///
    /// # Errors
    /// [`Error::MissingTensor`], [`Error::Digest`] naming the block, [`Error::Blocks`],
    /// [`Error::Quant`], [`Error::Io`].
    pub fn read_stored(&self, name: &str) -> Result<Stored> {
        match self.open_stored(name)? {
            Stored::Lossless(store) => {
                store.verify_all().map_err(|source| Error::Blocks {
                    tensor: name.into(),
                    source,
                })?;
                Ok(Stored::Lossless(store))
            }
            s => Ok(s),
        }
    }

    /// [`Artifact::read_stored`], except that a lossless tensor's blocks stay in the
    /// file's memory map and are checked each time one is decoded
    /// ([`BlockStore::from_shared`]), not all at once now: for readers that decode every
    /// block anyway (`verify`, `unpack`), so each block is hashed while it is in cache.
    fn open_stored(&self, name: &str) -> Result<Stored> {
        let t = self
            .tensor(name)
            .ok_or_else(|| Error::MissingTensor(name.into()))?;
        match &t.storage {
            StorageRecipe::Dense => {
                // a dense tensor's only seal is its whole-tensor digest: checked on every
                // read, as lossless blocks are
                let bytes = self.read_entry(name)?;
                self.check_whole(name, &bytes)?;
                Ok(Stored::Dense(bytes))
            }
            StorageRecipe::Lossless {
                rows,
                row_bytes,
                block_rows,
                block_sha256,
                index_sha256,
                ..
            } => {
                let v1 = self.recipe.version == 1;
                let blob = self.map_entry(&blocks_name(name))?;
                let store =
                    BlockStore::from_shared(Arc::new(blob)).map_err(|source| Error::Blocks {
                        tensor: name.into(),
                        source,
                    })?;
                let dtype = Dtype::parse(&t.dtype).unwrap_or(Dtype::U8);
                // version 1: every recipe digest pairs with one block (the same block size
                // and count); version 2: the index digest seals them all
                if store.rows() != *rows
                    || store.row_bytes() as u64 != *row_bytes
                    || store.kind() != value_kind(dtype)
                    || store.block_rows() != *block_rows
                    || (v1 && store.num_blocks() != block_sha256.len())
                {
                    return Err(Error::Invalid {
                        tensor: name.into(),
                        reason: "block store shape or kind differs from the recipe".into(),
                    });
                }
                if v1 {
                    let digests = store.block_digests().iter().zip(block_sha256);
                    for (i, (d, want)) in digests.enumerate() {
                        if hex(d) != *want {
                            return Err(Error::Digest {
                                tensor: name.into(),
                                what: format!("block {i} (recipe)"),
                            });
                        }
                    }
                } else if index_sha256.as_deref() != Some(hex(&store.index_digest()).as_str()) {
                    return Err(Error::Digest {
                        tensor: name.into(),
                        what: "the block store's index (recipe)".into(),
                    });
                }
                Ok(Stored::Lossless(store))
            }
            StorageRecipe::Quant {
                format,
                rows,
                cols,
                payload_sha256,
            } => {
                let format = Format::parse(format).map_err(|source| Error::Quant {
                    tensor: name.into(),
                    source,
                })?;
                let mut digest = sha2::Sha256::new();
                let codes = self.read_entry(&codes_name(name))?;
                digest.update(&codes);
                let scales = self.read_floats(&scales_name(name), &mut digest)?;
                let mins = self.read_floats(&mins_name(name), &mut digest)?;
                let d: [u8; 32] = digest.finalize().into();
                if hex(&d) != *payload_sha256 {
                    return Err(Error::Digest {
                        tensor: name.into(),
                        what: "packed codes and scales".into(),
                    });
                }
                let packed = Packed::from_parts(format, *rows, *cols, codes, scales, mins)
                    .map_err(|source| Error::Quant {
                        tensor: name.into(),
                        source,
                    })?;
                Ok(Stored::Quantized(packed))
            }
        }
    }

    /// The original bytes of a tensor stored dense or lossless (checked against the
    /// recipe's whole-tensor SHA-256), or the dequantized values in the original dtype
    /// for a quantized one (`lossless` false).
    ///
    /// # Errors
    /// As [`Artifact::read_stored`], and [`Error::Digest`] for a whole-tensor mismatch.
    pub fn read_tensor(&self, name: &str) -> Result<(Vec<u8>, bool)> {
        let lossless = matches!(
            self.tensor(name).map(|t| &t.storage),
            Some(StorageRecipe::Lossless { .. })
        );
        let (bytes, exact) = self.decode_tensor(name)?;
        // dense bytes were checked as they were read
        if exact && lossless {
            self.check_whole(name, &bytes)?;
        }
        Ok((bytes, exact))
    }

    /// Checks bytes against the recipe's whole-tensor digest of `name` (XXH3-128 for a
    /// lossless tensor from version 4 on, SHA-256 otherwise).
    fn check_whole(&self, name: &str, bytes: &[u8]) -> Result<()> {
        let t = self.tensor(name);
        let kind = t.and_then(TensorRecipe::whole_digest);
        if !t.is_some_and(|t| t.whole_is(&kind.unwrap_or_default().hex_of(bytes))) {
            return Err(Error::Digest {
                tensor: name.into(),
                what: "whole tensor".into(),
            });
        }
        Ok(())
    }

    /// [`Artifact::read_tensor`] without the whole-tensor check (block digests are still
    /// checked): the caller checks it, e.g. while writing the bytes out.
    fn decode_tensor(&self, name: &str) -> Result<(Vec<u8>, bool)> {
        let t = self
            .tensor(name)
            .ok_or_else(|| Error::MissingTensor(name.into()))?;
        let dtype = Dtype::parse(&t.dtype).unwrap_or(Dtype::U8);
        let (bytes, exact) = match self.open_stored(name)? {
            Stored::Dense(b) => (b, true),
            Stored::Lossless(store) => (
                store.decode_all().map_err(|source| Error::Blocks {
                    tensor: name.into(),
                    source,
                })?,
                true,
            ),
            Stored::Quantized(p) => {
                let n = p
                    .rows()
                    .checked_mul(p.cols())
                    .ok_or_else(|| Error::Invalid {
                        tensor: name.into(),
                        reason: "rows x cols overflows".into(),
                    })?;
                let mut v = vec![0f32; n];
                p.dequantize_into(&mut v).map_err(|source| Error::Quant {
                    tensor: name.into(),
                    source,
                })?;
                (from_f32(dtype, &v), false)
            }
        };
        Ok((bytes, exact))
    }

    /// Calls `sink` with a quantized tensor's dequantized values in its dtype, in order,
    /// about [`STREAM_PIECE`] bytes of f32 at a time, with each piece's offset in the
    /// tensor (its packed buffers checked against their payload digest first); the
    /// tensor must come to exactly the recipe's size. Dense and lossless tensors are read
    /// through [`Artifact::stream_digested`], which checks their whole-tensor digests.
    ///
    /// # Errors
    /// As [`Artifact::read_stored`], a size that differs from the recipe's, and `sink`'s.
    pub(crate) fn stream_dequantized(
        &self,
        t: &TensorRecipe,
        mut sink: impl FnMut(u64, &[u8]) -> Result<()>,
    ) -> Result<()> {
        let name = &t.name;
        let want = decoded_bytes(t).unwrap_or(u64::MAX);
        let dtype = Dtype::parse(&t.dtype).unwrap_or(Dtype::U8);
        let Stored::Quantized(p) = self.open_stored(name)? else {
            return Err(Error::Invalid {
                tensor: name.clone(),
                reason: "not a quantized tensor".into(),
            });
        };
        let cols = p.cols().max(1);
        let per = STREAM_PIECE
            .checked_div(cols.saturating_mul(4))
            .unwrap_or(1)
            .max(1);
        let mut v = Vec::new();
        let (mut r0, mut got) = (0, 0u64);
        while r0 < p.rows() {
            let r1 = r0.saturating_add(per).min(p.rows());
            // r1 - r0 rows of a packed tensor whose rows x cols was checked
            v.resize(r1.saturating_sub(r0).saturating_mul(p.cols()), 0f32);
            p.dequantize_range_into(r0, &mut v)
                .map_err(|source| Error::Quant {
                    tensor: name.clone(),
                    source,
                })?;
            let piece = from_f32(dtype, &v);
            let at = got;
            got = got.saturating_add(piece.len() as u64);
            if got > want {
                return Err(Error::Invalid {
                    tensor: name.clone(),
                    reason: format!("decodes to more than {want} bytes"),
                });
            }
            sink(at, &piece)?;
            r0 = r1;
        }
        if got != want {
            return Err(Error::Invalid {
                tensor: name.clone(),
                reason: format!("decoded {got} bytes, expected {want}"),
            });
        }
        Ok(())
    }

    /// Verifies every tensor: each block's digest (and the recipe's copy of it), the
    /// whole-tensor SHA-256 of what dense and lossless tensors decode to, and every
    /// packed tensor's buffers. Decodes a tensor over [`STREAM_PIECE`] bytes a piece at a
    /// time, up to four such tensors side by side, and smaller ones whole, four at a time,
    /// so the whole-tensor digests are taken four in lockstep; memory stays bounded
    /// (`lanes::LANES_BYTES` of stored bytes in the lanes, [`STREAM_BYTES`] for the small
    /// ones); under the limits the artifact was opened with.
    ///
    /// # Errors
    /// The first failure, naming the tensor (and block).
    pub fn verify(&self) -> Result<Summary> {
        self.check(true, |_, _| {})
    }

    /// [`Artifact::verify`], calling `progress` with each tensor's name and decoded bytes
    /// once it has been checked (on any of rayon's threads, one call at a time; tensors
    /// finish out of the recipe's order), for a progress bar.
    ///
    /// # Errors
    /// As [`Artifact::verify`].
    pub fn verify_with(&self, progress: impl FnMut(&str, u64) + Send) -> Result<Summary> {
        self.check(true, progress)
    }

    /// Checks every stored byte against its digest without decoding: each block store's
    /// block digests and index digest (and the recipe's record of them), dense tensors'
    /// SHA-256, packed buffers' payload digest and layout. What [`Writer::finish`] runs on
    /// the file it wrote: the encoder already decoded every block and compared it with
    /// the input, so the whole-tensor digests (taken from the input) hold for what the
    /// checked blocks decode to. [`Artifact::verify`] decodes and hashes them again.
    ///
    /// Runs on [`crate::pipeline::ordered_light`], whose calling thread waits on its
    /// results: call it from outside rayon's pool (from a worker of a one-thread pool it
    /// would wait forever), as [`Artifact::verify`]'s quantized tensors and
    /// [`crate::unpack`]'s also need.
    ///
    /// # Errors
    /// The first failure, naming the tensor (and block).
    ///
    /// [`Writer::finish`]: crate::Writer::finish
    pub fn check_stored(&self) -> Result<Summary> {
        self.check(false, |_, _| {})
    }

    /// [`Artifact::check_stored`] with [`Artifact::verify_with`]'s `progress`.
    ///
    /// # Errors
    /// As [`Artifact::check_stored`].
    pub fn check_stored_with(&self, progress: impl FnMut(&str, u64) + Send) -> Result<Summary> {
        self.check(false, progress)
    }

    /// [`Artifact::verify`] (`decode`) or [`Artifact::check_stored`]: tensors in
    /// parallel ([`crate::pipeline::ordered_light`]), at most [`STREAM_BYTES`] (or one tensor)
    /// of stored bytes in flight, the first failure in the recipe's order reported.
    fn check(&self, decode: bool, mut progress: impl FnMut(&str, u64) + Send) -> Result<Summary> {
        let mut s = Summary {
            file_bytes: self.file_bytes,
            ..Summary::default()
        };
        let ts: Vec<&TensorRecipe> = self.recipe.tensors.iter().collect();
        let checked = |i: usize| {
            if let Some(t) = ts.get(i) {
                progress(&t.name, decoded_bytes(t).unwrap_or(0));
            }
            Ok(())
        };
        if decode {
            self.stream_all(&ts, true, |_, _, _| Ok(()), checked)?;
        } else {
            // every digest against the stored bytes, nothing decoded
            let weight = |i: &usize| ts.get(*i).map_or(0, |t| self.stored_bytes(t));
            let work = |i: usize| -> Result<usize> {
                let t = ts.get(i).ok_or(Error::Cancelled)?;
                self.read_stored(&t.name).map(|_| i)
            };
            crate::pipeline::ordered_light(
                0..ts.len(),
                weight,
                STREAM_BYTES as u64,
                work,
                checked,
            )?;
        }
        for t in &self.recipe.tensors {
            s.tensors = s.tensors.saturating_add(1);
            let want = decoded_bytes(t).unwrap_or(u64::MAX);
            s.dense_bytes = s.dense_bytes.saturating_add(want);
            s.stored_bytes = s.stored_bytes.saturating_add(self.stored_bytes(t));
            match &t.storage {
                StorageRecipe::Dense => s.dense = s.dense.saturating_add(1),
                StorageRecipe::Lossless {
                    rows, block_rows, ..
                } => {
                    s.lossless = s.lossless.saturating_add(1);
                    // the block count the recipe implies (checked against the store when
                    // its blocks were read)
                    let blocks = rows.div_ceil((*block_rows).max(1) as u64);
                    s.blocks = s
                        .blocks
                        .saturating_add(usize::try_from(blocks).unwrap_or(usize::MAX));
                }
                StorageRecipe::Quant { .. } => s.quantized = s.quantized.saturating_add(1),
            }
        }
        Ok(s)
    }
}

/// Bytes of tensors that [`Artifact::verify`] and [`unpack`] hold in flight at once (one
/// tensor at least, however large): their stored bytes' pages, and two
/// [`STREAM_PIECE`]s each of decoded bytes.
///
/// [`unpack`]: crate::unpack
pub const STREAM_BYTES: usize = 64 << 20;

/// Decoded bytes a streaming read decodes at a time: small enough that a piece is still
/// in cache when it is hashed and written.
pub const STREAM_PIECE: usize = 4 << 20;

/// Whether `t`'s decoded bytes are sealed by a whole-tensor digest (dense and lossless
/// tensors; a quantized one's seal is its payload digest).
pub(crate) fn has_whole_digest(t: &TensorRecipe) -> bool {
    !matches!(t.storage, StorageRecipe::Quant { .. })
}
