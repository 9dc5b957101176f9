//! Reading a checkpoint: one safetensors file, a folder, or a sharded checkpoint through
//! its index JSON, a tensor at a time.
#![deny(clippy::arithmetic_side_effects)] // reads files: no unchecked arithmetic

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::st::{Entry, Limits, Mapped, SafetensorsFile};
use crate::{Error, Result};

/// A checkpoint's tensors across one or more safetensors files.
#[derive(Debug)]
pub struct Checkpoint {
    files: Vec<SafetensorsFile>,
    /// Tensor name -> (file index, entry), in name order.
    tensors: BTreeMap<String, (usize, Entry)>,
    metadata: BTreeMap<String, String>,
}

impl Checkpoint {
    /// Opens `path`: a `.safetensors` file, a `*.index.json` of a sharded checkpoint, or a
    /// folder holding `model.safetensors` or `model.safetensors.index.json`.
    ///
    /// # Errors
    /// [`Error::Io`] for a missing path, [`Error::NotSafetensors`] for a file that is not
    /// one (or an index that names no shards), and a tensor in two shards.
    pub fn open(path: &Path, limits: &Limits) -> Result<Self> {
        let missing = |p: &Path| Error::Io {
            path: p.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or folder"),
        };
        let path = if path.is_dir() {
            let single = path.join("model.safetensors");
            let index = path.join("model.safetensors.index.json");
            if single.exists() {
                single
            } else if index.exists() {
                index
            } else {
                return Err(missing(&single));
            }
        } else if path.exists() {
            path.to_path_buf()
        } else {
            return Err(missing(path));
        };
        let shards: Vec<PathBuf> = if path.extension().is_some_and(|e| e == "json") {
            shard_files(&path)?
        } else {
            vec![path.clone()]
        };
        let mut files = Vec::with_capacity(shards.len());
        let mut tensors = BTreeMap::new();
        let mut metadata = BTreeMap::new();
        for (i, shard) in shards.iter().enumerate() {
            let f = SafetensorsFile::open(shard, limits)?;
            for e in f.entries() {
                if tensors.insert(e.name.clone(), (i, e.clone())).is_some() {
                    return Err(Error::NotSafetensors {
                        path: shard.clone(),
                        reason: format!("tensor `{}` is in more than one shard", e.name),
                    });
                }
            }
            metadata.extend(f.metadata().clone());
            files.push(f);
        }
        Ok(Self {
            files,
            tensors,
            metadata,
        })
    }

    /// Every tensor, in name order.
    pub fn entries(&self) -> impl Iterator<Item = &Entry> {
        self.tensors.values().map(|(_, e)| e)
    }

    /// The files' `__metadata__`, merged.
    #[must_use]
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// A checkpoint of one file: its header as it is in the file (after the length
    /// prefix), for [`crate::Writer::set_source_header`]. `None` for a sharded one (its
    /// shards' headers are not recorded; `unpack` writes one file).
    #[must_use]
    pub fn source_header(&self) -> Option<&[u8]> {
        match self.files.as_slice() {
            [one] => Some(one.header_text()),
            _ => None,
        }
    }

    /// Bytes of the largest tensor.
    #[must_use]
    pub fn largest(&self) -> u64 {
        self.entries().map(Entry::len).max().unwrap_or(0)
    }

    /// Reads one tensor's bytes.
    ///
    /// # Errors
    /// [`Error::MissingTensor`], [`Error::Io`].
    pub fn read(&self, name: &str) -> Result<Vec<u8>> {
        Ok(self.map(name)?.to_vec())
    }

    /// One tensor's bytes, memory-mapped ([`SafetensorsFile::map`]): nothing copied, and
    /// the pages released when the map is dropped.
    ///
    /// # Errors
    /// [`Error::MissingTensor`], [`Error::Io`].
    pub fn map(&self, name: &str) -> Result<Mapped> {
        let (i, e) = self
            .tensors
            .get(name)
            .ok_or_else(|| Error::MissingTensor(name.into()))?;
        match self.files.get(*i) {
            Some(f) => f.map(e),
            None => Err(Error::MissingTensor(name.into())),
        }
    }
}

fn shard_files(index: &Path) -> Result<Vec<PathBuf>> {
    let bad = |reason: String| Error::NotSafetensors {
        path: index.to_path_buf(),
        reason,
    };
    let text = std::fs::read_to_string(index).map_err(|source| Error::Io {
        path: index.to_path_buf(),
        source,
    })?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("index is not JSON: {e}")))?;
    let map = v
        .get("weight_map")
        .and_then(serde_json::Value::as_object)
        .ok_or_else(|| bad("index has no weight_map".into()))?;
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut files: Vec<PathBuf> = Vec::new();
    for f in map.values() {
        let name = f
            .as_str()
            .ok_or_else(|| bad("weight_map values must be file names".into()))?;
        if name.contains("..") || Path::new(name).is_absolute() {
            return Err(bad(format!("shard `{name}` is outside the folder")));
        }
        let p = dir.join(name);
        if !files.contains(&p) {
            files.push(p);
        }
    }
    if files.is_empty() {
        return Err(bad("index names no shards".into()));
    }
    files.sort();
    Ok(files)
}
