//! Evaluation of language models whose storage changed: perplexity over complete
//! documents with overlapping windows, distribution shift against the f32 reference (KL
//! divergence, top-1 agreement, change in the correct token's probability), and paired
//! comparisons of two variants on the same targets (bootstrap interval, sign test).
//!
//! Models enter as a closure from token ids to next-token logits, so any family (and any
//! storage) can be scored; the crate holds no model code. The closure is told which rows
//! (positions of the window) are scored, and returns only those: with overlapping windows
//! the rest are context, and a model need not run its output head on them.
//!
//! Also: [`time`] (warm-up, raw samples, units actually produced), [`peak_rss_bytes`],
//! [`reset_peak_rss`] and [`current_rss_bytes`]; [`median`] and [`cosine`], used across
//! the workspace.
//!
//! For models without a language-model head (sentence embedders): [`embedding_agreement`]
//! (cosine to the reference and nearest-neighbour retrieval agreement).
//!
//! What it is not: the offline benchmark and its report (`compressme-offline` builds them
//! on these), or any model code.
//!
//! # Example
//! ```
//! use compressme_eval::{Window, score_documents};
//!
//! // a "model" that always predicts token 1 with probability ~1, at the rows asked for
//! let logits = |_ids: &[u32], rows: std::ops::Range<usize>| -> Result<Vec<Vec<f32>>, String> {
//!     Ok(rows.map(|_| vec![0.0, 30.0, 0.0]).collect())
//! };
//! let docs = vec![vec![1u32, 1, 1, 1, 1], vec![0, 1, 1]];
//! let s = score_documents(&docs, Window { len: 3, stride: 2 }, false, logits)?;
//! assert_eq!(s.tokens.len(), 4 + 2); // every target of every document, once
//! assert!(s.perplexity() < 1.001); // every target is token 1
//! # Ok::<(), compressme_eval::Error>(())
//! ```
#![deny(missing_docs)]
#![forbid(unsafe_code)]

use compressme_quant::synthetic::Rng;
use serde::{Deserialize, Serialize};

/// What can go wrong evaluating.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The model failed on a window.
    #[error("document {doc}, window starting at token {start}: {message}")]
    Model {
        /// The document.
        doc: usize,
        /// The window's first token.
        start: usize,
        /// The model's error.
        message: String,
    },
    /// A loss that is NaN or infinite.
    #[error("document {doc}, token {position}: non-finite log-likelihood {value}")]
    NonFinite {
        /// The document.
        doc: usize,
        /// The target's position.
        position: usize,
        /// The value.
        value: f64,
    },
    /// Inputs that do not fit together.
    #[error("{0}")]
    Invalid(String),
}

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Rows of a window: `rows.start..rows.end` index its positions, and row `i` holds the
/// next-token logits after position `i` (the distribution of token `i + 1`).
pub type Rows = std::ops::Range<usize>;

/// Overlapping windows: `len` tokens each, starting every `stride` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Window {
    /// Tokens a window (the model's context).
    pub len: usize,
    /// Tokens between window starts. A stride of `len` or more would leave targets
    /// that no window predicts (a window's first token has no context inside it), so
    /// windows then advance by `len - 1`: every target is still scored once.
    pub stride: usize,
}

impl Window {
    /// How far windows actually advance: `stride`, at most `len - 1`.
    #[must_use]
    pub fn step(&self) -> usize {
        self.stride.min(self.len.saturating_sub(1)).max(1)
    }
}

/// One scored target.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenScore {
    /// Document index.
    pub doc: usize,
    /// Position of the target in its document (at least 1).
    pub position: usize,
    /// The target token.
    pub target: u32,
    /// Natural-log probability the model gave it.
    pub logprob: f64,
    /// Tokens of context it was predicted from.
    pub context: usize,
}

/// Every target of every document, scored once.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Scored {
    /// In document order, then position order.
    pub tokens: Vec<TokenScore>,
    /// Per target, the full log-probability vector (kept on request, for KL).
    #[serde(skip)]
    pub distributions: Vec<Vec<f32>>,
    /// Per target, `exp` of each kept log-probability, in f64 as the KL takes it: empty
    /// unless [`Scored::with_probabilities`] made it, for a reference that many variants
    /// are scored against ([`score_against`] then reads them instead of taking the
    /// exponentials again; the results are the same bits either way).
    #[serde(skip)]
    pub probabilities: Vec<Vec<f64>>,
    /// Per target, the most likely token of its kept distribution (the last of equals in
    /// `f64::total_cmp`'s order): empty unless [`Scored::with_probabilities`] made it.
    #[serde(skip)]
    pub argmaxes: Vec<usize>,
}

impl Scored {
    /// Mean negative log-likelihood a target.
    #[must_use]
    pub fn mean_nll(&self) -> f64 {
        -self.tokens.iter().map(|t| t.logprob).sum::<f64>() / self.tokens.len().max(1) as f64
    }

    /// exp(mean NLL).
    #[must_use]
    pub fn perplexity(&self) -> f64 {
        self.mean_nll().exp()
    }

    /// Per-target negative log-likelihoods.
    #[must_use]
    pub fn nll(&self) -> Vec<f64> {
        self.tokens.iter().map(|t| -t.logprob).collect()
    }

    /// This reference with [`Scored::probabilities`] worked out from its distributions (on
    /// every core), so that each variant [`score_against`] it takes one exponential a
    /// vocabulary entry, not two. Twice the distributions' memory (8 bytes an entry).
    #[must_use]
    pub fn with_probabilities(mut self) -> Self {
        use rayon::prelude::*;
        self.probabilities = self
            .distributions
            .par_iter()
            .map(|d| compressme_quant::softmax::exp_all(d))
            .collect();
        self.argmaxes = self
            .distributions
            .par_iter()
            .map(|d| compressme_quant::softmax::argmax(d))
            .collect();
        self
    }
}

/// `f` of `logits`' log-softmax (`compressme_quant::softmax::log_softmax`), worked out in
/// a vocabulary-long buffer this thread keeps from row to row (a call within `f` takes a
/// buffer of its own).
fn with_log_softmax<R>(logits: &[f32], f: impl FnOnce(&[f64]) -> R) -> R {
    thread_local! {
        static ROW: std::cell::Cell<Vec<f64>> = const { std::cell::Cell::new(Vec::new()) };
    }
    let mut row = ROW.take();
    compressme_quant::softmax::log_softmax(logits, &mut row);
    let r = f(&row);
    ROW.set(row);
    r
}

/// Scores every target of every document exactly once (positions `1..n`; the first token
/// has no context). Windows of `window.len` tokens start every [`Window::step`] tokens;
/// each target is taken from the first window that predicts it and has not been counted,
/// so its context is as long as the window allows. `logits(ids, rows)` returns, for each
/// position of `ids` in `rows`, the logits of the next token: the rows the window's
/// targets need (see [`Rows`]; the positions before them are context only, and so is the
/// window's last).
///
/// # Errors
/// [`Error::Invalid`] for a bad window or logits of the wrong shape, [`Error::Model`]
/// naming the document and window, [`Error::NonFinite`] naming the document and position.
pub fn score_documents(
    docs: &[Vec<u32>],
    window: Window,
    keep_distributions: bool,
    mut logits: impl FnMut(&[u32], Rows) -> std::result::Result<Vec<Vec<f32>>, String>,
) -> Result<Scored> {
    score_windows(
        docs,
        window,
        keep_distributions,
        1,
        one_at_a_time(|ids, rows| logits(ids, rows).map(|out| (out, ()))),
    )
}

/// [`score_documents`] with `lanes` windows' logits worked out side by side, each on one
/// thread (`compressme_quant::in_lanes`): for a model whose products scale worse on the
/// cores than whole windows do. The same results, bit for bit, when `logits` gives the
/// same bits on any thread.
///
/// # Errors
/// As [`score_documents`].
pub fn score_documents_in_lanes(
    docs: &[Vec<u32>],
    window: Window,
    keep_distributions: bool,
    lanes: usize,
    logits: impl Fn(&[u32], Rows) -> std::result::Result<Vec<Vec<f32>>, String> + Sync,
) -> Result<Scored> {
    score_windows(docs, window, keep_distributions, lanes, |windows| {
        // a window's failure is its result, so every lane's run is `Ok`
        let run = |_: &mut (), (ids, rows): &(&[u32], Rows)| -> std::result::Result<_, ()> {
            Ok(logits(ids, rows.clone()).map(|out| (out, ())))
        };
        compressme_quant::in_lanes(windows, lanes, || Ok(()), run).unwrap_or_default()
    })
}

/// `f` a window at a time, as [`for_each_target`] takes its windows.
#[allow(clippy::type_complexity)]
fn one_at_a_time<X>(
    mut f: impl FnMut(&[u32], Rows) -> std::result::Result<(Vec<Vec<f32>>, X), String>,
) -> impl FnMut(&[(&[u32], Rows)]) -> Vec<std::result::Result<(Vec<Vec<f32>>, X), String>> {
    move |windows| {
        windows
            .iter()
            .map(|(ids, rows)| f(ids, rows.clone()))
            .collect()
    }
}

/// [`score_documents`], `group` windows a call of `run`.
fn score_windows(
    docs: &[Vec<u32>],
    window: Window,
    keep_distributions: bool,
    group: usize,
    run: impl FnMut(&[(&[u32], Rows)]) -> Vec<std::result::Result<(Vec<Vec<f32>>, ()), String>>,
) -> Result<Scored> {
    let mut tokens = Vec::new();
    let mut distributions = Vec::new();
    for_each_target(
        docs,
        window,
        group,
        run,
        |_, _, lp, _, ()| {
            Ok(keep_distributions.then(|| lp.iter().map(|&v| v as f32).collect::<Vec<f32>>()))
        },
        |t, kept| {
            tokens.push(t);
            distributions.extend(kept);
            Ok(())
        },
    )?;
    Ok(Scored {
        tokens,
        distributions,
        probabilities: Vec::new(),
        argmaxes: Vec::new(),
    })
}

/// Targets whose log-probabilities [`for_each_target`] computes at a time, on every core:
/// each is a vocabulary of f64s (16 x 49,152 x 8 bytes is 6 MB), so memory stays small.
const SCORE_CHUNK: usize = 16;

/// The windows [`score_documents`] runs, and for each the rows it counts: calls `run` with
/// `group` windows at a time, in order, as `(ids, rows)` (returning, for each, the logit
/// rows `rows` of it, the ones its targets need, and anything else the caller needs, or
/// the window's failure), then, for every target each window scores, in order,
/// `prepare(k, &score, log_probs, row, extra)` (`k` counting the targets from 0,
/// `row` the target's index among the rows returned) and `take(score, prepared)`. The
/// log-softmaxes and `prepare` run on rayon's threads, [`SCORE_CHUNK`] targets at a time;
/// `take` runs on the caller's thread, in the targets' order, and the first error in that
/// order is returned: the results do not depend on the thread count.
fn for_each_target<X: Sync, P: Send>(
    docs: &[Vec<u32>],
    window: Window,
    group: usize,
    mut run: impl FnMut(&[(&[u32], Rows)]) -> Vec<std::result::Result<(Vec<Vec<f32>>, X), String>>,
    prepare: impl Fn(usize, &TokenScore, &[f64], usize, &X) -> Result<P> + Sync,
    mut take: impl FnMut(TokenScore, P) -> Result<()>,
) -> Result<()> {
    use rayon::prelude::*;
    let spans = spans(docs, window)?;
    let mut k = 0;
    for group in spans.chunks(group.max(1)) {
        let windows: Vec<(&[u32], Rows)> = group
            .iter()
            .map(|s| {
                let ids = docs
                    .get(s.d)
                    .and_then(|doc| doc.get(s.start..s.end))
                    .unwrap_or(&[]);
                (ids, s.first..s.first + s.positions.len())
            })
            .collect();
        let outs = run(&windows);
        if outs.len() != group.len() {
            return Err(Error::Invalid(format!(
                "{} windows' logits where {} were asked for",
                outs.len(),
                group.len()
            )));
        }
        for ((span, (ids, rows)), out) in group.iter().zip(&windows).zip(outs) {
            let &Span {
                d, start, first, ..
            } = span;
            let doc = docs.get(d).map_or(&[][..], Vec::as_slice);
            let (out, extra) = out.map_err(|message| Error::Model {
                doc: d,
                start,
                message,
            })?;
            if out.len() != rows.len() {
                return Err(Error::Invalid(format!(
                    "document {d}: {} logit rows where rows {}..{} of {} tokens were asked for",
                    out.len(),
                    rows.start,
                    rows.end,
                    ids.len()
                )));
            }
            for chunk in span.positions.chunks(SCORE_CHUNK) {
                let k0 = k;
                let one = |(i, &position): (usize, &usize)| -> Result<(TokenScore, P)> {
                    let row = position - 1 - start - first;
                    // both exist: `out` has a row per position scored, and `position < end <= n`
                    let (Some(logits), Some(&target)) = (out.get(row), doc.get(position)) else {
                        return Err(Error::Invalid(format!(
                            "document {d}: no logits for position {position}"
                        )));
                    };
                    with_log_softmax(logits, |lp| {
                        let logprob = lp.get(target as usize).copied().ok_or_else(|| {
                            Error::Invalid(format!(
                                "document {d}: token {target} past a vocabulary of {}",
                                lp.len()
                            ))
                        })?;
                        if !logprob.is_finite() {
                            return Err(Error::NonFinite {
                                doc: d,
                                position,
                                value: logprob,
                            });
                        }
                        let score = TokenScore {
                            doc: d,
                            position,
                            target,
                            logprob,
                            context: position - start,
                        };
                        let prepared = prepare(k0 + i, &score, lp, row, &extra)?;
                        Ok((score, prepared))
                    })
                };
                let done: Vec<Result<(TokenScore, P)>> =
                    chunk.par_iter().enumerate().map(one).collect();
                for r in done {
                    let (score, prepared) = r?;
                    take(score, prepared)?;
                    k += 1;
                }
            }
        }
    }
    Ok(())
}

/// One window of [`for_each_target`]: document `d`'s tokens `start..end`, whose rows from
/// `first` on predict the targets at `positions` (row `i` predicts position
/// `start + i + 1`; the rows before are context only).
struct Span {
    d: usize,
    start: usize,
    end: usize,
    first: usize,
    positions: Vec<usize>,
}

/// The windows [`for_each_target`] runs, in order.
fn spans(docs: &[Vec<u32>], window: Window) -> Result<Vec<Span>> {
    // windows overlap by at least one token (see `Window::step`): a window's first token
    // is predicted by the window before it
    if window.len < 2 || window.stride == 0 {
        return Err(Error::Invalid(format!(
            "window of {} tokens with stride {}: need len >= 2 and stride >= 1",
            window.len, window.stride
        )));
    }
    let mut spans = Vec::new();
    for (d, doc) in docs.iter().enumerate() {
        let n = doc.len();
        let mut counted = 1; // the next target position not yet scored
        let mut start = 0;
        while counted < n {
            let end = (start + window.len).min(n);
            let scored = counted.max(start + 1);
            spans.push(Span {
                d,
                start,
                end,
                first: scored - 1 - start,
                positions: (scored..end).collect(),
            });
            counted = end;
            if end == n {
                break;
            }
            start += window.step();
        }
    }
    Ok(spans)
}

/// A variant and its reference scored on the same windows, and the shift between them.
#[derive(Debug, Clone, PartialEq)]
pub struct PairScored {
    /// The reference's scores (no distributions kept).
    pub reference: Scored,
    /// The variant's scores (no distributions kept).
    pub variant: Scored,
    /// KL, top-1 agreement and the correct token's probability change.
    pub shift: Shift,
}

/// Scores `variant` and `reference` on the same windows of the same documents, as
/// [`score_documents`] would, and computes [`shift`] window by window without keeping
/// any distribution (a vocabulary of 50,000 over thousands of targets would take
/// gigabytes). `reference(ids, rows)` and `variant(ids, rows)` return next-token logits at
/// the rows asked for, as in [`score_documents`].
///
/// # Errors
/// As [`score_documents`], for either model; logits of different widths.
pub fn score_pair(
    docs: &[Vec<u32>],
    window: Window,
    mut reference: impl FnMut(&[u32], Rows) -> std::result::Result<Vec<Vec<f32>>, String>,
    mut variant: impl FnMut(&[u32], Rows) -> std::result::Result<Vec<Vec<f32>>, String>,
) -> Result<PairScored> {
    let (mut rt, mut vt) = (Vec::new(), Vec::new());
    let mut acc = ShiftAcc::default();
    for_each_target(
        docs,
        window,
        1,
        one_at_a_time(|ids, rows| Ok((reference(ids, rows.clone())?, variant(ids, rows)?))),
        |_, t, lp_ref, row, rows| {
            let Some(q_logits) = rows.get(row) else {
                return Err(Error::Invalid("variant returned too few rows".into()));
            };
            if q_logits.len() != lp_ref.len() {
                return Err(Error::Invalid(format!(
                    "document {}: the variant's logits are {} wide, the reference's {}",
                    t.doc,
                    q_logits.len(),
                    lp_ref.len()
                )));
            }
            with_log_softmax(q_logits, |lq| {
                let target = t.target as usize;
                let vlp = lq.get(target).copied().unwrap_or(f64::NEG_INFINITY);
                if !vlp.is_finite() {
                    return Err(Error::NonFinite {
                        doc: t.doc,
                        position: t.position,
                        value: vlp,
                    });
                }
                Ok((vlp, TargetShift::new(lp_ref, None, None, lq, target)))
            })
        },
        |t, (vlp, shift)| {
            acc.push(shift);
            vt.push(TokenScore {
                logprob: vlp,
                ..t.clone()
            });
            rt.push(t);
            Ok(())
        },
    )?;
    Ok(PairScored {
        reference: Scored {
            tokens: rt,
            distributions: Vec::new(),
            probabilities: Vec::new(),
            argmaxes: Vec::new(),
        },
        variant: Scored {
            tokens: vt,
            distributions: Vec::new(),
            probabilities: Vec::new(),
            argmaxes: Vec::new(),
        },
        shift: acc.finish(),
    })
}

/// Scores `variant` on the windows `reference` was scored on (by [`score_documents`]
/// with its distributions kept), and computes [`shift`] target by target against the
/// kept distributions, without keeping the variant's: a reference scored once serves
/// every variant.
///
/// # Errors
/// As [`score_documents`]; a reference scored without distributions or on other
/// targets.
pub fn score_against(
    docs: &[Vec<u32>],
    window: Window,
    reference: &Scored,
    mut variant: impl FnMut(&[u32], Rows) -> std::result::Result<Vec<Vec<f32>>, String>,
) -> Result<(Scored, Shift)> {
    if reference.distributions.len() != reference.tokens.len() {
        return Err(Error::Invalid(
            "the reference was scored without its distributions".into(),
        ));
    }
    let mut tokens = Vec::with_capacity(reference.tokens.len());
    let mut acc = ShiftAcc::default();
    for_each_target(
        docs,
        window,
        1,
        one_at_a_time(|ids, rows| variant(ids, rows).map(|out| (out, ()))),
        |k, t, lq, _, ()| {
            let (Some(r), Some(p)) = (reference.tokens.get(k), reference.distributions.get(k))
            else {
                return Err(Error::Invalid("more targets than the reference has".into()));
            };
            if (r.doc, r.position, r.target) != (t.doc, t.position, t.target) || p.len() != lq.len()
            {
                return Err(Error::Invalid(format!(
                    "target {k} (document {}, position {}) is not the reference's",
                    t.doc, t.position
                )));
            }
            let exp = reference
                .probabilities
                .get(k)
                .filter(|e| e.len() == p.len());
            let top = reference
                .argmaxes
                .get(k)
                .filter(|_| reference.argmaxes.len() == reference.distributions.len());
            Ok(TargetShift::new(
                p,
                exp.map(Vec::as_slice),
                top.copied(),
                lq,
                t.target as usize,
            ))
        },
        |t, shift| {
            acc.push(shift);
            tokens.push(t);
            Ok(())
        },
    )?;
    if tokens.len() != reference.tokens.len() {
        return Err(Error::Invalid(format!(
            "{} targets scored, the reference has {}",
            tokens.len(),
            reference.tokens.len()
        )));
    }
    Ok((
        Scored {
            tokens,
            distributions: Vec::new(),
            probabilities: Vec::new(),
            argmaxes: Vec::new(),
        },
        acc.finish(),
    ))
}

/// Running sums of [`Shift`], one target at a time.
#[derive(Default)]
struct ShiftAcc {
    kls: Vec<f64>,
    dps: Vec<f64>,
    agree: usize,
    dp_sum: f64,
}

/// One target's part of [`Shift`]: computed on any thread, added in the targets' order.
struct TargetShift {
    kl: f64,
    agree: bool,
    dp: f64,
}

impl TargetShift {
    /// A target's KL, top-1 agreement and change in the target's probability, from the
    /// log-probabilities of the reference `p` and the variant `q`; `p_exp` and `p_argmax`,
    /// where given, hold `exp` of each of `p` and the argmax of `p` (taken from them
    /// instead of worked out: the same bits). The KL's sum and every exponential are
    /// `compressme_quant::softmax`'s (the same bits on every CPU).
    fn new<P: LogProb>(
        p: &[P],
        p_exp: Option<&[f64]>,
        p_argmax: Option<usize>,
        q: &[f64],
        target: usize,
    ) -> Self {
        use compressme_quant::softmax::exp;
        let prob = |v: Option<f64>| exp(v.unwrap_or(f64::NEG_INFINITY));
        let p_target = match p_exp {
            Some(e) => e.get(target).copied().unwrap_or(0.0),
            None => prob(p.get(target).map(|&x| x.into())),
        };
        Self {
            kl: P::kl_sum(p, p_exp, q),
            agree: p_argmax.unwrap_or_else(|| P::argmax(p))
                == compressme_quant::softmax::argmax_f64(q),
            dp: prob(q.get(target).copied()) - p_target,
        }
    }
}

/// The reference's log-probabilities as kept (f32) or just worked out (f64).
trait LogProb: Copy + Into<f64> {
    /// `compressme_quant::softmax::kl_sum` for this type.
    fn kl_sum(p: &[Self], ep: Option<&[f64]>, q: &[f64]) -> f64;
    /// `compressme_quant::softmax::argmax` for this type.
    fn argmax(v: &[Self]) -> usize;
}

impl LogProb for f32 {
    fn kl_sum(p: &[Self], ep: Option<&[f64]>, q: &[f64]) -> f64 {
        compressme_quant::softmax::kl_sum(p, ep, q)
    }
    fn argmax(v: &[Self]) -> usize {
        compressme_quant::softmax::argmax(v)
    }
}

impl LogProb for f64 {
    fn kl_sum(p: &[Self], ep: Option<&[f64]>, q: &[f64]) -> f64 {
        compressme_quant::softmax::kl_sum_f64(p, ep, q)
    }
    fn argmax(v: &[Self]) -> usize {
        compressme_quant::softmax::argmax_f64(v)
    }
}

impl ShiftAcc {
    /// Adds a target's part.
    fn push(&mut self, s: TargetShift) {
        self.kls.push(s.kl.max(0.0));
        self.agree += usize::from(s.agree);
        self.dp_sum += s.dp;
        self.dps.push(s.dp.abs());
    }

    fn finish(self) -> Shift {
        let n = self.kls.len();
        Shift {
            targets: n,
            kl_mean: self.kls.iter().sum::<f64>() / n.max(1) as f64,
            kl_p99: percentile(self.kls, 0.99),
            top1_agreement: self.agree as f64 / n.max(1) as f64,
            dp_correct_mean: self.dp_sum / n.max(1) as f64,
            dp_correct_abs_p99: percentile(self.dps, 0.99),
        }
    }
}

/// The median of `v`: for an even count the upper of the two middle values (so it is one
/// of the samples); NaN for none. The workspace's one median.
#[must_use]
pub fn median(v: Vec<f64>) -> f64 {
    percentile(v, 0.5)
}

fn percentile(mut v: Vec<f64>, q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let i = ((v.len() - 1) as f64 * q).round() as usize;
    v.get(i).copied().unwrap_or(f64::NAN)
}

/// How far a variant's next-token distributions moved from the reference's.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Shift {
    /// Targets compared.
    pub targets: usize,
    /// Mean KL(reference || variant), nats.
    pub kl_mean: f64,
    /// Its 99th percentile.
    pub kl_p99: f64,
    /// Share of targets where both put their highest probability on the same token.
    pub top1_agreement: f64,
    /// Mean of p_variant(correct) - p_reference(correct).
    pub dp_correct_mean: f64,
    /// 99th percentile of |p_variant(correct) - p_reference(correct)|.
    pub dp_correct_abs_p99: f64,
}

/// KL divergence, top-1 agreement and the correct token's probability change of
/// `variant` against `reference`, both scored with `keep_distributions` on the same
/// documents and windows (the reference should be the f32 model, not a compressed one).
///
/// # Errors
/// [`Error::Invalid`] when the two were not scored on the same targets.
pub fn shift(reference: &Scored, variant: &Scored) -> Result<Shift> {
    let same = reference.tokens.len() == variant.tokens.len()
        && reference.distributions.len() == reference.tokens.len()
        && variant.distributions.len() == variant.tokens.len()
        && reference
            .tokens
            .iter()
            .zip(&variant.tokens)
            .all(|(a, b)| (a.doc, a.position, a.target) == (b.doc, b.position, b.target));
    if !same {
        return Err(Error::Invalid(
            "reference and variant were not scored on the same targets with distributions kept"
                .into(),
        ));
    }
    let mut acc = ShiftAcc::default();
    for ((p, q), t) in reference
        .distributions
        .iter()
        .zip(&variant.distributions)
        .zip(&reference.tokens)
    {
        let q: Vec<f64> = q.iter().map(|&v| f64::from(v)).collect();
        acc.push(TargetShift::new(p, None, None, &q, t.target as usize));
    }
    Ok(acc.finish())
}

/// Two variants on the same targets: is `b` better than `a`?
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Paired {
    /// Targets.
    pub targets: usize,
    /// Mean of NLL(b) - NLL(a): negative means `b` is better.
    pub mean_diff: f64,
    /// 2.5th percentile of the bootstrap distribution of the mean difference.
    pub ci_low: f64,
    /// 97.5th percentile.
    pub ci_high: f64,
    /// Bootstrap resamples.
    pub resamples: usize,
    /// The resampling seed.
    pub seed: u64,
    /// Targets where `b` had the lower NLL.
    pub b_better: usize,
    /// Targets where `a` had the lower NLL.
    pub a_better: usize,
    /// Two-sided sign-test p-value (ties dropped; exact binomial).
    pub sign_test_p: f64,
}

/// Paired comparison of per-target NLLs `a` and `b` (same targets, same order): mean
/// difference with a percentile bootstrap interval (`resamples` resamples of targets,
/// fixed `seed`) and a sign test.
///
/// # Errors
/// [`Error::Invalid`] for lengths that differ or no targets.
pub fn paired(a: &[f64], b: &[f64], resamples: usize, seed: u64) -> Result<Paired> {
    if a.len() != b.len() || a.is_empty() {
        return Err(Error::Invalid(format!(
            "paired comparison of {} and {} targets",
            a.len(),
            b.len()
        )));
    }
    let d: Vec<f64> = b.iter().zip(a).map(|(x, y)| x - y).collect();
    let n = d.len();
    let mean = d.iter().sum::<f64>() / n as f64;
    let mut rng = Rng::new(seed);
    let mut means = Vec::with_capacity(resamples);
    for _ in 0..resamples.max(1) {
        let s: f64 = (0..n)
            .map(|_| {
                d.get((rng.next_u64() % n as u64) as usize)
                    .copied()
                    .unwrap_or(0.0)
            })
            .sum();
        means.push(s / n as f64);
    }
    let b_better = d.iter().filter(|&&x| x < 0.0).count();
    let a_better = d.iter().filter(|&&x| x > 0.0).count();
    Ok(Paired {
        targets: n,
        mean_diff: mean,
        ci_low: percentile(means.clone(), 0.025),
        ci_high: percentile(means, 0.975),
        resamples: resamples.max(1),
        seed,
        b_better,
        a_better,
        sign_test_p: sign_test(b_better, a_better),
    })
}

/// Two-sided exact binomial test of `k` successes against `m` failures at p = 1/2.
#[must_use]
pub fn sign_test(k: usize, m: usize) -> f64 {
    let n = k + m;
    if n == 0 {
        return 1.0;
    }
    let lo = k.min(m);
    // P(X <= lo) for X ~ Binomial(n, 1/2), in log space
    let ln_choose = |n: usize, r: usize| -> f64 {
        (1..=r)
            .map(|i| ((n - r + i) as f64).ln() - (i as f64).ln())
            .sum()
    };
    let ln_half_n = n as f64 * 0.5f64.ln();
    let tail: f64 = (0..=lo).map(|r| (ln_choose(n, r) + ln_half_n).exp()).sum();
    (2.0 * tail).min(1.0)
}

/// Wall-clock samples of a repeated call, kept raw beside their summary.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Timing {
    /// Warm-up calls run first and not recorded.
    pub warmup: usize,
    /// Seconds a call, in the order they ran.
    pub samples: Vec<f64>,
    /// Units of work a call (tokens produced, for example), when the caller counts them.
    pub units: Vec<u64>,
    /// Median seconds.
    pub median: f64,
    /// Fastest sample.
    pub min: f64,
    /// Slowest sample.
    pub max: f64,
}

impl Timing {
    /// The summary of samples measured elsewhere (for example interleaved across several
    /// variants, so that drift on a shared machine hits them all alike); `units` holds
    /// one count per sample. Without samples (something not timed) every summary is 0, so
    /// that the timing is still a JSON number: read `samples`, not the summary, to know.
    #[must_use]
    pub fn from_samples(warmup: usize, samples: Vec<f64>, units: Vec<u64>) -> Self {
        if samples.is_empty() {
            return Self {
                warmup,
                samples,
                units,
                median: 0.0,
                min: 0.0,
                max: 0.0,
            };
        }
        Self {
            warmup,
            median: percentile(samples.clone(), 0.5),
            min: samples.iter().copied().fold(f64::INFINITY, f64::min),
            max: samples.iter().copied().fold(0.0, f64::max),
            samples,
            units,
        }
    }

    /// Median units a second (for example tokens a second), counting what each call
    /// actually produced.
    #[must_use]
    pub fn median_rate(&self) -> f64 {
        let rates: Vec<f64> = self
            .samples
            .iter()
            .zip(&self.units)
            .map(|(s, &u)| u as f64 / s.max(1e-12))
            .collect();
        percentile(rates, 0.5)
    }
}

/// Times `call` `reps` times after `warmup` unrecorded calls. `call` returns how many
/// units of work it did (tokens actually generated, early stops included); errors stop
/// the measurement. Any device synchronisation belongs inside `call`.
///
/// # Errors
/// The first error `call` returns.
pub fn time<E>(
    warmup: usize,
    reps: usize,
    mut call: impl FnMut() -> std::result::Result<u64, E>,
) -> std::result::Result<Timing, E> {
    for _ in 0..warmup {
        call()?;
    }
    let (mut samples, mut units) = (Vec::with_capacity(reps), Vec::with_capacity(reps));
    for _ in 0..reps.max(1) {
        let t = std::time::Instant::now();
        let u = call()?;
        samples.push(t.elapsed().as_secs_f64());
        units.push(u);
    }
    Ok(Timing::from_samples(warmup, samples, units))
}

/// The process's peak resident set so far, in bytes (`VmHWM` from `/proc/self/status`;
/// `None` where that file does not exist).
#[must_use]
pub fn peak_rss_bytes() -> Option<u64> {
    status_bytes("VmHWM:")
}

/// The process's resident set now, in bytes (`VmRSS`; `None` where that file does not
/// exist).
#[must_use]
pub fn current_rss_bytes() -> Option<u64> {
    status_bytes("VmRSS:")
}

fn status_bytes(key: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(key))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Resets the process's peak resident set to its current size (writes `5` to
/// `/proc/self/clear_refs`, Linux 4.0 and later), so that [`peak_rss_bytes`] then
/// measures one stage. Returns whether the reset happened, checked: the write succeeded
/// **and** the peak read back afterwards is within 1 MiB of the resident set read just
/// before it (a kernel that accepts the write but ignores it returns false). A caller
/// that gets false reports the stage's peak as unavailable.
#[must_use = "a peak after a failed reset covers everything before it"]
pub fn reset_peak_rss() -> bool {
    if std::fs::write("/proc/self/clear_refs", "5").is_err() {
        return false;
    }
    match (current_rss_bytes(), peak_rss_bytes()) {
        (Some(now), Some(peak)) => peak <= now.saturating_add(1 << 20),
        _ => false,
    }
}

/// How closely a variant's sentence embeddings follow the reference's.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EmbeddingAgreement {
    /// Embeddings compared.
    pub items: usize,
    /// Mean cosine similarity between each item's reference and variant embedding.
    pub cosine_mean: f64,
    /// The lowest.
    pub cosine_min: f64,
    /// Share of items whose nearest other item (by cosine) is the same under both.
    pub retrieval_top1_agreement: f64,
}

/// Cosine similarity of two vectors, summed in f64; two zero vectors are identical (1),
/// one zero vector against another vector is 0. The workspace's one cosine.
#[must_use]
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (f64::from(x), f64::from(y));
        ab += x * y;
        aa += x * x;
        bb += y * y;
    }
    if aa == 0.0 || bb == 0.0 {
        return if aa == bb { 1.0 } else { 0.0 };
    }
    ab / (aa.sqrt() * bb.sqrt())
}

fn nearest(items: &[Vec<f32>], i: usize) -> Option<usize> {
    let q = items.get(i)?;
    items
        .iter()
        .enumerate()
        .filter(|(j, _)| *j != i)
        .map(|(j, v)| (j, cosine(q, v)))
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(j, _)| j)
}

/// Cosine similarity of each item's `variant` embedding to its `reference` embedding, and
/// nearest-neighbour retrieval agreement: for each item, is its most similar other item
/// the same under both? (Needs at least two items for retrieval.)
///
/// # Errors
/// [`Error::Invalid`] for lists of different lengths, no items, or embeddings whose
/// widths differ.
pub fn embedding_agreement(
    reference: &[Vec<f32>],
    variant: &[Vec<f32>],
) -> Result<EmbeddingAgreement> {
    if reference.len() != variant.len()
        || reference.is_empty()
        || reference
            .iter()
            .zip(variant)
            .any(|(a, b)| a.len() != b.len())
    {
        return Err(Error::Invalid(format!(
            "embedding comparison of {} and {} items (or of different widths)",
            reference.len(),
            variant.len()
        )));
    }
    let cos: Vec<f64> = reference
        .iter()
        .zip(variant)
        .map(|(a, b)| cosine(a, b))
        .collect();
    let n = reference.len();
    let agree = (0..n)
        .filter(|&i| nearest(reference, i) == nearest(variant, i))
        .count();
    Ok(EmbeddingAgreement {
        items: n,
        cosine_mean: cos.iter().sum::<f64>() / n as f64,
        cosine_min: cos.iter().copied().fold(f64::INFINITY, f64::min),
        retrieval_top1_agreement: agree as f64 / n as f64,
    })
}
