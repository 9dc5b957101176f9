//! `pack`, `verify`, `unpack` and `inspect` through the built binary, on the committed
//! tiny BERT and on the real MiniLM checkpoint.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, missing_docs)] // tests

mod common;

use std::path::Path;

use common::{Scratch, root, run};

fn tmp(name: &str) -> Scratch {
    Scratch::new(&format!("cm-cli-{name}"))
}

/// Every tensor of `a` is in `b` with the same dtype, shape and bytes.
fn same_tensors(a: &Path, b: &Path) -> usize {
    let (ra, rb) = (std::fs::read(a).unwrap(), std::fs::read(b).unwrap());
    let (sa, sb) = (
        safetensors::SafeTensors::deserialize(&ra).unwrap(),
        safetensors::SafeTensors::deserialize(&rb).unwrap(),
    );
    assert_eq!(sa.len(), sb.len());
    for (name, va) in sa.tensors() {
        let vb = sb.tensor(&name).unwrap();
        assert_eq!(va.dtype(), vb.dtype(), "{name}");
        assert_eq!(va.shape(), vb.shape(), "{name}");
        assert!(va.data() == vb.data(), "{name} differs");
    }
    sa.len()
}

fn round_trip(input: &Path, d: &Path) -> (usize, serde_json::Value) {
    round_trip_with(input, d, &[])
}

/// [`round_trip`] with `extra` options to `pack`.
fn round_trip_with(input: &Path, d: &Path, extra: &[&str]) -> (usize, serde_json::Value) {
    let art = d.join("a.cma");
    let out = d.join("back.safetensors");
    let mut args = vec![
        "pack",
        input.to_str().unwrap(),
        "--lossless",
        "-o",
        art.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let (ok, _, err) = run(&args);
    assert!(ok, "{err}");
    let (ok, stdout, err) = run(&["verify", art.to_str().unwrap()]);
    assert!(ok && stdout.contains("ok"), "{err}");
    let (ok, _, err) = run(&["unpack", art.to_str().unwrap(), "-o", out.to_str().unwrap()]);
    assert!(ok, "{err}");
    let src = if input.is_dir() {
        input.join("model.safetensors")
    } else {
        input.to_path_buf()
    };
    let n = same_tensors(&src, &out);
    // a one-file checkpoint: its header is recorded (version 4, or 3 with SHA-256 digests)
    // and the file comes back
    assert!(
        std::fs::read(&src).unwrap() == std::fs::read(&out).unwrap(),
        "unpack did not give back {} byte for byte",
        src.display()
    );
    let (ok, stdout, _) = run(&["inspect", art.to_str().unwrap(), "--json"]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let sha256 = extra.windows(2).any(|w| w == ["--whole-digest", "sha256"]);
    assert_eq!(v["version"], if sha256 { 3 } else { 4 }, "{v}");
    assert_eq!(
        v["source_header_bytes"].as_u64(),
        Some(u64::from_le_bytes(
            std::fs::read(&src).unwrap()[..8].try_into().unwrap()
        ))
    );
    (n, v)
}

#[test]
fn fsync_writes_the_same_files() {
    // `--fsync` only waits for the disk: the artifact and the unpacked file are the same
    let d = tmp("fsync");
    let input = root().join("fixtures/bert/tiny");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let (a, b) = (d.join("a.cma"), d.join("b.cma"));
    for (art, extra) in [(&a, None), (&b, Some("--fsync"))] {
        let mut args = vec![
            "pack".to_string(),
            s(&input),
            "--lossless".into(),
            "-o".into(),
            s(art),
        ];
        args.extend(extra.map(String::from));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (ok, _, err) = run(&args);
        assert!(ok, "{err}");
    }
    assert!(std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap());
    let (x, y) = (d.join("x.safetensors"), d.join("y.safetensors"));
    let (ok, _, err) = run(&["unpack", &s(&a), "-o", &s(&x)]);
    assert!(ok, "{err}");
    let (ok, _, err) = run(&["unpack", "--fsync", &s(&a), "-o", &s(&y)]);
    assert!(ok, "{err}");
    assert!(std::fs::read(&x).unwrap() == std::fs::read(&y).unwrap());
    assert_eq!(same_tensors(&input.join("model.safetensors"), &y), 37);
    // nothing but the outputs is left beside them
    let mut names: Vec<String> = std::fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["a.cma", "b.cma", "x.safetensors", "y.safetensors"]);
}

#[test]
fn whole_tensor_sha256_digests_write_version_3() {
    let d = tmp("tiny-sha256");
    let (n, _) = round_trip_with(
        &root().join("fixtures/bert/tiny"),
        &d,
        &["--whole-digest", "sha256"],
    );
    assert_eq!(n, 37);
}

#[test]
fn tiny_bert_round_trip_and_inspect() {
    let d = tmp("tiny");
    let (n, inspect) = round_trip(&root().join("fixtures/bert/tiny"), &d);
    assert_eq!(n, 37);
    assert_eq!(inspect["tensors"].as_array().unwrap().len(), 37);
    assert_eq!(inspect["format"], "compressme-artifact");
    let dense: u64 = inspect["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["dense_bytes"].as_u64().unwrap())
        .sum();
    assert_eq!(inspect["dense_bytes"].as_u64().unwrap(), dense);
    // quantized by pattern, embeddings kept
    let art = d.join("q.cma");
    let (ok, stdout, err) = run(&[
        "pack",
        root()
            .join("fixtures/bert/tiny/model.safetensors")
            .to_str()
            .unwrap(),
        "--format",
        "nf4-g32",
        "--keep",
        "embeddings",
        "-o",
        art.to_str().unwrap(),
        "--json",
    ]);
    assert!(ok, "{err}");
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    for t in report["tensors"].as_array().unwrap() {
        let name = t["name"].as_str().unwrap();
        let quantized = t["storage"] == "nf4-g32";
        let weight2d = name.ends_with(".weight") && !name.contains("LayerNorm");
        assert_eq!(
            quantized,
            weight2d && !name.contains("embeddings"),
            "{name}"
        );
    }
    let (ok, stdout, _) = run(&["inspect", art.to_str().unwrap()]);
    assert!(
        ok && stdout.contains("nf4-g32") && stdout.contains("total: 37 tensors"),
        "{stdout}"
    );
    // --paranoid decodes everything again before the rename: the same file, the same
    // counts
    let paranoid = d.join("p.cma");
    let tiny = root().join("fixtures/bert/tiny/model.safetensors");
    for (out, extra) in [(&art, None), (&paranoid, Some("--paranoid"))] {
        let mut args = vec![
            "pack",
            tiny.to_str().unwrap(),
            "--lossless",
            "-o",
            out.to_str().unwrap(),
            "--json",
        ];
        args.extend(extra);
        let (ok, _, err) = run(&args);
        assert!(ok, "{err}");
    }
    assert!(std::fs::read(&art).unwrap() == std::fs::read(&paranoid).unwrap());
}

#[test]
fn errors_are_clear_and_leave_no_output() {
    let d = tmp("errors");
    let out = d.join("x.cma");
    let o = out.to_str().unwrap();
    let tiny = root().join("fixtures/bert/tiny/model.safetensors");
    let t = tiny.to_str().unwrap();
    let case = |args: &[&str], needle: &str| {
        let (ok, _, err) = run(args);
        assert!(!ok, "{args:?} succeeded");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!out.exists(), "{args:?} left an output");
        let left = std::fs::read_dir(&d).unwrap().count();
        assert_eq!(left, 0, "{args:?} left temporary files");
    };
    case(
        &["pack", "/no/such/model.safetensors", "--lossless", "-o", o],
        "/no/such/model.safetensors",
    );
    let junk = std::env::temp_dir().join(format!("cm-junk-{}.safetensors", std::process::id()));
    std::fs::write(&junk, b"this is not a safetensors file at all").unwrap();
    case(
        &["pack", junk.to_str().unwrap(), "--lossless", "-o", o],
        "not a valid safetensors file",
    );
    let plan = std::env::temp_dir().join(format!("cm-plan-{}.json", std::process::id()));
    std::fs::write(
        &plan,
        r#"{"version": 1, "modules": {"encoder.layer.9.output.dense": "int8"}}"#,
    )
    .unwrap();
    case(
        &["pack", t, "--plan", plan.to_str().unwrap(), "-o", o],
        "encoder.layer.9.output.dense",
    );
    std::fs::write(
        &plan,
        r#"{"version": 1, "modules": {"encoder.layer.0.output.dense": "int3"}}"#,
    )
    .unwrap();
    case(
        &["pack", t, "--plan", plan.to_str().unwrap(), "-o", o],
        "int3",
    );
    case(&["pack", t, "--format", "nf4-g48", "-o", o], "nf4-g48");
    case(&["pack", t, "-o", o], "--lossless");
    case(
        &["verify", "/no/such/artifact.cma"],
        "/no/such/artifact.cma",
    );
    case(&["inspect", t], "not a compressme artifact");
    std::fs::remove_file(&junk).unwrap();

    // a plan that works records its hash, and a corrupted artifact fails verify naming
    // the tensor and the block
    std::fs::write(&plan, r#"{"version": 1, "modules": {"encoder.layer.0.output.dense": "int8", "embeddings.word_embeddings": "lossless"}}"#).unwrap();
    let (ok, _, err) = run(&["pack", t, "--plan", plan.to_str().unwrap(), "-o", o]);
    assert!(ok, "{err}");
    let (ok, stdout, _) = run(&["inspect", o, "--json"]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v["plan_sha256"].as_str().unwrap().len(), 64);
    let mut b = std::fs::read(&out).unwrap();
    let at = b.len() - 40; // inside the last payload
    b[at] ^= 0x55;
    std::fs::write(&out, &b).unwrap();
    let (ok, _, err) = run(&["verify", o]);
    assert!(!ok);
    assert!(err.contains("tensor `"), "{err}");
    std::fs::remove_file(&plan).unwrap();
}

#[test]
fn minilm_round_trip_is_byte_identical() {
    let dir = root().join("cache/minilm");
    if !dir.join("model.safetensors").exists() {
        assert!(
            std::env::var_os("COMPRESSME_SKIP_FIXTURES").is_some(),
            "cache/minilm is missing; run `cargo xtask fixtures` (or set COMPRESSME_SKIP_FIXTURES=1 to skip the tests that need it)"
        );
        eprintln!("skipped (COMPRESSME_SKIP_FIXTURES): cache/minilm is absent");
        return;
    }
    let d = tmp("minilm");
    let (n, inspect) = round_trip(&dir, &d);
    assert_eq!(n, 104);
    let ratio = inspect["ratio"].as_f64().unwrap();
    println!(
        "MiniLM lossless: {n} tensors byte-identical after pack/unpack, stored/dense {ratio:.4}"
    );
    assert!(ratio < 0.83, "{ratio}");
}

/// profile -> plan (budget, thresholds, shuffled) -> pack --plan -> verify, on MiniLM.
#[test]
fn profile_plan_pack_on_minilm() {
    let dir = root().join("cache/minilm");
    if !dir.join("model.safetensors").exists() {
        assert!(
            std::env::var_os("COMPRESSME_SKIP_FIXTURES").is_some(),
            "cache/minilm is missing; run `cargo xtask fixtures` (or set COMPRESSME_SKIP_FIXTURES=1 to skip the tests that need it)"
        );
        eprintln!("skipped (COMPRESSME_SKIP_FIXTURES): cache/minilm is absent");
        return;
    }
    let d = tmp("plan");
    let p = |n: &str| d.join(n).to_str().unwrap().to_string();
    let calib = root().join("fixtures/calibration/docs_128.txt");
    let (ok, out, err) = run(&[
        "profile",
        dir.to_str().unwrap(),
        "--data",
        calib.to_str().unwrap(),
        "-o",
        &p("profile.json"),
        "--batch",
        "32",
        "--max-len",
        "64",
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("39 modules"), "{out}");
    let (ok, out, err) = run(&[
        "plan",
        &p("profile.json"),
        "--budget-bpw",
        "4.5",
        "-o",
        &p("plan.json"),
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("optimal"), "{out}");
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(p("plan.json")).unwrap()).unwrap();
    let weights = 10_616_832u64;
    assert!(
        plan["stored_bytes"].as_u64().unwrap() <= weights * 45 / 80,
        "over budget"
    );
    let (ok, _, err) = run(&[
        "plan",
        &p("profile.json"),
        "--budget-bpw",
        "4.5",
        "--shuffle-seed",
        "3",
        "-o",
        &p("shuffled.json"),
    ]);
    assert!(ok, "{err}");
    let shuffled: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(p("shuffled.json")).unwrap()).unwrap();
    assert_eq!(shuffled["stored_bytes"], plan["stored_bytes"]);
    let (ok, _, err) = run(&[
        "plan",
        &p("profile.json"),
        "--budget-bpw",
        "1",
        "-o",
        &p("no.json"),
    ]);
    assert!(!ok && err.contains("cannot be met"), "{err}");
    let (ok, _, err) = run(&[
        "plan",
        &p("profile.json"),
        "--thresholds",
        "-o",
        &p("t.json"),
    ]);
    assert!(ok, "{err}");
    let (ok, _, err) = run(&[
        "pack",
        dir.to_str().unwrap(),
        "--plan",
        &p("plan.json"),
        "--lossless",
        "-o",
        &p("a.cma"),
    ]);
    assert!(ok, "{err}");
    let (ok, out, err) = run(&["inspect", &p("a.cma"), "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["output_head_policy"], "at least int8 for lm_head");
    let planned = v["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| {
            let s = t["storage"].as_str().unwrap();
            s.starts_with("nf4") || s.starts_with("int")
        })
        .count();
    assert_eq!(planned, 36);
    let (ok, _, err) = run(&["verify", &p("a.cma")]);
    assert!(ok, "{err}");
    // the packed model against f32 on held-out sentences
    let heldout = d.join("heldout.txt");
    std::fs::write(
        &heldout,
        "A man is playing a guitar.\nSomeone plays an instrument on stage.\nThe stock market fell sharply today.\nShares dropped at the close of trading.\nA cat sleeps on the warm windowsill.\nThe kitten is napping in the sun.\n",
    )
    .unwrap();
    let (ok, out, err) = run(&[
        "evaluate",
        &p("a.cma"),
        "--reference",
        dir.to_str().unwrap(),
        "--data",
        heldout.to_str().unwrap(),
        "--json",
    ]);
    assert!(ok, "{err}");
    let e: serde_json::Value = serde_json::from_str(&out).unwrap();
    println!("MiniLM at 4.5 bits/weight against f32: {e}");
    assert_eq!(e["items"], 6);
    let cos = e["cosine_mean"].as_f64().unwrap();
    assert!(cos > 0.9 && cos < 1.0, "{cos}");
    let agree = e["retrieval_top1_agreement"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&agree));
    let (ok, _, err) = run(&["evaluate", &p("a.cma"), "--data", heldout.to_str().unwrap()]);
    assert!(!ok && err.contains("--reference"), "{err}");
}

/// A checkpoint with a tensor of values around 1e6 (finite in f32, past f16's 65,504)
/// and an empty `[0, 128]` tensor.
fn range_checkpoint(path: &Path) -> (Vec<u8>, Vec<u8>) {
    let big: Vec<u8> = (0..16 * 128)
        .flat_map(|i| (1e6f32 + i as f32 * 37.0).to_le_bytes())
        .collect();
    let small: Vec<u8> = (0..16 * 128)
        .flat_map(|i| ((i % 17) as f32 * 0.01 - 0.08).to_le_bytes())
        .collect();
    let empty: Vec<u8> = Vec::new();
    let mut t = std::collections::HashMap::new();
    fn view(d: &[u8], shape: Vec<usize>) -> safetensors::tensor::TensorView<'_> {
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape, d).unwrap()
    }
    t.insert("big.weight".to_string(), view(&big, vec![16, 128]));
    t.insert("small.weight".to_string(), view(&small, vec![16, 128]));
    t.insert("empty.weight".to_string(), view(&empty, vec![0, 128]));
    safetensors::serialize_to_file(&t, None, path).unwrap();
    (big, small)
}

#[test]
fn formats_that_cannot_hold_the_values_are_refused_and_empty_tensors_stay_dense() {
    let d = tmp("range");
    let input = d.join("in.safetensors");
    let (big, _) = range_checkpoint(&input);
    let p = |n: &str| d.join(n).to_str().unwrap().to_string();
    let inp = input.to_str().unwrap();
    // f16 would turn 1e6 into inf: refused by name, nothing written
    let (ok, _, err) = run(&["pack", inp, "--format", "f16", "-o", &p("f16.cma")]);
    assert!(!ok);
    assert!(err.contains("tensor `big.weight`"), "{err}");
    assert!(err.contains("does not fit f16"), "{err}");
    assert!(err.contains("--keep-unrepresentable"), "{err}");
    assert!(!d.join("f16.cma").exists());
    // kept dense when asked: the big tensor comes back exact, the others as f16
    let (ok, _, err) = run(&[
        "pack",
        inp,
        "--format",
        "f16",
        "--keep-unrepresentable",
        "-o",
        &p("f16.cma"),
    ]);
    assert!(ok, "{err}");
    assert!(err.contains("big.weight: kept dense"), "{err}");
    let (ok, _, err) = run(&["unpack", &p("f16.cma"), "-o", &p("back.safetensors")]);
    assert!(ok, "{err}");
    let back = std::fs::read(d.join("back.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&back).unwrap();
    assert!(st.tensor("big.weight").unwrap().data() == big.as_slice());
    assert_eq!(st.tensor("empty.weight").unwrap().shape(), &[0, 128]);
    let values: Vec<f32> = st
        .tensor("small.weight")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert!(values.iter().all(|v| v.is_finite()));
    // a blockwise format's f16 scale cannot hold it either; bf16 and int8 can
    for (fmt, fits) in [
        ("nf4-g64", false),
        ("int4-g32", false),
        ("bf16", true),
        ("int8", true),
    ] {
        let out = p(&format!("{fmt}.cma"));
        let (ok, _, err) = run(&["pack", inp, "--format", fmt, "-o", &out]);
        assert_eq!(ok, fits, "{fmt}: {err}");
        // the empty tensor never stops a pack: it is kept dense
        if fits {
            let (ok, json, err) = run(&["inspect", &out, "--json"]);
            assert!(ok, "{err}");
            let v: serde_json::Value = serde_json::from_str(&json).unwrap();
            let empty = v["tensors"]
                .as_array()
                .unwrap()
                .iter()
                .find(|t| t["name"] == "empty.weight")
                .unwrap();
            assert_eq!(empty["storage"], "dense", "{fmt}");
        }
    }
    let (ok, _, err) = run(&["pack", inp, "--lossless", "-o", &p("lossless.cma")]);
    assert!(ok, "{err}");
}

/// `pack` prepares tensors in parallel and writes them in order, and `unpack` writes
/// each at its offset as it decodes: neither file may depend on the thread count.
#[test]
fn pack_and_unpack_do_not_depend_on_the_thread_count() {
    let minilm = root().join("cache/minilm/model.safetensors");
    let input = if minilm.exists() {
        minilm
    } else {
        assert!(
            std::env::var_os("COMPRESSME_SKIP_FIXTURES").is_some(),
            "cache/minilm is missing; run `cargo xtask fixtures`"
        );
        eprintln!("cache/minilm is absent (COMPRESSME_SKIP_FIXTURES): the tiny BERT only");
        root().join("fixtures/bert/tiny/model.safetensors")
    };
    let d = tmp("threads");
    let with_threads = |threads: &str, args: &[&str]| {
        let (ok, _, err) = common::run_env(args, &[("RAYON_NUM_THREADS", threads)]);
        assert!(ok, "{err}");
    };
    let mut packed = Vec::new();
    let mut unpacked = Vec::new();
    for threads in ["1", "2", "5"] {
        let art = d.join(format!("t{threads}.cma"));
        let back = d.join(format!("t{threads}.safetensors"));
        with_threads(
            threads,
            &[
                "pack",
                input.to_str().unwrap(),
                "--lossless",
                "-o",
                art.to_str().unwrap(),
            ],
        );
        with_threads(
            threads,
            &[
                "unpack",
                art.to_str().unwrap(),
                "-o",
                back.to_str().unwrap(),
            ],
        );
        packed.push(std::fs::read(&art).unwrap());
        unpacked.push(std::fs::read(&back).unwrap());
    }
    assert!(packed.iter().all(|p| *p == packed[0]), "pack output varies");
    assert!(
        unpacked.iter().all(|u| *u == unpacked[0]),
        "unpack output varies"
    );
    let n = safetensors::SafeTensors::deserialize(&std::fs::read(&input).unwrap())
        .unwrap()
        .len();
    assert_eq!(same_tensors(&input, &d.join("t1.safetensors")), n);
}
