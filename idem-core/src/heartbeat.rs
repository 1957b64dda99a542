//! The heartbeat: a claim is renewed every third of its lease from when its body starts
//! until its outcome is recorded (or the claim settled), so a live call never loses its
//! key, however long its body runs (up to `max_run`) and however long the store takes
//! to record what it returned; only a dead process's claim runs out.
//!
//! The timer thread ([`crate::timer`]) keeps each claim's schedule ([`Beat`]), whatever
//! the body's task is doing: an async body that blocks its thread, or waits behind
//! another task on a busy current-thread runtime, keeps its claim as a sync body does.
//! A renewal is sent when due, counted from when the last one was sent, and runs on a
//! blocking thread of idem's own runtime ([`crate::background::run_blocking`]), never
//! on the timer thread: a store that blocks (sled's writes wait for its IO under a
//! flood of writes, a custom store doing blocking IO) delays its own renewals, not
//! every wait and renewal in the process. At most [`RENEWALS_PER_STORE`] renewals of one
//! store run at once, so one that blocks for long holds a bounded number of threads. A
//! store whose renewals never block ([`Store::renewals_block`]: Postgres, whose renewals
//! wait for one statement carrying them all) has them run as tasks of idem's own
//! runtime instead, as many at once as are due.
//!
//! The heartbeat also tells an async body when to stop ([`drive`]): at `max_run`, or
//! when a renewal found its claim taken over. Every body registers with the timer
//! thread before it first runs (a body may block its thread before it ever waits),
//! which costs a lock and no store round trip; its first renewal is due a third of a
//! lease later. Once the body has ended ([`Beat::body_ended`]), `max_run` no longer
//! applies: the claim is renewed while its outcome is written. A sync body cannot be
//! stopped from outside: at `max_run` its renewals stop.
//!
//! One renewal of a claim is in flight at a time: a store slower than a third of the
//! lease gets its next renewal when it answered, not a pile of them. A claim its call
//! gives up without an outcome is first let go of here ([`Beat::before_settling`]),
//! which waits for a renewal still in flight: one that landed after the claim was given
//! up as abandoned would make it live again for a lease. One slower than that wait (a
//! lease) that lands after the call settled its claim gives it up again at once.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use crate::background;
use crate::error::Error;
use crate::error::Human;
use crate::key_text::Key;
use crate::options::Options;
use crate::protocol::ToolName;
use crate::record::Token;
use crate::store::{Fenced, Store};
use crate::telemetry::{in_span, store_op};
use crate::timer::{self, Periodic};

/// How soon a renewal is tried again after the store failed to answer one.
fn retry_after(every: Duration) -> Duration {
    (every / 2).min(Duration::from_secs(1))
}

/// The claim a heartbeat renews.
pub(crate) struct Lease<'a> {
    pub(crate) store: &'a Arc<dyn Store>,
    pub(crate) key: &'a Key,
    pub(crate) tool: &'a ToolName,
    pub(crate) token: Token,
    pub(crate) options: &'a Options,
    /// The call's span, which the heartbeat's events go in.
    pub(crate) span: &'a tracing::Span,
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

/// Polls `body` to the end while `beat` renews its claim; stops it at `max_run`, or
/// when a renewal finds the claim gone (see the module docs).
pub(crate) async fn drive<F: Future>(mut body: Pin<&mut F>, beat: &Beat) -> Ran<F::Output> {
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

/// Where a renewed claim stands.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum BeatState {
    Running,
    OverMaxRun,
    Lost,
}

const RUNNING: u8 = 0;
const OVER_MAX_RUN: u8 = 1;
const LOST: u8 = 2;
/// Let go of: nothing more to renew.
const ENDED: u8 = 3;

/// A claim renewed while this handle lives (see the module docs).
pub(crate) struct Beat {
    entry: Option<Arc<Entry>>,
}

struct Entry {
    /// Its id in the timer thread's table.
    id: u64,
    store: Arc<dyn Store>,
    key: Key,
    tool: ToolName,
    /// The call's span while its claim is renewed; let go of at the end, so that a
    /// renewal still in flight does not hold the span open after the call.
    span: Mutex<Option<tracing::Span>>,
    token: Token,
    lease: Duration,
    ttl: Duration,
    every: Duration,
    deadline: Option<Instant>,
    max_run: Duration,
    state: AtomicU8,
    /// The body has ended: `max_run` no longer applies, and a renewal that finds the
    /// claim gone (its outcome recorded meanwhile) is no news.
    body_ended: AtomicBool,
    /// A renewal is sent and not yet answered (see [`Beat::before_settling`]).
    in_flight: AtomicBool,
    /// The call is settling the claim (releasing it, or giving it up as abandoned): a
    /// renewal that lands from now on gives it up again.
    settling: AtomicBool,
    /// Fired when a renewal in flight is answered.
    answered: event_listener::Event,
    /// The async body's task, woken when it must stop.
    waker: Mutex<Option<Waker>>,
}

impl Beat {
    /// Starts renewing the claim `lease` describes, from now.
    pub(crate) fn start(lease: &Lease<'_>) -> Beat {
        let options = lease.options;
        let now = Instant::now();
        static IDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let entry = Arc::new(Entry {
            id: IDS.fetch_add(1, AtomicOrdering::Relaxed),
            store: Arc::clone(lease.store),
            key: lease.key.clone(),
            tool: lease.tool.clone(),
            span: Mutex::new(Some(lease.span.clone())),
            token: lease.token,
            lease: options.lease,
            ttl: options.ttl,
            every: options.renew_every(),
            deadline: now.checked_add(options.max_run),
            max_run: options.max_run,
            state: AtomicU8::new(RUNNING),
            body_ended: AtomicBool::new(false),
            in_flight: AtomicBool::new(false),
            settling: AtomicBool::new(false),
            answered: event_listener::Event::new(),
            waker: Mutex::new(None),
        });
        if !timer::register(
            entry.id,
            Arc::clone(&entry) as Arc<dyn Periodic>,
            entry.next(now),
        ) {
            return Beat { entry: None };
        }
        Beat { entry: Some(entry) }
    }

    /// The body has ended; the claim is renewed on, past `max_run`, until the call lets
    /// go of it (its outcome recorded, or its claim settled).
    pub(crate) fn body_ended(&self) {
        if let Some(entry) = &self.entry {
            entry.body_ended.store(true, AtomicOrdering::SeqCst);
        }
    }

    /// No claim: renews nothing.
    pub(crate) const fn none() -> Beat {
        Beat { entry: None }
    }

    /// Stops renewing the claim: no renewal is sent after this. One sent before may
    /// still be in flight: [`Quiet::before_settling`] waits for it.
    pub(crate) fn end(mut self) -> Quiet {
        let entry = self.entry.take();
        if let Some(entry) = &entry {
            entry.end();
        }
        Quiet(entry)
    }

    /// Stops renewing the claim, which its call is about to settle (see
    /// [`Quiet::before_settling`]).
    pub(crate) async fn before_settling(self) {
        self.end().before_settling().await
    }

    /// Where the claim stands; `waker` is woken when that changes.
    fn watch(&self, waker: &Waker) -> BeatState {
        let Some(entry) = &self.entry else {
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

/// A claim whose renewals were stopped ([`Beat::end`]).
#[derive(Clone)]
pub(crate) struct Quiet(Option<Arc<Entry>>);

impl Quiet {
    /// Returns once no renewal of the claim is in flight, so that none lands after the
    /// call settles its claim; or once a lease has passed waiting for one (a store that
    /// never answers): one that lands later gives the claim up again. Call it right
    /// before settling the claim.
    pub(crate) async fn before_settling(self) {
        let Some(entry) = self.0 else {
            return;
        };
        // A renewal sent before the end is waited for; one about to be sent saw the end
        // (see `Entry::tick`).
        let until = Instant::now().checked_add(entry.lease);
        loop {
            let answered = entry.answered.listen();
            if !entry.in_flight.load(AtomicOrdering::SeqCst) {
                break;
            }
            match until.filter(|until| *until > Instant::now()) {
                Some(until) => either(answered, timer::sleep_until(until)).await,
                None => break,
            }
        }
        entry.settling.store(true, AtomicOrdering::SeqCst);
    }
}

/// Waits for either of two futures.
async fn either(a: impl Future<Output = ()>, b: impl Future<Output = ()>) {
    let (mut a, mut b) = (std::pin::pin!(a), std::pin::pin!(b));
    std::future::poll_fn(|cx| {
        if a.as_mut().poll(cx).is_ready() || b.as_mut().poll(cx).is_ready() {
            return Poll::Ready(());
        }
        Poll::Pending
    })
    .await
}

impl Drop for Beat {
    fn drop(&mut self) {
        if let Some(entry) = self.entry.take() {
            entry.end();
        }
    }
}

impl Entry {
    /// Stops renewing: no renewal is sent after this.
    fn end(&self) {
        self.state.store(ENDED, AtomicOrdering::SeqCst);
        crate::sync::lock(&self.span).take();
        timer::forget(self.id);
    }

    /// Runs `f` in the call's span, if its claim is still renewed (see [`in_span`]).
    fn in_span(&self, f: impl FnOnce()) {
        let span = crate::sync::lock(&self.span).clone();
        match span {
            Some(span) => in_span(&span, f),
            None => f(),
        }
    }

    /// When to look at this claim next: its next renewal, or its deadline if sooner.
    fn next(&self, after: Instant) -> Instant {
        let renewal = after + self.every;
        match self.deadline {
            Some(deadline) if !self.body_ended.load(AtomicOrdering::SeqCst) => {
                renewal.min(deadline)
            }
            _ => renewal,
        }
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
                // After the body, the outcome may have been recorded meanwhile: the
                // call learns from its own write whether the claim was still its.
                let running = self.state.load(AtomicOrdering::SeqCst) == RUNNING;
                if running && !self.body_ended.load(AtomicOrdering::SeqCst) {
                    self.in_span(|| {
                        tracing::warn!(tool = %self.tool, key = %self.key, "idem: the claim was taken over or removed while the body ran; stopping it")
                    });
                }
                self.stop(LOST);
            }
            Err(error) => {
                if self.state.load(AtomicOrdering::SeqCst) == RUNNING {
                    self.in_span(|| {
                        tracing::warn!(tool = %self.tool, key = %self.key, %error, "idem: could not renew the claim; trying again")
                    });
                    timer::tick_at(self.id, Instant::now() + retry_after(self.every));
                }
            }
        }
    }
}

impl Periodic for Entry {
    /// Sends a renewal, or stops the body at its deadline; returns when to look at the
    /// claim next, if ever.
    fn tick(self: Arc<Self>) -> Option<Instant> {
        if self.state.load(AtomicOrdering::SeqCst) != RUNNING {
            return None;
        }
        let now = Instant::now();
        let over = self.deadline.is_some_and(|deadline| now >= deadline);
        if over && !self.body_ended.load(AtomicOrdering::SeqCst) {
            self.in_span(|| {
                tracing::warn!(tool = %self.tool, key = %self.key, max_run = %Human(self.max_run), "idem: the body ran past its max_run; its claim is no longer renewed")
            });
            self.stop(OVER_MAX_RUN);
            return None;
        }
        // One renewal at a time: one still out is waited for, and looked at again soon.
        let sent = self.in_flight.compare_exchange(
            false,
            true,
            AtomicOrdering::SeqCst,
            AtomicOrdering::SeqCst,
        );
        if sent.is_err() {
            return Some(now + retry_after(self.every));
        }
        let flight = InFlight(Arc::clone(&self));
        // Counted before the state is read again, and `Beat::end` reads the count after
        // it ends the state: either this tick sees the end and sends nothing, or the
        // settling sees this renewal in flight and waits for it.
        if self.state.load(AtomicOrdering::SeqCst) != RUNNING {
            return None;
        }
        // A store whose renewals may block runs them on threads of their own, a bounded
        // number at once.
        let blocks = self.store.renewals_block();
        let slot = match blocks.then(|| StoreSlot::take(&self.store)) {
            // This store's renewals are all out (it blocks): this one waits its turn.
            Some(None) => return Some(now + retry_after(self.every)),
            Some(slot) => slot,
            None => None,
        };
        let next = self.next(now);
        let entry = Arc::clone(&self);
        let renewal = async move {
            let renewed = store_op(entry.store.name(), "renew", || {
                entry
                    .store
                    .renew(&entry.key, entry.token, entry.lease, entry.ttl)
            })
            .await;
            // Landed after the call began to settle its claim: it may have revived it.
            let revived = matches!(renewed, Ok(Fenced::Applied))
                && entry.settling.load(AtomicOrdering::SeqCst);
            entry.renewed(renewed);
            if revived {
                entry.give_up_again().await;
            }
            drop((flight, slot));
        };
        let started = match blocks {
            true => background::run_blocking(renewal),
            false => background::spawn(renewal),
        };
        if !started {
            // No thread for it now (a process at its thread limit): tried again soon.
            self.in_span(|| {
                tracing::warn!(tool = %self.tool, key = %self.key, "idem: no thread to renew the claim on; trying again")
            });
            return Some(now + retry_after(self.every));
        }
        Some(next)
    }
}

/// How many renewals of one store whose renewals may block run at once, at most: a store
/// that blocks in its renewals (a custom store doing blocking IO) holds this many
/// threads of idem's blocking pool, not all of them.
pub(crate) const RENEWALS_PER_STORE: usize = 32;

/// A renewal of a store under way, counted against [`RENEWALS_PER_STORE`].
struct StoreSlot(usize);

/// Renewals under way, by store (the address of its `Arc`).
static STORE_SLOTS: Mutex<Option<std::collections::HashMap<usize, usize>>> = Mutex::new(None);

impl StoreSlot {
    /// A slot for a renewal of `store`, if it has one free.
    fn take(store: &Arc<dyn Store>) -> Option<StoreSlot> {
        let id = Arc::as_ptr(store).cast::<()>() as usize;
        let mut slots = crate::sync::lock(&STORE_SLOTS);
        let taken = slots
            .get_or_insert_with(Default::default)
            .entry(id)
            .or_insert(0);
        if *taken >= RENEWALS_PER_STORE {
            return None;
        }
        *taken += 1;
        Some(StoreSlot(id))
    }
}

impl Drop for StoreSlot {
    fn drop(&mut self) {
        let mut slots = crate::sync::lock(&STORE_SLOTS);
        if let Some(slots) = slots.as_mut() {
            if let Some(taken) = slots.get_mut(&self.0) {
                *taken -= 1;
                if *taken == 0 {
                    slots.remove(&self.0);
                }
            }
        }
    }
}

impl Entry {
    /// A renewal landed after the call began to settle its claim (a store slower than
    /// the wait in [`Quiet::before_settling`]): if the call gave the claim up as
    /// abandoned, this renewal made it live again for a lease, so it is given up again
    /// (a zero lease, fenced by the token: on a claim the call released, or has yet to
    /// settle, it changes nothing the settling does not change too).
    async fn give_up_again(&self) {
        let given_up = store_op(self.store.name(), "renew", || {
            self.store
                .renew(&self.key, self.token, Duration::ZERO, self.ttl)
        })
        .await;
        tracing::debug!(tool = %self.tool, key = %self.key, ?given_up, "idem: a renewal landed after its call settled the claim; the claim is given up again");
        crate::wait::notify(&self.key);
    }
}

/// A renewal in flight, until it is answered (or found it had nothing to send).
struct InFlight(Arc<Entry>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.store(false, AtomicOrdering::SeqCst);
        self.0.answered.notify(usize::MAX);
    }
}
