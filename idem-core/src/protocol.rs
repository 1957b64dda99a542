//! The protocol: claim → run → complete (or release), and every answer in between.
//!
//! The `#[idempotent]` attribute turns a tool function into a call of [`execute`] (async
//! tools) or [`execute_blocking`] (sync tools); both can be called by hand too:
//!
//! ```
//! # async fn demo() -> Result<(), idem_core::Error> {
//! use idem_core::{execute, Call, MemoryStore, Options, ReleaseErrors, Run};
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
//! 2. **Run** the operation once, with [`current_key`](crate::current_key) set.
//! 3. `Ok`: **complete** the key with the serialized value (fenced by the token; a
//!    stale owner gets [`Error::LostLease`]). `Err`: **release** the key so a retry runs
//!    again, or, with [`CacheErrors`], store the error for replay.
//!
//! The protocol holds no lock while the operation runs. A call whose future is dropped
//! mid-operation leaves its claim in place until the lease expires, as a crash does.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::options::{Delivery, Options};
use crate::record::{Timestamp, Token};
use crate::run::CURRENT_KEY;
use crate::store::{Claim, ClaimRequest, Fenced, Outcome, Store};
use crate::wait::{self, AsyncPause, BlockingPause, Pause};
use crate::{Error, Fingerprint, Key, KeyParts, Run};

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
    /// Whether errors are stored and replayed.
    const CACHES: bool;
    /// Serializes an error for storage.
    fn encode(key: &Key, error: &E) -> Result<Vec<u8>, Error>;
    /// Deserializes a stored error.
    fn decode(key: &Key, bytes: &[u8]) -> Result<E, Error>;
}

/// The default error policy: an `Err` releases the claim, so a retry runs again.
#[derive(Debug, Clone, Copy)]
pub struct ReleaseErrors;

impl<E> ErrorPolicy<E> for ReleaseErrors {
    const CACHES: bool = false;
    fn encode(key: &Key, _: &E) -> Result<Vec<u8>, Error> {
        Err(Error::Output {
            key: key.to_string(),
            source: serde::ser::Error::custom("errors are not cached by this tool"),
        })
    }
    fn decode(key: &Key, _: &[u8]) -> Result<E, Error> {
        Err(Error::StoredResult {
            key: key.to_string(),
            source: serde::de::Error::custom("errors are not cached by this tool"),
        })
    }
}

/// Opt-in error policy: an `Err` is stored like a result and replayed to retries until
/// the TTL ends (for errors that retrying cannot fix, such as a rejected card).
/// Requires `E: Serialize + DeserializeOwned`.
#[derive(Debug, Clone, Copy)]
pub struct CacheErrors;

impl<E: Replayable> ErrorPolicy<E> for CacheErrors {
    const CACHES: bool = true;
    fn encode(key: &Key, error: &E) -> Result<Vec<u8>, Error> {
        serde_json::to_vec(error).map_err(|source| Error::Output {
            key: key.to_string(),
            source,
        })
    }
    fn decode(key: &Key, bytes: &[u8]) -> Result<E, Error> {
        serde_json::from_slice(bytes).map_err(|source| Error::StoredResult {
            key: key.to_string(),
            source,
        })
    }
}

/// One idempotent call, ready to execute: its run, key and input fingerprint.
#[derive(Debug, Clone)]
pub struct Call {
    run: Run,
    tool: String,
    key: Key,
    fingerprint: Fingerprint,
    options: Options,
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
        let run = match run {
            Some(run) => run.clone(),
            None => Run::current().ok_or_else(|| Error::NoRun {
                tool: tool.to_owned(),
            })?,
        };
        let (fingerprint, key_fingerprint) = fingerprints(&KeyParts {
            tenant: run.tenant(),
            run_id: run.id(),
            call_id: run.call_id(),
            tool,
        })?;
        Ok(Call {
            key: Key::of(tool, &key_fingerprint),
            run,
            tool: tool.to_owned(),
            fingerprint,
            options,
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
}

/// Runs an async operation at most once per key (see the module docs).
///
/// Returns `Ok(output)` with the operation's own output (run now or replayed), or an
/// [`Error`] when idem could not run it safely. `C` is the [`ErrorPolicy`].
pub async fn execute<R, C, Fut>(call: Result<Call, Error>, operation: Fut) -> Result<R, Error>
where
    R: ToolOutput,
    C: ErrorPolicy<R::Err>,
    Fut: Future<Output = R>,
{
    let call = call?;
    let owner = match acquire::<R, C, AsyncPause>(&call).await? {
        Acquired::Replay(output) => return Ok(output),
        Acquired::Owner(owner) => owner,
    };
    let output = CURRENT_KEY.scope(call.key.clone(), operation).await;
    finish::<R, C>(&call, owner, output).await
}

/// Runs a blocking operation at most once per key: [`execute`] for sync tools.
///
/// Store calls block the current thread. The memory and sled stores work anywhere.
/// The Postgres and Redis stores run on tokio: call sync tools that use them from a
/// thread of a multi-threaded tokio runtime (for example inside
/// `tokio::task::spawn_blocking`); elsewhere their operations return
/// [`Error::Store`] instead of blocking forever.
pub fn execute_blocking<R, C, F>(call: Result<Call, Error>, operation: F) -> Result<R, Error>
where
    R: ToolOutput,
    C: ErrorPolicy<R::Err>,
    F: FnOnce() -> R,
{
    let call = call?;
    let _blocking = BlockingGuard::enter();
    pollster::block_on(async {
        let owner = match acquire::<R, C, BlockingPause>(&call).await? {
            Acquired::Replay(output) => return Ok(output),
            Acquired::Owner(owner) => owner,
        };
        let output = CURRENT_KEY.sync_scope(call.key.clone(), operation);
        finish::<R, C>(&call, owner, output).await
    })
}

thread_local! {
    static BLOCKING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks the thread as inside [`execute_blocking`] while it lives.
struct BlockingGuard(bool);

impl BlockingGuard {
    fn enter() -> Self {
        BlockingGuard(BLOCKING.with(|b| b.replace(true)))
    }
}

impl Drop for BlockingGuard {
    fn drop(&mut self) {
        let previous = self.0;
        BLOCKING.with(|b| b.set(previous));
    }
}

#[cfg(any(feature = "postgres", feature = "redis"))]
/// For stores that run on tokio: an error if the current thread is blocked in a sync
/// tool where tokio cannot make progress (no runtime, or a current-thread runtime whose
/// only thread is the blocked one). Waiting there would never end.
pub(crate) fn check_tokio_reachable(store: &'static str) -> Result<(), Error> {
    if !BLOCKING.with(|b| b.get()) {
        return Ok(());
    }
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => Ok(()),
        _ => Err(Error::store(
            store,
            "a sync tool on this store must run on a thread of a multi-threaded tokio runtime \
             (e.g. inside tokio::task::spawn_blocking): here the store could never answer",
        )),
    }
}

struct Owner {
    store: std::sync::Arc<dyn Store>,
    token: Token,
}

enum Acquired<R> {
    Replay(R),
    Owner(Owner),
}

/// First wait between polls of a key held in another process; doubles up to the cap.
const POLL_START: Duration = Duration::from_millis(5);
const POLL_CAP: Duration = Duration::from_millis(100);

async fn acquire<R, C, P>(call: &Call) -> Result<Acquired<R>, Error>
where
    R: ToolOutput,
    C: ErrorPolicy<R::Err>,
    P: Pause,
{
    let store = call.run.store_ref()?;
    let key = &call.key;
    let mut hit = None;
    (**store).with_completed_result(key, &call.fingerprint, &mut |bytes| {
        hit = Some(replay::<R>(key, bytes));
    });
    if let Some(replayed) = hit {
        tracing::debug!(tool = %call.tool, %key, "idem: hit, replaying stored result");
        return replayed;
    }
    let request = ClaimRequest {
        fingerprint: call.fingerprint,
        token: Token::generate()?,
        lease: call.options.lease,
        ttl: call.options.ttl,
        take_over_expired: call.options.delivery == Delivery::AtLeastOnce,
        retry_failed: !C::CACHES,
    };
    let mut started: Option<Instant> = None;
    let mut poll = POLL_START;
    let mut waiting = wait::Waiting::new(key);
    let result = loop {
        // Through `&dyn Store`: the `Arc`'s own `Store` impl would box a second future.
        match (**store).claim(key, &request).await {
            Err(e) => break Err(e),
            Ok(Claim::Acquired { took_over }) => {
                if took_over {
                    tracing::info!(tool = %call.tool, %key, "idem: lease expired, taking over and running again");
                } else {
                    tracing::debug!(tool = %call.tool, %key, "idem: miss, running");
                }
                break Ok(Acquired::Owner(Owner {
                    store: store.into_owned(),
                    token: request.token,
                }));
            }
            Ok(Claim::Completed(bytes)) => {
                tracing::debug!(tool = %call.tool, %key, "idem: hit, replaying stored result");
                break replay::<R>(key, &bytes);
            }
            Ok(Claim::Failed(bytes)) => {
                tracing::debug!(tool = %call.tool, %key, "idem: hit, replaying stored error");
                break C::decode(key, &bytes).map(|e| Acquired::Replay(R::from_result(Err(e))));
            }
            Ok(Claim::Mismatch) => {
                tracing::warn!(tool = %call.tool, %key, "idem: payload mismatch");
                break Err(Error::PayloadMismatch {
                    key: key.to_string(),
                });
            }
            Ok(Claim::Abandoned) => {
                tracing::warn!(tool = %call.tool, %key, "idem: earlier call crashed, outcome unknown (at-most-once)");
                break Err(Error::OutcomeUnknown {
                    key: key.to_string(),
                });
            }
            Ok(Claim::Busy { lease_until }) => {
                let waited = started.get_or_insert_with(Instant::now).elapsed();
                let budget = match call.options.max_wait() {
                    Some(max) if waited < max => max - waited,
                    _ => {
                        tracing::debug!(tool = %call.tool, %key, "idem: in progress elsewhere, not waiting");
                        break Err(Error::InProgress {
                            key: key.to_string(),
                        });
                    }
                };
                // Listen before each claim, so a completion in between is not missed.
                match waiting.relisten() {
                    None => {
                        tracing::debug!(tool = %call.tool, %key, "idem: in progress elsewhere, waiting")
                    }
                    Some(l) => {
                        let until_lease =
                            lease_until.remaining(Timestamp::now()) + Duration::from_millis(1);
                        P::pause(l, poll.min(budget).min(until_lease)).await;
                        poll = (poll * 2).min(POLL_CAP);
                    }
                }
            }
        }
    };
    drop(waiting);
    result
}

/// A stored result, decoded for replay.
fn replay<R: ToolOutput>(key: &Key, bytes: &[u8]) -> Result<Acquired<R>, Error> {
    serde_json::from_slice::<R::Ok>(bytes)
        .map(|value| Acquired::Replay(R::from_result(Ok(value))))
        .map_err(|source| Error::StoredResult {
            key: key.to_string(),
            source,
        })
}

async fn finish<R, C>(call: &Call, owner: Owner, output: R) -> Result<R, Error>
where
    R: ToolOutput,
    C: ErrorPolicy<R::Err>,
{
    let key = &call.key;
    let result = output.into_result();
    let stored = match &result {
        Ok(value) => match serde_json::to_vec(value) {
            Ok(bytes) => Some(bytes),
            Err(source) => {
                return Err(unstorable(
                    call,
                    &owner,
                    Error::Output {
                        key: key.to_string(),
                        source,
                    },
                )
                .await)
            }
        },
        Err(error) if C::CACHES => match C::encode(key, error) {
            Ok(bytes) => Some(bytes),
            Err(e) => return Err(unstorable(call, &owner, e).await),
        },
        Err(_) => None,
    };
    if let Some(bytes) = &stored {
        let limit = owner.store.max_result_bytes();
        if bytes.len() > limit {
            let error = Error::ResultTooLarge {
                key: key.to_string(),
                size: bytes.len(),
                limit,
            };
            return Err(unstorable(call, &owner, error).await);
        }
    }
    let Some(bytes) = stored else {
        tracing::debug!(tool = %call.tool, %key, "idem: operation failed, releasing the key for retries");
        release(call, &owner).await;
        return Ok(R::from_result(result));
    };
    let outcome = match result {
        Ok(_) => Outcome::Completed(&bytes),
        Err(_) => Outcome::Failed(&bytes),
    };
    let fenced = (*owner.store)
        .complete(key, owner.token, outcome, call.options.ttl)
        .await;
    wait::notify(key);
    match fenced? {
        Fenced::Applied => Ok(R::from_result(result)),
        Fenced::LostLease => {
            tracing::warn!(tool = %call.tool, %key, "idem: lease lost while running; result not stored");
            Err(Error::LostLease {
                key: key.to_string(),
            })
        }
    }
}

/// The body ran but its outcome cannot be stored. At-least-once: release the key, so a
/// retry runs again. At-most-once: keep the claim, so a retry after the lease gets
/// `OutcomeUnknown` rather than a second run.
async fn unstorable(call: &Call, owner: &Owner, error: Error) -> Error {
    tracing::warn!(tool = %call.tool, key = %call.key, %error, "idem: the body ran but its outcome cannot be stored");
    if call.options.delivery == Delivery::AtLeastOnce {
        release(call, owner).await;
    }
    error
}

async fn release(call: &Call, owner: &Owner) {
    match (*owner.store).release(&call.key, owner.token).await {
        Ok(Fenced::Applied) => {}
        Ok(Fenced::LostLease) => {
            tracing::debug!(tool = %call.tool, key = %call.key, "idem: release found the key taken over")
        }
        Err(e) => {
            // The claim stays until its lease expires; retries wait for that.
            tracing::warn!(tool = %call.tool, key = %call.key, error = %e, "idem: release failed")
        }
    }
    wait::notify(&call.key);
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

/// An argument that can be part of an idempotency key: any `Serialize` type.
///
/// The attribute passes each argument as `&dyn KeyInput`, so an argument that does not
/// serialize is one compile error, at that argument; and each argument is then written
/// by fully typed code, with one dynamic call per argument.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be part of an idempotency key: it does not implement `serde::Serialize`",
    label = "this argument is hashed into the key",
    note = "derive `Serialize` for it, or, if it is context (a client, a connection) rather than input, list it in `skip = [...]`"
)]
pub trait KeyInput {
    /// Appends the canonical JSON of `self` to `out` (see [`crate::key`]).
    fn write_canonical(&self, out: &mut Vec<u8>) -> Result<(), serde_json::Error>;
}

impl<T: Serialize + ?Sized> KeyInput for T {
    fn write_canonical(&self, out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
        crate::canonical::write(out, self)
    }
}
