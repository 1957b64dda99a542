//! What only the sled store has: a directory, one handle per path, bytes on disk.

use std::time::Duration;

use idem_core::__private::{execute, Call, ReleaseErrors};
use idem_core::store::Store;
use idem_core::{Error, Options, Run, SledStore};

async fn send(run: &Run, to: &str, value: &str) -> Result<Result<String, Error>, Error> {
    let value = value.to_string();
    execute::<Result<String, Error>, ReleaseErrors, _>(
        Call::new(Some(run), "send_email", Options::new(), &to),
        async move { Ok(value) },
    )
    .await
}

/// Opens the database under a closed store with sled itself. sled's background thread
/// lets go of the directory's lock a moment after the last handle is dropped, so wait
/// for it as `SledStore::open` does.
fn open_raw(path: &std::path::Path) -> sled::Db {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match sled::open(path) {
            Ok(db) => return db,
            Err(e) if std::time::Instant::now() < deadline => {
                assert!(e.to_string().contains("could not acquire lock"), "{e}");
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err(e) => panic!("the store's lock was never released: {e}"),
        }
    }
}

#[tokio::test]
async fn corrupt_bytes_are_a_typed_error_naming_the_key_and_nothing_else_is_touched() {
    let dir = tempfile::tempdir().unwrap();
    let run_on = |store: SledStore| Run::new("run-corrupt").with_store(store);

    let store = SledStore::open(dir.path()).unwrap();
    send(&run_on(store.clone()), "ada@example.com", "msg-ada")
        .await
        .unwrap()
        .unwrap();
    let bad = Call::new(
        Some(&run_on(store.clone())),
        "send_email",
        Options::new(),
        &"bob@example.com",
    )
    .unwrap()
    .key()
    .clone();
    drop(store);

    // Damage one record behind idem's back.
    {
        let db = open_raw(dir.path());
        let tree = db.open_tree(SledStore::TREE).unwrap();
        tree.insert(bad.as_str(), &b"\x00\x01 not a record"[..])
            .unwrap();
        tree.insert("idem-future", &b"idem\x09rest"[..]).unwrap();
        db.flush().unwrap();
    }

    let store = SledStore::open(dir.path()).unwrap();
    let run = run_on(store.clone());
    let err = send(&run, "bob@example.com", "msg-bob").await.unwrap_err();
    match &err {
        Error::CorruptRecord { key, .. } => assert_eq!(key, bad.as_str()),
        other => panic!("expected CorruptRecord, got {other}"),
    }
    assert!(err.to_string().contains(bad.as_str()));
    let err = store
        .get(&idem_core::Key::from_text("idem-future"))
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::UnsupportedFormat { version: 9, .. }),
        "{err}"
    );

    // The other record still replays, and purge leaves unreadable records alone.
    assert_eq!(
        send(&run, "ada@example.com", "other")
            .await
            .unwrap()
            .unwrap(),
        "msg-ada"
    );
    assert_eq!(store.purge_expired().await.unwrap(), 0);
    assert_eq!(store.len(), 3);

    // Deleting the corrupt key lets the call run again.
    assert!(store.delete(&bad).await.unwrap());
    assert_eq!(
        send(&run, "bob@example.com", "msg-bob")
            .await
            .unwrap()
            .unwrap(),
        "msg-bob"
    );
}

#[tokio::test]
async fn one_handle_per_path_inside_a_process() {
    let dir = tempfile::tempdir().unwrap();
    let a = SledStore::open(dir.path()).unwrap();
    let b = SledStore::open(dir.path().join(".")).unwrap();
    assert_eq!(a.path(), b.path());
    send(&Run::new("r").with_store(a), "x", "first")
        .await
        .unwrap()
        .unwrap();
    // The second handle sees the first one's record at once.
    assert_eq!(
        send(&Run::new("r").with_store(b), "x", "second")
            .await
            .unwrap()
            .unwrap(),
        "first"
    );
}

#[tokio::test]
async fn records_survive_closing_and_reopening() {
    let dir = tempfile::tempdir().unwrap();
    let store = SledStore::open(dir.path()).unwrap();
    send(&Run::new("r").with_store(store.clone()), "x", "kept")
        .await
        .unwrap()
        .unwrap();
    drop(store);
    let store = SledStore::open(dir.path()).unwrap();
    assert_eq!(
        send(&Run::new("r").with_store(store), "x", "new")
            .await
            .unwrap()
            .unwrap(),
        "kept"
    );
}

#[tokio::test]
async fn an_unusable_directory_is_a_store_error() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"not a directory").unwrap();
    let err = SledStore::open(&file).unwrap_err();
    assert!(matches!(err, Error::Store { store: "sled", .. }), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_sweeper_purges_expired_records() {
    let dir = tempfile::tempdir().unwrap();
    let store = SledStore::open(dir.path()).unwrap();
    let run = Run::new("r").with_store(store.clone());
    let short = Options::new().ttl(Duration::from_millis(50));
    execute::<Result<u8, Error>, ReleaseErrors, _>(Call::new(Some(&run), "t", short, &1), async {
        Ok(1)
    })
    .await
    .unwrap()
    .unwrap();
    assert_eq!(store.len(), 1);
    let _sweeper = idem_core::sweeper::spawn(
        std::sync::Arc::new(store.clone()),
        Duration::from_millis(20),
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !store.is_empty() {
        assert!(std::time::Instant::now() < deadline, "sweeper never purged");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Many concurrent durable misses on distinct keys: they share flushes, and finish.
/// (sled's own `flush_async` deadlocks its thread pool under this load, so the work
/// runs on a thread of its own and the test gives up on it after a minute.)
#[test]
fn many_concurrent_misses_share_flushes_and_finish() {
    let dir = tempfile::tempdir().unwrap();
    let store = SledStore::open(dir.path()).unwrap();
    let (done, finished) = std::sync::mpsc::channel();
    let worker_store = store.clone();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let run = Run::new("many").with_store(worker_store);
            let tasks: Vec<_> = (0..64u32)
                .map(|t| {
                    let run = run.clone();
                    tokio::spawn(async move {
                        for i in 0..8u32 {
                            let n = t * 100 + i;
                            let v = execute::<Result<u32, Error>, ReleaseErrors, _>(
                                Call::new(Some(&run), "tool", Options::new(), &n),
                                async move { Ok(n) },
                            )
                            .await
                            .unwrap()
                            .unwrap();
                            assert_eq!(v, n);
                        }
                    })
                })
                .collect();
            for t in tasks {
                t.await.unwrap();
            }
        });
        let _ = done.send(());
    });
    finished
        .recv_timeout(Duration::from_secs(60))
        .expect("concurrent misses on sled did not finish within a minute: flush deadlock");
    assert_eq!(store.len(), 64 * 8);
}

/// Calls cancelled at every point (an agent's timeout around the tool call), many of
/// them while their flush runs: later calls still complete.
#[test]
fn cancelled_calls_do_not_wedge_the_flush() {
    let dir = tempfile::tempdir().unwrap();
    let store = SledStore::open(dir.path()).unwrap();
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let run = Run::new("cancel").with_store(store);
            for n in 0..300u32 {
                let call = execute::<Result<u32, Error>, ReleaseErrors, _>(
                    Call::new(Some(&run), "tool", Options::new(), &n),
                    async move { Ok(n) },
                );
                let budget = Duration::from_micros(u64::from(n % 30) * 20);
                let _ = tokio::time::timeout(budget, call).await;
            }
            // A call after all that still goes through.
            let v = execute::<Result<u32, Error>, ReleaseErrors, _>(
                Call::new(Some(&run), "tool", Options::new(), &"after"),
                async { Ok(7) },
            )
            .await
            .unwrap()
            .unwrap();
            assert_eq!(v, 7);
        });
        let _ = done.send(());
    });
    finished
        .recv_timeout(Duration::from_secs(60))
        .expect("a call after cancelled ones never finished: a flush was left running");
}

#[tokio::test]
async fn fsync_mode_caps_results_below_the_blob_size_and_is_one_setting_per_directory() {
    let dir = tempfile::tempdir().unwrap();
    let store = SledStore::builder(dir.path()).fsync(true).open().unwrap();
    assert_eq!(store.max_result_bytes(), SledStore::FSYNC_MAX_RESULT_BYTES);
    let run = Run::new("r").with_store(store.clone());
    // A result that would need one of sled's (never synced) blob files is refused.
    let big = "x".repeat(SledStore::FSYNC_MAX_RESULT_BYTES);
    let err = send(&run, "big", &big).await.unwrap_err();
    assert!(matches!(err, Error::ResultTooLarge { .. }), "{err}");
    // Just under the cap is stored and replayed.
    let fits = "x".repeat(SledStore::FSYNC_MAX_RESULT_BYTES - 2);
    assert_eq!(send(&run, "fits", &fits).await.unwrap().unwrap(), fits);
    assert_eq!(send(&run, "fits", "other").await.unwrap().unwrap(), fits);

    // The same directory cannot be open with and without fsync at once.
    let err = SledStore::open(dir.path()).unwrap_err();
    assert!(err.to_string().contains("fsync = true"), "{err}");
    drop((run, store));
    // Reopened without fsync, the records are there.
    let store = SledStore::open(dir.path()).unwrap();
    assert_eq!(
        store.max_result_bytes(),
        idem_core::store::DEFAULT_MAX_RESULT_BYTES
    );
    let run = Run::new("r").with_store(store);
    assert_eq!(send(&run, "fits", "other").await.unwrap().unwrap(), fits);
}

/// A miss flushes wherever the tool runs: in place on a multi-threaded runtime, on a
/// blocking thread from a current-thread runtime, inline with no runtime at all; from
/// async and sync tools alike. Each body runs once, a retry gets its value back, and
/// every result is there when the store is opened again.
#[test]
fn misses_flush_and_replay_from_every_kind_of_thread() {
    use idem_core::__private::execute_blocking;
    use std::sync::atomic::{AtomicUsize, Ordering};

    let dir = tempfile::tempdir().unwrap();
    let run = Run::new("r").with_store(SledStore::open(dir.path()).unwrap());
    let runs = AtomicUsize::new(0);
    let sync_tool = |to: &str| {
        execute_blocking::<Result<String, Error>, ReleaseErrors, _>(
            Call::new(Some(&run), "send_email", Options::new(), &to),
            || {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok(format!("sent to {to}"))
            },
        )
        .unwrap()
        .unwrap()
    };
    let multi = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    let current = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let mut sent = Vec::new();
    for _ in 0..2 {
        sent.push(
            multi
                .block_on(multi.spawn({
                    let run = run.clone();
                    async move { send(&run, "async-multi", "async on a worker").await }
                }))
                .unwrap()
                .unwrap()
                .unwrap(),
        );
        sent.push(
            current
                .block_on(send(&run, "async-current", "async, current thread"))
                .unwrap()
                .unwrap(),
        );
        sent.push(
            multi
                .block_on(multi.spawn_blocking({
                    let run = run.clone();
                    move || {
                        execute_blocking::<Result<String, Error>, ReleaseErrors, _>(
                            Call::new(Some(&run), "send_email", Options::new(), &"sync-worker"),
                            || Ok("sync in spawn_blocking".to_string()),
                        )
                    }
                }))
                .unwrap()
                .unwrap()
                .unwrap(),
        );
        sent.push(current.block_on(async { sync_tool("sync-in-current") }));
        sent.push(sync_tool("sync-no-runtime"));
    }
    assert_eq!(sent[..5], sent[5..], "a retry got another value");
    assert_eq!(runs.load(Ordering::SeqCst), 2, "a sync body ran twice");

    drop(run);
    let store = SledStore::open(dir.path()).unwrap();
    assert_eq!(store.len(), 5);
    let reopened = Run::new("r").with_store(store);
    let tos = [
        "async-multi",
        "async-current",
        "sync-worker",
        "sync-in-current",
        "sync-no-runtime",
    ];
    for (to, value) in tos.iter().zip(&sent) {
        let got = current
            .block_on(send(&reopened, to, "ran again"))
            .unwrap()
            .unwrap();
        assert_eq!(&got, value);
    }
}

/// On a current-thread runtime whose blocking pool can start no thread (here the OS
/// cannot map the stack it asks for; elsewhere a process at its thread limit), where
/// `tokio::task::spawn_blocking` panics, the store flushes and purges in place: the
/// body runs once, a retry gets its value back, the purge removes what expired, and
/// the result is still there when the store is opened again.
#[test]
fn a_runtime_that_starts_no_blocking_thread_flushes_and_purges_in_place() {
    use std::sync::atomic::{AtomicUsize, Ordering};

    let crippled = tokio::runtime::Builder::new_current_thread()
        .thread_stack_size(usize::MAX >> 2)
        .enable_time()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = SledStore::open(dir.path()).unwrap();
    let run = Run::new("r").with_store(store.clone());
    let runs = AtomicUsize::new(0);
    let call = |ttl: Duration| {
        execute::<Result<usize, Error>, ReleaseErrors, _>(
            Call::new(Some(&run), "send_email", Options::new().ttl(ttl), &"ada"),
            async { Ok(runs.fetch_add(1, Ordering::SeqCst)) },
        )
    };
    let hour = Duration::from_secs(3600);
    let first = crippled.block_on(call(hour)).unwrap().unwrap();
    let retry = crippled.block_on(call(hour)).unwrap().unwrap();
    assert_eq!(
        (first, retry),
        (0, 0),
        "the retry did not replay the first result"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    let short = Run::new("short").with_store(store.clone());
    crippled
        .block_on(execute::<Result<u8, Error>, ReleaseErrors, _>(
            Call::new(
                Some(&short),
                "t",
                Options::new().ttl(Duration::from_millis(200)),
                &1,
            ),
            async { Ok(1) },
        ))
        .unwrap()
        .unwrap();
    std::thread::sleep(Duration::from_millis(250));
    assert_eq!(crippled.block_on(store.purge_expired()).unwrap(), 1);
    assert_eq!(store.len(), 1);

    drop((run, short, store));
    let reopened = Run::new("r").with_store(SledStore::open(dir.path()).unwrap());
    let replayed = crippled.block_on(execute::<Result<usize, Error>, ReleaseErrors, _>(
        Call::new(Some(&reopened), "send_email", Options::new(), &"ada"),
        async { Ok(99) },
    ));
    assert_eq!(
        replayed.unwrap().unwrap(),
        0,
        "the result did not survive reopening"
    );
}

/// A process killed while sled wrote a snapshot (sled writes one each time it opens a
/// database) leaves `snap.<lsn>.generating`, which sled 0.34 then takes for the newest
/// snapshot and refuses to open the database over, for good. The store clears it and
/// opens, with every record kept.
#[tokio::test]
async fn a_store_left_with_an_unfinished_snapshot_opens_and_keeps_its_records() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem");
    {
        let run = Run::new("run-snap").with_store(SledStore::open(&path).unwrap());
        assert_eq!(send(&run, "ada", "m-1").await.unwrap().unwrap(), "m-1");
    }
    // What a kill between creating the snapshot file and renaming it leaves behind.
    drop(open_raw(&path));
    std::fs::write(path.join("snap.FFFFFFFFFFFFFFFF.generating"), b"").unwrap();
    match sled::open(&path) {
        Err(sled::Error::Corruption { .. }) => {}
        other => panic!("sled itself opened it: {:?}", other.map(|_| ())),
    }

    let store = SledStore::open(&path).unwrap();
    let run = Run::new("run-snap").with_store(store);
    assert_eq!(
        send(&run, "ada", "never").await.unwrap().unwrap(),
        "m-1",
        "the completed call is replayed"
    );
    let unfinished = std::fs::read_dir(&path)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .ends_with(".generating")
        })
        .count();
    assert_eq!(unfinished, 0);
}

/// A lease short enough that a renewal held up for two thirds of it loses the claim:
/// 150 ms, renewed every 50 ms. It is safe here, on a busy machine, only because the
/// renewals run on idem's own thread and not behind the writes that flood the store
/// (nor on the timer thread, which every wait in the process relies on); a test that
/// needs a claim held but not a short lease uses a lease of seconds.
fn flood_lease() -> Options {
    Options::new().lease(Duration::from_millis(150))
}

/// A body with a 150 ms lease keeps its claim for ten leases while eight other tasks
/// flood the same sled store with durable writes: a duplicate that does not wait finds
/// the claim held at any time, and the body's result is stored, not lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_lease_holds_while_other_tasks_flood_sled_with_writes() {
    let dir = tempfile::tempdir().unwrap();
    let run = Run::new("flood").with_store(SledStore::open(dir.path()).unwrap());
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flood: Vec<_> = (0..8)
        .map(|task| {
            let (run, stop) = (run.clone(), stop.clone());
            tokio::spawn(async move {
                let mut writes = 0u32;
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    let call = Call::new(Some(&run), "flood", Options::new(), &(task, writes));
                    execute::<Result<u32, Error>, ReleaseErrors, _>(call, async move { Ok(1) })
                        .await
                        .unwrap()
                        .unwrap();
                    writes += 1;
                }
                writes
            })
        })
        .collect();
    let owner = execute::<Result<String, Error>, ReleaseErrors, _>(
        Call::new(Some(&run), "export_report", flood_lease(), &7),
        async {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            Ok("the owner's report".to_owned())
        },
    );
    let duplicates = async {
        let mut held = 0;
        for _ in 0..6 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let duplicate = execute::<Result<String, Error>, ReleaseErrors, _>(
                Call::new(Some(&run), "export_report", flood_lease().fail_fast(), &7),
                async { Ok("a second report".to_owned()) },
            )
            .await;
            assert!(
                matches!(duplicate, Err(Error::InProgress { .. })),
                "the claim was lost under the flood: {duplicate:?}"
            );
            held += 1;
        }
        held
    };
    let (owner, held) = tokio::join!(owner, duplicates);
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut writes = 0;
    for task in flood {
        writes += task.await.unwrap();
    }
    assert_eq!(
        owner.unwrap().unwrap(),
        "the owner's report",
        "no LostLease"
    );
    assert_eq!(held, 6);
    assert!(writes > 100, "the flood was {writes} durable writes");
    let replayed = execute::<Result<String, Error>, ReleaseErrors, _>(
        Call::new(Some(&run), "export_report", flood_lease(), &7),
        async { Ok("a second report".to_owned()) },
    )
    .await;
    assert_eq!(replayed.unwrap().unwrap(), "the owner's report");
}
