//! The SQL text of every statement, made once per store for its table, and the
//! conditions of a listing's filter.

use crate::key_text::Key;
use crate::store::{Filter, StateKind};

/// The most rows one statement of a purge deletes: about 0.1 s of work.
pub(super) const PURGE_BATCH: i64 = 10_000;

/// The statements, with the table name filled in.
pub(super) struct Sql {
    pub(super) table: String,
    pub(super) read: String,
    pub(super) claim_read: String,
    pub(super) claim_insert: String,
    pub(super) claim_fresh: String,
    pub(super) claim: String,
    pub(super) complete: String,
    pub(super) complete_plain: String,
    pub(super) renew_many: String,
    pub(super) release: String,
    pub(super) delete: String,
    pub(super) delete_settled: String,
    pub(super) purge: String,
    pub(super) resolve_completed: String,
    pub(super) resolve_completed_plain: String,
    pub(super) resolve_released: String,
}

impl Sql {
    /// Where `sql` is among these statements, if it is one of them: the same string,
    /// not only an equal one, so a place never names another statement.
    pub(super) fn place_of(&self, sql: &str) -> Option<usize> {
        [
            &self.read,
            &self.claim_read,
            &self.claim_insert,
            &self.claim_fresh,
            &self.claim,
            &self.complete,
            &self.complete_plain,
            &self.renew_many,
            &self.release,
            &self.delete,
            &self.delete_settled,
            &self.purge,
            &self.resolve_completed,
            &self.resolve_completed_plain,
            &self.resolve_released,
        ]
        .iter()
        .position(|statement| std::ptr::eq(statement.as_str(), sql))
    }

    pub(super) fn new(t: &str) -> Self {
        // What a claim's own statements check on the row they find by its key: it is
        // still in progress under the caller's token and has not expired; or, for the
        // reconciliation of an abandoned call, it is abandoned under that token.
        let held = on_the_row("state = 0 AND token = $2 AND expires_at > now()");
        // The same, for many claims at once: the token is the one of the claim's row
        // `w` in the statement's list.
        let held_by_w = on_the_row("r.state = 0 AND r.token = w.token AND r.expires_at > now()");
        let abandoned = on_the_row(&format!(
            "{ABANDONED} AND token = $2 AND expires_at > now()"
        ));
        // An outcome's write, with `result` set to `result` (its text through the
        // function, or NULL when the server refuses that).
        let complete = |result: &str| {
            format!(
                "UPDATE {t} SET state = $3, payload = $4, result = {result}, lease_until = NULL, \
                 created_at = now(), completed_at = now(), \
                 expires_at = now() + $5::int8 * interval '1 millisecond' \
                 WHERE key = $1 AND {held}"
            )
        };
        let resolve_completed = |result: &str| {
            format!(
                "UPDATE {t} SET state = 1, payload = $3, result = {result}, lease_until = NULL, \
                 created_at = now(), completed_at = now(), \
                 expires_at = now() + $4::int8 * interval '1 millisecond' \
                 WHERE key = $1 AND {abandoned}"
            )
        };
        // The row under `$1` (all NULL if there is none) and the database time.
        let read = format!("SELECT {COLUMNS}, now()");
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
            // What the claim decides by and the database time, when the key has a row:
            // a claim in a streak of hits reads it first (see `net::Streak`).
            claim_read: format!(
                "SELECT {columns}, now() FROM {t} AS r WHERE r.key = $1",
                columns = CLAIM_COLUMNS,
            ),
            // A claim of a key without a row, alone: a claim in a streak of misses
            // inserts first (see `net::Streak`).
            claim_insert: format!("{insert} ON CONFLICT (key) DO NOTHING RETURNING 1"),
            // What the claim decides by (see `CLAIM_COLUMNS`), not the whole row.
            // The row is read first and the claim inserted only when the statement's
            // snapshot sees none: a key with a row (a hit) then costs the server a read,
            // not an insertion's conflict check on the primary key.
            claim_fresh: format!(
                "WITH found AS (SELECT {columns} FROM {t} AS r WHERE r.key = $1), \
                 fresh AS ({insert_select} WHERE NOT EXISTS (SELECT 1 FROM found) \
                     ON CONFLICT (key) DO NOTHING RETURNING 1) \
                 SELECT found.*, now(), (SELECT count(*) FROM fresh) \
                 FROM (SELECT 1) AS one LEFT JOIN found ON true",
                columns = CLAIM_COLUMNS,
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
            // Claims `$1` under tokens `$2`, each renewed for its lease `$3` and ttl `$4`
            // (ms), in one statement. A row another transaction holds locked is skipped,
            // not waited for: the rows to renew are taken with `FOR UPDATE SKIP LOCKED`
            // first (the job-queue pattern), and the `UPDATE` checks each again as it
            // writes it. Each claim comes back with whether it was renewed, and whether
            // its row was the caller's claim as the statement began (the main query does
            // not see the `UPDATE`'s writes): one that was, yet was not renewed, was
            // skipped for a lock.
            renew_many: format!(
                "WITH w AS (SELECT * FROM unnest($1::text[], $2::bytea[], $3::int8[], $4::int8[]) \
                     AS w(key, token, lease, ttl)), \
                 renewed AS (UPDATE {t} AS r \
                     SET lease_until = now() + w.lease * interval '1 millisecond', \
                         expires_at = now() + w.ttl * interval '1 millisecond', renewed_at = now() \
                     FROM w \
                     WHERE r.key = w.key \
                       AND r.key = ANY(ARRAY(SELECT s.key FROM {t} AS s WHERE s.key = ANY($1::text[]) \
                           FOR UPDATE SKIP LOCKED)) \
                       AND {held_by_w} \
                     RETURNING r.key) \
                 SELECT w.key, EXISTS (SELECT 1 FROM renewed WHERE renewed.key = w.key), {held_by_w} \
                 FROM w LEFT JOIN {t} AS r ON r.key = w.key"
            ),
            resolve_completed: resolve_completed("$5::text::jsonb"),
            resolve_completed_plain: resolve_completed("NULL"),
            resolve_released: format!(
                "DELETE FROM {t} WHERE key = $1 AND {abandoned}"
            ),
            release: format!(
                "DELETE FROM {t} WHERE key = $1 AND {held}"
            ),
            delete: format!("DELETE FROM {t} WHERE key = $1 RETURNING expires_at > now()"),
            delete_settled: format!(
                "DELETE FROM {t} WHERE key = $1 AND {checks}",
                checks = on_the_row("expires_at > now() AND NOT (state = 0 AND lease_until > now())"),
            ),
            // `$1` in whole milliseconds, rounded down from the last batch's latest expiry;
            // 0 (the first batch, or one whose latest expiry is not after 1970) starts at
            // `-infinity`, so rows written by hand to expire before 1970 go too.
            purge: format!(
                "WITH gone AS (DELETE FROM {t} WHERE ctid = ANY(ARRAY( \
                     SELECT ctid FROM {t} WHERE expires_at <= now() \
                     AND expires_at >= CASE WHEN $1::int8 <= 0 THEN '-infinity'::timestamptz \
                         ELSE to_timestamp($1::int8 / 1000.0) END \
                     ORDER BY expires_at LIMIT $2)) \
                 AND expires_at <= now() RETURNING expires_at) \
                 SELECT count(*), coalesce(greatest( \
                     floor(extract(epoch from max(expires_at)) * 1000), 0)::int8, 0) \
                 FROM gone"
            ),
            table: t.to_owned(),
        }
    }

    /// A listing's statement: the rows matching `filter` past the key `$1` (or from
    /// the first, when NULL), in key order, at most `$2`.
    pub(super) fn list(&self, filter: &Filter) -> (String, Params) {
        let mut params = Params::default();
        params.push(None::<String>);
        params.push(0i64);
        let conditions = conditions(filter, &mut params);
        let rows = settled_and_in_progress(|state| {
            format!(
                "SELECT r.key, {columns}, now() FROM {t} AS r \
                 WHERE {state} AND r.expires_at > now() AND ($1::text IS NULL OR r.key > $1) \
                 {conditions} ORDER BY r.key LIMIT $2",
                columns = COLUMNS,
                t = self.table,
            )
        });
        (
            format!("SELECT * FROM ({rows}) AS page ORDER BY 1 LIMIT $2"),
            params,
        )
    }

    /// The counts by state of the rows matching `filter`.
    pub(super) fn count(&self, filter: &Filter) -> (String, Params) {
        let mut params = Params::default();
        let conditions = conditions(filter, &mut params);
        // In the order `count` reads them: running, abandoned, completed, failed.
        let counts = StateKind::ALL
            .iter()
            .enumerate()
            .map(|(i, kind)| format!("count(*) FILTER (WHERE {}) AS n{i}", state_condition(*kind)))
            .collect::<Vec<_>>()
            .join(", ");
        let sums = (0..StateKind::ALL.len())
            .map(|i| format!("sum(n{i})::int8"))
            .collect::<Vec<_>>()
            .join(", ");
        let rows = settled_and_in_progress(|state| {
            format!(
                "SELECT {counts} FROM {t} AS r WHERE {state} AND r.expires_at > now() {conditions}",
                t = self.table,
            )
        });
        (format!("SELECT {sums} FROM ({rows}) AS counted"), params)
    }

    /// One batch of deleting the rows matching `filter`: at most `$1` of them.
    pub(super) fn delete_matching(&self, filter: &Filter) -> (String, Params) {
        let mut params = Params::default();
        params.push(PURGE_BATCH);
        let conditions = conditions(filter, &mut params);
        let t = &self.table;
        let rows = settled_and_in_progress(|state| {
            format!(
                "SELECT r.ctid FROM {t} AS r WHERE {state} AND r.expires_at > now() {conditions} \
                 LIMIT $1"
            )
        });
        let sql = format!(
            "WITH gone AS (DELETE FROM {t} WHERE ctid = ANY(ARRAY( \
                 SELECT ctid FROM ({rows}) AS matching LIMIT $1)) \
             RETURNING 1) SELECT count(*) FROM gone"
        );
        (sql, params)
    }
}

/// `select`, a statement with `{state}` where a condition on the row's state goes, made
/// twice: for the settled rows, and for the rows in progress, as one `UNION ALL`. The
/// listings' indexes (by run, by tool) hold settled rows only, so a claim adds no entry
/// to them and a miss adds one to each, not two; the rows in progress are found by the
/// in-progress index.
fn settled_and_in_progress(select: impl Fn(&str) -> String) -> String {
    format!(
        "({}) UNION ALL ({})",
        select("r.state <> 0"),
        select("r.state = 0")
    )
}

/// The columns of a record, as `decode_row` reads them (a row of table `r`). Times are
/// sent as stored, and read by the client (see `decode::Time`).
pub(super) const COLUMNS: &str = "r.fingerprint, r.state, r.token, r.lease_until, r.payload, \
     r.created_at, r.expires_at, r.run_id, r.tenant, r.call_id, r.tool, \
     coalesce(r.claimed_at, r.created_at), r.completed_at, r.renewed_at, r.attempts, r.takeovers";

/// How many columns [`COLUMNS`] has: the database time follows them.
pub(super) const COLUMN_COUNT: usize = 16;

/// The columns a claim decides by (see `decide_claim`): the first five of [`COLUMNS`],
/// then the expiry. The record's metadata and write time are for operators, never for
/// decisions, and a hit does not read them.
pub(super) const CLAIM_COLUMNS: &str =
    "r.fingerprint, r.state, r.token, r.lease_until, r.payload, r.expires_at";

/// How many columns [`CLAIM_COLUMNS`] has: the database time follows them, then whether
/// the statement inserted the claim.
pub(super) const CLAIM_COLUMN_COUNT: usize = 6;

/// `checks` on the row a statement has found by its key, as one condition no index can
/// serve and from which no index's predicate follows, so that every plan finds the row
/// by the primary key. Written as plain conditions, they let a plan made on stale
/// statistics (the expiry histogram of an hour ago, an in-progress index that was empty
/// at the last `ANALYZE`) walk the expiry or the in-progress index instead: every live
/// row, or every row in progress, on each completion.
fn on_the_row(checks: &str) -> String {
    // Not `(..) IS TRUE`: a later planner may learn to see through that.
    format!("CASE WHEN {checks} THEN true ELSE false END")
}

/// An in-progress row whose lease has run out.
pub(super) const ABANDONED: &str = "state = 0 AND lease_until <= now()";

/// A statement's parameters, numbered in the order pushed.
#[derive(Default)]
pub(super) struct Params(pub(super) Vec<Box<dyn tokio_postgres::types::ToSql + Sync + Send>>);

impl Params {
    /// Adds a parameter; returns its placeholder (`$n`).
    pub(super) fn push(
        &mut self,
        value: impl tokio_postgres::types::ToSql + Sync + Send + 'static,
    ) -> String {
        self.0.push(Box::new(value));
        format!("${}", self.0.len())
    }

    pub(super) fn as_refs(&self) -> Vec<&(dyn tokio_postgres::types::ToSql + Sync)> {
        self.0.iter().map(|p| &**p as _).collect()
    }
}

/// The SQL condition of a state, on table `r`.
pub(super) fn state_condition(kind: StateKind) -> &'static str {
    match kind {
        StateKind::Running => "r.state = 0 AND r.lease_until > now()",
        StateKind::Abandoned => "r.state = 0 AND r.lease_until <= now()",
        StateKind::Completed => "r.state = 1",
        StateKind::Failed => "r.state = 2",
    }
}

/// `filter` as ` AND ...` conditions on table `r`, with only the conditions it sets (so
/// each shape of filter is its own statement, and its index serves it).
pub(super) fn conditions(filter: &Filter, params: &mut Params) -> String {
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
