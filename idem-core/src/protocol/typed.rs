//! The typed shim: what the `#[idempotent]` attribute and [`Tool`](crate::Tool) call.
//!
//! A tool's own types meet the protocol here, and only here: its input is serialized
//! into the call ([`Call`]), a stored outcome is decoded into its `Result`, and the
//! outcome its body returns is serialized (and read back) into what the store
//! records. Each of [`execute`], [`execute_finishing`] and [`execute_blocking`] is that
//! glue around the shared parts (claiming, waiting, running the body with its
//! heartbeat, recording, settling), which are compiled once for every tool.

use std::any::Any;
use std::future::Future;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::Serialize;
use tracing::Instrument;

use super::call::Call;
use super::claim::{self, Acquired, Owner};
use super::finish::{self, BoxBody, Ended, Prepared};
use crate::error::Error;
use crate::key_text::Key;
use crate::read_back::{self, Equality};
use crate::run::Run;
use crate::telemetry::{Handover, Report};

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

/// Runs an async operation at most once per key (see the module docs of
/// `protocol`). If the caller stops waiting (drops this future) while the operation
/// runs, the operation is dropped with it and its claim is settled at once by the
/// delivery policy: released (at-least-once) or recorded as outcome-unknown
/// (at-most-once). For an operation that can run on its own, [`execute_finishing`]
/// finishes it instead.
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
    // The hit path, in line and in the call's span. Only a miss makes the states of the
    // rest (the claim, the body, its heartbeat, the record), in a box of their own: a
    // hit's future holds none of them, and moving it copies a few hundred bytes, not
    // the kilobyte and a half they take.
    let handover = {
        let _in_span = call.span().enter();
        let mut hit = Hit::<R, C>::new();
        match claim::look_up(&call, call.report(), &mut hit)? {
            claim::Looked::Hit(report) => return replay_hit(report, hit.decoded),
            // The miss finds its store again, inside its box.
            claim::Looked::Miss(_, report) => report.handover(),
        }
    };
    Box::pin(missed::<R, C, Fut>(call, handover, operation, compare)).await
}

/// The part of [`execute`] after a hit path that found nothing: claims the key
/// (waiting for another call that holds it), then replays what the claim found, or
/// runs the body as the owner.
///
/// A plain `fn` that returns its future: an `async fn` keeps its arguments in its
/// future beside the future it moves them into, and held every miss's call twice.
fn missed<R, C, Fut>(
    call: Call,
    handover: Handover,
    operation: Fut,
    compare: Compare<R::Ok, R::Err>,
) -> impl Future<Output = Result<R, Error>>
where
    R: ToolOutput,
    C: ErrorPolicy<R::Err>,
    Fut: Future<Output = R>,
{
    let span = call.span().clone();
    async move {
        let report = call.resume(handover);
        let acquired = claim::claim_key(&call, report, C::STORED.is_some()).await?;
        let (owner, report) = match replay::<R, C>(&call, acquired, None)? {
            Acquisition::Replay(output) => return Ok(output),
            Acquisition::Owner(owner, report) => (owner, report),
        };
        let mut output = None;
        {
            let body = body::<R, C, Fut>(&call.key, operation, &mut output, compare);
            let body = std::pin::pin!(Some(body));
            finish::own(&call, owner, report, body, std::any::type_name::<R::Err>()).await?;
        }
        ran(output)
    }
    .instrument(span)
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
///
/// The store's hit path runs here, before the returned future is first polled; a miss
/// is one boxed future that is not generic, compiled once for every tool.
pub fn execute_finishing<'a, R, C, Fut>(
    call: impl Into<Checked<R::Ok, R::Err>>,
    operation: impl FnOnce() -> Fut + Send + 'a,
) -> Execution<'a, R>
where
    R: ToolOutput + Send + 'static,
    R::Ok: Send,
    R::Err: Send,
    C: ErrorPolicy<R::Err> + 'static,
    Fut: FinishesAlone<Output = R>,
{
    let Checked { call, compare } = call.into();
    let mut tool = Starting::<R, C, _> {
        decoded: None,
        operation: Some(operation),
        compare,
        policy: std::marker::PhantomData,
    };
    let error_type = std::any::type_name::<R::Err>();
    let state = match finish::start(call, &mut tool, C::STORED.is_some(), error_type) {
        Some(missed) => Stage::Missed(Some(missed)),
        None => Stage::Ready(tool.decoded),
    };
    Execution { state }
}

/// A tool's part of the start of a call of [`execute_finishing`] (see
/// [`Start`](finish::Start)).
struct Starting<R: ToolOutput, C, Op> {
    /// The answer, once the hit path has one.
    decoded: Option<Result<R, Error>>,
    operation: Option<Op>,
    compare: Compare<R::Ok, R::Err>,
    policy: std::marker::PhantomData<fn() -> C>,
}

impl<R: ToolOutput, C: ErrorPolicy<R::Err>, Op> claim::Lend for Starting<R, C, Op> {
    fn lend(&mut self, key: &Key, bytes: &[u8], failed: bool) {
        self.decoded = Some(decode::<R, C>(key, bytes, failed));
    }

    fn fail(&mut self, error: Error) {
        self.decoded = Some(Err(error));
    }
}

impl<'a, R, C, Op, Fut> finish::Start<'a> for Starting<R, C, Op>
where
    R: ToolOutput + Send + 'static,
    R::Ok: Send,
    R::Err: Send,
    C: ErrorPolicy<R::Err> + 'static,
    Op: FnOnce() -> Fut + Send + 'a,
    Fut: FinishesAlone<Output = R>,
{
    fn answered(&self) -> Option<Result<bool, &Error>> {
        let decoded = self.decoded.as_ref()?;
        Some(decoded.as_ref().map(ToolOutput::failed))
    }

    fn glue(&mut self) -> Option<Box<dyn finish::Glue + 'a>> {
        let operation = self.operation.take()?;
        Some(Box::new(Finishes::<R, C, _> {
            operation: Some(operation),
            compare: self.compare,
            policy: std::marker::PhantomData,
        }))
    }
}

/// The future [`execute_finishing`] returns: a call's outcome, replayed from the hit
/// path, or that of its (boxed, shared) miss.
#[must_use = "futures do nothing unless polled"]
pub struct Execution<'a, R> {
    state: Stage<'a, R>,
}

enum Stage<'a, R> {
    /// The hit path's answer, until it is taken.
    Ready(Option<Result<R, Error>>),
    /// The miss, until it ends: its output is an `R`, boxed.
    Missed(Option<finish::Missed<'a>>),
}

// Nothing is pinned in place: the answer is moved out, the miss is boxed.
impl<R> Unpin for Execution<'_, R> {}

impl<R: 'static> Future for Execution<'_, R> {
    type Output = Result<R, Error>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let output = match &mut self.state {
            Stage::Ready(output) => output
                .take()
                .unwrap_or_else(|| Err(finish::polled_after_end())),
            Stage::Missed(missed) => match finish::poll_missed(missed, cx) {
                std::task::Poll::Ready(output) => output.and_then(taken::<R>),
                std::task::Poll::Pending => return std::task::Poll::Pending,
            },
        };
        std::task::Poll::Ready(output)
    }
}

/// A tool's output, as the shared code handed it back.
fn taken<R: 'static>(output: Box<dyn Any + Send>) -> Result<R, Error> {
    match output.downcast::<R>() {
        Ok(output) => Ok(*output),
        Err(_) => Err(not_its_type()),
    }
}

#[cold]
fn not_its_type() -> Error {
    Error::store("idem", "a body's output is not its tool's type")
}

/// A tool's part of a call of [`execute_finishing`] (see [`Glue`](finish::Glue)).
struct Finishes<R: ToolOutput, C, Op> {
    operation: Option<Op>,
    compare: Compare<R::Ok, R::Err>,
    policy: std::marker::PhantomData<fn() -> (R, C)>,
}

impl<R, C, Op, Fut> finish::Glue for Finishes<R, C, Op>
where
    R: ToolOutput + Send + 'static,
    R::Ok: Send,
    R::Err: Send,
    C: ErrorPolicy<R::Err> + 'static,
    Op: FnOnce() -> Fut + Send,
    Fut: FinishesAlone<Output = R>,
{
    fn decode(&self, key: &Key, bytes: &[u8], failed: bool) -> Result<finish::Output, Error> {
        let output = decode::<R, C>(key, bytes, failed)?;
        let failed = output.failed();
        Ok((Box::new(output), failed))
    }

    fn body(&mut self, key: &Key) -> Option<BoxBody> {
        let operation = self.operation.take()?;
        Some(boxed_body::<R, C, Fut>(
            key.clone(),
            operation(),
            self.compare,
        ))
    }
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
    let _span = call.span().enter();
    let _blocking = crate::blocking::InSyncTool::enter();
    let mut hit = Hit::<R, C>::new();
    let acquired = claim::acquire_blocking(&call, call.report(), C::STORED.is_some(), &mut hit)?;
    let (owner, report) = match replay::<R, C>(&call, acquired, hit.decoded)? {
        Acquisition::Replay(output) => return Ok(output),
        Acquisition::Owner(owner, report) => (owner, report),
    };
    let mut output = None;
    let mut operation = Some(operation);
    let key = &call.key;
    let body = &mut || {
        let result = operation.take().map(|operation| operation().into_result());
        result.map(|result| {
            let (prepared, ran) = prepare::<R, C>(key, result, compare);
            output = Some(ran);
            prepared
        })
    };
    finish::own_blocking(&call, owner, report, body, std::any::type_name::<R::Err>())?;
    ran(output)
}

/// A tool's decoder on the hit path: the result a store lends, decoded.
struct Hit<R, C> {
    decoded: Option<Result<R, Error>>,
    policy: std::marker::PhantomData<fn() -> C>,
}

impl<R, C> Hit<R, C> {
    fn new() -> Self {
        Hit {
            decoded: None,
            policy: std::marker::PhantomData,
        }
    }
}

impl<R: ToolOutput, C: ErrorPolicy<R::Err>> claim::Lend for Hit<R, C> {
    fn lend(&mut self, key: &Key, bytes: &[u8], failed: bool) {
        self.decoded = Some(decode::<R, C>(key, bytes, failed));
    }

    fn fail(&mut self, error: Error) {
        self.decoded = Some(Err(error));
    }
}

/// What an acquired key gives the caller: the stored outcome, decoded, or the claim
/// (and the call's report, to go on with).
enum Acquisition<'a, R> {
    Replay(R),
    Owner(Owner, Report<'a>),
}

/// The caller's answer from an acquired key: a stored outcome, decoded (a `hit` the
/// store lent, or bytes the claim found) and reported, or the claim.
fn replay<'a, R, C>(
    call: &Call,
    acquired: Acquired<'a>,
    hit: Option<Result<R, Error>>,
) -> Result<Acquisition<'a, R>, Error>
where
    R: ToolOutput,
    C: ErrorPolicy<R::Err>,
{
    let replayed = match acquired {
        Acquired::Owner(owner, report) => return Ok(Acquisition::Owner(owner, report)),
        Acquired::Hit(report) => replay_hit(report, hit),
        Acquired::Stored {
            report,
            bytes,
            failed,
        } => {
            let mut stored = Hit::<R, C>::new();
            claim::lend_caught(&mut stored, &call.key, &bytes, failed);
            replayed(
                report,
                stored.decoded.unwrap_or_else(|| Err(lent_nothing())),
            )
        }
    };
    replayed.map(Acquisition::Replay)
}

/// A stored result the store lent on the hit path, decoded, reported.
fn replay_hit<R: ToolOutput>(
    report: Report<'_>,
    hit: Option<Result<R, Error>>,
) -> Result<R, Error> {
    replayed(report, hit.unwrap_or_else(|| Err(lent_nothing())))
}

/// A stored outcome, decoded (or the error decoding it gave), reported.
fn replayed<R: ToolOutput>(report: Report<'_>, decoded: Result<R, Error>) -> Result<R, Error> {
    let failed = decoded.as_ref().map(ToolOutput::failed);
    report.replay(failed, std::any::type_name::<R::Err>());
    decoded
}

#[cold]
fn lent_nothing() -> Error {
    Error::store(
        "idem",
        "the store answered a hit without lending its result",
    )
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
    let (prepared, ran) = prepare::<R, C>(key, result, compare);
    *output = Some(ran);
    prepared
}

/// The tool's body, made ready to run on its own: [`body`], boxed, its output handed
/// back with what the store is to record.
fn boxed_body<R, C, Fut>(key: Key, operation: Fut, compare: Compare<R::Ok, R::Err>) -> BoxBody
where
    R: ToolOutput + Send + 'static,
    C: ErrorPolicy<R::Err> + 'static,
    Fut: FinishesAlone<Output = R>,
{
    Box::pin(async move {
        let result = operation.await.into_result();
        let (prepared, output) = prepare::<R, C>(&key, result, compare);
        let output: Box<dyn Any + Send> = Box::new(output);
        Ended { prepared, output }
    })
}

/// What the store is to record of a body's `result`, and the output it makes.
///
/// The read-back check runs here, where the value is at hand (see `read_back.rs`).
fn prepare<R, C>(
    key: &Key,
    result: Result<R::Ok, R::Err>,
    compare: Compare<R::Ok, R::Err>,
) -> (Prepared, R)
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
    (prepared, R::from_result(result))
}

/// The output an owner's body left, once its outcome is settled.
fn ran<R>(output: Option<R>) -> Result<R, Error> {
    output.ok_or_else(no_output)
}

#[cold]
fn no_output() -> Error {
    Error::store("idem", "the body ended without an output")
}

/// A stored outcome, decoded for replay: the tool's result, or (`failed`) its cached
/// error. Not inlined: the hit path and the claim's replay share one copy.
#[inline(never)]
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

/// Converts an idem error into the tool's output (`Err(E::from(error))`); what the
/// attribute returns when idem could not run the operation safely.
pub fn from_idem_error<R>(error: Error) -> R
where
    R: ToolOutput,
    R::Err: From<Error>,
{
    R::from_result(Err(R::Err::from(error)))
}
