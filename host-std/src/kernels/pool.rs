//! [`WorkerPool`]: the kernels' worker threads, started once and parked between calls;
//! [`Executor`]: what a kernel call needs of threads, so a host can lend its own.
//!
//! A call hands the pool a job borrowed for the call's duration, wakes as many parked
//! workers as it has tasks for, works on the job itself, and returns only when no worker
//! is still running it. Nothing is spawned, allocated or boxed per call: the cost of a
//! parallel call is one mutex round trip and a futex wake per helper.
//!
//! Why not rayon: kvpage is embedded in programs (games, services) that own their
//! threads, and a library-global pool that spins up on first use is hidden global
//! state the design rules out. A `WorkerPool` is an ordinary value: its owner (a
//! [`KvCache`](crate::KvCache), or the caller of the free kernel functions) decides when
//! its threads start and, by dropping it, when they end.
//!
//! Invariant that makes the one `unsafe` block sound: the job's lifetime is erased only
//! to publish it in the shared state, and [`WorkerPool::run`] does not return — not even
//! by unwinding — until it has closed the call to new workers and seen every worker that
//! joined it finish. A worker copies the job out of the shared state only while it
//! holds the state's lock and the call is open, and counts itself as running before it
//! lets go of the lock. The tests below pass under Miri
//! (`cargo +nightly miri test -p kvpage --lib pool`), which checks this at run time.

use core::sync::atomic::{AtomicUsize, Ordering};
use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

/// Most threads a pool runs (the calling thread included): more than any CPU kernel
/// call can use, and a bound on what a configuration of `usize::MAX` threads starts.
pub const MAX_THREADS: usize = 256;

/// A job as the workers see it: each participant calls it once; it draws tasks until
/// none are left.
type Job<'a> = dyn Fn() + Sync + 'a;

/// Threads that share a kernel call's tasks with the calling thread.
///
/// [`WorkerPool`] is kvpage's own. A host that already runs a job system (a game
/// engine, a service's pool) implements this to lend its threads to the kernel
/// functions instead ([`AttentionParams::pool`](super::AttentionParams)); a
/// [`KvCache`](crate::KvCache) runs its `decode` / `prefill` on its own `WorkerPool`
/// (none started with `threads: 1`), and hands out what the kernel functions need
/// (`layout`, `arena`, `block_manager().block_table()`).
///
/// `job` draws the call's tasks from a shared counter until none are left, so it may be
/// called any number of times, from any threads, concurrently: each task still runs
/// exactly once. Whatever `execute` leaves undone (even everything, if it never calls
/// `job`) the calling thread runs after it returns.
pub trait Executor: Sync {
    /// Calls `job` on up to `helpers` threads besides the calling thread (which may call
    /// it too), and returns only when every call of `job` has returned. The borrow of
    /// `job` ends when `execute` returns: an implementation that hands it to threads
    /// outside a scope must itself keep that promise. A panic of `job` is the
    /// implementation's to handle (re-raise it, as [`WorkerPool`] does, or abort).
    fn execute(&self, helpers: usize, job: &(dyn Fn() + Sync));

    /// Threads that may run a call's tasks, the calling thread included: the kernels
    /// size their tasks by it (fewer, larger tasks read memory in longer runs; enough
    /// of them keep every thread busy). The default, `usize::MAX`, says "unknown": the
    /// kernels then cut their work as finely as they can. O(1).
    fn threads(&self) -> usize {
        usize::MAX
    }
}

/// What the calling thread and the workers share, behind [`Shared::state`].
struct State {
    /// The job of the call in progress, its lifetime erased (see the module docs).
    /// `Some` from the start of a parallel call until every worker has left it, so it
    /// also marks the pool busy.
    job: Option<&'static Job<'static>>,
    /// Number of the current call; a worker joins one call at most once.
    call: u64,
    /// Workers the current call still takes; 0 once the call is closed.
    seats: usize,
    /// Workers running the current job now.
    running: usize,
    /// The first panic of a worker in the current call, re-raised by the caller.
    panic: Option<Box<dyn Any + Send>>,
    /// Set by `Drop`: workers return.
    shutdown: bool,
}

/// The state and the two conditions waited on.
struct Shared {
    state: Mutex<State>,
    /// Signalled for each seat of a new call, and on shutdown.
    wake: Condvar,
    /// Signalled when the last running worker leaves a job.
    idle: Condvar,
}

impl Shared {
    /// Locks the state. No code panics while holding the lock, so it is never poisoned;
    /// if it were, the state is still consistent (every update is a few plain stores),
    /// so the guard is taken anyway rather than panicking.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Worker threads started once and parked between calls; the calling thread of each
/// call works too.
///
/// Jobs run one at a time: a call that finds the pool busy (another thread's call, or a
/// task that itself calls the pool) runs its job on its own thread only, so a call
/// never waits for another and never deadlocks. `Send + Sync`; dropping the pool stops
/// and joins its threads.
pub struct WorkerPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

// A call that unwinds (a task panicked) has already waited for every worker and cleared
// the job, so a pool seen after a caught panic is in its ordinary idle state. (The auto
// traits are lost only to the `JoinHandle`s, which a call never touches.)
impl std::panic::UnwindSafe for WorkerPool {}
impl std::panic::RefUnwindSafe for WorkerPool {}

impl core::fmt::Debug for WorkerPool {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("WorkerPool")
            .field("threads", &self.threads())
            .finish()
    }
}

impl WorkerPool {
    /// A pool of `threads` threads, the calling thread of each call included: starts
    /// `threads - 1` workers named `kvpage-worker-1`, `kvpage-worker-2`, ...; `0` means
    /// one per available core, and at most [`MAX_THREADS`] are used. A thread the OS
    /// refuses to start (its thread limit, memory for a stack) is not an error: the
    /// pool has the workers that did start ([`WorkerPool::threads`] says how many).
    /// `WorkerPool::new(1)` starts nothing and runs every call on its calling thread.
    /// O(threads) thread starts.
    pub fn new(threads: usize) -> Self {
        Self::with_stack(threads, None)
    }

    /// [`WorkerPool::new`] with workers of `stack` bytes of stack (the platform's
    /// default when `None`; tests use an impossible size to make every start fail).
    fn with_stack(threads: usize, stack: Option<usize>) -> Self {
        let threads = match threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        }
        .min(MAX_THREADS);
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                job: None,
                call: 0,
                seats: 0,
                running: 0,
                panic: None,
                shutdown: false,
            }),
            wake: Condvar::new(),
            idle: Condvar::new(),
        });
        let mut workers = Vec::with_capacity(threads - 1);
        for i in 1..threads {
            let mut builder = std::thread::Builder::new().name(format!("kvpage-worker-{i}"));
            if let Some(bytes) = stack {
                builder = builder.stack_size(bytes);
            }
            let shared = Arc::clone(&shared);
            match builder.spawn(move || worker(&shared)) {
                Ok(handle) => workers.push(handle),
                // Refused: the pool runs with the workers that started.
                Err(_) => break,
            }
        }
        Self { shared, workers }
    }

    /// Threads a call can use: the started workers plus the calling thread. O(1).
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `work(state, task)` exactly once for every `task < tasks`, on the calling
    /// thread and up to `tasks - 1` workers, and returns when all have finished. Each
    /// participating thread builds its own state with `init` once and receives its
    /// tasks in increasing order (drawn from one atomic counter, so a thread that draws
    /// a cheap task simply draws the next one). O(tasks) calls of `work`, plus one
    /// wake per worker used.
    ///
    /// # Panics
    /// If `init` or `work` panics, on whichever thread: the call still waits for every
    /// worker to finish, then re-raises the panic on the calling thread (the tasks not
    /// yet drawn when it happened may not have run). The workers survive it, and the
    /// pool serves the next call normally.
    pub fn for_each_task<W, I, F>(&self, tasks: usize, init: I, work: F)
    where
        I: Fn() -> W + Sync,
        F: Fn(&mut W, usize) + Sync,
    {
        for_each_task(Some(self as &dyn Executor), tasks, init, work);
    }

    /// Runs `job` on the calling thread and on up to `helpers` workers, returning after
    /// every one of them has returned from it; re-raises the first panic of any. On
    /// the calling thread alone if the pool is busy or `helpers` is 0.
    fn run(&self, helpers: usize, job: &Job<'_>) {
        let helpers = helpers.min(self.workers.len());
        let mut state = self.shared.lock();
        if helpers == 0 || state.job.is_some() {
            drop(state);
            return job();
        }
        // SAFETY: only the lifetime changes (same fat pointer). The erased reference is
        // stored in `state.job`, which workers read only under the lock while the call
        // is open (`seats > 0`), counting themselves in `running` before unlocking.
        // Below, this function closes the call (`seats = 0`) and waits for
        // `running == 0` before it clears `job` and returns; nothing in between can
        // unwind (the calling thread's share of the job runs under `catch_unwind`, and
        // locking and waiting never panic: poisoning is ignored and there is one mutex).
        // So every use of the erased reference ends while `job` is still borrowed.
        let erased: &'static Job<'static> =
            unsafe { core::mem::transmute::<&Job<'_>, &'static Job<'static>>(job) };
        state.job = Some(erased);
        state.call = state.call.wrapping_add(1);
        state.seats = helpers;
        drop(state);
        for _ in 0..helpers {
            self.shared.wake.notify_one();
        }
        let mine = catch_unwind(AssertUnwindSafe(job));
        let mut state = self.shared.lock();
        // Workers that have not woken yet stay out: the calling thread never waits for
        // a thread to be scheduled, only for those already running the job.
        state.seats = 0;
        while state.running > 0 {
            state = self
                .shared
                .idle
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
        state.job = None;
        let theirs = state.panic.take();
        drop(state);
        if let Err(payload) = mine {
            resume_unwind(payload);
        }
        if let Some(payload) = theirs {
            resume_unwind(payload);
        }
    }
}

impl Executor for WorkerPool {
    /// Wakes up to `helpers` parked workers, works on `job` too, and waits for the
    /// workers that started on it (never for one that has not woken up yet). O(helpers).
    ///
    /// # Panics
    /// Re-raises a panic of `job` (see [`WorkerPool::for_each_task`]).
    fn execute(&self, helpers: usize, job: &(dyn Fn() + Sync)) {
        self.run(helpers, job);
    }

    /// The started workers plus the calling thread ([`WorkerPool::threads`]).
    fn threads(&self) -> usize {
        WorkerPool::threads(self)
    }
}

impl Drop for WorkerPool {
    /// Stops the workers and joins them. No call is in progress (it would borrow the
    /// pool), so each worker is parked or about to park. O(threads).
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.wake.notify_all();
        for handle in self.workers.drain(..) {
            // A worker catches every panic of a job, so it always returns normally.
            let _ = handle.join();
        }
    }
}

/// A worker's life: park until a call has a seat for it (or shutdown), run the job,
/// report, park again. Never panics: a job's panic is caught and handed to the caller.
fn worker(shared: &Shared) {
    let mut joined = 0u64;
    let mut state = shared.lock();
    loop {
        if state.shutdown {
            return;
        }
        match state.job {
            Some(job) if state.seats > 0 && state.call != joined => {
                joined = state.call;
                state.seats -= 1;
                state.running += 1;
                drop(state);
                let result = catch_unwind(AssertUnwindSafe(job));
                state = shared.lock();
                if let Err(payload) = result {
                    state.panic.get_or_insert(payload);
                }
                state.running -= 1;
                if state.running == 0 {
                    shared.idle.notify_one();
                }
            }
            _ => {
                state = shared
                    .wake
                    .wait(state)
                    .unwrap_or_else(PoisonError::into_inner)
            }
        }
    }
}

/// Runs `work(state, task)` for every `task < tasks` on `pool` and the calling thread
/// (see [`WorkerPool::for_each_task`]), or on the calling thread alone when `pool` is
/// `None`. O(tasks) calls of `work`.
pub(crate) fn for_each_task<W, I, F>(pool: Option<&dyn Executor>, tasks: usize, init: I, work: F)
where
    I: Fn() -> W + Sync,
    F: Fn(&mut W, usize) + Sync,
{
    draw_tasks(pool, tasks, init, |w, task, _| work(w, task), false);
}

/// As [`for_each_task`], and `work(state, task, next)` also learns `next`, the task its
/// thread runs after `task` when the thread has claimed it already, so that `task` can
/// start fetching `next`'s data. A thread claims its next task ahead only while at
/// least as many tasks are unclaimed as the executor has threads
/// ([`Executor::threads`]; never for one that does not say): every thread still finds
/// work, and the claims ahead leave the threads at most one task apart at the end.
/// O(tasks) calls of `work`.
pub(crate) fn for_each_task_ahead<W, I, F>(
    pool: Option<&dyn Executor>,
    tasks: usize,
    init: I,
    work: F,
) where
    I: Fn() -> W + Sync,
    F: Fn(&mut W, usize, Option<usize>) + Sync,
{
    draw_tasks(pool, tasks, init, work, true);
}

/// The one loop behind [`for_each_task`] and [`for_each_task_ahead`] (`ahead`: whether
/// threads claim their next task ahead).
fn draw_tasks<W, I, F>(pool: Option<&dyn Executor>, tasks: usize, init: I, work: F, ahead: bool)
where
    I: Fn() -> W + Sync,
    F: Fn(&mut W, usize, Option<usize>) + Sync,
{
    let threads = pool.map_or(1, |p| p.threads());
    // Each participant overshoots the counter by two draws at most (a claim ahead that
    // finds nothing, then the draw that ends its loop), so it cannot wrap for any task
    // count a call could finish (`tasks <= usize::MAX - 2 * MAX_THREADS`).
    let next = AtomicUsize::new(0);
    let job = || {
        let mut state = init();
        let mut task = next.fetch_add(1, Ordering::Relaxed);
        while task < tasks {
            let claim = ahead && tasks.saturating_sub(next.load(Ordering::Relaxed)) >= threads;
            let following = if claim {
                Some(next.fetch_add(1, Ordering::Relaxed)).filter(|&t| t < tasks)
            } else {
                None
            };
            work(&mut state, task, following);
            task = following.unwrap_or_else(|| next.fetch_add(1, Ordering::Relaxed));
        }
    };
    if let Some(pool) = pool {
        pool.execute(tasks.saturating_sub(1), &job);
    }
    // What the executor left undone (all of it without one). Its threads have returned,
    // so the counter is final unless tasks remain.
    if next.load(Ordering::Relaxed) < tasks {
        job();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::sync::atomic::AtomicBool;
    use std::sync::Barrier;

    /// Counts how often each task ran in one call.
    fn run_counting(pool: &WorkerPool, tasks: usize) -> Vec<usize> {
        let runs: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
        pool.for_each_task(
            tasks,
            || (),
            |_, t| {
                runs[t].fetch_add(1, Ordering::Relaxed);
            },
        );
        runs.into_iter().map(AtomicUsize::into_inner).collect()
    }

    #[test]
    fn every_task_runs_once_across_many_calls() {
        // Under Miri (which checks the pool's synchronisation) fewer pools and calls.
        let (pools, calls): (&[usize], usize) = if cfg!(miri) {
            (&[1, 3], 18)
        } else {
            (&[1, 2, 3, 4, 8], 200)
        };
        for &threads in pools {
            let pool = WorkerPool::new(threads);
            assert_eq!(pool.threads(), threads);
            for call in 0..calls {
                let tasks = [0, 1, 2, 3, 7, 8, 9, 64, 100][call % 9];
                let runs = run_counting(&pool, tasks);
                assert!(runs.iter().all(|&n| n == 1), "{threads} {tasks} {runs:?}");
            }
        }
        // Claiming tasks ahead: each runs once, and a thread's announced next task is the
        // one it runs next.
        for &threads in pools {
            let pool = WorkerPool::new(threads);
            for call in 0..calls {
                let tasks = [0, 1, 2, 3, 7, 8, 9, 64, 100][call % 9];
                let runs: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
                let (ok, claimed) = (AtomicBool::new(true), AtomicUsize::new(0));
                for_each_task_ahead(
                    Some(&pool),
                    tasks,
                    || None::<usize>,
                    |promised, t, next| {
                        if promised.is_some_and(|p| p != t) || next.is_some_and(|n| n <= t) {
                            ok.store(false, Ordering::Relaxed);
                        }
                        claimed.fetch_add(usize::from(next.is_some()), Ordering::Relaxed);
                        *promised = next;
                        runs[t].fetch_add(1, Ordering::Relaxed);
                    },
                );
                assert!(ok.into_inner(), "{threads} {tasks}");
                let runs: Vec<usize> = runs.into_iter().map(AtomicUsize::into_inner).collect();
                assert!(runs.iter().all(|&n| n == 1), "{threads} {tasks} {runs:?}");
                if threads == 1 && tasks > 1 {
                    // One thread claims every task but the first ahead.
                    assert_eq!(claimed.into_inner(), tasks - 1);
                }
            }
        }
        // Without a pool, on the calling thread.
        let runs: Vec<AtomicUsize> = (0..5).map(|_| AtomicUsize::new(0)).collect();
        for_each_task(
            None,
            5,
            || (),
            |_, t| _ = runs[t].fetch_add(1, Ordering::Relaxed),
        );
        assert!(runs.iter().all(|n| n.load(Ordering::Relaxed) == 1));
    }

    #[test]
    fn state_is_per_thread_and_tasks_come_in_order() {
        let pool = WorkerPool::new(4);
        let ok = AtomicBool::new(true);
        let (calls, tasks) = if cfg!(miri) { (3, 100) } else { (50, 1000) };
        for _ in 0..calls {
            pool.for_each_task(
                tasks,
                || None::<usize>,
                |last, t| {
                    if last.is_some_and(|l| l >= t) {
                        ok.store(false, Ordering::Relaxed);
                    }
                    *last = Some(t);
                },
            );
        }
        assert!(ok.into_inner());
    }

    /// Every worker takes part when there are tasks for all (each task waits until all
    /// threads hold one), the workers are the named ones, and dropping the pool joins
    /// them: their thread-local destructors have run when `drop` returns.
    #[test]
    fn workers_are_named_used_and_joined_by_drop() {
        struct OnExit<'a>(&'a AtomicUsize);
        impl Drop for OnExit<'_> {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        static EXITED: AtomicUsize = AtomicUsize::new(0);
        thread_local! {
            static GUARD: Cell<Option<OnExit<'static>>> = const { Cell::new(None) };
        }
        let threads = 4;
        let pool = WorkerPool::new(threads);
        let barrier = Barrier::new(threads);
        let names = Mutex::new(Vec::new());
        let caller = std::thread::current().id();
        pool.for_each_task(
            threads,
            || (),
            |_, _| {
                barrier.wait();
                let me = std::thread::current();
                if me.id() != caller {
                    GUARD.with(|g| g.set(Some(OnExit(&EXITED))));
                    names.lock().unwrap().push(me.name().map(str::to_owned));
                }
            },
        );
        let mut names = names.into_inner().unwrap();
        names.sort();
        let expected: Vec<_> = (1..threads)
            .map(|i| Some(format!("kvpage-worker-{i}")))
            .collect();
        assert_eq!(names, expected);
        assert_eq!(EXITED.load(Ordering::SeqCst), 0);
        drop(pool);
        assert_eq!(EXITED.load(Ordering::SeqCst), threads - 1);
    }

    /// A panicking task neither hangs the call nor kills a worker: the panic comes back
    /// on the calling thread, and the next calls run every task once, on every thread.
    #[test]
    fn a_panicking_task_is_reraised_and_the_pool_keeps_working() {
        let pool = WorkerPool::new(3);
        for bad in [0, 1, 5, 39] {
            let r = catch_unwind(|| {
                pool.for_each_task(
                    40,
                    || (),
                    |_, t| {
                        if t == bad {
                            panic!("task {t} fails on purpose");
                        }
                    },
                )
            });
            let payload = r.expect_err("the panic is re-raised");
            let message = payload.downcast_ref::<String>().map(String::as_str);
            assert_eq!(
                message,
                Some(format!("task {bad} fails on purpose").as_str())
            );
            assert!(run_counting(&pool, 100).iter().all(|&n| n == 1));
        }
        // Every worker is still alive: all three threads meet at a barrier.
        let barrier = Barrier::new(3);
        pool.for_each_task(3, || (), |_, _| _ = barrier.wait());
    }

    /// A task that calls the pool again (or a second thread's call while one runs) does
    /// not deadlock: the inner call runs on its own thread.
    #[test]
    fn a_call_on_a_busy_pool_runs_on_its_own_thread() {
        let pool = WorkerPool::new(3);
        let inner_runs: Vec<AtomicUsize> = (0..20).map(|_| AtomicUsize::new(0)).collect();
        pool.for_each_task(
            4,
            || (),
            |_, t| {
                pool.for_each_task(
                    5,
                    || (),
                    |_, u| _ = inner_runs[t * 5 + u].fetch_add(1, Ordering::Relaxed),
                )
            },
        );
        assert!(inner_runs.iter().all(|n| n.load(Ordering::Relaxed) == 1));
        // Calls from several threads at once on one shared pool.
        let (threads, calls) = if cfg!(miri) { (2, 5) } else { (4, 50) };
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| {
                    for _ in 0..calls {
                        assert!(run_counting(&pool, 30).iter().all(|&n| n == 1));
                    }
                });
            }
        });
    }

    /// A host's executor may call the job on any threads, any number of times, or never:
    /// every task still runs exactly once.
    #[test]
    fn host_executors_run_every_task_once_however_they_call_the_job() {
        struct Never;
        impl Executor for Never {
            fn execute(&self, _: usize, _: &(dyn Fn() + Sync)) {}
        }
        struct Repeatedly;
        impl Executor for Repeatedly {
            fn execute(&self, helpers: usize, job: &(dyn Fn() + Sync)) {
                std::thread::scope(|s| {
                    for _ in 0..helpers + 3 {
                        s.spawn(|| {
                            job();
                            job();
                        });
                    }
                });
            }
        }
        for executor in [&Never as &dyn Executor, &Repeatedly] {
            for tasks in [0, 1, 2, 17, 300] {
                let runs: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
                for_each_task(
                    Some(executor),
                    tasks,
                    || (),
                    |_, t| _ = runs[t].fetch_add(1, Ordering::Relaxed),
                );
                assert!(runs.iter().all(|n| n.load(Ordering::Relaxed) == 1));
            }
        }
    }

    /// A thread the OS refuses to start (its thread limit, a caller asking for
    /// `usize::MAX` threads, no memory for a stack) is no panic: the pool has fewer
    /// workers, and the calling thread runs every task.
    #[test]
    #[cfg_attr(miri, ignore = "Miri ignores the stack size, so the starts succeed")]
    fn refused_thread_starts_leave_a_smaller_pool() {
        // A stack no address space holds (1 PiB; on 32 bits, all but 64 KiB of the
        // 4 GiB), so every start fails.
        #[cfg(target_pointer_width = "64")]
        let huge = 1 << 50;
        #[cfg(not(target_pointer_width = "64"))]
        let huge = usize::MAX - 0xFFFF;
        let pool = WorkerPool::with_stack(8, Some(huge));
        assert_eq!(pool.threads(), 1);
        assert!(run_counting(&pool, 50).iter().all(|&n| n == 1));
        assert!(WorkerPool::new(usize::MAX).threads() <= MAX_THREADS);
    }
}
