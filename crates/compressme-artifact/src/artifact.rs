//! Writing and reading artifacts.

use std::collections::{BTreeMap, HashSet};
use std::fs::File;
use std::io::Read;

use rayon::prelude::*;
use sha2::Digest;
use std::path::{Path, PathBuf};

use compressme_blockstore::{BlockStore, Coder, EncodeOptions, ValueKind};
use compressme_quant::{Format, Packed};

use crate::recipe::{
    FORMAT_KEY, FORMAT_NAME, READABLE, RECIPE_KEY, RECIPE_SHA_KEY, Recipe, StorageRecipe,
    TensorRecipe, VERSION, VERSION_KEY, hex, sha256_hex,
};
use crate::st::{
    AtomicFile, Dtype, EXPANSION_FLOOR, Entry, Limits, Planned, SafetensorsFile, header_bytes,
};
use crate::{Error, Result};

/// Payload name of a lossless tensor's block store.
#[must_use]
pub fn blocks_name(tensor: &str) -> String {
    format!("cm.blocks/{tensor}")
}
/// Payload name of a quantized tensor's codes.
#[must_use]
pub fn codes_name(tensor: &str) -> String {
    format!("cm.codes/{tensor}")
}
/// Payload name of a quantized tensor's scales.
#[must_use]
pub fn scales_name(tensor: &str) -> String {
    format!("cm.scales/{tensor}")
}
/// Payload name of an `int4-g*` tensor's minimums.
#[must_use]
pub fn mins_name(tensor: &str) -> String {
    format!("cm.mins/{tensor}")
}

/// The block store's value kind for a dtype.
#[must_use]
pub fn value_kind(dtype: Dtype) -> ValueKind {
    use compressme_shuffle::ElementSize;
    match dtype {
        Dtype::F32 => ValueKind::F32,
        Dtype::Bf16 => ValueKind::Bf16,
        Dtype::F16 => ValueKind::F16,
        Dtype::F64 => ValueKind::F64,
        d => ValueKind::Bytes(match d.size() {
            2 => ElementSize::Two,
            4 => ElementSize::Four,
            8 => ElementSize::Eight,
            _ => ElementSize::One,
        }),
    }
}

/// The `[rows, row_bytes]` view a tensor is blocked by: the first dimension, or one row.
#[must_use]
pub fn row_view(dtype: Dtype, shape: &[usize]) -> (u64, u64) {
    let numel: u64 = shape.iter().map(|&d| d as u64).product();
    let rows = if shape.len() >= 2 {
        shape.first().copied().unwrap_or(1) as u64
    } else {
        1
    };
    let row_bytes = numel.checked_div(rows).unwrap_or(0) * dtype.size() as u64;
    (rows, row_bytes)
}

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

/// Writes an artifact a tensor at a time: payloads go to a temporary data file as they
/// come, so memory holds one tensor; [`Writer::finish`] writes the header, copies the
/// data, verifies everything it wrote and only then renames the file into place.
/// Dropping an unfinished writer leaves nothing behind.
#[derive(Debug)]
pub struct Writer {
    dest: PathBuf,
    data: AtomicFile,
    planned: Vec<Planned>,
    tensors: Vec<TensorRecipe>,
    names: HashSet<String>,
    recipe: Recipe,
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
            planned: Vec::new(),
            tensors: Vec::new(),
            names: HashSet::new(),
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
            },
        })
    }

    /// The recipe's optional fields (policy, hashes, source metadata) to be written.
    pub fn recipe_mut(&mut self) -> &mut Recipe {
        &mut self.recipe
    }

    fn claim(&mut self, name: &str) -> Result<()> {
        if name.starts_with("cm.") || name == "__metadata__" {
            return Err(Error::Invalid {
                tensor: name.into(),
                reason: "names starting with `cm.` are reserved for payloads".into(),
            });
        }
        if !self.names.insert(name.to_string()) {
            return Err(Error::Invalid {
                tensor: name.into(),
                reason: "added twice".into(),
            });
        }
        Ok(())
    }

    fn push(&mut self, name: String, dtype: Dtype, shape: Vec<usize>, bytes: &[u8]) -> Result<()> {
        self.data.write_all(bytes)?;
        self.planned.push(Planned {
            name,
            dtype,
            shape,
            len: bytes.len() as u64,
        });
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
        Self::check_size(name, dtype, shape, bytes)?;
        self.claim(name)?;
        self.push(name.into(), dtype, shape.to_vec(), bytes)?;
        self.tensors.push(TensorRecipe {
            name: name.into(),
            dtype: dtype.name().into(),
            shape: shape.to_vec(),
            sha256: Some(sha256_hex(bytes)),
            storage: StorageRecipe::Dense,
        });
        Ok(Added {
            name: name.into(),
            storage: "dense".into(),
            dense_bytes: bytes.len() as u64,
            stored_bytes: bytes.len() as u64,
            kept_dense: false,
        })
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
        Self::check_size(name, dtype, shape, bytes)?;
        let (rows, row_bytes) = row_view(dtype, shape);
        if bytes.is_empty() {
            let mut a = self.add_dense(name, dtype, shape, bytes)?;
            a.kept_dense = true;
            return Ok(a);
        }
        let kind = value_kind(dtype);
        let opts = EncodeOptions::new(kind)
            .block_rows(block_rows)
            .coder(coder)
            .row_index(row_index);
        let store =
            BlockStore::encode(bytes, rows, row_bytes as usize, &opts).map_err(|source| {
                Error::Blocks {
                    tensor: name.into(),
                    source,
                }
            })?;
        let index = store.index_bytes();
        let blob_len = index.len() + store.payload().len();
        if blob_len >= bytes.len() {
            let mut a = self.add_dense(name, dtype, shape, bytes)?;
            a.kept_dense = true;
            return Ok(a);
        }
        self.claim(name)?;
        // index and payload written in turn: the payload is never copied
        self.data.write_all(&index)?;
        self.data.write_all(store.payload())?;
        self.planned.push(Planned {
            name: blocks_name(name),
            dtype: Dtype::U8,
            shape: vec![blob_len],
            len: blob_len as u64,
        });
        self.tensors.push(TensorRecipe {
            name: name.into(),
            dtype: dtype.name().into(),
            shape: shape.to_vec(),
            sha256: Some(sha256_hex(bytes)),
            storage: StorageRecipe::Lossless {
                block_rows,
                rows,
                row_bytes,
                coder: match coder {
                    Coder::Zstd { level } => format!("zstd-{level}"),
                    _ => "huffman".into(),
                },
                row_index,
                element_size: dtype.size(),
                block_sha256: store.block_digests().iter().map(|d| hex(d)).collect(),
            },
        });
        Ok(Added {
            name: name.into(),
            storage: "lossless".into(),
            dense_bytes: bytes.len() as u64,
            stored_bytes: blob_len as u64,
            kept_dense: false,
        })
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
        Self::check_size(name, dtype, shape, bytes)?;
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
        let packed = compressme_quant::quantize_weighted(&values, rows, cols, format, importance)
            .map_err(|source| Error::Quant {
            tensor: name.into(),
            source,
        })?;
        let mut added = self.add_packed(name, dtype, shape, &packed)?;
        added.dense_bytes = bytes.len() as u64;
        Ok(added)
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
        self.claim(name)?;
        let before: u64 = self.planned.iter().map(|p| p.len).sum();
        let mut digest = sha2::Sha256::new();
        self.push(
            codes_name(name),
            Dtype::U8,
            vec![packed.codes().len()],
            packed.codes(),
        )?;
        digest.update(packed.codes());
        let group = format.group().is_some();
        if !packed.scales().is_empty() {
            let (dt, b) = scale_bytes(packed.scales(), group);
            self.push(scales_name(name), dt, vec![packed.scales().len()], &b)?;
            digest.update(&b);
        }
        if !packed.mins().is_empty() {
            let (dt, b) = scale_bytes(packed.mins(), true);
            self.push(mins_name(name), dt, vec![packed.mins().len()], &b)?;
            digest.update(&b);
        }
        let d: [u8; 32] = digest.finalize().into();
        let after: u64 = self.planned.iter().map(|p| p.len).sum();
        self.tensors.push(TensorRecipe {
            name: name.into(),
            dtype: dtype.name().into(),
            shape: shape.to_vec(),
            sha256: None,
            storage: StorageRecipe::Quant {
                format: format.to_string(),
                rows,
                cols,
                payload_sha256: hex(&d),
            },
        });
        Ok(Added {
            name: name.into(),
            storage: format.to_string(),
            dense_bytes: (rows * cols * dtype.size()) as u64,
            stored_bytes: after - before,
            kept_dense: false,
        })
    }

    /// Writes the file: header, then the payloads; reopens it, checks the recipe against
    /// the payload and verifies every tensor (block digests, whole-tensor SHA-256 of what
    /// the blocks decode to, packed buffers); then renames it into place.
    ///
    /// # Errors
    /// [`Error::Io`], and any verification failure (the file is then removed).
    pub fn finish(mut self) -> Result<Summary> {
        self.data.sync()?;
        let mut recipe = self.recipe.clone();
        let mut order: Vec<usize> = (0..self.tensors.len()).collect();
        order.sort_by(|&a, &b| self.tensors[a].name.cmp(&self.tensors[b].name));
        recipe.tensors = order.iter().map(|&i| self.tensors[i].clone()).collect();
        let mut metadata = BTreeMap::new();
        metadata.insert(FORMAT_KEY.to_string(), FORMAT_NAME.to_string());
        metadata.insert(VERSION_KEY.to_string(), VERSION.to_string());
        let json = serde_json::to_string(&recipe).map_err(|e| Error::Recipe {
            path: self.dest.clone(),
            reason: e.to_string(),
        })?;
        metadata.insert(RECIPE_SHA_KEY.to_string(), sha256_hex(json.as_bytes()));
        metadata.insert(RECIPE_KEY.to_string(), json);
        let header = header_bytes(&self.planned, &metadata)?;
        let mut out = AtomicFile::create(&self.dest)?;
        out.write_all(&header)?;
        let data_path = self.data.tmp_path().to_path_buf();
        let mut data = File::open(&data_path).map_err(|source| Error::Io {
            path: data_path.clone(),
            source,
        })?;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = data.read(&mut buf).map_err(|source| Error::Io {
                path: data_path.clone(),
                source,
            })?;
            if n == 0 {
                break;
            }
            out.write_all(buf.get(..n).unwrap_or(&[]))?;
        }
        drop(data);
        drop(self.data); // removes the data file
        out.sync()?;
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
        let summary = artifact.verify()?;
        out.commit()?;
        Ok(summary)
    }
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

/// Little-endian float bytes as f32 values.
#[must_use]
pub fn to_f32(dtype: Dtype, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        Dtype::Bf16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        Dtype::F64 => bytes
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as f32)
            .collect(),
        _ => Vec::new(),
    }
}

/// f32 values as little-endian bytes of `dtype` (round to nearest even).
#[must_use]
pub fn from_f32(dtype: Dtype, values: &[f32]) -> Vec<u8> {
    match dtype {
        Dtype::F16 => values
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_bits().to_le_bytes())
            .collect(),
        Dtype::Bf16 => values
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes())
            .collect(),
        Dtype::F64 => values
            .iter()
            .flat_map(|v| f64::from(*v).to_le_bytes())
            .collect(),
        _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

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
    limits: Limits,
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
        let md = file.metadata();
        let not = |reason: &str| Error::NotArtifact {
            path: path.to_path_buf(),
            reason: reason.into(),
        };
        if md.get(FORMAT_KEY).map(String::as_str) != Some(FORMAT_NAME) {
            return Err(not("no `format: compressme-artifact` in __metadata__"));
        }
        let version = md
            .get(VERSION_KEY)
            .ok_or_else(|| not("no compressme.version in __metadata__"))?;
        if !READABLE.iter().any(|v| v.to_string() == *version) {
            return Err(Error::UnsupportedVersion {
                path: path.to_path_buf(),
                found: version.clone(),
                supported: READABLE.map(|v| v.to_string()).join(", "),
            });
        }
        let bad = |reason: String| Error::Recipe {
            path: path.to_path_buf(),
            reason,
        };
        let json = md
            .get(RECIPE_KEY)
            .ok_or_else(|| not("no compressme.recipe in __metadata__"))?;
        let recorded = md
            .get(RECIPE_SHA_KEY)
            .ok_or_else(|| not("no compressme.recipe_sha256 in __metadata__"))?;
        if *recorded != sha256_hex(json.as_bytes()) {
            return Err(Error::Digest {
                tensor: "(recipe)".into(),
                what: "the recipe in __metadata__".into(),
            });
        }
        let recipe: Recipe =
            serde_json::from_str(json).map_err(|e| bad(format!("not a valid recipe: {e}")))?;
        if recipe.format != FORMAT_NAME || recipe.version.to_string() != *version {
            return Err(bad(format!(
                "recipe says {} version {}, metadata says version {version}",
                recipe.format, recipe.version
            )));
        }
        if !file.header_padded() {
            return Err(not(
                "the header is not padded with spaces to a multiple of 8 bytes",
            ));
        }
        let mut used = HashSet::new();
        let mut seen = HashSet::new();
        let mut previous: Option<&str> = None;
        for t in &recipe.tensors {
            if !seen.insert(t.name.as_str()) {
                return Err(bad(format!("tensor `{}` listed twice", t.name)));
            }
            if previous.is_some_and(|p| p > t.name.as_str()) {
                return Err(bad(format!(
                    "tensors are not sorted by name (`{}` after `{}`)",
                    t.name,
                    previous.unwrap_or_default()
                )));
            }
            previous = Some(t.name.as_str());
            check_tensor(&file, t, &mut used).map_err(bad)?;
        }
        if let Some(stray) = file.entries().iter().find(|e| !used.contains(&e.name)) {
            return Err(bad(format!(
                "payload tensor `{}` is not in the recipe",
                stray.name
            )));
        }
        check_decoded(path, &file, &recipe, limits)?;
        Ok(Self {
            file,
            recipe,
            file_bytes,
            limits: *limits,
        })
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
            .sum()
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

    fn read_entry(&mut self, name: &str) -> Result<Vec<u8>> {
        let e = self
            .file
            .entry(name)
            .cloned()
            .ok_or_else(|| Error::MissingTensor(name.into()))?;
        self.file.read(&e)
    }

    /// Payload `name` as f32 values (empty when the format has none), its stored bytes
    /// fed to `digest`.
    fn read_floats(&mut self, name: &str, digest: &mut sha2::Sha256) -> Result<Vec<f32>> {
        let Some(e) = self.file.entry(name).cloned() else {
            return Ok(Vec::new());
        };
        let bytes = self.file.read(&e)?;
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
    pub fn read_stored(&mut self, name: &str) -> Result<Stored> {
        let t = self
            .tensor(name)
            .cloned()
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
                ..
            } => {
                let blob = self.read_entry(&blocks_name(name))?;
                let store = BlockStore::from_bytes(&blob).map_err(|source| Error::Blocks {
                    tensor: name.into(),
                    source,
                })?;
                let dtype = Dtype::parse(&t.dtype).unwrap_or(Dtype::U8);
                // every recipe digest pairs with one block: the same block size and count
                if store.rows() != *rows
                    || store.row_bytes() as u64 != *row_bytes
                    || store.kind() != value_kind(dtype)
                    || store.block_rows() != *block_rows
                    || store.num_blocks() != block_sha256.len()
                {
                    return Err(Error::Invalid {
                        tensor: name.into(),
                        reason: "block store shape or kind differs from the recipe".into(),
                    });
                }
                for (i, (d, want)) in store.block_digests().iter().zip(block_sha256).enumerate() {
                    if hex(d) != *want {
                        return Err(Error::Digest {
                            tensor: name.into(),
                            what: format!("block {i} (recipe)"),
                        });
                    }
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
    pub fn read_tensor(&mut self, name: &str) -> Result<(Vec<u8>, bool)> {
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

    /// Checks bytes against the recipe's whole-tensor SHA-256 of `name`.
    fn check_whole(&self, name: &str, bytes: &[u8]) -> Result<()> {
        let want = self.tensor(name).and_then(|t| t.sha256.as_deref());
        if want != Some(sha256_hex(bytes).as_str()) {
            return Err(Error::Digest {
                tensor: name.into(),
                what: "whole tensor".into(),
            });
        }
        Ok(())
    }

    /// [`Artifact::read_tensor`] without the whole-tensor check (block digests are still
    /// checked): the caller checks it, e.g. while writing the bytes out.
    fn decode_tensor(&mut self, name: &str) -> Result<(Vec<u8>, bool)> {
        let t = self
            .tensor(name)
            .cloned()
            .ok_or_else(|| Error::MissingTensor(name.into()))?;
        let dtype = Dtype::parse(&t.dtype).unwrap_or(Dtype::U8);
        let (bytes, exact) = match self.read_stored(name)? {
            Stored::Dense(b) => (b, true),
            Stored::Lossless(store) => (
                store.decode_all().map_err(|source| Error::Blocks {
                    tensor: name.into(),
                    source,
                })?,
                true,
            ),
            Stored::Quantized(p) => {
                let mut v = vec![0f32; p.rows() * p.cols()];
                p.dequantize_into(&mut v).map_err(|source| Error::Quant {
                    tensor: name.into(),
                    source,
                })?;
                (from_f32(dtype, &v), false)
            }
        };
        Ok((bytes, exact))
    }

    /// Calls `sink` with the tensor's decoded bytes in order, at most [`STREAM_BYTES`]
    /// (or one block) at a time, blocks decoded in parallel within each piece, and says
    /// what is left to check (see [`Streamed`]). Memory stays bounded whatever the
    /// tensor's size.
    ///
    /// # Errors
    /// As [`Artifact::read_stored`], and `sink`'s.
    fn stream_tensor(
        &mut self,
        name: &str,
        mut sink: impl FnMut(&[u8]) -> Result<()>,
    ) -> Result<Streamed> {
        let t = self
            .tensor(name)
            .cloned()
            .ok_or_else(|| Error::MissingTensor(name.into()))?;
        let dtype = Dtype::parse(&t.dtype).unwrap_or(Dtype::U8);
        let blocks_err = |source| Error::Blocks {
            tensor: name.into(),
            source,
        };
        match self.read_stored(name)? {
            Stored::Dense(b) => {
                sink(&b)?;
                Ok(Streamed::Verified)
            }
            Stored::Lossless(store) => {
                let (rb, br) = (store.row_bytes(), store.block_rows());
                let block_bytes = rb.saturating_mul(br);
                if block_bytes == 0 {
                    return Ok(Streamed::Decoded);
                }
                let per = (STREAM_BYTES / block_bytes).max(1);
                let (nb, rows) = (store.num_blocks(), store.rows());
                let mut buf = Vec::new();
                let mut b0 = 0;
                while b0 < nb {
                    let b1 = b0.saturating_add(per).min(nb);
                    let r0 = (b0 as u64).saturating_mul(br as u64);
                    let r1 = (b1 as u64).saturating_mul(br as u64).min(rows);
                    let len = usize::try_from(r1.saturating_sub(r0))
                        .ok()
                        .and_then(|r| r.checked_mul(rb))
                        .ok_or_else(|| Error::Invalid {
                            tensor: name.into(),
                            reason: "block range overflows".into(),
                        })?;
                    buf.resize(len, 0);
                    buf.par_chunks_mut(block_bytes)
                        .enumerate()
                        .try_for_each_init(
                            || store.decoder(),
                            |dec, (i, dst)| dec.decode_block(b0 + i, dst).map(drop),
                        )
                        .map_err(blocks_err)?;
                    sink(&buf)?;
                    b0 = b1;
                }
                Ok(Streamed::Decoded)
            }
            Stored::Quantized(p) => {
                let cols = p.cols().max(1);
                let per = (STREAM_BYTES / (4 * cols)).max(1);
                let mut v = Vec::new();
                let mut r0 = 0;
                while r0 < p.rows() {
                    let r1 = r0.saturating_add(per).min(p.rows());
                    v.resize((r1 - r0) * p.cols(), 0f32);
                    p.dequantize_range_into(r0, &mut v)
                        .map_err(|source| Error::Quant {
                            tensor: name.into(),
                            source,
                        })?;
                    sink(&from_f32(dtype, &v))?;
                    r0 = r1;
                }
                Ok(Streamed::Dequantized)
            }
        }
    }

    /// Verifies every tensor: each block's digest (and the recipe's copy of it), the
    /// whole-tensor SHA-256 of what dense and lossless tensors decode to, and every
    /// packed tensor's buffers. Decodes a piece at a time ([`STREAM_BYTES`]), never a
    /// whole tensor, under the limits the artifact was opened with.
    ///
    /// # Errors
    /// The first failure, naming the tensor (and block).
    pub fn verify(&self) -> Result<Summary> {
        let mut me = Self {
            file: SafetensorsFile::open(self.file.path(), &self.limits)?,
            recipe: self.recipe.clone(),
            file_bytes: self.file_bytes,
            limits: self.limits,
        };
        let mut s = Summary {
            file_bytes: self.file_bytes,
            ..Summary::default()
        };
        for t in &self.recipe.tensors {
            s.tensors += 1;
            let want = decoded_bytes(t).unwrap_or(u64::MAX);
            s.dense_bytes = s.dense_bytes.saturating_add(want);
            s.stored_bytes += me.stored_bytes(t);
            match &t.storage {
                StorageRecipe::Dense => s.dense += 1,
                StorageRecipe::Lossless { block_sha256, .. } => {
                    s.lossless += 1;
                    s.blocks += block_sha256.len();
                }
                StorageRecipe::Quant { .. } => s.quantized += 1,
            }
            // only lossless bytes are hashed here: dense bytes were checked as they were
            // read, and packed buffers against their payload digest
            let lossless = matches!(t.storage, StorageRecipe::Lossless { .. });
            let mut h = sha2::Sha256::new();
            let mut got = 0u64;
            let streamed = me.stream_tensor(&t.name, |b| {
                if lossless {
                    h.update(b);
                }
                got = got.saturating_add(b.len() as u64);
                Ok(())
            })?;
            if got != want {
                return Err(Error::Invalid {
                    tensor: t.name.clone(),
                    reason: format!("decoded {got} bytes, expected {want}"),
                });
            }
            if streamed == Streamed::Decoded {
                check_digest(t, h)?;
            }
        }
        Ok(s)
    }
}

/// Decoded bytes a streaming read ([`Artifact::verify`], [`unpack`]) holds at once.
pub const STREAM_BYTES: usize = 64 << 20;

/// What a streaming read of one tensor leaves to its caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Streamed {
    /// Dense bytes, already checked against the whole-tensor digest as they were read.
    Verified,
    /// Lossless bytes (every block checked): the whole-tensor digest is the caller's.
    Decoded,
    /// Dequantized values (the packed buffers were checked against their digest).
    Dequantized,
}

/// The whole-tensor digest of `t` against what `h` was fed.
fn check_digest(t: &TensorRecipe, h: sha2::Sha256) -> Result<()> {
    let d: [u8; 32] = h.finalize().into();
    if t.sha256.as_deref() == Some(hex(&d).as_str()) {
        Ok(())
    } else {
        Err(Error::Digest {
            tensor: t.name.clone(),
            what: "whole tensor".into(),
        })
    }
}

/// What a recipe entry decodes to, in bytes (`None` when that overflows).
fn decoded_bytes(t: &TensorRecipe) -> Option<u64> {
    let size = Dtype::parse(&t.dtype).map_or(1, Dtype::size) as u64;
    t.shape
        .iter()
        .try_fold(size, |a, &d| a.checked_mul(d as u64))
}

/// The decoded-size limits, from the recipe's shapes and the payload's sizes, before any
/// payload is read.
fn check_decoded(
    path: &Path,
    file: &SafetensorsFile,
    recipe: &Recipe,
    limits: &Limits,
) -> Result<()> {
    let mut total = 0u64;
    for t in &recipe.tensors {
        let too_large = |what: String, got: u64, limit: u64| Error::TooLarge {
            path: path.to_path_buf(),
            what,
            got,
            limit,
        };
        let decoded = decoded_bytes(t).ok_or_else(|| {
            too_large(
                format!("tensor `{}` decoded", t.name),
                u64::MAX,
                limits.max_decoded_tensor,
            )
        })?;
        if decoded > limits.max_decoded_tensor {
            return Err(too_large(
                format!("tensor `{}` decoded", t.name),
                decoded,
                limits.max_decoded_tensor,
            ));
        }
        total = total.saturating_add(decoded);
        if total > limits.max_decoded_total {
            return Err(too_large(
                "the artifact decoded".into(),
                total,
                limits.max_decoded_total,
            ));
        }
        let stored = payload_names(t)
            .iter()
            .filter_map(|n| file.entry(n))
            .fold(0u64, |a, e| a.saturating_add(e.len()));
        if decoded > EXPANSION_FLOOR && decoded > stored.saturating_mul(limits.max_expansion) {
            return Err(Error::Expansion {
                path: path.to_path_buf(),
                tensor: t.name.clone(),
                decoded,
                stored,
                limit: limits.max_expansion,
            });
        }
    }
    Ok(())
}

/// The payload tensors a recipe entry owns.
fn payload_names(t: &TensorRecipe) -> Vec<String> {
    match &t.storage {
        StorageRecipe::Dense => vec![t.name.clone()],
        StorageRecipe::Lossless { .. } => vec![blocks_name(&t.name)],
        StorageRecipe::Quant { .. } => vec![
            codes_name(&t.name),
            scales_name(&t.name),
            mins_name(&t.name),
        ],
    }
}

/// One recipe entry against the payload, without reading any payload.
fn check_tensor(
    file: &SafetensorsFile,
    t: &TensorRecipe,
    used: &mut HashSet<String>,
) -> std::result::Result<(), String> {
    let n = &t.name;
    let dtype = Dtype::parse(&t.dtype).ok_or(format!("tensor `{n}`: unknown dtype {}", t.dtype))?;
    let numel = t
        .shape
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d as u64))
        .ok_or(format!("tensor `{n}`: shape {:?} overflows", t.shape))?;
    let dense_len = numel
        .checked_mul(dtype.size() as u64)
        .ok_or(format!("tensor `{n}`: too large"))?;
    let entry = |name: &str, want: Option<Dtype>| -> std::result::Result<Entry, String> {
        let e = file
            .entry(name)
            .ok_or(format!("tensor `{n}`: payload `{name}` is missing"))?;
        // payload tensors (all but a dense tensor's own) are one-dimensional
        if name != n && e.shape.len() != 1 {
            return Err(format!(
                "payload `{name}` has shape {:?}, not one dimension",
                e.shape
            ));
        }
        if let Some(d) = want
            && e.dtype != d
        {
            return Err(format!(
                "payload `{name}` is {}, expected {}",
                e.dtype.name(),
                d.name()
            ));
        }
        Ok(e.clone())
    };
    let hex_ok = |s: &str| s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit());
    match &t.storage {
        StorageRecipe::Dense => {
            let e = entry(n, Some(dtype))?;
            if e.shape != t.shape {
                return Err(format!(
                    "tensor `{n}`: payload shape {:?}, recipe {:?}",
                    e.shape, t.shape
                ));
            }
            if !t.sha256.as_deref().is_some_and(hex_ok) {
                return Err(format!("tensor `{n}`: dense storage needs a SHA-256"));
            }
            used.insert(n.clone());
        }
        StorageRecipe::Lossless {
            block_rows,
            rows,
            row_bytes,
            element_size,
            block_sha256,
            ..
        } => {
            let e = entry(&blocks_name(n), Some(Dtype::U8))?;
            let (r, rb) = row_view(dtype, &t.shape);
            if (r, rb) != (*rows, *row_bytes) || *element_size != dtype.size().max(1) {
                return Err(format!(
                    "tensor `{n}`: row view {rows} x {row_bytes} (element {element_size}) does not fit {:?} {}",
                    t.shape, t.dtype
                ));
            }
            if *block_rows == 0 {
                return Err(format!("tensor `{n}`: block_rows is 0"));
            }
            let blocks = rows.div_ceil(*block_rows as u64);
            if block_sha256.len() as u64 != blocks || !block_sha256.iter().all(|s| hex_ok(s)) {
                return Err(format!(
                    "tensor `{n}`: {} block digests for {blocks} blocks",
                    block_sha256.len()
                ));
            }
            if !t.sha256.as_deref().is_some_and(hex_ok) {
                return Err(format!("tensor `{n}`: lossless storage needs a SHA-256"));
            }
            // a block store is at most its dense bytes plus per-block overhead
            let es = *element_size as u64;
            let bound = dense_len
                .saturating_add(4096)
                .saturating_add(blocks.saturating_mul(es.saturating_mul(8).saturating_add(52)))
                .saturating_add(es.saturating_mul(2048));
            if e.len() > bound {
                return Err(format!(
                    "tensor `{n}`: {} bytes of blocks for {dense_len} dense",
                    e.len()
                ));
            }
            used.insert(e.name);
        }
        StorageRecipe::Quant {
            format,
            rows,
            cols,
            payload_sha256,
        } => {
            if !hex_ok(payload_sha256) {
                return Err(format!("tensor `{n}`: no payload SHA-256"));
            }
            if t.sha256.is_some() {
                return Err(format!(
                    "tensor `{n}`: a quantized tensor has no whole-tensor sha256 (its payload_sha256 seals it)"
                ));
            }
            let f = Format::parse(format).map_err(|e| format!("tensor `{n}`: {e}"))?;
            if !dtype.is_float()
                || (*rows as u64).checked_mul(*cols as u64) != Some(numel)
                || t.shape.first() != Some(rows)
            {
                return Err(format!(
                    "tensor `{n}`: quantized as {rows} x {cols}, shape {:?} {}",
                    t.shape, t.dtype
                ));
            }
            let codes = entry(&codes_name(n), Some(Dtype::U8))?;
            if (*rows as u64).checked_mul(f.row_code_bytes(*cols) as u64) != Some(codes.len()) {
                return Err(format!(
                    "tensor `{n}`: {} code bytes for {rows} x {cols} {f}",
                    codes.len()
                ));
            }
            used.insert(codes.name);
            let (per_row, group) = match f.group() {
                Some(g) => (cols.div_ceil(g), true),
                None if matches!(f, Format::F16 | Format::Bf16) => (0, false),
                None => (1, false),
            };
            let want = (*rows as u64)
                .checked_mul(per_row as u64)
                .ok_or(format!("tensor `{n}`: {rows} x {per_row} scales overflow"))?;
            let count = |e: &Entry| {
                e.shape
                    .iter()
                    .try_fold(1u64, |a, &d| a.checked_mul(d as u64))
            };
            let sdt = if group { Dtype::F16 } else { Dtype::F32 };
            if want > 0 {
                let s = entry(&scales_name(n), Some(sdt))?;
                if count(&s) != Some(want) {
                    return Err(format!(
                        "tensor `{n}`: {:?} scales, expected {want}",
                        s.shape
                    ));
                }
                used.insert(s.name);
            }
            if matches!(f, Format::Int4Block(_)) {
                let m = entry(&mins_name(n), Some(Dtype::F16))?;
                if count(&m) != Some(want) {
                    return Err(format!(
                        "tensor `{n}`: {:?} minimums, expected {want}",
                        m.shape
                    ));
                }
                used.insert(m.name);
            }
        }
    }
    Ok(())
}

/// Writes a plain safetensors file from an artifact: every tensor under its own name and
/// dtype, byte-identical to the original for dense and lossless storage (dequantized for
/// quantized tensors), with the source's `__metadata__`. Streams a tensor at a time;
/// written beside `dest` and renamed when complete.
///
/// # Errors
/// Any read or verification error (nothing is left at `dest`).
pub fn unpack(
    artifact: &mut Artifact,
    dest: &Path,
    mut progress: impl FnMut(&str, u64),
) -> Result<Summary> {
    let tensors = artifact.recipe().tensors.clone();
    let planned: Vec<Planned> = tensors
        .iter()
        .map(|t| {
            let dtype = Dtype::parse(&t.dtype).unwrap_or(Dtype::U8);
            Planned {
                name: t.name.clone(),
                dtype,
                shape: t.shape.clone(),
                // bounded by the limits `Artifact::open` checked
                len: decoded_bytes(t).unwrap_or(u64::MAX),
            }
        })
        .collect();
    let header = header_bytes(&planned, &artifact.recipe().source_metadata)?;
    let mut out = AtomicFile::create(dest)?;
    out.write_all(&header)?;
    let mut s = Summary::default();
    for (t, p) in tensors.iter().zip(&planned) {
        // a piece at a time: the digest on one core while the other writes; a mismatch
        // abandons the file before it is renamed
        // lossless bytes hashed as they are written (dense ones were checked on reading)
        let lossless = matches!(t.storage, StorageRecipe::Lossless { .. });
        let mut h = sha2::Sha256::new();
        let mut got = 0u64;
        let streamed = artifact.stream_tensor(&t.name, |piece| {
            got = got.saturating_add(piece.len() as u64);
            if got > p.len {
                return Err(Error::Invalid {
                    tensor: t.name.clone(),
                    reason: format!("decodes to more than {} bytes", p.len),
                });
            }
            if !lossless {
                return out.write_all(piece);
            }
            let ((), written) = rayon::join(|| h.update(piece), || out.write_all(piece));
            written
        })?;
        if got != p.len {
            return Err(Error::Invalid {
                tensor: t.name.clone(),
                reason: format!("decoded {got} bytes, expected {}", p.len),
            });
        }
        if streamed == Streamed::Decoded {
            check_digest(t, h)?;
        }
        s.tensors += 1;
        s.dense_bytes += p.len;
        if streamed != Streamed::Dequantized {
            s.lossless += 1;
        } else {
            s.quantized += 1;
        }
        progress(&t.name, p.len);
    }
    out.commit()?;
    s.file_bytes = std::fs::metadata(dest).map(|m| m.len()).unwrap_or(0);
    Ok(s)
}
