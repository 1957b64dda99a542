//! The heartbeat: a running body's claim is renewed every third of its lease, so a live
//! body never loses its key, however long it runs (up to `max_run`); only a dead
//! process's claim runs out.
//!
//! The timer thread ([`crate::timer`]) renews the claims of running bodies itself
//! ([`Beat`]), whatever their task is doing: an async body that blocks its thread, or
//! waits behind another task on a busy current-thread runtime, keeps its claim as a sync
//! body does. A renewal is sent when due, counted from when the last one was sent. It
//! is polled once on the timer thread, where the in-process stores complete it, and a
//! network store's renewal then goes on on the body's runtime (see
//! [`crate::background`]).
//!
//! The heartbeat also tells an async body when to stop ([`drive`]): at `max_run`, or
//! when a renewal found its claim taken over. Every body registers with the timer
//! thread before it first runs (a body may block its thread before it ever waits),
//! which costs a lock and no store round trip; its first renewal is due a third of a
//! lease later, and a body that has ended is forgotten at once. A sync body cannot be
//! stopped from outside: at `max_run` its renewals stop.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use crate::error::Human;
use crate::options::Options;
use crate::record::Token;
use crate::store::{Fenced, Store};
use crate::telemetry::{in_span, store_op};
use crate::timer::{self, Periodic};
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

/// Polls `body` to the end while the timer thread renews its claim; stops it at
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

/// Where a claim the timer thread renews stands.
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

/// A claim renewed by the timer thread while this handle lives.
pub(crate) struct Beat {
    entry: Option<(u64, Arc<Entry>)>,
}

struct Entry {
    /// Its id in the timer thread's table.
    id: u64,
    store: Arc<dyn Store>,
    key: Key,
    tool: Arc<str>,
    /// The call's span while its body runs; let go when it ends, so that a renewal
    /// still in flight does not hold the span open after the call.
    span: Mutex<Option<tracing::Span>>,
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
    /// Starts renewing the claim `lease` describes, on the timer thread.
    pub(crate) fn start(lease: &Lease<'_>) -> Beat {
        let options = lease.options;
        let now = Instant::now();
        static IDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let entry = Arc::new(Entry {
            id: IDS.fetch_add(1, AtomicOrdering::Relaxed),
            store: Arc::clone(lease.store),
            key: lease.key.clone(),
            tool: Arc::clone(lease.tool),
            span: Mutex::new(Some(lease.span.clone())),
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
        if !timer::register(
            entry.id,
            Arc::clone(&entry) as Arc<dyn Periodic>,
            entry.next(now),
        ) {
            return Beat { entry: None };
        }
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
            crate::sync::lock(&entry.span).take();
            timer::forget(id);
        }
    }
}

impl Entry {
    /// Runs `f` in the call's span, if its body still runs (see [`in_span`]).
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
                    self.in_span(|| {
                        tracing::warn!(tool = %self.tool, key = %self.key, "idem: the claim was taken over or removed while the body ran; stopping it")
                    });
                }
                self.stop(LOST);
            }
            Err(error) => {
                self.in_span(|| {
                    tracing::warn!(tool = %self.tool, key = %self.key, %error, "idem: could not renew the claim; trying again")
                });
                timer::tick_at(self.id, Instant::now() + retry_after(self.every));
            }
        }
    }
}

impl Periodic for Entry {
    /// Renews the claim, or stops its body at its deadline; returns when to look at it
    /// next, if ever.
    fn tick(self: Arc<Self>) -> Option<Instant> {
        if self.state.load(AtomicOrdering::SeqCst) != RUNNING {
            return None;
        }
        let now = Instant::now();
        if self.deadline.is_some_and(|deadline| now >= deadline) {
            self.in_span(|| {
                tracing::warn!(tool = %self.tool, key = %self.key, max_run = %Human(self.max_run), "idem: the body ran past its max_run; its claim is no longer renewed")
            });
            self.stop(OVER_MAX_RUN);
            return None;
        }
        let next = self.next(now);
        let runtime = self.runtime.clone();
        background::detach(
            async move {
                let renewing = self
                    .store
                    .renew(&self.key, self.token, self.lease, self.ttl);
                let renewed = store_op(self.store.name(), "renew", renewing).await;
                self.renewed(renewed);
            },
            runtime.as_ref(),
        );
        Some(next)
    }
}
