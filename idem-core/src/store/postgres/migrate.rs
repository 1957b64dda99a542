//! The table and its indexes: created if missing, and a table of idem 0.1 upgraded
//! (`PostgresStore::migrate`; see the type's docs for each step and its locks).

use std::time::Duration;

use super::{as_text, pg_error, refuses_result, PostgresStore, STORE};
use crate::error::Error;
use crate::store::net;

/// The columns format 2 added to the table (one per line: `migrate` adds each to a
/// table of idem 0.1).
pub(super) const COLUMNS_V2: &str = "run_id       text,
tenant       text,
call_id      text,
tool         text,
claimed_at   timestamptz,
completed_at timestamptz,
renewed_at   timestamptz,
attempts     integer     NOT NULL DEFAULT 0,
takeovers    integer     NOT NULL DEFAULT 0,
result       jsonb";

/// The indexes of the operators' listings: the settled rows by run and by tool (each
/// in key order, as pages are read), and the claims in progress by lease (stuck calls,
/// and every listing's rows in progress); and the rows whose `result` is still to fill.
pub(super) const INDEXES: [(&str, &str); 4] = [
    ("settled_run", "(run_id, key) WHERE state <> 0"),
    ("settled_tool", "(tool, key) WHERE state <> 0"),
    ("in_progress", "(lease_until) WHERE state = 0"),
    ("unfilled", "(key) WHERE result IS NULL AND state <> 0"),
];

/// The indexes of earlier versions that [`INDEXES`] replace (by run and by tool, of every
/// row: each miss added two entries to each), dropped once those are built.
pub(super) const REPLACED: [&str; 2] = ["run", "tool"];

/// The bound on each step of a migration: building an index on a large table takes
/// longer than an operation's timeout.
pub(super) const MIGRATE_TIMEOUT: Duration = Duration::from_secs(600);

/// An index of table `t` (quoted, maybe schema-qualified; `base` its unquoted name):
/// its name as `CREATE INDEX` takes it, and qualified by the table's schema.
pub(super) fn index_name(t: &str, base: &str, suffix: &str) -> (String, String) {
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
pub(super) struct Held(Option<deadpool_postgres::Object>);

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(client) = self.0.take() {
            drop(deadpool_postgres::Object::take(client));
        }
    }
}

impl PostgresStore {
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
    pub(super) async fn create_table(&self, timeout: Duration) -> Result<(), Error> {
        let t = &self.inner.table;
        let base = self.base_name();
        let lock = t.replace('\'', "");
        let (expires_index, expires_qualified) = index_name(t, &base, "expires_at");
        // A step that fails or is dropped closes the connection rather than return it
        // to the pool in a failed transaction.
        let mut held = Held(Some(
            net::bounded(STORE, timeout, self.client()).await?.object,
        ));
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
    pub(super) async fn build_indexes(&self, wait: bool) -> Result<(), Error> {
        let t = &self.inner.table;
        let lock = t.replace('\'', "");
        // Dropped or failed, the connection is closed, and the session's lock with it.
        let mut held = Held(Some(self.bounded(self.client()).await?.object));
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
    pub(super) fn base_name(&self) -> String {
        let t = &self.inner.table;
        t.rsplit('.')
            .next()
            .unwrap_or(t)
            .trim_matches('"')
            .to_owned()
    }

    /// Builds the listings' indexes without blocking writes (an index a failed build
    /// left invalid is built again), then fills the results of 0.1's rows.
    pub(super) async fn indexes_and_results(
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
        for suffix in REPLACED {
            let (_, qualified) = index_name(t, base, suffix);
            let exists = format!("SELECT to_regclass('{qualified}') IS NOT NULL");
            let row = self
                .bounded(async { client.query_one(&exists, &[]).await.map_err(pg_error) })
                .await?;
            if row.try_get::<_, bool>(0).map_err(pg_error)? {
                let drop = format!("DROP INDEX CONCURRENTLY IF EXISTS {qualified}");
                net::bounded(STORE, MIGRATE_TIMEOUT, batch(drop)).await?;
                tracing::info!(table = %t, index = %qualified, "idem: dropped an index that one of settled rows replaces");
            }
        }
        self.fill_results(client).await
    }

    /// Fills `result` for completed rows that lack it (written by idem 0.1, before or
    /// during the upgrade), in batches of a thousand, each one statement. The `unfilled`
    /// index holds just those rows (and those whose result `jsonb` refuses), so a table
    /// with none costs one index lookup.
    pub(super) async fn fill_results(
        &self,
        client: &deadpool_postgres::Object,
    ) -> Result<(), Error> {
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
    pub(super) async fn fill_batch(
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
}
