//! The concurrency campaign: many tasks make random, overlapping calls over a set of
//! keys, with a short lease that slow bodies outlive, so claims are taken over while
//! their first owner still runs (takeover) and that owner's late completion must be
//! refused (fencing). Memory and sled run in one process; Postgres and Redis run in
//! three worker processes at once, each with its own connection. Memory and Redis run
//! again with a `LocalCache` in front (in each worker process, for Redis).
//!
//! Checked per key: every caller that got a value got the same one; the store holds
//! that value (no stale owner overwrote it); and the body ran exactly once per
//! completion: one execution completed, and every other execution's owner was told it
//! lost its lease.
//!
//! Postgres and Redis need `IDEM_POSTGRES_URL` / `IDEM_REDIS_URL`; without them those
//! cases print SKIPPED.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem::{idempotent, Error, Key, MemoryStore, Run, State, Store};

const TASKS: u64 = 24;
const CALLS_PER_TASK: u64 = 20;
const KEYS: u64 = 12;

/// What happened, one line per event: `exec <k> <value> <key> <nanos>` when a body
/// started (wall clock, shared by every process of the machine),
/// `ok <k> <value>` when a caller got a value, `lost <k>` when a caller was told its
/// lease was lost.
#[derive(Default)]
struct Journal(Mutex<Vec<String>>);

impl Journal {
    fn push(&self, line: String) {
        self.0.lock().unwrap().push(line);
    }
    fn lines(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

static NONCE: AtomicU64 = AtomicU64::new(0);

/// A tool whose body sometimes outlives its 150 ms lease (a third of the calls sleep
/// 400 ms), so waiting duplicates take the claim over while it still runs.
#[idempotent(name = "slow_tool", lease = "150ms", wait = "20s", skip = [journal, slow])]
async fn slow_tool(journal: &Journal, k: u64, slow: bool) -> Result<String, Error> {
    let value = format!(
        "k{k}-p{}-v{}",
        std::process::id(),
        NONCE.fetch_add(1, Ordering::SeqCst)
    );
    let key = idem::current_key()
        .map(|k| k.to_string())
        .unwrap_or_default();
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    journal.push(format!("exec {k} {value} {key} {started}"));
    let pause = if slow { 400 } else { (k * 7) % 30 };
    tokio::time::sleep(Duration::from_millis(pause)).await;
    Ok(value)
}

/// `tasks` tasks making random calls in `run_id` on `store`.
async fn drive(store: &Arc<dyn Store>, run_id: &str, seed: u64, tasks: u64) -> Vec<String> {
    let journal = Arc::new(Journal::default());
    let mut handles = Vec::new();
    for t in 0..tasks {
        let run = Run::new(run_id).with_shared_store(store.clone());
        let journal = journal.clone();
        handles.push(tokio::spawn(async move {
            let mut rng = (seed ^ t).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            for _ in 0..CALLS_PER_TASK {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let k = rng % KEYS;
                let slow = rng % 3 == 0;
                match run.scope(slow_tool(&journal, k, slow)).await {
                    Ok(value) => journal.push(format!("ok {k} {value}")),
                    Err(Error::LostLease { .. }) => journal.push(format!("lost {k}")),
                    Err(e) => panic!("key {k}: unexpected error {e}"),
                }
            }
        }));
    }
    for handle in handles {
        handle.await.unwrap();
    }
    journal.lines()
}

/// Checks the invariants over everything every process saw.
async fn check(lines: &[String], store: &dyn Store) {
    // Per key: (start, value) of every execution.
    let mut executions: HashMap<u64, Vec<(u128, String)>> = HashMap::new();
    let mut keys: HashMap<u64, String> = HashMap::new();
    let mut answers: HashMap<u64, Vec<String>> = HashMap::new();
    let mut lost: HashMap<u64, u32> = HashMap::new();
    for line in lines {
        let parts: Vec<&str> = line.split(' ').collect();
        let k: u64 = parts[1].parse().unwrap();
        match parts[0] {
            "exec" => {
                let started: u128 = parts[4].parse().unwrap();
                executions
                    .entry(k)
                    .or_default()
                    .push((started, parts[2].to_owned()));
                keys.insert(k, parts[3].to_owned());
            }
            "ok" => answers.entry(k).or_default().push(parts[2].to_owned()),
            "lost" => *lost.entry(k).or_default() += 1,
            other => panic!("unknown journal line {other}"),
        }
    }
    let mut takeovers = 0;
    for (k, values) in &answers {
        let first = &values[0];
        assert!(
            values.iter().all(|v| v == first),
            "key {k}: callers saw different values: {values:?}"
        );
        // The store holds what the callers got: no stale owner overwrote it.
        let key = Key::from_text(keys[k].as_str());
        let record = store.get(&key).await.unwrap().expect("a record");
        let State::Completed { result } = record.state else {
            panic!("key {k}: not completed: {:?}", record.state);
        };
        let stored: String = serde_json::from_slice(&result).unwrap();
        assert_eq!(&stored, first, "key {k}: the store holds another value");
        // Exactly one execution completed; every other one's owner lost its lease.
        let ran = executions[k].len() as u32;
        let lost = lost.get(k).copied().unwrap_or(0);
        assert_eq!(
            ran,
            1 + lost,
            "key {k}: {ran} executions, 1 completion and {lost} lost leases"
        );
        // The completion came from the newest owner: an execution whose claim was
        // taken over must never complete, even if it finishes first. (Claims of one
        // key are a lease, 150 ms, apart; a body starts microseconds after its claim.)
        let newest = executions[k].iter().max().map(|(_, v)| v).unwrap();
        assert_eq!(
            newest, first,
            "key {k}: a stale owner's result was stored over the newest owner's"
        );
        takeovers += lost;
    }
    let calls: usize = answers.values().map(Vec::len).sum();
    println!("{calls} calls answered, {takeovers} takeovers (stale owners fenced off)");
    assert!(
        takeovers > 0,
        "no lease expired mid-body: the campaign tested nothing"
    );
}

fn run_id() -> String {
    format!(
        "concurrency-{}-{}",
        std::process::id(),
        NONCE.fetch_add(1, Ordering::SeqCst)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_store_concurrency_campaign() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let lines = drive(&store, &run_id(), 1, TASKS).await;
    check(&lines, &*store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_store_behind_a_local_cache_concurrency_campaign() {
    let store: Arc<dyn Store> = Arc::new(idem::LocalCache::new(MemoryStore::new()));
    let lines = drive(&store, &run_id(), 3, TASKS).await;
    check(&lines, &*store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sled_store_concurrency_campaign() {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn Store> = Arc::new(idem::SledStore::open(dir.path()).unwrap());
    let lines = drive(&store, &run_id(), 2, TASKS).await;
    check(&lines, &*store).await;
}

// ---------------------------------------------------------------------------------
// Network stores: three worker processes at once.
// ---------------------------------------------------------------------------------

#[cfg(any(feature = "postgres", feature = "redis"))]
mod fleet {
    use super::*;
    use std::process::Command;

    const WORKER: &str = "IDEM_CONCURRENCY_WORKER";
    const PROCESSES: u64 = 3;
    /// The suffix of a store name whose workers put a `LocalCache` in front of it.
    pub const LOCAL_CACHE: &str = "+local-cache";

    #[derive(serde::Serialize, serde::Deserialize)]
    struct Job {
        store: String,
        url: String,
        run_id: String,
        seed: u64,
        out: std::path::PathBuf,
    }

    pub async fn connect(store: &str, url: &str) -> Arc<dyn Store> {
        match store {
            #[cfg(feature = "postgres")]
            "postgres" => Arc::new(
                idem::PostgresStore::builder(url)
                    .table("idem_concurrency")
                    .connect()
                    .await
                    .unwrap(),
            ),
            #[cfg(feature = "redis")]
            "redis" => Arc::new(
                idem::RedisStore::builder(url)
                    .prefix("idem-concurrency:")
                    .connect()
                    .await
                    .unwrap(),
            ),
            other => panic!("no {other} store in this build"),
        }
    }

    /// A worker's store: `<store>`, or `<store>+local-cache` for that store behind a
    /// `LocalCache` of the worker's own.
    async fn worker_store(store: &str, url: &str) -> Arc<dyn Store> {
        match store.strip_suffix(LOCAL_CACHE) {
            Some(shared) => Arc::new(idem::LocalCache::new(connect(shared, url).await)),
            None => connect(store, url).await,
        }
    }

    /// One worker process: its share of the tasks, its own connection; the journal
    /// goes to a file.
    #[test]
    #[ignore = "worker process of the concurrency campaign; started by it"]
    fn concurrency_worker() {
        let Ok(job) = std::env::var(WORKER) else {
            return;
        };
        let job: Job = serde_json::from_str(&job).unwrap();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let lines = runtime.block_on(async {
            let store = worker_store(&job.store, &job.url).await;
            drive(&store, &job.run_id, job.seed, TASKS / PROCESSES).await
        });
        std::fs::write(&job.out, lines.join("\n")).unwrap();
    }

    pub async fn campaign(store: &str, url: &str) {
        let dir = tempfile::tempdir().unwrap();
        let run_id = run_id();
        let children: Vec<_> = (0..PROCESSES)
            .map(|p| {
                let job = Job {
                    store: store.to_owned(),
                    url: url.to_owned(),
                    run_id: run_id.clone(),
                    seed: 100 + p,
                    out: dir.path().join(format!("journal-{p}")),
                };
                let child = Command::new(std::env::current_exe().unwrap())
                    .args([
                        "--ignored",
                        "--exact",
                        "fleet::concurrency_worker",
                        "--quiet",
                    ])
                    .env(WORKER, serde_json::to_string(&job).unwrap())
                    .stdout(std::process::Stdio::null())
                    .spawn()
                    .unwrap();
                (child, job.out)
            })
            .collect();
        let mut lines = Vec::new();
        for (mut child, out) in children {
            let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
                .await
                .unwrap();
            assert!(status.success(), "a worker process failed");
            let journal = std::fs::read_to_string(out).unwrap();
            lines.extend(journal.lines().map(str::to_owned));
        }
        // Checked on the shared store itself, as a process without a cache sees it.
        let shared = store.strip_suffix(LOCAL_CACHE).unwrap_or(store);
        let store = connect(shared, url).await;
        print!("{PROCESSES} processes on {}: ", store_name(url));
        check(&lines, &*store).await;
    }

    fn store_name(url: &str) -> &str {
        url.split(':').next().unwrap_or(url)
    }
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_store_concurrency_campaign_across_processes() {
    match std::env::var("IDEM_POSTGRES_URL") {
        Ok(url) => fleet::campaign("postgres", &url).await,
        Err(_) => println!("SKIPPED postgres concurrency campaign: IDEM_POSTGRES_URL is not set"),
    }
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_concurrency_campaign_across_processes() {
    match std::env::var("IDEM_REDIS_URL") {
        Ok(url) => fleet::campaign("redis", &url).await,
        Err(_) => println!("SKIPPED redis concurrency campaign: IDEM_REDIS_URL is not set"),
    }
}

/// Each worker process with a `LocalCache` in front of the shared Redis: a cache must
/// replay only the newest owner's value, never a fenced-off owner's.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_behind_local_caches_concurrency_campaign_across_processes() {
    match std::env::var("IDEM_REDIS_URL") {
        Ok(url) => fleet::campaign(&format!("redis{}", fleet::LOCAL_CACHE), &url).await,
        Err(_) => println!("SKIPPED redis concurrency campaign: IDEM_REDIS_URL is not set"),
    }
}
