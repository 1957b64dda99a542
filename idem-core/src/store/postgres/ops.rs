//! The [`Store`] trait on the table: each operation one statement (a claim may read
//! again after losing a race).

use std::time::Duration;

use async_trait::async_trait;
use tokio_postgres::{Row, Statement};

use super::decode::{decode_claim_read, decode_row, now_of, one_row};
use super::sql::{CLAIM_COLUMN_COUNT, PURGE_BATCH};
use super::{as_text, millis, pg_error, Pending, PostgresStore};
use crate::error::Error;
use crate::key_text::Key;
use crate::record::{Record, Timestamp, Token};
use crate::store::net::{fenced, in_local_clock, First};
use crate::store::{
    decide_claim, Claim, ClaimRequest, Counts, Cursor, Fenced, Filter, Listed, Outcome, Page,
    Resolution, Store, Unreadable,
};

/// How many times a claim reads again after losing a race before giving up (each lost
/// race means another caller made progress on the key).
const CLAIM_ATTEMPTS: usize = 64;

impl PostgresStore {
    /// A claim by the claim statement, which serves a key with a row and one without
    /// in one round trip (see `Sql::claim_fresh`), then takes over a row to claim;
    /// again after a lost race. `params` are the claim's eleven (see [`Store::claim`]).
    async fn claim_statement(
        &self,
        client: &deadpool_postgres::Object,
        key: &Key,
        request: &ClaimRequest,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync); 11],
    ) -> Result<Claim, Error> {
        let streak = &self.inner.streak;
        for _ in 0..CLAIM_ATTEMPTS {
            // Each statement's future in a box of its own (see `client`).
            let fresh = &params[..9];
            let read = |stmt: Statement| -> Pending<'_, Row> {
                Box::pin(async move { client.query_one(&stmt, fresh).await })
            };
            let row = self
                .on(client, &self.inner.sql.claim_fresh, read)
                .await
                .map_err(pg_error)?;
            if row
                .try_get::<_, i64>(CLAIM_COLUMN_COUNT + 1)
                .map_err(pg_error)?
                == 1
            {
                streak.inserted();
                return Ok(Claim::Acquired { took_over: false });
            }
            let (Some(current), now) = decode_claim_read(key, &row)? else {
                // Not inserted, yet no row to see: another caller's claim committed
                // after this statement's snapshot was taken. Look again.
                continue;
            };
            let (claim, write) = decide_claim(Some(&current), request, now);
            if write.is_none() {
                streak.found();
                return Ok(in_local_clock(claim, now));
            }
            if self
                .row_on(client, &self.inner.sql.claim, params)
                .await?
                .is_some()
            {
                streak.broken();
                return Ok(claim);
            }
        }
        Err(pg_error("claim kept losing write races; giving up"))
    }
}

#[async_trait]
impl Store for PostgresStore {
    fn name(&self) -> &'static str {
        "postgres"
    }

    /// A renewal waits for the statement a task sends for every claim waiting (see
    /// `renewals.rs`), and never blocks its thread.
    fn renewals_block(&self) -> bool {
        false
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
            // The statement a claim sends first (see `net::Streak`): the claim statement
            // serves a key with a row and one without in one round trip, and costs the
            // server more than either needs. On a hit its `INSERT` is planned and opened,
            // with the table's indexes, though it inserts nothing; on a miss its read,
            // `NOT EXISTS` and count run around the insertion. A plain `SELECT` answers
            // a hit alone; a plain `INSERT … DO NOTHING` claims a new key alone.
            let streak = &self.inner.streak;
            match streak.first() {
                First::Claim => {}
                First::Read => {
                    let read = &self.inner.sql.claim_read;
                    if let Some(row) = self.row_on(&client, read, &[&key.as_str()]).await? {
                        let (current, now) = decode_claim_read(key, &row)?;
                        let (claim, write) = decide_claim(current.as_ref(), request, now);
                        if write.is_none() {
                            streak.found();
                            return Ok(in_local_clock(claim, now));
                        }
                    }
                    // No row, or one to claim: the claim statement decides, and what
                    // it finds moves the streak.
                }
                First::Insert => {
                    let insert = &self.inner.sql.claim_insert;
                    if self.row_on(&client, insert, &params[..9]).await?.is_some() {
                        streak.inserted();
                        return Ok(Claim::Acquired { took_over: false });
                    }
                    // The key has a row: the claim statement reads it and decides,
                    // and what it finds moves the streak.
                }
            }
            // Boxed: its states (a row, a record, a decision, across a second
            // statement) made the future every claim makes 1,520 bytes, past the
            // 1,032 that glibc's per-thread cache serves (1,024 without them).
            Box::pin(self.claim_statement(&client, key, request, &params)).await
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

    /// Queued, and sent with every other renewal waiting, in one statement (see
    /// `renewals.rs`).
    async fn renew(
        &self,
        key: &Key,
        token: Token,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Fenced, Error> {
        self.bounded(self.renew_queued(key, token, lease, ttl))
            .await
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::record::State;
    use crate::store::net::{self, streak_request as request, Streak};

    /// A store on a table of its own on `IDEM_POSTGRES_URL`, whose claims send `fixed`
    /// first (or as the streak says, if `None`); `None` (said loudly) without the
    /// variable.
    async fn store(fixed: Option<First>) -> Option<PostgresStore> {
        let url = crate::store::net::test_server("IDEM_POSTGRES_URL")?;
        let mut store = PostgresStore::builder(&url)
            .table(crate::store::net::unique_name("idem_streak_"))
            .build()
            .expect("a Postgres store");
        Arc::get_mut(&mut store.inner)
            .expect("a store not yet shared")
            .streak
            .fixed = fixed;
        store.migrate().await.expect("the table");
        Some(store)
    }

    async fn drop_table(store: &PostgresStore) {
        let client = store.client().await.expect("a connection");
        client
            .batch_execute(&format!("DROP TABLE IF EXISTS {}", store.table()))
            .await
            .expect("the table dropped");
    }

    /// Every claim of the conformance suite reads its row first: what it decides is
    /// what the claim statement decides.
    #[cfg(feature = "testing")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn claims_that_read_first_conform() {
        let Some(store) = store(Some(First::Read)).await else {
            return;
        };
        crate::testing::run_all(Arc::new(store.clone())).await;
        drop_table(&store).await;
    }

    /// Every claim of the conformance suite inserts first: what it decides is what the
    /// claim statement decides.
    #[cfg(feature = "testing")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn claims_that_insert_first_conform() {
        let Some(store) = store(Some(First::Insert)).await else {
            return;
        };
        crate::testing::run_all(Arc::new(store.clone())).await;
        drop_table(&store).await;
    }

    fn key(name: &str) -> Key {
        Key::from_text(format!("tool.{name}"))
    }

    /// A streak of hits makes claims read first (see `net::a_streak_of_hits_reads_first`);
    /// a streak of `AFTER` new keys makes them insert first. A claim of the other kind
    /// ends either, and is answered as the claim statement answers it.
    #[tokio::test]
    async fn streaks_choose_the_first_statement_and_the_other_kind_ends_them() {
        let Some(store) = store(None).await else {
            return;
        };
        let streak = &store.inner.streak;
        net::a_streak_of_hits_reads_first(&store, streak, key).await;
        // New keys in a row: a streak of misses.
        for i in 0..Streak::AFTER {
            assert_eq!(streak.first(), First::Claim, "after {i} misses");
            let (new, request) = (key(&format!("fresh-{i}")), request(1));
            let claim = store.claim(&new, &request).await.unwrap();
            assert_eq!(claim, Claim::Acquired { took_over: false });
        }
        assert_eq!(streak.first(), First::Insert);
        // Inserted first: a new key is claimed once; a key with a row is answered by
        // the claim statement, and the streak is over.
        let fresh = key("fresh-last");
        let first = request(1);
        assert_eq!(
            store.claim(&fresh, &first).await.unwrap(),
            Claim::Acquired { took_over: false }
        );
        assert!(matches!(
            store.claim(&fresh, &request(1)).await.unwrap(),
            Claim::Busy { .. }
        ));
        assert_eq!(streak.first(), First::Claim);
        let stored = store.get(&fresh).await.unwrap().expect("the claim");
        assert!(
            matches!(stored.state, State::InProgress { token, .. } if token == first.token),
            "{:?}",
            stored.state
        );
        for i in 0..Streak::AFTER {
            let (new, request) = (key(&format!("more-{i}")), request(1));
            let claim = store.claim(&new, &request).await.unwrap();
            assert_eq!(claim, Claim::Acquired { took_over: false });
        }
        assert_eq!(streak.first(), First::Insert);
        let done = key("done");
        assert_eq!(
            store.claim(&done, &request(1)).await.unwrap(),
            Claim::Completed(b"42".to_vec())
        );
        assert_eq!(
            store.claim(&done, &request(2)).await.unwrap(),
            Claim::Mismatch
        );
        drop_table(&store).await;
    }
}
