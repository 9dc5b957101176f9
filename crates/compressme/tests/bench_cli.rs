//! `bench --replay` and `evaluate` on causal artifacts, and the real-model benchmark's
//! reduced CI report (`results/real-ci.json`: SmolLM2 on a few windows of Austen, every
//! variant, probes in child processes; needs `cargo xtask fixtures`: required, unless
//! `COMPRESSME_SKIP_FIXTURES` is set, when it says it skipped), through the built binary.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, missing_docs)] // tests

mod common;

use std::process::Command;

use common::{Scratch, root, run};

/// A tampered report fails its replay, naming the field; the replay's artifacts then
/// evaluate from the command line (perplexity, KL against the FP32 artifact).
#[test]
fn a_tampered_report_fails_replay_and_the_artifacts_evaluate() {
    let d = std::env::temp_dir().join(format!("cm-cli-bench-{}", std::process::id()));
    drop(std::fs::remove_dir_all(&d));
    std::fs::create_dir_all(&d).unwrap();
    let p = |n: &str| d.join(n).to_str().unwrap().to_string();
    let text = std::fs::read_to_string(root().join("results/offline-ci.json")).unwrap();
    let mut report: serde_json::Value = serde_json::from_str(&text).unwrap();
    let int8 = report["variants"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|v| v["name"] == "int8")
        .unwrap();
    let bytes = int8["storage"]["file_bytes"].as_u64().unwrap();
    int8["storage"]["file_bytes"] = serde_json::json!(bytes + 1);
    std::fs::write(p("tampered.json"), report.to_string()).unwrap();
    let (ok, out, err) = run(&[
        "bench",
        "--replay",
        &p("tampered.json"),
        "--work-dir",
        &p("work"),
    ]);
    assert!(!ok, "a tampered report replayed cleanly");
    assert!(out.contains("differs: variants.int8.storage"), "{out}");
    assert!(err.contains("1 fields differ"), "{err}");

    // held-out token ids, one document a line
    let docs = "1 3 5 7 9 11 13 15 17 19 21 23 25 27 29 31 33 35\n\n100 104 108 112 116 120 124 0 4 8 12 16\n";
    std::fs::write(p("heldout.txt"), docs).unwrap();
    let evaluate = |model: &str| {
        let (ok, out, err) = run(&[
            "evaluate",
            &p(model),
            "--reference",
            &p("work/fp32.cma"),
            "--data",
            &p("heldout.txt"),
            "--json",
        ]);
        assert!(ok, "{err}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    let same = evaluate("work/fp32.cma");
    assert_eq!(same["targets"], 17 + 11);
    assert_eq!(same["shift"]["kl_mean"], 0.0);
    assert_eq!(same["shift"]["top1_agreement"], 1.0);
    let nf4 = evaluate("work/nf4.cma");
    assert!(nf4["shift"]["kl_mean"].as_f64().unwrap() > 0.0, "{nf4}");
    assert_eq!(nf4["paired"]["targets"], 28);
    // bad data: named
    std::fs::write(p("bad.txt"), "1 2 x\n").unwrap();
    let (ok, _, err) = run(&["evaluate", &p("work/nf4.cma"), "--data", &p("bad.txt")]);
    assert!(
        !ok && err.contains("line 1") && err.contains("`x`"),
        "{err}"
    );
    std::fs::write(p("far.txt"), "1 2 999\n").unwrap();
    let (ok, _, err) = run(&["evaluate", &p("work/nf4.cma"), "--data", &p("far.txt")]);
    assert!(!ok && err.contains("999"), "{err}");
    std::fs::remove_dir_all(&d).unwrap();
}

/// A run writes the report, and beside it the table and the chart with the same stem; the
/// report replays; bad settings are refused before any work.
#[test]
fn a_small_run_writes_report_table_and_chart() {
    let d = std::env::temp_dir().join(format!("cm-cli-bench-run-{}", std::process::id()));
    drop(std::fs::remove_dir_all(&d));
    let p = |n: &str| d.join(n).to_str().unwrap().to_string();
    let (ok, out, err) = run(&[
        "bench",
        "--steps",
        "3",
        "--eval-docs",
        "2",
        "--timing-reps",
        "1",
        "--shuffle-seeds",
        "5",
        "--output",
        &p("out/small.json"),
        "--work-dir",
        &p("work"),
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("| shuffled-5 (control) |"), "{out}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(p("out/small.json")).unwrap()).unwrap();
    assert_eq!(report["config"]["steps"], 3);
    assert_eq!(report["variants"].as_array().unwrap().len(), 10);
    let md = std::fs::read_to_string(p("out/small.md")).unwrap();
    assert!(md.contains("| fp32 |"));
    let svg = std::fs::read_to_string(p("out/small.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    let (ok, out, err) = run(&[
        "bench",
        "--replay",
        &p("out/small.json"),
        "--work-dir",
        &p("replay"),
    ]);
    assert!(ok && out.contains("reproduced"), "{out}{err}");
    let (ok, _, err) = run(&["bench", "--eval-docs", "0", "--output", &p("x.json")]);
    assert!(!ok && err.contains("eval_docs"), "{err}");
    assert!(!d.join("x.json").exists());
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn real_decoder_the_real_model_ci_report_replays() {
    let gguf = root().join("cache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !gguf.exists() {
        assert!(
            std::env::var_os("COMPRESSME_SKIP_FIXTURES").is_some(),
            "{} is missing; run `cargo xtask fixtures` (or set COMPRESSME_SKIP_FIXTURES=1 to skip the tests that need it)",
            gguf.display()
        );
        eprintln!(
            "skipped (COMPRESSME_SKIP_FIXTURES): {} is absent",
            gguf.display()
        );
        return;
    }
    // about 1.5 GB of variant files: removed even when the test fails
    let work = Scratch::removed_always("cm-real-ci");
    // the report's paths (model, texts) are relative to the repository root
    let out = Command::new(env!("CARGO_BIN_EXE_compressme"))
        .current_dir(root())
        .args(["bench", "--replay", "results/real-ci.json", "--work-dir"])
        .arg(&*work)
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("reproduced"), "{stdout}");
    // the fresh report measured memory and speed in child processes, for every variant
    // but the shuffled controls
    let fresh: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(work.join("replay.json")).unwrap()).unwrap();
    let mut controls = 0;
    for v in fresh["variants"].as_array().unwrap() {
        if v["control"].as_bool().unwrap() {
            controls += 1;
            assert!(v["peak_rss_bytes"].is_null(), "{}", v["name"]);
            let timed = v["timing"]["generate_threads"].as_array();
            assert!(timed.is_none_or(Vec::is_empty), "{}", v["name"]);
            continue;
        }
        assert!(v["peak_rss_bytes"].as_u64().unwrap() > 0, "{}", v["name"]);
        let t = &v["timing"]["generate_threads"][0];
        assert_eq!(t["threads"], 1);
        assert_eq!(t["timing"]["units"][0], 4, "{}", v["name"]);
    }
    assert!(controls > 0, "no shuffled control in the CI report");
}
