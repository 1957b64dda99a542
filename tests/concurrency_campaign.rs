//! The concurrency campaign: many tasks make random, overlapping calls over a set of
//! keys, and misbehave as agents do: a fifth of the calls are given up by the caller's
//! own timeout (a random one, up to 200 ms), a quarter of the bodies panic after their
//! side effect, and a third of the bodies run 2.5 s, well past their one-second lease.
//! Memory and sled run in one process; Postgres and Redis run in three worker processes
//! at once, each with its own connection. Memory and Redis run again with a
//! `LocalCache` in front (in each worker process, for Redis).
//!
//! Even keys go to a tool that owns its inputs (a call given up finishes alone), odd
//! keys to one with `on_cancel = "abort"` (a call given up is released). Checked per
//! key: every caller that got a value got the same one, the store holds it, and an
//! execution that completed produced it; a body that outlived its lease kept its claim
//! (no caller is ever told its lease was lost); for the finishing tool, exactly one
//! execution completed and every other one panicked (no body was left half-run).
//!
//! Postgres and Redis need `IDEM_POSTGRES_URL` / `IDEM_REDIS_URL`; without them those
//! cases print SKIPPED.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::Duration;

use idem::store::State;
use idem::{idempotent, Error, Key, MemoryStore, Run, Store};

const TASKS: u64 = 24;
const CALLS_PER_TASK: u64 = 20;
const KEYS: u64 = 12;
/// How long a slow body runs: two and a half times the tools' one-second lease, so
/// it lives on renewals alone. The lease is long enough that a renewal (every third of
/// it) would have to come two thirds of a second late for a live body to lose its
/// claim, which a busy 2-core machine running three worker processes and the server
/// does not do; with 150 ms it did, once in a few runs beside two busy loops.
const SLOW_MS: u64 = 2_500;

/// What happened, one line per event: `exec <k> <value> <key>` when a body started,
/// `done <k> <value> <slow>` when it finished, `panic <k> <value>` when it panicked, `ok <k>
/// <value>` when a caller got a value, `gave-up <k>` when a caller's timeout fired,
/// `lost <k>` when a caller was told its lease was lost.
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

/// The message of the panics the campaign plans.
const PLANNED_PANIC: &str = "concurrency campaign: planned panic";

/// Planned panics are part of the run: keep them out of the output.
fn quiet_planned_panics() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let report = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let payload = info.payload();
            let planned = payload.downcast_ref::<&str>() == Some(&PLANNED_PANIC)
                || payload
                    .downcast_ref::<String>()
                    .is_some_and(|m| m == PLANNED_PANIC);
            if !planned {
                report(info);
            }
        }));
    });
}

/// The body both tools run: the side effect (a journal line), then a pause (2.5 s
/// when `slow`), then a panic when `panics`.
async fn body(journal: &Journal, k: u64, slow: bool, panics: bool) -> Result<String, Error> {
    let value = format!(
        "k{k}-p{}-v{}",
        std::process::id(),
        NONCE.fetch_add(1, Ordering::SeqCst)
    );
    let key = idem::current_key()
        .map(|k| k.to_string())
        .unwrap_or_default();
    journal.push(format!("exec {k} {value} {key}"));
    let pause = if slow { SLOW_MS } else { (k * 7) % 30 };
    tokio::time::sleep(Duration::from_millis(pause)).await;
    if panics {
        journal.push(format!("panic {k} {value}"));
        std::panic::panic_any(PLANNED_PANIC);
    }
    journal.push(format!("done {k} {value} {slow}"));
    Ok(value)
}

/// Owns its inputs: a call its caller gives up on finishes alone.
#[idempotent(name = "finishing_tool", lease = "1s", wait = "60s", skip = [journal, slow, panics])]
async fn finishing_tool(
    journal: Arc<Journal>,
    k: u64,
    slow: bool,
    panics: bool,
) -> Result<String, Error> {
    body(&journal, k, slow, panics).await
}

/// A call its caller gives up on is dropped, and its claim released.
#[idempotent(name = "aborting_tool", lease = "1s", wait = "60s", on_cancel = "abort", skip = [journal, slow, panics])]
async fn aborting_tool(
    journal: Arc<Journal>,
    k: u64,
    slow: bool,
    panics: bool,
) -> Result<String, Error> {
    body(&journal, k, slow, panics).await
}

/// `tasks` tasks making random calls in `run_id` on `store`.
async fn drive(store: &Arc<dyn Store>, run_id: &str, seed: u64, tasks: u64) -> Vec<String> {
    quiet_planned_panics();
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
                let panics = (rng >> 8) % 4 == 0;
                let gives_up =
                    ((rng >> 16) % 5 == 0).then(|| Duration::from_millis((rng >> 24) % 200));
                let call = {
                    let (run, journal) = (run.clone(), journal.clone());
                    async move {
                        let call = async {
                            if k % 2 == 0 {
                                finishing_tool(journal, k, slow, panics).await
                            } else {
                                aborting_tool(journal, k, slow, panics).await
                            }
                        };
                        let call = run.scope(call);
                        match gives_up {
                            Some(after) => tokio::time::timeout(after, call).await.ok(),
                            None => Some(call.await),
                        }
                    }
                };
                // In a task of its own: a panic in the body reaches the caller as the
                // task's.
                match tokio::spawn(call).await {
                    Ok(Some(Ok(value))) => journal.push(format!("ok {k} {value}")),
                    Ok(Some(Err(Error::LostLease { .. }))) => journal.push(format!("lost {k}")),
                    Ok(Some(Err(e))) => panic!("key {k}: unexpected error {e}"),
                    Ok(None) => journal.push(format!("gave-up {k}")),
                    Err(e) if e.is_panic() => {}
                    Err(e) => panic!("key {k}: {e}"),
                }
            }
        }));
    }
    for handle in handles {
        handle.await.unwrap();
    }
    // Bodies given up on may still be finishing: wait until every started body ended.
    let started = std::time::Instant::now();
    loop {
        let lines = journal.lines();
        let count = |what: &str| lines.iter().filter(|l| l.starts_with(what)).count();
        let ended = count("done ") + count("panic ");
        if count("exec ") == ended
            || started.elapsed() > Duration::from_secs(1) + Duration::from_millis(SLOW_MS)
        {
            return lines;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Per key, what the journal says.
#[derive(Default)]
struct Seen {
    key: String,
    executions: Vec<String>,
    done: Vec<String>,
    panicked: u32,
    answers: Vec<String>,
    gave_up: u32,
    lost: u32,
}

/// Checks the invariants over everything every process saw.
async fn check(lines: &[String], store: &dyn Store) {
    let mut seen: HashMap<u64, Seen> = HashMap::new();
    // Slow bodies (2.5 s, past their one-second lease) that completed.
    let mut outlived = 0;
    for line in lines {
        let parts: Vec<&str> = line.split(' ').collect();
        let k: u64 = parts[1].parse().unwrap();
        let seen = seen.entry(k).or_default();
        match parts[0] {
            "exec" => {
                seen.executions.push(parts[2].to_owned());
                seen.key = parts[3].to_owned();
            }
            "done" => {
                seen.done.push(parts[2].to_owned());
                outlived += u32::from(parts[3] == "true");
            }
            "panic" => seen.panicked += 1,
            "ok" => seen.answers.push(parts[2].to_owned()),
            "gave-up" => seen.gave_up += 1,
            "lost" => seen.lost += 1,
            other => panic!("unknown journal line {other}"),
        }
    }
    let (mut gave_up, mut panicked) = (0, 0);
    for (k, seen) in &seen {
        let first = seen
            .answers
            .first()
            .unwrap_or_else(|| panic!("key {k}: no caller got a value"));
        assert!(
            seen.answers.iter().all(|v| v == first),
            "key {k}: callers saw different values: {:?}",
            seen.answers
        );
        let key = Key::from_text(seen.key.as_str());
        let record = store.get(&key).await.unwrap().expect("a record");
        let State::Completed { result } = record.state else {
            panic!("key {k}: not completed: {:?}", record.state);
        };
        let stored: String = serde_json::from_slice(&result).unwrap();
        assert_eq!(&stored, first, "key {k}: the store holds another value");
        assert!(
            seen.done.contains(first),
            "key {k}: the value callers got came from no completed execution"
        );
        assert_eq!(seen.lost, 0, "key {k}: a live body lost its claim");
        if k % 2 == 0 {
            assert_eq!(
                seen.done.len(),
                1,
                "key {k}: {} executions of the finishing tool completed",
                seen.done.len()
            );
            assert_eq!(
                seen.executions.len() as u32,
                1 + seen.panicked,
                "key {k}: a body of the finishing tool was left half-run"
            );
        }
        gave_up += seen.gave_up;
        panicked += seen.panicked;
    }
    for line in lines.iter().filter(|l| l.starts_with("done ")) {
        // A completed execution of a slow body ran past its lease.
        let value = line.split(' ').nth(2).unwrap_or_default();
        outlived += u32::from(
            lines
                .iter()
                .any(|l| l.starts_with("exec ") && l.contains(value)),
        );
    }
    let calls: usize = seen.values().map(|s| s.answers.len()).sum();
    println!(
        "{calls} calls answered, {gave_up} given up by their callers, {panicked} bodies \
         panicked, {outlived} bodies completed past their lease, no lease lost"
    );
    assert!(
        gave_up > 0 && panicked > 0 && outlived > 0,
        "the campaign tested nothing: {gave_up} given up, {panicked} panics, {outlived} \
         bodies past their lease"
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
