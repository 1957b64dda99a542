//! The Postgres and Redis stores against real servers: the conformance suite, a fleet
//! of OS processes racing on the same keys, and servers that are wrong, silent or
//! stopped.
//!
//! The servers come from `IDEM_POSTGRES_URL` and `IDEM_REDIS_URL`. Without them the
//! tests say they skipped and pass nothing off as checked. Every test works in its own
//! table or key prefix, so parallel runs do not meet.

#![cfg(all(feature = "postgres", feature = "redis"))]

use std::collections::HashMap;
use std::net::TcpListener;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_core::__private::{execute, Call, ReleaseErrors};
use idem_core::store::{
    Claim, ClaimRequest, Fenced, Fingerprint, Outcome, Record, State, Timestamp, Token,
};
use idem_core::testing;
use idem_core::{Error, Key, LocalCache, Options, PostgresStore, RedisStore, Run, Store, Tool};

fn postgres_url() -> Option<String> {
    let url = std::env::var("IDEM_POSTGRES_URL")
        .ok()
        .filter(|u| !u.is_empty());
    if url.is_none() {
        eprintln!("SKIPPED: IDEM_POSTGRES_URL is not set; this Postgres test checked nothing");
    }
    url
}

fn redis_url() -> Option<String> {
    let url = std::env::var("IDEM_REDIS_URL")
        .ok()
        .filter(|u| !u.is_empty());
    if url.is_none() {
        eprintln!("SKIPPED: IDEM_REDIS_URL is not set; this Redis test checked nothing");
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

/// A claim of tool `tool` whose fingerprint is `byte` repeated: a 30-second lease, a
/// one-minute TTL, a fresh token.
fn claim_request(byte: u8) -> ClaimRequest {
    ClaimRequest {
        origin: idem_core::store::Origin::new("run", "tool"),
        fingerprint: Fingerprint::from_bytes([byte; 32]),
        token: Token::generate().unwrap(),
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(60),
        take_over_expired: true,
        retry_failed: true,
    }
}

/// A store on `table` with a pool of `connections`, whose operations may wait 30 s: the
/// renewal tests' store, where the pool, not the timeout, is what they load.
async fn store_on(url: &str, table: &str, connections: usize) -> PostgresStore {
    PostgresStore::builder(url)
        .table(table)
        .max_connections(connections)
        .timeout(Duration::from_secs(30))
        .connect()
        .await
        .unwrap()
}

async fn drop_table(url: &str, table: &str) {
    if let Ok((client, conn)) = tokio_postgres::connect(url, tokio_postgres::NoTls).await {
        tokio::spawn(conn);
        let _ = client
            .batch_execute(&format!("DROP TABLE IF EXISTS {table}"))
            .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_store_conforms() {
    let Some(url) = postgres_url() else { return };
    let table = unique("idem_conformance");
    let store = PostgresStore::builder(&url)
        .table(&table)
        .connect()
        .await
        .unwrap();
    // Migrating again, from many workers at once, is harmless.
    let again: Vec<_> = (0..4).map(|_| store.migrate()).collect();
    for r in futures_join(again).await {
        r.unwrap();
    }
    testing::run_all(Arc::new(store)).await;
    drop_table(&url, &table).await;
}

/// A purge removes rows written by hand to expire before 1970 (`-infinity`, 1969, a
/// batch's latest expiry there too), as every other expired row, and keeps live ones.
#[tokio::test]
async fn postgres_purge_removes_rows_that_expired_before_1970() {
    let Some(url) = postgres_url() else { return };
    let table = unique("idem_purge_1969");
    let store = store_on(&url, &table, 2).await;
    let client = store.pool().get().await.unwrap();
    let insert = |rows: &'static str| {
        let sql = format!(
            "INSERT INTO {table} (key, fingerprint, state, token, payload, created_at, expires_at)
             SELECT key, '\\x00', 1, '\\x00', '\\x00', now(), expires_at
             FROM (VALUES {rows}) AS r (key, expires_at)"
        );
        let client = &client;
        async move { client.batch_execute(&sql).await.unwrap() }
    };
    // Alone, a batch whose latest expiry is `-infinity`.
    insert("('minus_infinity', '-infinity'::timestamptz), ('live', now() + interval '1 hour')")
        .await;
    assert_eq!(store.purge_expired().await.unwrap(), 1);
    insert(
        "('y1969', '1969-12-31 23:59:59.9995+00'::timestamptz), \
         ('y1970', '1970-01-01 00:00:00+00'), ('an_hour_ago', now() - interval '1 hour')",
    )
    .await;
    assert_eq!(store.purge_expired().await.unwrap(), 3);
    assert_eq!(store.purge_expired().await.unwrap(), 0);
    let left = client
        .query(&format!("SELECT key FROM {table}"), &[])
        .await
        .unwrap();
    let left: Vec<String> = left.iter().map(|row| row.get(0)).collect();
    assert_eq!(left, ["live"]);
    drop(client);
    drop_table(&url, &table).await;
}

/// A purge deletes in batches of 10,000 rows, each starting at the last one's latest
/// expiry: a backlog of several batches goes whole, also where rows sharing an expiry
/// straddle the border of two batches and expiries fall between whole milliseconds,
/// and live rows stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_purge_removes_a_backlog_of_many_batches_and_keeps_live_rows() {
    let Some(url) = postgres_url() else { return };
    let table = unique("idem_purge");
    let store = PostgresStore::builder(&url)
        .table(&table)
        .connect()
        .await
        .unwrap();
    let client = store.pool().get().await.unwrap();
    // Seven expired rows to an expiry, expiries 0.5 ms apart from a whole millisecond:
    // the first border (row 10,000) falls inside a group on a whole millisecond, the
    // second (row 20,000) inside one between two. Then 100 live rows.
    client
        .batch_execute(&format!(
            "INSERT INTO {table}
             SELECT 'expired.' || g, '\\x00', 1, '\\x00', NULL, '\\x00', now() - interval '2 hours',
                    date_trunc('milliseconds', now()) - interval '1 hour'
                        + (g / 7) * interval '500 microseconds'
             FROM generate_series(1, 25003) AS g;
             INSERT INTO {table}
             SELECT 'live.' || g, '\\x00', 1, '\\x00', NULL, '\\x00', now(), now() + interval '1 hour'
             FROM generate_series(1, 100) AS g;"
        ))
        .await
        .unwrap();

    assert_eq!(store.purge_expired().await.unwrap(), 25_003);
    let left: Vec<String> = client
        .query(&format!("SELECT key FROM {table}"), &[])
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(left.len(), 100, "rows left: {left:?}");
    assert!(left.iter().all(|key| key.starts_with("live.")), "{left:?}");
    assert_eq!(store.purge_expired().await.unwrap(), 0);
    drop(client);
    drop_table(&url, &table).await;
}

/// A call of tool `send_email` with input `n` whose body counts its runs in `ran` and
/// returns `value`.
async fn call_counted(run: &Run, ran: &Arc<AtomicUsize>, n: u32, value: u32) -> Result<u32, Error> {
    let ran = ran.clone();
    Tool::new("send_email")
        .call(run, &n, move |_| async move {
            ran.fetch_add(1, SeqCst);
            Ok::<_, Error>(value)
        })
        .await
}

/// A table of its own (named from `prefix`) and a store on it with `connections`
/// sessions (one, so that every statement runs on the session a test spoils); a run on
/// the store, and a count of the bodies `call_counted` runs.
async fn counted_store(
    url: &str,
    prefix: &str,
    connections: usize,
) -> (String, PostgresStore, Run, Arc<AtomicUsize>) {
    let table = unique(prefix);
    let store = store_on(url, &table, connections).await;
    let run = Run::new(unique("run")).with_store(store.clone());
    (table, store, run, Arc::new(AtomicUsize::new(0)))
}

/// A session whose prepared statements went (`DISCARD ALL`, `DEALLOCATE`, run by hand
/// or by a pooler) has them prepared again: every call after it works, with no error
/// and no second run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_session_that_lost_its_prepared_statements_prepares_them_again() {
    let Some(url) = postgres_url() else { return };
    let (table, store, run, ran) = counted_store(&url, "idem_discard_all", 1).await;
    let discard = || async {
        let session = store.pool().get().await.unwrap();
        session.batch_execute("DISCARD ALL").await.unwrap();
    };
    assert_eq!(call_counted(&run, &ran, 1, 10).await.unwrap(), 10);
    discard().await;
    assert_eq!(call_counted(&run, &ran, 1, 11).await.unwrap(), 10);
    discard().await;
    // A claim, then a completion, each the first statement after a discard.
    assert_eq!(call_counted(&run, &ran, 2, 20).await.unwrap(), 20);
    discard().await;
    let listed = store.list(&Default::default(), None, 10).await.unwrap();
    assert_eq!(listed.records.len(), 2, "{:?}", listed.unreadable);
    assert_eq!(call_counted(&run, &ran, 2, 21).await.unwrap(), 20);
    assert_eq!(ran.load(SeqCst), 2);
    drop_table(&url, &table).await;
}

/// A column the statements return changes type under running workers (`ALTER COLUMN
/// … TYPE`, here the expiry to `timestamptz(3)`, then back): the server refuses the
/// statements each session prepared before, and they are prepared again. Every call
/// answers, hits replay, and each body ran once.
#[tokio::test]
async fn postgres_a_column_that_changed_type_has_the_statements_prepared_again() {
    let Some(url) = postgres_url() else { return };
    let (table, store, run, ran) = counted_store(&url, "idem_altered", 1).await;
    let alter = |to: &'static str| {
        let (store, table) = (store.clone(), table.clone());
        async move {
            let session = store.pool().get().await.unwrap();
            let sql = format!("ALTER TABLE {table} ALTER COLUMN expires_at TYPE {to}");
            session.batch_execute(&sql).await.unwrap();
        }
    };
    assert_eq!(call_counted(&run, &ran, 1, 10).await.unwrap(), 10);
    assert!(store.list(&Default::default(), None, 10).await.is_ok());
    // After each change: a hit, a miss (a claim and a completion) of the next input,
    // and a listing of every record so far.
    for (to, n) in [("timestamptz(3)", 2), ("timestamptz", 3)] {
        alter(to).await;
        assert_eq!(call_counted(&run, &ran, 1, 11).await.unwrap(), 10, "{to}");
        assert_eq!(
            call_counted(&run, &ran, n, n * 10).await.unwrap(),
            n * 10,
            "{to}"
        );
        let listed = store.list(&Default::default(), None, 10).await.unwrap();
        assert_eq!(
            listed.records.len() as u32,
            n,
            "{to}: {:?}",
            listed.unreadable
        );
    }
    assert_eq!(ran.load(SeqCst), 3);
    drop_table(&url, &table).await;
}

/// A migration that alters the time columns one statement at a time, again and again,
/// under 16 tasks calling (hits) on 16 sessions: a statement prepared again can meet
/// the next change before it runs, and is prepared again once more. No call fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_calls_go_on_through_a_migration_of_many_statements() {
    let Some(url) = postgres_url() else { return };
    let (table, _store, run, ran) = counted_store(&url, "idem_migrating", 16).await;
    for n in 0..16 {
        call_counted(&run, &ran, n, n).await.unwrap();
    }
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let callers: Vec<_> = (0..16)
        .map(|n| {
            let (run, ran, done) = (run.clone(), ran.clone(), done.clone());
            tokio::spawn(async move {
                let mut failed = Vec::new();
                while !done.load(SeqCst) {
                    match call_counted(&run, &ran, n, u32::MAX).await {
                        Ok(value) => assert_eq!(value, n),
                        Err(error) => failed.push(error.to_string()),
                    }
                }
                failed
            })
        })
        .collect();
    let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    for round in 0..10 {
        let to = if round % 2 == 0 {
            "timestamptz(3)"
        } else {
            "timestamptz"
        };
        for column in ["lease_until", "expires_at", "created_at"] {
            let sql = format!("ALTER TABLE {table} ALTER COLUMN {column} TYPE {to}");
            client.batch_execute(&sql).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    done.store(true, SeqCst);
    for caller in callers {
        let failed = caller.await.unwrap();
        assert!(
            failed.is_empty(),
            "{} calls failed: {:?}",
            failed.len(),
            &failed[..1]
        );
    }
    assert_eq!(ran.load(SeqCst), 16);
    drop(client);
    drop_table(&url, &table).await;
}

/// A running call's renewals do not queue behind a burst of other calls for a pooled
/// connection: with 3,000 calls (replays) flooding a pool of one connection while a
/// body runs, the body keeps its claim. Another worker calling the same key meanwhile
/// waits for its value and does not run the body again (when a renewal queued behind
/// the burst, its lease ran out waiting, the other worker took the claim over, and the
/// body ran twice).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_burst_of_calls_does_not_starve_a_running_calls_renewals() {
    let Some(url) = postgres_url() else { return };
    let table = unique("idem_starved");
    let (busy, other) = (
        store_on(&url, &table, 1).await,
        store_on(&url, &table, 4).await,
    );
    let lease = Duration::from_millis(600);
    let ran = Arc::new(AtomicUsize::new(0));
    let call = |store: &PostgresStore, tool: &'static str, n: u32, body: Duration, value: u32| {
        let (run, ran) = (Run::new("starved").with_store(store.clone()), ran.clone());
        tokio::spawn(async move {
            Tool::new(tool)
                .lease(lease)
                .call(&run, &n, move |_| async move {
                    if tool == "send_email" {
                        ran.fetch_add(1, SeqCst);
                    }
                    tokio::time::sleep(body).await;
                    Ok::<_, Error>(value)
                })
                .await
        })
    };
    // The burst replays one completed call: each is a statement that reads, and no
    // commit waits for the disk.
    assert_eq!(
        call(&busy, "flood", 1, Duration::ZERO, 1)
            .await
            .unwrap()
            .unwrap(),
        1
    );
    let first = call(&busy, "send_email", 0, lease * 3, 7);
    while ran.load(SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let burst: Vec<_> = (0..3000)
        .map(|_| call(&busy, "flood", 1, Duration::ZERO, 2))
        .collect();
    tokio::time::sleep(lease * 2).await;
    let second = call(&other, "send_email", 0, Duration::ZERO, 8);
    assert_eq!(
        first.await.unwrap().unwrap(),
        7,
        "the first caller kept its claim"
    );
    assert_eq!(
        second.await.unwrap().unwrap(),
        7,
        "the second caller got the first's value"
    );
    assert_eq!(ran.load(SeqCst), 1, "the body ran once");
    for replayed in futures_join(burst).await {
        assert_eq!(replayed.unwrap().unwrap(), 1);
    }
    drop_table(&url, &table).await;
}

/// Renewals hold one connection at most, however many bodies run: 600 bodies under a
/// 600 ms lease on a pool of one connection (3,000 renewals a second asked for) all
/// keep their claims, and every call records its outcome and returns its value. (With
/// one renewal statement per claim, each ahead of the calls' queue, the renewals kept
/// the only connection, completions never got it, and retries ran bodies again.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_renewals_of_many_bodies_leave_the_calls_a_connection() {
    let Some(url) = postgres_url() else { return };
    let table = unique("idem_renewals");
    let store = store_on(&url, &table, 1).await;
    let run = Run::new("bodies").with_store(store.clone());
    let ran = Arc::new(AtomicUsize::new(0));
    let calls: Vec<_> = (0..600u32)
        .map(|n| {
            let (run, ran) = (run.clone(), ran.clone());
            tokio::spawn(async move {
                Tool::new("long")
                    .lease(Duration::from_millis(600))
                    .call(&run, &n, move |_| async move {
                        ran.fetch_add(1, SeqCst);
                        tokio::time::sleep(Duration::from_millis(1500)).await;
                        Ok::<_, Error>(n + 1)
                    })
                    .await
            })
        })
        .collect();
    for (n, call) in futures_join(calls).await.into_iter().enumerate() {
        assert_eq!(call.unwrap().unwrap(), n as u32 + 1);
    }
    assert_eq!(ran.load(SeqCst), 600, "each body ran once");
    // Every outcome is recorded: calling again replays each.
    for n in 0..600u32 {
        let replayed = Tool::new("long")
            .call(&run, &n, |_| async { Ok::<_, Error>(0) })
            .await
            .unwrap();
        assert_eq!(replayed, n + 1);
    }
    assert_eq!(ran.load(SeqCst), 600);
    drop_table(&url, &table).await;
}

/// A row another transaction holds locked is skipped by the renewals' statement, not
/// waited for on a connection: on a pool of one connection, the other claim is renewed
/// at once, and a call goes through, while the locked row's renewal waits; once the
/// lock is let go it lands within moments. A claim that is not the caller's is
/// `LostLease`. (A renewal that waited for the lock held the only connection, and
/// everything else waited behind it; one answered at once with an error was tried again
/// only half a renewal period later, after a worker waiting on the same lock could take
/// the claim over.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_locked_row_holds_up_its_own_renewal_only() {
    let Some(url) = postgres_url() else { return };
    let table = unique("idem_locked");
    let store = store_on(&url, &table, 1).await;
    let (locked, free) = (claim_request(1), claim_request(2));
    let key = |request: &ClaimRequest| Key::of("tool", &request.fingerprint);
    for request in [&locked, &free] {
        let claim = store.claim(&key(request), request).await.unwrap();
        assert!(matches!(claim, Claim::Acquired { .. }), "{claim:?}");
    }
    let (mut outside, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let holder = outside.transaction().await.unwrap();
    holder
        .execute(
            &format!("SELECT 1 FROM {table} WHERE key = $1 FOR UPDATE"),
            &[&key(&locked).as_str()],
        )
        .await
        .unwrap();
    let renew = |request: &ClaimRequest| {
        let (store, key, token) = (store.clone(), key(request), request.token);
        let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(60));
        tokio::spawn(async move { store.renew(&key, token, lease, ttl).await })
    };
    let of_locked = renew(&locked);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = Instant::now();
    assert_eq!(renew(&free).await.unwrap().unwrap(), Fenced::Applied);
    let read = store.get(&key(&free)).await.unwrap();
    assert!(read.is_some());
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert!(
        !of_locked.is_finished(),
        "the locked row's renewal waits for the lock"
    );
    holder.rollback().await.unwrap();
    let released = Instant::now();
    assert_eq!(of_locked.await.unwrap().unwrap(), Fenced::Applied);
    assert!(
        released.elapsed() < Duration::from_secs(1),
        "{:?}",
        released.elapsed()
    );
    let stranger = ClaimRequest {
        token: Token::generate().unwrap(),
        ..locked.clone()
    };
    assert_eq!(renew(&stranger).await.unwrap().unwrap(), Fenced::LostLease);
    drop_table(&url, &table).await;
}

/// A renewal started on a runtime that is then kept but no longer driven (a
/// current-thread runtime between two `block_on`s) holds up no later renewal of the
/// store: the task that sends them runs on idem's own runtime. (When it ran on the
/// runtime of the renewal that started it, every later renewal waited out the store's
/// timeout, and live claims lapsed.)
#[test]
fn postgres_a_renewal_started_on_an_idle_runtime_holds_up_no_other() {
    let Some(url) = postgres_url() else { return };
    let table = unique("idem_idle_runtime");
    let main = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let side = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let store = main
        .block_on(
            PostgresStore::builder(&url)
                .table(&table)
                .timeout(Duration::from_secs(5))
                .connect(),
        )
        .unwrap();
    let request = claim_request(3);
    let key = Key::of("tool", &request.fingerprint);
    let claim = main.block_on(store.claim(&key, &request)).unwrap();
    assert!(matches!(claim, Claim::Acquired { .. }), "{claim:?}");
    // Queued on the side runtime, which is not driven again.
    side.block_on(async {
        let renewing = store.renew(&key, request.token, request.lease, request.ttl);
        let _ = tokio::time::timeout(Duration::from_micros(1), renewing).await;
    });
    for _ in 0..3 {
        let started = Instant::now();
        let renewed = main
            .block_on(store.renew(&key, request.token, request.lease, request.ttl))
            .unwrap();
        assert_eq!(renewed, Fenced::Applied);
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
    }
    main.block_on(drop_table(&url, &table));
    drop(side);
}

/// A claim whose renewal the server refuses for its values (a lease past what an
/// interval holds) fails alone: the renewals sent in the same statement are applied.
/// They are made to share one: the store's only connection is held while they queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_renewal_the_server_refuses_fails_alone() {
    let Some(url) = postgres_url() else { return };
    let table = unique("idem_refused");
    let store = store_on(&url, &table, 1).await;
    let mut claims = Vec::new();
    for n in 0..40u8 {
        let request = claim_request(n);
        let key = Key::of("tool", &request.fingerprint);
        let claim = store.claim(&key, &request).await.unwrap();
        assert!(matches!(claim, Claim::Acquired { .. }), "{claim:?}");
        claims.push((key, request.token));
    }
    const REFUSED: usize = 20;
    for _ in 0..3 {
        let held = store.pool().get().await.unwrap();
        // One claim's renewal asks for a lease no interval holds.
        let renewals = claims.iter().enumerate().map(|(i, (key, token))| {
            let (store, key, token) = (store.clone(), key.clone(), *token);
            let lease = match i {
                REFUSED => Duration::MAX,
                _ => Duration::from_secs(30),
            };
            tokio::spawn(async move {
                store
                    .renew(&key, token, lease, Duration::from_secs(60))
                    .await
            })
        });
        let renewals: Vec<_> = renewals.collect();
        tokio::time::sleep(Duration::from_millis(300)).await;
        drop(held);
        for (i, renewed) in futures_join(renewals).await.into_iter().enumerate() {
            match (i, renewed.unwrap()) {
                (REFUSED, Err(Error::Store { .. })) => {}
                (REFUSED, other) => panic!("the refused renewal: {other:?}"),
                (_, other) => assert_eq!(other.unwrap(), Fenced::Applied, "claim {i}"),
            }
        }
    }
    drop_table(&url, &table).await;
}

/// A table whose statistics are stale, as between two autovacuum runs: analyzed while
/// every row had expired and none was in progress, then filled with rows in progress
/// that expire later. Completions, renewals and releases each find their row by the
/// primary key; they never walk the in-progress or the expiry index (each of which
/// now holds every live row, where the statistics say it holds none).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_statements_find_their_row_by_key_whatever_the_statistics() {
    let Some(url) = postgres_url() else { return };
    let table = unique("idem_stale_stats");
    let store = PostgresStore::builder(&url)
        .table(&table)
        .connect()
        .await
        .unwrap();
    // A connection of its own: the store's go when the store does.
    let (admin, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    let row = |state: u8, lease: &str, expires: &str| {
        format!(
            "SELECT 'stale.' || g || '.{state}', '\\x00', {state}, '\\x00', {lease}, '\\x00', now(), {expires} \
             FROM generate_series(1, 20000) AS g"
        )
    };
    admin
        .batch_execute(&format!(
            "INSERT INTO {table} (key, fingerprint, state, token, lease_until, payload, created_at, expires_at) {}",
            row(1, "NULL", "now() - interval '1 day'")
        ))
        .await
        .unwrap();
    admin
        .batch_execute(&format!("VACUUM ANALYZE {table}"))
        .await
        .unwrap();
    admin
        .batch_execute(&format!(
            "INSERT INTO {table} (key, fingerprint, state, token, lease_until, payload, created_at, expires_at) {}",
            row(0, "now() + interval '1 hour'", "now() + interval '1 day'")
        ))
        .await
        .unwrap();
    // Scans of the in-progress and the expiry index, and of every index.
    let scans = format!(
        "SELECT coalesce(sum(idx_scan) FILTER (WHERE indexrelname LIKE '%\\_in\\_progress' \
                                                   OR indexrelname LIKE '%\\_expires\\_at'), 0)::int8, \
                coalesce(sum(idx_scan), 0)::int8 \
         FROM pg_stat_user_indexes WHERE relid = '{table}'::regclass"
    );
    let before: i64 = admin.query_one(&scans, &[]).await.unwrap().get(1);
    let run = Run::new(unique("run")).with_store(store.clone());
    let ran = Arc::new(AtomicUsize::new(0));
    for n in 0..50 {
        assert_eq!(call_counted(&run, &ran, n, n).await.unwrap(), n);
    }
    // A renewal and a release, which no call above needed.
    let request = claim_request(7);
    let key = Key::of("tool", &request.fingerprint);
    let claim = store.claim(&key, &request).await.unwrap();
    assert!(matches!(claim, Claim::Acquired { .. }), "{claim:?}");
    let (lease, ttl) = (request.lease, request.ttl);
    let renewed = store.renew(&key, request.token, lease, ttl).await.unwrap();
    assert_eq!(renewed, Fenced::Applied);
    let released = store.release(&key, request.token).await.unwrap();
    assert_eq!(released, Fenced::Applied);
    // A backend reports its statistics as it ends (or up to ten seconds after it goes
    // idle): closing the store's connections ends theirs.
    drop((run, store));
    let deadline = Instant::now() + Duration::from_secs(30);
    let (walked, all) = loop {
        let row = admin.query_one(&scans, &[]).await.unwrap();
        let (walked, all): (i64, i64) = (row.get(0), row.get::<_, i64>(1) - before);
        // A claim's read and a completion each scan an index at least once.
        if all >= 100 || Instant::now() > deadline {
            break (walked, all);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(all >= 100, "only {all} index scans were counted");
    assert_eq!(
        walked, 0,
        "scans of the in-progress or the expiry index, of {all}"
    );
    drop_table(&url, &table).await;
}

/// Listings by run and by tool, and a run's counts, read the listings' indexes of
/// settled rows and the in-progress index, never the whole table: among 40,000 rows of
/// other runs and tools, a run's 5 completed and 3 running records are listed, page by
/// page, without a sequential scan.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_listings_by_run_and_tool_read_their_indexes() {
    let Some(url) = postgres_url() else { return };
    let table = unique("idem_listed");
    // Each store works in sessions named for it, which report their scans as they end
    // (before they leave `pg_stat_activity`). The rows are made through a store of
    // their own, whose sessions are gone before the listings' scans are counted: a plan
    // on the new, small table reads all of it. Built, then migrated: no index build or
    // result fill of `connect`'s runs in the background.
    let named = |name: &str| {
        let sep = if url.contains('?') { '&' } else { '?' };
        PostgresStore::builder(&format!("{url}{sep}application_name={name}"))
            .table(&table)
            .build()
            .unwrap()
    };
    let (setup_name, lister_name) = (unique("idem_listed_setup"), unique("idem_listed"));
    let store = named(&setup_name);
    store.migrate().await.unwrap();
    let (admin, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    let run_id = unique("run");
    let run = Run::new(run_id.clone()).with_store(store.clone());
    let ran = Arc::new(AtomicUsize::new(0));
    for n in 0..5 {
        call_counted(&run, &ran, n, n).await.unwrap();
    }
    admin
        .batch_execute(&format!(
            "INSERT INTO {table} (key, fingerprint, state, token, lease_until, payload, \
                 created_at, expires_at, run_id, tool, result) \
             SELECT 'other_tool.' || g, '\\x00', 1, '\\x00', NULL, '\\x00', now(), \
                 now() + interval '1 day', 'other-' || (g % 100), 'other_tool', '1' \
             FROM generate_series(1, 40000) AS g"
        ))
        .await
        .unwrap();
    // Three calls of the run still running.
    for n in 0..3u8 {
        let request = ClaimRequest {
            origin: idem_core::store::Origin::new(run_id.as_str(), "send_email"),
            fingerprint: Fingerprint::from_bytes([n; 32]),
            token: Token::generate().unwrap(),
            lease: Duration::from_secs(600),
            ttl: Duration::from_secs(600),
            take_over_expired: true,
            retry_failed: true,
        };
        let key = Key::of("send_email", &request.fingerprint);
        let claim = store.claim(&key, &request).await.unwrap();
        assert!(matches!(claim, Claim::Acquired { .. }), "{claim:?}");
    }
    drop((run, store));
    let gone = |name: String| {
        let admin = &admin;
        async move {
            let sessions = "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1";
            let deadline = Instant::now() + Duration::from_secs(30);
            while admin
                .query_one(sessions, &[&name])
                .await
                .unwrap()
                .get::<_, i64>(0)
                > 0
            {
                assert!(
                    Instant::now() < deadline,
                    "the sessions of {name} never ended"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    gone(setup_name).await;
    admin
        .batch_execute(&format!("VACUUM ANALYZE {table}"))
        .await
        .unwrap();
    let store = named(&lister_name);
    let scans = format!(
        "SELECT t.seq_scan, \
             (SELECT coalesce(sum(idx_scan), 0)::int8 FROM pg_stat_user_indexes i \
              WHERE i.relid = t.relid AND i.indexrelname LIKE '%\\_settled\\_run'), \
             (SELECT coalesce(sum(idx_scan), 0)::int8 FROM pg_stat_user_indexes i \
              WHERE i.relid = t.relid AND i.indexrelname LIKE '%\\_settled\\_tool') \
         FROM pg_stat_user_tables t WHERE t.relid = '{table}'::regclass"
    );
    let read = |row: tokio_postgres::Row| -> [i64; 3] { [row.get(0), row.get(1), row.get(2)] };
    let before = read(admin.query_one(&scans, &[]).await.unwrap());

    let by_run = idem_core::store::Filter {
        run_id: Some(run_id.clone()),
        ..Default::default()
    };
    let by_tool = idem_core::store::Filter {
        tool: Some("send_email".into()),
        ..Default::default()
    };
    for filter in [&by_run, &by_tool] {
        let (mut listed, mut after) = (Vec::new(), None);
        loop {
            let page = store.list(filter, after.as_ref(), 3).await.unwrap();
            listed.extend(page.records.into_iter().map(|r| r.key));
            match page.next {
                Some(next) => after = Some(next),
                None => break,
            }
        }
        assert_eq!(listed.len(), 8, "{filter:?} listed {listed:?}");
        assert!(
            listed.windows(2).all(|w| w[0] < w[1]),
            "in key order: {listed:?}"
        );
    }
    let counts = store.count(&by_run).await.unwrap();
    assert_eq!((counts.completed, counts.running), (5, 3), "{counts:?}");

    // Every session of the listings' store has ended, and reported its scans.
    drop(store);
    gone(lister_name).await;
    let now = read(admin.query_one(&scans, &[]).await.unwrap());
    let [seq, run_scans, tool_scans] = [now[0] - before[0], now[1] - before[1], now[2] - before[2]];
    assert!(
        run_scans > 0 && tool_scans > 0,
        "index scans: run {run_scans}, tool {tool_scans}"
    );
    assert_eq!(seq, 0, "sequential scans of the table");
    drop_table(&url, &table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_store_conforms() {
    let Some(url) = redis_url() else { return };
    let store = redis_store(&url, "idem-conformance").await;
    testing::run_all(Arc::new(store)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn local_cache_over_the_redis_store_conforms() {
    let Some(url) = redis_url() else { return };
    let store = redis_store(&url, "idem-cache-conformance").await;
    testing::run_all(Arc::new(LocalCache::new(store))).await;
}

/// A store under a prefix of its own.
async fn redis_store(url: &str, name: &str) -> RedisStore {
    RedisStore::builder(url)
        .prefix(format!("{}:", unique(name)))
        .connect()
        .await
        .unwrap()
}

/// A store under a prefix of its own, and a plain connection to the same server, to
/// read or write its keys behind its back.
async fn redis_store_and_connection(
    url: &str,
    name: &str,
) -> (RedisStore, redis::aio::MultiplexedConnection) {
    let store = redis_store(url, name).await;
    let client = redis::Client::open(url).unwrap();
    let conn = client.get_multiplexed_async_connection().await.unwrap();
    (store, conn)
}

/// A server that lost its scripts (restarted without persistence, or `SCRIPT FLUSH`)
/// is sent each again: a completion, a renewal and a release after the flush all take
/// effect, and the completed call replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_scripts_the_server_lost_are_sent_again() {
    let Some(url) = redis_url() else { return };
    let (store, mut conn) = redis_store_and_connection(&url, "idem-noscript").await;
    let flush = || redis::cmd("SCRIPT").arg("FLUSH").to_owned();
    let request = |byte: u8| ClaimRequest {
        origin: idem_core::store::Origin::new("run", "tool"),
        fingerprint: Fingerprint::from_bytes([byte; 32]),
        token: Token::generate().unwrap(),
        lease: Duration::from_secs(60),
        ttl: Duration::from_secs(60),
        take_over_expired: true,
        retry_failed: true,
    };
    let (done, released) = (request(1), request(2));
    let done_key = Key::of("tool", &done.fingerprint);
    let released_key = Key::of("tool", &released.fingerprint);
    for (key, request) in [(&done_key, &done), (&released_key, &released)] {
        let claim = store.claim(key, request).await.unwrap();
        assert!(matches!(claim, Claim::Acquired { .. }), "{claim:?}");
    }

    let _: () = flush().query_async(&mut conn).await.unwrap();
    let renewed = store
        .renew(
            &done_key,
            done.token,
            Duration::from_secs(60),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    assert_eq!(renewed, Fenced::Applied);
    let _: () = flush().query_async(&mut conn).await.unwrap();
    let completed = store
        .complete(
            &done_key,
            done.token,
            Outcome::Completed(b"42"),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    assert_eq!(completed, Fenced::Applied);
    let _: () = flush().query_async(&mut conn).await.unwrap();
    let release = store.release(&released_key, released.token).await.unwrap();
    assert_eq!(release, Fenced::Applied);

    let again = store.claim(&done_key, &request(1)).await.unwrap();
    assert_eq!(again, Claim::Completed(b"42".to_vec()));
    let after_release = store.claim(&released_key, &request(2)).await.unwrap();
    assert!(
        matches!(after_release, Claim::Acquired { .. }),
        "{after_release:?}"
    );
}

/// Scripts flushed in a tight loop while calls complete, renew and release: each
/// operation still takes effect once (the store falls back to `EVAL` with the script's
/// text, which no flush can miss), and a listing still reads every record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_scripts_flushed_in_a_tight_loop_still_run() {
    let Some(url) = redis_url() else { return };
    let (store, conn) = redis_store_and_connection(&url, "idem-flushed").await;
    let store = Arc::new(store);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flusher = tokio::spawn({
        let (stop, mut conn) = (stop.clone(), conn.clone());
        async move {
            let mut flushes = 0u64;
            while !stop.load(SeqCst) {
                let _: () = redis::cmd("SCRIPT")
                    .arg("FLUSH")
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                flushes += 1;
            }
            flushes
        }
    });
    let tasks: Vec<_> = (0..32u8)
        .map(|n| {
            let store = store.clone();
            tokio::spawn(async move {
                for round in 0..8u8 {
                    let request = ClaimRequest {
                        origin: idem_core::store::Origin::new("run", "tool"),
                        fingerprint: Fingerprint::from_bytes([n; 32]),
                        token: Token::generate().unwrap(),
                        lease: Duration::from_secs(60),
                        ttl: Duration::from_secs(60),
                        take_over_expired: true,
                        retry_failed: true,
                    };
                    let mut bytes = [n; 32];
                    bytes[0] = round;
                    let request = ClaimRequest {
                        fingerprint: Fingerprint::from_bytes(bytes),
                        ..request
                    };
                    let key = Key::of("tool", &request.fingerprint);
                    let claim = store.claim(&key, &request).await.unwrap();
                    assert!(matches!(claim, Claim::Acquired { .. }), "{claim:?}");
                    let (lease, ttl) = (Duration::from_secs(60), Duration::from_secs(60));
                    let renewed = store.renew(&key, request.token, lease, ttl).await.unwrap();
                    assert_eq!(renewed, Fenced::Applied);
                    if round % 2 == 0 {
                        let done = store
                            .complete(&key, request.token, Outcome::Completed(&[round]), ttl)
                            .await
                            .unwrap();
                        assert_eq!(done, Fenced::Applied);
                        let again = ClaimRequest {
                            token: Token::generate().unwrap(),
                            ..request.clone()
                        };
                        let replay = store.claim(&key, &again).await.unwrap();
                        assert_eq!(replay, Claim::Completed(vec![round]));
                    } else {
                        let released = store.release(&key, request.token).await.unwrap();
                        assert_eq!(released, Fenced::Applied);
                    }
                }
            })
        })
        .collect();
    for task in futures_join(tasks).await {
        task.unwrap();
    }
    let listed = store.count(&Default::default()).await.unwrap();
    stop.store(true, SeqCst);
    let flushes = flusher.await.unwrap();
    assert_eq!(
        listed.completed,
        32 * 4,
        "the completed records, listed: {listed:?}"
    );
    assert_eq!(listed.running, 0, "{listed:?}");
    assert!(flushes > 10, "the scripts were flushed {flushes} times");
    drop(conn);
}

/// What a Redis key holds is left alone, and reported, when it is not an idem record:
/// bytes of another program, another Redis type, a claim someone made permanent (its
/// lease cannot be placed in time without the key's expiry), a record that expires as
/// it is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_values_that_are_not_records_are_corrupt_and_kept() {
    let Some(url) = redis_url() else { return };
    let (store, mut conn) = redis_store_and_connection(&url, "idem-foreign").await;
    let prefix = store.prefix().to_owned();
    let request = ClaimRequest {
        origin: idem_core::store::Origin::new("run", "tool"),
        fingerprint: Fingerprint::from_bytes([1; 32]),
        token: Token::generate().unwrap(),
        lease: Duration::from_secs(60),
        ttl: Duration::from_secs(60),
        take_over_expired: true,
        retry_failed: true,
    };
    let permanent = Record {
        fingerprint: request.fingerprint,
        created_at: Timestamp::from_millis(0),
        expires_at: Timestamp::from_millis(60_000),
        state: State::InProgress {
            token: Token::generate().unwrap(),
            lease_until: Timestamp::from_millis(1_000),
        },
        meta: Default::default(),
    }
    .encode();
    // A completed record that says it expired as it was stored: replaying it, or
    // claiming over it, would both be guesses.
    let stillborn = Record {
        fingerprint: request.fingerprint,
        created_at: Timestamp::from_millis(0),
        expires_at: Timestamp::from_millis(0),
        state: State::Completed {
            result: b"1".to_vec(),
        },
        meta: Default::default(),
    }
    .encode();
    let cases: [(&str, &[&[u8]], &str); 4] = [
        (
            "bytes",
            &[b"SET", b"not a record", b"PX", b"60000"],
            "magic",
        ),
        ("hash", &[b"HSET", b"fp", b"x"], "type"),
        ("permanent", &[b"SET", &permanent], "expiry"),
        (
            "stillborn",
            &[b"SET", &stillborn, b"PX", b"60000"],
            "expires when",
        ),
    ];
    for (name, write, reason) in cases {
        let key = Key::from_text(name);
        let redis_key = format!("{prefix}{key}");
        let mut command = redis::cmd(std::str::from_utf8(write[0]).unwrap());
        command.arg(&redis_key).arg(&write[1..]);
        let _: () = command.query_async(&mut conn).await.unwrap();
        let before: Vec<u8> = redis::cmd("DUMP")
            .arg(&redis_key)
            .query_async(&mut conn)
            .await
            .unwrap();
        for err in [
            store.claim(&key, &request).await.unwrap_err(),
            store.get(&key).await.unwrap_err(),
        ] {
            assert!(
                matches!(&err, Error::CorruptRecord { key: k, reason: r } if *k == key && r.contains(reason)),
                "{name}: {err}"
            );
        }
        let after: Vec<u8> = redis::cmd("DUMP")
            .arg(&redis_key)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(before, after, "{name}: the value was changed");
        assert!(
            store.delete(&key).await.unwrap(),
            "{name}: delete clears it"
        );
        assert_eq!(
            store.claim(&key, &request).await.unwrap(),
            Claim::Acquired { took_over: false },
            "{name}"
        );
    }
}

/// Records in Redis count time from the moment Redis stored them; read back, their
/// times are the server's: created when claimed, the lease ending a lease later, the
/// record expiring a TTL after the lease, however long after the claim they are read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_record_times_are_the_server_clock() {
    let Some(url) = redis_url() else { return };
    let (store, mut conn) = redis_store_and_connection(&url, "idem-times").await;
    let server_now = |(secs, micros): (u64, u64)| secs * 1000 + micros / 1000;
    let key = Key::from_text("times");
    let request = ClaimRequest {
        origin: idem_core::store::Origin::new("run", "tool"),
        fingerprint: Fingerprint::from_bytes([2; 32]),
        token: Token::generate().unwrap(),
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(3600),
        take_over_expired: true,
        retry_failed: false,
    };
    let before = server_now(redis::cmd("TIME").query_async(&mut conn).await.unwrap());
    store.claim(&key, &request).await.unwrap();
    let after = server_now(redis::cmd("TIME").query_async(&mut conn).await.unwrap());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let record = store.get(&key).await.unwrap().unwrap();
    // PTTL counts whole milliseconds: allow one either side.
    assert!(
        (before - 1..=after + 1).contains(&record.created_at.as_millis()),
        "created {} outside the claim's {before}..={after}",
        record.created_at.as_millis()
    );
    assert!(
        record
            .expires_at
            .as_millis()
            .abs_diff(record.created_at.as_millis() + 30_000 + 3_600_000)
            <= 1,
        "a claim's record expires a TTL after its lease: {record:?}"
    );
    match record.state {
        State::InProgress { token, lease_until } => {
            assert_eq!(token, request.token);
            assert_eq!(
                lease_until.as_millis(),
                record.created_at.as_millis() + 30_000,
                "{record:?}"
            );
        }
        other => panic!("{other:?}"),
    }
    // A second claim is busy until the lease, in this process's clock.
    let mut second = request;
    second.token = Token::generate().unwrap();
    match store.claim(&key, &second).await.unwrap() {
        Claim::Busy { lease_until } => {
            let left = lease_until.remaining(Timestamp::now());
            assert!(
                left > Duration::from_secs(28) && left <= Duration::from_secs(30),
                "{left:?}"
            );
        }
        other => panic!("{other:?}"),
    }
}

async fn futures_join<F: std::future::Future>(futures: Vec<F>) -> Vec<F::Output> {
    let mut out = Vec::new();
    let handles: Vec<_> = futures.into_iter().map(Box::pin).collect();
    for h in handles {
        out.push(h.await);
    }
    out
}

// ----- A fleet of processes -------------------------------------------------------

const ROLE: &str = "IDEM_TEST_FLEET_ROLE";
const NAME: &str = "IDEM_TEST_FLEET_NAME";
const OUT: &str = "IDEM_TEST_FLEET_OUT";
const KEYS: usize = 24;
const TASKS: usize = 12;
const PROCESSES: usize = 4;

/// One worker process of the fleet tests: `TASKS` tasks, each calling the tool for
/// every key in its own order. Every real execution leaves a side effect where all
/// processes can count it; every call's answer goes to the output file.
#[test]
#[ignore = "worker process of the fleet tests; started by them"]
fn fleet_worker() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let name = std::env::var(NAME).unwrap();
    let out = std::env::var(OUT).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let (store, effect): (Arc<dyn Store>, Arc<dyn Effect>) = match role.as_str() {
            "postgres" => {
                let url = std::env::var("IDEM_POSTGRES_URL").unwrap();
                let store = PostgresStore::builder(&url).table(&name).build().unwrap();
                let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                    .await
                    .unwrap();
                tokio::spawn(conn);
                (
                    Arc::new(store),
                    Arc::new(PgEffects(client, format!("{name}_effects"))),
                )
            }
            "redis" => {
                let url = std::env::var("IDEM_REDIS_URL").unwrap();
                let store = RedisStore::builder(&url)
                    .prefix(format!("{name}:"))
                    .build()
                    .unwrap();
                let client = redis::Client::open(url.as_str()).unwrap();
                let conn = client.get_multiplexed_async_connection().await.unwrap();
                (
                    Arc::new(store),
                    Arc::new(RedisEffects(conn, format!("{name}:effects:"))),
                )
            }
            other => panic!("unknown role {other}"),
        };
        let run = Run::new("fleet-run").with_shared_store(store);
        let mut tasks = Vec::new();
        for task in 0..TASKS {
            let (run, effect) = (run.clone(), effect.clone());
            tasks.push(tokio::spawn(async move {
                let mut answers = Vec::new();
                for i in 0..KEYS {
                    let key = (i * 7 + task * 5 + std::process::id() as usize) % KEYS;
                    let effect = effect.clone();
                    let call = Call::new(Some(&run), "fleet_tool", Options::new(), &key);
                    let answer =
                        execute::<Result<String, Error>, ReleaseErrors, _>(call, async move {
                            effect.record(key).await;
                            tokio::time::sleep(Duration::from_millis(3)).await;
                            Ok(format!("pid{}-task{task}-key{key}", std::process::id()))
                        })
                        .await
                        .unwrap()
                        .unwrap();
                    answers.push(format!("{key} {answer}"));
                }
                answers
            }));
        }
        let mut lines = Vec::new();
        for t in tasks {
            lines.extend(t.await.unwrap());
        }
        std::fs::write(out, lines.join("\n")).unwrap();
    });
}

/// Where a real execution leaves its mark, shared by all processes.
#[async_trait::async_trait]
trait Effect: Send + Sync {
    async fn record(&self, key: usize);
}

struct PgEffects(tokio_postgres::Client, String);
#[async_trait::async_trait]
impl Effect for PgEffects {
    async fn record(&self, key: usize) {
        self.0
            .execute(
                &format!("INSERT INTO {} (key) VALUES ($1)", self.1),
                &[&(key as i64)],
            )
            .await
            .unwrap();
    }
}

struct RedisEffects(redis::aio::MultiplexedConnection, String);
#[async_trait::async_trait]
impl Effect for RedisEffects {
    async fn record(&self, key: usize) {
        let mut c = self.0.clone();
        let _: i64 = redis::cmd("INCR")
            .arg(format!("{}{key}", self.1))
            .query_async(&mut c)
            .await
            .unwrap();
    }
}

/// Starts the fleet, waits for it, and returns every answer each key got.
fn run_fleet(role: &str, name: &str, dir: &Path) -> HashMap<usize, Vec<String>> {
    let children: Vec<_> = (0..PROCESSES)
        .map(|i| {
            Command::new(std::env::current_exe().unwrap())
                .args(["--ignored", "--exact", "fleet_worker", "--nocapture"])
                .env(ROLE, role)
                .env(NAME, name)
                .env(OUT, dir.join(format!("answers-{i}")))
                .spawn()
                .unwrap()
        })
        .collect();
    for mut child in children {
        assert!(child.wait().unwrap().success(), "a fleet worker failed");
    }
    let mut answers: HashMap<usize, Vec<String>> = HashMap::new();
    for i in 0..PROCESSES {
        let text = std::fs::read_to_string(dir.join(format!("answers-{i}"))).unwrap();
        for line in text.lines() {
            let (key, answer) = line.split_once(' ').unwrap();
            answers
                .entry(key.parse().unwrap())
                .or_default()
                .push(answer.to_owned());
        }
    }
    answers
}

fn assert_one_answer_per_key(answers: &HashMap<usize, Vec<String>>) {
    assert_eq!(answers.len(), KEYS);
    for (key, seen) in answers {
        assert_eq!(seen.len(), PROCESSES * TASKS, "key {key}");
        assert!(
            seen.iter().all(|a| a == &seen[0]),
            "key {key}: callers got different answers: {seen:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_fleet_of_processes_executes_each_key_once() {
    let Some(url) = postgres_url() else { return };
    let name = unique("idem_fleet");
    PostgresStore::builder(&url)
        .table(&name)
        .connect()
        .await
        .unwrap();
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client
        .batch_execute(&format!("CREATE TABLE {name}_effects (key int8 NOT NULL)"))
        .await
        .unwrap();

    let dir = tempfile::tempdir().unwrap();
    let answers = tokio::task::spawn_blocking({
        let (name, dir) = (name.clone(), dir.path().to_owned());
        move || run_fleet("postgres", &name, &dir)
    })
    .await
    .unwrap();

    let rows = client
        .query(
            &format!("SELECT key, count(*) FROM {name}_effects GROUP BY key"),
            &[],
        )
        .await
        .unwrap();
    assert_eq!(rows.len(), KEYS, "every key ran");
    for row in rows {
        let (key, n): (i64, i64) = (row.get(0), row.get(1));
        assert_eq!(n, 1, "key {key} ran {n} times across the fleet");
    }
    assert_one_answer_per_key(&answers);
    drop_table(&url, &format!("{name}_effects")).await;
    drop_table(&url, &name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_fleet_of_processes_executes_each_key_once() {
    let Some(url) = redis_url() else { return };
    let name = unique("idem-fleet");
    let dir = tempfile::tempdir().unwrap();
    let answers = tokio::task::spawn_blocking({
        let (name, dir) = (name.clone(), dir.path().to_owned());
        move || run_fleet("redis", &name, &dir)
    })
    .await
    .unwrap();

    let client = redis::Client::open(url.as_str()).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    for key in 0..KEYS {
        let n: Option<i64> = redis::cmd("GET")
            .arg(format!("{name}:effects:{key}"))
            .query_async(&mut c)
            .await
            .unwrap();
        assert_eq!(n, Some(1), "key {key} ran {n:?} times across the fleet");
    }
    assert_one_answer_per_key(&answers);
}

// ----- Servers that are wrong, silent, or stopped ---------------------------------

/// A port where a TCP server accepts connections and never says a word.
fn silent_server() -> (std::thread::JoinHandle<()>, u16) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let handle = std::thread::spawn(move || {
        let mut held = Vec::new();
        // Accept a handful of connections and hold them open, silent.
        for stream in listener.incoming().take(8) {
            held.push(stream);
        }
        std::thread::sleep(Duration::from_secs(10));
    });
    (handle, port)
}

/// A port nothing listens on.
fn closed_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// Calls a tool on `store`: the store must fail closed, within `bound`, and the
/// operation must not run.
async fn assert_fails_closed(store: impl Store, bound: Duration) {
    let ran = Arc::new(AtomicUsize::new(0));
    let run = Run::new("unreachable").with_store(store);
    let started = Instant::now();
    let r = ran.clone();
    let err = execute::<Result<(), Error>, ReleaseErrors, _>(
        Call::new(Some(&run), "send_email", Options::new(), &1),
        async move {
            r.fetch_add(1, SeqCst);
            Ok(())
        },
    )
    .await
    .unwrap_err();
    assert!(matches!(err, Error::Store { .. }), "{err}");
    assert!(started.elapsed() < bound, "took {:?}", started.elapsed());
    assert_eq!(ran.load(SeqCst), 0, "the operation ran without the guard");
}

#[tokio::test]
async fn unreachable_postgres_fails_closed_within_the_timeout() {
    let timeout = Duration::from_millis(500);
    let bound = Duration::from_secs(3);
    let wrong = format!("postgres://root@127.0.0.1:{}/test", closed_port());
    let started = Instant::now();
    let err = PostgresStore::builder(&wrong)
        .timeout(timeout)
        .connect()
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Store {
                store: "postgres",
                ..
            }
        ),
        "{err}"
    );
    assert!(started.elapsed() < bound);
    assert_fails_closed(
        PostgresStore::builder(&wrong)
            .timeout(timeout)
            .build()
            .unwrap(),
        bound,
    )
    .await;

    let (_server, port) = silent_server();
    let silent = format!("postgres://root@127.0.0.1:{port}/test");
    assert_fails_closed(
        PostgresStore::builder(&silent)
            .timeout(timeout)
            .build()
            .unwrap(),
        bound,
    )
    .await;
}

#[tokio::test]
async fn unreachable_redis_fails_closed_within_the_timeout() {
    let timeout = Duration::from_millis(500);
    let bound = Duration::from_secs(3);
    let wrong = format!("redis://127.0.0.1:{}", closed_port());
    let started = Instant::now();
    let err = RedisStore::builder(&wrong)
        .timeout(timeout)
        .connect()
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Store { store: "redis", .. }), "{err}");
    assert!(started.elapsed() < bound);
    assert_fails_closed(
        RedisStore::builder(&wrong)
            .timeout(timeout)
            .build()
            .unwrap(),
        bound,
    )
    .await;

    let (_server, port) = silent_server();
    let silent = format!("redis://127.0.0.1:{port}");
    assert_fails_closed(
        RedisStore::builder(&silent)
            .timeout(timeout)
            .build()
            .unwrap(),
        bound,
    )
    .await;
}

/// A Redis server of this test's own, which it stops and starts again.
/// Whether a `redis-server` binary is here to start and stop (said loudly when not).
fn redis_server_here() -> bool {
    let here = Command::new("redis-server")
        .arg("--version")
        .output()
        .is_ok();
    if !here {
        eprintln!("SKIPPED: no redis-server binary to start and stop; this test checked nothing");
    }
    here
}

/// A `redis-server` of this test's own on `port`, keeping nothing on disk; returns once
/// it accepts connections.
fn start_redis_server(port: u16) -> std::process::Child {
    let child = Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "redis-server did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_fails_closed_while_the_server_is_down_and_recovers_after() {
    if !redis_server_here() {
        return;
    }
    let port = closed_port();
    let start = || start_redis_server(port);
    let mut server = start();
    let store = RedisStore::builder(&format!("redis://127.0.0.1:{port}"))
        .timeout(Duration::from_millis(500))
        .connect()
        .await
        .unwrap();
    let run = Run::new("restart").with_store(store.clone());
    let call = |n: u32| {
        execute::<Result<u32, Error>, ReleaseErrors, _>(
            Call::new(Some(&run), "tool", Options::new(), &n),
            async move { Ok(n) },
        )
    };
    assert_eq!(call(1).await.unwrap().unwrap(), 1);

    server.kill().unwrap();
    server.wait().unwrap();
    assert_fails_closed(store.clone(), Duration::from_secs(3)).await;

    let mut server = start();
    // The connection manager reconnects; give it a few tries.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match call(2).await {
            Ok(v) => {
                assert_eq!(v.unwrap(), 2);
                break;
            }
            Err(e) => assert!(Instant::now() < deadline, "never reconnected: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    server.kill().unwrap();
    server.wait().unwrap();
}

// ----- Sync tools on the network stores -----------------------------------------

static SYNC_RUNS: AtomicUsize = AtomicUsize::new(0);

fn sync_call(run: &Run, n: u32) -> Result<Result<u32, Error>, Error> {
    sync_call_counted(run, n, &SYNC_RUNS)
}

/// [`sync_call`], its body's runs counted in `runs` (a test of its own, so that tests
/// running at once do not count each other's runs).
fn sync_call_counted(
    run: &Run,
    n: u32,
    runs: &'static AtomicUsize,
) -> Result<Result<u32, Error>, Error> {
    idem_core::__private::execute_blocking::<Result<u32, Error>, ReleaseErrors, _>(
        Call::new(Some(run), "sync_tool", Options::new(), &n),
        || {
            runs.fetch_add(1, SeqCst);
            Ok(n * 2)
        },
    )
}

/// The Postgres and Redis stores a sync-tool test runs on, made inside a runtime.
async fn sync_stores(pg: &str, redis: &str, table: &str) -> Vec<(&'static str, Arc<dyn Store>)> {
    let timeout = Duration::from_millis(500);
    vec![
        (
            "postgres",
            Arc::new(
                PostgresStore::builder(pg)
                    .table(table)
                    .timeout(timeout)
                    .connect()
                    .await
                    .unwrap(),
            ),
        ),
        (
            "redis",
            Arc::new(
                RedisStore::builder(redis)
                    .prefix(format!("{}:", unique("idem-sync")))
                    .timeout(timeout)
                    .connect()
                    .await
                    .unwrap(),
            ),
        ),
    ]
}

#[test]
fn a_sync_tool_on_a_network_store_with_no_runtime_or_on_the_runtimes_own_thread_fails_closed_with_advice_that_works(
) {
    let (Some(pg), Some(redis)) = (postgres_url(), redis_url()) else {
        return;
    };
    // No runtime at all: a typed error at once, no panic, no hang.
    let store = RedisStore::builder(&redis)
        .prefix(format!("{}:", unique("idem-sync")))
        .build();
    match store {
        Ok(store) => {
            let run = Run::new("sync").with_store(store);
            let err = sync_call(&run, 1).unwrap_err();
            assert!(matches!(err, Error::Store { store: "redis", .. }), "{err}");
            assert!(err.to_string().contains("spawn_blocking"), "{err}");
        }
        Err(e) => assert!(matches!(e, Error::Store { .. }), "{e}"),
    }
    // Called on a current-thread runtime's own thread, which the call blocks: the store
    // can never answer. An error after the store's timeout, not a hang; and the advice
    // it gives (spawn_blocking) is what the next test shows working.
    let table = unique("idem_sync_rt");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        for (name, store) in sync_stores(&pg, &redis, &table).await {
            let run = Run::new("sync-direct").with_shared_store(store);
            let started = Instant::now();
            let err = sync_call(&run, 1).unwrap_err();
            assert!(matches!(err, Error::Store { .. }), "{name}: {err}");
            assert!(err.to_string().contains("spawn_blocking"), "{name}: {err}");
            assert!(started.elapsed() < Duration::from_secs(10), "{name}");
        }
        drop_table(&pg, &table).await;
    });
}

#[test]
fn a_sync_tool_on_a_network_store_runs_once_inside_spawn_blocking_on_either_runtime_flavor() {
    let (Some(pg), Some(redis)) = (postgres_url(), redis_url()) else {
        return;
    };
    let flavors = [
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap(),
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap(),
    ];
    for (i, rt) in flavors.into_iter().enumerate() {
        let table = unique("idem_sync");
        rt.block_on(async {
            for (name, store) in sync_stores(&pg, &redis, &table).await {
                let run = Run::new(format!("sync-{i}")).with_shared_store(store);
                let before = SYNC_RUNS.load(SeqCst);
                let got =
                    tokio::task::spawn_blocking(move || (sync_call(&run, 21), sync_call(&run, 21)))
                        .await
                        .unwrap();
                assert_eq!(
                    (got.0.unwrap().unwrap(), got.1.unwrap().unwrap()),
                    (42, 42),
                    "{name}, runtime {i}"
                );
                assert_eq!(SYNC_RUNS.load(SeqCst) - before, 1, "{name}, runtime {i}");
            }
            drop_table(&pg, &table).await;
        });
    }
}

/// A timeout no network store can keep is refused as the store is built, with a
/// `Config` error that says why: zero (every operation would fail), and for Postgres
/// one under a millisecond (its `lock_timeout` of 0 ms is none) or over `i32::MAX`
/// milliseconds (refused at connect, with "invalid value for parameter"). No server
/// is needed: building connects to nothing.
#[test]
fn a_network_store_refuses_a_timeout_it_cannot_keep() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let _in_runtime = rt.enter();
    let refused = |built: Result<(), Error>, why: &str| {
        let error = built.expect_err(why);
        assert_eq!(
            error.store_kind(),
            Some(idem_core::StoreErrorKind::Config),
            "{error}"
        );
        assert!(error.to_string().contains(why), "{error}");
    };
    let postgres = |timeout| {
        PostgresStore::builder("postgres://idem@127.0.0.1:1/none")
            .timeout(timeout)
            .build()
            .map(drop)
    };
    let redis = |timeout| {
        RedisStore::builder("redis://127.0.0.1:1")
            .timeout(timeout)
            .build()
            .map(drop)
    };
    refused(
        postgres(Duration::ZERO),
        "shorter than the postgres store can keep",
    );
    refused(
        redis(Duration::ZERO),
        "shorter than the redis store can keep",
    );
    // Postgres reads a lock timeout of 0 ms as none.
    refused(
        postgres(Duration::from_micros(999)),
        "shorter than the postgres store can keep",
    );
    refused(
        postgres(Duration::MAX),
        "longer than the postgres store can keep",
    );
    let most = Duration::from_millis(i32::MAX as u64);
    refused(
        postgres(most + Duration::from_millis(1)),
        "longer than the postgres store can keep",
    );
    // What each can keep is built.
    postgres(most).unwrap();
    postgres(Duration::from_millis(1)).unwrap();
    redis(Duration::from_nanos(1)).unwrap();
    redis(Duration::MAX).unwrap();
}

/// A store timeout past what an `Instant` holds (`Duration::MAX`, "no bound") is a
/// deadline far away, for a sync tool too (whose bound the timer thread keeps): the
/// call answers, and the body runs once; no overflow panic. (Redis: the Postgres store
/// refuses such a timeout as it is built, see above.)
#[test]
fn a_sync_tool_on_a_network_store_with_an_unbounded_timeout_answers() {
    let Some(redis) = redis_url() else {
        return;
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let store = RedisStore::builder(&redis)
            .prefix(format!("{}:", unique("idem-sync-max")))
            .timeout(Duration::MAX)
            .connect()
            .await
            .unwrap();
        static RUNS: AtomicUsize = AtomicUsize::new(0);
        let run = Run::new("sync-max").with_store(store);
        let got = tokio::task::spawn_blocking(move || {
            (
                sync_call_counted(&run, 4, &RUNS),
                sync_call_counted(&run, 4, &RUNS),
            )
        })
        .await
        .unwrap();
        assert_eq!((got.0.unwrap().unwrap(), got.1.unwrap().unwrap()), (8, 8));
        assert_eq!(RUNS.load(SeqCst), 1);
    });
}

// ----- Errors keep their cause ---------------------------------------------------------

/// `error` and every source under it, as text.
fn causes(error: &Error) -> Vec<String> {
    let mut out = vec![error.to_string()];
    let mut next = std::error::Error::source(error);
    while let Some(cause) = next {
        out.push(cause.to_string());
        next = cause.source();
    }
    out
}

#[tokio::test]
async fn a_store_error_says_why_the_server_or_the_os_refused() {
    let (Some(pg), Some(_)) = (postgres_url(), redis_url()) else {
        return;
    };
    let timeout = Duration::from_secs(2);
    // A database that does not exist: the server's message and its SQLSTATE.
    let (base, _) = pg.rsplit_once('/').unwrap();
    let err = PostgresStore::builder(&format!("{base}/idem_no_such_database"))
        .timeout(timeout)
        .connect()
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("idem_no_such_database") && text.contains("does not exist"),
        "{text}"
    );
    assert!(text.contains("SQLSTATE 3D000"), "{text}");
    assert!(
        causes(&err).len() >= 3,
        "the chain is kept: {:?}",
        causes(&err)
    );

    // A closed port: the OS error, on both network stores.
    let port = closed_port();
    let err = PostgresStore::builder(&format!("postgres://idem@127.0.0.1:{port}/test"))
        .timeout(timeout)
        .connect()
        .await
        .unwrap_err();
    assert!(err.to_string().contains("refused"), "{err}");
    let err = match RedisStore::builder(&format!("redis://127.0.0.1:{port}"))
        .timeout(timeout)
        .connect()
        .await
    {
        Ok(_) => panic!("connected to a closed port"),
        Err(err) => err,
    };
    assert!(err.to_string().to_lowercase().contains("refused"), "{err}");
    assert!(causes(&err).len() >= 2, "{:?}", causes(&err));
}

// ----- A store that fails after the body ran -----------------------------------------

/// Counts the body's runs; returns `value`.
async fn counted(
    run: &Run,
    ran: &Arc<AtomicUsize>,
    value: u32,
    during: impl FnOnce(),
) -> Result<Result<u32, Error>, Error> {
    let ran = ran.clone();
    execute::<Result<u32, Error>, ReleaseErrors, _>(
        Call::new(
            Some(run),
            "send_email",
            Options::new().lease(Duration::from_secs(5)),
            &1,
        ),
        async move {
            ran.fetch_add(1, SeqCst);
            during();
            Ok(value)
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stopped_after_the_body_ran_the_caller_gets_its_value_and_the_retry_replays_it() {
    if !redis_server_here() {
        return;
    }
    let port = closed_port();
    let mut server = start_redis_server(port);
    let pid = server.id().to_string();
    let signal = |sig: &str| {
        assert!(Command::new("kill")
            .args([sig, &pid])
            .status()
            .unwrap()
            .success());
    };
    let store = RedisStore::builder(&format!("redis://127.0.0.1:{port}"))
        .timeout(Duration::from_millis(300))
        .connect()
        .await
        .unwrap();
    let run = Run::new("stopped").with_store(store);
    let ran = Arc::new(AtomicUsize::new(0));

    // The server stops as the body returns: the completion gets no answer.
    let first = counted(&run, &ran, 7, || signal("-STOP")).await;
    signal("-CONT");
    assert_eq!(
        first.unwrap().unwrap(),
        7,
        "the caller gets the body's value, not Error::Store"
    );
    let retry = counted(&run, &ran, 8, || ()).await;
    assert_eq!(
        retry.unwrap().unwrap(),
        7,
        "the retry replays the first value"
    );
    assert_eq!(ran.load(SeqCst), 1, "the body ran once");
    server.kill().unwrap();
    server.wait().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_row_lock_held_past_the_timeout_gives_the_caller_its_value_and_the_retry_replays_it(
) {
    let Some(url) = postgres_url() else { return };
    let table = unique("idem_locked");
    let store = PostgresStore::builder(&url)
        .table(&table)
        .timeout(Duration::from_millis(500))
        .connect()
        .await
        .unwrap();
    let run = Run::new("locked").with_store(store);
    let ran = Arc::new(AtomicUsize::new(0));

    // Another session locks the claimed row while the body runs, and holds the lock
    // past the store's timeout: the completion's UPDATE waits behind it.
    let (locker, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let locker = Arc::new(locker);
    let (locked_tx, locked_rx) = std::sync::mpsc::channel();
    let lock_sql = format!("BEGIN; SELECT 1 FROM {table} FOR UPDATE;");
    let holder = {
        let locker = locker.clone();
        move || {
            let locker = locker.clone();
            tokio::spawn(async move {
                locker.batch_execute(&lock_sql).await.unwrap();
                locked_tx.send(()).unwrap();
                tokio::time::sleep(Duration::from_millis(1500)).await;
                locker.batch_execute("COMMIT").await.unwrap();
            });
            locked_rx.recv_timeout(Duration::from_secs(5)).unwrap();
        }
    };
    let started = Instant::now();
    let first = counted(&run, &ran, 7, holder).await;
    assert_eq!(
        first.unwrap().unwrap(),
        7,
        "the caller gets the body's value, not Error::Store"
    );
    assert!(
        started.elapsed() < Duration::from_millis(1400),
        "answered at the timeout, not after the lock"
    );
    // A retry while the lock still holds cannot claim either: `Error::Store`, and it
    // did not run. Once the lock is gone, the late UPDATE has landed: a replay.
    let deadline = Instant::now() + Duration::from_secs(10);
    let replayed = loop {
        match counted(&run, &ran, 8, || ()).await {
            Ok(value) => break value.unwrap(),
            Err(Error::Store { .. }) => assert!(Instant::now() < deadline, "never replayed"),
            Err(other) => panic!("{other}"),
        }
    };
    assert_eq!(replayed, 7, "the retry replays the first value");
    assert_eq!(ran.load(SeqCst), 1, "the body ran once");
    drop_table(&url, &table).await;
}
