//! Records written by idem 0.1 (record format 1, and its Postgres table) read back in
//! every store after an upgrade: a call replays them without running its body, and an
//! operator lists them. The Postgres table of 0.1 is migrated in place, while a 0.1
//! worker goes on using it.
//!
//! The network stores need `IDEM_POSTGRES_URL` and `IDEM_REDIS_URL`; without them those
//! tests say they skipped and pass nothing off as checked.

#![cfg(all(feature = "postgres", feature = "redis", feature = "sled"))]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_core::__private::{execute, Call, ReleaseErrors};
use idem_core::store::{Filter, Meta, Record, State, Timestamp, Token};
use idem_core::testing::format_1_bytes;
use idem_core::{Error, Key, Options, PostgresStore, RedisStore, Run, SledStore, Store};

fn env(name: &str) -> Option<String> {
    let url = std::env::var(name).ok().filter(|u| !u.is_empty());
    if url.is_none() {
        eprintln!("SKIPPED: {name} is not set; this test checked nothing");
    }
    url
}

/// A name no other test run uses.
fn unique(prefix: &str) -> String {
    let t = Token::generate().unwrap().to_bits();
    format!(
        "{prefix}_{}_{:012x}",
        std::process::id(),
        t & 0xffff_ffff_ffff
    )
}

/// The call of `send_email` with input `n` in `run`: its key and fingerprint.
fn call(run: &Run, n: u32) -> Call {
    Call::new(Some(run), "send_email", Options::new(), &n).unwrap()
}

/// Calls `send_email(n)` in `run`; counts the body's runs.
async fn send(run: &Run, n: u32, ran: &Arc<AtomicUsize>) -> Result<String, Error> {
    let ran = ran.clone();
    execute::<Result<String, Error>, ReleaseErrors, _>(Ok(call(run, n)), async move {
        ran.fetch_add(1, SeqCst);
        Ok(format!("fresh-{n}"))
    })
    .await?
}

/// A completed record of `call` as 0.1 stored it, its times counted from `from`.
fn completed_v1(call: &Call, result: &str, from: u64) -> Vec<u8> {
    format_1_bytes(&Record {
        fingerprint: *call.fingerprint(),
        created_at: Timestamp::from_millis(from),
        expires_at: Timestamp::from_millis(from + 3_600_000),
        state: State::Completed {
            result: serde_json::to_vec(result).unwrap(),
        },
        meta: Meta::default(),
    })
}

/// Replays the 0.1 record of call 1 without running the body, runs call 2 (which has
/// none), and lists both: the old one without an origin, the new one with it.
async fn old_records_replay_and_list(store: Arc<dyn Store>, run: &Run) {
    let ran = Arc::new(AtomicUsize::new(0));
    assert_eq!(send(run, 1, &ran).await.unwrap(), "sent-by-0.1");
    assert_eq!(
        ran.load(SeqCst),
        0,
        "the body ran for a record 0.1 completed"
    );
    assert_eq!(send(run, 2, &ran).await.unwrap(), "fresh-2");
    assert_eq!(ran.load(SeqCst), 1);
    let old = store.get(call(run, 1).key()).await.unwrap().unwrap();
    assert_eq!(old.meta.origin, None, "{old:?}");
    assert!(old.meta.completed_at.is_some(), "{old:?}");
    let new = store.get(call(run, 2).key()).await.unwrap().unwrap();
    let origin = new.meta.origin.clone().unwrap();
    assert_eq!((&*origin.run_id, &*origin.tool), (run.id(), "send_email"));
    // A listing by tool finds the old record by its key's label, the new by its origin.
    let by_tool = Filter {
        tool: Some("send_email".into()),
        ..Filter::default()
    };
    let (mut keys, mut after) = (Vec::new(), None);
    loop {
        let page = store.list(&by_tool, after.as_ref(), 100).await.unwrap();
        keys.extend(page.records.into_iter().map(|l| l.key));
        match page.next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    for n in [1, 2] {
        let key = call(run, n).key().clone();
        assert!(keys.contains(&key), "{key} not listed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sled_records_of_format_1_replay_after_the_upgrade() {
    let dir = tempfile::tempdir().unwrap();
    let run = Run::new("upgrade-sled");
    {
        let db = sled::open(dir.path()).unwrap();
        let tree = db.open_tree(SledStore::TREE).unwrap();
        let now = Timestamp::now().as_millis();
        let c = call(&run, 1);
        tree.insert(c.key().as_str(), completed_v1(&c, "sent-by-0.1", now))
            .unwrap();
        db.flush().unwrap();
    }
    let store: Arc<dyn Store> = Arc::new(common::open_after_raw(dir.path()));
    let run = run.with_shared_store(store.clone());
    old_records_replay_and_list(store, &run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_records_of_format_1_replay_after_the_upgrade() {
    let Some(url) = env("IDEM_REDIS_URL") else {
        return;
    };
    let prefix = format!("{}:", unique("idem-upgrade"));
    let store = RedisStore::builder(&url)
        .prefix(&prefix)
        .connect()
        .await
        .unwrap();
    let run = Run::new("upgrade-redis");
    let c = call(&run, 1);
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    // 0.1's Redis records count their times from 0, the moment Redis stored them.
    let _: () = redis::cmd("SET")
        .arg(format!("{prefix}{}", c.key()))
        .arg(completed_v1(&c, "sent-by-0.1", 0))
        .arg("PX")
        .arg(3_600_000)
        .query_async(&mut conn)
        .await
        .unwrap();
    let store: Arc<dyn Store> = Arc::new(store);
    let run = run.with_shared_store(store.clone());
    old_records_replay_and_list(store.clone(), &run).await;
    let old = store.get(c.key()).await.unwrap().unwrap();
    let now = Timestamp::now().as_millis();
    assert!(
        old.meta.claimed_at.as_millis().abs_diff(now) < 60_000,
        "a 0.1 record's times are placed in the server's clock: {old:?}"
    );
}

// ----- Postgres: the table of 0.1, migrated in place --------------------------------

/// The table exactly as idem 0.1 created it.
fn table_of_0_1(t: &str) -> String {
    format!(
        "CREATE TABLE {t} (
             key         text        PRIMARY KEY,
             fingerprint bytea       NOT NULL,
             state       smallint    NOT NULL,
             token       bytea       NOT NULL,
             lease_until timestamptz,
             payload     bytea,
             created_at  timestamptz NOT NULL,
             expires_at  timestamptz NOT NULL
         );
         CREATE INDEX {t}_expires_at ON {t} (expires_at);"
    )
}

/// `n` completed rows as 0.1 wrote them, under keys `send_email.<i in hex>`, each with
/// the result `{"message_id":"m-<i>"}`.
fn completed_rows_of_0_1(t: &str, n: u32) -> String {
    format!(
        "INSERT INTO {t} SELECT 'send_email.' || lpad(to_hex(i), 64, '0'), \
             decode(repeat('07', 32), 'hex'), 1, decode(repeat('00', 16), 'hex'), NULL, \
             convert_to('{{\"message_id\":\"m-' || i || '\"}}', 'UTF8'), now(), now() + interval '1 hour' \
         FROM generate_series(1, {n}) AS i;"
    )
}

/// 0.1's claim of a fresh key, as a 0.1 worker sends it during the upgrade.
fn claim_of_0_1(t: &str) -> String {
    format!(
        "INSERT INTO {t} AS r (key, fingerprint, state, token, lease_until, payload, created_at, expires_at) \
         VALUES ($1, $2, 0, $3, now() + interval '60 seconds', NULL, now(), now() + interval '1 hour') \
         ON CONFLICT (key) DO NOTHING"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_migrate_upgrades_a_table_of_0_1_in_place_while_0_1_workers_call() {
    let Some(url) = env("IDEM_POSTGRES_URL") else {
        return;
    };
    let t = unique("idem_upgrade");
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client.batch_execute(&table_of_0_1(&t)).await.unwrap();
    // 20,000 completed records of 0.1 (twenty fill batches), a cached error, a claim
    // in progress, a result jsonb refuses (a NUL escape), and the one call 1 replays.
    client
        .batch_execute(&format!(
            "{}
             INSERT INTO {t} VALUES ('charge_card.1', decode(repeat('07', 32), 'hex'), 2, \
                 decode(repeat('00', 16), 'hex'), NULL, convert_to('\"declined\"', 'UTF8'), now(), now() + interval '1 hour');
             INSERT INTO {t} VALUES ('charge_card.2', decode(repeat('07', 32), 'hex'), 0, \
                 decode(repeat('ab', 16), 'hex'), now() + interval '1 hour', NULL, now(), now() + interval '2 hours');
             INSERT INTO {t} VALUES ('charge_card.3', decode(repeat('07', 32), 'hex'), 1, \
                 decode(repeat('00', 16), 'hex'), NULL, convert_to('\"a\\u0000b\"', 'UTF8'), now(), now() + interval '1 hour');
             INSERT INTO {t} VALUES ('charge_card.4', decode(repeat('07', 32), 'hex'), 1, \
                 decode(repeat('00', 16), 'hex'), NULL, convert_to('{{\"rate\":1e999999}}', 'UTF8'), now(), now() + interval '1 hour');",
            completed_rows_of_0_1(&t, 20_000)
        ))
        .await
        .unwrap();
    let run = Run::new("upgrade-postgres");
    let c = call(&run, 1);
    client
        .execute(
            &format!("INSERT INTO {t} VALUES ($1, $2, 1, $3, NULL, $4, now(), now() + interval '1 hour')"),
            &[
                &c.key().as_str(),
                &c.fingerprint().as_bytes().as_slice(),
                &[0u8; 16].as_slice(),
                &serde_json::to_vec("sent-by-0.1").unwrap(),
            ],
        )
        .await
        .unwrap();
    let rows_before: i64 = client
        .query_one(&format!("SELECT count(*) FROM {t}"), &[])
        .await
        .unwrap()
        .get(0);

    // A 0.1 worker goes on claiming while the table is migrated; its slowest claim
    // says how long calls stopped.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let worker = {
        let (stop, url, t) = (stop.clone(), url.clone(), t.clone());
        tokio::spawn(async move {
            let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                .await
                .unwrap();
            tokio::spawn(conn);
            let claim = client.prepare(&claim_of_0_1(&t)).await.unwrap();
            let (mut slowest, mut claims) = (Duration::ZERO, 0u32);
            while !stop.load(SeqCst) {
                let start = Instant::now();
                let key = format!("old_worker.{claims}");
                client
                    .execute(
                        &claim,
                        &[&key, &[7u8; 32].as_slice(), &[1u8; 16].as_slice()],
                    )
                    .await
                    .unwrap();
                slowest = slowest.max(start.elapsed());
                claims += 1;
            }
            (slowest, claims)
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = Instant::now();
    // `migrate()` waits for the indexes and the results, which `connect()` leaves to
    // the background.
    let store = PostgresStore::builder(&url).table(&t).build().unwrap();
    store.migrate().await.unwrap();
    let took = started.elapsed();
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop.store(true, SeqCst);
    let (slowest, claims) = worker.await.unwrap();
    eprintln!("migrated {rows_before} rows in {took:?}; a 0.1 worker made {claims} claims meanwhile, the slowest in {slowest:?}");
    assert!(claims > 10, "the 0.1 worker barely ran: {claims} claims");
    assert!(
        slowest < Duration::from_secs(2),
        "a 0.1 claim waited {slowest:?} on the migration"
    );

    // Nothing lost: every row is there, results are readable in SQL.
    let rows_after: i64 = client
        .query_one(
            &format!("SELECT count(*) FROM {t} WHERE key NOT LIKE 'old_worker.%'"),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows_after, rows_before);
    let unfilled: i64 = client
        .query_one(
            &format!("SELECT count(*) FROM {t} WHERE state IN (1, 2) AND result IS NULL"),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(unfilled, 2, "only the results jsonb refuses stay NULL");
    let id: String = client
        .query_one(
            &format!("SELECT result->>'message_id' FROM {t} WHERE key = 'send_email.' || lpad(to_hex(777), 64, '0')"),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(id, "m-777");
    let nul = store
        .get(&Key::from_text("charge_card.3"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        nul.state,
        State::Completed {
            result: b"\"a\\u0000b\"".to_vec()
        }
    );
    let claim = store
        .get(&Key::from_text("charge_card.2"))
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(claim.state, State::InProgress { token, .. } if token == Token::from_bits(u128::from_be_bytes([0xab; 16])))
    );
    let invalid: i64 = client
        .query_one(
            &format!(
                "SELECT count(*) FROM pg_index WHERE indrelid = '{t}'::regclass AND NOT indisvalid"
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let indexes: i64 = client
        .query_one(
            &format!("SELECT count(*) FROM pg_indexes WHERE tablename = '{t}'"),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        (invalid, indexes),
        (0, 6),
        "the primary key, expiry, run, tool, in-progress and unfilled indexes"
    );

    // A call replays the 0.1 record; the operator's views work on the migrated table.
    let store: Arc<dyn Store> = Arc::new(store);
    let run = run.with_shared_store(store.clone());
    old_records_replay_and_list(store.clone(), &run).await;
    let counts = store.count(&Filter::default()).await.unwrap();
    assert_eq!(counts.completed, 20_004, "{counts:?}");
    assert_eq!(counts.failed, 1, "{counts:?}");

    // Migrating again finds nothing to do, quickly.
    let again = Instant::now();
    PostgresStore::builder(&url)
        .table(&t)
        .build()
        .unwrap()
        .migrate()
        .await
        .unwrap();
    assert!(
        again.elapsed() < Duration::from_secs(2),
        "a second migration took {:?}",
        again.elapsed()
    );
    client
        .batch_execute(&format!("DROP TABLE {t}"))
        .await
        .unwrap();
}

/// Workers starting together on a table of 0.1 all migrate it without an error, and
/// leave every index valid and every result filled.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_workers_starting_together_migrate_a_table_of_0_1_once() {
    let Some(url) = env("IDEM_POSTGRES_URL") else {
        return;
    };
    let t = unique("idem_upgrade_race");
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client.batch_execute(&table_of_0_1(&t)).await.unwrap();
    client
        .batch_execute(&completed_rows_of_0_1(&t, 5_000))
        .await
        .unwrap();
    let workers: Vec<_> = (0..6)
        .map(|_| {
            let (url, t) = (url.clone(), t.clone());
            tokio::spawn(async move { PostgresStore::builder(&url).table(&t).connect().await })
        })
        .collect();
    for worker in workers {
        worker.await.unwrap().unwrap();
    }
    // The workers that found the indexes being built went on; a migration run on its
    // own finishes whatever they left, and waits for it.
    PostgresStore::builder(&url)
        .table(&t)
        .build()
        .unwrap()
        .migrate()
        .await
        .unwrap();
    let row = client
        .query_one(
            &format!(
                "SELECT (SELECT count(*) FROM pg_index WHERE indrelid = '{t}'::regclass AND indisvalid), \
                        (SELECT count(*) FROM {t} WHERE result IS NULL)"
            ),
            &[],
        )
        .await
        .unwrap();
    assert_eq!((row.get::<_, i64>(0), row.get::<_, i64>(1)), (6, 0));
    client
        .batch_execute(&format!("DROP TABLE {t}"))
        .await
        .unwrap();
}

/// A result `jsonb` refuses (a `\u0000` escape, a number beyond `numeric`) is still
/// recorded and replayed byte for byte; only its `result` column stays NULL. A result
/// that failed the completion would make every retry run the body again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_records_results_jsonb_refuses() {
    let Some(url) = env("IDEM_POSTGRES_URL") else {
        return;
    };
    let t = unique("idem_jsonb");
    let store = PostgresStore::builder(&url)
        .table(&t)
        .connect()
        .await
        .unwrap();
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let results: [&[u8]; 4] = [
        br#"{"rate":1e999999}"#,
        br#"{"rate":1e-999999}"#,
        br#""a\u0000b""#,
        br#"{"message_id":"m-1"}"#,
    ];
    for (i, result) in results.iter().enumerate() {
        let key = Key::from_text(format!("tool.{i}"));
        let request = idem_core::store::ClaimRequest {
            origin: idem_core::store::Origin::new("run", "tool"),
            fingerprint: idem_core::store::Fingerprint::from_bytes([1; 32]),
            token: Token::generate().unwrap(),
            lease: Duration::from_secs(60),
            ttl: Duration::from_secs(60),
            take_over_expired: false,
            retry_failed: false,
        };
        store.claim(&key, &request).await.unwrap();
        let done = store
            .complete(
                &key,
                request.token,
                idem_core::store::Outcome::Completed(result),
                Duration::from_secs(60),
            )
            .await
            .unwrap();
        assert_eq!(
            done,
            idem_core::store::Fenced::Applied,
            "{}",
            String::from_utf8_lossy(result)
        );
        let replay = store.claim(&key, &request).await.unwrap();
        assert_eq!(replay, idem_core::store::Claim::Completed(result.to_vec()));
        let json: Option<String> = client
            .query_one(
                &format!("SELECT result::text FROM {t} WHERE key = $1"),
                &[&key.as_str()],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(json.is_some(), i == 3, "{json:?}");
    }
    client
        .batch_execute(&format!("DROP TABLE {t}"))
        .await
        .unwrap();
}

/// A result the database's encoding cannot hold (a `€` in a LATIN1 database) is still
/// recorded, with `result` NULL: a completion that failed would make each retry run the
/// body again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_records_outcomes_the_database_encoding_cannot_hold() {
    let Some(url) = env("IDEM_POSTGRES_URL") else {
        return;
    };
    let db = unique("idem_latin1");
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client
        .batch_execute(&format!(
            "CREATE DATABASE {db} ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0"
        ))
        .await
        .unwrap();
    let db_url = match url.rsplit_once('/') {
        Some((server, _)) => format!("{server}/{db}"),
        None => panic!("IDEM_POSTGRES_URL names no database: {url}"),
    };
    {
        let store: Arc<dyn Store> = Arc::new(PostgresStore::connect(&db_url).await.unwrap());
        let run = Run::new("latin1").with_shared_store(store.clone());
        let ran = Arc::new(AtomicUsize::new(0));
        let euro = |ran: &Arc<AtomicUsize>| {
            let ran = ran.clone();
            execute::<Result<String, Error>, ReleaseErrors, _>(Ok(call(&run, 9)), async move {
                ran.fetch_add(1, SeqCst);
                Ok("12 €".to_owned())
            })
        };
        for _ in 0..3 {
            assert_eq!(euro(&ran).await.unwrap().unwrap(), "12 €");
        }
        assert_eq!(
            ran.load(SeqCst),
            1,
            "the body ran again: its outcome was not recorded"
        );
        let record = store.get(call(&run, 9).key()).await.unwrap().unwrap();
        assert_eq!(
            record.state,
            State::Completed {
                result: "\"12 €\"".as_bytes().to_vec()
            }
        );
    }
    // The store's connections close with it; give the server a moment to see them go.
    for _ in 0..50 {
        let dropped = client.batch_execute(&format!("DROP DATABASE {db}")).await;
        if dropped.is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("could not drop database {db}");
}

/// A migration that fails (its lock given up after the timeout, behind a long
/// transaction) leaves no connection of the pool in a failed transaction: once the
/// transaction ends, the next migration and every call work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_failed_migration_spoils_no_connection() {
    let Some(url) = env("IDEM_POSTGRES_URL") else {
        return;
    };
    let t = unique("idem_spoil");
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client.batch_execute(&table_of_0_1(&t)).await.unwrap();
    let (holder, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    holder
        .batch_execute(&format!("BEGIN; SELECT count(*) FROM {t}"))
        .await
        .unwrap();
    let store = PostgresStore::builder(&url)
        .table(&t)
        .timeout(Duration::from_secs(1))
        .max_connections(1)
        .build()
        .unwrap();
    let error = store.migrate().await.unwrap_err();
    assert!(error.to_string().contains("55P03"), "{error}");
    holder.batch_execute("COMMIT").await.unwrap();
    store.migrate().await.unwrap();
    let page = store.list(&Filter::default(), None, 10).await.unwrap();
    assert!(page.records.is_empty());
    client
        .batch_execute(&format!("DROP TABLE {t}"))
        .await
        .unwrap();
}

/// A table with the listings' indexes of every row (by run and by tool, as earlier
/// builds made them) has them replaced by the indexes of settled rows: `migrate()`
/// builds those and drops the old ones, and the table's records are listed as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_listing_indexes_of_every_row_are_replaced_by_those_of_settled_rows() {
    let Some(url) = env("IDEM_POSTGRES_URL") else {
        return;
    };
    let t = unique("idem_reindexed");
    let store = PostgresStore::builder(&url).table(&t).build().unwrap();
    store.migrate().await.unwrap();
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client
        .batch_execute(&format!(
            "DROP INDEX {t}_settled_run; DROP INDEX {t}_settled_tool; \
             CREATE INDEX {t}_run ON {t} (run_id, key); CREATE INDEX {t}_tool ON {t} (tool, key)"
        ))
        .await
        .unwrap();
    let run = Run::new(unique("run")).with_store(store.clone());
    let ran = Arc::new(AtomicUsize::new(0));
    assert_eq!(send(&run, 1, &ran).await.unwrap(), "fresh-1");
    store.migrate().await.unwrap();
    let indexes = format!(
        "SELECT string_agg(substr(indexrelid::regclass::text, {}) || ':' || indisvalid, ' ' \
             ORDER BY indexrelid::regclass::text) FROM pg_index WHERE indrelid = '{t}'::regclass",
        t.len() + 2
    );
    let listed: String = client.query_one(&indexes, &[]).await.unwrap().get(0);
    assert_eq!(
        listed,
        "expires_at:true in_progress:true pkey:true settled_run:true settled_tool:true unfilled:true"
    );
    let filter = Filter {
        run_id: Some(run.id().to_owned()),
        ..Filter::default()
    };
    let page = store.list(&filter, None, 10).await.unwrap();
    assert_eq!(page.records.len(), 1);
    assert_eq!(send(&run, 1, &ran).await.unwrap(), "fresh-1");
    assert_eq!(ran.load(SeqCst), 1);
    client
        .batch_execute(&format!("DROP TABLE {t}"))
        .await
        .unwrap();
}

/// A table name of the longest Postgres takes (63 bytes) still gets every index.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_long_table_name_gets_every_index() {
    let Some(url) = env("IDEM_POSTGRES_URL") else {
        return;
    };
    let t = format!("{:_<63}", unique("idem_long"));
    let store = PostgresStore::builder(&url).table(&t).build().unwrap();
    store.migrate().await.unwrap();
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let valid: i64 = client
        .query_one(
            &format!(
                "SELECT count(*) FROM pg_index WHERE indrelid = '\"{t}\"'::regclass AND indisvalid"
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(valid, 6);
    client
        .batch_execute(&format!("DROP TABLE \"{t}\""))
        .await
        .unwrap();
}

/// `connect()` returns within the store's timeout while another session holds a long
/// transaction open (on another table): `CREATE INDEX CONCURRENTLY`, which the listings'
/// indexes of an existing table (one of idem 0.1) need, waits for it, so they are built
/// in the background, and calls work at once. `migrate()` run on its own waits for
/// them; once the transaction ends, they are there. A new table gets its indexes as it
/// is made, and waits for nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_connect_returns_within_its_timeout_while_a_long_transaction_runs() {
    let Some(url) = env("IDEM_POSTGRES_URL") else {
        return;
    };
    let (other, old, new) = (
        unique("idem_other"),
        unique("idem_connect_old"),
        unique("idem_connect_new"),
    );
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client
        .batch_execute(&format!(
            "CREATE TABLE {other} (n int); {}",
            table_of_0_1(&old)
        ))
        .await
        .unwrap();
    let (long, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    long.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .await
        .unwrap();
    long.batch_execute(&format!("SELECT count(*) FROM {other}"))
        .await
        .unwrap();

    let timeout = Duration::from_secs(2);
    let valid = |t: &str| {
        format!("SELECT count(*) FROM pg_index WHERE indrelid = '{t}'::regclass AND indisvalid")
    };
    let mut stores = Vec::new();
    for t in [&old, &new] {
        let started = Instant::now();
        let store = PostgresStore::builder(&url)
            .table(t)
            .timeout(timeout)
            .connect()
            .await
            .unwrap();
        let took = started.elapsed();
        assert!(
            took < timeout * 2,
            "{t}: connect() took {took:?} with a {timeout:?} timeout"
        );
        let run = Run::new(unique("connect")).with_store(store.clone());
        let ran = Arc::new(AtomicUsize::new(0));
        assert_eq!(send(&run, 1, &ran).await.unwrap(), "fresh-1");
        assert_eq!(send(&run, 1, &ran).await.unwrap(), "fresh-1");
        assert_eq!(ran.load(SeqCst), 1, "{t}: calls work at once");
        stores.push(store);
    }
    let built = |t: String| {
        let client = &client;
        async move {
            client
                .query_one(&valid(&t), &[])
                .await
                .unwrap()
                .get::<_, i64>(0)
        }
    };
    assert_eq!(
        built(new.clone()).await,
        6,
        "a new table has every index at once"
    );
    assert!(
        built(old.clone()).await < 6,
        "the long transaction holds the build up"
    );

    // `migrate()` waits for the long transaction, and builds what is missing.
    let migrating = tokio::spawn({
        let store = stores[0].clone();
        async move { store.migrate().await }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!migrating.is_finished(), "migrate() waits for the indexes");
    long.batch_execute("COMMIT").await.unwrap();
    migrating.await.unwrap().unwrap();
    assert_eq!(
        built(old.clone()).await,
        6,
        "the key, the expiry and the four listings"
    );
    client
        .batch_execute(&format!(
            "DROP TABLE {old}; DROP TABLE {new}; DROP TABLE {other}"
        ))
        .await
        .unwrap();
}
