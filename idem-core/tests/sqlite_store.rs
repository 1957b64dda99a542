//! `SqliteStore`: the conformance suite, several handles on one file, a write lock held
//! by another connection, damaged rows, and the table read in SQL.
#![cfg(feature = "sqlite")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_core::store::{Claim, ClaimRequest, Fenced, Filter, Fingerprint, Origin, Outcome, Token};
use idem_core::{testing, Error, Key, LocalCache, SqliteStore, Store, StoreErrorKind};

fn request(fingerprint: u8) -> ClaimRequest {
    ClaimRequest {
        origin: Origin::new("run-1", "send_email"),
        fingerprint: Fingerprint::from_bytes([fingerprint; 32]),
        token: Token::generate().unwrap(),
        lease: Duration::from_secs(60),
        ttl: Duration::from_secs(3600),
        take_over_expired: true,
        retry_failed: true,
    }
}

/// Claims `key` and completes it with `result`.
async fn complete(store: &SqliteStore, key: &Key, req: &ClaimRequest, result: &[u8]) {
    let claim = store.claim(key, req).await.unwrap();
    assert_eq!(claim, Claim::Acquired { took_over: false });
    let done = store
        .complete(
            key,
            req.token,
            Outcome::Completed(result),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    assert_eq!(done, Fenced::Applied);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_store_conforms() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("idem.sqlite")).unwrap();
    testing::run_all(Arc::new(store)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_store_in_fsync_mode_with_its_own_table_conforms() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::builder(dir.path().join("nested/dir/idem.sqlite"))
        .fsync(true)
        .table("agent_records")
        .open()
        .unwrap();
    testing::run_all(Arc::new(store)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn local_cache_over_the_sqlite_store_conforms() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("idem.sqlite")).unwrap();
    testing::run_all(Arc::new(LocalCache::new(store))).await;
}

/// On a current-thread runtime the store works too (its waits block the thread).
#[tokio::test(flavor = "current_thread")]
async fn sqlite_store_works_on_a_current_thread_runtime() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("idem.sqlite")).unwrap();
    let key = Key::from_text("send_email.ab");
    let req = request(1);
    assert_eq!(
        store.claim(&key, &req).await.unwrap(),
        Claim::Acquired { took_over: false }
    );
    let done = store
        .complete(
            &key,
            req.token,
            Outcome::Completed(b"1"),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    assert_eq!(done, Fenced::Applied);
    assert_eq!(
        store.claim(&key, &request(1)).await.unwrap(),
        Claim::Completed(b"1".to_vec())
    );
}

/// Handles opened separately on one file (each with its own connections, as separate
/// processes have) agree: of many concurrent claims on one key, exactly one acquires.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn separate_handles_on_one_file_have_one_winner() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.sqlite");
    let handles: Vec<SqliteStore> = (0..4).map(|_| SqliteStore::open(&path).unwrap()).collect();
    for round in 0..20u8 {
        let key = Key::from_text(format!("send_email.{round:02x}"));
        let mut tasks = Vec::new();
        for i in 0..32 {
            let (store, key) = (handles[i % handles.len()].clone(), key.clone());
            tasks.push(tokio::spawn(
                async move { store.claim(&key, &request(1)).await },
            ));
        }
        let mut acquired = 0;
        for task in tasks {
            match task.await.unwrap().unwrap() {
                Claim::Acquired { .. } => acquired += 1,
                Claim::Busy { .. } => {}
                other => panic!("unexpected claim {other:?}"),
            }
        }
        assert_eq!(acquired, 1, "round {round}: one claim acquires");
    }
}

/// Another connection holds the write lock (a long transaction in another process):
/// a write fails within the store's timeout with an error that says so, a hit still
/// answers (WAL readers do not wait), and once the lock is let go writes go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_lock_held_elsewhere_is_an_error_within_the_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.sqlite");
    let timeout = Duration::from_millis(300);
    let store = SqliteStore::builder(&path).timeout(timeout).open().unwrap();
    let done_key = Key::from_text("send_email.01");
    let req = request(1);
    complete(&store, &done_key, &req, b"\"m-1\"").await;

    let holder = rusqlite::Connection::open(&path).unwrap();
    holder.execute_batch("BEGIN IMMEDIATE").unwrap();

    let started = Instant::now();
    let err = store
        .claim(&Key::from_text("send_email.02"), &request(1))
        .await
        .unwrap_err();
    let waited = started.elapsed();
    assert!(
        matches!(
            err,
            Error::Store {
                store: "sqlite",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("write lock"), "{err}");
    assert!(
        waited >= timeout,
        "gave up after {waited:?}, before the timeout"
    );
    assert!(
        waited < timeout * 4,
        "waited {waited:?} for a {timeout:?} timeout"
    );

    let mut replayed = None;
    store.with_completed_result(&done_key, &req.fingerprint, &mut |r| {
        replayed = Some(r.to_vec())
    });
    assert_eq!(replayed.as_deref(), Some(&b"\"m-1\""[..]), "a hit answers");
    assert!(
        store.get(&done_key).await.unwrap().is_some(),
        "reads answer"
    );

    // Writes queued behind one another in this process share the bound: each fails
    // when its own timeout is up, not one timeout after the write ahead of it.
    let started = Instant::now();
    let queued: Vec<_> = (0..8u8)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                let key = Key::from_text(format!("send_email.q{i}"));
                let result = store.claim(&key, &request(1)).await;
                (result.is_err(), started.elapsed())
            })
        })
        .collect();
    for task in queued {
        let (failed, after) = task.await.unwrap();
        assert!(failed, "the lock is still held");
        assert!(
            after < timeout * 3,
            "a queued write gave up after {after:?}"
        );
    }

    holder.execute_batch("ROLLBACK").unwrap();
    assert_eq!(
        store
            .claim(&Key::from_text("send_email.02"), &request(1))
            .await
            .unwrap(),
        Claim::Acquired { took_over: false }
    );
}

/// A row damaged by hand is a typed error on the claim, an unreadable entry in a
/// listing, and `delete` removes it; nothing panics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_row_is_a_typed_error_and_can_be_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.sqlite");
    let store = SqliteStore::open(&path).unwrap();
    let raw = rusqlite::Connection::open(&path).unwrap();
    for (key, state, fingerprint, expires) in [
        (
            "send_email.bad-state",
            "bogus",
            vec![1u8; 32],
            "9000000000000",
        ),
        (
            "send_email.short-fp",
            "completed",
            vec![1u8; 3],
            "9000000000000",
        ),
        (
            "send_email.text-expiry",
            "completed",
            vec![1u8; 32],
            "'soon'",
        ),
    ] {
        raw.execute(
            &format!(
                "INSERT INTO idem_records (key, fingerprint, state, result, created_at, \
                 expires_at, claimed_at, attempts, takeovers) \
                 VALUES (?1, ?2, ?3, '1', 0, {expires}, 0, 1, 0)"
            ),
            rusqlite::params![key, fingerprint, state],
        )
        .unwrap();
        let key = Key::from_text(key);
        let err = store.claim(&key, &request(1)).await.unwrap_err();
        assert!(
            matches!(&err, Error::CorruptRecord { key: k, .. } if *k == key),
            "{err}"
        );
    }
    let page = store.list(&Filter::default(), None, 10).await.unwrap();
    assert_eq!(page.unreadable.len(), 3, "{page:?}");
    for key in [
        "send_email.bad-state",
        "send_email.short-fp",
        "send_email.text-expiry",
    ] {
        assert!(store.delete(&Key::from_text(key)).await.unwrap(), "{key}");
    }
    let page = store.list(&Filter::default(), None, 10).await.unwrap();
    assert!(page.unreadable.is_empty() && page.records.is_empty());
}

/// Keys no idem writes (text that is not UTF-8, a `BLOB`) are listed as unreadable,
/// and the rows around them are listed all the same, page by page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_that_are_not_text_are_unreadable_and_the_listing_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.sqlite");
    let store = SqliteStore::open(&path).unwrap();
    for i in 0..3u8 {
        let key = Key::from_text(format!("send_email.{i:02x}"));
        complete(&store, &key, &request(i), b"1").await;
    }
    let raw = rusqlite::Connection::open(&path).unwrap();
    for key in [
        "CAST(X'73656e645f656d61696c2e30ff' AS TEXT)",
        "X'73656e645f656d61696c2e31'",
    ] {
        raw.execute_batch(&format!(
            "INSERT INTO idem_records (key, fingerprint, state, result, created_at, expires_at, \
             claimed_at, attempts, takeovers) VALUES ({key}, zeroblob(32), 'completed', '1', 0, \
             9000000000000, 0, 1, 0)"
        ))
        .unwrap();
    }
    let (mut records, mut unreadable, mut after) = (0, Vec::new(), None);
    loop {
        let page = store
            .list(&Filter::default(), after.as_ref(), 1)
            .await
            .unwrap();
        records += page.records.len();
        unreadable.extend(page.unreadable.into_iter().map(|u| u.key));
        match page.next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    assert_eq!(records, 3);
    assert_eq!(
        unreadable.iter().map(Key::as_str).collect::<Vec<_>>(),
        [
            "x'73656e645f656d61696c2e30ff'",
            "x'73656e645f656d61696c2e31'"
        ],
        "listed as SQL literals of their bytes"
    );
    assert_eq!(store.delete_matching(&Filter::default()).await.unwrap(), 3);
    // What an operator does with an unreadable key: `delete` takes it as listed.
    for key in &unreadable {
        assert!(store.delete(key).await.unwrap(), "{key}");
    }
    let page = store.list(&Filter::default(), None, 10).await.unwrap();
    assert!(
        page.records.is_empty() && page.unreadable.is_empty(),
        "{page:?}"
    );
}

/// A call whose claim meets a lock another process holds fails after about the store's
/// timeout, on either runtime flavor (not after a second timeout spent settling its
/// claim), and a caller's own timeout cuts the wait short.
#[test]
fn a_call_that_meets_a_held_lock_fails_after_one_timeout() {
    for flavor in ["current_thread", "multi_thread"] {
        let runtime = match flavor {
            "current_thread" => tokio::runtime::Builder::new_current_thread(),
            _ => tokio::runtime::Builder::new_multi_thread(),
        }
        .enable_all()
        .build()
        .unwrap();
        runtime.block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("idem.sqlite");
            let timeout = Duration::from_millis(400);
            let store = SqliteStore::builder(&path).timeout(timeout).open().unwrap();
            let run = idem_core::Run::new("run-1").with_store(store);
            let tool = idem_core::Tool::new("send_email");
            let holder = rusqlite::Connection::open(&path).unwrap();
            holder.execute_batch("BEGIN IMMEDIATE").unwrap();
            let call =
                |n: &'static u32| tool.call(&run, n, move |_| async move { Ok::<_, Error>(*n) });

            let started = Instant::now();
            let result = call(&1).await;
            let took = started.elapsed();
            assert!(result.is_err(), "{flavor}: {result:?}");
            assert!(
                took >= timeout && took < timeout * 3 / 2,
                "{flavor}: the call failed after {took:?}, its store's timeout is {timeout:?}"
            );

            let started = Instant::now();
            let given_up = tokio::time::timeout(Duration::from_millis(50), call(&2)).await;
            assert!(given_up.is_err(), "{flavor}: the caller's timeout fired");
            assert!(
                started.elapsed() < Duration::from_millis(300),
                "{flavor}: the caller waited {:?} for its own 50 ms timeout",
                started.elapsed()
            );
            holder.execute_batch("ROLLBACK").unwrap();
        });
    }
}

/// The table reads in SQL: tool, state, and a field of the JSON result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_table_reads_in_sql() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.sqlite");
    let store = SqliteStore::open(&path).unwrap();
    let key = Key::from_text("send_email.cd");
    complete(&store, &key, &request(7), br#"{"message_id":"m-42"}"#).await;
    let raw = rusqlite::Connection::open(&path).unwrap();
    let row: (String, String, String, String) = raw
        .query_row(
            "SELECT tool, run_id, state, json_extract(result, '$.message_id') FROM idem_records",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
        )
        .unwrap();
    assert_eq!(
        row,
        (
            "send_email".into(),
            "run-1".into(),
            "completed".into(),
            "m-42".into()
        )
    );
}

#[test]
fn bad_settings_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let err = SqliteStore::builder(dir.path().join("a.sqlite"))
        .table("records; drop")
        .open()
        .unwrap_err();
    assert!(err.to_string().contains("invalid table name"), "{err}");
    // A busy timeout past what SQLite takes (`i32::MAX` ms): a `Config` error, where
    // its driver panicked ("too big"). Zero (never wait for the lock) opens.
    let err = SqliteStore::builder(dir.path().join("a.sqlite"))
        .timeout(Duration::MAX)
        .open()
        .unwrap_err();
    assert_eq!(err.store_kind(), Some(StoreErrorKind::Config), "{err}");
    assert!(
        err.to_string()
            .contains("longer than the sqlite store can keep"),
        "{err}"
    );
    SqliteStore::builder(dir.path().join("a.sqlite"))
        .timeout(Duration::ZERO)
        .open()
        .unwrap();
    // A directory where the file should be.
    let err = SqliteStore::open(dir.path()).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Store {
                store: "sqlite",
                ..
            }
        ),
        "{err}"
    );
}

/// Many processes (here threads, each with connections of its own) opening one new
/// file at the same moment all get a store: the first to put the file in WAL mode and
/// make the table does so, the others wait for it rather than fail with `SQLITE_BUSY`
/// (which SQLite answers at once, busy timeout or not, to a journal-mode change that
/// would otherwise wait on another).
#[test]
fn stores_opened_at_once_on_one_new_file_all_open() {
    for round in 0..20 {
        let dir = tempfile::tempdir().unwrap();
        let path = Arc::new(dir.path().join("idem.sqlite"));
        let start = Arc::new(std::sync::Barrier::new(12));
        let openers: Vec<_> = (0..12)
            .map(|_| {
                let (path, start) = (path.clone(), start.clone());
                std::thread::spawn(move || {
                    start.wait();
                    SqliteStore::open(&*path).map(drop)
                })
            })
            .collect();
        for opener in openers {
            let opened = opener.join().unwrap();
            assert!(opened.is_ok(), "round {round}: {opened:?}");
        }
    }
}
