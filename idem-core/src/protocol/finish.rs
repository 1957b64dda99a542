//! The owner's part of a call: its body run with the claim's heartbeat, and its outcome
//! recorded.
//!
//! [`own`] runs an async body, [`own_blocking`] a sync one; both record what it
//! returned ([`finish`]) or settle the claim when it panicked, ran past `max_run` or
//! lost its claim. [`finishing`] runs the owner's part of a body that can run on its
//! own: if its caller stops waiting, it goes on in a task of its own to its end. An
//! outcome the store fails to take is recorded late, in the background
//! ([`record_late`]).
//!
//! Nothing here is generic over a tool's types: a body is polled through its slot
//! ([`own`] is generic over the body's future only for that), and what it returned is
//! already [`Prepared`], bytes to store.

use std::any::Any;
use std::future::Future;
use std::panic::{self, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tracing::Instrument;

use super::call::Call;
use super::claim::{self, Acquired, Owner};
use super::settle::{lost_lease, Settle, Settlement, Settling};
use crate::background;
use crate::error::{Error, Human, Logged};
use crate::heartbeat::{self, Beat, Lease, Ran};
use crate::key_text::Key;
use crate::record::Token;
use crate::run::{Run, CURRENT_KEY};
use crate::store::{Fenced, Outcome, Store};
use crate::telemetry::{self, store_op, Handover, Report};
use crate::wait;

/// What the store is to record of a body that ran to its end.
pub(crate) enum Prepared {
    /// Its result, or (`failed`) its error under an error policy that caches errors;
    /// stored if the bytes read back as the value (`read_back`) and are within the
    /// store's limit.
    Record {
        bytes: Vec<u8>,
        failed: bool,
        read_back: Result<(), serde_json::Error>,
    },
    /// Its error, not cached: the claim is released.
    Release,
    /// Its outcome, which did not serialize.
    Unstorable(Error),
}

impl Prepared {
    /// What to record of an outcome serialized to `bytes`, which `reads_back` checks.
    pub(crate) fn record(
        key: &Key,
        bytes: Result<Vec<u8>, serde_json::Error>,
        failed: bool,
        reads_back: impl FnOnce(&[u8]) -> Result<(), serde_json::Error>,
    ) -> Prepared {
        match bytes {
            Ok(bytes) => Prepared::Record {
                read_back: reads_back(&bytes),
                bytes,
                failed,
            },
            Err(source) => Prepared::Unstorable(Error::Output {
                key: key.clone(),
                source,
            }),
        }
    }
}

/// A tool's body, in the slot its shim keeps it in: polled to its end by [`own`], or
/// stopped (dropped where it stands) when it must not run on.
pub(crate) type BodySlot<'a, F> = Pin<&'a mut Option<F>>;

/// The owner's part: runs the body with its heartbeat, then records its outcome (see
/// [`settle_run`]), and reports how the call ended (`error_type` names the tool's
/// error type). Dropped before the end, it settles the claim (see [`Settle`]).
///
/// Generic over the body only for polling it; what comes after is shared.
pub(crate) async fn own<F: Future<Output = Prepared>>(
    call: &Call,
    owner: Owner,
    report: Report<'_>,
    mut body: BodySlot<'_, F>,
    error_type: &'static str,
) -> Result<(), Error> {
    let guard = Settle::new(call, &owner);
    let ran = {
        let running = std::pin::pin!(CURRENT_KEY.scope(call.key.clone(), Polled(body.as_mut())));
        heartbeat::drive(std::pin::pin!(CatchUnwind(running)), guard.beat()).await
    };
    // The body is dropped before its claim is settled, whatever stopped it.
    if !matches!(ran, Ran::Finished(Ok(_))) {
        CURRENT_KEY.sync_scope(call.key.clone(), || body.set(None));
    }
    // Boxed: the future of every tool's body holds a pointer to it, not its states.
    let settled = Box::pin(settle_run(call, guard, ran)).await;
    ended(report, settled, error_type)
}

/// `result`, the end of an owner's call (`Ok(failed)`: whether its outcome is the
/// tool's error, of type `error_type`), once reported.
fn ended(
    report: Report<'_>,
    result: Result<bool, Error>,
    error_type: &'static str,
) -> Result<(), Error> {
    report.ran(result.as_ref().copied(), error_type);
    result.map(drop)
}

/// Polls the body in its slot; a stopped body has nothing more to give.
struct Polled<'a, F>(BodySlot<'a, F>);

impl<F: Future<Output = Prepared>> Future for Polled<'_, F> {
    type Output = Prepared;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Prepared> {
        match self.0.as_mut().as_pin_mut() {
            Some(body) => body.poll(cx),
            None => Poll::Ready(Prepared::Unstorable(Error::store(
                "idem",
                "a body was polled after it stopped",
            ))),
        }
    }
}

/// How a body's run ended: its prepared outcome, or its panic.
type BodyEnd = Result<Prepared, Box<dyn Any + Send>>;

/// Settles an owner's call after its body's run: records the outcome of a body that
/// finished ([`finish`]), settles the claim of one that panicked (then the panic goes
/// on) or ran past `max_run`, and gives up one whose claim was lost. `Ok(failed)`: the
/// outcome is in, and `failed` says whether it is the tool's error.
async fn settle_run(call: &Call, mut guard: Settle<'_>, ran: Ran<BodyEnd>) -> Result<bool, Error> {
    match ran {
        Ran::Finished(Ok(prepared)) => finish(call, guard, prepared).await,
        Ran::Finished(Err(panic)) => guard.panicked(panic).await,
        Ran::OverMaxRun => {
            tracing::warn!(tool = %call.tool, key = %call.key, max_run = %Human(call.options.max_run), "idem: the body ran past its max_run and was stopped");
            guard.settle("was stopped at its max_run").await;
            Err(Error::MaxRunExceeded {
                key: call.key.clone(),
                max_run: call.options.max_run,
            })
        }
        Ran::Lost => {
            let store = Arc::clone(guard.store);
            guard.disarm();
            Err(Box::pin(lost_lease(call, &*store)).await)
        }
    }
}

/// The owner's part of a sync tool's call: runs `body` (`None` if called twice, which
/// it is not) with the heartbeat renewing its claim, then records its outcome and
/// reports how the call ended.
pub(crate) fn own_blocking(
    call: &Call,
    owner: Owner,
    report: Report<'_>,
    body: &mut dyn FnMut() -> Option<Prepared>,
    error_type: &'static str,
) -> Result<(), Error> {
    let guard = Settle::new(call, &owner);
    let ended = panic::catch_unwind(AssertUnwindSafe(|| {
        CURRENT_KEY.sync_scope(call.key.clone(), &mut *body)
    }));
    let ended = match ended {
        Ok(Some(prepared)) => Ok(prepared),
        Ok(None) => Ok(Prepared::Unstorable(Error::store(
            "idem",
            "a sync body was called twice",
        ))),
        Err(panic) => Err(panic),
    };
    let settled = pollster::block_on(settle_run(call, guard, Ran::Finished(ended)));
    self::ended(report, settled, error_type)
}

/// A future that turns a panic in `F`'s poll into `Err(payload)`.
struct CatchUnwind<F>(F);

impl<F: Future + Unpin> Future for CatchUnwind<F> {
    type Output = Result<F::Output, Box<dyn Any + Send>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let inner = &mut self.0;
        match panic::catch_unwind(AssertUnwindSafe(|| Pin::new(inner).poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(output)) => Poll::Ready(Ok(output)),
            Err(payload) => Poll::Ready(Err(payload)),
        }
    }
}

/// What a body that can run on its own ended with: what to record, and its output,
/// which the shim that made the body takes back.
pub(crate) struct Ended {
    pub(crate) prepared: Prepared,
    pub(crate) output: Box<dyn Any + Send>,
}

/// What a tool's types give the shared code of a call whose body can run on its own
/// ([`miss`]): decoding a stored outcome and making the body. The typed shim implements
/// it for each tool; the rest is compiled once.
pub(crate) trait Glue: Send {
    /// Decodes a stored outcome (the result, or with `failed` a cached error) into the
    /// call's output.
    fn decode(&self, key: &Key, bytes: &[u8], failed: bool) -> Result<Output, Error>;
    /// The body, boxed; `None` if asked twice.
    fn body(&mut self, key: &Key) -> Option<BoxBody>;
}

/// A call's output, boxed (its type is the tool's), and whether it is the tool's error.
pub(crate) type Output = (Box<dyn Any + Send>, bool);

/// The future of a [`miss`]: the call's output, boxed.
pub(crate) type Missed<'a> =
    Pin<Box<dyn Future<Output = Result<Box<dyn Any + Send>, Error>> + Send + 'a>>;

/// A tool's part of the start of a call whose body can run on its own ([`start`]): its
/// decoder on the hit path (see [`Lend`](claim::Lend)), where the answer is kept, and
/// the [`Glue`] of its miss.
pub(crate) trait Start<'a>: claim::Lend {
    /// The answer kept (`Ok(failed)`: whether it is the tool's error), if any.
    fn answered(&self) -> Option<Result<bool, &Error>>;
    /// The glue of the miss; `None` if asked twice.
    fn glue(&mut self) -> Option<Box<dyn Glue + 'a>>;
}

/// Starts a call whose body can run on its own: its hit path, in line, whose answer
/// (replayed, or an error) goes to `tool`; or, on a miss, the [`miss`] to await. Not
/// generic: one copy serves every tool.
pub(crate) fn start<'a>(
    call: Result<Call, Error>,
    tool: &mut dyn Start<'a>,
    caches_errors: bool,
    error_type: &'static str,
) -> Option<Missed<'a>> {
    let call = match call {
        Ok(call) => call,
        Err(error) => {
            tool.fail(error);
            return None;
        }
    };
    // The hit path, in the call's span; the miss enters it on its own.
    let handover = {
        let _in_span = call.span().enter();
        match claim::look_up(&call, call.report(), tool) {
            Err(error) => {
                tool.fail(error);
                return None;
            }
            Ok(claim::Looked::Hit(report)) => {
                if tool.answered().is_none() {
                    tool.fail(Error::store(
                        "idem",
                        "the store answered a hit without lending its result",
                    ));
                }
                if let Some(answered) = tool.answered() {
                    report.replay(answered, error_type);
                }
                return None;
            }
            // The miss finds its store again, inside its box.
            Ok(claim::Looked::Miss(_, report)) => report.handover(),
        }
    };
    let Some(glue) = tool.glue() else {
        tool.fail(Error::store("idem", "a body was asked for twice"));
        return None;
    };
    Some(miss(call, handover, caches_errors, error_type, glue))
}

/// Polls a [`miss`] until it ends, then drops it: polled again, it says so. Not generic.
pub(crate) fn poll_missed(
    missed: &mut Option<Missed<'_>>,
    cx: &mut Context<'_>,
) -> Poll<Result<Box<dyn Any + Send>, Error>> {
    let Some(future) = missed else {
        return Poll::Ready(Err(polled_after_end()));
    };
    let output = std::task::ready!(future.as_mut().poll(cx));
    *missed = None;
    Poll::Ready(output)
}

/// The error of a call polled after it ended.
#[cold]
pub(crate) fn polled_after_end() -> Error {
    Error::store("idem", "a call was polled after it ended")
}

/// A call whose hit path found nothing, whose body can run on its own: claims the key
/// (waiting for another call that holds it), then replays what the claim found, or runs
/// the body ([`finishing`]). Boxed, and not generic: the future of every tool's call
/// holds a pointer to it.
pub(crate) fn miss<'a>(
    call: Call,
    handover: Handover,
    caches_errors: bool,
    error_type: &'static str,
    mut glue: Box<dyn Glue + 'a>,
) -> Missed<'a> {
    let span = call.span().clone();
    Box::pin(
        async move {
            let report = call.resume(handover);
            let (owner, report) = match claim::claim_key(&call, report, caches_errors).await? {
                Acquired::Owner(owner, report) => (owner, report),
                Acquired::Stored {
                    report,
                    bytes,
                    failed,
                } => {
                    // A panic in the type's `Deserialize` is a record that cannot be
                    // read back, as on the hit path (see `claim::lend_caught`).
                    let decoded = panic::catch_unwind(AssertUnwindSafe(|| {
                        glue.decode(&call.key, &bytes, failed)
                    }))
                    .unwrap_or_else(|_| Err(claim::unreadable_panic(&call.key)));
                    report.replay(decoded.as_ref().map(|(_, failed)| *failed), error_type);
                    return decoded.map(|(output, _)| output);
                }
                Acquired::Hit(report) => {
                    let error = Error::store("idem", "a claim answered as a hit");
                    report.refused(&error);
                    return Err(error);
                }
            };
            // The closure that makes the body runs in the key's scope; a panic in it is
            // the body's panic, and settles the claim as one does (see `own`).
            let made = panic::catch_unwind(AssertUnwindSafe(|| {
                CURRENT_KEY.sync_scope(call.key.clone(), || glue.body(&call.key))
            }));
            let body = match made {
                Ok(Some(body)) => body,
                Ok(None) => {
                    let error = Error::store("idem", "a body was asked for twice");
                    report.refused(&error);
                    return Err(error);
                }
                Err(payload) => Box::pin(async move { panic::resume_unwind(payload) }),
            };
            // What the body needed of the glue is in the body now.
            drop(glue);
            let handover = report.handover();
            finishing(call, owner, handover, body, error_type).await
        }
        .instrument(span),
    )
}

/// A body that can run on its own, type-erased: what [`finishing`] runs.
pub(crate) type BoxBody = Pin<Box<dyn Future<Output = Ended> + Send>>;

/// The owner's part of a call whose body can run on its own (see [`own`]): if the
/// caller stops waiting (drops this future) while the body runs, the body goes on in a
/// tokio task to its end, its outcome is recorded as usual, and a retry gets that
/// outcome as soon as it is in. Returns the body's output.
///
/// The task keeps the caller's ambient [`Run`] and `tracing` span; other task-locals of
/// the caller's are not carried over. It runs on the runtime the call started on, even
/// if the call is dropped elsewhere; outside any tokio runtime there is nowhere to
/// finish, and a dropped call is settled as [`own`] settles it.
pub(crate) fn finishing(
    call: Call,
    owner: Owner,
    handover: Handover,
    body: BoxBody,
    error_type: &'static str,
) -> Finishing {
    let key = call.key.clone();
    let ambient = Run::current();
    // The owner's part, in the run's scope: one future, whose arguments are held
    // once (an `async` block around it, or an `async fn` scope, held them twice; the
    // box was 1,840 bytes for a small tool, past the 1,032 that glibc's per-thread
    // cache serves).
    let life: Life = Box::pin(crate::run::in_scope(ambient, async move {
        let report = call.resume(handover);
        let mut output = None;
        let body = async {
            let ended = body.await;
            output = Some(ended.output);
            ended.prepared
        };
        own(&call, owner, report, std::pin::pin!(Some(body)), error_type).await?;
        output.ok_or_else(|| Error::store("idem", "the body ended without an output"))
    }));
    Finishing {
        life: Some(life.instrument(tracing::Span::current())),
        key,
        // Outside any runtime there is nowhere to finish: a dropped call is settled.
        runtime: tokio::runtime::Handle::try_current().ok(),
        handover,
    }
}

/// An owner's call, run by [`finishing`]: finished in a task of its own, on the
/// runtime the call started on, if the caller drops it.
pub(crate) struct Finishing {
    /// The owner's part of the call, until it ends, in the caller's span.
    life: Option<tracing::instrument::Instrumented<Life>>,
    key: Key,
    runtime: Option<tokio::runtime::Handle>,
    /// The call's report, which the owner's part carries on.
    handover: Handover,
}

/// The owner's part of a call, boxed so it can move to a task of its own; its output
/// is the body's.
type Life = Pin<Box<dyn Future<Output = Result<Box<dyn Any + Send>, Error>> + Send>>;

impl Future for Finishing {
    type Output = Result<Box<dyn Any + Send>, Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(life) = self.life.as_mut() else {
            return Poll::Ready(Err(Error::store("idem", "polled after completion")));
        };
        // A panic goes on to the caller; the panicked body must not be finished later.
        let polled = panic::catch_unwind(AssertUnwindSafe(|| Pin::new(life).poll(cx)));
        match polled {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(output)) => {
                self.life = None;
                Poll::Ready(output)
            }
            Err(payload) => {
                self.life = None;
                panic::resume_unwind(payload)
            }
        }
    }
}

impl Drop for Finishing {
    fn drop(&mut self) {
        let Some(life) = self.life.take() else {
            return;
        };
        let Some(runtime) = &self.runtime else {
            // Dropped here, the owner's part settles its claim.
            drop(life);
            return;
        };
        // It reports from its own task, out of the caller's `observe`.
        telemetry::release_observer(&self.handover);
        let span = life.span().clone();
        finish_alone(life, self.key.clone(), runtime, span);
    }
}

/// Finishes, in a task of its own, the owner's part of a call whose caller stopped
/// waiting.
fn finish_alone(
    life: tracing::instrument::Instrumented<Life>,
    key: Key,
    runtime: &tokio::runtime::Handle,
    span: tracing::Span,
) {
    tracing::debug!(parent: &span, %key, "idem: the caller stopped waiting; the body runs on and its outcome will answer the retry");
    // A runtime shutting down drops the task, and with it the body: its claim is
    // then settled as `execute` settles it.
    let finishing = async move {
        match life.await {
            Ok(_) => {
                tracing::debug!(%key, "idem: a body whose caller stopped waiting finished; its outcome is recorded")
            }
            Err(error) => {
                tracing::warn!(%key, error = %Logged(&error), "idem: a body whose caller stopped waiting ended with an error")
            }
        }
    };
    drop(runtime.spawn(finishing.instrument(span)));
}

/// Records the outcome of a body that ran to its end.
///
/// An outcome that cannot be stored so that a retry reads it back (it does not
/// serialize, it is over the store's size limit, or its JSON does not deserialize into
/// its own type) is an error here, at the call that ran, and is not stored: the claim is
/// settled by the delivery policy. An outcome the store fails to record is still the
/// caller's: the body ran, so the caller gets its value, and the record is tried again
/// in the background (see [`record_late`]).
async fn finish(call: &Call, mut guard: Settle<'_>, prepared: Prepared) -> Result<bool, Error> {
    let key = &call.key;
    let store = guard.store;
    let stored = match prepared {
        Prepared::Release => {
            guard.release().await;
            return Ok(true);
        }
        Prepared::Unstorable(error) => Err(error),
        Prepared::Record {
            bytes,
            failed,
            read_back,
        } => within_limit(call, store, bytes).and_then(|bytes| match read_back {
            Ok(()) => Ok((bytes, failed)),
            Err(source) => Err(unreadable(call, source)),
        }),
    };
    let (bytes, failed) = match stored {
        Ok(stored) => stored,
        Err(error) => {
            tracing::warn!(tool = %call.tool, %key, error = %Logged(&error), "idem: the body ran but its outcome cannot be stored");
            guard.settle("ran, but its outcome cannot be stored").await;
            return Err(error);
        }
    };
    // Armed while the completion is out: dropped there, the claim is settled (fenced: a
    // no-op if the completion landed). Its renewals go on meanwhile: a slow completion
    // must not let the lease run out under it.
    guard.beat().body_ended();
    let completed = store_op(store.name(), "complete", || {
        store.complete(key, guard.token, outcome(&bytes, failed), call.options.ttl)
    })
    .await;
    match completed {
        Ok(Fenced::Applied) => {
            guard.disarm();
            wait::notify(key);
            Ok(failed)
        }
        Ok(Fenced::LostLease) => {
            guard.disarm();
            wait::notify(key);
            Err(Box::pin(lost_lease(call, &**store)).await)
        }
        Err(error) => {
            // The body ran: what it returned is the truth, so the caller gets it. The
            // background takes over the claim and its renewals from here.
            tracing::warn!(tool = %call.tool, %key, %error, "idem: the body ran, but the store failed to record its outcome; returning the body's value, and trying to record it again in the background");
            let beat = guard.take_beat();
            guard.disarm();
            call.tally.unrecorded();
            record_late(call, Arc::clone(store), guard.token, beat, bytes, failed);
            Ok(failed)
        }
    }
}

/// A body's stored outcome: its result, or (`failed`) its cached error.
fn outcome(bytes: &[u8], failed: bool) -> Outcome<'_> {
    if failed {
        Outcome::Failed(bytes)
    } else {
        Outcome::Completed(bytes)
    }
}

/// `bytes`, or [`Error::ResultTooLarge`] over the store's limit.
fn within_limit(call: &Call, store: &Arc<dyn Store>, bytes: Vec<u8>) -> Result<Vec<u8>, Error> {
    let limit = store.max_result_bytes();
    if bytes.len() > limit {
        return Err(Error::ResultTooLarge {
            key: call.key.clone(),
            size: bytes.len(),
            limit,
        });
    }
    Ok(bytes)
}

fn unreadable(call: &Call, source: serde_json::Error) -> Error {
    Error::Unreplayable {
        tool: call.tool.to_string(),
        key: call.key.clone(),
        source,
    }
}

/// Delays between the background attempts to record an outcome the store failed to
/// take; the last attempt comes about 6 s after the first failure.
const RECORD_AGAIN: [Duration; 4] = [
    Duration::from_millis(100),
    Duration::from_millis(400),
    Duration::from_millis(1500),
    Duration::from_secs(4),
];

/// Records an outcome the store failed to take, in the background: its bytes are
/// written again (fenced by the claim's token, so never over another owner's record) a
/// few times over some seconds, while `beat` goes on renewing the claim. Until one
/// lands, the key holds the claim, so a retry waits as it would for a running call,
/// and then gets the recorded outcome. If none lands, the claim is settled by the
/// delivery policy (or, with the store still down, runs out after its lease): an
/// at-least-once retry runs the body again, an at-most-once retry gets
/// [`Error::OutcomeUnknown`].
fn record_late(
    call: &Call,
    store: Arc<dyn Store>,
    token: Token,
    beat: Beat,
    bytes: Vec<u8>,
    failed: bool,
) {
    let late = Late {
        claim: Settlement {
            store,
            key: call.key.clone(),
            tool: call.tool.clone(),
            token,
            options: call.options,
            how: Settling::ByPolicy,
        },
        span: call.tally.span().clone(),
        bytes: bytes.into(),
        failed,
    };
    let again = late.clone();
    // In the call's span: it stays open until the outcome is recorded or settled.
    let span = call.tally.span().clone();
    background::detach(
        late.record(beat).instrument(span.clone()),
        // Its runtime shut down: from the start on idem's own, renewed afresh.
        Some(Box::new(move || {
            Box::pin(
                async move {
                    let beat = again.beat();
                    again.record(beat).await
                }
                .instrument(span),
            )
        })),
        tokio::runtime::Handle::try_current().ok().as_ref(),
    );
}

/// An outcome to record late (see [`record_late`]): the claim, settled by the delivery
/// policy if the outcome is never recorded, and the outcome.
#[derive(Clone)]
struct Late {
    claim: Settlement,
    span: tracing::Span,
    bytes: Arc<[u8]>,
    failed: bool,
}

impl Late {
    /// Renewals of the claim, from now.
    fn beat(&self) -> Beat {
        let claim = &self.claim;
        let beat = Beat::start(&Lease {
            store: &claim.store,
            key: &claim.key,
            tool: &claim.tool,
            token: claim.token,
            options: &claim.options,
            span: &self.span,
        });
        beat.body_ended();
        beat
    }

    async fn record(self, beat: Beat) {
        let Settlement {
            store,
            key,
            tool,
            token,
            options,
            ..
        } = &self.claim;
        for delay in RECORD_AGAIN {
            crate::timer::sleep_until(Instant::now() + delay).await;
            let completing =
                || store.complete(key, *token, outcome(&self.bytes, self.failed), options.ttl);
            match store_op(store.name(), "complete", completing).await {
                Ok(Fenced::Applied) => {
                    tracing::info!(%tool, %key, "idem: an outcome the store failed to take is now recorded");
                    wait::notify(key);
                    return;
                }
                Ok(Fenced::LostLease) => {
                    tracing::info!(%tool, %key, "idem: an outcome the store seemed to refuse is not written again: the key no longer holds this call's claim (the first write landed late, or the claim was taken over)");
                    wait::notify(key);
                    return;
                }
                Err(error) => {
                    tracing::debug!(%tool, %key, %error, "idem: recording an outcome again failed")
                }
            }
        }
        let why = "ran, but the store never took its outcome";
        self.claim.after(beat.end(), why).await;
    }
}
