//! The heartbeat across processes: a worker (this test binary, re-invoked) holds a claim
//! with a 600 ms lease for as long as its body runs; killed with SIGKILL, its heartbeat
//! stops with it and the claim is taken over within a lease; stopped with SIGSTOP past
//! its lease, it loses the claim, and when it resumes its late result is fenced off.
//!
//! Postgres and Redis are shared by the processes at once (`IDEM_POSTGRES_URL`,
//! `IDEM_REDIS_URL`; without them those tests say SKIPPED). sled allows one process per
//! directory, so there the worker is killed first and the claim read afterwards.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_core::__private::{execute, Call, ReleaseErrors};
use idem_core::store::State;
use idem_core::{Error, Options, Run, SledStore, Store};

const ROLE: &str = "IDEM_TEST_HEARTBEAT_ROLE";
const STORE: &str = "IDEM_TEST_HEARTBEAT_STORE";
const DIR: &str = "IDEM_TEST_HEARTBEAT_DIR";
const RUN: &str = "IDEM_TEST_HEARTBEAT_RUN";
const LEASE: Duration = Duration::from_millis(600);

fn call(run: &Run) -> Result<Call, Error> {
    Call::new(
        Some(run),
        "export_report",
        Options::new().lease(LEASE),
        &"report-7",
    )
}

async fn open(store: &str, dir: &Path) -> Arc<dyn Store> {
    match store {
        "sled" => Arc::new(SledStore::open(dir.join("store")).unwrap()),
        #[cfg(feature = "postgres")]
        "postgres" => {
            let url = std::env::var("IDEM_POSTGRES_URL").unwrap();
            Arc::new(
                idem_core::PostgresStore::builder(&url)
                    .table("idem_heartbeat")
                    .connect()
                    .await
                    .unwrap(),
            )
        }
        #[cfg(feature = "redis")]
        "redis" => {
            let url = std::env::var("IDEM_REDIS_URL").unwrap();
            Arc::new(
                idem_core::RedisStore::builder(&url)
                    .prefix("idem-heartbeat:")
                    .connect()
                    .await
                    .unwrap(),
            )
        }
        other => panic!("no {other} store in this build"),
    }
}

/// The worker's side: claims the key and runs a body that says it started, then runs
/// forever (`hold`) or three seconds (`slow`); writes what its call returned.
#[test]
#[ignore = "worker process of the heartbeat tests; started by them"]
fn heartbeat_worker() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let dir = PathBuf::from(std::env::var(DIR).unwrap());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let store = open(&std::env::var(STORE).unwrap(), &dir).await;
        let run = Run::new(std::env::var(RUN).unwrap()).with_shared_store(store);
        let started = dir.join("started");
        let answer = execute::<Result<String, Error>, ReleaseErrors, _>(call(&run), async move {
            std::fs::write(started, "started").unwrap();
            match role.as_str() {
                "hold" => std::future::pending().await,
                _ => tokio::time::sleep(Duration::from_secs(3)).await,
            }
            Ok("from the worker".to_owned())
        })
        .await;
        std::fs::write(dir.join("answer"), format!("{answer:?}")).unwrap();
    });
}

fn spawn_worker(role: &str, store: &str, dir: &Path, run_id: &str) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "heartbeat_worker", "--quiet"])
        .env(ROLE, role)
        .env(STORE, store)
        .env(DIR, dir)
        .env(RUN, run_id)
        .spawn()
        .unwrap()
}

fn wait_for_file(path: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !path.exists() {
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn signal(child: &Child, signal: &str) {
    let status = Command::new("kill")
        .args([signal, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill {signal}");
}

fn run_id(store: &str) -> String {
    format!(
        "heartbeat-{store}-{}-{:?}",
        std::process::id(),
        Instant::now()
    )
}

/// A call in this process; the body counts its runs.
async fn call_here(run: &Run, options: Options, runs: &Arc<AtomicUsize>) -> Result<String, Error> {
    let runs = runs.clone();
    let call = Call::new(Some(run), "export_report", options, &"report-7");
    execute::<Result<String, Error>, ReleaseErrors, _>(call, async move {
        runs.fetch_add(1, SeqCst);
        Ok("from this process".to_owned())
    })
    .await?
}

/// While the worker lives, its claim holds through many leases; SIGKILLed, its claim is
/// taken over within about a lease.
#[cfg(any(feature = "postgres", feature = "redis"))]
async fn killed_worker_loses_its_claim_after_the_lease(store_name: &str) {
    let dir = tempfile::tempdir().unwrap();
    let run_id = run_id(store_name);
    let mut worker = spawn_worker("hold", store_name, dir.path(), &run_id);
    wait_for_file(&dir.path().join("started"));
    let store = open(store_name, dir.path()).await;
    let run = Run::new(&run_id).with_shared_store(store);
    let runs = Arc::new(AtomicUsize::new(0));

    // Five leases: without renewals the claim would have run out four times over.
    let holding = Instant::now();
    while holding.elapsed() < LEASE * 5 {
        let answer = call_here(&run, Options::new().lease(LEASE).fail_fast(), &runs).await;
        assert!(
            matches!(answer, Err(Error::InProgress { .. })),
            "{:?} into the worker's body: {answer:?}",
            holding.elapsed()
        );
        tokio::time::sleep(LEASE / 4).await;
    }

    signal(&worker, "-KILL");
    let killed = Instant::now();
    worker.wait().unwrap();
    let answer = call_here(&run, Options::new().lease(LEASE), &runs).await;
    let took = killed.elapsed();
    assert_eq!(answer.unwrap(), "from this process");
    assert_eq!(runs.load(SeqCst), 1);
    assert!(
        took < LEASE + Duration::from_secs(2),
        "taken over {took:?} after the kill; the lease is {LEASE:?}"
    );
}

/// A worker stopped past its lease loses its claim to a retry; resumed, its renewal
/// finds the claim gone, its body is stopped, its call returns `LostLease`, and the
/// store keeps the new owner's result.
#[cfg(any(feature = "postgres", feature = "redis"))]
async fn stopped_worker_is_fenced_off_when_it_resumes(store_name: &str) {
    let dir = tempfile::tempdir().unwrap();
    let run_id = run_id(store_name);
    let mut worker = spawn_worker("slow", store_name, dir.path(), &run_id);
    wait_for_file(&dir.path().join("started"));
    signal(&worker, "-STOP");
    let store = open(store_name, dir.path()).await;
    let run = Run::new(&run_id).with_shared_store(store.clone());
    let runs = Arc::new(AtomicUsize::new(0));

    let answer = call_here(&run, Options::new().lease(LEASE), &runs).await;
    assert_eq!(answer.unwrap(), "from this process", "the retry took over");
    signal(&worker, "-CONT");
    assert!(worker.wait().unwrap().success());
    let worker_answer = std::fs::read_to_string(dir.path().join("answer")).unwrap();
    assert!(
        worker_answer.contains("LostLease"),
        "the resumed worker got {worker_answer}"
    );
    let record = store.get(call(&run).unwrap().key()).await.unwrap().unwrap();
    assert_eq!(
        record.state,
        State::Completed {
            result: b"\"from this process\"".to_vec()
        }
    );
    assert_eq!(runs.load(SeqCst), 1);
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_killed_worker_loses_its_claim_after_the_lease() {
    if std::env::var("IDEM_POSTGRES_URL").is_err() {
        return eprintln!("SKIPPED: IDEM_POSTGRES_URL is not set; this test checked nothing");
    }
    killed_worker_loses_its_claim_after_the_lease("postgres").await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_worker_loses_its_claim_after_the_lease() {
    if std::env::var("IDEM_REDIS_URL").is_err() {
        return eprintln!("SKIPPED: IDEM_REDIS_URL is not set; this test checked nothing");
    }
    killed_worker_loses_its_claim_after_the_lease("redis").await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_stopped_worker_is_fenced_off_when_it_resumes() {
    if std::env::var("IDEM_POSTGRES_URL").is_err() {
        return eprintln!("SKIPPED: IDEM_POSTGRES_URL is not set; this test checked nothing");
    }
    stopped_worker_is_fenced_off_when_it_resumes("postgres").await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stopped_worker_is_fenced_off_when_it_resumes() {
    if std::env::var("IDEM_REDIS_URL").is_err() {
        return eprintln!("SKIPPED: IDEM_REDIS_URL is not set; this test checked nothing");
    }
    stopped_worker_is_fenced_off_when_it_resumes("redis").await;
}

/// sled: the worker renews its claim while it lives (its lease's end, read after the
/// kill, is seconds past the first lease), and the claim is taken over within a lease
/// of the kill.
#[tokio::test]
async fn sled_killed_worker_renewed_its_claim_until_it_died() {
    let dir = tempfile::tempdir().unwrap();
    let run_id = run_id("sled");
    let mut worker = spawn_worker("hold", "sled", dir.path(), &run_id);
    wait_for_file(&dir.path().join("started"));
    let claimed = idem_core::store::Timestamp::now();
    tokio::time::sleep(LEASE * 5).await;
    signal(&worker, "-KILL");
    let killed = Instant::now();
    worker.wait().unwrap();

    let store = open("sled", dir.path()).await;
    let run = Run::new(&run_id).with_shared_store(store.clone());
    let key = call(&run).unwrap().key().clone();
    match store.get(&key).await.unwrap().map(|r| r.state) {
        Some(State::InProgress { lease_until, .. }) => assert!(
            lease_until > claimed.after(LEASE * 3),
            "the lease ends {:?} after the claim: not renewed",
            lease_until.remaining(claimed)
        ),
        other => panic!("the killed worker's claim reads as {other:?}"),
    }
    let runs = Arc::new(AtomicUsize::new(0));
    let answer = call_here(&run, Options::new().lease(LEASE), &runs).await;
    assert_eq!(answer.unwrap(), "from this process");
    assert!(killed.elapsed() < LEASE + Duration::from_secs(2));
}
