//! Writing: [`Writer`] adds tensors one at a time, spooling payloads to a temporary
//! data file, and [`Writer::finish`] writes the header, reopens and verifies the file,
//! and renames it into place.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use sha2::Digest;

use compressme_blockstore::{BlockStore, Coder, EncodeOptions, SharedBytes};
use compressme_quant::Format;

use crate::convert::{row_view, to_f32, value_kind};
use crate::read::{Artifact, Summary};
use crate::recipe::{
    FORMAT_KEY, FORMAT_NAME, RECIPE_KEY, RECIPE_SHA_KEY, Recipe, SOURCE_HEADER_KEY, StorageRecipe,
    TensorRecipe, VERSION, VERSION_KEY, VERSION_SOURCE_HEADER, VERSION_XXH3, WholeDigest, hex,
    sha256_hex, xxh3_hex,
};
use crate::st::{AtomicFile, Dtype, Durability, Limits, Planned, header_bytes};
use crate::validate::{blocks_name, codes_name, mins_name, scales_name};
use crate::{Error, Result};

/// What happened to one tensor when it was added.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Added {
    /// The tensor.
    pub name: String,
    /// `dense`, `lossless` or a format name.
    pub storage: String,
    /// Bytes of the original.
    pub dense_bytes: u64,
    /// Bytes of its payload tensors.
    pub stored_bytes: u64,
    /// When lossless packing was asked for but would have grown the tensor.
    pub kept_dense: bool,
}

/// The block store's options for a lossless tensor of `dtype`.
fn lossless_options(
    dtype: Dtype,
    block_rows: usize,
    coder: Coder,
    row_index: bool,
) -> EncodeOptions {
    EncodeOptions::new(value_kind(dtype))
        .block_rows(block_rows)
        .coder(coder)
        .row_index(row_index)
}

/// Names a writer refuses: payload names are `cm.`-prefixed.
fn reserved(name: &str) -> Result<()> {
    if name.starts_with("cm.") || name == "__metadata__" {
        return Err(Error::Invalid {
            tensor: name.into(),
            reason: "names starting with `cm.` are reserved for payloads".into(),
        });
    }
    Ok(())
}

/// A tensor's bytes handed to [`Writer::prepare`]: borrowed, or shared (a memory map)
/// so that a prepared dense tensor can outlive the call and cross threads uncopied.
#[derive(Clone)]
pub enum Input<'a> {
    /// Bytes the caller keeps.
    Borrowed(&'a [u8]),
    /// Bytes the prepared tensor may keep (e.g. a [`crate::Mapped`] in an `Arc`).
    Shared(SharedBytes),
}

impl Input<'_> {
    fn as_slice(&self) -> &[u8] {
        match self {
            Self::Borrowed(b) => b,
            Self::Shared(b) => (**b).as_ref(),
        }
    }
}

impl std::fmt::Debug for Input<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Input({} bytes)", self.as_slice().len())
    }
}

/// How [`Writer::prepare`] stores a tensor.
#[derive(Debug, Clone, PartialEq)]
pub enum Storage {
    /// As it is.
    Dense,
    /// Losslessly in row blocks (dense when that would not be smaller).
    Lossless {
        /// Rows per block.
        block_rows: usize,
        /// The plane coder.
        coder: Coder,
        /// Row-indexed Huffman planes (see [`Writer::add_lossless_indexed`]).
        row_index: bool,
        /// The whole-tensor digest recorded (XXH3-128 by default: artifact version 4).
        digest: WholeDigest,
    },
    /// Quantized (2-D or more float tensors).
    Quantized {
        /// The format.
        format: Format,
        /// One weight per column for activation-aware rounding; empty for absmax.
        importance: Vec<f32>,
    },
    /// Quantized with GPTQ rounding against the layer's input (2-D or more float
    /// tensors whose columns are the factor's; see `compressme_quant::quantize_gptq`):
    /// the same layout and recipe entry as [`Storage::Quantized`].
    Gptq {
        /// The format.
        format: Format,
        /// The layer's factor (shared by layers that read the same input).
        factor: std::sync::Arc<compressme_quant::GptqFactor>,
    },
}

/// One payload of a prepared tensor.
enum Part<'a> {
    Bytes(Cow<'a, [u8]>),
    Shared(SharedBytes),
    /// A block store's serialized index, then its payload (never copied).
    Store(Vec<u8>, Box<BlockStore>),
}

/// A tensor ready to be written ([`Writer::prepare`], [`Writer::prepare_packed`]): its
/// payloads and recipe entry, built on any thread; [`Writer::commit`] writes it.
pub struct Prepared<'a> {
    tensor: TensorRecipe,
    parts: Vec<(Planned, Part<'a>)>,
    added: Added,
}

impl Prepared<'_> {
    /// What adding it did (storage, dense and stored bytes).
    #[must_use]
    pub fn added(&self) -> &Added {
        &self.added
    }
}

impl std::fmt::Debug for Prepared<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prepared")
            .field("tensor", &self.tensor.name)
            .field("added", &self.added)
            .finish_non_exhaustive()
    }
}

/// Writes an artifact a tensor at a time: payloads go to a temporary data file as they
/// come, so memory holds one tensor; [`Writer::finish`] writes the header, copies the
/// data, verifies everything it wrote and only then renames the file into place.
/// Dropping an unfinished writer leaves nothing behind.
#[derive(Debug)]
pub struct Writer {
    dest: PathBuf,
    /// Payloads as they come: a temporary data file, or (after
    /// [`Writer::reserve_header`]) the destination itself, after the header's room.
    data: AtomicFile,
    /// The header's room in the destination, when payloads go straight there.
    room: Option<u64>,
    planned: Vec<Planned>,
    tensors: Vec<TensorRecipe>,
    names: HashSet<String>,
    recipe: Recipe,
    paranoid: bool,
    durability: Durability,
    /// The source file's header text, to be recorded (version 3).
    source_header: Option<String>,
    /// The whole-tensor digest [`Writer::add_lossless`] records.
    whole_digest: WholeDigest,
}

impl Writer {
    /// Starts an artifact that will be written to `dest`.
    ///
    /// # Errors
    /// [`Error::Io`] when the folder is not writable.
    pub fn create(dest: &Path) -> Result<Self> {
        let data_path = dest.with_extension("data");
        Ok(Self {
            dest: dest.to_path_buf(),
            data: AtomicFile::create(&data_path)?,
            room: None,
            planned: Vec::new(),
            tensors: Vec::new(),
            names: HashSet::new(),
            paranoid: false,
            durability: Durability::default(),
            source_header: None,
            whole_digest: WholeDigest::default(),
            recipe: Recipe {
                format: FORMAT_NAME.into(),
                version: VERSION,
                tool: concat!("compressme ", env!("CARGO_PKG_VERSION")).into(),
                tensors: Vec::new(),
                output_head_policy: None,
                plan_sha256: None,
                calibration_sha256: None,
                tokenizer_sha256: None,
                source_metadata: BTreeMap::new(),
                source_header_sha256: None,
            },
        })
    }

    /// Records the header of the safetensors file the tensors come from (its bytes
    /// after the length prefix, padding included: [`crate::SafetensorsFile::header_text`]),
    /// so that [`crate::unpack`] writes that header and lays the tensors out at its
    /// offsets: the source file again, byte for byte, when every tensor is stored dense or
    /// losslessly. The artifact is then written in version 3. Call it before
    /// [`Writer::header_room`]. A header whose tensors are not the ones added (by name,
    /// dtype and shape) fails [`Writer::finish`]'s reopening check, as any reader refuses
    /// it, and the file is removed.
    ///
    /// # Errors
    /// A header that is not UTF-8 (a safetensors header is JSON).
    pub fn set_source_header(&mut self, text: &[u8]) -> Result<()> {
        let text = std::str::from_utf8(text).map_err(|e| Error::Invalid {
            tensor: String::new(),
            reason: format!("the source header is not UTF-8: {e}"),
        })?;
        self.source_header = Some(text.to_string());
        Ok(())
    }

    /// The recipe as it will be written: the caller's fields, with the version and the
    /// source header's digest derived from [`Writer::set_source_header`].
    fn recipe_to_write(&self) -> Recipe {
        let mut recipe = self.recipe.clone();
        recipe.source_header_sha256 = self
            .source_header
            .as_deref()
            .map(|t| sha256_hex(t.as_bytes()));
        recipe.version = if self.tensors.iter().any(|t| t.xxh3_128.is_some()) {
            VERSION_XXH3
        } else if self.source_header.is_some() {
            VERSION_SOURCE_HEADER
        } else {
            VERSION
        };
        recipe
    }

    /// The whole-tensor digest [`Writer::add_lossless`] and
    /// [`Writer::add_lossless_indexed`] record (XXH3-128 unless set: artifact version 4;
    /// SHA-256 writes versions 2 and 3, which compressme read before version 4). Tensors
    /// prepared elsewhere carry their own ([`Storage::Lossless`]'s `digest`); one
    /// artifact holds one kind: [`Writer::finish`] refuses a mix.
    pub fn set_whole_digest(&mut self, digest: WholeDigest) {
        self.whole_digest = digest;
    }

    /// Whether [`Writer::finish`] decodes every block and hashes every tensor again after
    /// reopening the file ([`Artifact::verify`]) instead of checking every stored byte
    /// against its digest without decoding ([`Artifact::check_stored`], the default: the
    /// encoder already decoded each block and compared it with the input).
    pub fn set_paranoid(&mut self, on: bool) {
        self.paranoid = on;
    }

    /// Whether [`Writer::finish`] syncs the file to the disk before the rename
    /// ([`Durability`]; not by default).
    pub fn set_durability(&mut self, d: Durability) {
        self.durability = d;
    }

    /// Sends payloads straight to the destination, after `room` bytes kept for the
    /// header (a multiple of 8, at least 16), instead of through a temporary data file
    /// copied after the header at the end: each payload byte is written once. Call it
    /// before the first tensor, with [`Writer::header_room`]'s bound for the tensors to
    /// come. The header is padded with spaces to fill the room (the format allows it);
    /// should it not fit after all, the payloads are moved up to make room, so the file
    /// is right either way.
    ///
    /// # Errors
    /// A room that is not a multiple of 8 or is below 16, a writer that already holds
    /// tensors, [`Error::Io`].
    pub fn reserve_header(&mut self, room: u64) -> Result<()> {
        if !self.planned.is_empty() || self.room.is_some() {
            return Err(Error::Invalid {
                tensor: String::new(),
                reason: "the header's room is reserved before the first tensor".into(),
            });
        }
        if room < 16 || !room.is_multiple_of(8) {
            return Err(Error::Invalid {
                tensor: String::new(),
                reason: format!("a header room of {room} bytes is not a multiple of 8 from 16"),
            });
        }
        let mut out = AtomicFile::create(&self.dest)?;
        out.seek_to(room)?;
        // the empty data file goes
        self.data = out;
        self.room = Some(room);
        Ok(())
    }

    /// A bound on the header (length prefix included) of an artifact holding these
    /// tensors stored these ways, with the recipe fields set so far: every number at the
    /// most it can be (payloads as large as the dense tensor), every digest at its fixed
    /// width, and a byte a tensor and 64 more to spare, rounded up to a multiple of 8. For
    /// [`Writer::reserve_header`].
    ///
    /// # Errors
    /// Sizes that overflow, a recipe that does not serialize.
    pub fn header_room(&self, tensors: &[(&str, Dtype, &[usize], &Storage)]) -> Result<u64> {
        let digest = || "0".repeat(64);
        let mut planned = Vec::new();
        let mut recipe = self.recipe_to_write();
        for &(name, dtype, shape, storage) in tensors {
            let dense = shape
                .iter()
                .try_fold(dtype.size() as u64, |a, &d| a.checked_mul(d as u64))
                .ok_or_else(|| Error::Invalid {
                    tensor: name.into(),
                    reason: format!("shape {shape:?} overflows"),
                })?;
            let part = |n: String, dt: Dtype| Planned {
                name: n,
                dtype: dt,
                shape: vec![usize::try_from(dense).unwrap_or(usize::MAX)],
                len: dense,
            };
            let (sha256, xxh3_128, storage) = match storage {
                Storage::Dense => {
                    planned.push(Planned {
                        name: name.into(),
                        dtype,
                        shape: shape.to_vec(),
                        len: dense,
                    });
                    (Some(digest()), None, StorageRecipe::Dense)
                }
                Storage::Lossless {
                    block_rows,
                    coder,
                    row_index,
                    digest: whole,
                } => {
                    // a bound: the entry is longer than a dense one, should blocks not pay
                    planned.push(part(blocks_name(name), Dtype::U8));
                    let storage =
                        lossless_recipe(dtype, shape, *block_rows, *coder, *row_index, digest());
                    match whole {
                        WholeDigest::Sha256 => (Some(digest()), None, storage),
                        WholeDigest::Xxh3 => (None, Some("0".repeat(32)), storage),
                    }
                }
                Storage::Quantized { format, .. } | Storage::Gptq { format, .. } => {
                    planned.push(part(codes_name(name), Dtype::U8));
                    planned.push(part(scales_name(name), Dtype::F32));
                    planned.push(part(mins_name(name), Dtype::F32));
                    let storage = StorageRecipe::Quant {
                        format: format.to_string(),
                        rows: shape.first().copied().unwrap_or(0),
                        cols: shape.iter().skip(1).product::<usize>(),
                        payload_sha256: digest(),
                    };
                    (None, None, storage)
                }
            };
            recipe.tensors.push(TensorRecipe {
                name: name.into(),
                dtype: dtype.name().into(),
                shape: shape.to_vec(),
                sha256,
                xxh3_128,
                storage,
            });
        }
        let metadata = metadata(&recipe, &self.dest, self.source_header.as_deref())?;
        let header = header_bytes(&planned, &metadata)?.len() as u64;
        // every field above is at its widest already: the spare is for safety only
        let spare = (tensors.len() as u64).saturating_add(64);
        Ok(header.saturating_add(spare).next_multiple_of(8))
    }

    /// The recipe's optional fields (policy, hashes, source metadata) to be written.
    pub fn recipe_mut(&mut self) -> &mut Recipe {
        &mut self.recipe
    }

    fn claim(&mut self, name: &str) -> Result<()> {
        reserved(name)?;
        if !self.names.insert(name.to_string()) {
            return Err(Error::Invalid {
                tensor: name.into(),
                reason: "added twice".into(),
            });
        }
        Ok(())
    }

    fn check_size(name: &str, dtype: Dtype, shape: &[usize], bytes: &[u8]) -> Result<()> {
        let want = shape
            .iter()
            .try_fold(dtype.size() as u64, |a, &d| a.checked_mul(d as u64));
        if want != Some(bytes.len() as u64) {
            return Err(Error::Invalid {
                tensor: name.into(),
                reason: format!(
                    "{} bytes for shape {shape:?} of {}",
                    bytes.len(),
                    dtype.name()
                ),
            });
        }
        Ok(())
    }

    /// Writes a prepared tensor's payloads and records it: the second half of every
    /// `add_*`, run in the tensors' order by a pipeline whose [`Writer::prepare`] calls
    /// ran in parallel.
    ///
    /// # Errors
    /// A reserved or repeated name, [`Error::Io`].
    pub fn commit(&mut self, p: Prepared<'_>) -> Result<Added> {
        self.claim(&p.tensor.name)?;
        for (planned, part) in p.parts {
            match &part {
                Part::Bytes(b) => self.data.write_all(b)?,
                Part::Shared(b) => self.data.write_all((**b).as_ref())?,
                // index and payload written in turn: the payload is never copied
                Part::Store(index, store) => {
                    self.data.write_all(index)?;
                    self.data.write_all(store.payload())?;
                }
            }
            self.planned.push(planned);
        }
        self.tensors.push(p.tensor);
        Ok(p.added)
    }

    /// Stores a tensor as it is.
    ///
    /// # Errors
    /// A reserved or repeated name, bytes that do not fit the shape, [`Error::Io`].
    pub fn add_dense(
        &mut self,
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        bytes: &[u8],
    ) -> Result<Added> {
        let p = Self::prepare(name, dtype, shape, Input::Borrowed(bytes), &Storage::Dense)?;
        self.commit(p)
    }

    /// Stores a tensor losslessly in row blocks when that is smaller, else as it is.
    /// The block store checks every block against the input as it is built.
    ///
    /// # Errors
    /// As [`Writer::add_dense`], and block store errors for bad options.
    pub fn add_lossless(
        &mut self,
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        bytes: &[u8],
        block_rows: usize,
        coder: Coder,
    ) -> Result<Added> {
        self.add_lossless_indexed(name, dtype, shape, bytes, block_rows, coder, false)
    }

    /// [`Writer::add_lossless`], with Huffman-coded planes row-indexed when `row_index`
    /// (plane mode 32 + t: a lookup decodes only the rows it asks for, for a few tenths
    /// of a percent more bytes).
    ///
    /// # Errors
    /// As [`Writer::add_lossless`].
    #[allow(clippy::too_many_arguments)] // add_lossless's, and the one option it adds
    pub fn add_lossless_indexed(
        &mut self,
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        bytes: &[u8],
        block_rows: usize,
        coder: Coder,
        row_index: bool,
    ) -> Result<Added> {
        let storage = Storage::Lossless {
            block_rows,
            coder,
            row_index,
            digest: self.whole_digest,
        };
        let p = Self::prepare(name, dtype, shape, Input::Borrowed(bytes), &storage)?;
        self.commit(p)
    }

    /// Stores a 2-D (or higher: rows are the first dimension) float tensor quantized.
    ///
    /// # Errors
    /// As [`Writer::add_dense`], a tensor that is not float or has fewer than 2
    /// dimensions, and quantization errors (non-finite weights).
    pub fn add_quantized(
        &mut self,
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        bytes: &[u8],
        format: Format,
    ) -> Result<Added> {
        self.add_quantized_weighted(name, dtype, shape, bytes, format, &[])
    }

    /// [`Writer::add_quantized`] with activation-aware rounding for the blockwise 4-bit
    /// formats (`importance`: one weight per column, e.g. the per-channel mean x² of the
    /// layer's input; empty for plain absmax), see `compressme_quant::quantize_weighted`.
    ///
    /// # Errors
    /// As [`Writer::add_quantized`].
    pub fn add_quantized_weighted(
        &mut self,
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        bytes: &[u8],
        format: Format,
        importance: &[f32],
    ) -> Result<Added> {
        let storage = Storage::Quantized {
            format,
            importance: importance.to_vec(),
        };
        let p = Self::prepare(name, dtype, shape, Input::Borrowed(bytes), &storage)?;
        self.commit(p)
    }

    /// Stores weights already quantized (a model's packed layer, as it is: no
    /// re-quantization) for an original tensor of `dtype` and `shape` (rows are the first
    /// dimension).
    ///
    /// # Errors
    /// As [`Writer::add_dense`]; a shape that does not match the packed rows and columns.
    pub fn add_packed(
        &mut self,
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        packed: &compressme_quant::Packed,
    ) -> Result<Added> {
        let p = Self::prepare_packed(name, dtype, shape, packed)?;
        self.commit(p)
    }

    /// Builds a tensor's payloads and recipe entry without touching the writer, so
    /// tensors can be prepared on many threads and [committed](Writer::commit) in order:
    /// what every `add_*` does before writing. Lossless storage falls back to dense
    /// (`kept_dense`) when blocks would not be smaller; the block store checks every
    /// block against the input as it is built, and the whole-tensor SHA-256 is taken
    /// on another core at the same time.
    ///
    /// # Errors
    /// Bytes that do not fit the shape, a tensor that cannot be quantized (not float,
    /// fewer than 2 dimensions, non-finite weights), block store errors for bad options.
    pub fn prepare<'a>(
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        input: Input<'a>,
        storage: &Storage,
    ) -> Result<Prepared<'a>> {
        let bytes = input.as_slice();
        Self::check_size(name, dtype, shape, bytes)?;
        reserved(name)?;
        match storage {
            Storage::Dense => Ok(Self::prepare_dense(name, dtype, shape, input, false)),
            Storage::Lossless {
                block_rows,
                coder,
                row_index,
                digest,
            } => {
                let (rows, row_bytes) = row_view(dtype, shape);
                if bytes.is_empty() {
                    return Ok(Self::prepare_dense(name, dtype, shape, input, true));
                }
                let opts = lossless_options(dtype, *block_rows, *coder, *row_index);
                // the whole-tensor digest on one core while the blocks are coded
                let (whole, store) = rayon::join(
                    || digest.hex_of(bytes),
                    || BlockStore::encode(bytes, rows, row_bytes as usize, &opts),
                );
                let coding = (*block_rows, *coder, *row_index);
                let whole = (*digest, whole);
                Self::lossless_prepared(name, dtype, shape, input, coding, whole, store)
            }
            Storage::Quantized { format, importance } => {
                Self::prepare_quantized(name, dtype, shape, bytes, |v, rows, cols| {
                    compressme_quant::quantize_weighted(v, rows, cols, *format, importance)
                })
            }
            Storage::Gptq { format, factor } => {
                Self::prepare_quantized(name, dtype, shape, bytes, |v, rows, cols| {
                    compressme_quant::quantize_gptq(v, rows, cols, *format, factor)
                })
            }
        }
    }

    /// A float tensor of 2 or more dimensions, quantized by `quantize(values, rows, cols)`.
    fn prepare_quantized<'a>(
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        bytes: &[u8],
        quantize: impl FnOnce(
            &[f32],
            usize,
            usize,
        ) -> compressme_quant::Result<compressme_quant::Packed>,
    ) -> Result<Prepared<'a>> {
        if !dtype.is_float() || shape.len() < 2 {
            return Err(Error::Invalid {
                tensor: name.into(),
                reason: format!(
                    "only float tensors of 2 or more dimensions are quantized ({} {shape:?})",
                    dtype.name()
                ),
            });
        }
        let rows = shape.first().copied().unwrap_or(0);
        let cols = shape.iter().skip(1).product::<usize>();
        let values = to_f32(dtype, bytes);
        let packed = quantize(&values, rows, cols).map_err(|source| Error::Quant {
            tensor: name.into(),
            source,
        })?;
        let mut p = Self::prepare_packed(name, dtype, shape, &packed)?;
        p.added.dense_bytes = bytes.len() as u64;
        Ok(p)
    }

    /// Prepares several lossless tensors at once: as [`Writer::prepare`] gives each, the
    /// same bytes and recipe entries, with their whole-tensor digests taken on another
    /// core while the blocks are coded (SHA-256s four at a time in lockstep, where one
    /// tensor at a time runs one chain at the latency of the SHA unit). A `storage` that
    /// is not lossless prepares each tensor alone. One result a tensor, in order.
    pub fn prepare_many<'a>(
        tensors: Vec<(String, Dtype, Vec<usize>, Input<'a>)>,
        storage: &Storage,
    ) -> Vec<Result<Prepared<'a>>> {
        let &Storage::Lossless {
            block_rows,
            coder,
            row_index,
            digest,
        } = storage
        else {
            return tensors
                .into_iter()
                .map(|(name, dtype, shape, input)| {
                    Self::prepare(&name, dtype, &shape, input, storage)
                })
                .collect();
        };
        // the tensors whose blocks are coded: the rest go through `prepare` (its errors,
        // or a dense entry for an empty tensor)
        let coded: Vec<bool> = tensors
            .iter()
            .map(|(name, dtype, shape, input)| {
                let bytes = input.as_slice();
                Self::check_size(name, *dtype, shape, bytes).is_ok()
                    && reserved(name).is_ok()
                    && !bytes.is_empty()
            })
            .collect();
        let slices: Vec<&[u8]> = tensors
            .iter()
            .zip(&coded)
            .filter(|(_, c)| **c)
            .map(|((_, _, _, input), _)| input.as_slice())
            .collect();
        let (digests, stores) = rayon::join(
            || match digest {
                WholeDigest::Sha256 => compressme_blockstore::sha256_many(&slices)
                    .iter()
                    .map(|d| hex(d))
                    .collect(),
                WholeDigest::Xxh3 => slices.iter().map(|s| xxh3_hex(s)).collect::<Vec<_>>(),
            },
            || {
                tensors
                    .iter()
                    .zip(&coded)
                    .filter(|(_, c)| **c)
                    .map(|((_, dtype, shape, input), _)| {
                        let (rows, row_bytes) = row_view(*dtype, shape);
                        let opts = lossless_options(*dtype, block_rows, coder, row_index);
                        BlockStore::encode(input.as_slice(), rows, row_bytes as usize, &opts)
                    })
                    .collect::<Vec<_>>()
            },
        );
        drop(slices);
        let mut done = digests.into_iter().zip(stores);
        tensors
            .into_iter()
            .zip(coded)
            .map(|((name, dtype, shape, input), c)| {
                if !c {
                    return Self::prepare(&name, dtype, &shape, input, storage);
                }
                let Some((whole, store)) = done.next() else {
                    return Err(Error::Invalid {
                        tensor: name,
                        reason: "no digest for a coded tensor".into(),
                    });
                };
                let coding = (block_rows, coder, row_index);
                let whole = (digest, whole);
                Self::lossless_prepared(&name, dtype, &shape, input, coding, whole, store)
            })
            .collect()
    }

    /// A lossless tensor's entry from its coded blocks and its whole-tensor digest (of
    /// `input`'s bytes), or a dense one when the blocks are not smaller. `coding` is the
    /// lossless storage's rows a block, coder and row index.
    fn lossless_prepared<'a>(
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        input: Input<'a>,
        (block_rows, coder, row_index): (usize, Coder, bool),
        (digest, whole): (WholeDigest, String),
        store: compressme_blockstore::Result<BlockStore>,
    ) -> Result<Prepared<'a>> {
        let bytes = input.as_slice();
        let store = store.map_err(|source| Error::Blocks {
            tensor: name.into(),
            source,
        })?;
        let index = store.index_bytes();
        let blob_len = index.len() + store.payload().len();
        if blob_len >= bytes.len() {
            return Ok(Self::prepare_dense(name, dtype, shape, input, true));
        }
        let index_sha = hex(&store.index_digest());
        Ok(Prepared {
            parts: vec![(
                Planned {
                    name: blocks_name(name),
                    dtype: Dtype::U8,
                    shape: vec![blob_len],
                    len: blob_len as u64,
                },
                Part::Store(index, Box::new(store)),
            )],
            tensor: TensorRecipe {
                name: name.into(),
                dtype: dtype.name().into(),
                shape: shape.to_vec(),
                sha256: (digest == WholeDigest::Sha256).then(|| whole.clone()),
                xxh3_128: (digest == WholeDigest::Xxh3).then_some(whole),
                storage: lossless_recipe(dtype, shape, block_rows, coder, row_index, index_sha),
            },
            added: Added {
                name: name.into(),
                storage: "lossless".into(),
                dense_bytes: bytes.len() as u64,
                stored_bytes: blob_len as u64,
                kept_dense: false,
            },
        })
    }

    fn prepare_dense<'a>(
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        input: Input<'a>,
        kept_dense: bool,
    ) -> Prepared<'a> {
        let bytes = input.as_slice();
        let len = bytes.len() as u64;
        let tensor = TensorRecipe {
            name: name.into(),
            dtype: dtype.name().into(),
            shape: shape.to_vec(),
            sha256: Some(sha256_hex(bytes)),
            xxh3_128: None,
            storage: StorageRecipe::Dense,
        };
        let planned = Planned {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            len,
        };
        let part = match input {
            Input::Borrowed(b) => Part::Bytes(Cow::Borrowed(b)),
            Input::Shared(b) => Part::Shared(b),
        };
        Prepared {
            tensor,
            parts: vec![(planned, part)],
            added: Added {
                name: name.into(),
                storage: "dense".into(),
                dense_bytes: len,
                stored_bytes: len,
                kept_dense,
            },
        }
    }

    /// [`Writer::add_packed`]'s payloads and recipe entry, for [`Writer::commit`].
    ///
    /// # Errors
    /// As [`Writer::add_packed`].
    pub fn prepare_packed(
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        packed: &compressme_quant::Packed,
    ) -> Result<Prepared<'static>> {
        reserved(name)?;
        let rows = shape.first().copied().unwrap_or(0);
        let cols = shape.iter().skip(1).product::<usize>();
        if shape.len() < 2 || (rows, cols) != (packed.rows(), packed.cols()) || !dtype.is_float() {
            return Err(Error::Invalid {
                tensor: name.into(),
                reason: format!(
                    "packed {} x {} weights do not fit a {} {shape:?} tensor",
                    packed.rows(),
                    packed.cols(),
                    dtype.name()
                ),
            });
        }
        let format = packed.format();
        let mut digest = sha2::Sha256::new();
        let mut parts = Vec::new();
        let mut part = |name: String, dtype: Dtype, count: usize, bytes: Vec<u8>| {
            digest.update(&bytes);
            let planned = Planned {
                name,
                dtype,
                shape: vec![count],
                len: bytes.len() as u64,
            };
            parts.push((planned, Part::Bytes(Cow::Owned(bytes))));
        };
        part(
            codes_name(name),
            Dtype::U8,
            packed.codes().len(),
            packed.codes().to_vec(),
        );
        let group = format.group().is_some();
        if !packed.scales().is_empty() {
            let (dt, b) = scale_bytes(packed.scales(), group);
            part(scales_name(name), dt, packed.scales().len(), b);
        }
        if !packed.mins().is_empty() {
            let (dt, b) = scale_bytes(packed.mins(), true);
            part(mins_name(name), dt, packed.mins().len(), b);
        }
        let d: [u8; 32] = digest.finalize().into();
        let stored: u64 = parts.iter().map(|(p, _)| p.len).sum();
        Ok(Prepared {
            tensor: TensorRecipe {
                name: name.into(),
                dtype: dtype.name().into(),
                shape: shape.to_vec(),
                sha256: None,
                xxh3_128: None,
                storage: StorageRecipe::Quant {
                    format: format.to_string(),
                    rows,
                    cols,
                    payload_sha256: hex(&d),
                },
            },
            parts,
            added: Added {
                name: name.into(),
                storage: format.to_string(),
                dense_bytes: (rows * cols * dtype.size()) as u64,
                stored_bytes: stored,
                kept_dense: false,
            },
        })
    }

    /// Writes the file: header, then the payloads; reopens it, checks the recipe against
    /// the payload and every stored byte against its digest (block digests, each block
    /// store's index digest, dense tensors' SHA-256, packed buffers), without decoding:
    /// every block was decoded and compared with its input when it was encoded, so the
    /// whole-tensor digests, taken from the input, hold for the checked blocks. With
    /// [`Writer::set_paranoid`], every tensor is decoded and hashed again. Then renames
    /// the file into place.
    ///
    /// # Errors
    /// [`Error::Io`], [`Error::Invalid`] for lossless tensors prepared with both kinds of
    /// whole-tensor digest, and any verification failure (the file is then removed).
    pub fn finish(self) -> Result<Summary> {
        // one whole-tensor digest for the lossless tensors: the version says which
        let lossless_with = |d: WholeDigest| {
            self.tensors
                .iter()
                .any(|t| t.lossless_whole_digest() == Some(d))
        };
        if lossless_with(WholeDigest::Xxh3) && lossless_with(WholeDigest::Sha256) {
            return Err(Error::Invalid {
                tensor: String::new(),
                reason: "lossless tensors prepared with both XXH3-128 and SHA-256 whole-tensor \
                         digests: an artifact holds one kind"
                    .into(),
            });
        }
        let mut recipe = self.recipe_to_write();
        let mut order: Vec<usize> = (0..self.tensors.len()).collect();
        order.sort_by(|&a, &b| self.tensors[a].name.cmp(&self.tensors[b].name));
        recipe.tensors = order.iter().map(|&i| self.tensors[i].clone()).collect();
        let metadata = metadata(&recipe, &self.dest, self.source_header.as_deref())?;
        let header = header_bytes(&self.planned, &metadata)?;
        let mut out = match self.room {
            Some(room) => {
                // the payloads are in place after the room: the header fills it, padded
                // with spaces; or, past it, the payloads move up first
                let mut out = self.data;
                let len = header.len() as u64;
                if len <= room {
                    out.write_all_at(0, &pad_header(header, room))?;
                } else {
                    out.shift_tail(room, len.saturating_sub(room))?;
                    out.write_all_at(0, &header)?;
                }
                out
            }
            None => {
                // the data file is read back and removed here: no need to sync it
                let mut out = AtomicFile::create(&self.dest)?;
                out.write_all(&header)?;
                out.append_file(self.data.tmp_path())?;
                drop(self.data); // removes the data file
                out
            }
        };
        // checked from the page cache, then renamed (synced first when asked) by `commit`
        // the writer's own check is not bounded by the decoded-size limits (it encoded
        // these bytes itself); a reader's default limits may refuse a degenerate tensor,
        // which `Artifact::expansion` lets the caller warn about
        let unbounded = Limits {
            max_decoded_tensor: u64::MAX,
            max_decoded_total: u64::MAX,
            max_expansion: u64::MAX,
            ..Limits::default()
        };
        let artifact = Artifact::open(out.tmp_path(), &unbounded)?;
        let summary = if self.paranoid {
            artifact.verify()?
        } else {
            artifact.check_stored()?
        };
        out.set_durability(self.durability);
        out.commit()?;
        Ok(summary)
    }
}

/// A lossless tensor's recipe entry (version 2: the block store's index digest).
fn lossless_recipe(
    dtype: Dtype,
    shape: &[usize],
    block_rows: usize,
    coder: Coder,
    row_index: bool,
    index_sha256: String,
) -> StorageRecipe {
    let (rows, row_bytes) = row_view(dtype, shape);
    StorageRecipe::Lossless {
        block_rows,
        rows,
        row_bytes,
        coder: match coder {
            Coder::Zstd { level } => format!("zstd-{level}"),
            Coder::SharedRans { .. } => "rans".into(),
            Coder::Mixed { .. } => "mixed".into(),
            _ => "huffman".into(),
        },
        row_index,
        element_size: dtype.size(),
        block_sha256: Vec::new(),
        index_sha256: Some(index_sha256),
    }
}

/// The artifact's `__metadata__`: format, version, the recipe and its digest, and the
/// source header when one is recorded (version 3).
fn metadata(
    recipe: &Recipe,
    dest: &Path,
    source_header: Option<&str>,
) -> Result<BTreeMap<String, String>> {
    let mut metadata = BTreeMap::new();
    metadata.insert(FORMAT_KEY.to_string(), FORMAT_NAME.to_string());
    metadata.insert(VERSION_KEY.to_string(), recipe.version.to_string());
    if let Some(text) = source_header {
        metadata.insert(SOURCE_HEADER_KEY.to_string(), text.to_string());
    }
    let json = serde_json::to_string(recipe).map_err(|e| Error::Recipe {
        path: dest.to_path_buf(),
        reason: e.to_string(),
    })?;
    metadata.insert(RECIPE_SHA_KEY.to_string(), sha256_hex(json.as_bytes()));
    metadata.insert(RECIPE_KEY.to_string(), json);
    Ok(metadata)
}

/// `header` (length prefix, JSON, spaces) grown with spaces to `room` bytes in all.
fn pad_header(header: Vec<u8>, room: u64) -> Vec<u8> {
    let mut out = room.saturating_sub(8).to_le_bytes().to_vec();
    out.extend_from_slice(header.get(8..).unwrap_or(&[]));
    out.resize(usize::try_from(room).unwrap_or(out.len()), b' ');
    out
}

fn scale_bytes(v: &[f32], as_f16: bool) -> (Dtype, Vec<u8>) {
    if as_f16 {
        (
            Dtype::F16,
            v.iter()
                .flat_map(|x| half::f16::from_f32(*x).to_bits().to_le_bytes())
                .collect(),
        )
    } else {
        (Dtype::F32, v.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
}
