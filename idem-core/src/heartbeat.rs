//! The heartbeat: a running body's claim is renewed every third of its lease, so a live
//! body never loses its key, however long it runs (up to `max_run`); only a dead
//! process's claim runs out.
//!
//! One process-wide thread (`idem-heartbeat`) keeps the time, sleeping until the next
//! thing is due; it serves two kinds of bodies:
//!
//! - An async body is polled together with its renewals ([`drive`]): the thread only
//!   wakes the body's task when a renewal is due, and the renewal runs in that task (so
//!   a network store's renewal runs on the caller's runtime). No tokio timer is needed,
//!   so this works on any executor. A body that finishes before it first waits costs
//!   nothing; one that waits costs one entry in the thread's queue, and no store round
//!   trip until its first renewal is due. At `max_run` the body is stopped; a renewal
//!   that finds the claim taken over stops it too.
//! - A sync body blocks its thread: the heartbeat thread renews its claim itself
//!   ([`Beat`]). It cannot stop the body; at `max_run` it stops renewing.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use crate::error::Human;
use crate::options::Options;
use crate::record::Token;
use crate::store::{Fenced, Store};
use crate::Key;

/// How soon a renewal is tried again after the store failed to answer one.
fn retry_after(every: Duration) -> Duration {
    (every / 2).min(Duration::from_secs(1))
}

/// The claim a heartbeat renews.
pub(crate) struct Lease<'a> {
    pub(crate) store: &'a dyn Store,
    pub(crate) key: &'a Key,
    pub(crate) tool: &'a str,
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

/// Polls `body` to the end while renewing its claim (see the module docs).
pub(crate) async fn drive<F: Future>(mut body: Pin<&mut F>, lease: &Lease<'_>) -> Ran<F::Output> {
    let every = lease.options.renew_every();
    let started = Instant::now();
    let deadline = started.checked_add(lease.options.max_run);
    let mut next = started + every;
    let mut alarm = Alarm::default();
    let mut renewal: Option<Pin<Box<dyn Future<Output = _> + Send + '_>>> = None;
    std::future::poll_fn(|cx| {
        if let Poll::Ready(output) = body.as_mut().poll(cx) {
            return Poll::Ready(Ran::Finished(output));
        }
        loop {
            if let Some(renewing) = renewal.as_mut() {
                let Poll::Ready(renewed) = renewing.as_mut().poll(cx) else {
                    return Poll::Pending;
                };
                renewal = None;
                next = match renewed {
                    Ok(Fenced::Applied) => Instant::now() + every,
                    Ok(Fenced::LostLease) => {
                        tracing::warn!(tool = lease.tool, key = %lease.key, "idem: the claim was taken over or removed while the body ran; stopping the body");
                        return Poll::Ready(Ran::Lost);
                    }
                    Err(error) => {
                        tracing::warn!(tool = lease.tool, key = %lease.key, %error, "idem: could not renew the claim; trying again");
                        Instant::now() + retry_after(every)
                    }
                };
            }
            let now = Instant::now();
            if deadline.is_some_and(|deadline| now >= deadline) {
                return Poll::Ready(Ran::OverMaxRun);
            }
            if now < next {
                let wake_at = deadline.map_or(next, |deadline| next.min(deadline));
                // Without a heartbeat thread, the claim is not renewed (logged once).
                alarm.set(wake_at, cx.waker());
                return Poll::Pending;
            }
            renewal = Some(lease.store.renew(
                lease.key,
                lease.token,
                lease.options.lease,
                lease.options.ttl,
            ));
        }
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
        let mut due = slot.due.lock().unwrap_or_else(PoisonError::into_inner);
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
            *slot.due.lock().unwrap_or_else(PoisonError::into_inner) = None;
        }
    }
}

impl AlarmSlot {
    /// Wakes the task if the alarm is still set for `at`.
    fn ring(&self, at: Instant) {
        let due = self.due.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((when, waker)) = &*due {
            if *when == at {
                let waker = waker.clone();
                drop(due);
                waker.wake();
            }
        }
    }
}

/// A sync body's claim, renewed by the heartbeat thread while this handle lives.
pub(crate) struct Beat {
    entry: Option<Arc<Entry>>,
}

struct Entry {
    store: Arc<dyn Store>,
    key: Key,
    tool: String,
    token: Token,
    lease: Duration,
    ttl: Duration,
    every: Duration,
    deadline: Option<Instant>,
    max_run: Duration,
    /// A multi-threaded runtime to renew on (network stores need one); otherwise the
    /// renewal runs on the renewer thread.
    runtime: Option<tokio::runtime::Handle>,
    stopped: AtomicBool,
}

impl Beat {
    /// Starts renewing the claim `lease` describes, on the heartbeat thread.
    pub(crate) fn start(store: &Arc<dyn Store>, lease: &Lease<'_>) -> Beat {
        let Some(timer) = timer() else {
            return Beat { entry: None };
        };
        let runtime = tokio::runtime::Handle::try_current()
            .ok()
            .filter(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        let options = lease.options;
        let entry = Arc::new(Entry {
            store: Arc::clone(store),
            key: lease.key.clone(),
            tool: lease.tool.to_owned(),
            token: lease.token,
            lease: options.lease,
            ttl: options.ttl,
            every: options.renew_every(),
            deadline: Instant::now().checked_add(options.max_run),
            max_run: options.max_run,
            runtime,
            stopped: AtomicBool::new(false),
        });
        timer.schedule(Instant::now() + entry.every, Job::Renew(Arc::clone(&entry)));
        Beat { entry: Some(entry) }
    }
}

impl Drop for Beat {
    fn drop(&mut self) {
        if let Some(entry) = &self.entry {
            // Its queue slot goes when it comes due.
            entry.stopped.store(true, AtomicOrdering::SeqCst);
        }
    }
}

/// What the heartbeat thread does when something comes due.
enum Job {
    /// Wake an async body's task, whose renewal is due.
    Wake(Arc<AlarmSlot>),
    /// Renew a sync body's claim.
    Renew(Arc<Entry>),
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
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn schedule(&self, at: Instant, job: Job) {
        let mut queue = self.lock();
        queue.seq += 1;
        let seq = queue.seq;
        queue.heap.push(Due { at, seq, job });
        // Wake the thread only if it would otherwise sleep past this renewal.
        if queue.wakes_at.is_none_or(|wakes| at < wakes) {
            self.wake.notify_one();
        }
    }

    fn run(&self) {
        // Network stores cannot be driven from this thread: mark it as blocking, so they
        // answer with an error instead of waiting on a runtime that is not here.
        crate::protocol::mark_blocking();
        let mut queue = self.lock();
        loop {
            let now = Instant::now();
            let due_at = queue.heap.peek().map(|due| due.at);
            match due_at {
                None => {
                    queue.wakes_at = None;
                    queue = self
                        .wake
                        .wait(queue)
                        .unwrap_or_else(PoisonError::into_inner);
                }
                Some(at) if at > now => {
                    queue.wakes_at = Some(at);
                    queue = self
                        .wake
                        .wait_timeout(queue, at - now)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                }
                Some(_) => {
                    queue.wakes_at = None;
                    let Some(due) = queue.heap.pop() else {
                        continue;
                    };
                    drop(queue);
                    match due.job {
                        Job::Wake(slot) => slot.ring(due.at),
                        Job::Renew(entry) => {
                            if let Some(next) = self.renew(&entry) {
                                self.schedule(next, Job::Renew(entry));
                            }
                        }
                    }
                    queue = self.lock();
                }
            }
        }
    }

    /// Renews `entry`'s claim; returns when to renew it next, if ever.
    fn renew(&self, entry: &Arc<Entry>) -> Option<Instant> {
        if entry.stopped.load(AtomicOrdering::SeqCst) {
            return None;
        }
        let now = Instant::now();
        if entry.deadline.is_some_and(|deadline| now >= deadline) {
            tracing::warn!(tool = %entry.tool, key = %entry.key, max_run = %Human(entry.max_run), "idem: the body ran past its max_run; its claim is no longer renewed");
            return None;
        }
        match &entry.runtime {
            Some(runtime) => {
                // On the runtime, so a slow store holds up no other claim's renewal.
                let spawned = Arc::clone(entry);
                runtime.spawn(async move {
                    let renewed = spawned
                        .store
                        .renew(&spawned.key, spawned.token, spawned.lease, spawned.ttl)
                        .await;
                    spawned.outcome(renewed);
                });
                Some(now + entry.every)
            }
            None => {
                let renewed = pollster::block_on(entry.store.renew(
                    &entry.key,
                    entry.token,
                    entry.lease,
                    entry.ttl,
                ));
                let ok = entry.outcome(renewed)?;
                Some(
                    Instant::now()
                        + if ok {
                            entry.every
                        } else {
                            retry_after(entry.every)
                        },
                )
            }
        }
    }
}

impl Entry {
    /// Logs a renewal's outcome; `None` once the claim is lost, else whether it renewed.
    fn outcome(&self, renewed: Result<Fenced, crate::Error>) -> Option<bool> {
        match renewed {
            Ok(Fenced::Applied) => Some(true),
            Ok(Fenced::LostLease) => {
                if !self.stopped.swap(true, AtomicOrdering::SeqCst) {
                    tracing::warn!(tool = %self.tool, key = %self.key, "idem: the claim was taken over or removed while the body ran; its result will not be stored");
                }
                None
            }
            Err(error) => {
                tracing::warn!(tool = %self.tool, key = %self.key, %error, "idem: could not renew the claim; trying again");
                Some(false)
            }
        }
    }
}
