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

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::error::Error;
pub use crate::key::{Fingerprint, KeyParts};
pub use crate::key_text::Key;
pub use crate::record::{Meta, Origin, Record, State, Timestamp, Token, FORMAT_VERSION};

/// What a caller asks for when it claims a key.
#[derive(Clone, Debug)]
pub struct ClaimRequest {
    /// Who calls: kept in the record's [`Meta`] when the claim writes one.
    pub origin: Origin,
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

    /// One page of the live records that match `filter`, in an order the store keeps
    /// from page to page: the first page with `after = None`, then each next one with
    /// the previous page's [`Page::next`] until it is `None`. A page holds at most
    /// `limit` records (it may hold fewer, even none, and still have a next page), so
    /// any number of records can be walked without holding them all.
    ///
    /// A record written or removed while the pages are walked may be listed or not;
    /// one that stays all along is listed exactly once. The default is
    /// [`Error::Unsupported`].
    async fn list(
        &self,
        filter: &Filter,
        after: Option<&Cursor>,
        limit: usize,
    ) -> Result<Page, Error> {
        let _ = (filter, after, limit);
        Err(Error::Unsupported {
            store: self.name(),
            operation: "list",
        })
    }

    /// How many live records match `filter`, by state. The default walks
    /// [`Store::list`].
    async fn count(&self, filter: &Filter) -> Result<Counts, Error> {
        let (mut counts, mut after) = (Counts::default(), None);
        loop {
            let page = self.list(filter, after.as_ref(), WALK_PAGE).await?;
            for listed in &page.records {
                counts.add(StateKind::of(&listed.record, page.now));
            }
            counts.unreadable += page.unreadable.len() as u64;
            match page.next {
                Some(next) => after = Some(next),
                None => return Ok(counts),
            }
        }
    }

    /// Removes every live record that matches `filter` (a call running under one loses
    /// its lease); returns how many were removed. A value the store cannot read matches
    /// no filter, and stays.
    ///
    /// A record is removed only if it still matches when it is removed: one written
    /// since it was read (renewed, completed, claimed again after it expired) is
    /// judged as it is then, so a filter of settled states (`Completed`, `Failed`,
    /// `Abandoned`) never removes a running call's claim. The built-in stores keep this
    /// in one atomic step per record. The default walks [`Store::list`] and deletes each
    /// record with [`Store::delete`], so a record written between the two is removed
    /// all the same: a store whose operators evict running runs should do better.
    async fn delete_matching(&self, filter: &Filter) -> Result<u64, Error> {
        let (mut removed, mut after) = (0, None);
        loop {
            let page = self.list(filter, after.as_ref(), WALK_PAGE).await?;
            for listed in &page.records {
                removed += u64::from(self.delete(&listed.key).await?);
            }
            match page.next {
                Some(next) => after = Some(next),
                None => return Ok(removed),
            }
        }
    }

    /// Removes the record under `key` unless it is a running call's claim (in progress,
    /// its lease not run out, by the store's clock), in one step; returns whether a live
    /// record was removed. What `idem evict` does without `--force`: removing a running
    /// claim would make its call lose it (its result is not stored, and a retry runs the
    /// body again, at-most-once or not).
    ///
    /// The built-in stores decide and remove atomically. The default reads the record
    /// and then deletes it, so a claim made between the two (a record that expired and
    /// was claimed again) is removed all the same. A store that wraps another should
    /// forward this (and [`Store::delete_matching`]) to it, or it gets the default.
    async fn delete_settled(&self, key: &Key) -> Result<bool, Error> {
        match self.get(key).await? {
            Some(record) if StateKind::of(&record, Timestamp::now()) == StateKind::Running => {
                Ok(false)
            }
            Some(_) => self.delete(key).await,
            None => Ok(false),
        }
    }

    /// Settles an abandoned claim: the record under `key` is resolved only if it is in
    /// progress under `token` and its lease has run out (its call stopped without an
    /// outcome); otherwise nothing is written and the answer is
    /// [`Fenced::LostLease`]. [`Resolution::Completed`] records the result (the next
    /// call replays it), [`Resolution::Released`] removes the claim (the next call
    /// runs). The default is [`Error::Unsupported`].
    async fn resolve(
        &self,
        key: &Key,
        token: Token,
        resolution: Resolution<'_>,
    ) -> Result<Fenced, Error> {
        let _ = (key, token, resolution);
        Err(Error::Unsupported {
            store: self.name(),
            operation: "resolve",
        })
    }

    /// The largest serialized result this store keeps, in bytes. A larger result is
    /// [`Error::ResultTooLarge`], never a store error half-way through a write.
    /// Default: [`DEFAULT_MAX_RESULT_BYTES`].
    fn max_result_bytes(&self) -> usize {
        DEFAULT_MAX_RESULT_BYTES
    }

    /// A short fixed name of the kind of store (`memory`, `sled`, `sqlite`, `postgres`,
    /// `redis`), for spans and metric labels (`idem.store`, `store`). Default: `custom`.
    fn name(&self) -> &'static str {
        "custom"
    }

    /// Whether [`Store::renew`] may block the thread it is polled on (sled waiting for
    /// its IO, a custom store doing blocking IO in an `async fn`). The heartbeat then
    /// runs each renewal on a thread of idem's blocking pool, at most 32 of one store at
    /// once, so that a store that blocks holds a bounded number of threads and holds up
    /// no other store; a renewal due while they are all out is tried again half a
    /// renewal period later. A store whose renewals never block (Postgres: each waits
    /// for a statement that renews every claim waiting) says `false`, and the heartbeat
    /// runs its renewals as tasks of idem's own runtime, as many at once as are due.
    /// Default: `true`. A store that wraps another must forward it, as `Arc` and
    /// [`LocalCache`](crate::LocalCache) do: a wrapper that does not has a
    /// non-blocking store's renewals run 32 at a time again.
    fn renewals_block(&self) -> bool {
        true
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

/// Removes every live record that matches `filter` and is settled (completed, failed,
/// or an abandoned claim), and leaves running calls' claims: [`Store::delete_matching`]
/// once for each settled state, so each record is judged as it is removed (a claim made
/// meanwhile stays). What `idem evict --run` does without `--force`.
pub async fn delete_settled_matching(store: &dyn Store, filter: &Filter) -> Result<u64, Error> {
    let mut removed = 0;
    for state in [
        StateKind::Completed,
        StateKind::Failed,
        StateKind::Abandoned,
    ] {
        let filter = Filter {
            state: Some(state),
            ..filter.clone()
        };
        removed += store.delete_matching(&filter).await?;
    }
    Ok(removed)
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

/// What an `async fn` of [`Store`] returns once `async_trait` has written it out: the
/// operation's future, boxed.
type Boxed<'a, T> = Pin<Box<dyn Future<Output = Result<T, Error>> + Send + 'a>>;

/// A store behind an `Arc` (as a run holds its store: `Arc<dyn Store>`, on which method
/// calls find this impl first). The four operations of every call hand back the inner
/// store's own boxed future: written as `async fn`s, each would box a second future
/// that only awaits the first, an allocation and a layer of polling per operation.
/// Their signatures are the ones `async_trait` gives the trait's.
#[async_trait]
impl<S: Store + ?Sized> Store for Arc<S> {
    fn claim<'s, 'k, 'r, 'f>(&'s self, key: &'k Key, request: &'r ClaimRequest) -> Boxed<'f, Claim>
    where
        's: 'f,
        'k: 'f,
        'r: 'f,
        Self: 'f,
    {
        (**self).claim(key, request)
    }
    fn complete<'s, 'k, 'o, 'f>(
        &'s self,
        key: &'k Key,
        token: Token,
        outcome: Outcome<'o>,
        ttl: Duration,
    ) -> Boxed<'f, Fenced>
    where
        's: 'f,
        'k: 'f,
        'o: 'f,
        Self: 'f,
    {
        (**self).complete(key, token, outcome, ttl)
    }
    fn release<'s, 'k, 'f>(&'s self, key: &'k Key, token: Token) -> Boxed<'f, Fenced>
    where
        's: 'f,
        'k: 'f,
        Self: 'f,
    {
        (**self).release(key, token)
    }
    fn renew<'s, 'k, 'f>(
        &'s self,
        key: &'k Key,
        token: Token,
        lease: Duration,
        ttl: Duration,
    ) -> Boxed<'f, Fenced>
    where
        's: 'f,
        'k: 'f,
        Self: 'f,
    {
        (**self).renew(key, token, lease, ttl)
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
    async fn list(
        &self,
        filter: &Filter,
        after: Option<&Cursor>,
        limit: usize,
    ) -> Result<Page, Error> {
        (**self).list(filter, after, limit).await
    }
    async fn count(&self, filter: &Filter) -> Result<Counts, Error> {
        (**self).count(filter).await
    }
    async fn delete_matching(&self, filter: &Filter) -> Result<u64, Error> {
        (**self).delete_matching(filter).await
    }
    async fn delete_settled(&self, key: &Key) -> Result<bool, Error> {
        (**self).delete_settled(key).await
    }
    async fn resolve(
        &self,
        key: &Key,
        token: Token,
        resolution: Resolution<'_>,
    ) -> Result<Fenced, Error> {
        (**self).resolve(key, token, resolution).await
    }
    fn max_result_bytes(&self) -> usize {
        (**self).max_result_bytes()
    }
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn renewals_block(&self) -> bool {
        (**self).renewals_block()
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
    // A new claim: the first one (no history), or another attempt at a key whose
    // earlier one failed or was abandoned (its history goes on).
    let claim = |history: Option<&Meta>, took_over: bool| {
        let meta = match history {
            None => Meta {
                origin: Some(request.origin.clone()),
                claimed_at: now,
                completed_at: None,
                renewed_at: None,
                attempts: 1,
                takeovers: 0,
            },
            Some(meta) => Meta {
                origin: meta.origin.clone().or_else(|| Some(request.origin.clone())),
                claimed_at: meta.claimed_at,
                completed_at: None,
                renewed_at: None,
                attempts: meta.attempts.saturating_add(1),
                takeovers: meta.takeovers.saturating_add(u32::from(took_over)),
            },
        };
        let record = in_progress(request, now, meta);
        (Claim::Acquired { took_over }, Some(record))
    };
    let existing = match existing {
        Some(r) if !r.is_expired(now) => r,
        _ => return claim(None, false),
    };
    if existing.fingerprint != request.fingerprint {
        return (Claim::Mismatch, None);
    }
    match &existing.state {
        State::Completed { result } => (Claim::Completed(result.clone()), None),
        State::Failed { .. } if request.retry_failed => claim(Some(&existing.meta), false),
        State::Failed { error } => (Claim::Failed(error.clone()), None),
        State::InProgress { lease_until, .. } if *lease_until > now => (
            Claim::Busy {
                lease_until: *lease_until,
            },
            None,
        ),
        State::InProgress { .. } if request.take_over_expired => claim(Some(&existing.meta), true),
        State::InProgress { .. } => (
            Claim::Abandoned {
                expires_at: existing.expires_at,
            },
            None,
        ),
    }
}

/// The claim `request` asks for, written at `now`: its lease ends `lease` later, and
/// the record expires `ttl` after the lease.
fn in_progress(request: &ClaimRequest, now: Timestamp, meta: Meta) -> Record {
    let lease_until = now.after(request.lease);
    Record {
        fingerprint: request.fingerprint,
        created_at: now,
        expires_at: lease_until.after(request.ttl),
        state: State::InProgress {
            token: request.token,
            lease_until,
        },
        meta,
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
        OwnerWrite::Complete { outcome, ttl } => Some(completed(r, outcome, ttl, now)),
        OwnerWrite::Renew { lease, ttl } => {
            let lease_until = now.after(lease);
            Some(Record {
                fingerprint: r.fingerprint,
                created_at: now,
                expires_at: lease_until.after(ttl),
                state: State::InProgress { token, lease_until },
                meta: Meta {
                    renewed_at: Some(now),
                    ..r.meta.clone()
                },
            })
        }
        OwnerWrite::Release => None,
    })
}

/// `claim` with `outcome` recorded at `now`, kept for `ttl`: its history goes on.
fn completed(claim: &Record, outcome: Outcome<'_>, ttl: Duration, now: Timestamp) -> Record {
    Record {
        fingerprint: claim.fingerprint,
        created_at: now,
        expires_at: now.after(ttl),
        state: match outcome {
            Outcome::Completed(b) => State::Completed { result: b.to_vec() },
            Outcome::Failed(b) => State::Failed { error: b.to_vec() },
        },
        meta: Meta {
            completed_at: Some(now),
            ..claim.meta.clone()
        },
    }
}

/// The resolution rule shared by in-process stores: given the record under the key,
/// the record to write (`None` to remove it) if it is an abandoned claim of `token`
/// at `now`, or `LostLease`.
pub fn decide_resolution(
    existing: Option<&Record>,
    token: Token,
    resolution: Resolution<'_>,
    now: Timestamp,
) -> Result<Option<Record>, Fenced> {
    let abandoned = existing.filter(|r| {
        !r.is_expired(now)
            && matches!(r.state, State::InProgress { token: owner, lease_until }
                if owner == token && lease_until <= now)
    });
    let Some(r) = abandoned else {
        return Err(Fenced::LostLease);
    };
    Ok(match resolution {
        Resolution::Completed { result, ttl } => {
            Some(completed(r, Outcome::Completed(result), ttl, now))
        }
        Resolution::Released => None,
    })
}

/// How an abandoned claim is settled ([`Store::resolve`]).
#[derive(Clone, Copy, Debug)]
pub enum Resolution<'a> {
    /// The call did happen, with this serialized result: record it, kept for `ttl`.
    Completed {
        /// The serialized `Ok` value, as the tool would have stored it.
        result: &'a [u8],
        /// How long the result is kept.
        ttl: Duration,
    },
    /// The call never happened: remove the claim, so the next call runs.
    Released,
}

/// The state of a record as an operator sees it, with its lease read against a clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StateKind {
    /// In progress, its lease alive: a call is running (or its process stopped within
    /// the lease).
    Running,
    /// In progress, its lease run out: the call stopped without an outcome. An
    /// at-most-once tool answers [`Error::OutcomeUnknown`] until it is resolved; an
    /// at-least-once one takes it over at the next call.
    Abandoned,
    /// Completed: the next call replays its result.
    Completed,
    /// A cached error: the next call replays it.
    Failed,
}

impl StateKind {
    /// The state of `record` at `now`.
    pub fn of(record: &Record, now: Timestamp) -> StateKind {
        match record.state {
            State::InProgress { lease_until, .. } if lease_until > now => StateKind::Running,
            State::InProgress { .. } => StateKind::Abandoned,
            State::Completed { .. } => StateKind::Completed,
            State::Failed { .. } => StateKind::Failed,
        }
    }

    /// Every state, in the order listings show them.
    pub const ALL: [StateKind; 4] = [
        StateKind::Running,
        StateKind::Abandoned,
        StateKind::Completed,
        StateKind::Failed,
    ];

    /// The state's name: `running`, `abandoned`, `completed`, `failed`.
    pub fn as_str(self) -> &'static str {
        match self {
            StateKind::Running => "running",
            StateKind::Abandoned => "abandoned",
            StateKind::Completed => "completed",
            StateKind::Failed => "failed",
        }
    }
}

impl std::fmt::Display for StateKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for StateKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        StateKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| {
                format!("unknown state `{s}`: use running, abandoned, completed or failed")
            })
    }
}

/// Which records to list, count or remove: every condition set must hold.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Filter {
    /// Records of this run.
    pub run_id: Option<String>,
    /// Records of this tenant.
    pub tenant: Option<String>,
    /// Records of this tool.
    pub tool: Option<String>,
    /// Records in this state.
    pub state: Option<StateKind>,
    /// Records whose key was first claimed before this time.
    pub claimed_before: Option<Timestamp>,
}

impl Filter {
    /// Whether `record` matches, at `now`. A record without an origin (format 1)
    /// matches no run or tenant condition, and the tool its key's label names.
    pub fn matches(&self, key: &Key, record: &Record, now: Timestamp) -> bool {
        let origin = record.meta.origin.as_ref();
        let is = |want: &Option<String>, have: Option<&str>| {
            want.as_deref().is_none_or(|want| have == Some(want))
        };
        let tool = || match (origin, &self.tool) {
            (Some(o), Some(want)) => *o.tool == **want,
            // A record of format 1: its key's label names the tool.
            (None, Some(want)) => key.label() == Some(&Key::label_of(want)),
            (_, None) => true,
        };
        is(&self.run_id, origin.map(|o| &*o.run_id))
            && is(&self.tenant, origin.and_then(|o| o.tenant.as_deref()))
            && tool()
            && self
                .state
                .is_none_or(|state| StateKind::of(record, now) == state)
            && self
                .claimed_before
                .is_none_or(|before| record.meta.claimed_at < before)
    }

    /// Whether no condition is set (every record matches).
    pub fn is_empty(&self) -> bool {
        *self == Filter::default()
    }
}

/// Where a listing goes on from: opaque, made by the store that listed the page.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cursor(pub String);

/// One page of a listing ([`Store::list`]).
#[derive(Debug, Default)]
pub struct Page {
    /// The records, with their keys.
    pub records: Vec<Listed>,
    /// Keys on the page whose values this build cannot read (another program's key, a
    /// damaged record, a format from a newer idem), whatever the filter: an operator
    /// wants to know of them, and [`Store::delete`] removes them.
    pub unreadable: Vec<Unreadable>,
    /// Where the next page starts; `None` after the last page.
    pub next: Option<Cursor>,
    /// The store's clock when the page was read: the time to read leases by.
    pub now: Timestamp,
}

/// A record in a listing.
#[derive(Clone, Debug)]
pub struct Listed {
    /// Its key.
    pub key: Key,
    /// The record.
    pub record: Record,
}

/// A key a listing found but could not read.
#[derive(Debug)]
pub struct Unreadable {
    /// Its key.
    pub key: Key,
    /// Why it cannot be read ([`Error::CorruptRecord`], [`Error::UnsupportedFormat`]).
    pub error: Error,
}

/// How many records are in each state ([`Store::count`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// In progress, lease alive.
    pub running: u64,
    /// In progress, lease run out.
    pub abandoned: u64,
    /// Completed.
    pub completed: u64,
    /// Cached errors.
    pub failed: u64,
    /// Values that are not records this build reads (see [`Page::unreadable`]); a
    /// store that counts without reading values (Postgres) counts none.
    pub unreadable: u64,
}

impl Counts {
    /// Counts one more record in `state`.
    pub fn add(&mut self, state: StateKind) {
        *self.get_mut(state) += 1;
    }

    /// The count of `state`.
    pub fn get(&self, state: StateKind) -> u64 {
        match state {
            StateKind::Running => self.running,
            StateKind::Abandoned => self.abandoned,
            StateKind::Completed => self.completed,
            StateKind::Failed => self.failed,
        }
    }

    fn get_mut(&mut self, state: StateKind) -> &mut u64 {
        match state {
            StateKind::Running => &mut self.running,
            StateKind::Abandoned => &mut self.abandoned,
            StateKind::Completed => &mut self.completed,
            StateKind::Failed => &mut self.failed,
        }
    }

    /// All records, the unreadable ones included.
    pub fn total(&self) -> u64 {
        self.running + self.abandoned + self.completed + self.failed + self.unreadable
    }
}

/// How many records a page of the default walks holds.
pub(crate) const WALK_PAGE: usize = 1_000;

/// A page of `limit` records from a sorted stream of keyed records: the listing of a
/// store whose keys are in order. `entries` yields every live key in key order, from
/// where the page starts, with its place in the store (`P`) and its record or the
/// reason it cannot be read; an `Err` item fails the page. `cursor` makes the next
/// page's cursor of the last place read, once, when there is a next page.
pub(crate) fn page_by_key<P>(
    entries: impl Iterator<Item = Result<(P, Key, Result<Record, Error>), Error>>,
    cursor: impl FnOnce(P) -> Cursor,
    filter: &Filter,
    limit: usize,
    now: Timestamp,
) -> Result<Page, Error> {
    let limit = limit.max(1);
    let mut page = Page {
        now,
        ..Page::default()
    };
    let mut last = None;
    for entry in entries {
        let (place, key, record) = entry?;
        if page.records.len() + page.unreadable.len() == limit {
            page.next = last.map(cursor);
            break;
        }
        last = Some(place);
        match record {
            Ok(record) if filter.matches(&key, &record, now) => {
                page.records.push(Listed { key, record })
            }
            Ok(_) => {}
            Err(error) => page.unreadable.push(Unreadable { key, error }),
        }
    }
    Ok(page)
}

/// The rule of [`Store::delete_settled`] for a store that decides in Rust: a live record
/// is removed (`Ok(None)`: nothing written in its place) unless it is a running call's
/// claim.
#[cfg(any(feature = "sled", feature = "sqlite"))]
pub(crate) fn decide_settled_removal(
    current: Option<&Record>,
    now: Timestamp,
) -> Result<Option<Record>, Fenced> {
    match current {
        Some(r) if !r.is_expired(now) && StateKind::of(r, now) != StateKind::Running => Ok(None),
        _ => Err(Fenced::LostLease),
    }
}

/// Bytes written as hex (a listing's cursor over raw keys).
#[cfg(any(feature = "sled", feature = "sqlite"))]
pub(crate) fn unhex(text: &str) -> Option<Vec<u8>> {
    if text.len() % 2 != 0 {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// The longest timeout a store can keep whose database takes it in milliseconds as a
/// 32-bit integer (Postgres' `lock_timeout`, SQLite's busy timeout): about 24.8 days.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) const MILLIS_I32: Duration = Duration::from_millis(i32::MAX as u64);

/// Checks a store's timeout as the store is built: a
/// [`StoreErrorKind::Config`](crate::error::StoreErrorKind::Config) error if it is
/// shorter than `least` (a network store's every operation would fail at zero; Postgres
/// takes its lock timeout in whole milliseconds, and reads zero as none) or longer than
/// `most`, rather than a store that fails every call, or an error (or a panic) from its
/// database's driver on first use.
#[cfg(any(feature = "postgres", feature = "redis", feature = "sqlite"))]
pub(crate) fn check_timeout(
    store: &'static str,
    timeout: Duration,
    least: Duration,
    most: Duration,
) -> Result<(), Error> {
    let why = if timeout < least {
        format!(
            "a timeout of {timeout:?} is shorter than the {store} store can keep ({least:?}): \
             give it one that lasts a round trip"
        )
    } else if timeout > most {
        format!("a timeout of {timeout:?} is longer than the {store} store can keep ({most:?})")
    } else {
        return Ok(());
    };
    Err(Error::store_of_kind(
        store,
        crate::error::StoreErrorKind::Config,
        why,
    ))
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
#[cfg(feature = "sqlite")]
pub(crate) mod sqlite;

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
                        meta: Meta::default(),
                    };
                    for (take_over_expired, retry_failed) in
                        [(false, false), (false, true), (true, false), (true, true)]
                    {
                        let request = ClaimRequest {
                            origin: Origin::new("run", "tool"),
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
