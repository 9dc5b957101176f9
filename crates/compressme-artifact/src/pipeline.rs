//! Tensors in parallel, results in order, memory bounded: the pipeline under `pack`,
//! `verify` and `unpack`. Work items are admitted in order while the bytes they weigh
//! fit a budget (one item is always admitted, however heavy), run on rayon's pool (each
//! may itself run in parallel), and their results are handed to a sink in the items'
//! order on the calling thread, so a writer's output does not depend on the thread
//! count and writing overlaps the work of later items. The calling thread may be one of
//! rayon's workers (a caller running several writers side by side): while it waits for
//! a result it runs the pool's other jobs, its own items among them.
#![deny(clippy::arithmetic_side_effects)]

use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use crate::Result;

/// Runs `work` on every item on rayon's pool, at most `budget` bytes of items (by
/// `weight`) in flight, an item's weight held from admission until `sink` has taken its
/// result; `sink` gets the results in the items' order, on the calling thread. The first
/// error (from `work` or `sink`) stops admission and is returned once the items already
/// running have finished; a panic in `work` is resumed on the calling thread.
///
/// A calling thread that is one of rayon's workers runs the pool's jobs while it waits,
/// so the items it spawned run even when every worker is a caller.
///
/// # Errors
/// The first error `work` or `sink` returned.
pub fn ordered<I, T>(
    items: impl IntoIterator<Item = I>,
    weight: impl Fn(&I) -> u64,
    budget: u64,
    work: impl Fn(I) -> Result<T> + Sync,
    sink: impl FnMut(T) -> Result<()>,
) -> Result<()>
where
    I: Send,
    T: Send,
{
    run(items, weight, budget, Hold::UntilSunk, work, sink)
}

/// [`ordered`] for results that hold no memory of their own (a check's `()`, a count):
/// an item's weight is released as soon as its `work` returns, not when `sink` takes
/// its result. A slow item early in the order (one large tensor) then no longer holds
/// up the admission of the items after it while it runs: `verify` and `unpack`, whose
/// work streams a tensor and returns nothing it holds, keep both cores busy past it.
///
/// # Errors
/// As [`ordered`].
pub fn ordered_light<I, T>(
    items: impl IntoIterator<Item = I>,
    weight: impl Fn(&I) -> u64,
    budget: u64,
    work: impl Fn(I) -> Result<T> + Sync,
    sink: impl FnMut(T) -> Result<()>,
) -> Result<()>
where
    I: Send,
    T: Send,
{
    run(items, weight, budget, Hold::UntilDone, work, sink)
}

/// Until when an item's weight counts against the budget.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Hold {
    /// Until `sink` has taken its result (the result holds the item's memory).
    UntilSunk,
    /// Until `work` returns.
    UntilDone,
}

fn run<I, T>(
    items: impl IntoIterator<Item = I>,
    weight: impl Fn(&I) -> u64,
    budget: u64,
    hold: Hold,
    work: impl Fn(I) -> Result<T> + Sync,
    mut sink: impl FnMut(T) -> Result<()>,
) -> Result<()>
where
    I: Send,
    T: Send,
{
    type Done<T> = std::thread::Result<Result<T>>;
    let stop = AtomicBool::new(false);
    let work = &work;
    let stop_ref = &stop;
    rayon::in_place_scope(|scope| {
        let (tx, rx) = mpsc::channel::<(usize, u64, Done<T>)>();
        let mut items = items.into_iter().enumerate().peekable();
        let mut pending: BTreeMap<usize, (u64, Done<T>)> = BTreeMap::new();
        let (mut admitted, mut next, mut in_flight) = (0usize, 0usize, 0u64);
        let mut first_err = None;
        loop {
            while first_err.is_none() {
                let Some((_, item)) = items.peek() else { break };
                let w = weight(item);
                if in_flight > 0 && in_flight.saturating_add(w) > budget {
                    break;
                }
                let Some((i, item)) = items.next() else { break };
                in_flight = in_flight.saturating_add(w);
                admitted = admitted.saturating_add(1);
                let tx = tx.clone();
                scope.spawn(move |_| {
                    let r = if stop_ref.load(Ordering::Relaxed) {
                        Ok(Err(crate::Error::Cancelled))
                    } else {
                        catch_unwind(AssertUnwindSafe(|| work(item)))
                    };
                    // the receiver outlives every job (the scope waits for them)
                    let _ = tx.send((i, w, r));
                });
            }
            if next == admitted {
                break; // everything admitted has been sunk, and nothing more will be
            }
            let Some((i, w, r)) = receive(&rx) else { break };
            if hold == Hold::UntilDone {
                in_flight = in_flight.saturating_sub(w);
            }
            pending.insert(i, (w, r));
            while let Some((w, r)) = pending.remove(&next) {
                next = next.saturating_add(1);
                if hold == Hold::UntilSunk {
                    in_flight = in_flight.saturating_sub(w);
                }
                let r = match r {
                    Ok(r) => r,
                    Err(panic) => {
                        stop.store(true, Ordering::Relaxed);
                        resume_unwind(panic);
                    }
                };
                if first_err.is_some() {
                    continue; // draining what was already running
                }
                if let Err(e) = r.and_then(&mut sink) {
                    stop.store(true, Ordering::Relaxed);
                    first_err = Some(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    })
}

/// The next message of `rx`, or `None` once every sender is gone. On one of rayon's
/// workers it runs the pool's pending jobs (the items this caller spawned among them)
/// while none has come, so callers running side by side on every worker still finish;
/// elsewhere it blocks.
fn receive<T>(rx: &mpsc::Receiver<T>) -> Option<T> {
    if rayon::current_thread_index().is_none() {
        return rx.recv().ok();
    }
    loop {
        match rx.try_recv() {
            Ok(m) => return Some(m),
            Err(mpsc::TryRecvError::Disconnected) => return None,
            Err(mpsc::TryRecvError::Empty) => {}
        }
        if rayon::yield_now() != Some(rayon::Yield::Executed) {
            // nothing to run: the items are running elsewhere; wait for one a little
            match rx.recv_timeout(Duration::from_micros(200)) {
                Ok(m) => return Some(m),
                Err(mpsc::RecvTimeoutError::Disconnected) => return None,
                Err(mpsc::RecvTimeoutError::Timeout) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::arithmetic_side_effects, clippy::unwrap_used)]
    use super::{ordered, ordered_light};
    use crate::Error;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};

    /// Three items of weight 5 under a budget of 10: the first waits (at most `patience`)
    /// for the third to start; whether it saw it start.
    fn third_starts_while_the_first_runs(light: bool, patience: Duration) -> bool {
        let started = AtomicBool::new(false);
        let seen = AtomicBool::new(false);
        let work = |i: u64| {
            if i == 0 {
                let t0 = Instant::now();
                while !started.load(Ordering::SeqCst) && t0.elapsed() < patience {
                    std::thread::sleep(Duration::from_millis(1));
                }
                seen.store(started.load(Ordering::SeqCst), Ordering::SeqCst);
            } else if i == 2 {
                started.store(true, Ordering::SeqCst);
            }
            Ok(i)
        };
        let mut got = Vec::new();
        // a pool of its own: the caller's thread waits on results, the first item holds
        // another, and the rest need one more
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(4)
            .build()
            .unwrap();
        let sink = |r| {
            got.push(r);
            Ok(())
        };
        pool.install(|| {
            if light {
                ordered_light(0..3u64, |_| 5, 10, work, sink)
            } else {
                ordered(0..3u64, |_| 5, 10, work, sink)
            }
        })
        .unwrap();
        assert_eq!(got, [0, 1, 2]);
        seen.load(Ordering::SeqCst)
    }

    #[test]
    fn light_results_release_their_weight_when_their_work_returns() {
        // the second item's weight goes when it returns, so the third starts while the
        // first is still running; with `ordered` it waits until the first is sunk
        assert!(third_starts_while_the_first_runs(
            true,
            Duration::from_secs(20)
        ));
        assert!(!third_starts_while_the_first_runs(
            false,
            Duration::from_millis(200)
        ));
    }

    #[test]
    fn results_come_in_order_under_the_budget() {
        let in_flight = std::sync::atomic::AtomicU64::new(0);
        let peak = std::sync::atomic::AtomicU64::new(0);
        let mut got = Vec::new();
        ordered(
            0..200u64,
            |&i| 1 + i % 7,
            10,
            |i| {
                let now = in_flight.fetch_add(1 + i % 7, std::sync::atomic::Ordering::SeqCst);
                peak.fetch_max(now + 1 + i % 7, std::sync::atomic::Ordering::SeqCst);
                std::thread::sleep(std::time::Duration::from_micros((i * 37) % 300));
                in_flight.fetch_sub(1 + i % 7, std::sync::atomic::Ordering::SeqCst);
                Ok(i * 2)
            },
            |r| {
                got.push(r);
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(got, (0..200).map(|i| i * 2).collect::<Vec<_>>());
        assert!(peak.load(std::sync::atomic::Ordering::SeqCst) <= 10);
    }

    #[test]
    fn callers_on_every_worker_of_the_pool_finish() {
        // two callers side by side on a pool of two: each waits on items only the pool
        // can run, and both of its workers are callers (a blocking wait deadlocked here)
        let (done, wait) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(2)
                .build()
                .unwrap();
            let sums = pool.install(|| {
                let one = |k: u64| {
                    let mut sum = 0;
                    ordered(
                        0..50u64,
                        |_| 1,
                        4,
                        |i| {
                            std::thread::sleep(std::time::Duration::from_micros(100));
                            Ok(i * k)
                        },
                        |r| {
                            sum += r;
                            Ok(())
                        },
                    )
                    .map(|()| sum)
                };
                rayon::join(|| one(1), || one(2))
            });
            let _ = done.send(sums);
        });
        let got = wait.recv_timeout(std::time::Duration::from_secs(60));
        assert!(got.is_ok(), "the callers did not finish in a minute");
        let (a, b) = got.unwrap();
        assert_eq!((a.unwrap(), b.unwrap()), (1225, 2450));
    }

    #[test]
    fn an_item_heavier_than_the_budget_runs_alone() {
        let mut got = Vec::new();
        ordered(
            [5u64, 100, 5],
            |&w| w,
            10,
            Ok,
            |r| {
                got.push(r);
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(got, [5, 100, 5]);
    }

    #[test]
    fn the_first_error_is_returned_and_nothing_after_it_is_sunk() {
        let mut got = Vec::new();
        let r = ordered(
            0..100u64,
            |_| 1,
            4,
            |i| {
                if i == 10 {
                    Err(Error::MissingTensor(format!("t{i}")))
                } else {
                    Ok(i)
                }
            },
            |r| {
                got.push(r);
                Ok(())
            },
        );
        assert!(matches!(r, Err(Error::MissingTensor(ref n)) if n == "t10"));
        assert_eq!(got, (0..10).collect::<Vec<_>>());
        // a sink's error stops it too
        let mut n = 0;
        let r = ordered(
            0..100u64,
            |_| 1,
            4,
            Ok,
            |i| {
                n += 1;
                if i == 3 {
                    Err(Error::Cancelled)
                } else {
                    Ok(())
                }
            },
        );
        assert!(matches!(r, Err(Error::Cancelled)));
        assert_eq!(n, 4);
    }

    #[test]
    fn a_panic_in_work_reaches_the_caller() {
        let r = std::panic::catch_unwind(|| {
            ordered(
                0..10u64,
                |_| 1,
                2,
                |i| if i == 5 { panic!("boom") } else { Ok(i) },
                |_| Ok(()),
            )
        });
        assert!(r.is_err());
    }
}
