//! Profiles against direct computation, batching invariance, clean failure, and plans:
//! JSON, the shuffled control's bytes, the budget solver against brute force.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, missing_docs)] // tests

use std::sync::{Arc, Mutex};

use candle_core::{Device, Tensor};
use compressme_nn::causal::cyclic_batch;
use compressme_nn::{CausalConfig, CausalLm, Model, Observer, Storage};
use compressme_plan::{Choice, Error, Plan, Policy, shapes, solve};
use compressme_profile::{ActivationRecorder, ProfileSettings};
use compressme_quant::Format;
use compressme_quant::synthetic::Rng;

fn model() -> CausalLm {
    let cfg = CausalConfig {
        vocab: 16,
        width: 32,
        layers: 2,
        heads: 2,
        context: 16,
    };
    CausalLm::new(cfg, 3, &Device::Cpu).unwrap()
}

fn batches(n: usize, batch: usize) -> Vec<Tensor> {
    let mut rng = Rng::new(11);
    (0..n)
        .map(|_| {
            cyclic_batch(&mut rng, batch, 12, 16, 3, &Device::Cpu)
                .unwrap()
                .0
        })
        .collect()
}

struct Keep(Mutex<Vec<(String, Vec<f32>, usize)>>);
impl Observer for Keep {
    fn observe(&self, m: &str, x: &Tensor) -> compressme_nn::Result<()> {
        let cols = *x.dims().last().unwrap();
        self.0
            .lock()
            .unwrap()
            .push((m.into(), x.flatten_all()?.to_vec1::<f32>()?, cols));
        Ok(())
    }
}

#[test]
fn statistics_match_a_direct_computation() {
    let m = model();
    let data = batches(3, 4);
    let p = ActivationRecorder::new(ProfileSettings::default())
        .record(&m, &data, |m, ids| m.forward(ids).map(drop))
        .unwrap();
    // the same inputs, kept whole, summed here
    let keep = Arc::new(Keep(Mutex::new(Vec::new())));
    {
        let _g = m.hooks().install(keep.clone()).unwrap();
        for ids in &data {
            m.forward(ids).unwrap();
        }
    }
    let seen = keep.0.lock().unwrap();
    for (name, s) in &p.modules {
        let xs: Vec<f32> = seen
            .iter()
            .filter(|(n, ..)| n == name)
            .flat_map(|(_, v, _)| v.clone())
            .collect();
        let cols = s.cols;
        assert_eq!(s.elements as usize, xs.len(), "{name}");
        let mean_abs = xs.iter().map(|v| f64::from(v.abs())).sum::<f64>() / xs.len() as f64;
        let density = xs.iter().filter(|v| v.abs() > 0.01).count() as f64 / xs.len() as f64;
        let max = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
        assert!(
            (s.mean_abs() - mean_abs).abs() <= 1e-9 * mean_abs.max(1.0),
            "{name}"
        );
        assert_eq!(s.density(), density, "{name}");
        assert_eq!(s.max_abs, max, "{name}");
        let rows = xs.len() / cols;
        for j in [0, cols / 2, cols - 1] {
            let sq: f64 = (0..rows)
                .map(|r| f64::from(xs[r * cols + j]).powi(2))
                .sum::<f64>()
                / rows as f64;
            let got = s.channel_mean_sq()[j];
            assert!(
                (got - sq).abs() <= 1e-9 * sq.max(1e-12),
                "{name} channel {j}"
            );
        }
        if name != "tok_embeddings" {
            assert_eq!(s.estimated_error.len(), 9, "{name}: every candidate");
            assert!(
                s.estimated_error["int8"] < s.estimated_error["nf4"],
                "{name}"
            );
        }
    }
    assert_eq!(p.tokens, 3 * 4 * 12);
}

#[test]
fn statistics_do_not_depend_on_batching() {
    let m = model();
    let whole = batches(1, 8);
    let split: Vec<Tensor> = (0..8).map(|i| whole[0].narrow(0, i, 1).unwrap()).collect();
    let rec = ActivationRecorder::new(ProfileSettings::default());
    let a = rec
        .record(&m, &whole, |m, ids| m.forward(ids).map(drop))
        .unwrap();
    let b = rec
        .record(&m, &split, |m, ids| m.forward(ids).map(drop))
        .unwrap();
    for (name, sa) in &a.modules {
        let sb = &b.modules[name];
        assert_eq!(sa.elements, sb.elements);
        let close = |x: f64, y: f64| (x - y).abs() <= 1e-5 * x.abs().max(1e-6);
        assert!(close(sa.mean_abs(), sb.mean_abs()), "{name}");
        assert!(close(sa.density(), sb.density()), "{name}");
        assert!(
            (sa.max_abs - sb.max_abs).abs() <= 1e-5 * sa.max_abs,
            "{name}"
        );
        for (x, y) in sa.channel_mean_sq().iter().zip(sb.channel_mean_sq()) {
            assert!(close(*x, y), "{name}");
        }
    }
}

#[test]
fn failures_are_clean() {
    let m = model();
    let data = batches(3, 2);
    let rec = ActivationRecorder::new(ProfileSettings::default());
    // a model error at batch 1: named, and the observer is gone
    let e = rec
        .record(&m, &data, |m, ids| {
            if ids.dims()[0] > 0 && std::ptr::eq(ids, &data[1]) {
                return Err(compressme_nn::Error::Shape("injected".into()));
            }
            m.forward(ids).map(drop)
        })
        .unwrap_err();
    let ok = matches!(e, compressme_profile::Error::Model { batch: 1, .. });
    assert!(ok, "{e}");
    assert!(!m.hooks().installed());
    // a NaN weight: the first module to see a NaN is named
    let mut bad = model();
    let name = "layers.1.mlp.down".to_string();
    let w = vec![f32::NAN; 32 * 128];
    let mut l = match bad.module(&name).unwrap() {
        compressme_nn::ModuleRef::Linear(l) => l.clone(),
        _ => unreachable!(),
    };
    let t = Tensor::from_vec(w, (32, 128), &Device::Cpu).unwrap();
    l.set_weight(compressme_nn::Weight::Dense(t)).unwrap();
    if let Some(compressme_nn::ModuleMut::Linear(slot)) = bad.module_mut(&name) {
        *slot = l;
    }
    let e = rec
        .record(&bad, &data, |m, ids| m.forward(ids).map(drop))
        .unwrap_err();
    let named_head = match &e {
        compressme_profile::Error::NonFinite { module, .. } => module == "lm_head",
        _ => false,
    };
    assert!(named_head, "{e}");
    assert!(!bad.hooks().installed());
    assert!(matches!(
        rec.record(&m, &Vec::<Tensor>::new(), |_, _: &Tensor| Ok(())),
        Err(compressme_profile::Error::Empty)
    ));
}

fn linear_weights(m: &CausalLm) -> Vec<(String, Vec<f32>)> {
    m.module_names()
        .into_iter()
        .filter_map(|n| match m.module(&n) {
            Some(compressme_nn::ModuleRef::Linear(l)) => Some((n, l.weight_f32().unwrap())),
            _ => None,
        })
        .collect()
}

#[test]
fn measured_sensitivity_scales_the_estimates_and_leaves_the_model_as_it_was() {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let m = model();
    let data = batches(2, 4);
    let mut p = ActivationRecorder::new(ProfileSettings::default())
        .record(&m, &data, |m, ids| m.forward(ids).map(drop))
        .unwrap();
    let before = p.clone();
    let weights = linear_weights(&m);
    let ids = &data[0];
    let out = |m: &CausalLm| -> Vec<f32> {
        m.forward(ids)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    let reference = out(&m);
    // the mean squared change of the outputs
    let shift = |m: &CausalLm| -> f64 {
        let o = out(m);
        o.iter()
            .zip(&reference)
            .map(|(a, b)| f64::from(a - b).powi(2))
            .sum::<f64>()
            / o.len() as f64
    };
    let probe = Format::Nf4Block(compressme_quant::GroupSize::G32);
    let done = Mutex::new(Vec::new());
    let changed = Mutex::new(Vec::new());
    compressme_profile::measure_sensitivity(
        &m,
        &mut p,
        probe,
        1,
        |m, name| {
            // the module is quantized while it is measured, and only it
            let now = linear_weights(m);
            for ((n, a), (_, b)) in weights.iter().zip(&now) {
                if a != b {
                    changed.lock().unwrap().push((name.to_string(), n.clone()));
                }
            }
            Ok(shift(m))
        },
        |n| done.lock().unwrap().push(n.to_string()),
    )
    .unwrap();
    let (done, changed) = (done.into_inner().unwrap(), changed.into_inner().unwrap());
    // two lanes side by side: the same measurements, each module once
    let mut p2 = before.clone();
    let done2 = Mutex::new(Vec::new());
    compressme_profile::measure_sensitivity(
        &m,
        &mut p2,
        probe,
        2,
        |m, _| Ok(shift(m)),
        |n| done2.lock().unwrap().push(n.to_string()),
    )
    .unwrap();
    assert!(p2 == p, "two lanes measure what one does");
    let mut done2 = done2.into_inner().unwrap();
    done2.sort();
    assert_eq!(done2, done);
    let linears: Vec<String> = before
        .modules
        .iter()
        .filter(|(_, s)| s.kind == compressme_nn::ModuleKind::Linear)
        .map(|(n, _)| n.clone())
        .collect();
    assert_eq!(done, linears);
    assert_eq!(
        changed,
        linears
            .iter()
            .map(|n| (n.clone(), n.clone()))
            .collect::<Vec<_>>()
    );
    assert_eq!(linear_weights(&m), weights, "the model is as it was");
    let key = probe.to_string();
    for n in &linears {
        let (b, a) = (&before.modules[n], &p.modules[n]);
        let meas = a.measured.as_ref().unwrap();
        assert_eq!(meas.format, key);
        assert!(meas.value > 0.0, "{n}");
        // the heuristic of each format as stored: the same as recorded where there are
        // no activation-aware scales, no larger where there are (absmax is among the
        // scales they choose from)
        assert_eq!(meas.heuristic["int8"], b.estimated_error["int8"], "{n}");
        assert_eq!(meas.heuristic["f16"], b.estimated_error["f16"], "{n}");
        assert!(
            meas.heuristic[&key] <= b.estimated_error[&key] * (1.0 + 1e-9),
            "{n}"
        );
        assert_eq!(a.estimated_error[&key], meas.value, "{n}");
        assert_eq!(
            a.estimated_error.keys().collect::<Vec<_>>(),
            meas.heuristic.keys().collect::<Vec<_>>()
        );
        for (f, e) in &a.estimated_error {
            let want = meas.value * meas.heuristic[f] / meas.heuristic[&key];
            assert!((e - want).abs() <= 1e-12 * want.abs(), "{n} {f}");
        }
        assert!(a.estimated_error["int8"] < a.estimated_error["nf4"], "{n}");
    }
    // the measured profile is still a profile: JSON round trip, and a budget plan on it
    let back = compressme_profile::Profile::from_json(&p.to_json().unwrap()).unwrap();
    assert_eq!(back, p);
    let cands = [Format::Int8, probe];
    let plan = Plan::within_budget(&p, &cands, 1 << 20, Policy::default()).unwrap();
    assert!(plan.estimated_error.unwrap() >= 0.0);
    // a failing measure is named with its module (the first in name order, in any
    // lanes), and the model and the profile are left as they were
    for lanes in [1, 2] {
        let mut q = before.clone();
        let e = compressme_profile::measure_sensitivity(
            &m,
            &mut q,
            probe,
            lanes,
            |_, n| {
                if n == linears[1] || n == linears[linears.len() - 1] {
                    Err(format!("injected at {n}"))
                } else {
                    Ok(1.0)
                }
            },
            |_| {},
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .contains(&format!("injected at {}", linears[1])),
            "{e}"
        );
        assert_eq!(linear_weights(&m), weights, "the model is as it was");
        assert_eq!(q, before, "and so is the profile");
    }
    // a probe the profile has no estimate for is refused before anything changes
    let mut only_int8 = ActivationRecorder::new(ProfileSettings {
        candidates: vec!["int8".into()],
        ..ProfileSettings::default()
    })
    .record(&m, &data, |m, ids| m.forward(ids).map(drop))
    .unwrap();
    let calls = AtomicUsize::new(0);
    let e = compressme_profile::measure_sensitivity(
        &m,
        &mut only_int8,
        probe,
        2,
        |_, _| {
            calls.fetch_add(1, Ordering::Relaxed);
            Ok(1.0)
        },
        |_| {},
    )
    .unwrap_err();
    assert!(e.to_string().contains("no estimate for nf4-g32"), "{e}");
    assert_eq!(calls.load(Ordering::Relaxed), 0);
    assert!(only_int8.modules.values().all(|s| s.measured.is_none()));
}

#[test]
fn plans_round_trip_validate_and_shuffle_at_equal_bytes() {
    let m = model();
    let p = ActivationRecorder::new(ProfileSettings::default())
        .record(&m, &batches(2, 4), |m, ids| m.forward(ids).map(drop))
        .unwrap();
    let back = compressme_profile::Profile::from_json(&p.to_json().unwrap()).unwrap();
    assert!(back == p, "profile JSON round trip");
    let sh = shapes(&p);
    let plan = Plan::from_importance(&p, Policy::default());
    assert!(
        plan.modules
            .values()
            .all(|c| matches!(c, Choice::Format(_)))
    );
    assert!(plan.modules["lm_head"].at_least_int8(), "head floor");
    plan.validate(&sh).unwrap();
    assert_eq!(Plan::from_json(&plan.to_json().unwrap()).unwrap(), plan);
    // a version-0 plan (a bare map) still reads
    let v0 = Plan::from_json(r#"{"layers.0.attn.q": "int8", "lm_head": "f16"}"#).unwrap();
    assert_eq!(v0.modules["layers.0.attn.q"], Choice::Format(Format::Int8));
    assert!(Plan::from_json(r#"{"version": 7, "modules": {}}"#).is_err());
    // validation errors
    let mut bad = plan.clone();
    bad.modules.insert("nope".into(), Choice::Dense);
    assert!(matches!(bad.validate(&sh), Err(Error::UnknownModule(_))));
    let mut bad = plan.clone();
    bad.modules
        .insert("lm_head".into(), Choice::Format(Format::Nf4));
    assert!(matches!(bad.validate(&sh), Err(Error::Unsuitable { .. })));
    bad.policy.protect_output_head = false;
    bad.validate(&sh).unwrap();
    let mut bad = plan.clone();
    bad.modules
        .insert("tok_embeddings".into(), Choice::Format(Format::Nf4));
    assert!(matches!(bad.validate(&sh), Err(Error::Unsuitable { .. })));
    let mut bad = plan.clone();
    bad.modules.insert(
        "layers.0.attn.q".into(),
        Choice::Format(Format::Nf4Block(compressme_quant::GroupSize::G64)),
    );
    let ok = matches!(bad.validate(&sh), Err(Error::Unsuitable { .. }));
    assert!(ok, "group 64 does not divide 32");
    // shuffled controls: same bytes for several seeds, some actually different
    let budget = Plan::within_budget(
        &p,
        &compressme_profile::default_candidates(),
        plan.stored_bytes.unwrap(),
        Policy::default(),
    )
    .unwrap();
    let mut differs = 0;
    for seed in 0..8 {
        let s = budget.shuffled(&sh, seed);
        assert_eq!(s.stored_bytes, budget.stored_bytes, "seed {seed}");
        assert_eq!(s.modules["lm_head"], budget.modules["lm_head"]);
        s.validate(&sh).unwrap();
        differs += usize::from(s.modules != budget.modules);
    }
    assert!(differs > 0);
    // the plan applies to the model
    let mut m2 = m.clone();
    let changes: Vec<(String, Storage)> = budget
        .modules
        .iter()
        .filter_map(|(n, c)| match c {
            Choice::Format(f) => Some((n.clone(), Storage::Quant(*f))),
            _ => None,
        })
        .collect();
    m2.set_storage(&changes).unwrap();
}

#[test]
fn the_budget_solver_is_optimal_and_never_over_budget() {
    let mut rng = Rng::new(5);
    for case in 0..300 {
        let n = 1 + (rng.next_u64() % 6) as usize;
        let items: Vec<Vec<(u64, f64)>> = (0..n)
            .map(|_| {
                (0..1 + rng.next_u64() % 4)
                    .map(|_| (1 + rng.next_u64() % 50, rng.uniform() * 10.0))
                    .collect()
            })
            .collect();
        let total_min: u64 = items
            .iter()
            .map(|o| o.iter().map(|c| c.0).min().unwrap())
            .sum();
        let budget = total_min + rng.next_u64() % 80;
        // brute force
        let mut best = f64::INFINITY;
        let mut idx = vec![0usize; n];
        loop {
            let (b, e) = idx
                .iter()
                .zip(&items)
                .fold((0, 0.0), |(b, e), (&k, o)| (b + o[k].0, e + o[k].1));
            if b <= budget && e < best {
                best = e;
            }
            let mut i = 0;
            while i < n {
                idx[i] += 1;
                if idx[i] < items[i].len() {
                    break;
                }
                idx[i] = 0;
                i += 1;
            }
            if i == n {
                break;
            }
        }
        let (picks, exact) = solve(&items, budget).unwrap();
        assert!(exact);
        let (b, e) = picks
            .iter()
            .zip(&items)
            .fold((0, 0.0), |(b, e), (&k, o)| (b + o[k].0, e + o[k].1));
        assert!(b <= budget, "case {case}: {b} > {budget}");
        assert!(
            (e - best).abs() <= 1e-9,
            "case {case}: {e} vs brute force {best}"
        );
    }
    assert!(matches!(
        solve(&[vec![(10, 0.0)]], 9),
        Err(Error::Budget { smallest: 10, .. })
    ));
}

#[test]
fn plans_never_choose_a_format_that_cannot_hold_the_weights() {
    let m = model();
    let mut p = ActivationRecorder::new(ProfileSettings::default())
        .record(&m, &batches(2, 4), |m, ids| m.forward(ids).map(drop))
        .unwrap();
    // ordinary weights fit every format, and the profile's JSON does not mention it
    assert!(p.modules.values().all(|s| s.unrepresentable.is_empty()));
    assert!(!p.to_json().unwrap().contains("unrepresentable"));
    // the thresholds plan's f16 modules, as if their weights were past 65,504
    let plan = Plan::from_importance(&p, Policy::default());
    let f16: Vec<String> = plan
        .modules
        .iter()
        .filter(|(_, c)| **c == Choice::Format(Format::F16))
        .map(|(n, _)| n.clone())
        .collect();
    assert!(!f16.is_empty());
    let every: Vec<String> = Format::ALL.iter().map(ToString::to_string).collect();
    for n in &f16 {
        let s = p.modules.get_mut(n).unwrap();
        s.unrepresentable.insert("f16".into());
        // and one of them fits nothing but INT8 and dense
        if n == &f16[0] {
            s.unrepresentable = every
                .iter()
                .filter(|f| !f.starts_with("int8"))
                .cloned()
                .collect();
        }
    }
    let back = compressme_profile::Profile::from_json(&p.to_json().unwrap()).unwrap();
    assert!(back == p, "the field round-trips");
    let plan = Plan::from_importance(&p, Policy::default());
    for n in &f16 {
        assert_eq!(plan.modules[n], Choice::Dense, "{n}");
    }
    let mut solved = 0;
    for budget_bits in [4.5f64, 6.0, 10.0] {
        let total: u64 = shapes(&p).values().map(|s| (s.rows * s.cols) as u64).sum();
        let Ok(b) = Plan::within_budget(
            &p,
            &compressme_profile::default_candidates(),
            (budget_bits * total as f64 / 8.0) as u64,
            Policy::default(),
        ) else {
            continue;
        };
        for (n, c) in &b.modules {
            if let Choice::Format(f) = c {
                assert!(
                    !p.modules[n].unrepresentable.contains(&f.to_string()),
                    "{n}: {f} at {budget_bits} bits"
                );
            }
        }
        assert!(matches!(
            b.modules[&f16[0]],
            Choice::Dense | Choice::Format(Format::Int8)
        ));
        solved += 1;
    }
    assert!(solved >= 2, "only {solved} budgets were feasible");
}

#[test]
fn holds_is_what_quantize_accepts() {
    for max in [
        1.0f32,
        6.5e4,
        65_504.0,
        65_519.0,
        65_520.0,
        7e4,
        1e6,
        3.3e38,
        f32::MAX,
    ] {
        for f in Format::ALL {
            let w = [max, -max * 0.5, 0.25, 0.0];
            let ok = compressme_quant::quantize(&w, 1, 4, f).is_ok();
            // exact, except that INT4's minimum is the group's smallest value, which
            // may fit where the largest magnitude does not: holds is then conservative
            if matches!(f, Format::Int4Block(_)) {
                assert!(!f.holds(max) || ok, "{f} at {max}");
            } else {
                assert_eq!(f.holds(max), ok, "{f} at {max}");
            }
        }
    }
}

/// A profile read from a hostile file may claim any shape: module sizes whose products
/// overflow `usize` and `u64` reach every planner as errors or saturated sizes, never as
/// an overflow (this runs in the debug profile, where one panics).
#[test]
fn extreme_shapes_in_a_profile_do_not_overflow() {
    let m = model();
    let p = ActivationRecorder::new(ProfileSettings::default())
        .record(&m, &batches(2, 4), |m, ids| m.forward(ids).map(drop))
        .unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&p.to_json().unwrap()).unwrap();
    for (_, s) in json["modules"].as_object_mut().unwrap() {
        s["rows"] = serde_json::json!(usize::MAX / 2);
        s["cols"] = serde_json::json!(1u64 << 40);
    }
    let hostile = compressme_profile::Profile::from_json(&json.to_string()).unwrap();
    let thresholds = Plan::from_importance(&hostile, Policy::default());
    let shapes = shapes(&hostile);
    let _ = thresholds.validate(&shapes);
    let _ = thresholds.shuffled(&shapes, 7);
    for budget in [0, 1 << 20, u64::MAX] {
        let candidates = compressme_profile::default_candidates();
        if let Ok(b) = Plan::within_budget(&hostile, &candidates, budget, Policy::default()) {
            let _ = b.shuffled(&shapes, 3);
        }
    }
    for c in thresholds.modules.values() {
        assert_eq!(c.bytes(usize::MAX, usize::MAX).map(|b| b > 0), Some(true));
    }
}

/// A candidate the profile has no estimates for is refused by name, not skipped; a
/// profile that estimated it lets the solver choose it.
#[test]
fn a_candidate_the_profile_did_not_estimate_is_named() {
    let m = model();
    let int8_g32 = Format::Int8Block(compressme_quant::GroupSize::G32);
    let p = ActivationRecorder::new(ProfileSettings::default())
        .record(&m, &batches(2, 4), |m, ids| m.forward(ids).map(drop))
        .unwrap();
    let total: u64 = shapes(&p).values().map(|s| (s.rows * s.cols) as u64).sum();
    let e = Plan::within_budget(&p, &[Format::Int8, int8_g32], total * 2, Policy::default())
        .unwrap_err();
    let ok = matches!(&e, Error::NotProfiled { format, .. } if format == "int8-g32");
    assert!(ok, "{e}");
    let settings = ProfileSettings {
        candidates: vec!["int8".into(), "int8-g32".into()],
        ..ProfileSettings::default()
    };
    let p = ActivationRecorder::new(settings)
        .record(&m, &batches(2, 4), |m, ids| m.forward(ids).map(drop))
        .unwrap();
    // a budget that fits INT8-g32 everywhere: it is the lower-error choice
    let plan =
        Plan::within_budget(&p, &[Format::Int8, int8_g32], total * 2, Policy::default()).unwrap();
    let chosen = plan
        .modules
        .values()
        .filter(|c| **c == Choice::Format(int8_g32))
        .count();
    assert!(chosen > 0, "{:?}", plan.modules);
}
