//! The heartbeat: a running body's claim is renewed every third of its lease, so a live
//! body never loses its key, however long it runs (up to `max_run`); only a dead
//! process's claim runs out.
//!
//! One process-wide thread (`idem-heartbeat`) keeps the time, sleeping until the next
//! thing is due. It renews the claims of running bodies itself ([`Beat`]), whatever
//! their task is doing: an async body that blocks its thread, or waits behind another
//! task on a busy current-thread runtime, keeps its claim as a sync body does. A renewal
//! is sent when due, counted from when the last one was sent. It is polled once on the
//! heartbeat thread, where the in-process stores complete it, and a network store's
//! renewal then goes on on the body's runtime (see [`crate::background`]).
//!
//! The thread also tells an async body when to stop ([`drive`]): at `max_run`, or when a
//! renewal found its claim taken over. Every body registers with the thread before it
//! first runs (a body may block its thread before it ever waits), which costs a lock and
//! no store round trip; its first renewal is due a third of a lease later, and a body
//! that has ended is forgotten at once. A sync body cannot be stopped from outside: at
//! `max_run` its renewals stop. The thread is also the timer waits sleep on
//! ([`sleep_until`]), so nothing here needs tokio's timer. A panic in a store's code run
//! there is caught and logged; the thread goes on.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};
use std::future::Future;
use std::hash::{BuildHasherDefault, Hasher};
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering as AtomicOrdering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use crate::error::Human;
use crate::options::Options;
use crate::record::Token;
use crate::store::{Fenced, Store};
use crate::{background, Error, Key};

/// How soon a renewal is tried again after the store failed to answer one.
fn retry_after(every: Duration) -> Duration {
    (every / 2).min(Duration::from_secs(1))
}

/// The claim a heartbeat renews.
pub(crate) struct Lease<'a> {
    pub(crate) store: &'a Arc<dyn Store>,
    pub(crate) key: &'a Key,
    pub(crate) tool: &'a Arc<str>,
    pub(crate) token: Token,
    pub(crate) options: &'a Options,
}

/// How a body driven with its heartbeat ended.
pub(crate) enum Ran<T> {
    /// The body finished with this output.
    Finished(T),
    /// The body was still running at `max_run`.
    OverMaxRun,
    /// A renewal found the claim no longer this call's (taken over, or deleted).
    Lost,
}

/// Polls `body` to the end while the heartbeat thread renews its claim; stops it at
/// `max_run`, or when a renewal finds the claim gone (see the module docs).
pub(crate) async fn drive<F: Future>(mut body: Pin<&mut F>, lease: &Lease<'_>) -> Ran<F::Output> {
    let beat = Beat::start(lease);
    std::future::poll_fn(|cx| {
        if let Poll::Ready(output) = body.as_mut().poll(cx) {
            return Poll::Ready(Ran::Finished(output));
        }
        match beat.watch(cx.waker()) {
            BeatState::Running => Poll::Pending,
            BeatState::OverMaxRun => Poll::Ready(Ran::OverMaxRun),
            BeatState::Lost => Poll::Ready(Ran::Lost),
        }
    })
    .await
}

/// Where a claim the heartbeat thread renews stands.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum BeatState {
    Running,
    OverMaxRun,
    Lost,
}

const RUNNING: u8 = 0;
const OVER_MAX_RUN: u8 = 1;
const LOST: u8 = 2;
/// The body ended: nothing more to renew.
const ENDED: u8 = 3;

/// A claim renewed by the heartbeat thread while this handle lives.
pub(crate) struct Beat {
    entry: Option<(u64, Arc<Entry>)>,
}

struct Entry {
    /// Its id in the heartbeat thread's table.
    id: u64,
    store: Arc<dyn Store>,
    key: Key,
    tool: Arc<str>,
    token: Token,
    lease: Duration,
    ttl: Duration,
    every: Duration,
    deadline: Option<Instant>,
    max_run: Duration,
    /// The runtime the body runs on, where a renewal that must wait goes on.
    runtime: Option<tokio::runtime::Handle>,
    state: AtomicU8,
    /// The async body's task, woken when it must stop.
    waker: Mutex<Option<Waker>>,
}

impl Beat {
    /// Starts renewing the claim `lease` describes, on the heartbeat thread.
    pub(crate) fn start(lease: &Lease<'_>) -> Beat {
        let Some(timer) = timer() else {
            return Beat { entry: None };
        };
        let options = lease.options;
        let now = Instant::now();
        static IDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let entry = Arc::new(Entry {
            id: IDS.fetch_add(1, AtomicOrdering::Relaxed),
            store: Arc::clone(lease.store),
            key: lease.key.clone(),
            tool: Arc::clone(lease.tool),
            token: lease.token,
            lease: options.lease,
            ttl: options.ttl,
            every: options.renew_every(),
            deadline: now.checked_add(options.max_run),
            max_run: options.max_run,
            runtime: tokio::runtime::Handle::try_current().ok(),
            state: AtomicU8::new(RUNNING),
            waker: Mutex::new(None),
        });
        timer.register(Arc::clone(&entry), entry.next(now));
        Beat {
            entry: Some((entry.id, entry)),
        }
    }

    /// Where the claim stands; `waker` is woken when that changes.
    fn watch(&self, waker: &Waker) -> BeatState {
        let Some((_, entry)) = &self.entry else {
            return BeatState::Running;
        };
        {
            let mut slot = crate::sync::lock(&entry.waker);
            match &mut *slot {
                Some(current) if current.will_wake(waker) => {}
                other => *other = Some(waker.clone()),
            }
        }
        // Read after the waker is in place, so a change in between is not missed.
        match entry.state.load(AtomicOrdering::SeqCst) {
            OVER_MAX_RUN => BeatState::OverMaxRun,
            LOST => BeatState::Lost,
            _ => BeatState::Running,
        }
    }
}

impl Drop for Beat {
    fn drop(&mut self) {
        if let Some((id, entry)) = self.entry.take() {
            entry.state.store(ENDED, AtomicOrdering::SeqCst);
            if let Some(timer) = timer() {
                timer.forget(id);
            }
        }
    }
}

impl Entry {
    /// When to look at this claim next: its next renewal, or its deadline if sooner.
    fn next(&self, after: Instant) -> Instant {
        let renewal = after + self.every;
        self.deadline
            .map_or(renewal, |deadline| renewal.min(deadline))
    }

    /// Moves a running claim to `state` and wakes its body.
    fn stop(&self, state: u8) {
        if self
            .state
            .compare_exchange(
                RUNNING,
                state,
                AtomicOrdering::SeqCst,
                AtomicOrdering::SeqCst,
            )
            .is_ok()
        {
            let waker = crate::sync::lock(&self.waker).take();
            if let Some(waker) = waker {
                waker.wake();
            }
        }
    }

    /// What a renewal found.
    fn renewed(self: &Arc<Self>, renewed: Result<Fenced, Error>) {
        match renewed {
            Ok(Fenced::Applied) => {}
            Ok(Fenced::LostLease) => {
                if self.state.load(AtomicOrdering::SeqCst) == RUNNING {
                    tracing::warn!(tool = %self.tool, key = %self.key, "idem: the claim was taken over or removed while the body ran; stopping it");
                }
                self.stop(LOST);
            }
            Err(error) => {
                tracing::warn!(tool = %self.tool, key = %self.key, %error, "idem: could not renew the claim; trying again");
                if let Some(timer) = timer() {
                    let soon = Instant::now() + retry_after(self.every);
                    timer.schedule_renewal(self, soon);
                }
            }
        }
    }
}

/// Completes at `at` or later, woken by the heartbeat thread: a timer that needs no
/// tokio (a runtime built without timers, another executor, none at all).
pub(crate) async fn sleep_until(at: Instant) {
    let mut alarm = Alarm::default();
    std::future::poll_fn(|cx| {
        let now = Instant::now();
        if now >= at {
            return Poll::Ready(());
        }
        if !alarm.set(at, cx.waker()) {
            // No heartbeat thread (the OS would not start one): block until then
            // rather than poll without pause.
            std::thread::sleep(at - now);
        }
        Poll::Pending
    })
    .await
}

/// Wakes a task at a given time, from the heartbeat thread. Dropped, it wakes no one.
#[derive(Default)]
struct Alarm {
    slot: Option<Arc<AlarmSlot>>,
}

struct AlarmSlot {
    /// The waker and the time it is due, `None` once the alarm is dropped.
    due: Mutex<Option<(Instant, Waker)>>,
}

impl Alarm {
    /// Wakes `waker` at `at` (or later), replacing any earlier setting. `false` if there
    /// is no heartbeat thread to do it.
    fn set(&mut self, at: Instant, waker: &Waker) -> bool {
        let Some(timer) = timer() else {
            return false;
        };
        let slot = self.slot.get_or_insert_with(|| {
            Arc::new(AlarmSlot {
                due: Mutex::new(None),
            })
        });
        let mut due = crate::sync::lock(&slot.due);
        match &mut *due {
            Some((when, current)) if *when == at => {
                if !current.will_wake(waker) {
                    current.clone_from(waker);
                }
            }
            other => {
                *other = Some((at, waker.clone()));
                drop(due);
                timer.schedule(at, Job::Wake(Arc::clone(slot)));
            }
        }
        true
    }
}

impl Drop for Alarm {
    fn drop(&mut self) {
        if let Some(slot) = &self.slot {
            // Its queue slot goes when it comes due.
            *crate::sync::lock(&slot.due) = None;
        }
    }
}

impl AlarmSlot {
    /// Wakes the task if the alarm is still set for `at`.
    fn ring(&self, at: Instant) {
        let due = crate::sync::lock(&self.due);
        if let Some((when, waker)) = &*due {
            if *when == at {
                let waker = waker.clone();
                drop(due);
                waker.wake();
            }
        }
    }
}

/// What the heartbeat thread does when something comes due.
enum Job {
    /// Wake a task whose alarm is due.
    Wake(Arc<AlarmSlot>),
    /// Renew a running body's claim (or stop it at its deadline), by its id.
    Renew(u64),
}

/// A job due at `at`.
struct Due {
    at: Instant,
    seq: u64,
    job: Job,
}

impl PartialEq for Due {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Due {}
impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Due {
    /// Reversed, so the heap's top is the earliest.
    fn cmp(&self, other: &Self) -> Ordering {
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

struct Queue {
    heap: BinaryHeap<Due>,
    seq: u64,
    /// When the thread wakes next, if it sleeps with a timeout.
    wakes_at: Option<Instant>,
    /// The claims being renewed, by id; a body that ends is removed at once (its
    /// queue slots go when they come due, or in a sweep when they pile up).
    entries: Option<Entries>,
}

/// The claims being renewed, by id. Ids are a counter's values, so a multiplication
/// spreads them well enough: no need for SipHash on every call.
type Entries = HashMap<u64, Arc<Entry>, BuildHasherDefault<IdHasher>>;

#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8 | u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, id: u64) {
        self.0 = id.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// The heartbeat thread's queue.
struct Timer {
    queue: Mutex<Queue>,
    wake: Condvar,
}

/// The heartbeat thread, started on first use; `None` if the OS would not start it
/// (then claims are not renewed, and a body longer than its lease may be taken over:
/// logged once).
fn timer() -> Option<&'static Timer> {
    static TIMER: Timer = Timer {
        queue: Mutex::new(Queue {
            heap: BinaryHeap::new(),
            seq: 0,
            wakes_at: None,
            entries: None,
        }),
        wake: Condvar::new(),
    };
    static STARTED: OnceLock<bool> = OnceLock::new();
    let started = *STARTED.get_or_init(|| {
        let spawned = std::thread::Builder::new()
            .name("idem-heartbeat".into())
            .spawn(|| TIMER.run());
        if let Err(error) = &spawned {
            tracing::error!(%error, "idem: cannot start the heartbeat thread; claims will not be renewed");
        }
        spawned.is_ok()
    });
    started.then_some(&TIMER)
}

impl Timer {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        crate::sync::lock(&self.queue)
    }

    fn schedule(&self, at: Instant, job: Job) {
        let mut queue = self.lock();
        self.push(&mut queue, at, job);
    }

    fn push(&self, queue: &mut Queue, at: Instant, job: Job) {
        queue.seq += 1;
        let seq = queue.seq;
        queue.heap.push(Due { at, seq, job });
        // Wake the thread only if it would otherwise sleep past this job.
        if queue.wakes_at.is_none_or(|wakes| at < wakes) {
            self.wake.notify_one();
        }
    }

    /// Starts renewing `entry`, first at `at`.
    fn register(&self, entry: Arc<Entry>, at: Instant) {
        let mut queue = self.lock();
        let id = entry.id;
        queue
            .entries
            .get_or_insert_with(Entries::default)
            .insert(id, entry);
        self.push(&mut queue, at, Job::Renew(id));
    }

    /// Renews `entry` (if still registered) again at `at`, besides its schedule.
    fn schedule_renewal(&self, entry: &Entry, at: Instant) {
        self.schedule(at, Job::Renew(entry.id));
    }

    /// Stops renewing the claim `id`.
    fn forget(&self, id: u64) {
        let mut queue = self.lock();
        let entries = queue.entries.get_or_insert_with(Entries::default);
        entries.remove(&id);
        let live = entries.len();
        // Slots of ended claims wait in the queue until due: sweep them when they
        // outnumber the live ones, so a fast stream of calls does not pile them up.
        if queue.heap.len() > 2 * live + 1024 {
            let Queue { heap, entries, .. } = &mut *queue;
            let entries = entries.get_or_insert_with(Entries::default);
            heap.retain(|due| match &due.job {
                Job::Renew(id) => entries.contains_key(id),
                Job::Wake(_) => true,
            });
        }
    }

    fn run(&self) {
        let mut queue = self.lock();
        loop {
            let now = Instant::now();
            let due_at = queue.heap.peek().map(|due| due.at);
            match due_at {
                None => {
                    queue.wakes_at = None;
                    queue = crate::sync::wait(&self.wake, queue);
                }
                Some(at) if at > now => {
                    queue.wakes_at = Some(at);
                    queue = crate::sync::wait_timeout(&self.wake, queue, at - now);
                }
                Some(_) => {
                    queue.wakes_at = None;
                    let Some(due) = queue.heap.pop() else {
                        continue;
                    };
                    let entry = match &due.job {
                        Job::Renew(id) => queue.entries.as_ref().and_then(|e| e.get(id)).cloned(),
                        Job::Wake(_) => None,
                    };
                    drop(queue);
                    // A panic in a store's code must not stop the heartbeat of every
                    // other claim.
                    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        match (&due.job, entry) {
                            (Job::Wake(slot), _) => slot.ring(due.at),
                            (Job::Renew(id), Some(entry)) => {
                                if let Some(next) = self.renew(&entry) {
                                    self.schedule(next, Job::Renew(*id));
                                }
                            }
                            (Job::Renew(_), None) => {}
                        }
                    }));
                    if ran.is_err() {
                        tracing::error!(
                            "idem: a store panicked on the heartbeat thread; the heartbeat goes on"
                        );
                    }
                    queue = self.lock();
                }
            }
        }
    }

    /// Renews `entry`'s claim, or stops its body at its deadline; returns when to look
    /// at it next, if ever.
    fn renew(&self, entry: &Arc<Entry>) -> Option<Instant> {
        if entry.state.load(AtomicOrdering::SeqCst) != RUNNING {
            return None;
        }
        let now = Instant::now();
        if entry.deadline.is_some_and(|deadline| now >= deadline) {
            tracing::warn!(tool = %entry.tool, key = %entry.key, max_run = %Human(entry.max_run), "idem: the body ran past its max_run; its claim is no longer renewed");
            entry.stop(OVER_MAX_RUN);
            return None;
        }
        let renewing = Arc::clone(entry);
        background::detach(
            async move {
                let renewed = renewing
                    .store
                    .renew(&renewing.key, renewing.token, renewing.lease, renewing.ttl)
                    .await;
                renewing.renewed(renewed);
            },
            entry.runtime.as_ref(),
        );
        Some(entry.next(now))
    }
}
