//! `compressme embed` against the golden sentence embeddings from `transformers`.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, missing_docs)] // tests

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn minilm() -> Option<PathBuf> {
    let dir = root().join("cache/minilm");
    if dir.join("model.safetensors").exists() {
        return Some(dir);
    }
    assert!(
        std::env::var_os("COMPRESSME_SKIP_FIXTURES").is_some(),
        "cache/minilm is missing; run `cargo xtask fixtures` (or set COMPRESSME_SKIP_FIXTURES=1 to skip the tests that need it)"
    );
    eprintln!("skipped (COMPRESSME_SKIP_FIXTURES): cache/minilm is absent");
    None
}

fn run(args: &[&str], stdin: &str) -> (bool, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_compressme"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // a command that fails before reading its input closes the pipe: that is not an error
    // of the test
    if let Err(e) = child.stdin.take().unwrap().write_all(stdin.as_bytes()) {
        assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe, "{e}");
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

#[test]
fn embed_prints_one_golden_embedding_per_line() {
    let Some(dir) = minilm() else { return };
    let golden: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("fixtures/bert/minilm_golden.json")).unwrap(),
    )
    .unwrap();
    let sentences: Vec<&str> = golden["sentences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    let input = sentences.join("\n") + "\n";
    let file = std::env::temp_dir().join(format!("compressme-embed-{}.txt", std::process::id()));
    std::fs::write(&file, &input).unwrap();
    let d = dir.to_str().unwrap();
    // from a file in batches of 5, and from stdin in one batch
    for (args, stdin) in [
        (
            vec![
                "embed",
                d,
                "--text",
                file.to_str().unwrap(),
                "--batch",
                "5",
                "--json",
            ],
            "",
        ),
        (vec!["embed", d, "--batch", "64"], input.as_str()),
    ] {
        let (ok, out, err) = run(&args, stdin);
        assert!(ok, "{err}");
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), sentences.len());
        let mut worst = 0f64;
        for (line, want) in lines.iter().zip(golden["embeddings"].as_array().unwrap()) {
            let got: Vec<f64> = serde_json::from_str(line).unwrap();
            let want: Vec<f64> = want
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap())
                .collect();
            assert_eq!(got.len(), 384);
            for (a, b) in got.iter().zip(&want) {
                worst = worst.max((a - b).abs());
            }
        }
        assert!(worst <= 1e-5, "max difference {worst}");
        if args.contains(&"--json") {
            let meta: serde_json::Value = serde_json::from_str(err.trim()).unwrap();
            assert_eq!(meta["lines"], sentences.len());
        }
    }
    std::fs::remove_file(&file).unwrap();
    // no input, no output
    let (ok, out, _) = run(&["embed", d], "");
    assert!(ok);
    assert!(out.is_empty());
}

#[test]
fn embed_refuses_remote_ids_and_missing_folders() {
    let (ok, _, err) = run(&["embed", "sentence-transformers/all-MiniLM-L6-v2"], "hi\n");
    assert!(!ok);
    assert!(
        err.contains("remote model identifiers are not resolved"),
        "{err}"
    );
    let (ok, _, err) = run(&["embed", "/no/such/folder"], "hi\n");
    assert!(!ok);
    assert!(err.contains("/no/such/folder"), "{err}");
}

/// `embed --artifact`: the weights from an artifact, each module in its storage. A
/// lossless artifact gives the dense checkpoint's embeddings exactly; an NF4-g64 one
/// gives close ones.
#[test]
fn embed_from_an_artifact() {
    let Some(dir) = minilm() else { return };
    let work = std::env::temp_dir().join(format!("cm-embed-artifact-{}", std::process::id()));
    std::fs::create_dir_all(&work).unwrap();
    let input = "a first sentence\nand a second, longer one\n";
    let (ok, dense, err) = run(&["embed", dir.to_str().unwrap()], input);
    assert!(ok, "{err}");
    for (name, how) in [("lossless", "--lossless"), ("nf4", "--format")] {
        let art = work.join(format!("{name}.cma"));
        let mut args = vec!["pack", dir.to_str().unwrap(), how];
        if name == "nf4" {
            args.push("nf4-g64");
        }
        args.extend(["-o", art.to_str().unwrap()]);
        let (ok, _, err) = run(&args, "");
        assert!(ok, "{err}");
        let (ok, got, err) = run(
            &[
                "embed",
                dir.to_str().unwrap(),
                "--artifact",
                art.to_str().unwrap(),
            ],
            input,
        );
        assert!(ok, "{err}");
        assert_eq!(got.lines().count(), 2);
        if name == "lossless" {
            assert_eq!(
                got, dense,
                "a lossless artifact embeds exactly as the checkpoint"
            );
        } else {
            for (a, b) in got.lines().zip(dense.lines()) {
                let a: Vec<f64> = serde_json::from_str(a).unwrap();
                let b: Vec<f64> = serde_json::from_str(b).unwrap();
                let cos = a.iter().zip(&b).map(|(x, y)| x * y).sum::<f64>();
                assert!(cos > 0.8 && cos < 1.0 + 1e-6, "{cos}");
            }
        }
    }
    std::fs::remove_dir_all(&work).unwrap();
}
