//! Reconciling an unknown outcome: before an at-most-once call answers
//! [`Error::OutcomeUnknown`](crate::Error::OutcomeUnknown), its tool's reconcile hook
//! asks the downstream system what happened (a provider's lookup by idempotency key),
//! and the answer settles the abandoned claim.
//!
//! [`reconcile`] runs before such a call (the attribute's
//! `#[idempotent(at_most_once, reconcile = check)]`, or [`Tool::reconcile`](crate::Tool)),
//! in substance:
//!
//! ```text
//! for _ in 0..RECONCILE_ROUNDS {
//!     let Some(abandoned) = abandoned(&call).await else { break };   // reads the key
//!     let answer = ask(&call, check(abandoned.key(), &input)).await; // the hook, bounded
//!     if resolve_abandoned(&call, abandoned, answer).await { break } // one fenced write
//! }
//! execute(call, async move { body }).await                           // as without a hook
//! ```
//!
//! The hook has the tool's `reconcile_timeout` to answer (10 seconds by default;
//! [`Options::reconcile_timeout`](crate::Options::reconcile_timeout)): past it, it is
//! dropped where it stands, and its answer counts as unknown (an answer from a hook
//! that blocked its thread past it, too). A value it answers must
//! read back as itself, as a body's result must (see [`crate::read_back`]); one that
//! does not (a NaN, a field its JSON never holds) counts as unknown too, since storing
//! it would give every later call another value, or an error. Either way a warning
//! names the tool and the key.
//!
//! The hook runs before the call claims anything, so a caller that drops the call
//! while the hook runs leaves nothing behind. Its answer settles the abandoned claim
//! through [`Store::resolve`], fenced by the claim's token and its run-out lease: it
//! happened, with this value (the value is recorded, and the call replays it, as every
//! later call does); it never happened (the claim is removed, and the call runs under a
//! fresh claim); or unknown (nothing changes, and the call answers `OutcomeUnknown`). A
//! claim that changed since it was read (another caller settled it first) is left to
//! the call, which finds what is there now.

use std::future::Future;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::{Error, Human, Logged};
use crate::key_text::Key;
use crate::options::Delivery;
use crate::protocol::Call;
use crate::read_back::{self, Equality};
use crate::record::{State, Timestamp, Token};
use crate::store::{Fenced, Resolution, Store};
use crate::telemetry::{in_span, store_op};

/// What a reconcile hook found out downstream about a call whose outcome is unknown
/// (its process stopped, or its caller dropped it, between claiming the key and
/// recording an outcome).
///
/// ```
/// use idem_core::{Key, Reconciled};
/// # struct Charge { amount_cents: u64 }
/// # #[derive(serde::Serialize)] struct Receipt { id: String }
/// # async fn lookup(key: &str) -> Result<Option<Receipt>, std::io::Error> { Ok(None) }
///
/// /// Asks the provider for a charge made under the call's key.
/// async fn check_charge(key: &Key, _input: &Charge) -> Reconciled<Receipt> {
///     match lookup(key.as_str()).await {
///         Ok(Some(receipt)) => Reconciled::Happened(receipt),
///         Ok(None) => Reconciled::NeverHappened,
///         Err(_) => Reconciled::Unknown, // the provider cannot tell now
///     }
/// }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reconciled<T> {
    /// It happened, with this result: the result is recorded and returned, as if the
    /// call had completed.
    Happened(T),
    /// It never happened: the call runs now, under a fresh claim. Answer this only when
    /// the downstream system is sure (a lookup that found nothing, in a system that
    /// records every request before acting on it) **and** the earlier call cannot still
    /// act: a lease that ran out proves only that its owner stopped renewing, and a
    /// process paused past it (SIGSTOP, a frozen VM) that resumes goes on with its body.
    /// So pair it with a downstream that deduplicates by the key the tool forwards
    /// ([`current_key`](crate::current_key)): that late request then changes nothing.
    /// Without one, answer [`Reconciled::Unknown`] rather than guess.
    NeverHappened,
    /// Still unknown: the call answers [`Error::OutcomeUnknown`], as without a hook.
    Unknown,
}

/// An abandoned claim found before a call: what its settling needs.
struct Abandoned {
    store: Arc<dyn Store>,
    key: Key,
    token: Token,
}

impl Abandoned {
    /// The call's key, for the hook.
    fn key(&self) -> &Key {
        &self.key
    }
}

/// The abandoned claim under the call's key, if its tool is at-most-once and the key
/// holds a claim of this input whose lease has run out (by this process's clock).
///
/// A claim whose lease is still running (its process was killed a moment ago, or its
/// body is running) is watched, as the call would wait for it, within the tool's wait:
/// if it completes, or the wait would end first, this is `None` and the call answers as
/// usual; if its lease runs out, it is abandoned. Any other case, a store error
/// included, is `None`: the call goes on and answers as it would without a hook.
async fn abandoned(call: &Result<Call, Error>) -> Option<Abandoned> {
    let call = call.as_ref().ok()?;
    if call.options().delivery != Delivery::AtMostOnce {
        return None;
    }
    let store = call.run().store().ok()?;
    let key = call.key().clone();
    let started = Instant::now();
    let max_wait = call.options().max_wait();
    loop {
        let read = store_op(store.name(), "get", || store.get(&key)).await;
        let record = match read {
            Ok(Some(record)) => record,
            Ok(None) => return None,
            Err(error) => {
                in_span(
                    call.span(),
                    || tracing::debug!(%key, error = %Logged(&error), "idem: could not read the key before reconciling; the call goes on"),
                );
                return None;
            }
        };
        let State::InProgress { token, lease_until } = record.state else {
            return None;
        };
        if record.fingerprint != *call.fingerprint() {
            return None;
        }
        let left = lease_until.remaining(Timestamp::now());
        if left.is_zero() {
            in_span(
                call.span(),
                || tracing::info!(tool = %call.tool(), %key, "idem: an earlier call stopped without an outcome; asking the reconcile hook what happened"),
            );
            return Some(Abandoned { store, key, token });
        }
        // Look again when the lease ends, or sooner, to see a completion early.
        let next = left.min(WATCH_EVERY) + Duration::from_millis(5);
        match max_wait {
            Some(max) if started.elapsed() + next <= max => {}
            // Fail-fast, or the wait would end first: the call answers as usual.
            _ => return None,
        }
        match Instant::now().checked_add(next) {
            Some(at) => crate::timer::sleep_until(at).await,
            None => return None,
        }
    }
}

/// How often a claim whose lease is still running is read again.
const WATCH_EVERY: Duration = Duration::from_millis(250);

/// Awaits a reconcile hook's `answer` for at most the tool's `reconcile_timeout`; past
/// it, the hook is dropped and the answer is [`Reconciled::Unknown`], with a warning.
/// A hook that blocks its thread cannot be stopped: its answer, when it comes after the
/// timeout, is [`Reconciled::Unknown`] all the same. An answer that leaves the outcome
/// unknown, late or not, is said here, once.
async fn ask<T>(
    call: &Result<Call, Error>,
    answer: impl Future<Output = Reconciled<T>>,
) -> Reconciled<T> {
    let Ok(call) = call else {
        return Reconciled::Unknown;
    };
    let timeout = call.options().reconcile_timeout;
    let answered = match Instant::now().checked_add(timeout) {
        None => Some(answer.await),
        Some(deadline) => {
            let mut answer = std::pin::pin!(answer);
            let mut alarm = std::pin::pin!(crate::timer::sleep_until(deadline));
            std::future::poll_fn(|cx| {
                if let Poll::Ready(answer) = answer.as_mut().poll(cx) {
                    // An answer that came too late (a hook that blocked its thread, or
                    // waited behind other tasks) counts as none.
                    return Poll::Ready(Some(answer).filter(|_| Instant::now() <= deadline));
                }
                alarm.as_mut().poll(cx).map(|()| None)
            })
            .await
        }
    };
    let log = |f: &dyn Fn()| in_span(call.span(), f);
    let (tool, key) = (call.tool(), call.key());
    match answered {
        None => log(
            &|| tracing::warn!(%tool, %key, timeout = %Human(timeout), "idem: the reconcile hook did not answer within its reconcile_timeout; the outcome stays unknown"),
        ),
        Some(Reconciled::Unknown) => log(
            &|| tracing::warn!(%tool, %key, "idem: the reconcile hook cannot tell what happened; the outcome stays unknown"),
        ),
        Some(_) => {}
    }
    answered.unwrap_or(Reconciled::Unknown)
}

/// How many times a call looks at its key and asks the reconcile hook before it goes
/// on as without a hook: 20. A round that finds the abandoned claim changed under it
/// (another caller settled it, or the store's clock did not yet see its lease run out)
/// looks again 50 ms later, so the bound is about a second of such rounds, plus the
/// hook's own time in each.
pub const RECONCILE_ROUNDS: usize = 20;

/// Before an at-most-once call: settles an abandoned claim of it by what `hook` finds
/// out downstream (see the module docs), in at most `RECONCILE_ROUNDS` (20) rounds. The
/// call then runs as usual, and finds what is there now.
///
/// `hook` gets the call's key; `eq` compares a value it answers with what its JSON
/// reads back as (the attribute passes the type's `PartialEq` where it has one).
pub async fn reconcile<T, Fut>(
    call: &Result<Call, Error>,
    eq: Equality<T>,
    mut hook: impl FnMut(Key) -> Fut,
) where
    T: Serialize + DeserializeOwned,
    Fut: Future<Output = Reconciled<T>>,
{
    for _ in 0..RECONCILE_ROUNDS {
        let Some(abandoned) = abandoned(call).await else {
            return;
        };
        let answer = ask(call, hook(abandoned.key().clone())).await;
        let Some(answer) = encode(call, &abandoned, answer, eq) else {
            return;
        };
        if resolve_abandoned(call, abandoned, answer).await {
            return;
        }
    }
}

/// A reconcile hook's `answer`, as the tool's value type (`eq`'s): where the attribute
/// says so, so that a hook of another type is an error at the hook.
pub fn hook_answer<T>(eq: Equality<T>, answer: Reconciled<T>) -> Reconciled<T> {
    let _ = eq;
    answer
}

/// A hook's answer, ready for the store.
enum Answer {
    /// It happened, with this result, serialized.
    Happened(Vec<u8>),
    NeverHappened,
}

/// The hook's `answer`, with a value it found serialized and checked to read back as
/// itself; `None` when the outcome stays unknown (said here, or by [`ask`]).
fn encode<T: Serialize + DeserializeOwned>(
    call: &Result<Call, Error>,
    abandoned: &Abandoned,
    answer: Reconciled<T>,
    eq: Equality<T>,
) -> Option<Answer> {
    let call = call.as_ref().ok()?;
    let (tool, key, store) = (call.tool(), &abandoned.key, &abandoned.store);
    let log = |f: &dyn Fn()| in_span(call.span(), f);
    let value = match answer {
        Reconciled::Happened(value) => value,
        Reconciled::NeverHappened => return Some(Answer::NeverHappened),
        // Said so by `ask`.
        Reconciled::Unknown => return None,
    };
    let written = serde_json::to_vec(&value).map_err(|source| Error::Output {
        key: key.clone(),
        source,
    });
    let read_back = |bytes: &[u8]| {
        read_back::reads_back(bytes, &value, eq).map_err(|source| Error::Unreplayable {
            tool: tool.to_owned(),
            key: key.clone(),
            source,
        })
    };
    match written.and_then(|bytes| read_back(&bytes).map(|()| bytes)) {
        Ok(bytes) if bytes.len() <= store.max_result_bytes() => Some(Answer::Happened(bytes)),
        Ok(bytes) => {
            let (len, max) = (bytes.len(), store.max_result_bytes());
            log(
                &|| tracing::warn!(%tool, %key, len, max, "idem: the reconcile hook's result is larger than the store keeps; the outcome stays unknown"),
            );
            None
        }
        Err(error) => {
            log(
                &|| tracing::warn!(%tool, %key, error = %Logged(&error), "idem: the reconcile hook's result cannot be stored so that a retry reads it back as itself; the outcome stays unknown"),
            );
            None
        }
    }
}

/// Settles `abandoned` by the hook's `answer` (see the module docs). Failures are
/// logged, and leave the claim as it was: the call then answers `OutcomeUnknown`.
/// Returns `false` when the claim changed before it could be settled (another caller
/// settled it, or the store's clock did not yet see its lease run out): look again.
async fn resolve_abandoned(
    call: &Result<Call, Error>,
    abandoned: Abandoned,
    answer: Answer,
) -> bool {
    let Ok(call) = call else { return true };
    let Abandoned { store, key, token } = abandoned;
    let log = |f: &dyn Fn()| in_span(call.span(), f);
    let (resolution, what) = match &answer {
        Answer::Happened(bytes) => (
            Resolution::Completed {
                result: bytes,
                ttl: call.options().ttl,
            },
            "it happened; its result is recorded and replayed",
        ),
        Answer::NeverHappened => (Resolution::Released, "it never happened; running it now"),
    };
    match store_op(store.name(), "resolve", || {
        store.resolve(&key, token, resolution)
    })
    .await
    {
        Ok(Fenced::Applied) => log(&|| tracing::info!(%key, "idem: reconciled: {what}")),
        Ok(Fenced::LostLease) => {
            log(
                &|| tracing::debug!(%key, "idem: the abandoned claim changed while it was reconciled; looking again"),
            );
            // A store whose clock is behind this process's sees the lease run out a
            // moment later (see `RECONCILE_ROUNDS`).
            if let Some(at) = Instant::now().checked_add(Duration::from_millis(50)) {
                crate::timer::sleep_until(at).await;
            }
            return false;
        }
        Err(error) => log(
            &|| tracing::warn!(%key, error = %Logged(&error), "idem: could not record the reconciliation; the outcome stays unknown"),
        ),
    }
    true
}
