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
//! many bodies run, and the calls always have the others (with a pool of one
//! connection, the two take it in turns); and a renewal waits for a connection behind
//! as many calls at most as the pool has connections.
//!
//! A row another transaction holds locked (a claim's takeover attempt, an operator's
//! `SELECT … FOR UPDATE`) is skipped rather than waited for: one locked row holds up
//! its own renewal, never the statement. Its renewal fails with [`Error::Store`] if the
//! claim is still the caller's, and the heartbeat tries it again soon.
//!
//! The sending task is spawned by the renewal that finds none running, and ends when
//! none is waiting. Each renewal waits for its answer within the store's timeout. A
//! task that is dropped unfinished (its runtime shut down) or panics answers every
//! renewal it held or that was waiting with an error, and the next renewal starts
//! another.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio_postgres::{Row, Statement};

use super::{millis, pg_error, Pending, PostgresStore, STORE};
use crate::error::{Error, StoreErrorKind};
use crate::key_text::Key;
use crate::record::Token;
use crate::store::Fenced;
use crate::sync::lock;

/// The most claims one statement renews.
const BATCH: usize = 1000;

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
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return Err(pg_error("a renewal needs a tokio runtime to be sent on"));
        };
        let (answer, answered) = oneshot::channel();
        let renewal = Renewal {
            key: key.as_str().to_owned(),
            token: token.0.to_be_bytes(),
            lease: millis(lease),
            ttl: millis(lease.saturating_add(ttl)),
            answer,
        };
        let start = {
            let mut queue = lock(&self.inner.renewals.queue);
            queue.waiting.push(renewal);
            !std::mem::replace(&mut queue.sending, true)
        };
        if start {
            // Whatever becomes of the task, its `Sender` answers (see its `Drop`).
            let sender = Sender {
                store: self.clone(),
                finished: false,
            };
            runtime.spawn(sender.run());
        }
        answered
            .await
            .unwrap_or_else(|_| Err(pg_error("the task sending renewals ended unfinished")))
    }

    /// Renews `batch` in one statement. Returns the keys renewed, and of the others
    /// those still held by the renewal's token: rows the statement skipped for a lock.
    async fn renew_all(
        &self,
        batch: &[Renewal],
    ) -> Result<(HashSet<String>, HashSet<String>), Error> {
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
        let sql = &self.inner.sql;
        let renewed = keys_of(self.on(client, &sql.renew_many, renew).await)?;
        if renewed.len() == batch.len() {
            return Ok((renewed, HashSet::new()));
        }
        let (keys, tokens): (Vec<&str>, Vec<&[u8]>) = batch
            .iter()
            .filter(|r| !renewed.contains(&r.key))
            .map(|r| (r.key.as_str(), &r.token[..]))
            .unzip();
        let (k, t) = (&keys, &tokens);
        let held = |stmt: Statement| -> Pending<'_, Vec<Row>> {
            Box::pin(async move { client.query(&stmt, &[k, t]).await })
        };
        let held = keys_of(self.on(client, &sql.renew_held, held).await)?;
        Ok((renewed, held))
    }
}

/// The keys a statement returned, as its first column.
fn keys_of(rows: Result<Vec<Row>, tokio_postgres::Error>) -> Result<HashSet<String>, Error> {
    rows.map_err(pg_error)?
        .iter()
        .map(|row| row.try_get::<_, String>(0).map_err(pg_error))
        .collect()
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
            let batch = {
                let mut queue = lock(&self.store.inner.renewals.queue);
                if queue.waiting.is_empty() {
                    queue.sending = false;
                    self.finished = true;
                    return;
                }
                take_batch(&mut queue.waiting)
            };
            let store = &self.store;
            let sent = store.bounded(store.renew_all(&batch)).await;
            tracing::trace!(table = %store.inner.table, claims = batch.len(), ok = sent.is_ok(), "idem: renewals sent");
            for renewal in batch {
                let answer = match &sent {
                    Ok((renewed, _)) if renewed.contains(&renewal.key) => Ok(Fenced::Applied),
                    Ok((_, held)) if held.contains(&renewal.key) => Err(pg_error(format!(
                        "the row of `{}` is locked by another transaction; the claim was not renewed",
                        renewal.key
                    ))),
                    Ok(_) => Ok(Fenced::LostLease),
                    Err(error) => Err(each(error)),
                };
                // A renewal that gave up waiting (its timeout) no longer listens.
                let _ = renewal.answer.send(answer);
            }
        }
    }
}

impl Drop for Sender {
    /// Dropped unfinished (its runtime shut down, or a panic): the renewals waiting get
    /// an error (their answers are dropped), and the next renewal starts a new task.
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

/// Takes up to [`BATCH`] renewals from `waiting`, the first come, no key twice (one
/// statement updates a row once): a second renewal of a key waits for the next.
fn take_batch(waiting: &mut Vec<Renewal>) -> Vec<Renewal> {
    let mut keys = HashSet::new();
    let (mut batch, mut rest) = (Vec::new(), Vec::new());
    for renewal in waiting.drain(..) {
        if batch.len() < BATCH && keys.insert(renewal.key.clone()) {
            batch.push(renewal);
        } else {
            rest.push(renewal);
        }
    }
    *waiting = rest;
    batch
}

/// The statement's failure, for each renewal it carried: the same kind and text.
fn each(error: &Error) -> Error {
    let text = match error {
        Error::Store { source, .. } => crate::error::chain(&**source),
        other => other.to_string(),
    };
    let kind = error.store_kind().unwrap_or(StoreErrorKind::Other);
    Error::store_of_kind(STORE, kind, text)
}
