//! What a call tells the outside: its span, its metrics, and its outcome to a caller
//! that asks ([`observe`]).
//!
//! Every idempotent call runs in one `tracing` span, shaped after the OpenTelemetry
//! GenAI conventions for tool execution, so that `tracing-opentelemetry` exports it
//! under the agent's own span with no setup of idem's:
//!
//! | field | value |
//! |---|---|
//! | span name | `execute_tool` (`otel.name`: `execute_tool {tool}`) |
//! | `gen_ai.operation.name` | `execute_tool` |
//! | `gen_ai.tool.name` | the tool's name |
//! | `gen_ai.tool.call.id` | the run's call id ([`Run::with_call_id`]), if any |
//! | `error.type` | on failure: the idem error's [`Error::kind`], `panic`, `cancelled`, or the tool's own error type |
//! | `otel.status_code` | `ERROR` on failure |
//! | `idem.outcome` | the [`CallOutcome`] (`executed`, `replayed`, ...) |
//! | `idem.store` | the store's [`Store::name`](crate::Store::name) |
//! | `idem.key` | the call's key (it holds no input: a hash of it) |
//! | `idem.wait_seconds` | how long the call waited for another call holding its key |
//!
//! The input and the result are never recorded, in the fields or in idem's events (an
//! error that may quote them is logged without its details: [`Logged`]). idem's own
//! events fire inside the span, those of the heartbeat and of background work too.
//!
//! With the `metrics` feature, the same calls are counted through the `metrics` facade
//! (see `describe_metrics`); labels are the tool, the outcome, the store and the
//! store operation, never the key, so their number stays bounded by the tools'.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tracing::field::Empty;
use tracing::Span;

use crate::error::Error;
use crate::error::Logged;
use crate::key_text::Key;
use crate::protocol::ToolName;
use crate::run::Run;

/// How idem answered an idempotent call: the `idem.outcome` of its span, and the
/// `outcome` label of the `idem_calls_total` metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CallOutcome {
    /// The body ran, as the first call of its key (or a retry after a released claim).
    Executed,
    /// The body did not run: the key's stored outcome was returned.
    Replayed,
    /// The body did not run: the call waited for another call holding its key, then
    /// returned that call's outcome.
    WaitedThenReplayed,
    /// An earlier call's claim ran out (its process died, or stopped renewing it), and
    /// this call took the key over and ran the body (at-least-once).
    TookOver,
    /// The key was first used with another input: [`Error::PayloadMismatch`].
    PayloadMismatch,
    /// An earlier call stopped without an outcome: [`Error::OutcomeUnknown`]
    /// (at-most-once).
    OutcomeUnknown,
    /// Another call held the key past this call's wait: [`Error::InProgress`].
    InProgress,
    /// The store failed (or held a record that does not read back) before the body
    /// ran: [`Error::Store`] and its kin. The body did not run.
    StoreError,
    /// The body ran (or was started), but no outcome of it is recorded: it panicked,
    /// ran past `max_run`, lost its claim, returned a value that cannot be stored, or
    /// the store failed to take its outcome (then the caller has the body's value, and
    /// idem tries again in the background). `error.type` says which.
    NotRecorded,
    /// The caller stopped waiting (dropped the call) before it had an answer, and
    /// nothing went on without it: the call was waiting, or its body (one that cannot
    /// run on alone) was stopped and its claim settled by the delivery policy.
    Cancelled,
    /// idem refused the call before the store: no run, or an input it cannot key
    /// ([`Error::NoRun`], [`Error::Input`]).
    Rejected,
}

impl CallOutcome {
    /// The outcome as written in spans and metric labels: `executed`, `replayed`,
    /// `waited_then_replayed`, `took_over`, `payload_mismatch`, `outcome_unknown`,
    /// `in_progress`, `store_error`, `not_recorded`, `cancelled` or `rejected`.
    pub fn as_str(self) -> &'static str {
        match self {
            CallOutcome::Executed => "executed",
            CallOutcome::Replayed => "replayed",
            CallOutcome::WaitedThenReplayed => "waited_then_replayed",
            CallOutcome::TookOver => "took_over",
            CallOutcome::PayloadMismatch => "payload_mismatch",
            CallOutcome::OutcomeUnknown => "outcome_unknown",
            CallOutcome::InProgress => "in_progress",
            CallOutcome::StoreError => "store_error",
            CallOutcome::NotRecorded => "not_recorded",
            CallOutcome::Cancelled => "cancelled",
            CallOutcome::Rejected => "rejected",
        }
    }

    /// Whether the caller got a stored outcome instead of running the body.
    pub fn replayed(self) -> bool {
        matches!(
            self,
            CallOutcome::Replayed | CallOutcome::WaitedThenReplayed
        )
    }

    /// The outcome of a call that failed with `error` before its body ran.
    fn of_error(error: &Error) -> CallOutcome {
        match error {
            Error::PayloadMismatch { .. } => CallOutcome::PayloadMismatch,
            Error::OutcomeUnknown { .. } => CallOutcome::OutcomeUnknown,
            Error::InProgress { .. } => CallOutcome::InProgress,
            Error::NoRun { .. } | Error::Input { .. } => CallOutcome::Rejected,
            _ => CallOutcome::StoreError,
        }
    }
}

impl std::fmt::Display for CallOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What [`observe`] saw of the first idempotent call made inside it.
#[derive(Debug, Clone)]
pub struct CallReport {
    outcome: CallOutcome,
    tool: Arc<str>,
    key: Key,
    waited: Option<Duration>,
}

impl CallReport {
    /// How the call was answered.
    pub fn outcome(&self) -> CallOutcome {
        self.outcome
    }

    /// Whether the value the call returned was replayed (its body did not run now).
    pub fn replayed(&self) -> bool {
        self.outcome.replayed()
    }

    /// The tool's name.
    pub fn tool(&self) -> &str {
        &self.tool
    }

    /// The call's idempotency key.
    pub fn key(&self) -> &Key {
        &self.key
    }

    /// How long the call waited for another call that held its key, if it waited.
    pub fn waited(&self) -> Option<Duration> {
        self.waited
    }
}

/// Runs `future`, and reports how the first idempotent call made inside it was
/// answered: whether its value was replayed, without changing the tool's signature.
/// `None` if no idempotent call was made (or it was refused before it had a key).
///
/// ```
/// # async fn demo() -> Result<(), idem_core::Error> {
/// # use idem_core::{MemoryStore, Run};
/// # let run = Run::new("run-1").with_store(MemoryStore::new());
/// # async fn send_email(_: &Run) -> Result<String, idem_core::Error> { Ok("id".into()) }
/// let (sent, report) = idem_core::observe(send_email(&run)).await;
/// if report.is_some_and(|call| call.replayed()) {
///     // Tell the agent: this is the earlier call's result, nothing was sent now.
/// }
/// # sent.map(drop) }
/// ```
///
/// The report is of the outermost call: one the first call makes inside its body is
/// not reported. A call that `future` stops waiting for (a timeout, the losing branch
/// of a `select!`) is not reported either: its outcome is not known yet (it may be
/// finishing in the background, and its span will say); a call that answered is, the
/// one beside it or the retry after it. An `observe` inside another reports to both.
pub async fn observe<F: Future>(future: F) -> (F::Output, Option<CallReport>) {
    let (output, report) = OBSERVER
        .scope(Observer::default(), async {
            let output = future.await;
            (output, OBSERVER.with(Observer::take))
        })
        .await;
    (output, pass_up(report))
}

/// [`observe`] for sync code: runs `f`, and reports the first idempotent call made in it.
pub fn observe_sync<T>(f: impl FnOnce() -> T) -> (T, Option<CallReport>) {
    let (output, report) = OBSERVER.sync_scope(Observer::default(), || {
        let output = f();
        (output, OBSERVER.with(Observer::take))
    });
    (output, pass_up(report))
}

/// Gives `report`, of an inner [`observe`] scope, to the enclosing one too, if it has
/// no call of its own yet.
fn pass_up(report: Option<CallReport>) -> Option<CallReport> {
    if let Some(report) = &report {
        let _ = OBSERVER.try_with(|outer| {
            if !outer.taken.replace(true) {
                *outer.report.borrow_mut() = Some(report.clone());
            }
        });
    }
    report
}

/// A call that took the enclosing [`observe`] scope will not report to it (its caller
/// stopped waiting, and it goes on elsewhere): the next call may take it.
pub(crate) fn release_observer(handover: &Handover) {
    if handover.observing == Observing::Took {
        let _ = OBSERVER.try_with(Observer::let_go);
    }
}

/// A call's part in the enclosing [`observe`] scope.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Observing {
    /// No scope.
    No,
    /// It took the scope: it reports to it, or lets it go if its caller stops waiting.
    Took,
    /// Another call had taken the scope when it started (an outer call, or one beside
    /// it): it reports if that call let the scope go by the time it ends, else parks its
    /// report, which stands if that call lets the scope go later.
    Pending,
}

tokio::task_local! {
    static OBSERVER: Observer;
}

/// An [`observe`] scope: whether a call took it, and what that call reported; and the
/// report of the first call that answered while another held the scope, which stands
/// if that one lets the scope go.
#[derive(Default)]
struct Observer {
    taken: Cell<bool>,
    report: RefCell<Option<CallReport>>,
    parked: RefCell<Option<CallReport>>,
}

impl Observer {
    fn take(&self) -> Option<CallReport> {
        self.report.borrow_mut().take()
    }

    /// The call that took the scope will not report to it: a call that answered
    /// meanwhile does, else the next one to start or to answer.
    fn let_go(&self) {
        match self.parked.borrow_mut().take() {
            Some(parked) => *self.report.borrow_mut() = Some(parked),
            None => self.taken.set(false),
        }
    }
}

/// Takes the enclosing [`observe`] scope for this call, if there is one and no call
/// took it yet.
fn take_observer() -> Observing {
    let took = OBSERVER.try_with(|observer| !observer.taken.replace(true));
    match took {
        Err(_) => Observing::No,
        Ok(true) => Observing::Took,
        Ok(false) => Observing::Pending,
    }
}

/// What the protocol learns about a call on its way, for its span and metrics: shared
/// by the call's parts, which may run on other threads (a finishing body).
#[derive(Debug)]
pub(crate) struct Tally {
    span: Span,
    /// What it learned ([`TOOK_OVER`], ...) in the top byte; how long it waited, in
    /// microseconds, below.
    learned: AtomicU64,
}

const FLAGS: u32 = 56;
const WAIT_MASK: u64 = (1 << FLAGS) - 1;
const TOOK_OVER: u8 = 1;
/// It paused for another call's claim (`waited_micros` says how long).
const WAITED: u8 = 2;
const UNRECORDED: u8 = 4;
const PANICKED: u8 = 8;
/// It found its key held by another call.
const BUSY: u8 = 16;

impl Tally {
    /// The tally of a call of `tool` with `key`, and its span (disabled, at no cost,
    /// when no subscriber wants it).
    pub(crate) fn new(tool: &str, key: &Key, run: &Run) -> Tally {
        Tally {
            span: call_span(tool, Some(key), run.call_id()),
            learned: AtomicU64::new(0),
        }
    }

    /// The call's span.
    pub(crate) fn span(&self) -> &Span {
        &self.span
    }

    /// The call found its key held by another call.
    pub(crate) fn busy(&self) {
        self.learn(BUSY);
    }

    /// The call has waited `waited` so far for another call's claim.
    pub(crate) fn waited(&self, waited: Duration) {
        let micros = u64::try_from(waited.as_micros())
            .unwrap_or(u64::MAX)
            .min(WAIT_MASK);
        let learned = |old: u64| Some(old & !WAIT_MASK | micros | u64::from(WAITED) << FLAGS);
        let _ = self
            .learned
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, learned);
    }

    /// The call took over a claim that ran out.
    pub(crate) fn took_over(&self) {
        self.learn(TOOK_OVER);
    }

    /// The body ran, but its outcome is not recorded (the store failed to take it).
    pub(crate) fn unrecorded(&self) {
        self.learn(UNRECORDED);
    }

    /// The body panicked.
    pub(crate) fn panicked(&self) {
        self.learn(PANICKED);
    }

    fn learn(&self, flag: u8) {
        self.learned
            .fetch_or(u64::from(flag) << FLAGS, Ordering::Relaxed);
    }

    fn has(&self, flag: u8) -> bool {
        self.learned.load(Ordering::Relaxed) >> FLAGS & u64::from(flag) != 0
    }

    fn waited_for(&self) -> Option<Duration> {
        let learned = self.learned.load(Ordering::Relaxed);
        (learned >> FLAGS & u64::from(WAITED) != 0)
            .then(|| Duration::from_micros(learned & WAIT_MASK))
    }
}

impl Clone for Tally {
    /// A fresh tally for the same call, in the same span.
    fn clone(&self) -> Tally {
        Tally {
            span: self.span.clone(),
            learned: AtomicU64::new(0),
        }
    }
}

/// The span of a call of `tool` (see the module docs).
fn call_span(tool: &str, key: Option<&Key>, call_id: Option<&str>) -> Span {
    tracing::info_span!(
        "execute_tool",
        otel.name = format_args!("execute_tool {tool}"),
        otel.kind = "internal",
        otel.status_code = Empty,
        gen_ai.operation.name = "execute_tool",
        gen_ai.tool.name = tool,
        gen_ai.tool.call.id = call_id,
        error.type = Empty,
        idem.outcome = Empty,
        idem.store = Empty,
        idem.key = key.map(tracing::field::display),
        idem.wait_seconds = Empty,
    )
}

/// Runs `f` in `span`, with the span's own subscriber as the default: for events about a
/// call that fire on another thread (the heartbeat's, the background's), where the thread's default
/// subscriber may not be the call's.
pub(crate) fn in_span<T>(span: &Span, f: impl FnOnce() -> T) -> T {
    match span.with_subscriber(|(_, dispatch)| dispatch.clone()) {
        Some(dispatch) => tracing::dispatcher::with_default(&dispatch, || span.in_scope(f)),
        None => f(),
    }
}

/// A call under way, which reports its outcome once: to its span, to the metrics, and
/// to an [`observe`] scope that it took. Dropped unreported, it reports that the caller
/// stopped waiting ([`CallOutcome::Cancelled`]), or that the body panicked.
pub(crate) struct Report<'a> {
    tool: &'a ToolName,
    key: &'a Key,
    run: &'a Run,
    tally: &'a Tally,
    observing: Observing,
    done: bool,
}

impl<'a> Report<'a> {
    /// Starts reporting the call.
    pub(crate) fn start(tool: &'a ToolName, key: &'a Key, run: &'a Run, tally: &'a Tally) -> Self {
        Report {
            tool,
            key,
            run,
            tally,
            observing: take_observer(),
            done: false,
        }
    }

    /// Hands the report over to the part of the call that goes on (an owner's call,
    /// which may finish in a task of its own), to [`Report::resume`] there.
    pub(crate) fn handover(mut self) -> Handover {
        self.done = true;
        Handover {
            observing: self.observing,
        }
    }

    /// Goes on with a report handed over.
    pub(crate) fn resume(
        tool: &'a ToolName,
        key: &'a Key,
        run: &'a Run,
        tally: &'a Tally,
        handover: Handover,
    ) -> Self {
        Report {
            tool,
            key,
            run,
            tally,
            observing: handover.observing,
            done: false,
        }
    }

    /// The call returned a stored outcome; `failed` if it is the tool's cached error
    /// (of type `error_type`).
    pub(crate) fn replayed(self, failed: bool, error_type: &'static str) {
        let outcome = if self.tally.has(BUSY) {
            CallOutcome::WaitedThenReplayed
        } else {
            CallOutcome::Replayed
        };
        self.end(outcome, failed.then_some(error_type));
    }

    /// The call's key held a stored outcome: `Ok(failed)`, decoded (the tool's error,
    /// of type `error_type`, if `failed`), or the error decoding it gave.
    pub(crate) fn replay(self, decoded: Result<bool, &Error>, error_type: &'static str) {
        match decoded {
            Ok(failed) => self.replayed(failed, error_type),
            Err(error) => self.refused(error),
        }
    }

    /// The call failed before its body ran.
    pub(crate) fn refused(self, error: &Error) {
        self.end(CallOutcome::of_error(error), Some(error.kind()));
    }

    /// The call's body ran and the call returned `Ok(output)`, where `failed` says
    /// whether the output is the tool's own error (of type `error_type`), or the call
    /// ended with `Err(error)` (the body's outcome was not recorded).
    pub(crate) fn ran(self, ended: Result<bool, &Error>, error_type: &'static str) {
        match ended {
            Err(error) => self.end(CallOutcome::NotRecorded, Some(error.kind())),
            Ok(failed) => {
                let outcome = if self.tally.has(UNRECORDED) {
                    CallOutcome::NotRecorded
                } else if self.tally.has(TOOK_OVER) {
                    CallOutcome::TookOver
                } else {
                    CallOutcome::Executed
                };
                self.end(outcome, failed.then_some(error_type));
            }
        }
    }

    fn end(mut self, outcome: CallOutcome, error_type: Option<&'static str>) {
        self.report(outcome, error_type);
    }

    fn report(&mut self, outcome: CallOutcome, error_type: Option<&'static str>) {
        self.done = true;
        let (tally, waited) = (self.tally, self.tally.waited_for());
        // A disabled span would still look each field up by name.
        let span = &tally.span;
        let store = || self.run.store_name();
        if !span.is_disabled() {
            let store = store();
            span.record("idem.outcome", outcome.as_str());
            span.record("idem.store", store);
            if let Some(waited) = waited {
                span.record("idem.wait_seconds", waited.as_secs_f64());
            }
            if let Some(error_type) = error_type {
                span.record("error.type", error_type);
                span.record("otel.status_code", "ERROR");
            }
        }
        #[cfg(feature = "metrics")]
        metrics::call(self.tool, outcome, store(), waited, tally.has(TOOK_OVER));
        if self.observing == Observing::No {
            return;
        }
        let report = CallReport {
            outcome,
            tool: self.tool.to_shared(),
            key: self.key.clone(),
            waited,
        };
        let observing = self.observing;
        let _ = OBSERVER.try_with(|observer| {
            if observing == Observing::Took || !observer.taken.replace(true) {
                *observer.report.borrow_mut() = Some(report);
            } else {
                observer.parked.borrow_mut().get_or_insert(report);
            }
        });
    }
}

/// A [`Report`] on its way from one part of a call to another.
#[derive(Clone, Copy)]
pub(crate) struct Handover {
    observing: Observing,
}

impl Drop for Report<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // Only the body's own panic: the caller may be unwinding from one of its own.
        if self.tally.has(PANICKED) {
            self.report(CallOutcome::NotRecorded, Some("panic"));
        } else {
            // Its caller stopped waiting: an `observe` around it reports another call.
            if self.observing == Observing::Took {
                let _ = OBSERVER.try_with(Observer::let_go);
                self.observing = Observing::No;
            }
            self.report(CallOutcome::Cancelled, Some("cancelled"));
        }
    }
}

/// Reports a call of `tool` refused before it had a key (no run, an input it cannot
/// key); `call_id` is its run's call id, if it has a run.
pub(crate) fn rejected(tool: &str, call_id: Option<&str>, error: &Error) {
    let span = call_span(tool, None, call_id);
    let _entered = span.enter();
    span.record("idem.outcome", CallOutcome::Rejected.as_str());
    span.record("error.type", error.kind());
    span.record("otel.status_code", "ERROR");
    tracing::warn!(error = %Logged(error), "idem: call refused");
    #[cfg(feature = "metrics")]
    metrics::call(
        &ToolName::copied(tool),
        CallOutcome::Rejected,
        "none",
        None,
        false,
    );
}

/// A store operation, made by `make` and awaited: a panic in the store's code is the
/// store's failure ([`Error::Store`]), never the caller's panic (a store that panics
/// while recording a body's outcome must not make its caller, and then a retry, run the
/// body again). The operation is made here, inside the same guard as its polls: a
/// store method written by hand rather than as an `async fn` may do work, and panic,
/// before it returns its future (and `Store for Arc<S>` hands that call straight on).
/// Timed for the `idem_store_operation_duration_seconds` histogram when the `metrics`
/// feature is on.
pub(crate) async fn store_op<T, F: Future<Output = Result<T, Error>>>(
    store: &'static str,
    name: &'static str,
    make: impl FnOnce() -> F,
) -> Result<T, Error> {
    #[cfg(feature = "metrics")]
    let started = std::time::Instant::now();
    let mut make = Some(make);
    let mut operation = std::pin::pin!(None::<F>);
    let panicked = || {
        tracing::error!(store, operation = name, "idem: the store panicked");
        Err(Error::store(store, format!("the store panicked in {name}")))
    };
    let output = std::future::poll_fn(|cx| {
        let polled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            if let Some(make) = make.take() {
                operation.set(Some(make()));
            }
            // `None` only if making it panicked, which ended the operation already.
            operation
                .as_mut()
                .as_pin_mut()
                .map(|operation| operation.poll(cx))
        }));
        match polled {
            Ok(Some(polled)) => polled,
            Ok(None) | Err(_) => std::task::Poll::Ready(panicked()),
        }
    })
    .await;
    #[cfg(feature = "metrics")]
    metrics::store_op(store, name, started.elapsed());
    output
}

#[cfg(feature = "metrics")]
pub use self::metrics::describe_metrics;

#[cfg(feature = "metrics")]
mod metrics {
    //! idem's metrics, through the `metrics` facade.

    use std::sync::Once;
    use std::time::Duration;

    use metrics::{counter, describe_counter, describe_histogram, histogram, SharedString, Unit};

    use super::{CallOutcome, ToolName};

    pub(super) const CALLS: &str = "idem_calls_total";
    pub(super) const TAKEOVERS: &str = "idem_lease_takeovers_total";
    pub(super) const UNKNOWN: &str = "idem_outcome_unknown_total";
    pub(super) const WAIT: &str = "idem_wait_duration_seconds";
    pub(super) const STORE_OP: &str = "idem_store_operation_duration_seconds";

    /// Describes idem's metrics (names, units, help texts) to the installed recorder.
    ///
    /// idem does this by itself at its first call; call it after installing a recorder
    /// that came later, so that the descriptions reach it too.
    ///
    /// | metric | kind | labels |
    /// |---|---|---|
    /// | `idem_calls_total` | counter | `tool`, `outcome`, `store` |
    /// | `idem_wait_duration_seconds` | histogram | `tool`, `store` |
    /// | `idem_lease_takeovers_total` | counter | `tool`, `store` |
    /// | `idem_outcome_unknown_total` | counter | `tool`, `store` |
    /// | `idem_store_operation_duration_seconds` | histogram | `store`, `operation` |
    pub fn describe_metrics() {
        describe_counter!(
            CALLS,
            Unit::Count,
            "Idempotent tool calls, by tool, outcome (executed, replayed, ...) and store."
        );
        describe_histogram!(
            WAIT,
            Unit::Seconds,
            "Time calls waited for another call holding their key."
        );
        describe_counter!(
            TAKEOVERS,
            Unit::Count,
            "Calls that took over a claim whose owner stopped renewing it (a crash)."
        );
        describe_counter!(
            UNKNOWN,
            Unit::Count,
            "Calls answered OutcomeUnknown: an earlier at-most-once call stopped without an outcome."
        );
        describe_histogram!(
            STORE_OP,
            Unit::Seconds,
            "Latency of store operations (claim, complete, release, renew)."
        );
    }

    static DESCRIBED: Once = Once::new();

    pub(super) fn call(
        tool: &ToolName,
        outcome: CallOutcome,
        store: &'static str,
        waited: Option<Duration>,
        took_over: bool,
    ) {
        DESCRIBED.call_once(describe_metrics);
        // The attribute's name as it is, a dynamic tool's as an `Arc`: no copy either way.
        let tool: SharedString = match tool.as_static() {
            Some(name) => name.into(),
            None => tool.to_shared().into(),
        };
        counter!(CALLS, "tool" => tool.clone(), "outcome" => outcome.as_str(), "store" => store)
            .increment(1);
        if let Some(waited) = waited {
            histogram!(WAIT, "tool" => tool.clone(), "store" => store).record(waited);
        }
        if took_over {
            counter!(TAKEOVERS, "tool" => tool.clone(), "store" => store).increment(1);
        }
        if outcome == CallOutcome::OutcomeUnknown {
            counter!(UNKNOWN, "tool" => tool, "store" => store).increment(1);
        }
    }

    pub(super) fn store_op(store: &'static str, operation: &'static str, took: Duration) {
        histogram!(STORE_OP, "store" => store, "operation" => operation).record(took);
    }
}
