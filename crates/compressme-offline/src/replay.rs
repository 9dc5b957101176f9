//! Does a fresh run reproduce a recorded one?
#![deny(clippy::arithmetic_side_effects)] // reads files: no unchecked arithmetic

use serde::{Deserialize, Serialize};

use crate::Report;

/// How far likelihood-derived figures may move between a run and its replay. Everything
/// else (hashes, byte counts, digests, plans, token counts) must be identical.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tolerance {
    /// Per-target NLL, training losses: absolute, nats.
    pub nll_abs: f64,
    /// Mean NLL, KL, top-1, probability shifts and paired statistics: absolute.
    pub metric_abs: f64,
}

impl Default for Tolerance {
    fn default() -> Self {
        Self {
            nll_abs: 1e-4,
            metric_abs: 1e-6,
        }
    }
}

/// A field that did not reproduce.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Difference {
    /// Where, as a dotted path.
    pub field: String,
    /// The recorded value.
    pub recorded: String,
    /// The fresh one.
    pub fresh: String,
}

impl std::fmt::Display for Difference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: recorded {}, now {}",
            self.field, self.recorded, self.fresh
        )
    }
}

struct Diffs {
    list: Vec<Difference>,
}

impl Diffs {
    fn exact<T: Serialize + PartialEq>(&mut self, field: &str, a: &T, b: &T) {
        if a != b {
            let show = |v: &T| {
                let s = serde_json::to_string(v).unwrap_or_default();
                if s.len() > 200 {
                    format!("{}... ({} chars)", s.get(..200).unwrap_or(""), s.len())
                } else {
                    s
                }
            };
            self.list.push(Difference {
                field: field.into(),
                recorded: show(a),
                fresh: show(b),
            });
        }
    }

    fn close(&mut self, field: &str, a: f64, b: f64, tol: f64) {
        let same = a.to_bits() == b.to_bits() || (a - b).abs() <= tol;
        if !same {
            self.list.push(Difference {
                field: field.into(),
                recorded: format!("{a:e}"),
                fresh: format!("{b:e} (tolerance {tol:e})"),
            });
        }
    }

    fn all_close(&mut self, field: &str, a: &[f64], b: &[f64], tol: f64) {
        if a.len() != b.len() {
            self.exact(&format!("{field}.len"), &a.len(), &b.len());
            return;
        }
        let worst = a
            .iter()
            .zip(b)
            .enumerate()
            .filter(|(_, (x, y))| x.to_bits() != y.to_bits())
            .map(|(i, (x, y))| (i, (x - y).abs()))
            .max_by(|p, q| p.1.total_cmp(&q.1));
        if let Some((i, d)) = worst
            && (d.is_nan() || d > tol)
        {
            self.list.push(Difference {
                field: format!("{field}[{i}]"),
                recorded: format!("{:e}", a.get(i).copied().unwrap_or(f64::NAN)),
                fresh: format!(
                    "{:e} (largest difference {d:e}, tolerance {tol:e})",
                    b.get(i).copied().unwrap_or(f64::NAN)
                ),
            });
        }
    }
}

/// Whether a variant is run by candle's quantized kernels (its likelihoods depend on
/// the CPU's kernel tier).
fn is_candle(variant: &str) -> bool {
    variant.starts_with("candle-")
}

/// What [`compare`] leaves out, and why: the candle variants' likelihoods when the two
/// runs had different tiers of candle's kernels (their arithmetic differs; their bytes
/// and digests are still compared); the `.cma` files' sizes and digests when the runs
/// wrote different artifact versions (the rest of their storage, which is the payload's,
/// is still compared). `None` when everything is compared.
#[must_use]
pub fn not_compared(recorded: &Report, fresh: &Report) -> Option<String> {
    let mut notes = Vec::new();
    if recorded.candle_kernels != fresh.candle_kernels {
        notes.push(format!(
            "candle's kernels differ between the runs (recorded {}, now {}): the candle variants' likelihoods, their paired rows and generated-token counts are not compared; their storage is",
            recorded.candle_kernels, fresh.candle_kernels
        ));
    }
    if recorded.artifact_version != fresh.artifact_version {
        notes.push(format!(
            "the runs wrote different artifact versions (recorded {}, now {}): the .cma files' sizes and SHA-256 are not compared; every module's stored bytes are",
            recorded.artifact_version, fresh.artifact_version
        ));
    }
    (!notes.is_empty()).then(|| notes.join("; "))
}

/// A variant's storage as compared across artifact versions: without the file's size and
/// digest (which include the header the version defines).
fn payload_storage(s: &crate::report::Storage) -> crate::report::Storage {
    let mut s = s.clone();
    if s.file.ends_with(".cma") {
        s.file_bytes = 0;
        s.file_sha256.clear();
    }
    s
}

/// Every field of `fresh` that does not reproduce `recorded`: deterministic fields
/// exactly, likelihoods within `tol`, except what [`not_compared`] names. Timing, memory
/// and seconds are not compared.
#[must_use]
pub fn compare(recorded: &Report, fresh: &Report, tol: Tolerance) -> Vec<Difference> {
    let candle_comparable = recorded.candle_kernels == fresh.candle_kernels;
    // a different artifact version is said by `not_compared`, not a difference
    let same_artifacts = recorded.artifact_version == fresh.artifact_version;
    let mut d = Diffs { list: Vec::new() };
    d.exact(
        "report_version",
        &recorded.report_version,
        &fresh.report_version,
    );
    d.exact("tool", &recorded.tool, &fresh.tool);
    // fixed by the tool's version: a report cannot widen the tolerance it is checked with
    d.exact("tolerance", &recorded.tolerance, &fresh.tolerance);
    d.exact("config", &recorded.config, &fresh.config);
    d.exact("corpus", &recorded.corpus, &fresh.corpus);
    match (&recorded.training, &fresh.training) {
        (Some(a), Some(b)) => {
            d.exact(
                "training.weights_sha256",
                &a.weights_sha256,
                &b.weights_sha256,
            );
            d.all_close("training.losses", &a.losses, &b.losses, tol.nll_abs);
        }
        (a, b) => d.exact("training", &a.is_some(), &b.is_some()),
    }
    d.exact(
        "profile_sha256",
        &recorded.profile_sha256,
        &fresh.profile_sha256,
    );
    d.exact("plans", &recorded.plans, &fresh.plans);
    let names = |r: &Report| {
        r.variants
            .iter()
            .map(|v| v.name.clone())
            .collect::<Vec<_>>()
    };
    d.exact("variants", &names(recorded), &names(fresh));
    for (a, b) in recorded.variants.iter().zip(&fresh.variants) {
        let p = format!("variants.{}", a.name);
        d.exact(&format!("{p}.description"), &a.description, &b.description);
        if same_artifacts {
            d.exact(&format!("{p}.storage"), &a.storage, &b.storage);
        } else {
            let (a, b) = (payload_storage(&a.storage), payload_storage(&b.storage));
            d.exact(&format!("{p}.storage"), &a, &b);
        }
        if !candle_comparable && is_candle(&a.name) {
            continue;
        }
        d.close(
            &format!("{p}.mean_nll"),
            a.mean_nll,
            b.mean_nll,
            tol.metric_abs,
        );
        d.all_close(&format!("{p}.nll"), &a.nll, &b.nll, tol.nll_abs);
        d.exact(
            &format!("{p}.shift.targets"),
            &a.shift.targets,
            &b.shift.targets,
        );
        for (f, x, y) in [
            ("kl_mean", a.shift.kl_mean, b.shift.kl_mean),
            ("kl_p99", a.shift.kl_p99, b.shift.kl_p99),
            (
                "top1_agreement",
                a.shift.top1_agreement,
                b.shift.top1_agreement,
            ),
            (
                "dp_correct_mean",
                a.shift.dp_correct_mean,
                b.shift.dp_correct_mean,
            ),
            (
                "dp_correct_abs_p99",
                a.shift.dp_correct_abs_p99,
                b.shift.dp_correct_abs_p99,
            ),
        ] {
            d.close(&format!("{p}.shift.{f}"), x, y, tol.metric_abs);
        }
        d.exact(
            &format!("{p}.timing.generate.units"),
            &a.timing.generate.units,
            &b.timing.generate.units,
        );
    }
    let pairs = |r: &Report| {
        r.paired
            .iter()
            .map(|p| (p.a.clone(), p.b.clone()))
            .collect::<Vec<_>>()
    };
    d.exact("paired", &pairs(recorded), &pairs(fresh));
    for (a, b) in recorded.paired.iter().zip(&fresh.paired) {
        let p = format!("paired.{}-vs-{}", a.b, a.a);
        let (x, y) = (&a.paired, &b.paired);
        d.exact(&format!("{p}.targets"), &x.targets, &y.targets);
        if !candle_comparable && (is_candle(&a.a) || is_candle(&a.b)) {
            continue;
        }
        d.exact(
            &format!("{p}.counts"),
            &(x.b_better, x.a_better),
            &(y.b_better, y.a_better),
        );
        for (f, u, v) in [
            ("mean_diff", x.mean_diff, y.mean_diff),
            ("ci_low", x.ci_low, y.ci_low),
            ("ci_high", x.ci_high, y.ci_high),
            ("sign_test_p", x.sign_test_p, y.sign_test_p),
        ] {
            d.close(&format!("{p}.{f}"), u, v, tol.metric_abs);
        }
    }
    d.list
}
