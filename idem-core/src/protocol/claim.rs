//! Claiming a call's key, and waiting for another call that holds it.
//!
//! A call is answered before its body may run in two steps: [`look_up`], the hit path,
//! takes a result the store lends at once (no claim); when it finds none, [`claim_key`]
//! claims the key and gives a stored outcome the claim found, or the claim itself
//! ([`Owner`]). A key another call holds is waited for ([`Waiting`]); a claim whose
//! answer never came is released once it has landed.

use std::borrow::Cow;
use std::future::Future;
use std::panic::{self, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use super::call::Call;
use super::settle::Settlement;
use crate::background;
use crate::error::{Error, Human};
use crate::heartbeat::Lease;
use crate::key_text::Key;
use crate::options::Delivery;
use crate::record::{Timestamp, Token};
use crate::store::{Claim, ClaimRequest, Store};
use crate::telemetry::{store_op, Report};
use crate::wait::{self, AsyncPause, BlockingPause, Pause};

/// The claim this call acquired.
pub(crate) struct Owner {
    pub(super) store: Arc<dyn Store>,
    pub(super) token: Token,
}

impl Owner {
    pub(super) fn lease<'a>(&'a self, call: &'a Call) -> Lease<'a> {
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

/// What a call's key gave it.
pub(crate) enum Acquired<'a> {
    /// The store lent its completed result at once, and the hit path's decoder has it.
    Hit(Report<'a>),
    /// A stored outcome the claim found, to decode: the tool's result, or (`failed`)
    /// its cached error.
    Stored {
        report: Report<'a>,
        bytes: Vec<u8>,
        failed: bool,
    },
    /// The claim: this call runs the body.
    Owner(Owner, Report<'a>),
}

/// Where a store lends a completed result on the hit path: the tool's decoder. A trait
/// of one method, so each tool's decoder is one function, not a closure's shims.
pub(crate) trait Lend {
    /// Decodes the outcome stored for `key`: its result, or (`failed`) a cached error.
    fn lend(&mut self, key: &Key, bytes: &[u8], failed: bool);
    /// Keeps `error` as the call's answer.
    fn fail(&mut self, error: Error);
}

/// [`Lend::lend`], with a panic in the type's `Deserialize` made the answer
/// [`Error::StoredResult`]: a record that cannot be read back, never the caller's
/// panic. Not generic: one copy serves every tool.
pub(crate) fn lend_caught(to: &mut dyn Lend, key: &Key, bytes: &[u8], failed: bool) {
    if panic::catch_unwind(AssertUnwindSafe(|| to.lend(key, bytes, failed))).is_err() {
        to.fail(unreadable_panic(key));
    }
}

/// The error of a stored outcome whose type's `Deserialize` panicked.
#[cold]
pub(crate) fn unreadable_panic(key: &Key) -> Error {
    Error::StoredResult {
        key: key.clone(),
        source: serde::de::Error::custom("its type's `Deserialize` panicked"),
    }
}

/// What the hit path found (see [`look_up`]).
pub(crate) enum Looked<'a> {
    /// The store lent its completed result to the decoder.
    Hit(Report<'a>),
    /// Nothing to replay at once: the call claims its key, in this store.
    Miss(Cow<'a, Arc<dyn Store>>, Report<'a>),
}

/// The hit path (see the module docs), which runs in line, before anything is awaited.
/// A result the store lends goes to `hit` before this returns (`hit` is not held by
/// the call's future, so a decoder that is not `Send` leaves that future `Send`). An
/// error is reported here.
pub(crate) fn look_up<'a>(
    call: &'a Call,
    report: Report<'a>,
    hit: &mut dyn Lend,
) -> Result<Looked<'a>, Error> {
    let store = match call.run.store_ref() {
        Ok(store) => store,
        Err(error) => return refused(report, error),
    };
    match lookup(call, &**store, hit) {
        Ok(true) => Ok(Looked::Hit(report)),
        Ok(false) => Ok(Looked::Miss(store, report)),
        Err(error) => refused(report, error),
    }
}

/// The claim (see the module docs), for a call whose hit path found nothing. Boxed:
/// its states are the largest of a miss's, and inside the miss's own box they put it
/// past the 1,032 bytes glibc's per-thread cache serves (a larger block is found, and
/// freed, in the arena's bins on every miss; see `tests/miss_allocations.rs`).
pub(crate) fn claim_key<'a>(
    call: &'a Call,
    report: Report<'a>,
    caches_errors: bool,
) -> Pin<Box<impl Future<Output = Result<Acquired<'a>, Error>> + 'a>> {
    Box::pin(claim_key_in_line(call, report, caches_errors))
}

/// [`claim_key`]'s future.
async fn claim_key_in_line<'a>(
    call: &'a Call,
    report: Report<'a>,
    caches_errors: bool,
) -> Result<Acquired<'a>, Error> {
    let store = match call.run.store_ref() {
        Ok(store) => store,
        Err(error) => return refused(report, error),
    };
    claimed::<AsyncPause>(call, store, report, caches_errors).await
}

/// [`look_up`], then [`claim_key`], for a sync tool, whose waits block its thread.
pub(crate) fn acquire_blocking<'a>(
    call: &'a Call,
    report: Report<'a>,
    caches_errors: bool,
    hit: &mut dyn Lend,
) -> Result<Acquired<'a>, Error> {
    match look_up(call, report, hit)? {
        Looked::Hit(report) => Ok(Acquired::Hit(report)),
        Looked::Miss(store, report) => {
            pollster::block_on(claimed::<BlockingPause>(call, store, report, caches_errors))
        }
    }
}

/// Claims the key (see [`claim`]), and says what the claim found.
async fn claimed<'a, P: Pause>(
    call: &'a Call,
    store: Cow<'a, Arc<dyn Store>>,
    report: Report<'a>,
    caches_errors: bool,
) -> Result<Acquired<'a>, Error> {
    match claim::<P>(call, store, caches_errors).await {
        Ok(Claimed::Owner(owner)) => Ok(Acquired::Owner(owner, report)),
        Ok(Claimed::Stored { bytes, failed }) => Ok(Acquired::Stored {
            report,
            bytes,
            failed,
        }),
        Err(error) => refused(report, error),
    }
}

/// A call that ends with `error` before its body ran, reported.
fn refused<T>(report: Report<'_>, error: Error) -> Result<T, Error> {
    report.refused(&error);
    Err(error)
}

/// The store's lookup on the hit path, lending a stored result to `replay`: whether it
/// did. A panic in the result's `Deserialize` is a record that cannot be read back (see
/// [`lend_caught`]); a panic in the store's own code is the store's failure; neither is
/// the caller's panic.
fn lookup(call: &Call, store: &dyn Store, replay: &mut dyn Lend) -> Result<bool, Error> {
    let mut replayed = false;
    let looked_up = panic::catch_unwind(AssertUnwindSafe(|| {
        store.with_completed_result(&call.key, &call.fingerprint, &mut |bytes| {
            replayed = true;
            lend_caught(replay, &call.key, bytes, false);
        })
    }));
    if looked_up.is_err() {
        let why = "a panic in the store's lookup";
        return Err(Error::store(store.name(), why));
    }
    if replayed {
        tracing::debug!(tool = %call.tool, key = %call.key, "idem: hit, replaying stored result");
    }
    Ok(replayed)
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
        origin: call.run.origin(call.tool.to_shared()),
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
pub(super) const LATE_CLAIM: Duration = Duration::from_secs(10);

/// A claim request that owns what it needs, so it can finish without its caller.
type ClaimFuture = Pin<Box<dyn Future<Output = Result<Claim, Error>> + Send>>;

fn claim_owned(store: &Arc<dyn Store>, key: &Key, request: ClaimRequest) -> ClaimFuture {
    let (store, key) = (Arc::clone(store), key.clone());
    Box::pin(async move { store_op(store.name(), "claim", || store.claim(&key, &request)).await })
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
