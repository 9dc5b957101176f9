//! Helpers shared by the CLI tests.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A test's folder under the system's temporary folder, made empty at the start and removed
/// when the test ends. A failed test keeps it for a look unless it was made with
/// [`Scratch::removed_always`] (for folders of model-sized files, which would fill the disk
/// of a machine that runs the tests again and again).
#[allow(dead_code)] // not every test binary uses every helper
pub(crate) struct Scratch {
    path: PathBuf,
    keep_on_failure: bool,
}

#[allow(dead_code)]
impl Scratch {
    /// `<temp>/<name>-<pid>`, empty; kept if the test fails.
    pub(crate) fn new(name: &str) -> Self {
        Self::make(name, true)
    }

    /// Like [`Scratch::new`], but removed when the test fails too.
    pub(crate) fn removed_always(name: &str) -> Self {
        Self::make(name, false)
    }

    fn make(name: &str, keep_on_failure: bool) -> Self {
        let path = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
        drop(std::fs::remove_dir_all(&path));
        std::fs::create_dir_all(&path).unwrap();
        Self {
            path,
            keep_on_failure,
        }
    }
}

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.path
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !(self.keep_on_failure && std::thread::panicking()) {
            drop(std::fs::remove_dir_all(&self.path));
        }
    }
}

/// The workspace root.
pub(crate) fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs the built `compressme` with `args`: (success, stdout, stderr).
pub(crate) fn run(args: &[&str]) -> (bool, String, String) {
    run_env(args, &[])
}

/// [`run`] with environment variables set for the child.
pub(crate) fn run_env(args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_compressme"))
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}
