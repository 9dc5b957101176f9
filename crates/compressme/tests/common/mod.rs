//! Helpers shared by the CLI tests.

use std::path::PathBuf;
use std::process::Command;

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
