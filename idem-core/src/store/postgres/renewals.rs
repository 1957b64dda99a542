//! Renewals of many claims in one statement, on a connection asked of the pool ahead
//! of the calls.
//!
//! Every running call's claim is renewed every third of its lease. As one `UPDATE`
//! each, a renewal asked the pool for a connection behind every claim and completion
//! already waiting, and a burst of calls that kept that queue longer than a lease let
//! another worker take a live call's claim over. Renewals now queue here, and one task
//! at a time sends those waiting (up to [`BATCH`]) as one statement, on a connection it
//! asks the pool for without a turn (`PostgresStore::renewal_client`; every other
//! operation waits for a turn first). So renewals hold one connection at most, however
//! many bodies run, and a renewal waits for a connection behind as many calls at most
//! as the pool has connections.
//!
//! While calls hold every turn at the pool, the task rests after each statement as long
//! as the statement took (at most a sixth of the shortest lease it renewed, and
//! [`MAX_REST`]) before it sends the next, and renewals due meanwhile gather for it:
//! with a pool of one connection, calls then keep at least half of it, however many
//! claims are running or waiting to record their outcome. (Three times as long, calls
//! kept three quarters, but claims whose renewals were due faster than a quarter of the
//! connection served lapsed.)
//!
//! A row another transaction holds locked (a claim's takeover attempt, a completion,
//! an operator's `SELECT … FOR UPDATE`) is skipped rather than waited for: one locked
//! row holds up its own renewal, never the statement, and no connection. If the claim
//! is still the caller's, its renewal goes back in the queue and is sent again every
//! [`LOCKED_AGAIN`] until the lock goes (or the caller stops waiting, at the store's
//! timeout): it lands as soon as the lock goes, as an `UPDATE` waiting on the lock
//! would, ahead of a takeover that waited on the same lock. (Answered at once with an
//! error instead, it was tried again half a renewal period later, and a lock shorter
//! than the lease let a worker waiting on it take the claim over first.) A renewal
//! whose caller stopped waiting is dropped from the queue unsent. A statement the
//! server refuses for one claim's values (a data error) is sent again one claim at a
//! time, so that claim's renewal alone fails.
//!
//! The task runs on idem's own runtime (see [`crate::background`]), never on a caller's,
//! which may be shut down or no longer driven. Each renewal waits for its answer within
//! the store's timeout. A task dropped unfinished or that panics answers every renewal
//! it held or that was waiting with an error, and the next renewal starts another.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;
use tokio_postgres::{Row, Statement};

use super::{millis, pg_error, refuses_result, Pending, PostgresStore, STORE};
use crate::error::{Error, StoreErrorKind};
use crate::key_text::Key;
use crate::record::Token;
use crate::store::Fenced;
use crate::sync::lock;

/// The most claims one statement renews.
const BATCH: usize = 512;

/// How soon a renewal whose row was locked is sent again.
const LOCKED_AGAIN: Duration = Duration::from_millis(10);

/// The longest rest between two statements (see the module docs).
const MAX_REST: Duration = Duration::from_secs(1);

/// The longest rest as a share of the shortest lease renewed (a sixth): a renewal is
/// sent a third of a lease after the last, so one that waits half of another third for
/// the rest is still in time.
const MAX_REST_OF_LEASE: u32 = 6;

/// What a statement found for one claim: renewed, or not renewed though its row was the
/// caller's claim as the statement began (skipped for a lock).
type Found = HashMap<String, (bool, bool)>;

/// The renewals waiting for a statement.
#[derive(Default)]
pub(super) struct Renewals {
    queue: Mutex<Queue>,
}

#[derive(Default)]
struct Queue {
    /// In the order they came.
    waiting: Vec<Renewal>,
    /// A task is sending them.
    sending: bool,
}

/// A renewal asked for: the claim, its new lease and expiry (ms from the statement's
/// time), and where its answer goes.
struct Renewal {
    key: String,
    token: [u8; 16],
    lease: i64,
    ttl: i64,
    answer: oneshot::Sender<Result<Fenced, Error>>,
    /// Not to be sent before this (its row was locked).
    not_before: Option<Instant>,
}

impl PostgresStore {
    /// Renews the claim on `key` held with `token`: its lease runs `lease` from the
    /// statement's time, and its record lives `ttl` past that. Queued, and sent with
    /// every other renewal waiting (see the module docs).
    pub(super) async fn renew_queued(
        &self,
        key: &Key,
        token: Token,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Fenced, Error> {
        let (answer, answered) = oneshot::channel();
        let renewal = Renewal {
            key: key.as_str().to_owned(),
            token: token.0.to_be_bytes(),
            lease: millis(lease),
            ttl: millis(lease.saturating_add(ttl)),
            answer,
            not_before: None,
        };
        let start = {
            let mut queue = lock(&self.inner.renewals.queue);
            queue.waiting.push(renewal);
            !std::mem::replace(&mut queue.sending, true)
        };
        if start {
            // Whatever becomes of the task, its `Sender` answers (see its `Drop`); one
            // that cannot be spawned is dropped at once.
            let sender = Sender {
                store: self.clone(),
                finished: false,
            };
            crate::background::spawn(sender.run());
        }
        answered
            .await
            .unwrap_or_else(|_| Err(pg_error("the task sending renewals ended unfinished")))
    }

    /// Renews `batch` in one statement: what it found for each claim, by key.
    async fn renew_all(&self, batch: &[Renewal]) -> Result<Found, Unsent> {
        let client = self.renewal_client().await?;
        let client = &client;
        let keys: Vec<&str> = batch.iter().map(|r| r.key.as_str()).collect();
        let tokens: Vec<&[u8]> = batch.iter().map(|r| &r.token[..]).collect();
        let leases: Vec<i64> = batch.iter().map(|r| r.lease).collect();
        let ttls: Vec<i64> = batch.iter().map(|r| r.ttl).collect();
        let (k, t, l, e) = (&keys, &tokens, &leases, &ttls);
        let renew = |stmt: Statement| -> Pending<'_, Vec<Row>> {
            Box::pin(async move { client.query(&stmt, &[k, t, l, e]).await })
        };
        let unsent = |error: tokio_postgres::Error| Unsent {
            for_a_value: refuses_result(&error),
            error: pg_error(error),
        };
        let rows = self
            .on(client, &self.inner.sql.renew_many, renew)
            .await
            .map_err(unsent)?;
        rows.iter()
            .map(|row| Ok((row.try_get(0)?, (row.try_get(1)?, row.try_get(2)?))))
            .collect::<Result<_, tokio_postgres::Error>>()
            .map_err(unsent)
    }

    /// [`PostgresStore::renew_all`] within the store's timeout.
    async fn bounded_renewals(&self, batch: &[Renewal]) -> Result<Found, Unsent> {
        match crate::store::net::bounded(STORE, self.inner.timeout, async {
            Ok(self.renew_all(batch).await)
        })
        .await
        {
            Ok(sent) => sent,
            Err(error) => Err(error.into()),
        }
    }
}

/// A statement of renewals that failed, and whether the server refused a value in it
/// (a data error: one claim's lease out of range, say), which it would not refuse of
/// the other claims sent alone.
struct Unsent {
    error: Error,
    for_a_value: bool,
}

/// A failure before the statement reached the server (no connection, a timeout).
impl From<Error> for Unsent {
    fn from(error: Error) -> Self {
        Unsent {
            error,
            for_a_value: false,
        }
    }
}

/// The task that sends the renewals waiting, one statement at a time, until none is.
struct Sender {
    store: PostgresStore,
    /// It found none waiting and said so; else its `Drop` answers those waiting.
    finished: bool,
}

impl Sender {
    async fn run(mut self) {
        loop {
            let (batch, next) = {
                let mut queue = lock(&self.store.inner.renewals.queue);
                let taken = take_batch(&mut queue.waiting, Instant::now());
                if queue.waiting.is_empty() && taken.0.is_empty() {
                    queue.sending = false;
                    self.finished = true;
                    return;
                }
                taken
            };
            if batch.is_empty() {
                // Only renewals of locked rows wait, none due yet.
                tokio::time::sleep_until(next.unwrap_or_else(Instant::now).into()).await;
                continue;
            }
            let started = Instant::now();
            let (shortest, claims) = (
                batch.iter().map(|r| r.lease).min().unwrap_or(0),
                batch.len(),
            );
            let store = &self.store;
            match store.bounded_renewals(&batch).await {
                Err(Unsent {
                    for_a_value: true, ..
                }) if batch.len() > 1 => {
                    // One claim's values spoil the statement: each claim alone.
                    for renewal in batch {
                        let sent = store.bounded_renewals(std::slice::from_ref(&renewal)).await;
                        self.again(answer(vec![renewal], &sent));
                    }
                }
                sent => self.again(answer(batch, &sent)),
            }
            tracing::trace!(table = %store.inner.table, claims, took = ?started.elapsed(), "idem: renewals sent");
            // Renewals due meanwhile gather for the next statement (see the module docs).
            if store.inner.calls.available_permits() == 0 {
                let cap =
                    Duration::from_millis(u64::try_from(shortest).unwrap_or(0)) / MAX_REST_OF_LEASE;
                tokio::time::sleep(started.elapsed().min(cap).min(MAX_REST)).await;
            }
        }
    }

    /// Puts renewals whose rows were locked back in the queue, to be sent again after
    /// [`LOCKED_AGAIN`].
    fn again(&self, locked: Vec<Renewal>) {
        if locked.is_empty() {
            return;
        }
        let not_before = Some(Instant::now() + LOCKED_AGAIN);
        let mut queue = lock(&self.store.inner.renewals.queue);
        queue
            .waiting
            .extend(locked.into_iter().map(|r| Renewal { not_before, ..r }));
    }
}

/// Answers each renewal of `batch` with what its statement found; returns those whose
/// rows were locked elsewhere, still the caller's claims, to be sent again.
fn answer(batch: Vec<Renewal>, sent: &Result<Found, Unsent>) -> Vec<Renewal> {
    let mut locked = Vec::new();
    for renewal in batch {
        let answer = match sent {
            Ok(found) => match found.get(&renewal.key) {
                Some((true, _)) => Ok(Fenced::Applied),
                Some((false, true)) => {
                    locked.push(renewal);
                    continue;
                }
                _ => Ok(Fenced::LostLease),
            },
            Err(unsent) => Err(each(&unsent.error)),
        };
        // A renewal that gave up waiting (its timeout) no longer listens.
        let _ = renewal.answer.send(answer);
    }
    locked
}

impl Drop for Sender {
    /// Dropped unfinished (a panic, or a runtime that could not take the task): the
    /// renewals waiting get an error (their answers are dropped), and the next renewal
    /// starts a new task.
    fn drop(&mut self) {
        if !self.finished {
            let waiting = {
                let mut queue = lock(&self.store.inner.renewals.queue);
                queue.sending = false;
                std::mem::take(&mut queue.waiting)
            };
            drop(waiting);
        }
    }
}

/// Takes up to [`BATCH`] renewals due by `now` from `waiting`, the first come, no key
/// twice (one statement updates a row once): a second renewal of a key waits for the
/// next. Drops those whose caller stopped waiting. Returns them, and when the first of
/// those left for later is due, if any is.
fn take_batch(waiting: &mut Vec<Renewal>, now: Instant) -> (Vec<Renewal>, Option<Instant>) {
    let mut keys = HashSet::new();
    let (mut batch, mut rest, mut next) = (Vec::new(), Vec::new(), None::<Instant>);
    for renewal in waiting.drain(..) {
        if renewal.answer.is_closed() {
            continue;
        }
        match renewal.not_before.filter(|at| *at > now) {
            Some(at) => {
                next = Some(next.map_or(at, |next| next.min(at)));
                rest.push(renewal);
            }
            None if batch.len() < BATCH && keys.insert(renewal.key.clone()) => batch.push(renewal),
            None => rest.push(renewal),
        }
    }
    *waiting = rest;
    (batch, next)
}

/// The statement's failure, for each renewal it carried: the same kind and text.
fn each(error: &Error) -> Error {
    let text = match error {
        Error::Store { source, .. } => source.to_string(),
        other => other.to_string(),
    };
    let kind = error.store_kind().unwrap_or(StoreErrorKind::Other);
    Error::store_of_kind(STORE, kind, text)
}
