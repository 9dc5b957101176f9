//! The kernels' fork-join: a product split over a few threads that wait for the next one
//! by spinning briefly before they sleep.
//!
//! A batch-1 product of a 4096 x 4096 4-bit matrix takes 0.3-0.8 ms, and a model calls
//! one after another with a little single-threaded work between them. Rayon's workers go
//! to sleep soon after they run out of work, and waking one is slow on a virtual machine;
//! candle's quantized kernels keep their workers spinning for about a millisecond instead
//! (its barrier pool). Here each worker spins for [`SPIN`] after its last piece of work,
//! then sleeps on a condition variable, so a product that follows another closely starts
//! on every thread at once. Measured on two threads (`peer_probe`, NF4-g64 4096 x 4096 at
//! batch 1 in strict alternation with candle's Q4_K, candle's spinning turned off): the
//! median ratio to candle 0.99 and 1.11 on this pool against 1.15 and 1.71 on rayon's, in
//! the same session; in runs of products back to back the two are within noise.
//!
//! The pool is not rayon's: it has `rayon::current_num_threads() - 1` workers of its own
//! (so `RAYON_NUM_THREADS` sets both), started on first use. One product runs on it at a
//! time; a second caller meanwhile (another thread's product, or a product called from
//! inside one) runs its pieces on its own thread, in order, with the same results.
//!
//! A job's pieces are taken in order from a shared counter, so a thread that falls behind
//! (this machine is shared) leaves its pieces to the others; every piece runs exactly
//! once, whichever thread takes it, so the outputs do not depend on the thread count.
//!
//! A caller that runs several models side by side, one a thread, uses [`in_lanes`]
//! instead: inside it every product runs whole on its lane's thread
//! ([`single_threaded`]), so the lanes do not queue for the pool or wait on each other.
//! Two lanes of one thread each get more out of two cores than one product split in two
//! (the work between the products is not split).
#![allow(unsafe_code)]

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock, TryLockError};
use std::time::{Duration, Instant};

/// How long an idle worker spins, looking for the next job, before it sleeps.
const SPIN: Duration = Duration::from_micros(200);

/// A job as the workers see it: `f(piece)` for each piece `0..pieces`.
type Job = &'static (dyn Fn(usize) + Sync);

struct Shared {
    /// Bumped once a job is published; a worker runs each generation once.
    generation: AtomicUsize,
    /// The job of the current generation.
    job: Mutex<Option<Job>>,
    /// The next piece to take.
    next: AtomicUsize,
    /// The current job's pieces.
    pieces: AtomicUsize,
    /// Workers still inside the current job.
    busy: AtomicUsize,
    /// Set when a piece panicked; the caller re-raises it.
    panicked: Mutex<Option<Box<dyn std::any::Any + Send>>>,
    /// Sleeping workers wait here for a new generation.
    sleep: Mutex<()>,
    wake: Condvar,
    sleepers: AtomicUsize,
}

struct Pool {
    shared: &'static Shared,
    workers: usize,
    /// One job at a time.
    call: Mutex<()>,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        let shared: &'static Shared = Box::leak(Box::new(Shared {
            generation: AtomicUsize::new(0),
            job: Mutex::new(None),
            next: AtomicUsize::new(0),
            pieces: AtomicUsize::new(0),
            busy: AtomicUsize::new(0),
            panicked: Mutex::new(None),
            sleep: Mutex::new(()),
            wake: Condvar::new(),
            sleepers: AtomicUsize::new(0),
        }));
        let wanted = rayon::current_num_threads().saturating_sub(1);
        let mut workers = 0;
        for i in 0..wanted {
            let spawned = std::thread::Builder::new()
                .name(format!("compressme-kernel-{i}"))
                .spawn(move || work(shared));
            // a worker that cannot start only makes the pool smaller
            if spawned.is_ok() {
                workers += 1;
            }
        }
        Pool {
            shared,
            workers,
            call: Mutex::new(()),
        }
    })
}

thread_local! {
    /// Set inside [`single_threaded`]: this thread's products run on it alone.
    static ALONE: Cell<bool> = const { Cell::new(false) };
}

/// The threads a job runs on: the caller and the pool's workers, or the caller alone
/// inside [`single_threaded`].
pub(super) fn threads() -> usize {
    if ALONE.with(Cell::get) {
        1
    } else {
        pool().workers + 1
    }
}

/// Runs `f` with every product it calls (on this thread) computed on this thread alone,
/// never on the kernels' pool; the outputs are the same bits, as at any thread count.
/// For a caller that keeps its other threads busy with other work.
pub fn single_threaded<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            ALONE.with(|a| a.set(self.0));
        }
    }
    let _restore = Restore(ALONE.with(|a| a.replace(true)));
    f()
}

/// Runs `f(&mut state, item)` for every item, in `lanes` lanes side by side on rayon's
/// threads: each lane makes its `state` once with `init` and takes the next item not yet
/// taken until none is left, its products [`single_threaded`]. Returns the results in
/// the items' order, or the first error in that order (a lane stops taking items once
/// any has failed). One lane, or one item: in order on the calling thread, with the
/// kernels' pool as usual. Every worker may be a lane, so work that waits for jobs it
/// gave rayon must wait in rayon's way (a join, a scope, or running the pool's jobs
/// meanwhile, as `compressme_artifact`'s pipeline does), never by blocking its thread.
///
/// # Errors
/// The first error of `init` or `f`, in the items' order (an `init` error counts as its
/// lane's first item's).
pub fn in_lanes<T: Sync, S, R: Send, E: Send>(
    items: &[T],
    lanes: usize,
    init: impl Fn() -> Result<S, E> + Sync,
    f: impl Fn(&mut S, &T) -> Result<R, E> + Sync,
) -> Result<Vec<R>, E> {
    if lanes <= 1 || items.len() <= 1 {
        let mut state = init()?;
        return items.iter().map(|t| f(&mut state, t)).collect();
    }
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let out: Vec<Mutex<Option<Result<R, E>>>> = items.iter().map(|_| Mutex::new(None)).collect();
    let put = |i: usize, r: Result<R, E>| {
        if r.is_err() {
            failed.store(true, Ordering::Release);
        }
        if let Some(slot) = out.get(i) {
            *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
        }
    };
    rayon::scope(|s| {
        for _ in 0..lanes.min(items.len()) {
            s.spawn(|_| {
                single_threaded(|| {
                    let mut state = None;
                    while !failed.load(Ordering::Acquire) {
                        let i = next.fetch_add(1, Ordering::AcqRel);
                        let Some(item) = items.get(i) else {
                            return;
                        };
                        let st = match state.take() {
                            Some(st) => st,
                            None => match init() {
                                Ok(st) => st,
                                Err(e) => return put(i, Err(e)),
                            },
                        };
                        let st = state.insert(st);
                        put(i, f(st, item));
                    }
                });
            });
        }
    });
    let mut results = Vec::with_capacity(items.len());
    for slot in out {
        match slot.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(Ok(r)) => results.push(r),
            Some(Err(e)) => return Err(e),
            // not taken: an earlier item failed, and is returned above
            None => {}
        }
    }
    Ok(results)
}

/// Takes pieces of the current job until none is left.
fn take_pieces(shared: &Shared, job: Job) {
    let pieces = shared.pieces.load(Ordering::Acquire);
    loop {
        let i = shared.next.fetch_add(1, Ordering::AcqRel);
        if i >= pieces {
            return;
        }
        if let Err(e) = catch_unwind(AssertUnwindSafe(|| job(i))) {
            let mut slot = shared.panicked.lock().unwrap_or_else(|p| p.into_inner());
            slot.get_or_insert(e);
        }
    }
}

fn work(shared: &'static Shared) {
    let mut seen = 0;
    loop {
        // spin for the next generation, then sleep for it
        let start = Instant::now();
        let mut spins = 0u32;
        let mut generation = shared.generation.load(Ordering::Acquire);
        while generation == seen {
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) && start.elapsed() > SPIN {
                let mut guard = shared.sleep.lock().unwrap_or_else(|p| p.into_inner());
                shared.sleepers.fetch_add(1, Ordering::AcqRel);
                while shared.generation.load(Ordering::Acquire) == seen {
                    guard = shared.wake.wait(guard).unwrap_or_else(|p| p.into_inner());
                }
                shared.sleepers.fetch_sub(1, Ordering::AcqRel);
                drop(guard);
            }
            generation = shared.generation.load(Ordering::Acquire);
        }
        seen = generation;
        let job = *shared.job.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(job) = job {
            take_pieces(shared, job);
        }
        shared.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Clears the published job and waits for every worker to leave it, even if the caller's
/// own pieces panicked: the job borrows the caller's stack.
struct Finish<'a> {
    shared: &'a Shared,
}

impl Drop for Finish<'_> {
    fn drop(&mut self) {
        let mut spins = 0u32;
        while self.shared.busy.load(Ordering::Acquire) != 0 {
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) {
                std::thread::yield_now();
            }
        }
        *self.shared.job.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

/// Runs `f(i)` once for every `i` in `0..pieces`, on the pool's threads and this one,
/// and returns when all have run; a panic in any piece is raised here after every
/// thread has left the job.
pub(super) fn run(pieces: usize, f: &(dyn Fn(usize) + Sync)) {
    if ALONE.with(Cell::get) {
        for i in 0..pieces {
            f(i);
        }
        return;
    }
    let pool = pool();
    let guard = match pool.call.try_lock() {
        Ok(g) => Some(g),
        Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    };
    let (Some(_guard), true) = (guard, pool.workers > 0 && pieces > 1) else {
        // busy, or nothing to share: in order on this thread
        for i in 0..pieces {
            f(i);
        }
        return;
    };
    let shared = pool.shared;
    // SAFETY: the job is only reached through `shared.job` and `take_pieces`; `Finish`
    // (dropped before this function returns or unwinds) waits until no worker is inside
    // the job and then clears it, so no reference to `f` outlives this call.
    let job: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(f) };
    shared.next.store(0, Ordering::Release);
    shared.pieces.store(pieces, Ordering::Release);
    *shared.job.lock().unwrap_or_else(|p| p.into_inner()) = Some(job);
    shared.busy.store(pool.workers, Ordering::Release);
    let finish = Finish { shared };
    {
        // publish under the sleep lock, so a worker about to sleep sees it or is woken
        let _sleep = shared.sleep.lock().unwrap_or_else(|p| p.into_inner());
        shared.generation.fetch_add(1, Ordering::AcqRel);
        if shared.sleepers.load(Ordering::Acquire) > 0 {
            shared.wake.notify_all();
        }
    }
    take_pieces(shared, job);
    drop(finish);
    let panicked = shared
        .panicked
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take();
    if let Some(e) = panicked {
        resume_unwind(e);
    }
}

/// Runs `f(i, item)` once for each of `items` (the `i`th item for piece `i`): shared as
/// [`run`] shares pieces when `share`, otherwise in order on this thread. For work split
/// into owned parts, such as disjoint `&mut` slices of one output.
pub(super) fn each<T: Send>(share: bool, items: Vec<T>, f: &(dyn Fn(usize, T) + Sync)) {
    if !share {
        for (i, item) in items.into_iter().enumerate() {
            f(i, item);
        }
        return;
    }
    let items: Vec<Mutex<Option<T>>> = items.into_iter().map(|t| Mutex::new(Some(t))).collect();
    run(items.len(), &|i| {
        let taken = items
            .get(i)
            .and_then(|m| m.lock().unwrap_or_else(|p| p.into_inner()).take());
        if let Some(item) = taken {
            f(i, item);
        }
    });
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_piece_runs_once_across_many_jobs() {
        for pieces in [0usize, 1, 2, 3, 17, 256] {
            for _ in 0..200 {
                let counts: Vec<AtomicUsize> = (0..pieces).map(|_| AtomicUsize::new(0)).collect();
                super::run(pieces, &|i| {
                    counts[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1));
            }
        }
    }

    #[test]
    fn jobs_after_a_sleep_and_from_many_callers_complete() {
        let total = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for k in 0..50 {
                        if k % 10 == 0 {
                            std::thread::sleep(std::time::Duration::from_millis(1));
                        }
                        super::run(9, &|_| {
                            total.fetch_add(1, Ordering::Relaxed);
                        });
                    }
                });
            }
        });
        assert_eq!(total.load(Ordering::Relaxed), 4 * 50 * 9);
    }

    #[test]
    fn a_panicking_piece_is_raised_to_the_caller_and_the_pool_goes_on() {
        let r = std::panic::catch_unwind(|| {
            super::run(8, &|i| {
                assert!(i != 5, "piece five");
            });
        });
        assert!(r.is_err());
        let n = AtomicUsize::new(0);
        super::run(8, &|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 8);
    }

    #[test]
    fn single_threaded_runs_every_piece_on_the_caller_and_restores() {
        let me = std::thread::current().id();
        let nested = super::single_threaded(|| {
            assert_eq!(super::threads(), 1);
            let on = std::sync::Mutex::new(Vec::new());
            super::run(16, &|_| {
                on.lock().unwrap().push(std::thread::current().id())
            });
            let on = on.into_inner().unwrap();
            assert_eq!(on.len(), 16);
            assert!(on.iter().all(|&t| t == me));
            // nested: still alone, and alone again after the inner scope
            super::single_threaded(super::threads) + super::threads()
        });
        assert_eq!(nested, 2);
        assert_eq!(super::threads(), super::pool().workers + 1);
    }

    #[test]
    fn lanes_give_the_items_results_in_order_and_the_first_error() {
        let items: Vec<usize> = (0..40).collect();
        for lanes in [1, 2, 3] {
            let inits = AtomicUsize::new(0);
            let got = super::in_lanes(
                &items,
                lanes,
                || {
                    inits.fetch_add(1, Ordering::Relaxed);
                    Ok::<_, String>(0usize)
                },
                |seen, &i| {
                    *seen += 1;
                    assert_eq!(
                        super::threads(),
                        if lanes > 1 {
                            1
                        } else {
                            super::pool().workers + 1
                        }
                    );
                    std::thread::sleep(std::time::Duration::from_micros((i as u64 * 37) % 300));
                    Ok(i * i)
                },
            );
            assert_eq!(got, Ok(items.iter().map(|i| i * i).collect::<Vec<_>>()));
            // one state a lane, made when the lane takes its first item
            assert!(
                (1..=lanes).contains(&inits.load(Ordering::Relaxed)),
                "{lanes}"
            );
            let failed = super::in_lanes(
                &items,
                lanes,
                || Ok(()),
                |(), &i| {
                    if i == 7 || i == 30 {
                        Err(format!("item {i}"))
                    } else {
                        Ok(i)
                    }
                },
            );
            assert_eq!(failed, Err("item 7".to_string()), "{lanes}");
            let refused = super::in_lanes(
                &items,
                lanes,
                || Err::<(), _>("no state".to_string()),
                |(), &i| Ok(i),
            );
            assert_eq!(refused, Err("no state".to_string()), "{lanes}");
        }
    }
}
