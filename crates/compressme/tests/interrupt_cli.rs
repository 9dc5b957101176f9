//! An interrupted `pack` or `unpack` (SIGTERM or SIGINT while it writes) leaves no
//! temporary file behind, and a later run removes the stale temporaries of a process
//! that was killed outright (SIGKILL), touching nothing else.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, missing_docs)] // tests
// one call to kill(2) a test: std sends only SIGKILL
#![allow(unsafe_code)]

#[allow(dead_code)] // each test binary uses part of the shared helpers
mod common;

use std::collections::HashMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::Scratch;

fn tmp(name: &str) -> Scratch {
    Scratch::new(&format!("cm-interrupt-{name}"))
}

/// A safetensors checkpoint of eight f32 tensors of 16 MiB each (smooth values with
/// noise: not trivially compressible), big enough that packing it takes a while.
fn checkpoint(path: &Path) {
    let mut tensors = HashMap::new();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let data: Vec<Vec<u8>> = (0..8)
        .map(|_| {
            (0..4 << 20)
                .flat_map(|i| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    let noise = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                    (((i % 1024) as f32 * 0.01).sin() * 0.1 + noise * 0.02).to_le_bytes()
                })
                .collect()
        })
        .collect();
    for (i, d) in data.iter().enumerate() {
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![4096, 1024], d)
                .unwrap();
        tensors.insert(format!("layer{i}.weight"), view);
    }
    safetensors::serialize_to_file(&tensors, None, path).unwrap();
}

fn spawn(args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_compressme"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The names in `dir` that start with `.` (the temporaries).
fn hidden(dir: &Path) -> Vec<(String, u64)> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            let len = e.metadata().map(|m| m.len()).unwrap_or(0);
            n.starts_with('.').then_some((n, len))
        })
        .collect()
}

/// Waits until `child` has written some bytes to a temporary in `dir`, then sends it
/// `signal`, and returns its exit code and stderr.
fn interrupt(mut child: Child, dir: &Path, signal: i32) -> (Option<i32>, String) {
    let t = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            let out = child.wait_with_output().unwrap();
            panic!(
                "the run finished before it could be interrupted: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        if hidden(dir).iter().any(|(_, len)| *len > 0) {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "no temporary appeared"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    let pid = i32::try_from(child.id()).unwrap();
    // SAFETY: kill(2) with a live child's pid and a valid signal number.
    assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn interrupted_pack_and_unpack_leave_no_temporary_file() {
    let d = tmp("signals");
    let input = d.join("in.safetensors");
    checkpoint(&input);
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let art = d.join("out.cma");
    for (signal, code) in [(libc::SIGTERM, 143), (libc::SIGINT, 130)] {
        let child = spawn(&["pack", &s(&input), "--lossless", "-o", &s(&art)]);
        let (got, err) = interrupt(child, &d, signal);
        assert_eq!(got, Some(code), "pack: {err}");
        assert!(err.contains("interrupted: removed"), "{err}");
        assert_eq!(hidden(&d), vec![], "pack left a temporary");
        assert!(!art.exists());
    }
    // a complete artifact to unpack
    let out = Command::new(env!("CARGO_BIN_EXE_compressme"))
        .args(["pack", &s(&input), "--lossless", "-o", &s(&art)])
        .output()
        .unwrap();
    assert!(out.status.success());
    let back = d.join("back.safetensors");
    for (signal, code) in [(libc::SIGTERM, 143), (libc::SIGINT, 130)] {
        let child = spawn(&["unpack", &s(&art), "-o", &s(&back)]);
        let (got, err) = interrupt(child, &d, signal);
        assert_eq!(got, Some(code), "unpack: {err}");
        assert_eq!(hidden(&d), vec![], "unpack left a temporary");
        assert!(!back.exists());
    }

    // SIGKILL runs no handler: the next run writing the same output removes what the
    // dead process left, and nothing that is not its own
    let child = spawn(&["unpack", &s(&art), "-o", &s(&back)]);
    let (got, _) = interrupt(child, &d, libc::SIGKILL);
    assert_eq!(got, None);
    let left = hidden(&d);
    assert_eq!(left.len(), 1, "{left:?}");
    assert!(left[0].0.starts_with(".back.safetensors.tmp-"), "{left:?}");
    // a live process's temporary (ours) and other names stay
    let ours = d.join(format!(".back.safetensors.tmp-{}", std::process::id()));
    let other = d.join(".notes.tmp-1");
    let not_a_pid = d.join(".back.safetensors.tmp-x1");
    for f in [&ours, &other, &not_a_pid] {
        std::fs::write(f, b"keep").unwrap();
    }
    let (ok, _, err) = common::run(&["unpack", &s(&art), "-o", &s(&back)]);
    assert!(ok, "{err}");
    let mut left: Vec<String> = hidden(&d).into_iter().map(|(n, _)| n).collect();
    left.sort();
    let mut want: Vec<String> = [&ours, &other, &not_a_pid]
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    want.sort();
    assert_eq!(left, want);
}
