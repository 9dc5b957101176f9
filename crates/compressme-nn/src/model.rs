//! The model trait: named modules, output heads, storage swaps and byte accounting.

use compressme_quant::Format;
use serde::{Deserialize, Serialize};

use crate::{Embedding, Error, Hooks, Linear, PackOptions, Result, Table, Weight};

/// What a module's weights should be stored as.
#[derive(Debug, Clone, PartialEq)]
pub enum Storage {
    /// Dense f32.
    Dense,
    /// A `compressme-quant` format (`Int8Rows` for embeddings only; linears use `Int8`).
    Quant(Format),
    /// Lossless row blocks (exact; for linears, decoded at every product).
    Lossless(PackOptions),
}

/// A linear or an embedding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModuleKind {
    /// `y = x W^T + b`.
    Linear,
    /// A lookup table.
    Embedding,
}

/// One named module as a model lists it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModuleInfo {
    /// The dotted name (the checkpoint's, without `.weight`).
    pub name: String,
    /// Linear or embedding.
    pub kind: ModuleKind,
    /// Output features (linear) or table rows (embedding).
    pub rows: usize,
    /// Input features (linear) or embedding width.
    pub cols: usize,
    /// `dense f32`, a format name, or `lossless`.
    pub storage: String,
    /// Bytes kept now (weight and bias).
    pub stored_bytes: u64,
    /// Bytes in the original dtype (f32 for linears).
    pub dense_bytes: u64,
}

/// A model's bytes: its named modules and everything else it holds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StorageReport {
    /// Per named module.
    pub modules: Vec<ModuleInfo>,
    /// Tensors outside the named modules (norms, position tables, ...), held dense.
    pub other_bytes: u64,
}

impl StorageReport {
    /// Every byte the model keeps.
    #[must_use]
    pub fn stored_bytes(&self) -> u64 {
        self.modules.iter().map(|m| m.stored_bytes).sum::<u64>() + self.other_bytes
    }

    /// Every byte of the model held dense.
    #[must_use]
    pub fn dense_bytes(&self) -> u64 {
        self.modules.iter().map(|m| m.dense_bytes).sum::<u64>() + self.other_bytes
    }
}

/// A borrowed module.
#[derive(Debug)]
pub enum ModuleRef<'a> {
    /// A linear layer.
    Linear(&'a Linear),
    /// An embedding.
    Embedding(&'a Embedding),
}

/// A mutably borrowed module.
#[derive(Debug)]
pub enum ModuleMut<'a> {
    /// A linear layer.
    Linear(&'a mut Linear),
    /// An embedding.
    Embedding(&'a mut Embedding),
}

enum Staged {
    Linear(Weight),
    Embedding(Table),
}

/// A model whose linears and embeddings can be listed, observed and re-stored by name.
pub trait Model {
    /// Names of every linear and embedding, in forward order.
    fn module_names(&self) -> Vec<String>;

    /// The module called `name`.
    fn module(&self, name: &str) -> Option<ModuleRef<'_>>;

    /// The module called `name`, mutably.
    fn module_mut(&mut self, name: &str) -> Option<ModuleMut<'_>>;

    /// Names of the modules that produce the model's outputs (`lm_head` for a causal
    /// model; none for an encoder whose output is pooled hidden states).
    fn output_heads(&self) -> Vec<String>;

    /// The observer slot every module of this model reports to.
    fn hooks(&self) -> &Hooks;

    /// Bytes of tensors outside the named modules.
    fn other_bytes(&self) -> u64;

    /// Every named module with its shape, storage and bytes.
    fn modules(&self) -> Vec<ModuleInfo> {
        self.module_names()
            .iter()
            .filter_map(|n| self.module(n))
            .map(|m| match m {
                ModuleRef::Linear(l) => ModuleInfo {
                    name: l.name().to_string(),
                    kind: ModuleKind::Linear,
                    rows: l.shape().0,
                    cols: l.shape().1,
                    storage: l.weight().describe(),
                    stored_bytes: l.stored_bytes(),
                    dense_bytes: l.dense_bytes(),
                },
                ModuleRef::Embedding(e) => ModuleInfo {
                    name: e.name().to_string(),
                    kind: ModuleKind::Embedding,
                    rows: e.shape().0,
                    cols: e.shape().1,
                    storage: e.table().describe(),
                    stored_bytes: e.stored_bytes(),
                    dense_bytes: e.dense_bytes(),
                },
            })
            .collect()
    }

    /// Stored against dense bytes for the whole model.
    fn storage_report(&self) -> StorageReport {
        StorageReport {
            modules: self.modules(),
            other_bytes: self.other_bytes(),
        }
    }

    /// Re-stores modules by name, all or nothing: every change is checked and built
    /// first, and the model is left as it was if any fails.
    ///
    /// # Errors
    /// [`Error::UnknownModule`] (listing a few known names), [`Error::BadStorage`] for a
    /// storage the module cannot take, a name given twice, and packing or quantization
    /// errors.
    fn set_storage(&mut self, changes: &[(String, Storage)]) -> Result<()> {
        let mut seen = std::collections::HashSet::new();
        let mut staged = Vec::with_capacity(changes.len());
        for (name, storage) in changes {
            if !seen.insert(name.as_str()) {
                return Err(Error::BadStorage {
                    module: name.clone(),
                    reason: "named twice in one change".into(),
                });
            }
            let built = match self.module(name) {
                Some(ModuleRef::Linear(l)) => {
                    let device = match l.weight() {
                        Weight::Dense(t) => t.device().clone(),
                        Weight::Packed(_)
                        | Weight::Ggml(_)
                        | Weight::GgmlReplica(..)
                        | Weight::Lossless(_) => candle_core::Device::Cpu,
                    };
                    Staged::Linear(l.prepare(storage, &device)?)
                }
                Some(ModuleRef::Embedding(e)) => Staged::Embedding(e.prepare(storage)?),
                None => {
                    let known = self.module_names();
                    return Err(Error::UnknownModule {
                        name: name.clone(),
                        known: known.iter().take(6).cloned().collect::<Vec<_>>().join(", "),
                        count: known.len(),
                    });
                }
            };
            staged.push((name, built));
        }
        for (name, built) in staged {
            match (self.module_mut(name), built) {
                (Some(ModuleMut::Linear(l)), Staged::Linear(w)) => l.set_weight(w)?,
                (Some(ModuleMut::Embedding(e)), Staged::Embedding(t)) => e.set_table(t),
                _ => {
                    return Err(Error::BadStorage {
                        module: name.clone(),
                        reason: "module changed kind while staging".into(),
                    });
                }
            }
        }
        Ok(())
    }
}
