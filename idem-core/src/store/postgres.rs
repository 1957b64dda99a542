//! `PostgresStore`: records in a PostgreSQL table, for fleets of workers (its docs give
//! the table, the statements, the clock and the timeouts).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::{NoTls, Row};

use crate::error::{Error, StoreErrorKind};
use crate::key::Fingerprint;
use crate::key_text::Key;
use crate::record::{Meta, Origin, Record, State, Timestamp, Token};
use crate::store::net::{self, fenced, in_local_clock};
use crate::store::{
    decide_claim, Claim, ClaimRequest, Counts, Cursor, Fenced, Filter, Listed, Outcome, Page,
    Resolution, StateKind, Store, Unreadable,
};

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
/// and the listings' indexes: `(run_id, key)`, `(tool, key)`, `(lease_until) WHERE state
/// = 0`, and `(key) WHERE result IS NULL AND state <> 0` (results still to fill). A new
/// table gets them as it is made; an existing one, concurrently, by one worker, in the
/// background of `connect` (which returns within the store's timeout: `CREATE INDEX
/// CONCURRENTLY` waits for every older transaction in the database), or waited for by
/// `migrate()`. A result `jsonb` refuses (a `\u0000` escape, a
/// number beyond `numeric`) fails the completion's statement, which is then made again
/// with `result` NULL: no result fails its completion. A table of idem 0.1 (without the metadata) is
/// upgraded in place: each step runs only when its object is missing, the columns are
/// added without a rewrite under a lock given up after the timeout, and results are
/// filled 1,000 rows a statement (`docs/operations.md`).
///
/// # Statements
///
/// Every time comes from the **database clock** (`now()`), so workers with skewed
/// clocks agree on leases and expiry, except [`Claim::Busy`]'s `lease_until`, which is
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
/// - **complete**: `UPDATE .. SET state = 1, payload = $p, expires_at = now() + ttl
///   WHERE key = $1 AND state = 0 AND token = $2 AND expires_at > now()`.
/// - **release**: `DELETE .. WHERE key = $1 AND state = 0 AND token = $2 AND
///   expires_at > now()`.
/// - **renew** (a running body's heartbeat): `UPDATE .. SET lease_until = now() +
///   lease, expires_at = now() + lease + ttl WHERE key = $1 AND state = 0 AND token =
///   $2 AND expires_at > now()`.
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
///   milliseconds, rounded down, so rows sharing it are not skipped): each batch starts
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
    table: String,
    timeout: Duration,
    sql: Sql,
}

/// Configures a [`PostgresStore`]: table name, timeout, pool size.
#[derive(Debug, Clone)]
pub struct PostgresStoreBuilder {
    url: String,
    table: String,
    timeout: Duration,
    max_connections: usize,
}

impl PostgresStoreBuilder {
    /// The table that holds the records (`idem_records` by default). A plain or
    /// schema-qualified identifier: letters, digits and `_`, not starting with a digit.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// The bound on every operation, connecting included (5 seconds by default).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The most connections the store's pool opens (16 by default).
    pub fn max_connections(mut self, n: usize) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// Builds the store without connecting: connections open on first use. Does not
    /// create the table; call [`PostgresStore::migrate`].
    pub fn build(self) -> Result<PostgresStore, Error> {
        let table = quote_table(&self.table)?;
        let mut config: tokio_postgres::Config = self.url.parse().map_err(|e| {
            Error::store_of_kind(
                STORE,
                StoreErrorKind::Config,
                format!("invalid connection URL: {e}"),
            )
        })?;
        config.connect_timeout(self.timeout);
        config.keepalives(true);
        config.keepalives_idle(Duration::from_secs(30));
        let manager = Manager::from_config(
            config,
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(self.max_connections)
            .wait_timeout(Some(self.timeout))
            .create_timeout(Some(self.timeout))
            .recycle_timeout(Some(self.timeout))
            .runtime(Runtime::Tokio1)
            .build()
            .map_err(|e| Error::store(STORE, e))?;
        Ok(PostgresStore {
            inner: Arc::new(Inner {
                pool,
                sql: Sql::new(&table),
                table,
                timeout: self.timeout,
            }),
        })
    }

    /// Builds the store, connects, and creates the table if it is missing (or adds the
    /// columns a table of idem 0.1 lacks), within the store's timeout, whatever other
    /// sessions do. The operators' indexes are then built in the background by one
    /// worker (see [`PostgresStore::migrate`]): calls do not need them.
    pub async fn connect(self) -> Result<PostgresStore, Error> {
        let store = self.build()?;
        store.create_table(store.inner.timeout).await?;
        let building = store.clone();
        tokio::spawn(async move {
            if let Err(error) = building.build_indexes(false).await {
                tracing::warn!(table = %building.inner.table, %error, "idem: building the operators' indexes failed; `PostgresStore::migrate()` builds them (listings are slower meanwhile, calls are not)");
            }
        });
        Ok(store)
    }
}

/// `"schema"."table"`, or an error for anything but plain identifiers.
fn quote_table(name: &str) -> Result<String, Error> {
    let parts: Vec<&str> = name.split('.').collect();
    let valid = |p: &&str| {
        !p.is_empty()
            && p.len() <= 63
            && !p.starts_with(|c: char| c.is_ascii_digit())
            && p.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    };
    if parts.len() > 2 || !parts.iter().all(valid) {
        return Err(Error::store_of_kind(
            STORE,
            StoreErrorKind::Config,
            format!("invalid table name `{name}`: use letters, digits and `_` (optionally `schema.table`)"),
        ));
    }
    Ok(parts
        .iter()
        .map(|p| format!("\"{p}\""))
        .collect::<Vec<_>>()
        .join("."))
}

/// The columns format 2 added to the table (one per line: `migrate` adds each to a
/// table of idem 0.1).
const COLUMNS_V2: &str = "run_id       text,
tenant       text,
call_id      text,
tool         text,
claimed_at   timestamptz,
completed_at timestamptz,
renewed_at   timestamptz,
attempts     integer     NOT NULL DEFAULT 0,
takeovers    integer     NOT NULL DEFAULT 0,
result       jsonb";

/// The indexes of the operators' listings: by run, by tool (each in key order, as
/// pages are read), and the claims in progress by lease (stuck calls); and the rows
/// whose `result` is still to fill.
const INDEXES: [(&str, &str); 4] = [
    ("run", "(run_id, key)"),
    ("tool", "(tool, key)"),
    ("in_progress", "(lease_until) WHERE state = 0"),
    ("unfilled", "(key) WHERE result IS NULL AND state <> 0"),
];

/// The bound on each step of a migration: building an index on a large table takes
/// longer than an operation's timeout.
const MIGRATE_TIMEOUT: Duration = Duration::from_secs(600);

/// An index of table `t` (quoted, maybe schema-qualified; `base` its unquoted name):
/// its name as `CREATE INDEX` takes it, and qualified by the table's schema.
fn index_name(t: &str, base: &str, suffix: &str) -> (String, String) {
    // Postgres cuts names at 63 bytes: a long table's index names would meet the
    // table's own. Those are named by a hash of the table's name instead.
    let name = match base.len() + 1 + suffix.len() <= 63 {
        true => format!("\"{base}_{suffix}\""),
        false => {
            let hash = base.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
            });
            format!("\"idem_{hash:016x}_{suffix}\"")
        }
    };
    let qualified = match t.rsplit_once('.') {
        Some((schema, _)) => format!("{schema}.{name}"),
        None => name.clone(),
    };
    (name, qualified)
}

/// A migration's connection: dropped without being let go of (an error, a dropped
/// future), it is closed, not returned to the pool, so a failed transaction or the
/// session's advisory lock goes with it.
struct Held(Option<deadpool_postgres::Object>);

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(client) = self.0.take() {
            drop(deadpool_postgres::Object::take(client));
        }
    }
}

/// The most rows one statement of a purge deletes: about 0.1 s of work.
const PURGE_BATCH: i64 = 10_000;

/// The statements, with the table name filled in.
struct Sql {
    table: String,
    read: String,
    claim_fresh: String,
    claim: String,
    complete: String,
    complete_plain: String,
    renew: String,
    release: String,
    delete: String,
    delete_settled: String,
    purge: String,
    resolve_completed: String,
    resolve_completed_plain: String,
    resolve_released: String,
}

/// Milliseconds since the Unix epoch of a `timestamptz` expression; NULL stays NULL,
/// and a time out of `int8`'s range (`infinity`, written by hand) is cut to its bounds.
fn ms(expr: &str) -> String {
    format!(
        "(CASE WHEN {expr} IS NULL THEN NULL \
          ELSE least(greatest(extract(epoch from {expr}) * 1000, 0), {MAX_MS})::int8 END)"
    )
}

/// The latest time `ms` gives: about 285,000 years from 1970.
const MAX_MS: i64 = 9_000_000_000_000_000;

impl Sql {
    fn new(t: &str) -> Self {
        // An outcome's write, with `result` set to `result` (its text through the
        // function, or NULL when the server refuses that).
        let complete = |result: &str| {
            format!(
                "UPDATE {t} SET state = $3, payload = $4, result = {result}, lease_until = NULL, \
                 created_at = now(), completed_at = now(), \
                 expires_at = now() + $5::int8 * interval '1 millisecond' \
                 WHERE key = $1 AND state = 0 AND token = $2 AND expires_at > now()"
            )
        };
        let resolve_completed = |result: &str| {
            format!(
                "UPDATE {t} SET state = 1, payload = $3, result = {result}, lease_until = NULL, \
                 created_at = now(), completed_at = now(), \
                 expires_at = now() + $4::int8 * interval '1 millisecond' \
                 WHERE key = $1 AND {ABANDONED} AND token = $2 AND expires_at > now()"
            )
        };
        // The row under `$1` (all NULL if there is none) and the database time.
        let read = format!("SELECT {}, {now}", columns(), now = ms("now()"));
        let from = format!("FROM (SELECT 1) AS one LEFT JOIN {t} AS r ON r.key = $1");
        // A claim of `$1`: fingerprint, token, lease ms, ttl ms.
        // The claim's origin: $6 run id, $7 tenant, $8 call id, $9 tool.
        let insert = format!(
            "INSERT INTO {t} AS r (key, fingerprint, state, token, lease_until, payload, created_at, expires_at, \
                 run_id, tenant, call_id, tool, claimed_at, attempts, takeovers) \
             VALUES ($1, $2, 0, $3, now() + $4::int8 * interval '1 millisecond', NULL, now(), \
                     now() + $5::int8 * interval '1 millisecond', $6, $7, $8, $9, now(), 1, 0)"
        );
        // The same claim, inserted by a `SELECT` that a `WHERE` can make empty.
        let insert_select = format!(
            "INSERT INTO {t} AS r (key, fingerprint, state, token, lease_until, payload, created_at, expires_at, \
                 run_id, tenant, call_id, tool, claimed_at, attempts, takeovers) \
             SELECT $1::text, $2::bytea, 0, $3::bytea, now() + $4::int8 * interval '1 millisecond', NULL, now(), \
                    now() + $5::int8 * interval '1 millisecond', $6::text, $7::text, $8::text, $9::text, now(), 1, 0"
        );
        Sql {
            read: format!("{read} {from}"),
            // What the claim decides by (see `claim_columns`), not the whole row.
            // The row is read first and the claim inserted only when the statement's
            // snapshot sees none: a key with a row (a hit) then costs the server a read,
            // not an insertion's conflict check on the primary key.
            claim_fresh: format!(
                "WITH found AS (SELECT {columns} FROM {t} AS r WHERE r.key = $1), \
                 fresh AS ({insert_select} WHERE NOT EXISTS (SELECT 1 FROM found) \
                     ON CONFLICT (key) DO NOTHING RETURNING 1) \
                 SELECT found.*, {now}, (SELECT count(*) FROM fresh) \
                 FROM (SELECT 1) AS one LEFT JOIN found ON true",
                columns = claim_columns(),
                now = ms("now()"),
            ),
            // An expired row starts a new history; a takeover or a retry goes on with
            // the row's (a row of idem 0.1 has none: its times say when it was written).
            claim: format!(
                "{insert} \
                 ON CONFLICT (key) DO UPDATE SET fingerprint = EXCLUDED.fingerprint, state = 0, \
                     token = EXCLUDED.token, lease_until = EXCLUDED.lease_until, payload = NULL, \
                     result = NULL, created_at = EXCLUDED.created_at, expires_at = EXCLUDED.expires_at, \
                     run_id = EXCLUDED.run_id, tenant = EXCLUDED.tenant, call_id = EXCLUDED.call_id, \
                     tool = EXCLUDED.tool, completed_at = NULL, renewed_at = NULL, \
                     claimed_at = CASE WHEN r.expires_at <= now() THEN now() \
                         ELSE coalesce(r.claimed_at, r.created_at) END, \
                     attempts = CASE WHEN r.expires_at <= now() THEN 1 ELSE r.attempts + 1 END, \
                     takeovers = CASE WHEN r.expires_at <= now() THEN 0 \
                         WHEN r.state = 0 THEN r.takeovers + 1 ELSE r.takeovers END \
                 WHERE r.expires_at <= now() \
                    OR (r.fingerprint = EXCLUDED.fingerprint AND ( \
                           (r.state = 0 AND r.lease_until <= now() AND $10) \
                        OR (r.state = 2 AND $11))) \
                 RETURNING 1"
            ),
            // $6: the result as text for `result`, or NULL (see `as_text`).
            complete: complete("$6::text::jsonb"),
            complete_plain: complete("NULL"),
            renew: format!(
                "UPDATE {t} SET lease_until = now() + $3::int8 * interval '1 millisecond', \
                 expires_at = now() + $4::int8 * interval '1 millisecond', renewed_at = now() \
                 WHERE key = $1 AND state = 0 AND token = $2 AND expires_at > now()"
            ),
            resolve_completed: resolve_completed("$5::text::jsonb"),
            resolve_completed_plain: resolve_completed("NULL"),
            resolve_released: format!(
                "DELETE FROM {t} WHERE key = $1 AND {ABANDONED} AND token = $2 AND expires_at > now()"
            ),
            release: format!(
                "DELETE FROM {t} WHERE key = $1 AND state = 0 AND token = $2 AND expires_at > now()"
            ),
            delete: format!("DELETE FROM {t} WHERE key = $1 RETURNING expires_at > now()"),
            delete_settled: format!(
                "DELETE FROM {t} WHERE key = $1 AND expires_at > now() \
                 AND NOT (state = 0 AND lease_until > now())"
            ),
            // `$1` in whole milliseconds, rounded down from the last batch's latest expiry.
            purge: format!(
                "WITH gone AS (DELETE FROM {t} WHERE ctid = ANY(ARRAY( \
                     SELECT ctid FROM {t} WHERE expires_at <= now() \
                     AND expires_at >= to_timestamp($1::int8 / 1000.0) \
                     ORDER BY expires_at LIMIT $2)) \
                 AND expires_at <= now() RETURNING expires_at) \
                 SELECT count(*), \
                     coalesce(floor(extract(epoch from max(expires_at)) * 1000)::int8, 0) \
                 FROM gone"
            ),
            table: t.to_owned(),
        }
    }

    /// A listing's statement: the rows matching `filter` past the key `$1` (or from
    /// the first, when NULL), in key order, at most `$2`.
    fn list(&self, filter: &Filter) -> (String, Params) {
        let mut params = Params::default();
        params.push(None::<String>);
        params.push(0i64);
        let conditions = conditions(filter, &mut params);
        let sql = format!(
            "SELECT r.key, {columns}, {now} FROM {t} AS r \
             WHERE r.expires_at > now() AND ($1::text IS NULL OR r.key > $1) {conditions} \
             ORDER BY r.key LIMIT $2",
            columns = columns(),
            now = ms("now()"),
            t = self.table,
        );
        (sql, params)
    }

    /// The counts by state of the rows matching `filter`.
    fn count(&self, filter: &Filter) -> (String, Params) {
        let mut params = Params::default();
        let conditions = conditions(filter, &mut params);
        let count = |kind| format!("count(*) FILTER (WHERE {})", state_condition(kind));
        let sql = format!(
            "SELECT {}, {}, {}, {} FROM {t} AS r WHERE r.expires_at > now() {conditions}",
            count(StateKind::Running),
            count(StateKind::Abandoned),
            count(StateKind::Completed),
            count(StateKind::Failed),
            t = self.table,
        );
        (sql, params)
    }

    /// One batch of deleting the rows matching `filter`: at most `$1` of them.
    fn delete_matching(&self, filter: &Filter) -> (String, Params) {
        let mut params = Params::default();
        params.push(PURGE_BATCH);
        let conditions = conditions(filter, &mut params);
        let t = &self.table;
        let sql = format!(
            "WITH gone AS (DELETE FROM {t} WHERE ctid = ANY(ARRAY( \
                 SELECT r.ctid FROM {t} AS r WHERE r.expires_at > now() {conditions} LIMIT $1)) \
             RETURNING 1) SELECT count(*) FROM gone"
        );
        (sql, params)
    }
}

/// The columns of a record, as `decode_row` reads them (a row of table `r`).
fn columns() -> String {
    format!(
        "r.fingerprint, r.state, r.token, {lease}, r.payload, {created}, {expires}, \
         r.run_id, r.tenant, r.call_id, r.tool, {claimed}, {completed}, {renewed}, \
         r.attempts, r.takeovers",
        lease = ms("r.lease_until"),
        created = ms("r.created_at"),
        expires = ms("r.expires_at"),
        claimed = ms("coalesce(r.claimed_at, r.created_at)"),
        completed = ms("r.completed_at"),
        renewed = ms("r.renewed_at"),
    )
}
/// How many columns [`columns`] has: the database time follows them.
const COLUMN_COUNT: usize = 16;

/// The columns a claim decides by (see `decide_claim`): the first five of [`columns`],
/// then the expiry. The record's metadata and write time are for operators, never for
/// decisions, and a hit does not read them.
fn claim_columns() -> String {
    format!(
        "r.fingerprint, r.state, r.token, {lease}, r.payload, {expires}",
        lease = ms("r.lease_until"),
        expires = ms("r.expires_at"),
    )
}
/// How many columns [`claim_columns`] has: the database time follows them, then whether
/// the statement inserted the claim.
const CLAIM_COLUMN_COUNT: usize = 6;

/// An in-progress row whose lease has run out.
const ABANDONED: &str = "state = 0 AND lease_until <= now()";

/// A statement's parameters, numbered in the order pushed.
#[derive(Default)]
struct Params(Vec<Box<dyn tokio_postgres::types::ToSql + Sync + Send>>);

impl Params {
    /// Adds a parameter; returns its placeholder (`$n`).
    fn push(&mut self, value: impl tokio_postgres::types::ToSql + Sync + Send + 'static) -> String {
        self.0.push(Box::new(value));
        format!("${}", self.0.len())
    }

    fn as_refs(&self) -> Vec<&(dyn tokio_postgres::types::ToSql + Sync)> {
        self.0.iter().map(|p| &**p as _).collect()
    }
}

/// The SQL condition of a state, on table `r`.
fn state_condition(kind: StateKind) -> &'static str {
    match kind {
        StateKind::Running => "r.state = 0 AND r.lease_until > now()",
        StateKind::Abandoned => "r.state = 0 AND r.lease_until <= now()",
        StateKind::Completed => "r.state = 1",
        StateKind::Failed => "r.state = 2",
    }
}

/// `filter` as ` AND ...` conditions on table `r`, with only the conditions it sets (so
/// each shape of filter is its own statement, and its index serves it).
fn conditions(filter: &Filter, params: &mut Params) -> String {
    let mut sql = String::new();
    if let Some(run) = &filter.run_id {
        sql += &format!(" AND r.run_id = {}", params.push(run.clone()));
    }
    if let Some(tenant) = &filter.tenant {
        sql += &format!(" AND r.tenant = {}", params.push(tenant.clone()));
    }
    if let Some(tool) = &filter.tool {
        // A row of idem 0.1 has no tool: its key's label names it.
        let label = format!("{}.%", Key::label_of(tool).replace('_', "\\_"));
        sql += &format!(
            " AND (r.tool = {} OR (r.tool IS NULL AND r.key LIKE {}))",
            params.push(tool.clone()),
            params.push(label)
        );
    }
    if let Some(state) = filter.state {
        sql += &format!(" AND {}", state_condition(state));
    }
    if let Some(before) = filter.claimed_before {
        let before = i64::try_from(before.as_millis()).unwrap_or(i64::MAX);
        sql += &format!(
            " AND coalesce(r.claimed_at, r.created_at) < to_timestamp({}::int8 / 1000.0)",
            params.push(before)
        );
    }
    sql
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
        PostgresStoreBuilder {
            url: url.to_owned(),
            table: "idem_records".to_owned(),
            timeout: Duration::from_secs(5),
            max_connections: 16,
        }
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

    /// Creates the table and its indexes if they are missing, and upgrades a table of
    /// idem 0.1 (idempotent; safe to run from many workers at once, and while calls
    /// run). See the type's docs for each step and the locks it takes.
    ///
    /// It returns once every step is done, which can take long: `CREATE INDEX
    /// CONCURRENTLY` waits for every transaction in the database that began before it
    /// (an idle session left in a transaction holds it up as long as it stays so), and
    /// filling the results of a large 0.1 table takes a while. [`PostgresStore::connect`]
    /// waits only for the table, and leaves the indexes to the background; run
    /// `migrate()` on its own (a deploy step, a job) to know when they are built.
    pub async fn migrate(&self) -> Result<(), Error> {
        self.create_table(MIGRATE_TIMEOUT).await?;
        self.build_indexes(true).await
    }

    /// The table, its expiry index, and for a table of idem 0.1 the new columns, each
    /// made only if missing, under an advisory lock, within `timeout`.
    async fn create_table(&self, timeout: Duration) -> Result<(), Error> {
        let t = &self.inner.table;
        let base = self.base_name();
        let lock = t.replace('\'', "");
        let (expires_index, expires_qualified) = index_name(t, &base, "expires_at");
        // A step that fails or is dropped closes the connection rather than return it
        // to the pool in a failed transaction.
        let mut held = Held(Some(net::bounded(STORE, timeout, self.client()).await?));
        let client = held
            .0
            .as_ref()
            .ok_or_else(|| pg_error("no migration connection"))?;
        let existing = format!(
            "SELECT to_regclass('{t}') IS NOT NULL, EXISTS (SELECT 1 FROM pg_attribute \
             WHERE attrelid = to_regclass('{t}') AND attname = 'result' AND NOT attisdropped)"
        );
        let existing = client.query_one(&existing, &[]);
        let existing =
            net::bounded(STORE, timeout, async { existing.await.map_err(pg_error) }).await?;
        let existed: bool = existing.try_get(0).map_err(pg_error)?;
        let had_columns: bool = existing.try_get(1).map_err(pg_error)?;
        // A new table gets every index at once: on a table no one else can see yet, a
        // plain `CREATE INDEX` waits for nothing. An existing one gets its expiry index
        // and, for a table of idem 0.1, the new columns: nullable or with a constant
        // default, so adding them rewrites nothing. Each is made only if missing,
        // checked under the lock: a DDL statement on an existing table would take a
        // lock that calls queue behind (and that deadlocks with an index another
        // worker builds concurrently). The lock the columns take is brief, and given up
        // (the migration fails, to be run again) rather than queue every call behind a
        // long transaction. The listings' indexes of an existing table are built
        // concurrently, by `build_indexes`.
        let add = COLUMNS_V2
            .split(",\n")
            .map(|column| format!("ADD COLUMN IF NOT EXISTS {}", column.trim()))
            .collect::<Vec<_>>()
            .join(", ");
        let listings: String = INDEXES
            .iter()
            .map(|(suffix, columns)| {
                let (name, _) = index_name(t, &base, suffix);
                format!("CREATE INDEX {name} ON {t} {columns};\n")
            })
            .collect();
        let create = format!(
            "BEGIN;
             SET LOCAL lock_timeout = '{lock_ms}ms';
             SELECT pg_advisory_xact_lock(hashtext('idem migrate ' || '{lock}'));
             DO $idem$ BEGIN
                 IF to_regclass('{t}') IS NULL THEN
                     CREATE TABLE {t} (
                         key          text        PRIMARY KEY,
                         fingerprint  bytea       NOT NULL,
                         state        smallint    NOT NULL,
                         token        bytea       NOT NULL,
                         lease_until  timestamptz,
                         payload      bytea,
                         created_at   timestamptz NOT NULL,
                         expires_at   timestamptz NOT NULL,
                         {COLUMNS_V2}
                     );
                     CREATE INDEX {expires_index} ON {t} (expires_at);
                     {listings}
                 ELSE
                     IF to_regclass('{expires_qualified}') IS NULL THEN
                         CREATE INDEX {expires_index} ON {t} (expires_at);
                     END IF;
                     IF NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass('{t}')
                                    AND attname = 'result' AND NOT attisdropped) THEN
                         ALTER TABLE {t} {add};
                     END IF;
                 END IF;
             END $idem$;
             COMMIT;",
            lock_ms = self.inner.timeout.min(timeout).as_millis(),
        );
        let created = async { client.batch_execute(&create).await.map_err(pg_error) };
        net::bounded(STORE, timeout, created).await?;
        if existed && !had_columns {
            tracing::info!(table = %t, "idem: the table has the record metadata columns of format 2");
        }
        held.0 = None;
        Ok(())
    }

    /// The listings' indexes and the results of 0.1's rows: one worker at a time (an
    /// index another is building reads as invalid). When another worker is at it, this
    /// one waits for it and then builds what it left (`wait`), or returns at once.
    async fn build_indexes(&self, wait: bool) -> Result<(), Error> {
        let t = &self.inner.table;
        let lock = t.replace('\'', "");
        // Dropped or failed, the connection is closed, and the session's lock with it.
        let mut held = Held(Some(self.bounded(self.client()).await?));
        let client = held
            .0
            .as_ref()
            .ok_or_else(|| pg_error("no migration connection"))?;
        // Waiting is asking again, each time a statement of its own: a statement that
        // waited for the lock would hold a snapshot, which the other worker's
        // `CREATE INDEX CONCURRENTLY` waits for in turn.
        let locked = format!("SELECT pg_try_advisory_lock(hashtext('idem index ' || '{lock}'))");
        let started = std::time::Instant::now();
        let got = loop {
            let row = self
                .bounded(async { client.query_one(&locked, &[]).await.map_err(pg_error) })
                .await?;
            let got = row.try_get::<_, bool>(0).map_err(pg_error)?;
            if got || !wait {
                break got;
            }
            if started.elapsed() > MIGRATE_TIMEOUT {
                return Err(Error::store(
                    STORE,
                    format!("another worker built the indexes for over {MIGRATE_TIMEOUT:?}"),
                ));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        if !got {
            tracing::debug!(table = %t, "idem: another worker is building the indexes; going on");
            held.0 = None;
            return Ok(());
        }
        self.indexes_and_results(client, &self.base_name()).await?;
        let unlock = format!("SELECT pg_advisory_unlock(hashtext('idem index ' || '{lock}'))");
        self.bounded(async { client.query_one(&unlock, &[]).await.map_err(pg_error) })
            .await?;
        held.0 = None;
        Ok(())
    }

    /// The table's own name, unquoted and without its schema.
    fn base_name(&self) -> String {
        let t = &self.inner.table;
        t.rsplit('.')
            .next()
            .unwrap_or(t)
            .trim_matches('"')
            .to_owned()
    }

    /// Builds the listings' indexes without blocking writes (an index a failed build
    /// left invalid is built again), then fills the results of 0.1's rows.
    async fn indexes_and_results(
        &self,
        client: &deadpool_postgres::Object,
        base: &str,
    ) -> Result<(), Error> {
        let t = &self.inner.table;
        let batch = |sql: String| async move { client.batch_execute(&sql).await.map_err(pg_error) };
        for (suffix, columns) in INDEXES {
            let (name, qualified) = index_name(t, base, suffix);
            let valid = format!(
                "SELECT i.indisvalid FROM pg_index i WHERE i.indexrelid = to_regclass('{qualified}')"
            );
            let row = self
                .bounded(async { client.query_opt(&valid, &[]).await.map_err(pg_error) })
                .await?;
            let valid = row
                .map(|row| row.try_get::<_, bool>(0))
                .transpose()
                .map_err(pg_error)?;
            if valid == Some(true) {
                continue;
            }
            if valid == Some(false) {
                net::bounded(
                    STORE,
                    MIGRATE_TIMEOUT,
                    batch(format!("DROP INDEX CONCURRENTLY IF EXISTS {qualified}")),
                )
                .await?;
            }
            let build = format!("CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON {t} {columns}");
            net::bounded(STORE, MIGRATE_TIMEOUT, batch(build)).await?;
        }
        self.fill_results(client).await
    }

    /// Fills `result` for completed rows that lack it (written by idem 0.1, before or
    /// during the upgrade), in batches of a thousand, each one statement. The `unfilled`
    /// index holds just those rows (and those whose result `jsonb` refuses), so a table
    /// with none costs one index lookup.
    async fn fill_results(&self, client: &deadpool_postgres::Object) -> Result<(), Error> {
        let t = &self.inner.table;
        let select = format!(
            "SELECT key, payload FROM {t} WHERE result IS NULL AND state <> 0 \
             AND key > $1 ORDER BY key LIMIT 1000"
        );
        let update = format!(
            "UPDATE {t} AS r SET result = v.result::jsonb \
             FROM unnest($1::text[], $2::bytea[], $3::text[]) AS v(key, payload, result) \
             WHERE r.key = v.key AND r.payload = v.payload AND r.state <> 0 AND r.result IS NULL"
        );
        let (mut after, mut filled) = (String::new(), 0u64);
        loop {
            let rows = self
                .bounded(async { client.query(&select, &[&after]).await.map_err(pg_error) })
                .await?;
            let Some(last) = rows.last() else { break };
            after = last.try_get(0).map_err(pg_error)?;
            let (mut keys, mut payloads, mut results) = (Vec::new(), Vec::new(), Vec::new());
            for row in &rows {
                let payload: Option<Vec<u8>> = row.try_get(1).map_err(pg_error)?;
                let Some(payload) = payload else { continue };
                if let Some(result) = as_text(&payload) {
                    results.push(result.to_owned());
                    keys.push(row.try_get::<_, String>(0).map_err(pg_error)?);
                    payloads.push(payload);
                }
            }
            let fill =
                |keys, payloads, results| self.fill_batch(client, &update, keys, payloads, results);
            filled += match fill(&keys, &payloads, &results).await? {
                Ok(n) => n,
                // A result `jsonb` refuses fails its batch: fill the batch's rows one by
                // one, leaving that one NULL.
                Err(e) if refuses_result(&e) => {
                    let mut n = 0;
                    for i in 0..keys.len() {
                        let one = fill(&keys[i..=i], &payloads[i..=i], &results[i..=i]).await?;
                        match one {
                            Ok(done) => n += done,
                            Err(e) if refuses_result(&e) => {}
                            Err(e) => return Err(pg_error(e)),
                        }
                    }
                    n
                }
                Err(e) => return Err(pg_error(e)),
            };
        }
        if filled > 0 {
            tracing::info!(table = %t, rows = filled, "idem: filled the `result` column of existing records");
        }
        Ok(())
    }

    /// One statement of `fill_results`: the store's failure, or the server's answer
    /// (which may refuse a result).
    async fn fill_batch(
        &self,
        client: &deadpool_postgres::Object,
        update: &str,
        keys: &[String],
        payloads: &[Vec<u8>],
        results: &[String],
    ) -> Result<Result<u64, tokio_postgres::Error>, Error> {
        self.bounded(async { Ok(client.execute(update, &[&keys, &payloads, &results]).await) })
            .await
    }

    /// Runs `f` within the store's timeout.
    async fn bounded<T>(
        &self,
        f: impl std::future::Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        net::bounded(STORE, self.inner.timeout, f).await
    }

    /// A pooled connection. The futures of the pool and of `tokio_postgres` are boxed
    /// where the hot paths await them (`claim`, `modified`, `recorded`): each store
    /// operation's future is moved into its own box and its timeout, and holding them
    /// in line made every move copy them all (a quarter of a hit's client
    /// instructions were `memcpy`).
    async fn client(&self) -> Result<deadpool_postgres::Object, Error> {
        Box::pin(self.inner.pool.get()).await.map_err(pg_error)
    }

    /// Reads the record under `key` (expired or not) and the database time.
    async fn read(
        &self,
        client: &deadpool_postgres::Object,
        key: &Key,
    ) -> Result<(Option<Record>, Timestamp), Error> {
        let stmt = client
            .prepare_cached(&self.inner.sql.read)
            .await
            .map_err(pg_error)?;
        let row = client
            .query_one(&stmt, &[&key.as_str()])
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
        let stmt = Box::pin(client.prepare_cached(sql))
            .await
            .map_err(pg_error)?;
        Box::pin(client.execute(&stmt, params))
            .await
            .map_err(pg_error)
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
        let first = async {
            let stmt = Box::pin(client.prepare_cached(sql)).await?;
            Box::pin(client.execute(&stmt, params)).await
        };
        match first.await {
            Ok(n) => Ok(n),
            Err(e) if refuses_result(&e) => {
                tracing::debug!(table = %self.inner.table, error = %e, "idem: the `result` column is left NULL for this outcome");
                let stmt = client.prepare_cached(plain).await.map_err(pg_error)?;
                let without_text = &params[..params.len() - 1];
                client.execute(&stmt, without_text).await.map_err(pg_error)
            }
            Err(e) => Err(pg_error(e)),
        }
    }

    /// Runs a statement built with its parameters (a listing's, a count's), within the
    /// store's timeout.
    async fn query(&self, sql: &str, params: &Params) -> Result<Vec<Row>, Error> {
        self.bounded(async {
            let client = self.client().await?;
            let stmt = client.prepare_cached(sql).await.map_err(pg_error)?;
            client
                .query(&stmt, &params.as_refs())
                .await
                .map_err(pg_error)
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
        let stmt = client.prepare_cached(sql).await.map_err(pg_error)?;
        client.query_opt(&stmt, params).await.map_err(pg_error)
    }
}

/// The one row of an aggregate's answer.
fn one_row(rows: Vec<Row>) -> Result<Row, Error> {
    rows.into_iter()
        .next()
        .ok_or_else(|| pg_error("an aggregate answered no row"))
}

/// What a row of the `read` query holds: the record (`None` if the key has no row) and
/// the database time.
fn decode_read(key: &Key, row: &Row) -> Result<(Option<Record>, Timestamp), Error> {
    Ok((decode_row(key, row, 0)?, now_of(row, 0)?))
}

/// The database time in a row that has the columns from `at` on, then the time.
fn now_of(row: &Row, at: usize) -> Result<Timestamp, Error> {
    let now: i64 = row.try_get(at + COLUMN_COUNT).map_err(pg_error)?;
    Ok(Timestamp(now.max(0) as u64))
}

/// What a claim decides by, in a row of the claim's read (see [`claim_columns`]): the
/// record, without its metadata (`None` if the key has no row), and the database time.
fn decode_claim_read(key: &Key, row: &Row) -> Result<(Option<Record>, Timestamp), Error> {
    let now: i64 = row.try_get(CLAIM_COLUMN_COUNT).map_err(pg_error)?;
    let now = Timestamp(now.max(0) as u64);
    let Some((fingerprint, state)) = decode_decision(key, row, 0)? else {
        return Ok((None, now));
    };
    let expires: i64 = row.try_get(5).map_err(pg_error)?;
    let record = Record {
        fingerprint,
        // Not read: no decision looks at when a record was written, or at its metadata.
        created_at: now,
        expires_at: Timestamp(expires.max(0) as u64),
        state,
        meta: Meta::default(),
    };
    Ok((Some(record), now))
}

/// The fingerprint and state in a row whose columns from `at` on begin as [`columns`]
/// and [`claim_columns`] do, or `None` if the key has no row.
fn decode_decision(key: &Key, row: &Row, at: usize) -> Result<Option<(Fingerprint, State)>, Error> {
    let corrupt = |reason: String| Error::CorruptRecord {
        key: key.clone(),
        reason,
    };
    let fingerprint: Option<Vec<u8>> = row.try_get(at).map_err(pg_error)?;
    let Some(fingerprint) = fingerprint else {
        return Ok(None);
    };
    let fingerprint: [u8; 32] = fingerprint
        .try_into()
        .map_err(|_| corrupt("fingerprint is not 32 bytes".into()))?;
    let state: i16 = row.try_get(at + 1).map_err(pg_error)?;
    let token: Vec<u8> = row.try_get(at + 2).map_err(pg_error)?;
    let token: [u8; 16] = token
        .try_into()
        .map_err(|_| corrupt("token is not 16 bytes".into()))?;
    let lease: Option<i64> = row.try_get(at + 3).map_err(pg_error)?;
    let payload: Option<Vec<u8>> = row.try_get(at + 4).map_err(pg_error)?;
    let state = match (state, lease, payload) {
        (0, Some(lease), _) => State::InProgress {
            token: Token(u128::from_be_bytes(token)),
            lease_until: Timestamp(lease.max(0) as u64),
        },
        (1, _, Some(result)) => State::Completed { result },
        (2, _, Some(error)) => State::Failed { error },
        (state, ..) => return Err(corrupt(format!("state {state} with missing fields"))),
    };
    Ok(Some((Fingerprint::from_bytes(fingerprint), state)))
}

/// The record in a row whose columns from `at` on are [`columns`], or `None` if the key
/// has no row.
fn decode_row(key: &Key, row: &Row, at: usize) -> Result<Option<Record>, Error> {
    let Some((fingerprint, state)) = decode_decision(key, row, at)? else {
        return Ok(None);
    };
    let get = |i: usize| at + i;
    let created: i64 = row.try_get(get(5)).map_err(pg_error)?;
    let expires: i64 = row.try_get(get(6)).map_err(pg_error)?;
    let text = |i: usize| -> Result<Option<std::sync::Arc<str>>, Error> {
        let value: Option<String> = row.try_get(get(i)).map_err(pg_error)?;
        Ok(value.map(Into::into))
    };
    let (run_id, tenant, call_id, tool) = (text(7)?, text(8)?, text(9)?, text(10)?);
    let time = |i: usize| -> Result<Option<Timestamp>, Error> {
        let ms: Option<i64> = row.try_get(get(i)).map_err(pg_error)?;
        Ok(ms.map(|ms| Timestamp(ms.max(0) as u64)))
    };
    let count = |i: usize| -> Result<u32, Error> {
        let n: i32 = row.try_get(get(i)).map_err(pg_error)?;
        Ok(n.max(0) as u32)
    };
    let at = |ms: i64| Timestamp(ms.max(0) as u64);
    let done = !matches!(state, State::InProgress { .. });
    let origin = match (run_id, tool) {
        (Some(run_id), Some(tool)) => Some(Origin {
            tenant,
            run_id,
            call_id,
            tool,
        }),
        _ => None,
    };
    Ok(Some(Record {
        fingerprint,
        created_at: at(created),
        expires_at: at(expires),
        state,
        meta: Meta {
            origin,
            claimed_at: time(11)?.unwrap_or_default(),
            // A row of idem 0.1 was last written by its completion.
            completed_at: time(12)?.or(done.then(|| at(created))),
            renewed_at: time(13)?,
            attempts: count(14)?,
            takeovers: count(15)?,
        },
    }))
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("table", &self.inner.table)
            .finish()
    }
}

/// How many times a claim reads again after losing a race before giving up (each lost
/// race means another caller made progress on the key).
const CLAIM_ATTEMPTS: usize = 64;

#[async_trait]
impl Store for PostgresStore {
    fn name(&self) -> &'static str {
        "postgres"
    }

    async fn claim(&self, key: &Key, request: &ClaimRequest) -> Result<Claim, Error> {
        self.bounded(async {
            let client = self.client().await?;
            let token = request.token.0.to_be_bytes();
            // The record lives one TTL past the lease.
            let (lease, ttl) = (
                millis(request.lease),
                millis(request.lease.saturating_add(request.ttl)),
            );
            let origin = &request.origin;
            // `claim_fresh` takes the first nine, `claim` all eleven.
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 11] = [
                &key.as_str(),
                &request.fingerprint.as_bytes().as_slice(),
                &token.as_slice(),
                &lease,
                &ttl,
                &&*origin.run_id,
                &origin.tenant.as_deref(),
                &origin.call_id.as_deref(),
                &&*origin.tool,
                &request.take_over_expired,
                &request.retry_failed,
            ];
            for _ in 0..CLAIM_ATTEMPTS {
                // Each statement's future in a box of its own (see `client`).
                let stmt = Box::pin(client.prepare_cached(&self.inner.sql.claim_fresh))
                    .await
                    .map_err(pg_error)?;
                let row = Box::pin(client.query_one(&stmt, &params[..9]))
                    .await
                    .map_err(pg_error)?;
                if row
                    .try_get::<_, i64>(CLAIM_COLUMN_COUNT + 1)
                    .map_err(pg_error)?
                    == 1
                {
                    return Ok(Claim::Acquired { took_over: false });
                }
                let (Some(current), now) = decode_claim_read(key, &row)? else {
                    // Not inserted, yet no row to see: another caller's claim committed
                    // after this statement's snapshot was taken. Look again.
                    continue;
                };
                let (claim, write) = decide_claim(Some(&current), request, now);
                if write.is_none() {
                    return Ok(in_local_clock(claim, now));
                }
                let stmt = Box::pin(client.prepare_cached(&self.inner.sql.claim))
                    .await
                    .map_err(pg_error)?;
                let claimed = Box::pin(client.query_opt(&stmt, &params))
                    .await
                    .map_err(pg_error)?;
                if claimed.is_some() {
                    return Ok(claim);
                }
            }
            Err(pg_error("claim kept losing write races; giving up"))
        })
        .await
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        outcome: Outcome<'_>,
        ttl: Duration,
    ) -> Result<Fenced, Error> {
        let (state, payload): (i16, &[u8]) = match outcome {
            Outcome::Completed(b) => (1, b),
            Outcome::Failed(b) => (2, b),
        };
        let token = token.0.to_be_bytes();
        let sql = &self.inner.sql;
        let n = self
            .bounded(self.recorded(
                (&sql.complete, &sql.complete_plain),
                &[
                    &key.as_str(),
                    &token.as_slice(),
                    &state,
                    &payload,
                    &millis(ttl),
                    &as_text(payload),
                ],
            ))
            .await?;
        Ok(fenced(n))
    }

    async fn release(&self, key: &Key, token: Token) -> Result<Fenced, Error> {
        let token = token.0.to_be_bytes();
        let n = self
            .bounded(self.modified(&self.inner.sql.release, &[&key.as_str(), &token.as_slice()]))
            .await?;
        Ok(fenced(n))
    }

    async fn renew(
        &self,
        key: &Key,
        token: Token,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Fenced, Error> {
        let token = token.0.to_be_bytes();
        let n = self
            .bounded(self.modified(
                &self.inner.sql.renew,
                &[
                    &key.as_str(),
                    &token.as_slice(),
                    &millis(lease),
                    &millis(lease.saturating_add(ttl)),
                ],
            ))
            .await?;
        Ok(fenced(n))
    }

    /// One statement per page, in key order from the cursor (the last key listed),
    /// served by the primary key or the index of the filter's run or tool.
    async fn list(
        &self,
        filter: &Filter,
        after: Option<&Cursor>,
        limit: usize,
    ) -> Result<Page, Error> {
        let (sql, mut params) = self.inner.sql.list(filter);
        let limit = i64::try_from(limit.max(1)).unwrap_or(i64::MAX);
        params.0[0] = Box::new(after.map(|c| c.0.clone()));
        params.0[1] = Box::new(limit);
        let rows = self.query(&sql, &params).await?;
        let mut page = Page {
            now: Timestamp::now(),
            ..Page::default()
        };
        let mut last = None;
        for row in &rows {
            let key = Key::from_text(row.try_get::<_, String>(0).map_err(pg_error)?);
            last = Some(key.as_str().to_owned());
            page.now = now_of(row, 1)?;
            match decode_row(&key, row, 1) {
                Ok(Some(record)) => page.records.push(Listed { key, record }),
                Ok(None) => {}
                Err(error) => page.unreadable.push(Unreadable { key, error }),
            }
        }
        if rows.len() as i64 == limit {
            page.next = last.map(Cursor);
        }
        Ok(page)
    }

    async fn count(&self, filter: &Filter) -> Result<Counts, Error> {
        let (sql, params) = self.inner.sql.count(filter);
        let row = one_row(self.query(&sql, &params).await?)?;
        let n = |i: usize| -> Result<u64, Error> {
            Ok(row.try_get::<_, i64>(i).map_err(pg_error)?.max(0) as u64)
        };
        Ok(Counts {
            running: n(0)?,
            abandoned: n(1)?,
            completed: n(2)?,
            failed: n(3)?,
            unreadable: 0,
        })
    }

    /// Deletes in batches of 10,000 rows, each one statement within the store's
    /// timeout, as a purge does.
    async fn delete_matching(&self, filter: &Filter) -> Result<u64, Error> {
        let (sql, params) = self.inner.sql.delete_matching(filter);
        let mut removed = 0;
        loop {
            let row = one_row(self.query(&sql, &params).await?)?;
            let batch: i64 = row.try_get(0).map_err(pg_error)?;
            removed += batch.max(0) as u64;
            if batch < PURGE_BATCH {
                return Ok(removed);
            }
        }
    }

    async fn resolve(
        &self,
        key: &Key,
        token: Token,
        resolution: Resolution<'_>,
    ) -> Result<Fenced, Error> {
        let token = token.0.to_be_bytes();
        let n = match resolution {
            Resolution::Completed { result, ttl } => {
                let sql = &self.inner.sql;
                self.bounded(self.recorded(
                    (&sql.resolve_completed, &sql.resolve_completed_plain),
                    &[
                        &key.as_str(),
                        &token.as_slice(),
                        &result,
                        &millis(ttl),
                        &as_text(result),
                    ],
                ))
                .await?
            }
            Resolution::Released => {
                self.bounded(self.modified(
                    &self.inner.sql.resolve_released,
                    &[&key.as_str(), &token.as_slice()],
                ))
                .await?
            }
        };
        Ok(fenced(n))
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>, Error> {
        self.bounded(async {
            let client = self.client().await?;
            let (record, now) = self.read(&client, key).await?;
            Ok(record.filter(|r| !r.is_expired(now)))
        })
        .await
    }

    async fn delete(&self, key: &Key) -> Result<bool, Error> {
        let row = self
            .bounded(self.row(&self.inner.sql.delete, &[&key.as_str()]))
            .await?;
        match row {
            Some(row) => row.try_get::<_, bool>(0).map_err(pg_error),
            None => Ok(false),
        }
    }

    /// One statement: the row is judged and removed under its lock.
    async fn delete_settled(&self, key: &Key) -> Result<bool, Error> {
        let sql = &self.inner.sql.delete_settled;
        let removed = self.bounded(self.modified(sql, &[&key.as_str()])).await?;
        Ok(removed == 1)
    }

    /// Deletes expired rows in batches of 10,000 rows, each one statement within
    /// the store's timeout (see the module docs). A purge that fails part-way keeps
    /// what its earlier batches removed.
    async fn purge_expired(&self) -> Result<u64, Error> {
        let (mut removed, mut from) = (0, 0i64);
        loop {
            let row = self
                .bounded(self.row(&self.inner.sql.purge, &[&from, &PURGE_BATCH]))
                .await?;
            // An aggregate always returns its one row.
            let Some(row) = row else {
                return Ok(removed);
            };
            let batch: i64 = row.try_get(0).map_err(pg_error)?;
            from = from.max(row.try_get(1).map_err(pg_error)?);
            removed += batch.max(0) as u64;
            if batch < PURGE_BATCH {
                return Ok(removed);
            }
        }
    }
}
