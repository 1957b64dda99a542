//! One process-wide thread (`idem-timer`) that keeps the time, sleeping until the next
//! thing is due: waits sleep on it ([`sleep_until`]), and the heartbeat's renewals are
//! sent when it says ([`register`]; they run elsewhere, so no store's code holds it
//! up). Nothing here needs tokio's timer, so it works on a runtime built without one,
//! on another executor, and with none at all. A panic in work run here is caught and
//! logged; the thread goes on.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::task::{Poll, Waker};
use std::time::Instant;

/// Work the timer thread runs when due, again and again while it is registered.
pub(crate) trait Periodic: Send + Sync {
    /// Runs the work; returns when to run it next, if ever.
    fn tick(self: Arc<Self>) -> Option<Instant>;
}

/// Runs `work` at `at`, and again when each run says, until [`forget`] or a run that
/// returns `None`. `false` if there is no timer thread to do it.
pub(crate) fn register(id: u64, work: Arc<dyn Periodic>, at: Instant) -> bool {
    let Some(timer) = timer() else {
        return false;
    };
    timer.register(id, work, at);
    true
}

/// Runs the work registered as `id` at `at` instead of when it was due: its schedule
/// goes on from that tick. (One schedule per work: a tick that was due is dropped, so
/// a retry never adds a second round of ticks.)
pub(crate) fn tick_at(id: u64, at: Instant) {
    if let Some(timer) = timer() {
        timer.reschedule(id, at);
    }
}

/// Stops running the work registered as `id`.
pub(crate) fn forget(id: u64) {
    if let Some(timer) = timer() {
        timer.forget(id);
    }
}

/// Completes at `at` or later, woken by the timer thread: a timer that needs no
/// tokio (a runtime built without timers, another executor, none at all).
pub(crate) async fn sleep_until(at: Instant) {
    let mut deadline = Deadline::new(at);
    std::future::poll_fn(|cx| deadline.poll(cx)).await
}

/// A time the timer thread wakes a task at (see [`sleep_until`]); dropped, it wakes no
/// one.
pub(crate) struct Deadline {
    at: Instant,
    alarm: Alarm,
}

impl Deadline {
    /// Due at `at`.
    pub(crate) fn new(at: Instant) -> Self {
        Deadline {
            at,
            alarm: Alarm::default(),
        }
    }

    /// Ready once due; until then the timer thread wakes `cx`'s task when it is.
    pub(crate) fn poll(&mut self, cx: &mut std::task::Context<'_>) -> Poll<()> {
        let now = Instant::now();
        if now >= self.at {
            return Poll::Ready(());
        }
        if !self.alarm.set(self.at, cx.waker()) {
            // No timer thread (the OS would not start one): block until then
            // rather than poll without pause.
            std::thread::sleep(self.at - now);
        }
        Poll::Pending
    }
}

/// Wakes a task at a given time, from the timer thread. Dropped, it wakes no one.
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
    /// is no timer thread to do it.
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

/// What the timer thread does when something comes due.
enum Job {
    /// Wake a task whose alarm is due.
    Wake(Arc<AlarmSlot>),
    /// Run a registered [`Periodic`]'s tick, by its id and the round of its schedule
    /// (a tick of an earlier round, replaced by [`tick_at`], is dropped).
    Tick(u64, u64),
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
    /// The registered periodic work, by id, with the round of its schedule; work that
    /// ends is removed at once (its queue slots go when they come due, or in a sweep
    /// when they pile up).
    entries: Option<Entries>,
}

/// The registered periodic work, by id. Ids are a counter's values, so a
/// multiplication spreads them well enough: no need for SipHash on every call.
type Entries = HashMap<u64, (Arc<dyn Periodic>, u64), BuildHasherDefault<IdHasher>>;

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

/// The timer thread's queue.
struct Timer {
    queue: Mutex<Queue>,
    wake: Condvar,
}

/// The timer thread, started on first use; `None` if the OS would not start it (then
/// claims are not renewed, and a body longer than its lease may be taken over: logged
/// once).
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
            .name("idem-timer".into())
            .spawn(|| TIMER.run());
        if let Err(error) = &spawned {
            tracing::error!(%error, "idem: cannot start the timer thread; claims will not be renewed");
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

    fn register(&self, id: u64, work: Arc<dyn Periodic>, at: Instant) {
        let mut queue = self.lock();
        queue
            .entries
            .get_or_insert_with(Entries::default)
            .insert(id, (work, 0));
        self.push(&mut queue, at, Job::Tick(id, 0));
    }

    /// Moves the next tick of `id` to `at`: a new round, so the tick due before is dropped.
    fn reschedule(&self, id: u64, at: Instant) {
        let mut queue = self.lock();
        let Some((_, round)) = queue.entries.as_mut().and_then(|e| e.get_mut(&id)) else {
            return;
        };
        *round += 1;
        let round = *round;
        self.push(&mut queue, at, Job::Tick(id, round));
    }

    fn forget(&self, id: u64) {
        let mut queue = self.lock();
        let entries = queue.entries.get_or_insert_with(Entries::default);
        entries.remove(&id);
        let live = entries.len();
        // Slots of ended work wait in the queue until due: sweep them when they
        // outnumber the live ones, so a fast stream of calls does not pile them up.
        if queue.heap.len() > 2 * live + 1024 {
            let Queue { heap, entries, .. } = &mut *queue;
            let entries = entries.get_or_insert_with(Entries::default);
            heap.retain(|due| match &due.job {
                Job::Tick(id, round) => entries.get(id).is_some_and(|(_, r)| r == round),
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
                    // A tick of a round that was rescheduled, or of ended work, is dropped.
                    let work = match &due.job {
                        Job::Tick(id, round) => queue
                            .entries
                            .as_ref()
                            .and_then(|e| e.get(id))
                            .filter(|(_, current)| current == round)
                            .map(|(work, _)| Arc::clone(work)),
                        Job::Wake(_) => None,
                    };
                    drop(queue);
                    // A panic in a store's code must not stop the heartbeat of every
                    // other claim.
                    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        match (&due.job, work) {
                            (Job::Wake(slot), _) => slot.ring(due.at),
                            (Job::Tick(id, round), Some(work)) => {
                                if let Some(next) = work.tick() {
                                    // Still this round: a reschedule during the tick
                                    // (a renewal that failed at once) made a new one,
                                    // and this one is then dropped when due.
                                    self.schedule(next, Job::Tick(*id, *round));
                                }
                            }
                            (Job::Tick(..), None) => {}
                        }
                    }));
                    if ran.is_err() {
                        tracing::error!(
                            "idem: work on the timer thread panicked; the timer goes on"
                        );
                    }
                    queue = self.lock();
                }
            }
        }
    }
}
