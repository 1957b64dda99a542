//! `PostgresStore`: records in a PostgreSQL table, for fleets of workers (its docs give
//! the table, the statements, the clock and the timeouts).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Pool;
use tokio::sync::{Semaphore, SemaphorePermit};
use tokio_postgres::error::SqlState;
use tokio_postgres::{Row, Statement};

use crate::error::{Error, StoreErrorKind};
use crate::key_text::Key;
use crate::record::{Record, Timestamp};
use crate::store::net;

mod builder;
mod decode;
mod migrate;
mod ops;
mod prepared;
mod renewals;
mod sql;

pub use builder::PostgresStoreBuilder;
use decode::decode_read;
use sql::{Params, Sql};

const STORE: &str = "postgres";

/// A store in a PostgreSQL table, for workers on many machines. Cheap to clone.
///
/// ```no_run
/// # async fn demo() -> Result<(), idem_core::Error> {
/// use idem_core::{PostgresStore, Run};
///
/// let store = PostgresStore::connect("postgres://app@db.internal/agents").await?;
/// let run = Run::new("run-42").with_store(store);
/// # Ok(()) }
/// ```
///
/// `PostgresStore`: records in one PostgreSQL table, shared by a fleet of workers
/// (feature `postgres`).
///
/// # Schema
///
/// Created by [`PostgresStore::connect`] (and [`PostgresStore::migrate`]), under an
/// advisory lock so workers starting together do not race. The table name is
/// configurable (`idem_records` by default):
///
/// ```sql
/// CREATE TABLE IF NOT EXISTS idem_records (
///     key         text        PRIMARY KEY,  -- `<tool>.<sha-256 hex>`
///     fingerprint bytea       NOT NULL,     -- SHA-256 of the call: key parts and whole input
///     state       smallint    NOT NULL,     -- 0 in progress, 1 completed, 2 failed
///     token       bytea       NOT NULL,     -- fencing token of the call that claimed it
///     lease_until timestamptz,              -- in progress: when the claim counts as abandoned
///     payload     bytea,                    -- completed / failed: the result or error, JSON
///     created_at  timestamptz NOT NULL,     -- the row's last write
///     expires_at  timestamptz NOT NULL,     -- the row is absent to idem from then on
///     -- who and what happened, for operators (no decision reads them):
///     run_id text, tenant text, call_id text, tool text,
///     claimed_at timestamptz, completed_at timestamptz, renewed_at timestamptz,
///     attempts integer NOT NULL DEFAULT 0, takeovers integer NOT NULL DEFAULT 0,
///     result jsonb                          -- the result or error again, for SQL
/// );
/// CREATE INDEX IF NOT EXISTS idem_records_expires_at ON idem_records (expires_at);
/// ```
///
/// and the listings' indexes: `(run_id, key) WHERE state <> 0` and `(tool, key) WHERE
/// state <> 0` (settled rows: a claim adds no entry to them, so a miss adds one to
/// each, not two; a listing reads the rows in progress through the next one),
/// `(lease_until) WHERE state = 0`, and `(key) WHERE result IS NULL AND state <> 0`
/// (results still to fill). A new table gets them as it is made; an existing one,
/// concurrently, by one worker, in the background of `connect` (which returns within
/// the store's timeout: `CREATE INDEX CONCURRENTLY` waits for every older transaction
/// in the database), or waited for by `migrate()`; the run and tool indexes of every
/// row that earlier builds made are then dropped, concurrently too. A result `jsonb`
/// refuses (a `\u0000` escape, a number beyond `numeric`) fails the completion's
/// statement, which is then made again with `result` NULL: no result fails its
/// completion. A table of idem 0.1 (without the metadata) is upgraded in place: each
/// step runs only when its object is missing, the columns are added without a rewrite
/// under a lock given up after the timeout, and results are filled 1,000 rows a
/// statement (`docs/operations.md`).
///
/// # Statements
///
/// Every time comes from the **database clock** (`now()`), so workers with skewed
/// clocks agree on leases and expiry, except [`Claim::Busy`](crate::store::Claim::Busy)'s `lease_until`, which is
/// converted to this process's clock, the one a waiting call sleeps by.
///
/// - **claim** is one statement in the common cases: it inserts a fresh claim if the
///   key has no row, and reads the row that was there and the database time:
///
///   ```sql
///   WITH found AS (SELECT fingerprint, state, token, lease_until, payload, expires_at
///                  FROM idem_records WHERE key = $1),
///        fresh AS (INSERT INTO idem_records (key, ...) SELECT $1, ...
///                  WHERE NOT EXISTS (SELECT 1 FROM found)
///                  ON CONFLICT (key) DO NOTHING RETURNING 1)
///   SELECT found.*, now(), (SELECT count(*) FROM fresh)
///   FROM (SELECT 1) AS one LEFT JOIN found ON true
///   ```
///
///   It reads what the claim decides by, no more: a record's metadata (origin, times,
///   counts) is written with the claim and read by the operator API, never by a hit.
///
///   A first call (the miss path) is claimed by it, so a miss is two statements and two
///   commits: this one and the completion. When the key has a row, nothing is inserted
///   (the transaction stays read-only; a row that another caller committed after the
///   statement's snapshot meets `DO NOTHING` instead, and the claim reads again), and
///   the row read decides: a completed row (the hit path), a live claim or another fingerprint
///   needs nothing more, so a hit is one statement too. When the row is claimable
///   (expired, abandoned, failed), a second statement claims it, deciding again under
///   the row lock:
///
///   ```sql
///   INSERT INTO idem_records AS r (key, fingerprint, state, token, lease_until, payload, created_at, expires_at)
///   VALUES ($1, $2, 0, $3, now() + $4 ms, NULL, now(), now() + $5 ms)  -- $5: lease + TTL
///   ON CONFLICT (key) DO UPDATE SET fingerprint = EXCLUDED.fingerprint, state = 0, ...
///   WHERE r.expires_at <= now()                                  -- expired: absent
///      OR (r.fingerprint = EXCLUDED.fingerprint AND (
///             (r.state = 0 AND r.lease_until <= now() AND $6)   -- abandoned, take over
///          OR (r.state = 2 AND $7)))                            -- failed, retry
///   RETURNING 1
///   ```
///
///   No row back means another caller won in between: the claim starts over and
///   reports what it finds.
///
///   While claims come in a streak of one kind (the last 16 claims on the store each
///   found a row and wrote nothing, as a run being replayed makes them, or each claimed
///   a new key, as a run doing new work makes them), a claim sends that kind's statement
///   first, which costs the server less than the statement above:
///
///   - in a streak of hits, a plain `SELECT … WHERE key = $1` of the same columns,
///     decided by the same rule: a completed row, a live claim or another fingerprint
///     is answered by it alone (the claim statement's `INSERT` is opened with the
///     table's indexes even when it inserts nothing);
///   - in a streak of misses, a plain `INSERT … ON CONFLICT (key) DO NOTHING RETURNING
///     1`: a new key is claimed by it alone (without the claim statement's read, `NOT
///     EXISTS` and count around it).
///
///   A claim of the other kind goes on to the statements above and ends the streak, so
///   it pays one more round trip at most once per streak.
/// - **complete**: `UPDATE .. SET state = 1, payload = $p, expires_at = now() + ttl
///   WHERE key = $1 AND state = 0 AND token = $2 AND expires_at > now()`. In this and
///   the statements below, what follows `key = $1` is written as one `CASE` that no
///   index serves: every plan then finds the row by the primary key, even one made on
///   stale statistics, which would otherwise walk the expiry index (every live row) or
///   the in-progress one.
/// - **release**: `DELETE .. WHERE key = $1 AND state = 0 AND token = $2 AND
///   expires_at > now()`.
/// - **renew** (a running body's heartbeat): every claim waiting to be renewed, in one
///   statement (see *Failures* below):
///
///   ```sql
///   WITH w AS (SELECT * FROM unnest($keys, $tokens, $leases, $ttls) AS w(key, token, lease, ttl)),
///   renewed AS (UPDATE idem_records AS r SET lease_until = now() + w.lease ms,
///           expires_at = now() + w.ttl ms, renewed_at = now()   -- w.ttl: lease + TTL
///       FROM w
///       WHERE r.key = w.key
///         AND r.key = ANY(ARRAY(SELECT key FROM idem_records WHERE key = ANY($keys)
///                               FOR UPDATE SKIP LOCKED))
///         AND r.state = 0 AND r.token = w.token AND r.expires_at > now()
///       RETURNING r.key)
///   SELECT w.key, EXISTS (SELECT 1 FROM renewed WHERE renewed.key = w.key),
///          r.state = 0 AND r.token = w.token AND r.expires_at > now()
///   FROM w LEFT JOIN idem_records AS r ON r.key = w.key
///   ```
///
///   Each claim comes back renewed, or not: then, if its row was still the caller's
///   claim as the statement began (the main query does not see the `UPDATE`), the row
///   was locked elsewhere and the renewal is sent again; else the claim is lost.
/// - **purge**: batches of at most 10,000 rows, in order of expiry, each one statement:
///
///   ```sql
///   WITH gone AS (DELETE FROM idem_records WHERE ctid = ANY(ARRAY(
///           SELECT ctid FROM idem_records WHERE expires_at <= now() AND expires_at >= $1
///           ORDER BY expires_at LIMIT $2))
///       AND expires_at <= now() RETURNING expires_at)
///   SELECT count(*), max(expires_at) FROM gone
///   ```
///
///   until a batch comes back short. `$1` is the last batch's latest expiry (in whole
///   milliseconds, rounded down, so rows sharing it are not skipped; `-infinity` for
///   the first batch, and after one whose latest expiry is not after 1970, so rows
///   written by hand to expire before 1970 go too): each batch starts
///   where the last one ended, and does not walk the index entries of the rows just
///   deleted. Every statement stays well within the store's timeout whatever the
///   backlog (one `DELETE` of 10⁶ rows took 0.6–0.9 s here, so a backlog of some
///   millions would outlast the 5-second default and the purge would report a
///   timeout), and no transaction holds locks and piles up WAL for long. A row that a
///   claim re-claims meanwhile gets a new version that is not expired: the outer test
///   keeps it.
///
/// # Failures
///
/// A running call's renewals do not queue behind other calls for a pooled connection.
/// They queue in the store, and one statement at a time renews every claim waiting
/// (`UPDATE … FROM unnest(…)`), on a connection asked of the pool ahead of the calls:
/// calls wait for a turn before they ask the pool, one turn per connection. Renewals
/// then hold one connection at most, however many bodies run, and wait behind as many
/// calls at most as the pool has connections, never behind a burst of thousands of
/// claims: a busy pool does not hold a live call's renewal past its lease, where another
/// worker would take the claim over. A row locked by another transaction is skipped
/// (`SKIP LOCKED`), not waited for on a connection: the other claims in the statement
/// are renewed, and its renewal goes back in the queue, sent again every 10 ms until
/// the lock goes (or the caller stops waiting, at the store's timeout). A
/// statement the server refuses for one claim's values is sent again claim by claim, so
/// that claim's renewal alone fails. While calls hold every turn, the renewals rest
/// between statements as long as the last one took, so that a pool of one connection
/// keeps half of it for the calls.
///
/// A pooled session that lost its prepared statements (`DISCARD ALL`, `DEALLOCATE`,
/// run by hand or by a pooler) has them prepared again the first time a statement
/// meets their absence; that statement then runs once more (one the session did not
/// have ran nothing).
///
/// Every operation is bounded by the store's timeout (5 seconds by default, covering
/// the connection, the wait for a pooled connection and the statement): an unreachable
/// or stopped server is an [`Error::Store`] within that time, and the operation is not
/// run.
#[derive(Clone)]
pub struct PostgresStore {
    inner: Arc<Inner>,
}

struct Inner {
    pool: Pool,
    /// Turns at the pool for every operation but the renewals', one per connection:
    /// calls queue here, not in the pool's own queue, so that the renewals' statement
    /// asks the pool behind as many calls at most as the pool has connections.
    calls: Semaphore,
    /// Renewals waiting for their statement (see [`renewals`]).
    renewals: renewals::Renewals,
    table: String,
    timeout: Duration,
    sql: Sql,
    prepared: prepared::Prepared,
    /// Which statement claims send first (see [`net::Streak`]).
    streak: net::Streak,
}

/// A pooled connection, with the turn at the pool it was taken with (none for the
/// renewals').
struct Session<'a> {
    /// Declared first, so that it goes back to the pool (to the renewals' statement, if
    /// it waits there) before the turn goes to the next call.
    object: deadpool_postgres::Object,
    _turn: Option<SemaphorePermit<'a>>,
}

impl std::ops::Deref for Session<'_> {
    type Target = deadpool_postgres::Object;

    fn deref(&self) -> &Self::Target {
        &self.object
    }
}

/// A result as text for the `result jsonb` column, or `None` if it is not UTF-8 or holds
/// a NUL. Text `jsonb` refuses fails the statement, which is then made again without it
/// (see `PostgresStore::recorded`). The exact bytes stay in `payload` either way, and
/// replays read those.
fn as_text(payload: &[u8]) -> Option<&str> {
    std::str::from_utf8(payload)
        .ok()
        .filter(|text| !text.contains('\0'))
}

/// Whether the server refused a write for its `result` text: a data error (class 22:
/// JSON `jsonb` refuses, a number beyond `numeric`, an encoding that cannot hold a
/// character) or a limit (class 54: nesting too deep). Nothing was written; the write
/// can be made without it.
fn refuses_result(e: &tokio_postgres::Error) -> bool {
    e.code()
        .is_some_and(|code| code.code().starts_with("22") || code.code().starts_with("54"))
}

/// A Postgres failure with its whole cause: the server's message and SQLSTATE, or the
/// connection's OS error; the original error stays its source.
fn pg_error(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Error {
    net::failure(STORE, e, |error, text| {
        let mut next = Some(error);
        while let Some(level) = next {
            if let Some(db) = level.downcast_ref::<tokio_postgres::error::DbError>() {
                text.push_str(&format!(" (SQLSTATE {})", db.code().code()));
                return match *db.code() {
                    tokio_postgres::error::SqlState::UNDEFINED_TABLE => {
                        StoreErrorKind::TableMissing
                    }
                    _ => StoreErrorKind::Other,
                };
            }
            next = level.source();
        }
        StoreErrorKind::Other
    })
}

/// A statement running, in a box of its own (see `PostgresStore::client`).
type Pending<'a, T> = Pin<Box<dyn Future<Output = Result<T, tokio_postgres::Error>> + Send + 'a>>;

/// How many times a statement is prepared and run when the session's prepared
/// statements no longer serve (see `PostgresStore::on`).
const PREPARE_ATTEMPTS: usize = 8;

/// Whether the server refused a prepared statement because a column it returns changed
/// type since it was prepared. That error's SQLSTATE (0A000, "feature not supported")
/// also covers errors that preparing again would not mend (`infinity` cast to `int8`),
/// so it is told by the server routine that raises it, or by its message.
fn stale_plan(e: &tokio_postgres::Error) -> bool {
    e.as_db_error().is_some_and(|db| {
        *db.code() == SqlState::FEATURE_NOT_SUPPORTED
            && (db.routine() == Some("RevalidateCachedQuery")
                || db.message() == "cached plan must not change result type")
    })
}

/// Milliseconds as Postgres' `int8`.
fn millis(d: Duration) -> i64 {
    i64::try_from(crate::record::millis(d)).unwrap_or(i64::MAX)
}

impl PostgresStore {
    /// Connects to `url` (`postgres://user@host:port/db`) with the defaults and creates
    /// the table if it is missing.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        Self::builder(url).connect().await
    }

    /// A builder, to choose the table, the timeout or the pool size.
    pub fn builder(url: &str) -> PostgresStoreBuilder {
        PostgresStoreBuilder::new(url)
    }

    /// The table, quoted as it appears in SQL.
    pub fn table(&self) -> &str {
        &self.inner.table
    }

    /// The store's connection pool, for idem's own benchmarks and tests (a floor on
    /// the same server processes, a table filled by hand). Not public API: its type is
    /// `deadpool_postgres`'s, whose version may change in any release.
    #[doc(hidden)]
    pub fn pool(&self) -> &Pool {
        &self.inner.pool
    }
}

impl PostgresStore {
    /// Runs `f` within the store's timeout (a plain `fn`: an `async fn` would hold `f`
    /// twice, in every operation's future).
    fn bounded<F>(&self, f: F) -> net::Bounded<F> {
        net::bounded(STORE, self.inner.timeout, f)
    }

    /// A pooled connection. The futures of the pool and of `tokio_postgres` are boxed
    /// where the hot paths await them (`claim`, `modified`, `recorded`): each store
    /// operation's future is moved into its own box and its timeout, and holding them
    /// in line made every move copy them all (a quarter of a hit's client
    /// instructions were `memcpy`). A call's connection waits for a turn first (see
    /// [`Inner::calls`]).
    async fn client(&self) -> Result<Session<'_>, Error> {
        let turn = self.inner.calls.acquire().await.map_err(pg_error)?;
        let object = Box::pin(self.inner.pool.get()).await.map_err(pg_error)?;
        Ok(Session {
            object,
            _turn: Some(turn),
        })
    }

    /// A pooled connection for the renewals' statement, asked of the pool without a
    /// turn (see [`Inner::calls`]).
    async fn renewal_client(&self) -> Result<Session<'_>, Error> {
        let object = Box::pin(self.inner.pool.get()).await.map_err(pg_error)?;
        Ok(Session {
            object,
            _turn: None,
        })
    }

    /// `sql` prepared on `client`: found by the connection and the statement's place
    /// when it is one of the store's own (see [`prepared`]).
    async fn prepare(
        &self,
        client: &deadpool_postgres::Object,
        sql: &str,
    ) -> Result<tokio_postgres::Statement, tokio_postgres::Error> {
        self.inner.prepared.get(&self.inner.sql, client, sql).await
    }

    /// Runs `sql`, prepared on `client`, with `run`. A session whose prepared statements
    /// no longer serve has them prepared again, and the statement runs once more:
    ///
    /// - it lost them (`DISCARD ALL`, `DEALLOCATE`, run on it by hand or by a pooler):
    ///   a statement the session did not have ran nothing;
    /// - a column they return changed type (`ALTER TABLE … ALTER COLUMN … TYPE`, even
    ///   to `timestamptz(3)`: the statements return the time columns as stored), and the
    ///   server refuses them (`cached plan must not change result type`, SQLSTATE
    ///   0A000) before they run. A statement that failed ran nothing either way: each is
    ///   a transaction of its own.
    ///
    /// Up to [`PREPARE_ATTEMPTS`] times: a migration that alters several columns, one
    /// statement each, can change the table again between a statement's new preparation
    /// and its run. The operation's timeout bounds them all.
    async fn on<'a, T>(
        &self,
        client: &deadpool_postgres::Object,
        sql: &str,
        run: impl Fn(Statement) -> Pending<'a, T>,
    ) -> Result<T, tokio_postgres::Error> {
        let mut attempt = 1;
        loop {
            let stmt = Box::pin(self.prepare(client, sql)).await?;
            match run(stmt).await {
                Err(e)
                    if attempt < PREPARE_ATTEMPTS
                        && (e.code() == Some(&SqlState::INVALID_SQL_STATEMENT_NAME)
                            || stale_plan(&e)) =>
                {
                    tracing::debug!(table = %self.inner.table, error = %e, "idem: the session's prepared statements no longer serve; preparing them again");
                    self.inner.prepared.forget(client);
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    /// Reads the record under `key` (expired or not) and the database time.
    async fn read(
        &self,
        client: &deadpool_postgres::Object,
        key: &Key,
    ) -> Result<(Option<Record>, Timestamp), Error> {
        let key_text = key.as_str();
        let read = |stmt: Statement| -> Pending<'_, Row> {
            Box::pin(async move { client.query_one(&stmt, &[&key_text]).await })
        };
        let row = self
            .on(client, &self.inner.sql.read, read)
            .await
            .map_err(pg_error)?;
        decode_read(key, &row)
    }

    async fn modified(
        &self,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<u64, Error> {
        let client = self.client().await?;
        let client = &client;
        let execute = |stmt: Statement| -> Pending<'_, u64> {
            Box::pin(async move { client.execute(&stmt, params).await })
        };
        self.on(client, sql, execute).await.map_err(pg_error)
    }

    /// Records an outcome with `sql`, whose last parameter is the result's text for the
    /// `result` column. Where the server refuses that text (JSON `jsonb` refuses, a
    /// number beyond `numeric`, an encoding that cannot hold it), the write is made
    /// again with `plain`, which leaves `result` NULL: the outcome is recorded either
    /// way, since a retry that found none would run the body again.
    async fn recorded(
        &self,
        (sql, plain): (&str, &str),
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<u64, Error> {
        let client = self.client().await?;
        let client = &client;
        let execute = |stmt: Statement| -> Pending<'_, u64> {
            Box::pin(async move { client.execute(&stmt, params).await })
        };
        match self.on(client, sql, execute).await {
            Ok(n) => Ok(n),
            Err(e) if refuses_result(&e) => {
                tracing::debug!(table = %self.inner.table, error = %e, "idem: the `result` column is left NULL for this outcome");
                let without_text = &params[..params.len() - 1];
                let execute = |stmt: Statement| -> Pending<'_, u64> {
                    Box::pin(async move { client.execute(&stmt, without_text).await })
                };
                self.on(client, plain, execute).await.map_err(pg_error)
            }
            Err(e) => Err(pg_error(e)),
        }
    }

    /// Runs a statement built with its parameters (a listing's, a count's), within the
    /// store's timeout.
    async fn query(&self, sql: &str, params: &Params) -> Result<Vec<Row>, Error> {
        self.bounded(async {
            let client = self.client().await?;
            let (client, params) = (&client, &params.as_refs());
            let query = |stmt: Statement| -> Pending<'_, Vec<Row>> {
                Box::pin(async move { client.query(&stmt, params).await })
            };
            self.on(client, sql, query).await.map_err(pg_error)
        })
        .await
    }

    /// Runs `sql`, a statement that returns at most one row, and returns that row.
    async fn row(
        &self,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Option<Row>, Error> {
        let client = self.client().await?;
        self.row_on(&client, sql, params).await
    }

    /// [`PostgresStore::row`] on a connection the caller holds (a claim's).
    async fn row_on(
        &self,
        client: &deadpool_postgres::Object,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Option<Row>, Error> {
        let query = |stmt: Statement| -> Pending<'_, Option<Row>> {
            Box::pin(async move { client.query_opt(&stmt, params).await })
        };
        self.on(client, sql, query).await.map_err(pg_error)
    }
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("table", &self.inner.table)
            .finish()
    }
}
