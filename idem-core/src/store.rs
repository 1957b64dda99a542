//! The `Store` trait: the contract every store keeps, and the claim decision the
//! in-process stores share.
//!
//! # Contract
//!
//! - [`Store::claim`] is one atomic step: of any number of concurrent claims on a key
//!   (tasks, threads, processes, machines), at most one returns [`Claim::Acquired`]
//!   while its lease is alive.
//! - [`Store::complete`], [`Store::renew`] and [`Store::release`] are fenced by the
//!   owner's token: they change the record only while it is in progress *with that
//!   token*.
//! - A claim lives by its lease, a result by its TTL: an in-progress record expires one
//!   TTL after its lease ends (so a claim given up without an outcome is remembered, for
//!   at-most-once tools, as long as a result would be), and a completed one one TTL
//!   after its completion.
//! - An expired record (its `expires_at` has passed) is absent on every read path,
//!   whatever the physical cleanup ([`Store::purge_expired`], the store's own TTL)
//!   has done so far.
//! - Errors are [`Error`]s (usually [`Error::Store`]); no method panics on stored data.
//!
//! [`decide_claim`] is the claim rule as a pure function; a store that can run Rust
//! inside its atomic step (a lock, a compare-and-swap loop) uses it as is. The
//! `testing` feature exports a conformance suite (`idem::store::testing`) that checks
//! all of the above against any store.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

pub use crate::key::{Fingerprint, KeyParts};
pub use crate::key_text::Key;
pub use crate::record::{Record, State, Timestamp, Token, FORMAT_VERSION};
use crate::Error;

/// What a caller asks for when it claims a key.
#[derive(Clone, Copy, Debug)]
pub struct ClaimRequest {
    /// Fingerprint of the caller's whole input.
    pub fingerprint: Fingerprint,
    /// The caller's fencing token, written into the record if the claim succeeds.
    pub token: Token,
    /// How long the claim holds, unless renewed, before it is considered abandoned.
    pub lease: Duration,
    /// How long the record lives after the claim's lease ends (and, once completed,
    /// after its completion).
    pub ttl: Duration,
    /// When the existing claim's lease has expired: take it over (`true`,
    /// at-least-once) or report it abandoned (`false`, at-most-once).
    pub take_over_expired: bool,
    /// When the key holds a cached error: claim it and run again (`true`) or return the
    /// error (`false`).
    pub retry_failed: bool,
}

/// What a claim found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Claim {
    /// The caller owns the key now and must run the operation, then complete or release.
    Acquired {
        /// Whether an abandoned claim (expired lease) was taken over.
        took_over: bool,
    },
    /// The key completed with this serialized result: replay it.
    Completed(Vec<u8>),
    /// The key failed with this serialized error (errors are cached): replay it.
    Failed(Vec<u8>),
    /// Another call holds the key until `lease_until`.
    Busy {
        /// When the other call's lease runs out, by this process's clock (a store that
        /// decides by a server's clock converts it).
        lease_until: Timestamp,
    },
    /// An earlier claim was given up without an outcome (its lease ran out, or its
    /// owner gave it up with a zero-lease [`Store::renew`]), and the request does not
    /// take over abandoned claims: the outcome is unknown.
    Abandoned {
        /// When the record of the abandoned claim expires, by this process's clock (a
        /// store that decides by a server's clock converts it).
        expires_at: Timestamp,
    },
    /// The key belongs to a different input.
    Mismatch,
}

/// The outcome to store when completing a key.
#[derive(Clone, Copy, Debug)]
pub enum Outcome<'a> {
    /// The serialized `Ok` value.
    Completed(&'a [u8]),
    /// The serialized `Err` value (only when the tool caches errors).
    Failed(&'a [u8]),
}

/// A write only the claim's owner may make: fenced by its token.
#[derive(Clone, Copy, Debug)]
pub enum OwnerWrite<'a> {
    /// Record the outcome; the record then lives for `ttl` from now.
    Complete {
        /// The outcome.
        outcome: Outcome<'a>,
        /// How long the result is kept.
        ttl: Duration,
    },
    /// Extend the claim: its lease ends `lease` from now, and the record expires `ttl`
    /// after that. A zero lease gives the claim up as abandoned at once.
    Renew {
        /// The new lease, from now.
        lease: Duration,
        /// How long the record lives after the lease.
        ttl: Duration,
    },
    /// Remove the claim, so the next call runs again.
    Release,
}

/// Whether a fenced write found the caller still owning the key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fenced {
    /// The caller's token matched; the write was applied.
    Applied,
    /// The key is no longer in progress with the caller's token (taken over, expired,
    /// deleted); nothing was written.
    LostLease,
}

/// A place to keep idempotency records. Object-safe: stores are used as `Arc<dyn Store>`.
///
/// Implement it to plug in your own store, and check the implementation with the
/// conformance suite (`idem_core::testing`, feature `testing`).
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Atomically claims `key`, or reports what holds it (see [`decide_claim`]).
    async fn claim(&self, key: &Key, request: &ClaimRequest) -> Result<Claim, Error>;

    /// Records the outcome of the claim `token` holds; the record then lives for `ttl`.
    async fn complete(
        &self,
        key: &Key,
        token: Token,
        outcome: Outcome<'_>,
        ttl: Duration,
    ) -> Result<Fenced, Error>;

    /// Removes the claim `token` holds, so the next call runs again.
    async fn release(&self, key: &Key, token: Token) -> Result<Fenced, Error>;

    /// Renews the claim `token` holds (the heartbeat of a running body): its lease now
    /// ends `lease` from now, by the store's clock, and the record expires `ttl` after
    /// that. A claim whose lease ran out but that nobody took over is renewed too.
    ///
    /// A zero `lease` gives the claim up at once: the next claim finds it abandoned, and
    /// takes it over (at-least-once) or reports [`Claim::Abandoned`] (at-most-once), for
    /// `ttl` from now. This is how a call cancelled or panicking in a live process settles
    /// an at-most-once claim without anyone waiting out a lease.
    ///
    /// A renewal need not be durable: losing one in a crash only brings the lease's end
    /// back to an earlier renewal's, and the process is gone anyway.
    async fn renew(
        &self,
        key: &Key,
        token: Token,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Fenced, Error>;

    /// The live record under `key`, if any (expired records are `None`).
    async fn get(&self, key: &Key) -> Result<Option<Record>, Error>;

    /// Removes the record under `key`, whatever its state. Returns whether a live record
    /// was there. Use it to resolve an [`Error::OutcomeUnknown`] by hand.
    async fn delete(&self, key: &Key) -> Result<bool, Error>;

    /// Physically removes expired records; returns how many were removed.
    async fn purge_expired(&self) -> Result<u64, Error>;

    /// The largest serialized result this store keeps, in bytes. A larger result is
    /// [`Error::ResultTooLarge`], never a store error half-way through a write.
    /// Default: [`DEFAULT_MAX_RESULT_BYTES`].
    fn max_result_bytes(&self) -> usize {
        DEFAULT_MAX_RESULT_BYTES
    }

    /// A short fixed name of the kind of store (`memory`, `sled`, `postgres`, `redis`),
    /// for spans and metric labels (`idem.store`, `store`). Default: `custom`.
    fn name(&self) -> &'static str {
        "custom"
    }

    /// The hit path without a claim: calls `replay` with the stored result if `key`
    /// holds a live, completed record for `fingerprint` and the store can tell at once,
    /// without waiting on I/O. Otherwise it does not call `replay`, and the caller goes
    /// on to [`Store::claim`], which stays the authority on everything else (a record
    /// that cannot be read is not replayed here, and `claim` reports the error).
    ///
    /// Call `replay` at most once, and not while holding a lock the store's other
    /// methods take: it deserializes the result, which runs user code. The result is
    /// lent, not copied.
    ///
    /// The default never calls `replay`, which is always correct; the memory and sled
    /// stores answer from their maps, and [`LocalCache`](local_cache::LocalCache) from
    /// the results its process completed. A hit answered here skips the claim's fencing
    /// token, its boxed future and a copy of the result.
    fn with_completed_result(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        replay: &mut dyn FnMut(&[u8]),
    ) {
        let _ = (key, fingerprint, replay);
    }
}

/// Whether a claim on `record` would replay its result: the record is live, completed,
/// and for `fingerprint` (the rule [`Store::with_completed_result`] answers by).
pub fn is_replayable(record: &Record, fingerprint: &Fingerprint, now: Timestamp) -> bool {
    !record.is_expired(now)
        && record.fingerprint == *fingerprint
        && matches!(record.state, State::Completed { .. })
}

/// The result size every built-in store accepts: 4 MiB. Redis (512 MiB per value) and
/// PostgreSQL (1 GiB per `bytea`) take far more, but a large value blocks Redis's one
/// thread while it moves and is copied on every replay; sled keeps values in memory
/// pages. Tool results are meant to go back into a model's context: ids, receipts,
/// short texts.
pub const DEFAULT_MAX_RESULT_BYTES: usize = 4 << 20;

#[async_trait]
impl<S: Store + ?Sized> Store for Arc<S> {
    async fn claim(&self, key: &Key, request: &ClaimRequest) -> Result<Claim, Error> {
        (**self).claim(key, request).await
    }
    async fn complete(
        &self,
        key: &Key,
        token: Token,
        outcome: Outcome<'_>,
        ttl: Duration,
    ) -> Result<Fenced, Error> {
        (**self).complete(key, token, outcome, ttl).await
    }
    async fn release(&self, key: &Key, token: Token) -> Result<Fenced, Error> {
        (**self).release(key, token).await
    }
    async fn renew(
        &self,
        key: &Key,
        token: Token,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Fenced, Error> {
        (**self).renew(key, token, lease, ttl).await
    }
    async fn get(&self, key: &Key) -> Result<Option<Record>, Error> {
        (**self).get(key).await
    }
    async fn delete(&self, key: &Key) -> Result<bool, Error> {
        (**self).delete(key).await
    }
    async fn purge_expired(&self) -> Result<u64, Error> {
        (**self).purge_expired().await
    }
    fn max_result_bytes(&self) -> usize {
        (**self).max_result_bytes()
    }
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn with_completed_result(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        replay: &mut dyn FnMut(&[u8]),
    ) {
        (**self).with_completed_result(key, fingerprint, replay)
    }
}

/// The claim rule. Given the record currently under the key (`None` if absent), returns
/// what the claim found and, if the store must write, the record to write.
///
/// - absent or expired → write a fresh in-progress record, whose lease ends `lease` from
///   now and which expires `ttl` after that: `Acquired`
/// - different fingerprint → `Mismatch` (nothing written)
/// - completed → `Completed`; failed → `Failed`, or re-claimed when `retry_failed`
/// - in progress, lease alive → `Busy`
/// - in progress, lease expired → re-claimed with the new token when
///   `take_over_expired`, else `Abandoned`
pub fn decide_claim(
    existing: Option<&Record>,
    request: &ClaimRequest,
    now: Timestamp,
) -> (Claim, Option<Record>) {
    let fresh = || {
        in_progress(
            request.fingerprint,
            request.token,
            now,
            request.lease,
            request.ttl,
        )
    };
    let existing = match existing {
        Some(r) if !r.is_expired(now) => r,
        _ => return (Claim::Acquired { took_over: false }, Some(fresh())),
    };
    if existing.fingerprint != request.fingerprint {
        return (Claim::Mismatch, None);
    }
    match &existing.state {
        State::Completed { result } => (Claim::Completed(result.clone()), None),
        State::Failed { .. } if request.retry_failed => {
            (Claim::Acquired { took_over: false }, Some(fresh()))
        }
        State::Failed { error } => (Claim::Failed(error.clone()), None),
        State::InProgress { lease_until, .. } if *lease_until > now => (
            Claim::Busy {
                lease_until: *lease_until,
            },
            None,
        ),
        State::InProgress { .. } if request.take_over_expired => {
            (Claim::Acquired { took_over: true }, Some(fresh()))
        }
        State::InProgress { .. } => (
            Claim::Abandoned {
                expires_at: existing.expires_at,
            },
            None,
        ),
    }
}

/// An in-progress record written at `now`: its lease ends `lease` later, and the record
/// expires `ttl` after the lease.
fn in_progress(
    fingerprint: Fingerprint,
    token: Token,
    now: Timestamp,
    lease: Duration,
    ttl: Duration,
) -> Record {
    let lease_until = now.after(lease);
    Record {
        fingerprint,
        created_at: now,
        expires_at: lease_until.after(ttl),
        state: State::InProgress { token, lease_until },
    }
}

/// The fenced-write rule shared by in-process stores: given the record under the key,
/// the record to write if `token` still owns it (`None` for a release), or `LostLease`.
pub fn decide_fenced(
    existing: Option<&Record>,
    token: Token,
    write: OwnerWrite<'_>,
    now: Timestamp,
) -> Result<Option<Record>, Fenced> {
    let owned = match existing {
        Some(r) if !r.is_expired(now) => {
            matches!(r.state, State::InProgress { token: owner, .. } if owner == token)
        }
        _ => false,
    };
    let Some(r) = existing.filter(|_| owned) else {
        return Err(Fenced::LostLease);
    };
    Ok(match write {
        OwnerWrite::Complete { outcome, ttl } => Some(Record {
            fingerprint: r.fingerprint,
            created_at: now,
            expires_at: now.after(ttl),
            state: match outcome {
                Outcome::Completed(b) => State::Completed { result: b.to_vec() },
                Outcome::Failed(b) => State::Failed { error: b.to_vec() },
            },
        }),
        OwnerWrite::Renew { lease, ttl } => {
            Some(in_progress(r.fingerprint, token, now, lease, ttl))
        }
        OwnerWrite::Release => None,
    })
}

pub(crate) mod local_cache;
pub(crate) mod memory;
#[cfg(any(feature = "postgres", feature = "redis"))]
mod net;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg(feature = "redis")]
pub(crate) mod redis;
#[cfg(feature = "sled")]
pub(crate) mod sled;

#[cfg(test)]
mod tests {
    use super::*;

    /// The replay rule is written twice: as `is_replayable` (the hit path before the
    /// claim) and inside `decide_claim`. They must answer alike for every record, or a
    /// hit would be served by one path and refused by the other.
    #[test]
    fn is_replayable_is_exactly_when_a_claim_replays() {
        let now = Timestamp(1_000);
        let states = [
            State::InProgress {
                token: Token(1),
                lease_until: Timestamp(2_000),
            },
            State::InProgress {
                token: Token(1),
                lease_until: Timestamp(500),
            },
            State::Completed {
                result: b"\"m-1\"".to_vec(),
            },
            State::Failed {
                error: b"\"declined\"".to_vec(),
            },
        ];
        let mut replays = 0;
        for state in states {
            for expires_at in [Timestamp(999), Timestamp(1_000), Timestamp(1_001)] {
                for stored in [1u8, 2] {
                    let record = Record {
                        fingerprint: Fingerprint::from_bytes([stored; 32]),
                        created_at: Timestamp(0),
                        expires_at,
                        state: state.clone(),
                    };
                    for (take_over_expired, retry_failed) in
                        [(false, false), (false, true), (true, false), (true, true)]
                    {
                        let request = ClaimRequest {
                            fingerprint: Fingerprint::from_bytes([1; 32]),
                            token: Token(2),
                            lease: Duration::from_secs(1),
                            ttl: Duration::from_secs(1),
                            take_over_expired,
                            retry_failed,
                        };
                        let (claim, _) = decide_claim(Some(&record), &request, now);
                        let replayed = matches!(claim, Claim::Completed(_));
                        replays += usize::from(replayed);
                        assert_eq!(
                            is_replayable(&record, &request.fingerprint, now),
                            replayed,
                            "{record:?} with {request:?} claimed as {claim:?}"
                        );
                    }
                }
            }
        }
        assert_eq!(
            replays, 4,
            "only the live, completed, same-input record replays"
        );
    }
}
