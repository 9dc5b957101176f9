//! The committed CI reference report reproduces; a tampered one does not; the outputs
//! (table, chart) are what they claim to be.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, missing_docs)] // tests

use std::path::{Path, PathBuf};

use compressme_offline::{
    BenchConfig, InProcess, NoProgress, Report, Tolerance, compare, markdown, replay, svg_chart,
};

/// Changes one field of a report.
type Tamper<'a> = Box<dyn Fn(&mut Report) + 'a>;

fn results() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../results")
}

fn work_dir(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    drop(std::fs::remove_dir_all(&d));
    d
}

#[test]
fn the_committed_reference_report_replays_and_tampering_is_caught() {
    let path = results().join("offline-ci.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let recorded = Report::from_json(&text).unwrap();
    let dir = work_dir("replay");
    let (fresh, diffs) = replay(&recorded, &dir, &NoProgress, &InProcess).unwrap();
    for d in &diffs {
        eprintln!("differs: {d}");
    }
    assert!(diffs.is_empty(), "{} fields did not reproduce", diffs.len());
    // every variant was written, reloaded and its file kept
    for v in &fresh.variants {
        assert!(dir.join(&v.storage.file).is_file(), "{}", v.storage.file);
    }

    // tampering with anything deterministic is caught, naming the field
    let tol = Tolerance::default();
    let cases: Vec<(&str, Tamper)> = vec![
        (
            "variants.int8.storage",
            Box::new(|r| r.variant_mut("int8").unwrap().storage.module_stored_bytes += 1),
        ),
        (
            "variants.nf4.storage",
            Box::new(|r| {
                r.variant_mut("nf4")
                    .unwrap()
                    .storage
                    .file_sha256
                    .replace_range(0..1, "x")
            }),
        ),
        (
            "corpus",
            Box::new(|r| r.corpus.eval_sha256.replace_range(0..1, "x")),
        ),
        (
            "training.weights_sha256",
            Box::new(|r| {
                r.training
                    .as_mut()
                    .unwrap()
                    .weights_sha256
                    .replace_range(0..1, "x")
            }),
        ),
        (
            "variants.mixed.nll[",
            Box::new(|r| r.variant_mut("mixed").unwrap().nll[7] += 10.0 * tol.nll_abs),
        ),
        (
            "variants.budget.mean_nll",
            Box::new(|r| r.variant_mut("budget").unwrap().mean_nll += 10.0 * tol.metric_abs),
        ),
        ("plans", Box::new(|r| drop(r.plans.pop_first()))),
        // a report that widens its own tolerance does not get it
        ("tolerance", Box::new(|r| r.tolerance.nll_abs *= 1e6)),
        (
            "config",
            Box::new(|r| match &mut r.config {
                BenchConfig::Synthetic(c) => c.steps += 1,
                BenchConfig::Real(_) => unreachable!("the CI report is synthetic"),
            }),
        ),
    ];
    for (field, tamper) in &cases {
        let mut bad = recorded.clone();
        tamper(&mut bad);
        let diffs = compare(&bad, &fresh, tol);
        assert!(
            diffs.iter().any(|d| d.field.starts_with(field)),
            "tampering with {field} went unnoticed: {diffs:?}"
        );
    }
    // differences inside the tolerance are not differences
    let mut close = recorded.clone();
    close.variant_mut("mixed").unwrap().nll[3] += 0.5 * tol.nll_abs;
    assert!(compare(&close, &fresh, tol).is_empty());
    // on another tier of candle's kernels, the candle variants' likelihoods (and only
    // theirs) are left out, said so, and their storage is still compared
    let mut other_cpu = recorded.clone();
    other_cpu.candle_kernels = "avx512-vnni-elsewhere".into();
    // this machine's own tier may be the recorded one or not: said exactly when it is not
    match compressme_offline::not_compared(&recorded, &fresh) {
        None => assert_eq!(recorded.candle_kernels, fresh.candle_kernels),
        Some(note) => {
            assert_ne!(recorded.candle_kernels, fresh.candle_kernels, "{note}");
            assert!(note.contains(&fresh.candle_kernels), "{note}");
        }
    }
    let note = compressme_offline::not_compared(&other_cpu, &fresh).unwrap();
    assert!(note.contains("avx512-vnni-elsewhere"), "{note}");
    other_cpu.variant_mut("candle-q8_0").unwrap().nll[2] += 1.0;
    other_cpu.variant_mut("candle-q4_0").unwrap().shift.kl_mean += 1.0;
    assert!(compare(&other_cpu, &fresh, tol).is_empty());
    other_cpu.variant_mut("int8").unwrap().nll[2] += 1.0;
    other_cpu
        .variant_mut("candle-q4_0")
        .unwrap()
        .storage
        .file_bytes += 1;
    let fields: Vec<String> = compare(&other_cpu, &fresh, tol)
        .into_iter()
        .map(|d| d.field)
        .collect();
    assert_eq!(
        fields,
        ["variants.int8.nll[2]", "variants.candle-q4_0.storage"]
    );
    // written in another artifact version: the .cma files' sizes and digests (and only
    // those) are left out, said so; the payload's bytes are still compared
    let mut old = recorded.clone();
    old.artifact_version = fresh.artifact_version - 1;
    let note = compressme_offline::not_compared(&old, &fresh).unwrap();
    assert!(note.contains("artifact versions"), "{note}");
    let v = old.variant_mut("lossless-emb").unwrap();
    v.storage.file_bytes += 4096;
    v.storage.file_sha256 = "ab".repeat(32);
    assert!(compare(&old, &fresh, tol).is_empty());
    old.variant_mut("lossless-emb")
        .unwrap()
        .storage
        .module_stored_bytes += 1;
    let g = old.variant_mut("candle-q8_0").unwrap();
    g.storage.file_sha256 = "ab".repeat(32); // a GGUF file is not an artifact
    let fields: Vec<String> = compare(&old, &fresh, tol)
        .into_iter()
        .map(|d| d.field)
        .collect();
    assert_eq!(
        fields,
        [
            "variants.lossless-emb.storage",
            "variants.candle-q8_0.storage"
        ]
    );
    // timing is not compared
    let mut slow = recorded.clone();
    slow.variants[0].timing.forward.median *= 2.0;
    assert!(compare(&slow, &fresh, Tolerance::default()).is_empty());
}

#[test]
fn the_table_and_chart_show_every_variant() {
    let text = std::fs::read_to_string(results().join("offline-ci.json")).unwrap();
    let r = Report::from_json(&text).unwrap();
    let md = markdown(&r);
    for v in &r.variants {
        assert!(
            md.lines().any(|l| l.starts_with(&format!("| {}", v.name))),
            "no row for {}",
            v.name
        );
    }
    assert!(md.contains("not a pretrained-language-model result"));
    let svg = svg_chart(&r).unwrap();
    let doc = roxmltree::Document::parse(&svg).unwrap();
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    let texts: Vec<&str> = doc
        .descendants()
        .filter(|n| n.has_tag_name("text"))
        .filter_map(|n| n.text().map(str::trim))
        .collect();
    for v in &r.variants {
        assert!(texts.contains(&v.name.as_str()), "no label for {}", v.name);
    }
    // a report of another version is refused
    let newer = text.replacen("\"report_version\":1,", "\"report_version\":2,", 1);
    assert_ne!(newer, text);
    assert!(Report::from_json(&newer).is_err());
}
