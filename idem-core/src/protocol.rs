//! The protocol: claim → run → complete (or release), and every answer in between.
//!
//! The `#[idempotent]` attribute turns a tool function into a call of [`execute`],
//! [`execute_finishing`] (async tools) or [`execute_blocking`] (sync tools). None of
//! this is public API (the attribute reaches it through a hidden module); in substance
//! the generated code does this:
//!
//! ```
//! # async fn demo() -> Result<(), idem_core::Error> {
//! use idem_core::__private::{execute, Call, ReleaseErrors};
//! use idem_core::{MemoryStore, Options, Run};
//!
//! let run = Run::new("run-1").with_store(MemoryStore::new());
//! let to = "ada@example.com";
//! let call = Call::new(Some(&run), "send_email", Options::new(), &to);
//! let sent: Result<String, idem_core::Error> =
//!     execute::<_, ReleaseErrors, _>(call, async { Ok(format!("sent to {to}")) }).await?;
//! assert_eq!(sent?, "sent to ada@example.com");
//! # Ok(()) }
//! ```
//!
//! 1. **Claim** the key. Completed with the same fingerprint: replay the stored value,
//!    the operation does not run (an in-process store answers this case before the
//!    claim, through [`Store::with_completed_result`]). Another fingerprint: [`Error::PayloadMismatch`].
//!    Held by a live lease: wait (bounded; woken in-process, polling otherwise) or fail
//!    fast with [`Error::InProgress`]. Lease expired: take over and run
//!    ([`Delivery::AtLeastOnce`](crate::Delivery)) or [`Error::OutcomeUnknown`]
//!    ([`Delivery::AtMostOnce`](crate::Delivery)).
//! 2. **Run** the operation once, with [`current_key`](crate::current_key) set, renewing
//!    the claim every third of its lease while it runs (the heartbeat), up to `max_run`.
//! 3. `Ok`: **complete** the key with the serialized value (fenced by the token; an
//!    owner whose claim was taken over gets [`Error::LostLease`]). `Err`: **release** the
//!    key so a retry runs again, or, with [`CacheErrors`], store the error for replay.
//!
//! The protocol holds no lock while the operation runs. A call settles its claim
//! whatever happens to it:
//!
//! - dropped by its caller mid-operation: [`execute_finishing`] runs the operation on to
//!   its end in a task of its own; [`execute`] drops it and settles the claim at once;
//! - the operation panics: the claim is settled at once, then the panic goes on;
//! - the operation runs past `max_run`: it is stopped, the claim settled, and the caller
//!   gets [`Error::MaxRunExceeded`].
//!
//! To settle is to follow the delivery policy: at-least-once releases the claim (a
//! retry runs at once), at-most-once gives it up as abandoned (a retry gets
//! [`Error::OutcomeUnknown`] at once). Only a process that dies leaves its claim to run
//! out, one lease after its last renewal.

use std::any::Any;
use std::future::Future;
use std::panic::{self, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::Serialize;
use tracing::Instrument;

use crate::background;
use crate::error::{Human, Logged, LostTo};
use crate::heartbeat::{self, Beat, Lease, Ran};
pub use crate::key::KeyInput;
use crate::key::{Fingerprint, KeyParts};
use crate::options::{Delivery, Options};
use crate::read_back::{self, Equality};
use crate::record::{Timestamp, Token};
use crate::run::CURRENT_KEY;
use crate::store::{Claim, ClaimRequest, Fenced, Outcome, Store};
use crate::telemetry::{self, store_op, Handover, Report, Tally};
use crate::wait::{self, AsyncPause, BlockingPause, Pause};
use crate::{Error, Key, Run};

/// The argument the attribute takes for the call's run: an argument whose type is
/// written `Run` or `&Run` (or `idem::Run`). A type of another crate named `Run` is
/// caught here, with the error saying why.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not idem's `Run`, but `#[idempotent]` took this argument for the call's run because its type is named `Run`",
    label = "taken for the run, since its type is named `Run`",
    note = "to make it an ordinary input (part of the key), write its type by another path (`workflow::Run`) or alias (`use workflow::Run as WorkflowRun;`); idem's run argument is an `idem::Run` or `&idem::Run`"
)]
pub trait RunArgument {
    /// The run.
    fn as_run(&self) -> &Run;
}

impl RunArgument for Run {
    fn as_run(&self) -> &Run {
        self
    }
}

impl<T: RunArgument + ?Sized> RunArgument for &T {
    fn as_run(&self) -> &Run {
        (**self).as_run()
    }
}

/// Where a call's run comes from, for the attribute's `run = expr` option: a `Run`, a
/// `&Run`, an `Arc<Run>` (as context maps such as rig's `ToolContext::scope` hand out),
/// or an `Option` of one (`None`: use the ambient run).
pub trait RunSource {
    /// The run, if this source has one.
    fn run(&self) -> Option<&Run>;
}

impl RunSource for Run {
    fn run(&self) -> Option<&Run> {
        Some(self)
    }
}

impl RunSource for &Run {
    fn run(&self) -> Option<&Run> {
        Some(self)
    }
}

impl RunSource for Option<Run> {
    fn run(&self) -> Option<&Run> {
        self.as_ref()
    }
}

impl RunSource for Option<&Run> {
    fn run(&self) -> Option<&Run> {
        *self
    }
}

impl RunSource for Arc<Run> {
    fn run(&self) -> Option<&Run> {
        Some(self)
    }
}

impl RunSource for Option<Arc<Run>> {
    fn run(&self) -> Option<&Run> {
        self.as_deref()
    }
}

/// What a tool function returns: a `Result` whose `Ok` value idem can store.
#[diagnostic::on_unimplemented(
    message = "an `#[idempotent]` function must return `Result<T, E>`, not `{Self}`",
    label = "idem stores the `Ok` value and replays it; return a `Result`",
    note = "`E` must implement `From<idem::Error>`, or name a conversion with `map_error = ...`"
)]
pub trait ToolOutput: Sized {
    /// The success type, stored and replayed.
    type Ok: Replayable;
    /// The error type.
    type Err;
    /// Splits the output.
    fn into_result(self) -> Result<Self::Ok, Self::Err>;
    /// Rebuilds the output.
    fn from_result(result: Result<Self::Ok, Self::Err>) -> Self;
    /// Whether the output is the tool's error.
    fn failed(&self) -> bool;
}

impl<T: Replayable, E> ToolOutput for Result<T, E> {
    type Ok = T;
    type Err = E;
    fn into_result(self) -> Result<T, E> {
        self
    }
    fn from_result(result: Result<T, E>) -> Self {
        result
    }
    fn failed(&self) -> bool {
        self.is_err()
    }
}

/// A value idem can store and replay: `Serialize + DeserializeOwned`.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be stored and replayed by idem",
    label = "must implement `serde::Serialize` and `serde::de::DeserializeOwned`",
    note = "derive `Serialize` and `Deserialize` for it: idem stores the first call's value and returns it to every retry"
)]
pub trait Replayable: Serialize + DeserializeOwned {}
impl<T: Serialize + DeserializeOwned> Replayable for T {}

/// What happens to a call that returned `Err`: see [`ReleaseErrors`] and [`CacheErrors`].
pub trait ErrorPolicy<E> {
    /// How errors are stored and replayed; `None` for a policy that stores none.
    const STORED: Option<ErrorCodec<E>>;
}

/// How an [`ErrorPolicy`] that caches errors stores them: plain functions, so the
/// protocol's code is shared by every tool, not copied into each.
pub struct ErrorCodec<E> {
    /// Serializes an error for storage.
    pub encode: fn(&E) -> Result<Vec<u8>, serde_json::Error>,
    /// Deserializes a stored error.
    pub decode: fn(&[u8]) -> Result<E, serde_json::Error>,
    /// Checks, before an error is stored, that its bytes read back as the same error
    /// (see `read_back.rs`).
    pub reads_back: ReadsBack<E>,
}

/// Whether bytes read back as a value (see `read_back.rs`).
pub type ReadsBack<E> = fn(&[u8], &E, Equality<E>) -> Result<(), serde_json::Error>;

/// The default error policy: an `Err` releases the claim, so a retry runs again.
#[derive(Debug, Clone, Copy)]
pub struct ReleaseErrors;

impl<E> ErrorPolicy<E> for ReleaseErrors {
    const STORED: Option<ErrorCodec<E>> = None;
}

/// Opt-in error policy: an `Err` is stored like a result and replayed to retries until
/// the TTL ends (for errors that retrying cannot fix, such as a rejected card).
/// Requires `E: Serialize + DeserializeOwned`.
#[derive(Debug, Clone, Copy)]
pub struct CacheErrors;

impl<E: Replayable> ErrorPolicy<E> for CacheErrors {
    const STORED: Option<ErrorCodec<E>> = Some(ErrorCodec {
        encode: serde_json::to_vec::<E>,
        decode: from_json::<E>,
        reads_back: read_back::reads_back::<E>,
    });
}

fn from_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, serde_json::Error> {
    serde_json::from_slice(bytes)
}

/// How a tool's outcomes are compared with the values their JSON reads back as, before
/// they are stored (see `read_back.rs`): its result (`T`), and its error (`E`)
/// where errors are cached.
pub struct Compare<T, E> {
    /// For the result.
    pub ok: Equality<T>,
    /// For a cached error.
    pub err: Equality<E>,
}

impl<T, E> Compare<T, E> {
    /// By JSON only.
    pub const JSON: Self = Compare {
        ok: Equality::JSON,
        err: Equality::JSON,
    };

    /// What the attribute's [`Probe`](crate::__private::Probe) found.
    pub fn new(ok: impl Into<Equality<T>>, err: impl Into<Equality<E>>) -> Self {
        Compare {
            ok: ok.into(),
            err: err.into(),
        }
    }
}

impl<T, E> Clone for Compare<T, E> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T, E> Copy for Compare<T, E> {}

/// A call and how its outcomes are compared when read back: what [`execute`] and its
/// kin take. A bare `Result<Call, Error>` converts into one that compares by JSON
/// only; the attribute passes the tool's `PartialEq` where its types have one.
pub struct Checked<T, E> {
    call: Result<Call, Error>,
    compare: Compare<T, E>,
}

impl<T, E> Checked<T, E> {
    /// `call`, its outcomes compared by `compare`.
    pub fn new(call: Result<Call, Error>, compare: Compare<T, E>) -> Self {
        Checked { call, compare }
    }
}

impl<T, E> From<Result<Call, Error>> for Checked<T, E> {
    fn from(call: Result<Call, Error>) -> Self {
        Checked::new(call, Compare::JSON)
    }
}

/// One idempotent call, ready to execute: its run, key and input fingerprint.
#[derive(Debug, Clone)]
pub struct Call {
    run: Run,
    tool: Arc<str>,
    key: Key,
    fingerprint: Fingerprint,
    options: Options,
    /// Its span, and what the protocol learns on the way (see [`telemetry`]).
    tally: Tally,
}

impl Call {
    /// Prepares a call of `tool` whose key covers the whole `input`.
    ///
    /// `run` is the explicit run, if the tool takes one; otherwise the ambient run
    /// ([`Run::current`]) is used, and without one the call is [`Error::NoRun`].
    pub fn new<I: Serialize + ?Sized>(
        run: Option<&Run>,
        tool: &str,
        options: Options,
        input: &I,
    ) -> Result<Call, Error> {
        Self::build(run, tool, options, |parts| {
            let fingerprint = Fingerprint::of(parts, input)?;
            Ok((fingerprint, fingerprint))
        })
    }

    /// Prepares a call of `tool` whose key covers only `key_input` (a part of `input`).
    /// The fingerprint still covers all of `input`: reusing the key with another input
    /// is an [`Error::PayloadMismatch`].
    pub fn with_key<I: Serialize + ?Sized, K: Serialize + ?Sized>(
        run: Option<&Run>,
        tool: &str,
        options: Options,
        input: &I,
        key_input: &K,
    ) -> Result<Call, Error> {
        Self::build(run, tool, options, |parts| {
            Ok((
                Fingerprint::of(parts, input)?,
                Fingerprint::of(parts, key_input)?,
            ))
        })
    }

    /// Prepares a call from the function's arguments, as the attribute does: `args` are
    /// the arguments (hashed as a JSON array), `key` the ones that form the key, if not
    /// all of them.
    pub fn from_args(
        run: Option<&Run>,
        tool: &str,
        options: Options,
        args: &[&dyn KeyInput],
        key: Option<&[&dyn KeyInput]>,
    ) -> Result<Call, Error> {
        Self::build(run, tool, options, |parts| {
            let fingerprint = Fingerprint::of_args(parts, args)?;
            let key_fingerprint = match key {
                Some(key) => Fingerprint::of_args(parts, key)?,
                None => fingerprint,
            };
            Ok((fingerprint, key_fingerprint))
        })
    }

    /// Resolves the run (the explicit one, else the ambient one), then takes the
    /// fingerprints of the whole input and of the key's input with the call's parts.
    fn build(
        run: Option<&Run>,
        tool: &str,
        options: Options,
        fingerprints: impl FnOnce(&KeyParts<'_>) -> Result<(Fingerprint, Fingerprint), Error>,
    ) -> Result<Call, Error> {
        let run = match run.cloned().or_else(Run::current) {
            // A blank id would make every such caller one run.
            Some(run) if !crate::run::is_blank(run.id()) => run,
            run => {
                let error = Error::NoRun {
                    tool: tool.to_owned(),
                    blank_id: run.as_ref().map(|run| run.id().to_owned()),
                };
                telemetry::rejected(tool, run.as_ref().and_then(Run::call_id), &error);
                return Err(error);
            }
        };
        let parts = KeyParts {
            tenant: run.tenant(),
            run_id: run.id(),
            call_id: run.call_id(),
            tool,
        };
        let (fingerprint, key_fingerprint) = fingerprints(&parts)
            .inspect_err(|error| telemetry::rejected(tool, run.call_id(), error))?;
        let key = Key::of(tool, &key_fingerprint);
        Ok(Call {
            tally: Tally::new(tool, &key, &run),
            key,
            run,
            tool: tool.into(),
            fingerprint,
            options: options.clamped(),
        })
    }

    /// The call's idempotency key.
    pub fn key(&self) -> &Key {
        &self.key
    }

    /// The fingerprint of the call's whole input (with its key parts).
    pub fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }

    pub(crate) fn run(&self) -> &Run {
        &self.run
    }

    pub(crate) fn options(&self) -> &Options {
        &self.options
    }

    pub(crate) fn tool(&self) -> &str {
        &self.tool
    }

    pub(crate) fn span(&self) -> &tracing::Span {
        self.tally.span()
    }
}

// The per-tool part. What follows `execute`, `execute_finishing` and `execute_blocking`
// is generic over the tool (its output `R`, its error policy `C`, its body) only where
// it must be: decoding a stored outcome, serializing a new one, and polling the body.
// The rest (the claim, the wait, the heartbeat's stop, recording and settling) is
// shared code that every tool calls, compiled once.

/// Runs an async operation at most once per key (see the module docs). If the caller
/// stops waiting (drops this future) while the operation runs, the operation is dropped
/// with it and its claim is settled at once by the delivery policy: released
/// (at-least-once) or recorded as outcome-unknown (at-most-once). For an operation that
/// can run on its own, [`execute_finishing`] finishes it instead.
///
/// Returns `Ok(output)` with the operation's own output (run now or replayed), or an
/// [`Error`] when idem could not run it safely. `C` is the [`ErrorPolicy`].
pub async fn execute<R, C, Fut>(
    call: impl Into<Checked<R::Ok, R::Err>>,
    operation: Fut,
) -> Result<R, Error>
where
    R: ToolOutput,
    C: ErrorPolicy<R::Err>,
    Fut: Future<Output = R>,
{
    let Checked { call, compare } = call.into();
    let call = call?;
    let span = call.tally.span().clone();
    async move {
        let report = Report::start(&call.tool, &call.key, &call.run, &call.tally);
        match acquire::<R, C, AsyncPause>(&call, report).await? {
            Acquisition::Replay(output) => Ok(output),
            Acquisition::Owner(owner, report) => {
                run_owned::<R, C, _>(&call, owner, report, operation, compare).await
            }
        }
    }
    .instrument(span)
    .await
}

/// [`execute`] for an operation that can run on its own (`Send + 'static`): if the
/// caller stops waiting (its own timeout, `select!`, an aborted task, a disconnected
/// client) while the operation runs, the operation goes on in a tokio task to its end,
/// its outcome is recorded as usual, and a retry gets that outcome as soon as it is in.
///
/// `operation` makes the operation's future; it is called only when this call owns the
/// key, so a replay makes no copies of what the operation would own.
///
/// The task keeps the caller's ambient [`Run`] and `tracing` span; other task-locals of
/// the caller's are not carried over. It runs on the runtime the call started on, even
/// if the call is dropped elsewhere; outside any tokio runtime there is nowhere to
/// finish, and a dropped call is settled as [`execute`] settles it.
pub async fn execute_finishing<R, C, Fut>(
    call: impl Into<Checked<R::Ok, R::Err>>,
    operation: impl FnOnce() -> Fut,
) -> Result<R, Error>
where
    R: ToolOutput + Send + 'static,
    R::Ok: Send,
    R::Err: Send,
    C: ErrorPolicy<R::Err> + 'static,
    Fut: FinishesAlone<Output = R>,
{
    let Checked { call, compare } = call.into();
    let call = call?;
    let span = call.tally.span().clone();
    async move {
        let report = Report::start(&call.tool, &call.key, &call.run, &call.tally);
        let (owner, handover) = match acquire::<R, C, AsyncPause>(&call, report).await? {
            Acquisition::Replay(output) => return Ok(output),
            Acquisition::Owner(owner, report) => (owner, report.handover()),
        };
        let key = call.key.clone();
        let ambient = Run::current();
        let operation = operation();
        // The owner's part is made inside its box, on first poll: not built on the stack
        // and copied in (it is large, and a miss pays for every copy).
        let life: Life<R> = Box::pin(async move {
            let owned = execute_owned::<R, C, _>(call, owner, handover, operation, compare);
            crate::run::in_scope(ambient, owned).await
        });
        // Outside any runtime there is nowhere to finish: a dropped call is settled.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return life.await;
        };
        Finishing {
            life: Some(life.instrument(tracing::Span::current())),
            key,
            runtime,
            handover,
        }
        .await
    }
    .instrument(span)
    .await
}

/// The owner's part of [`execute_finishing`], owning all it needs.
async fn execute_owned<R, C, Fut>(
    call: Call,
    owner: Owner,
    handover: Handover,
    operation: Fut,
    compare: Compare<R::Ok, R::Err>,
) -> Result<R, Error>
where
    R: ToolOutput,
    C: ErrorPolicy<R::Err>,
    Fut: Future<Output = R>,
{
    let report = Report::resume(&call.tool, &call.key, &call.run, &call.tally, handover);
    run_owned::<R, C, _>(&call, owner, report, operation, compare).await
}

/// The owner's part of a call: runs the body (see [`own`]) and reports how it ended.
async fn run_owned<R, C, Fut>(
    call: &Call,
    owner: Owner,
    report: Report<'_>,
    operation: Fut,
    compare: Compare<R::Ok, R::Err>,
) -> Result<R, Error>
where
    R: ToolOutput,
    C: ErrorPolicy<R::Err>,
    Fut: Future<Output = R>,
{
    let mut output = None;
    let owned = {
        let body = body::<R, C, _>(&call.key, operation, &mut output, compare);
        let body = std::pin::pin!(Some(body));
        own(call, &owner, body).await
    };
    ended(report, owned.and_then(|()| ran(output)))
}

/// `result`, the end of an owner's call, once reported.
fn ended<R: ToolOutput>(report: Report<'_>, result: Result<R, Error>) -> Result<R, Error> {
    let failed = result.as_ref().map(ToolOutput::failed);
    report.ran(failed, std::any::type_name::<R::Err>());
    result
}

/// A body that can go on in a task of its own after its caller stops waiting: `Send`
/// and `'static`.
///
/// The attribute finishes an async tool whose body owns what it uses when its caller
/// stops waiting (a timeout, `select!`, an aborted task), so that body must be `Send`. A
/// compile error naming this bound means the body holds something that is not `Send`
/// (an `Rc`, a `RefCell` borrow, a `MutexGuard` of `std`) across an `.await`: keep it
/// out of the `.await`s, or write `on_cancel = "abort"` to settle the call's claim when
/// its caller stops waiting instead.
pub trait FinishesAlone: Future + Send + 'static {}
impl<F: Future + Send + 'static> FinishesAlone for F {}

/// An owner's call, run by [`execute_finishing`]: finished in a task of its own, on the
/// runtime the call started on, if the caller drops it.
struct Finishing<R: Send + 'static> {
    /// The owner's part of the call, until it ends, in the caller's span.
    life: Option<tracing::instrument::Instrumented<Life<R>>>,
    key: Key,
    runtime: tokio::runtime::Handle,
    /// The call's report, which the owner's part carries on.
    handover: Handover,
}

/// The owner's part of a call ([`execute_owned`]), boxed so it can move to a task of
/// its own.
type Life<R> = Pin<Box<dyn Future<Output = Result<R, Error>> + Send>>;

impl<R: Send + 'static> Future for Finishing<R> {
    type Output = Result<R, Error>;

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

impl<R: Send + 'static> Drop for Finishing<R> {
    fn drop(&mut self) {
        let Some(life) = self.life.take() else {
            return;
        };
        // It reports from its own task, out of the caller's `observe`.
        telemetry::release_observer(&self.handover);
        let span = life.span().clone();
        // The tool's output type goes here, so the task is the same for every tool.
        let life = Box::pin(async move { life.await.map(drop) });
        finish_alone(life, self.key.clone(), &self.runtime, span);
    }
}

/// Finishes, in a task of its own, the owner's part of a call whose caller stopped
/// waiting.
fn finish_alone(
    life: Pin<Box<dyn Future<Output = Result<(), Error>> + Send>>,
    key: Key,
    runtime: &tokio::runtime::Handle,
    span: tracing::Span,
) {
    tracing::debug!(parent: &span, %key, "idem: the caller stopped waiting; the body runs on and its outcome will answer the retry");
    // A runtime shutting down drops the task, and with it the body: its claim is
    // then settled as `execute` settles it.
    let finishing = async move {
        match life.await {
            Ok(()) => {
                tracing::debug!(%key, "idem: a body whose caller stopped waiting finished; its outcome is recorded")
            }
            Err(error) => {
                tracing::warn!(%key, error = %Logged(&error), "idem: a body whose caller stopped waiting ended with an error")
            }
        }
    };
    drop(runtime.spawn(finishing.instrument(span)));
}

/// Runs a blocking operation at most once per key: [`execute`] for sync tools. Its claim
/// is renewed by the heartbeat while it runs (a sync body cannot be stopped, so
/// at `max_run` the renewals stop, and a takeover after the lease fences its result). A
/// panic in the operation settles the claim by the delivery policy, then goes on.
///
/// Store calls block the current thread. The memory and sled stores work anywhere.
/// The Postgres and Redis stores run on tokio: call sync tools that use them inside
/// `tokio::task::spawn_blocking`, on a runtime of either flavor. Called on a thread
/// that drives tokio itself (a current-thread runtime's own thread), their operations
/// cannot be answered, and return [`Error::Store`] after the store's timeout instead
/// of blocking forever; with no runtime at all, at once.
pub fn execute_blocking<R, C, F>(
    call: impl Into<Checked<R::Ok, R::Err>>,
    operation: F,
) -> Result<R, Error>
where
    R: ToolOutput,
    C: ErrorPolicy<R::Err>,
    F: FnOnce() -> R,
{
    let Checked { call, compare } = call.into();
    let call = call?;
    let _span = call.tally.span().enter();
    let _blocking = crate::blocking::InSyncTool::enter();
    let report = Report::start(&call.tool, &call.key, &call.run, &call.tally);
    let (owner, report) = match pollster::block_on(acquire::<R, C, BlockingPause>(&call, report))? {
        Acquisition::Replay(output) => return Ok(output),
        Acquisition::Owner(owner, report) => (owner, report),
    };
    let mut output = None;
    let mut operation = Some(operation);
    let key = &call.key;
    let owned = own_blocking(&call, &owner, &mut || {
        let result = operation.take().map(|operation| operation().into_result());
        result.map(|result| prepare::<R, C>(key, result, &mut output, compare))
    });
    ended(report, owned.and_then(|()| ran(output)))
}

/// The tool's body, made ready for the shared code: runs `operation`, leaves its output
/// in `output`, and says what the store is to record.
async fn body<R, C, Fut>(
    key: &Key,
    operation: Fut,
    output: &mut Option<R>,
    compare: Compare<R::Ok, R::Err>,
) -> Prepared
where
    R: ToolOutput,
    C: ErrorPolicy<R::Err>,
    Fut: Future<Output = R>,
{
    let result = operation.await.into_result();
    prepare::<R, C>(key, result, output, compare)
}

/// What the store is to record of a body's `result`, which is left in `output`.
///
/// The read-back check runs here, where the value is at hand (see [`crate::read_back`]).
fn prepare<R, C>(
    key: &Key,
    result: Result<R::Ok, R::Err>,
    output: &mut Option<R>,
    compare: Compare<R::Ok, R::Err>,
) -> Prepared
where
    R: ToolOutput,
    C: ErrorPolicy<R::Err>,
{
    let prepared = match (&result, C::STORED) {
        (Ok(value), _) => Prepared::record(key, serde_json::to_vec(value), false, |bytes| {
            read_back::reads_back(bytes, value, compare.ok)
        }),
        (Err(error), Some(codec)) => Prepared::record(key, (codec.encode)(error), true, |bytes| {
            (codec.reads_back)(bytes, error, compare.err)
        }),
        (Err(_), None) => Prepared::Release,
    };
    *output = Some(R::from_result(result));
    prepared
}

/// The output an owner's body left, once its outcome is settled.
fn ran<R>(output: Option<R>) -> Result<R, Error> {
    output.ok_or_else(|| Error::store("idem", "the body ended without an output"))
}

/// A stored outcome, decoded for replay: the tool's result, or (`failed`) its cached
/// error.
fn decode<R, C>(key: &Key, bytes: &[u8], failed: bool) -> Result<R, Error>
where
    R: ToolOutput,
    C: ErrorPolicy<R::Err>,
{
    let decoded = match (failed, C::STORED) {
        (false, _) => serde_json::from_slice::<R::Ok>(bytes).map(Ok),
        (true, Some(codec)) => (codec.decode)(bytes).map(Err),
        (true, None) => Err(serde::de::Error::custom(
            "the store answered with a cached error for a tool that caches none",
        )),
    };
    decoded
        .map(R::from_result)
        .map_err(|source| Error::StoredResult {
            key: key.clone(),
            source,
        })
}

/// Acquires the call's key for a tool whose output is `R`: decodes a stored outcome to
/// replay, or claims the key (see [`claim`]).
///
/// Reports a call that ends here (a replay, or an error); an owner carries its
/// `report` on.
async fn acquire<'a, R, C, P>(
    call: &'a Call,
    report: Report<'a>,
) -> Result<Acquisition<'a, R>, Error>
where
    R: ToolOutput,
    C: ErrorPolicy<R::Err>,
    P: Pause,
{
    let claimed = match call.run.store_ref() {
        Ok(store) => {
            if let Some(replayed) = hit::<R, C>(call, &**store) {
                return replay(report, replayed);
            }
            claim::<P>(call, store, C::STORED.is_some()).await
        }
        Err(error) => Err(error),
    };
    match claimed {
        Ok(Claimed::Owner(owner)) => Ok(Acquisition::Owner(owner, report)),
        Ok(Claimed::Stored { bytes, failed }) => {
            replay(report, decode::<R, C>(&call.key, &bytes, failed))
        }
        Err(error) => {
            report.refused(&error);
            Err(error)
        }
    }
}

/// A stored outcome, decoded for the caller (or the error decoding it gave), reported.
fn replay<'a, R: ToolOutput>(
    report: Report<'a>,
    replayed: Result<R, Error>,
) -> Result<Acquisition<'a, R>, Error> {
    match replayed {
        Ok(output) => {
            report.replayed(output.failed(), std::any::type_name::<R::Err>());
            Ok(Acquisition::Replay(output))
        }
        Err(error) => {
            report.refused(&error);
            Err(error)
        }
    }
}

/// The hit path: a store that can tell at once that the key completed for this input
/// answers without a claim, lending the stored result to the decoder.
fn hit<R, C>(call: &Call, store: &dyn Store) -> Option<Result<R, Error>>
where
    R: ToolOutput,
    C: ErrorPolicy<R::Err>,
{
    let mut hit = None;
    let looked_up = lookup(call, store, &mut |bytes| {
        hit = Some(decode::<R, C>(&call.key, bytes, false));
    });
    match looked_up {
        Ok(()) => hit,
        Err(error) => Some(Err(error)),
    }
}

/// The store's lookup on the hit path, lending a stored result to `replay`; shared by
/// every tool. A panic in it (the store's code, or the result's `Deserialize`) is the
/// store's failure, never the caller's panic.
fn lookup(call: &Call, store: &dyn Store, replay: &mut dyn FnMut(&[u8])) -> Result<(), Error> {
    let mut replayed = false;
    let looked_up = panic::catch_unwind(AssertUnwindSafe(|| {
        store.with_completed_result(&call.key, &call.fingerprint, &mut |bytes| {
            replayed = true;
            replay(bytes);
        })
    }));
    if looked_up.is_err() {
        let why = "a panic in the lookup (the store's code, or the result's `Deserialize`)";
        return Err(Error::store(store.name(), why));
    }
    if replayed {
        tracing::debug!(tool = %call.tool, key = %call.key, "idem: hit, replaying stored result");
    }
    Ok(())
}

/// What an acquired key gives the caller: the stored outcome, or the claim (and the
/// call's report, to go on with).
enum Acquisition<'a, R> {
    Replay(R),
    Owner(Owner, Report<'a>),
}

// The shared part, compiled once.

/// What the store is to record of a body that ran to its end.
enum Prepared {
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
    fn record(
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

/// The claim this call acquired.
struct Owner {
    store: Arc<dyn Store>,
    token: Token,
}

impl Owner {
    fn lease<'a>(&'a self, call: &'a Call) -> Lease<'a> {
        Lease {
            store: &self.store,
            key: &call.key,
            tool: &call.tool,
            token: self.token,
            options: &call.options,
            span: call.tally.span(),
        }
    }
}

/// First wait between polls of a key held in another process; doubles up to the cap.
const POLL_START: Duration = Duration::from_millis(5);
const POLL_CAP: Duration = Duration::from_millis(100);
/// How long a call waits for another's claim before it says so at `info`.
const NOTICEABLE_WAIT: Duration = Duration::from_secs(1);

/// What a decided claim gives the call: the key, or a stored outcome to decode.
enum Claimed {
    Owner(Owner),
    Stored { bytes: Vec<u8>, failed: bool },
}

/// Claims the call's key until the claim is decided (see [`claim_loop`]);
/// `caches_errors` says whether the tool's errors are stored and replayed.
async fn claim<P: Pause>(
    call: &Call,
    store: std::borrow::Cow<'_, Arc<dyn Store>>,
    caches_errors: bool,
) -> Result<Claimed, Error> {
    let request = ClaimRequest {
        origin: call.run.origin(&call.tool),
        fingerprint: call.fingerprint,
        token: Token::generate()?,
        lease: call.options.lease,
        ttl: call.options.ttl,
        take_over_expired: call.options.delivery == Delivery::AtLeastOnce,
        retry_failed: !caches_errors,
    };
    Ok(match claim_loop::<P>(call, &store, &request).await? {
        Some(stored) => stored,
        None => Claimed::Owner(Owner {
            store: store.into_owned(),
            token: request.token,
        }),
    })
}

/// Claims the key until the claim is decided: `Ok(None)` when this call owns it now,
/// `Ok(Some(stored))` to replay, or the error the claim found. A busy key is waited
/// for ([`Waiting`]).
///
/// A claim whose answer never came may still be applied, and must not leave the key
/// held by nobody. No body ran under it, so it is released whatever the delivery
/// policy, once it is known to have landed (a release sent first would overtake it on
/// another connection, find nothing, and let it land after): a call dropped while its
/// claim is out finishes the claim in the background, then releases it if it acquired
/// the key; a claim the store gave up on (its timeout) is released then, and once more
/// [`LATE_CLAIM`] later, by when a request still in flight has landed or failed.
async fn claim_loop<P: Pause>(
    call: &Call,
    store: &Arc<dyn Store>,
    request: &ClaimRequest,
) -> Result<Option<Claimed>, Error> {
    let key = &call.key;
    let mut waiting = Waiting::new(call);
    loop {
        let claim = match (Claiming {
            claim: Some(claim_owned(store, key, request.clone())),
            call,
            store,
            token: request.token,
        })
        .await
        {
            Ok(claim) => claim,
            Err(error) => {
                release_late_claim(call, store, request.token);
                return Err(error);
            }
        };
        match claim {
            Claim::Busy { .. } => {}
            _ => waiting.done(),
        }
        match claim {
            Claim::Acquired { took_over } => {
                if took_over {
                    call.tally.took_over();
                    tracing::info!(tool = %call.tool, %key, "idem: an earlier claim ran out (its owner stopped renewing it); taking over and running again");
                } else {
                    tracing::debug!(tool = %call.tool, %key, "idem: miss, running");
                }
                return Ok(None);
            }
            Claim::Completed(bytes) => {
                tracing::debug!(tool = %call.tool, %key, "idem: hit, replaying stored result");
                return Ok(Some(Claimed::Stored {
                    bytes,
                    failed: false,
                }));
            }
            Claim::Failed(bytes) => {
                tracing::debug!(tool = %call.tool, %key, "idem: hit, replaying stored error");
                return Ok(Some(Claimed::Stored {
                    bytes,
                    failed: true,
                }));
            }
            Claim::Mismatch => {
                tracing::warn!(tool = %call.tool, %key, "idem: payload mismatch");
                return Err(Error::PayloadMismatch { key: key.clone() });
            }
            Claim::Abandoned { expires_at } => {
                tracing::warn!(tool = %call.tool, %key, "idem: an earlier call stopped without an outcome; it is unknown (at-most-once)");
                return Err(Error::OutcomeUnknown {
                    key: key.clone(),
                    expires_in: expires_at.remaining(Timestamp::now()),
                });
            }
            Claim::Busy { lease_until } => waiting.pause::<P>(lease_until).await?,
        }
    }
}

/// How long after a claim the store gave up on it is released a second time.
const LATE_CLAIM: Duration = Duration::from_secs(10);

/// A claim request that owns what it needs, so it can finish without its caller.
type ClaimFuture = Pin<Box<dyn Future<Output = Result<Claim, Error>> + Send>>;

fn claim_owned(store: &Arc<dyn Store>, key: &Key, request: ClaimRequest) -> ClaimFuture {
    let (store, key) = (Arc::clone(store), key.clone());
    Box::pin(async move { store_op(store.name(), "claim", store.claim(&key, &request)).await })
}

/// A claim request under way; dropped before its answer, it finishes in the
/// background and releases the key if it acquired it.
struct Claiming<'a> {
    claim: Option<ClaimFuture>,
    call: &'a Call,
    store: &'a Arc<dyn Store>,
    token: Token,
}

impl Future for Claiming<'_> {
    type Output = Result<Claim, Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(claim) = self.claim.as_mut() else {
            return Poll::Ready(Err(Error::store("idem", "polled after completion")));
        };
        // A store that panics is a store that failed (see `store_op`): the body has not
        // run.
        let answer = std::task::ready!(claim.as_mut().poll(cx));
        self.claim = None;
        Poll::Ready(answer)
    }
}

impl Drop for Claiming<'_> {
    fn drop(&mut self) {
        let Some(claim) = self.claim.take() else {
            return;
        };
        let release = Settlement::release(self.call, self.store, self.token);
        let again = release.clone();
        let why = "was dropped while its claim was out";
        // Not in the call's span: a claim that never answers would hold it open.
        background::detach(
            async move {
                match claim.await {
                    Ok(Claim::Acquired { .. }) => release.now(why).await,
                    Ok(_) => {}
                    Err(_) => release.twice(why, tracing::Span::none()).await,
                }
            },
            // Its runtime shut down with the claim still out: it may have landed.
            Some(Box::new(move || {
                Box::pin(again.twice(why, tracing::Span::none()))
            })),
            tokio::runtime::Handle::try_current().ok().as_ref(),
        );
    }
}

/// Releases a claim the store gave up on, in the background (see [`claim_loop`]).
fn release_late_claim(call: &Call, store: &Arc<dyn Store>, token: Token) {
    let release = Settlement::release(call, store, token);
    let again = release.clone();
    let span = call.tally.span().clone();
    let why = "got no answer to its claim";
    background::detach(
        release.twice(why, span),
        // Not in the call's span: holding it for the operation's ten seconds would
        // keep the call's span open.
        Some(Box::new(move || {
            Box::pin(again.twice(why, tracing::Span::none()))
        })),
        tokio::runtime::Handle::try_current().ok().as_ref(),
    );
}

/// A call waiting for another call's claim on its key.
struct Waiting<'a> {
    call: &'a Call,
    started: Option<Instant>,
    /// Whether it slept at all (a call told at once that the key is busy did not).
    paused: bool,
    poll: Duration,
    said_so: bool,
    listening: wait::Waiting<'a>,
}

impl<'a> Waiting<'a> {
    fn new(call: &'a Call) -> Self {
        Waiting {
            call,
            started: None,
            paused: false,
            poll: POLL_START,
            said_so: false,
            listening: wait::Waiting::new(&call.key),
        }
    }

    /// The wait is over: the call's tally learns how long it took, if it waited.
    fn done(&mut self) {
        if let Some(started) = self.started.take() {
            if self.paused {
                self.call.tally.waited(started.elapsed());
            }
        }
    }

    /// Waits a little for the claim held until `lease_until` (woken at once by an owner
    /// in this process), or returns [`Error::InProgress`] when the call may wait no more.
    async fn pause<P: Pause>(&mut self, lease_until: Timestamp) -> Result<(), Error> {
        let (call, key) = (self.call, &self.call.key);
        call.tally.busy();
        let waited = self.started.get_or_insert_with(Instant::now).elapsed();
        let lease_left = lease_until.remaining(Timestamp::now());
        let budget = match call.options.max_wait() {
            Some(max) if waited < max => max - waited,
            _ => {
                self.done();
                tracing::debug!(tool = %call.tool, %key, "idem: in progress elsewhere, not waiting longer");
                return Err(Error::InProgress {
                    key: key.clone(),
                    lease_left,
                    waited,
                });
            }
        };
        if waited >= NOTICEABLE_WAIT && !self.said_so {
            self.said_so = true;
            tracing::info!(
                tool = %call.tool,
                %key,
                waited = %Human(waited),
                claim_expires_in = %Human(lease_left),
                "idem: waiting for another call that holds this key; this call gets its \
                 result when it finishes (its claim expires unless its owner renews it)"
            );
        }
        // Listen before each claim, so a completion in between is not missed.
        match self.listening.relisten() {
            None => {
                tracing::debug!(tool = %call.tool, %key, "idem: in progress elsewhere, waiting")
            }
            Some(listener) => {
                let until_lease = lease_left + Duration::from_millis(1);
                self.paused = true;
                P::pause(listener, self.poll.min(budget).min(until_lease)).await;
                self.poll = (self.poll * 2).min(POLL_CAP);
            }
        }
        Ok(())
    }
}

impl Drop for Waiting<'_> {
    /// A call dropped while it waited still tells how long it waited.
    fn drop(&mut self) {
        self.done();
    }
}

/// A tool's body, in the slot its shim keeps it in: polled to its end by [`own`], or
/// stopped (dropped where it stands) when it must not run on.
type BodySlot<'a, F> = Pin<&'a mut Option<F>>;

/// The owner's part: runs the body with its heartbeat, then records its outcome (see
/// [`settle_run`]). Dropped before the end, it settles the claim (see [`Settle`]).
///
/// Generic over the body only for polling it; what comes after is shared.
async fn own<F: Future<Output = Prepared>>(
    call: &Call,
    owner: &Owner,
    mut body: BodySlot<'_, F>,
) -> Result<(), Error> {
    let guard = Settle::new(call, owner);
    let ran = {
        let running = std::pin::pin!(CURRENT_KEY.scope(call.key.clone(), Polled(body.as_mut())));
        heartbeat::drive(std::pin::pin!(CatchUnwind(running)), guard.beat()).await
    };
    // The body is dropped before its claim is settled, whatever stopped it.
    if !matches!(ran, Ran::Finished(Ok(_))) {
        CURRENT_KEY.sync_scope(call.key.clone(), || body.set(None));
    }
    settle_run(call, guard, ran).await
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
/// on) or ran past `max_run`, and gives up one whose claim was lost.
async fn settle_run(call: &Call, mut guard: Settle<'_>, ran: Ran<BodyEnd>) -> Result<(), Error> {
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
/// it is not) with the heartbeat renewing its claim, then records its outcome.
fn own_blocking(
    call: &Call,
    owner: &Owner,
    body: &mut dyn FnMut() -> Option<Prepared>,
) -> Result<(), Error> {
    let guard = Settle::new(call, owner);
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
    pollster::block_on(settle_run(call, guard, Ran::Finished(ended)))
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

/// How a claim left without an outcome is settled.
#[derive(Clone, Copy, Debug)]
enum Settling {
    /// Released, whatever the policy: no body ran under it, or the body failed
    /// (returned `Err`, which releases the key).
    Release,
    /// By the delivery policy: at-least-once releases it, so a retry runs at once;
    /// at-most-once gives it up as abandoned (a zero-lease renewal), so a retry gets
    /// [`Error::OutcomeUnknown`] at once.
    ByPolicy,
}

/// The owner's duty to settle its claim, and the claim's heartbeat, from the body's
/// start until the outcome is recorded (see [`crate::heartbeat`]).
///
/// Armed until the call recorded an outcome or its own settling write has landed;
/// dropped armed (the caller stopped waiting, a panic unwound through the protocol,
/// the call was dropped while its own settling write was out), it settles the claim in
/// the background, at once, by the delivery policy (see [`crate::background`]: on the
/// runtime it is dropped in, or on idem's own when that one is shutting down or there
/// is none). Either way no caller in a live process waits out a lease, and waiters in
/// this process are woken.
struct Settle<'a> {
    call: &'a Call,
    store: &'a Arc<dyn Store>,
    token: Token,
    /// The claim's renewals, until it is settled.
    beat: Beat,
    /// How to settle if dropped; `None` once there is nothing to settle.
    settling: Option<Settling>,
}

impl<'a> Settle<'a> {
    /// The duty for `owner`'s claim, whose renewals start now.
    fn new(call: &'a Call, owner: &'a Owner) -> Self {
        Settle {
            call,
            store: &owner.store,
            token: owner.token,
            beat: Beat::start(&owner.lease(call)),
            settling: Some(Settling::ByPolicy),
        }
    }

    /// The claim's heartbeat, which the body is driven by.
    fn beat(&self) -> &Beat {
        &self.beat
    }

    /// The claim's renewals, taken out of the guard (to go on with a late record).
    fn take_beat(&mut self) -> Beat {
        std::mem::replace(&mut self.beat, Beat::none())
    }

    /// Nothing is left to settle: the outcome is recorded, or the claim is not this
    /// call's any more. Its renewals stop.
    fn disarm(&mut self) {
        drop(self.take_beat());
        self.settling = None;
    }

    /// Settles the claim now; stays armed until that has landed. Its renewals stop
    /// first, and one in flight is waited for.
    ///
    /// Boxed: a path off the hit and the miss, kept out of the size of their futures
    /// (which every poll of a finishing call moves).
    async fn settle_now(&mut self, how: Settling, why: &str) {
        self.settling = Some(how);
        let (beat, call) = (self.take_beat(), self.call);
        let (store, token) = (&**self.store, self.token);
        Box::pin(async move {
            beat.before_settling().await;
            let options = &call.options;
            settle(store, &call.key, &call.tool, token, options, how, why).await
        })
        .await;
        self.settling = None;
    }

    /// Settles the claim now, by the delivery policy.
    async fn settle(mut self, why: &str) {
        self.settle_now(Settling::ByPolicy, why).await;
    }

    /// Releases the claim now (a failed call, whatever the delivery policy).
    async fn release(mut self) {
        self.settle_now(Settling::Release, "failed; its key is released for retries")
            .await;
    }

    /// The body panicked: settles the claim, then lets the panic go on, unchanged.
    async fn panicked<T>(self, payload: Box<dyn Any + Send>) -> T {
        self.call.tally.panicked();
        tracing::error!(tool = %self.call.tool, key = %self.call.key, "idem: the body panicked; settling its claim");
        self.settle("panicked").await;
        panic::resume_unwind(payload)
    }
}

impl Drop for Settle<'_> {
    fn drop(&mut self) {
        let Some(how) = self.settling else {
            return;
        };
        // Its renewals stop here; one in flight is waited for before settling.
        let quiet = self.take_beat().end();
        let settling = Settlement {
            store: Arc::clone(self.store),
            key: self.call.key.clone(),
            tool: self.call.tool.clone(),
            token: self.token,
            options: self.call.options,
            how,
        };
        let again = settling.clone();
        let (quiet_again, span) = (quiet.clone(), self.call.tally.span().clone());
        let why = "was dropped before recording an outcome";
        background::detach(
            settling.after(quiet, why).instrument(span.clone()),
            Some(Box::new(move || {
                Box::pin(again.after(quiet_again, why).instrument(span))
            })),
            tokio::runtime::Handle::try_current().ok().as_ref(),
        );
    }
}

/// A claim to settle, owning what that needs.
#[derive(Clone)]
struct Settlement {
    store: Arc<dyn Store>,
    key: Key,
    tool: Arc<str>,
    token: Token,
    options: Options,
    how: Settling,
}

impl Settlement {
    /// A release of `token`'s claim on `call`'s key.
    fn release(call: &Call, store: &Arc<dyn Store>, token: Token) -> Self {
        Settlement {
            store: Arc::clone(store),
            key: call.key.clone(),
            tool: call.tool.clone(),
            token,
            options: call.options,
            how: Settling::Release,
        }
    }

    /// Settles the claim now.
    async fn now(&self, why: &str) {
        let Settlement {
            store,
            key,
            tool,
            token,
            options,
            how,
        } = self;
        settle(&**store, key, tool, *token, options, *how, why).await
    }

    /// Settles the claim, once no renewal of it is in flight (`quiet`).
    async fn after(self, quiet: heartbeat::Quiet, why: &'static str) {
        quiet.before_settling().await;
        self.now(why).await
    }

    /// Settles the claim now (in the call's `span`) and again [`LATE_CLAIM`] later
    /// (fenced: a no-op on anyone else's claim; by then the call's span has ended): for
    /// a claim request whose answer never came, which may land late.
    async fn twice(self, why: &'static str, span: tracing::Span) {
        self.now(why).instrument(span).await;
        crate::timer::sleep_until(Instant::now() + LATE_CLAIM).await;
        self.now(why).await;
    }
}

/// Delays between the background attempts to settle a claim the store failed to
/// settle at once (a connection that went with a runtime that shut down, a blip).
const SETTLE_AGAIN: [Duration; 3] = [
    Duration::from_millis(50),
    Duration::from_millis(250),
    Duration::from_secs(1),
];

/// Settles a claim left without an outcome (see [`Settling`]). A store that fails to is
/// asked again a few times, for about a second and a half (every write that settles a
/// claim is fenced by its token, so a second one changes nothing); after that the
/// claim holds until its lease runs out.
async fn settle(
    store: &dyn Store,
    key: &Key,
    tool: &str,
    token: Token,
    options: &Options,
    how: Settling,
    why: &str,
) {
    let release = matches!(how, Settling::Release) || options.delivery == Delivery::AtLeastOnce;
    let outcome = if release {
        "released: a retry runs again"
    } else {
        "recorded as outcome unknown (at-most-once)"
    };
    let mut again = SETTLE_AGAIN.iter();
    let settled = loop {
        let settled = if release {
            store_op(store.name(), "release", store.release(key, token)).await
        } else {
            let renewing = store.renew(key, token, Duration::ZERO, options.ttl);
            store_op(store.name(), "renew", renewing).await
        };
        match (settled, again.next()) {
            (Err(error), Some(delay)) => {
                tracing::debug!(%tool, %key, %error, "idem: settling a claim failed; trying again");
                crate::timer::sleep_until(Instant::now() + *delay).await;
            }
            (settled, _) => break settled,
        }
    };
    match settled {
        Ok(Fenced::Applied) => {
            tracing::info!(%tool, %key, "idem: a call {why}; its claim was {outcome}")
        }
        Ok(Fenced::LostLease) => {
            tracing::debug!(%tool, %key, "idem: a call {why}; the key held no claim of its own")
        }
        Err(error) => {
            tracing::warn!(%tool, %key, %error, "idem: a call {why}, and its claim could not be settled; it holds until its lease runs out")
        }
    }
    wait::notify(key);
}

/// The error of a call whose claim was lost, saying what holds its key now: another
/// call (whose outcome a retry receives), or nothing (the record was removed: a retry
/// runs the body again). Called boxed, off the miss's future.
async fn lost_lease(call: &Call, store: &dyn Store) -> Error {
    let key = &call.key;
    let lost_to = match store_op(store.name(), "get", store.get(key)).await {
        Ok(Some(_)) => LostTo::AnotherCall,
        Ok(None) => LostTo::Removal,
        Err(_) => LostTo::Unknown,
    };
    tracing::warn!(tool = %call.tool, %key, %lost_to, "idem: the claim was lost while the body ran; result not stored");
    Error::LostLease {
        key: key.clone(),
        lost_to,
    }
}

/// Records the outcome of a body that ran to its end.
///
/// An outcome that cannot be stored so that a retry reads it back (it does not
/// serialize, it is over the store's size limit, or its JSON does not deserialize into
/// its own type) is an error here, at the call that ran, and is not stored: the claim is
/// settled by the delivery policy. An outcome the store fails to record is still the
/// caller's: the body ran, so the caller gets its value, and the record is tried again
/// in the background (see [`record_late`]).
async fn finish(call: &Call, mut guard: Settle<'_>, prepared: Prepared) -> Result<(), Error> {
    let key = &call.key;
    let store = guard.store;
    let stored = match prepared {
        Prepared::Release => {
            guard.release().await;
            return Ok(());
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
    let completed = store_op(
        store.name(),
        "complete",
        store.complete(key, guard.token, outcome(&bytes, failed), call.options.ttl),
    )
    .await;
    match completed {
        Ok(Fenced::Applied) => {
            guard.disarm();
            wait::notify(key);
            Ok(())
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
            Ok(())
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
            let outcome = outcome(&self.bytes, self.failed);
            let completing = store.complete(key, *token, outcome, options.ttl);
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

/// Converts an idem error into the tool's output (`Err(E::from(error))`); what the
/// attribute returns when idem could not run the operation safely.
pub fn from_idem_error<R>(error: Error) -> R
where
    R: ToolOutput,
    R::Err: From<Error>,
{
    R::from_result(Err(R::Err::from(error)))
}
