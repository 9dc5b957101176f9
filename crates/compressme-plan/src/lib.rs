//! Precision plans: which storage each module gets, chosen from an activation profile.
//!
//! - [`magnitude_density`]: the seed's importance heuristic (mean |x| times density,
//!   normalised so the most important module of a profile scores 1), and
//!   [`Plan::from_importance`], which maps scores to formats by thresholds.
//! - [`Plan::within_budget`]: one format per linear from a candidate list, minimising the
//!   summed estimated output error recorded in the profile (`Σ_j E[x_j²] · Σ_i Δw_ij²`)
//!   under a byte budget: an exact multiple-choice knapsack (a Pareto frontier over
//!   (bytes, error), pruned at the budget) that falls back to a Lagrangian search with a
//!   greedy repair, and says which, when the frontier grows past a cap.
//! - [`Plan::shuffled`]: the control, the same assignment permuted within groups of
//!   equal-shaped modules under a seed, so its stored bytes are exactly the same.
//! - [`Policy`]: output heads get at least INT8 unless `protect_output_head` is false.
//!
//! Both scores are heuristics, not causal sensitivities; the reports say so. Plans are
//! versioned JSON; a plan is validated against the model's modules before use.
//!
//! What it is not: a packer (the artifact writer applies plans) or a profiler.
//!
//! # Example
//! ```
//! use compressme_plan::{Plan, Policy, ModuleShape, Choice};
//! use compressme_quant::Format;
//! use std::collections::BTreeMap;
//!
//! let mut shapes = BTreeMap::new();
//! shapes.insert("lm_head".to_string(), ModuleShape { rows: 32, cols: 64, embedding: false });
//! shapes.insert("layers.0.mlp.up".to_string(), ModuleShape { rows: 128, cols: 64, embedding: false });
//! let mut modules = BTreeMap::new();
//! modules.insert("lm_head".to_string(), Choice::Format(Format::Nf4));
//! modules.insert("layers.0.mlp.up".to_string(), Choice::Format(Format::Nf4));
//! let mut plan = Plan::manual(modules, Policy::default());
//! plan.enforce_policy(&shapes); // the output head is raised to INT8
//! assert_eq!(plan.modules["lm_head"], Choice::Format(Format::Int8));
//! plan.validate(&shapes)?;
//! let back = Plan::from_json(&plan.to_json()?)?;
//! assert_eq!(back, plan);
//! # Ok::<(), compressme_plan::Error>(())
//! ```
#![deny(missing_docs)]
#![forbid(unsafe_code)]
// shapes and bytes come from profile and plan JSON: every operation on them is checked or
// saturating
#![deny(clippy::arithmetic_side_effects)]

use std::collections::BTreeMap;

use compressme_profile::{ModuleStats, Profile};
use compressme_quant::Format;
use compressme_quant::synthetic::Rng;
use serde::{Deserialize, Serialize};

/// The plan JSON version this build writes.
pub const VERSION: u32 = 1;
/// Frontier states the exact solver keeps before it falls back to the Lagrangian search.
pub const FRONTIER_CAP: usize = 200_000;

/// What can go wrong planning.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A plan names a module the model does not have.
    #[error("plan names `{0}`, which the model does not have")]
    UnknownModule(String),
    /// A storage a module cannot take.
    #[error("module `{module}`: {reason}")]
    Unsuitable {
        /// The module.
        module: String,
        /// Why.
        reason: String,
    },
    /// No assignment fits the budget.
    #[error("a budget of {budget} bytes cannot be met: the smallest plan takes {smallest}")]
    Budget {
        /// The budget.
        budget: u64,
        /// The smallest plan's bytes.
        smallest: u64,
    },
    /// JSON that is not a plan.
    #[error("plan: {0}")]
    Json(String),
    /// A candidate format the profile holds no error estimates for.
    #[error(
        "the profile holds no error estimates for {format} (it estimated: {profiled}); profile again with it among the candidates"
    )]
    NotProfiled {
        /// The candidate.
        format: String,
        /// The formats the profile estimated.
        profiled: String,
    },
}

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What a module is stored as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Choice {
    /// f32 as it was.
    Dense,
    /// Lossless row blocks (embeddings).
    Lossless,
    /// A `compressme-quant` format.
    Format(Format),
}

/// Bytes of a `[rows, cols]` weight in f32 (saturating).
fn dense_bytes(rows: usize, cols: usize) -> u64 {
    (rows as u64).saturating_mul(cols as u64).saturating_mul(4)
}

impl Choice {
    /// `dense`, `lossless` or the format's name.
    #[must_use]
    pub fn name(&self) -> String {
        match self {
            Self::Dense => "dense".into(),
            Self::Lossless => "lossless".into(),
            Self::Format(f) => f.to_string(),
        }
    }

    /// Reads what [`Choice::name`] writes.
    ///
    /// # Errors
    /// [`Error::Json`] for an unknown name.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "dense" => Ok(Self::Dense),
            "lossless" => Ok(Self::Lossless),
            f => Format::parse(f)
                .map(Self::Format)
                .map_err(|e| Error::Json(e.to_string())),
        }
    }

    /// Whether it keeps at least INT8 precision (the output-head floor).
    #[must_use]
    pub fn at_least_int8(&self) -> bool {
        match self {
            Self::Dense | Self::Lossless => true,
            Self::Format(f) => f.code_bits() >= 8,
        }
    }

    /// Stored bytes for a `[rows, cols]` weight (`None` for lossless: known only once
    /// packed).
    #[must_use]
    pub fn bytes(&self, rows: usize, cols: usize) -> Option<u64> {
        match self {
            Self::Dense => Some(dense_bytes(rows, cols)),
            Self::Lossless => None,
            Self::Format(f) => Some(f.stored_bytes(rows, cols) as u64),
        }
    }
}

impl Serialize for Choice {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.name())
    }
}

impl<'de> Deserialize<'de> for Choice {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// The output-head floor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    /// Give the output heads at least INT8 (default true).
    pub protect_output_head: bool,
    /// Module names of the output heads (default `lm_head`).
    pub output_heads: Vec<String>,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            protect_output_head: true,
            output_heads: vec!["lm_head".into()],
        }
    }
}

impl Policy {
    /// The policy as the artifact's recipe records it.
    #[must_use]
    pub fn describe(&self) -> String {
        if self.protect_output_head {
            format!("at least int8 for {}", self.output_heads.join(", "))
        } else {
            "output heads unprotected".into()
        }
    }
}

/// A module's shape, as plans need it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModuleShape {
    /// Output features or table rows.
    pub rows: usize,
    /// Input features or width.
    pub cols: usize,
    /// Whether it is an embedding table.
    pub embedding: bool,
}

/// The shapes of a profile's modules.
#[must_use]
pub fn shapes(profile: &Profile) -> BTreeMap<String, ModuleShape> {
    profile
        .modules
        .iter()
        .map(|(n, s)| {
            (
                n.clone(),
                ModuleShape {
                    rows: s.rows,
                    cols: s.cols,
                    embedding: s.kind == compressme_profile::ModuleKind::Embedding,
                },
            )
        })
        .collect()
}

/// How a plan was made, and what it costs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    /// [`VERSION`].
    pub version: u32,
    /// Storage by module name; modules not named stay as they are.
    pub modules: BTreeMap<String, Choice>,
    /// The output-head floor (default: at least INT8 for `lm_head`).
    #[serde(default)]
    pub policy: Policy,
    /// `manual`, `thresholds`, `budget`, or `shuffled`.
    #[serde(default = "manual_method")]
    pub method: String,
    /// The profile's model hash, when made from a profile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_sha256: Option<String>,
    /// The budget, bytes of the planned modules' weights, when there was one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_bytes: Option<u64>,
    /// Bytes of the planned modules' weights under this plan (lossless counted dense).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stored_bytes: Option<u64>,
    /// Summed estimated error (a heuristic), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub estimated_error: Option<f64>,
    /// Whether the budget solver proved its plan optimal (false: the Lagrangian fallback).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exact: Option<bool>,
    /// The shuffled control's seed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
}

fn manual_method() -> String {
    "manual".into()
}

impl Plan {
    /// A plan written by hand.
    #[must_use]
    pub fn manual(modules: BTreeMap<String, Choice>, policy: Policy) -> Self {
        Self {
            version: VERSION,
            modules,
            policy,
            method: "manual".into(),
            model_sha256: None,
            budget_bytes: None,
            stored_bytes: None,
            estimated_error: None,
            exact: None,
            seed: None,
        }
    }

    /// As pretty JSON.
    ///
    /// # Errors
    /// Never in practice.
    pub fn to_json(&self) -> Result<String> {
        serde_json::to_string_pretty(self).map_err(|e| Error::Json(e.to_string()))
    }

    /// Reads a plan: version 1, or version 0 (a bare `{"module": "format"}` map, as the
    /// seed's first plans were written), read with the default policy.
    ///
    /// # Errors
    /// [`Error::Json`] for anything else, naming the problem.
    pub fn from_json(text: &str) -> Result<Self> {
        let v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| Error::Json(e.to_string()))?;
        match v.get("version").map(serde_json::Value::as_u64) {
            Some(Some(1)) => serde_json::from_value(v).map_err(|e| Error::Json(e.to_string())),
            Some(other) => Err(Error::Json(format!(
                "plan version {other:?} is not supported (this build reads 1, and version-0 maps)"
            ))),
            None => {
                let modules: BTreeMap<String, Choice> =
                    serde_json::from_value(v).map_err(|e| Error::Json(e.to_string()))?;
                let mut p = Self::manual(modules, Policy::default());
                p.method = "manual (version 0)".into();
                Ok(p)
            }
        }
    }

    /// Raises output heads to INT8 when the policy protects them.
    pub fn enforce_policy(&mut self, shapes: &BTreeMap<String, ModuleShape>) {
        if !self.policy.protect_output_head {
            return;
        }
        for head in &self.policy.output_heads {
            if let Some(c) = self.modules.get_mut(head)
                && !c.at_least_int8()
            {
                *c = Choice::Format(Format::Int8);
            }
        }
        self.stored_bytes = planned_bytes(&self.modules, shapes);
    }

    /// Checks the plan against the model's modules: every name exists; embeddings get
    /// dense, lossless, or INT8 rows; linears get dense or a format whose groups divide
    /// their width; protected heads keep at least INT8.
    ///
    /// # Errors
    /// [`Error::UnknownModule`], [`Error::Unsuitable`].
    pub fn validate(&self, shapes: &BTreeMap<String, ModuleShape>) -> Result<()> {
        for (name, choice) in &self.modules {
            let s = shapes
                .get(name)
                .ok_or_else(|| Error::UnknownModule(name.clone()))?;
            let bad = |reason: String| {
                Err(Error::Unsuitable {
                    module: name.clone(),
                    reason,
                })
            };
            match (s.embedding, choice) {
                (true, Choice::Dense | Choice::Lossless)
                | (true, Choice::Format(Format::Int8Rows | Format::Int8)) => {}
                (true, c) => {
                    return bad(format!(
                        "an embedding takes dense, lossless or int8-rows, not {}",
                        c.name()
                    ));
                }
                (false, Choice::Lossless) => {
                    return bad("lossless storage is for embeddings".into());
                }
                (false, Choice::Format(Format::Int8Rows)) => {
                    return bad("int8-rows is for embeddings".into());
                }
                (false, Choice::Format(f)) => {
                    if let Some(g) = f.group()
                        && !s.cols.is_multiple_of(g)
                    {
                        return bad(format!(
                            "{f}: group {g} does not divide its width {}",
                            s.cols
                        ));
                    }
                }
                (false, Choice::Dense) => {}
            }
            if self.policy.protect_output_head
                && self.policy.output_heads.contains(name)
                && !choice.at_least_int8()
            {
                return bad(format!(
                    "an output head gets at least int8 ({} asked; set protect_output_head to false to allow it)",
                    choice.name()
                ));
            }
        }
        Ok(())
    }

    /// The seed's thresholds on [`magnitude_density`] scores: 0.75 and above f16, 0.4 and
    /// above INT8, the rest NF4 per row; output heads floored by `policy`.
    #[must_use]
    pub fn from_importance(profile: &Profile, policy: Policy) -> Self {
        Self::from_importance_with(profile, policy, 0.75, 0.4)
    }

    /// [`Plan::from_importance`] with other thresholds.
    #[must_use]
    pub fn from_importance_with(
        profile: &Profile,
        policy: Policy,
        f16_at: f64,
        int8_at: f64,
    ) -> Self {
        let scores = magnitude_density(profile);
        let modules = scores
            .iter()
            .map(|(n, &s)| {
                let f = if s >= f16_at {
                    Format::F16
                } else if s >= int8_at {
                    Format::Int8
                } else {
                    Format::Nf4
                };
                // a format that cannot hold the weights is never chosen: dense instead
                let holds = profile
                    .modules
                    .get(n)
                    .is_none_or(|m| !m.unrepresentable.contains(&f.to_string()));
                (
                    n.clone(),
                    if holds {
                        Choice::Format(f)
                    } else {
                        Choice::Dense
                    },
                )
            })
            .collect();
        let mut p = Self::manual(modules, policy);
        p.method = format!("thresholds (f16 >= {f16_at}, int8 >= {int8_at})");
        p.model_sha256 = Some(profile.model_sha256.clone());
        let sh = shapes(profile);
        p.enforce_policy(&sh);
        p.estimated_error = estimated_error(profile, &p.modules);
        p
    }

    /// One format per linear of `profile` from `candidates` (and dense f32), minimising
    /// the summed estimated error with the planned weights' bytes at most `budget_bytes`.
    ///
    /// # Errors
    /// [`Error::Budget`] when even the smallest choices do not fit;
    /// [`Error::NotProfiled`] for a candidate the profile did not estimate (it would
    /// otherwise be skipped without a word).
    pub fn within_budget(
        profile: &Profile,
        candidates: &[Format],
        budget_bytes: u64,
        policy: Policy,
    ) -> Result<Self> {
        let profiled: Vec<Format> = profile
            .settings
            .candidates
            .iter()
            .filter_map(|c| Format::parse(c).ok())
            .collect();
        if let Some(f) = candidates.iter().find(|f| !profiled.contains(f)) {
            return Err(Error::NotProfiled {
                format: f.to_string(),
                profiled: profile.settings.candidates.join(", "),
            });
        }
        let mut items: Vec<(String, Vec<Option3>)> = Vec::new();
        for (name, s) in linears(profile) {
            let head = policy.protect_output_head && policy.output_heads.contains(name);
            let mut opts = vec![(Choice::Dense, dense_bytes(s.rows, s.cols), 0.0)];
            for f in candidates {
                let choice = Choice::Format(*f);
                if head && !choice.at_least_int8() {
                    continue;
                }
                if f.group().is_some_and(|g| !s.cols.is_multiple_of(g))
                    || s.unrepresentable.contains(&f.to_string())
                {
                    continue;
                }
                if let Some(&e) = s.estimated_error.get(&f.to_string()) {
                    opts.push((choice, f.stored_bytes(s.rows, s.cols) as u64, e));
                }
            }
            items.push((name.clone(), opts));
        }
        let costs: Vec<Vec<(u64, f64)>> = items
            .iter()
            .map(|(_, o)| o.iter().map(|&(_, b, e)| (b, e)).collect())
            .collect();
        let (picks, exact) = solve(&costs, budget_bytes)?;
        let modules: BTreeMap<String, Choice> = items
            .iter()
            .zip(&picks)
            .map(|((n, opts), &k)| (n.clone(), opts.get(k).map_or(Choice::Dense, |o| o.0)))
            .collect();
        let mut p = Self::manual(modules, policy);
        p.method = "budget".into();
        p.model_sha256 = Some(profile.model_sha256.clone());
        p.budget_bytes = Some(budget_bytes);
        p.stored_bytes = planned_bytes(&p.modules, &shapes(profile));
        p.estimated_error = estimated_error(profile, &p.modules);
        p.exact = Some(exact);
        Ok(p)
    }

    /// The shuffled control: within each group of equal-shaped modules (heads under a
    /// protecting policy excepted), the assignment is permuted under `seed`. Stored bytes
    /// are exactly those of `self`.
    #[must_use]
    pub fn shuffled(&self, shapes: &BTreeMap<String, ModuleShape>, seed: u64) -> Self {
        let mut groups: BTreeMap<(usize, usize, bool), Vec<String>> = BTreeMap::new();
        for name in self.modules.keys() {
            let protected =
                self.policy.protect_output_head && self.policy.output_heads.contains(name);
            if let (Some(s), false) = (shapes.get(name), protected) {
                groups
                    .entry((s.rows, s.cols, s.embedding))
                    .or_default()
                    .push(name.clone());
            }
        }
        let mut rng = Rng::new(seed);
        let mut modules = self.modules.clone();
        for names in groups.values() {
            let mut choices: Vec<Choice> = names
                .iter()
                .filter_map(|n| self.modules.get(n).copied())
                .collect();
            for i in (1..choices.len()).rev() {
                let j = rng
                    .next_u64()
                    .checked_rem((i as u64).saturating_add(1))
                    .unwrap_or(0) as usize;
                choices.swap(i, j);
            }
            for (n, c) in names.iter().zip(choices) {
                modules.insert(n.clone(), c);
            }
        }
        let mut p = self.clone();
        p.modules = modules;
        p.method = format!("shuffled ({})", self.method);
        p.seed = Some(seed);
        p.estimated_error = None;
        p.stored_bytes = planned_bytes(&p.modules, shapes);
        p
    }
}

/// One option of the budget solver: storage, bytes, estimated error.
type Option3 = (Choice, u64, f64);

fn linears(profile: &Profile) -> impl Iterator<Item = (&String, &ModuleStats)> {
    profile
        .modules
        .iter()
        .filter(|(_, s)| s.kind == compressme_profile::ModuleKind::Linear)
}

/// Bytes of the planned modules' weights (lossless counted as dense).
#[must_use]
pub fn planned_bytes(
    modules: &BTreeMap<String, Choice>,
    shapes: &BTreeMap<String, ModuleShape>,
) -> Option<u64> {
    modules
        .iter()
        .map(|(n, c)| {
            let s = shapes.get(n)?;
            Some(
                c.bytes(s.rows, s.cols)
                    .unwrap_or(dense_bytes(s.rows, s.cols)),
            )
        })
        .try_fold(0u64, |total, b| Some(total.saturating_add(b?)))
}

fn estimated_error(profile: &Profile, modules: &BTreeMap<String, Choice>) -> Option<f64> {
    modules
        .iter()
        .map(|(n, c)| match c {
            Choice::Dense | Choice::Lossless => Some(0.0),
            Choice::Format(f) => profile
                .modules
                .get(n)?
                .estimated_error
                .get(&f.to_string())
                .copied(),
        })
        .sum()
}

/// The seed's importance: mean |x| times density for each linear, divided by the
/// profile's largest, so scores are in [0, 1]. A heuristic, not a causal sensitivity.
#[must_use]
pub fn magnitude_density(profile: &Profile) -> BTreeMap<String, f64> {
    let raw: BTreeMap<String, f64> = linears(profile)
        .map(|(n, s)| (n.clone(), s.mean_abs() * s.density()))
        .collect();
    let max = raw.values().copied().fold(0.0, f64::max);
    raw.into_iter()
        .map(|(n, v)| (n, if max > 0.0 { v / max } else { 0.0 }))
        .collect()
}

/// Multiple-choice knapsack: for each item one option `(bytes, error)`, minimising the
/// summed error with summed bytes at most `budget`. Returns the picks and whether they
/// are proven optimal.
///
/// Exact: a frontier of non-dominated partial sums (fewer bytes or less error), pruned
/// at the budget. Past [`FRONTIER_CAP`] states it switches to a Lagrangian search
/// (minimise error + λ bytes per item, bisecting λ) followed by a greedy repair that spends
/// the remaining slack on the best error reduction per byte.
///
/// # Errors
/// [`Error::Budget`] when the smallest options do not fit.
pub fn solve(items: &[Vec<(u64, f64)>], budget: u64) -> Result<(Vec<usize>, bool)> {
    let smallest: u64 = items
        .iter()
        .map(|o| o.iter().map(|c| c.0).min().unwrap_or(0))
        .fold(0, u64::saturating_add);
    if smallest > budget {
        return Err(Error::Budget { budget, smallest });
    }
    if let Some(p) = frontier(items, budget) {
        return Ok((p, true));
    }
    Ok((lagrangian(items, budget), false))
}

fn frontier(items: &[Vec<(u64, f64)>], budget: u64) -> Option<Vec<usize>> {
    // states: (bytes, error, back-pointer into history)
    #[derive(Clone, Copy)]
    struct State {
        bytes: u64,
        err: f64,
        parent: usize,
        pick: usize,
    }
    let mut history: Vec<Vec<State>> = Vec::with_capacity(items.len());
    let mut front = vec![State {
        bytes: 0,
        err: 0.0,
        parent: 0,
        pick: 0,
    }];
    // the cheapest remaining bytes bound what a partial sum may use
    let mut rest_min: Vec<u64> = vec![0; items.len().saturating_add(1)];
    for i in (0..items.len()).rev() {
        let m = items
            .get(i)
            .and_then(|o| o.iter().map(|c| c.0).min())
            .unwrap_or(0);
        rest_min[i] = rest_min[i.saturating_add(1)].saturating_add(m);
    }
    for (i, opts) in items.iter().enumerate() {
        let mut next: Vec<State> = Vec::with_capacity(front.len().saturating_mul(opts.len()));
        for (si, s) in front.iter().enumerate() {
            for (k, &(b, e)) in opts.iter().enumerate() {
                let bytes = s.bytes.saturating_add(b);
                if bytes.saturating_add(rest_min[i.saturating_add(1)]) <= budget {
                    next.push(State {
                        bytes,
                        err: s.err + e,
                        parent: si,
                        pick: k,
                    });
                }
            }
        }
        next.sort_by(|a, b| a.bytes.cmp(&b.bytes).then(a.err.total_cmp(&b.err)));
        let mut pruned: Vec<State> = Vec::with_capacity(next.len());
        for s in next {
            if pruned.last().is_none_or(|l: &State| s.err < l.err) {
                pruned.push(s);
            }
        }
        if pruned.len() > FRONTIER_CAP {
            return None;
        }
        history.push(front);
        front = pruned;
    }
    let best = front
        .iter()
        .enumerate()
        .min_by(|a, b| a.1.err.total_cmp(&b.1.err))?
        .0;
    let mut picks = vec![0; items.len()];
    let mut at = best;
    let mut layer = front;
    for i in (0..items.len()).rev() {
        let s = *layer.get(at)?;
        picks[i] = s.pick;
        at = s.parent;
        layer = history.pop()?;
    }
    Some(picks)
}

fn lagrangian(items: &[Vec<(u64, f64)>], budget: u64) -> Vec<usize> {
    let pick = |lambda: f64| -> Vec<usize> {
        items
            .iter()
            .map(|o| {
                o.iter()
                    .enumerate()
                    .min_by(|a, b| {
                        (a.1.1 + lambda * a.1.0 as f64).total_cmp(&(b.1.1 + lambda * b.1.0 as f64))
                    })
                    .map_or(0, |(k, _)| k)
            })
            .collect()
    };
    let bytes = |p: &[usize]| -> u64 {
        p.iter()
            .zip(items)
            .map(|(&k, o)| o.get(k).map_or(0, |c| c.0))
            .fold(0, u64::saturating_add)
    };
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    while bytes(&pick(hi)) > budget && hi < 1e30 {
        hi *= 4.0;
    }
    for _ in 0..100 {
        let mid = 0.5 * (lo + hi);
        if bytes(&pick(mid)) > budget {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let mut p = pick(hi);
    if bytes(&p) > budget {
        // the cheapest option of every item fits (checked by the caller)
        p = items
            .iter()
            .map(|o| {
                o.iter()
                    .enumerate()
                    .min_by_key(|c| c.1.0)
                    .map_or(0, |c| c.0)
            })
            .collect();
    }
    // greedy repair: spend slack on the best error reduction per extra byte
    loop {
        let used = bytes(&p);
        let mut best: Option<(usize, usize, f64)> = None;
        for (i, (o, &k)) in items.iter().zip(&p).enumerate() {
            let Some(&(b0, e0)) = o.get(k) else { continue };
            for (j, &(b, e)) in o.iter().enumerate() {
                if e < e0 && used.saturating_sub(b0).saturating_add(b) <= budget {
                    let gain = (e0 - e) / ((b.saturating_sub(b0)) as f64 + 1.0);
                    if best.is_none_or(|x| gain > x.2) {
                        best = Some((i, j, gain));
                    }
                }
            }
        }
        match best {
            Some((i, j, _)) => {
                if let Some(slot) = p.get_mut(i) {
                    *slot = j;
                }
            }
            None => break,
        }
    }
    p
}
