//! Calibration batches in lanes, side by side, with the observers' sums made in the
//! batches' order: the same bits as one batch after another.
//!
//! Each lane runs whole batches on one thread ([`compressme_quant::in_lanes`]). What the
//! model reports goes to [`Keep`], which files each observation (the module's name and a
//! handle on its tensor, which nothing changes afterwards) under the batch its thread is
//! running, and does there and then the work whose result does not depend on the order
//! (each distinct input's Gram product). A finished batch's observations wait in
//! [`Waiting`] until every earlier batch's have been given to the real observer, which
//! then gets them one by one as a run of one batch after another would have given them,
//! on whichever lane finished a batch (the other goes on meanwhile). A lane that finds
//! more batches waiting than there are lanes waits for its turn to hand them over before
//! it runs another; batches waiting for a slow earlier one are not bounded otherwise.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use candle_core::Tensor;
use compressme_nn::{Model, Observer};

use crate::{Error, Result, Watch, gram};

/// One batch's observations, in the order the model made them.
type Seen = Vec<(String, Tensor)>;

thread_local! {
    /// The observations of the batch this thread is running, while it runs one in a lane.
    static OPEN: RefCell<Option<Seen>> = const { RefCell::new(None) };
}

/// The observer on the model's hooks while batches run in lanes.
pub(crate) struct Keep {
    /// Order-free work done as each observation arrives: the Gram products.
    pub(crate) early: Option<Arc<gram::Collector>>,
}

impl Observer for Keep {
    fn observe(&self, module: &str, activations: &Tensor) -> compressme_nn::Result<()> {
        OPEN.with(|open| match open.borrow_mut().as_mut() {
            Some(seen) => {
                seen.push((module.to_string(), activations.clone()));
                Ok(())
            }
            None => Err(compressme_nn::Error::Observer(format!(
                "`{module}` reported outside the calibration batches (on another thread \
                 than the batch's)"
            ))),
        })?;
        if let Some(g) = &self.early {
            g.prepare(module, activations);
        }
        Ok(())
    }
}

/// Finished batches waiting for the earlier ones, and the next batch to hand over.
#[derive(Default)]
struct Waiting {
    next: usize,
    ready: BTreeMap<usize, Seen>,
    /// The first failure in the batches' order: a model's error where the batch ran, an
    /// observer's where its observations were handed over.
    failed: Option<(usize, Error)>,
}

impl Waiting {
    /// Whether batch `i` comes before the first failure (if any).
    fn before_failure(&self, i: usize) -> bool {
        self.failed.as_ref().is_none_or(|(b, _)| i < *b)
    }
}

/// Runs `forward` over `batches` in `lanes` lanes (more than one) with `observer` getting
/// every observation in the order of one batch after another; `early`'s Gram products are
/// made in the lanes.
pub(crate) fn run<M: Model + Sync, B: Sync>(
    watch: &Watch,
    model: &M,
    batches: &[B],
    lanes: usize,
    forward: &(impl Fn(&M, &B) -> compressme_nn::Result<()> + Sync),
    observer: &dyn Observer,
    early: Option<Arc<gram::Collector>>,
) -> Result<()> {
    let keep: Arc<dyn Observer> = Arc::new(Keep {
        early: early.clone(),
    });
    let _guard = model
        .hooks()
        .install(keep)
        .map_err(|source| Error::Model { batch: 0, source })?;
    let waiting = Mutex::new(Waiting::default());
    // held by the lane handing batches over; the other runs its batch meanwhile
    let handing = Mutex::new(());
    let lock = || waiting.lock().unwrap_or_else(PoisonError::into_inner);
    let fail = |batch: usize, e: Error| {
        let mut w = lock();
        if w.before_failure(batch) {
            w.failed = Some((batch, e));
        }
    };
    // hands over every batch that is next in order, while another lane is not doing it;
    // `wait`: wait for that lane instead of leaving it the work
    let hand_over = |wait: bool| {
        loop {
            let turn = if wait {
                handing.lock().unwrap_or_else(PoisonError::into_inner)
            } else {
                match handing.try_lock() {
                    Ok(t) => t,
                    Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                    Err(std::sync::TryLockError::WouldBlock) => return,
                }
            };
            loop {
                let (i, seen) = {
                    let mut w = lock();
                    let i = w.next;
                    if !w.before_failure(i) {
                        break;
                    }
                    match w.ready.remove(&i) {
                        Some(seen) => (i, seen),
                        None => break,
                    }
                };
                if let Err(e) = give(watch, i, &seen, observer) {
                    return fail(i, e);
                }
                if let Some(g) = &early {
                    g.forget(&seen);
                }
                lock().next = i.saturating_add(1);
            }
            drop(turn);
            // a batch that became next while this lane still held the turn
            let w = lock();
            if !(w.before_failure(w.next) && w.ready.contains_key(&w.next)) {
                return;
            }
        }
    };
    let indices: Vec<usize> = (0..batches.len()).collect();
    let lane = |(): &mut (), &i: &usize| -> std::result::Result<(), ()> {
        let Some(batch) = batches.get(i) else {
            return Ok(());
        };
        OPEN.with(|open| *open.borrow_mut() = Some(Vec::new()));
        let r = forward(model, batch);
        let seen = OPEN
            .with(|open| open.borrow_mut().take())
            .unwrap_or_default();
        if let Err(source) = r {
            fail(i, Error::Model { batch: i, source });
            return Err(());
        }
        let behind = {
            let mut w = lock();
            w.ready.insert(i, seen);
            w.ready.len() > lanes
        };
        // more batches waiting than lanes: this lane hands them over before it runs more
        hand_over(behind);
        if lock().failed.is_some() {
            return Err(());
        }
        Ok(())
    };
    // a failure stops the lanes; the batches before it are handed over all the same, as
    // one batch after another would have handed them over before it failed
    let _ = compressme_quant::in_lanes(&indices, lanes, || Ok(()), lane);
    hand_over(true);
    lock().failed.take().map_or(Ok(()), |(_, e)| Err(e))
}

/// Batch `i`'s observations to `observer`, in order, as a run of one batch after another
/// would have given them while it ran batch `i`.
fn give(watch: &Watch, i: usize, seen: &Seen, observer: &dyn Observer) -> Result<()> {
    watch.set_batch(i);
    for (module, x) in seen {
        if let Err(source) = observer.observe(module, x) {
            return Err(watch
                .take_failure()
                .unwrap_or(Error::Model { batch: i, source }));
        }
    }
    Ok(())
}
