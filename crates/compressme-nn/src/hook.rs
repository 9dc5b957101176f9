//! Activation hooks: modules report their inputs to an observer, by stable dotted name.

use std::sync::{Arc, PoisonError, RwLock};

use candle_core::Tensor;

use crate::{Error, Result};

/// Receives what a module saw: a [`crate::Linear`]'s input, an [`crate::Embedding`]'s
/// output. `module` is the checkpoint's dotted name (`encoder.layer.0.attention.self.query`).
pub trait Observer: Send + Sync {
    /// Called once per forward call of each module, before the module computes.
    ///
    /// # Errors
    /// An error stops the forward pass and is returned to its caller.
    fn observe(&self, module: &str, activations: &Tensor) -> Result<()>;
}

/// The observer slot one model's modules share. Cloning shares the slot.
///
/// With nothing installed a module pays one uncontended read lock per call.
#[derive(Clone, Default)]
pub struct Hooks(Arc<RwLock<Option<Arc<dyn Observer>>>>);

impl std::fmt::Debug for Hooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hooks")
            .field("installed", &self.installed())
            .finish()
    }
}

impl Hooks {
    /// Installs `observer` until the returned guard is dropped (RAII: an error or a panic
    /// in the caller's loop still uninstalls it).
    ///
    /// # Errors
    /// [`Error::Observer`] when an observer is already installed.
    pub fn install(&self, observer: Arc<dyn Observer>) -> Result<HookGuard> {
        let mut slot = self.0.write().unwrap_or_else(PoisonError::into_inner);
        if slot.is_some() {
            return Err(Error::Observer("an observer is already installed".into()));
        }
        *slot = Some(observer);
        Ok(HookGuard {
            hooks: self.clone(),
        })
    }

    /// Whether an observer is installed.
    #[must_use]
    pub fn installed(&self) -> bool {
        self.0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }

    /// Reports `activations` of `module` to the observer, if any.
    ///
    /// # Errors
    /// Whatever the observer returns.
    pub fn observe(&self, module: &str, activations: &Tensor) -> Result<()> {
        let observer = self
            .0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        match observer {
            Some(o) => o.observe(module, activations),
            None => Ok(()),
        }
    }
}

/// Uninstalls the observer when dropped.
#[must_use = "the observer is uninstalled when the guard is dropped"]
#[derive(Debug)]
pub struct HookGuard {
    hooks: Hooks,
}

impl Drop for HookGuard {
    fn drop(&mut self) {
        *self.hooks.0.write().unwrap_or_else(PoisonError::into_inner) = None;
    }
}
