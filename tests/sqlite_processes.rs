//! Several processes on one SQLite file: 4 worker processes make 200 calls each over
//! 50 keys of one run, at once; one of them is killed with SIGKILL midway and a fresh
//! process takes its place (and its calls). Checked from what the processes wrote down
//! as they went: each key's side effect ran once, except where a killed process had
//! run it and died before its result was stored (the crash window, where a takeover
//! runs it again, at-least-once); every call that returned got the same value for its
//! key, and it is the value the store holds.
#![cfg(feature = "sqlite")]

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use idem::store::{Filter, State};
use idem::{idempotent, Run, SqliteStore, Store};
use serde::{Deserialize, Serialize};

const WORKERS: usize = 4;
const CALLS: u64 = 200;
const KEYS: u64 = 50;
const RUN_ID: &str = "sqlite-processes";
/// The worker's configuration: `<database> <log>`.
const WORKER_ENV: &str = "IDEM_SQLITE_PROCESSES_WORKER";
/// Set for the worker the test kills: past a quarter of its calls it pauses between
/// them, so that the kill lands while it still has calls to make however slowly the
/// test sees its progress (most of its calls are replays, microseconds each, and a busy
/// machine once let it finish all 200 between two looks).
const PACED_ENV: &str = "IDEM_SQLITE_PROCESSES_PACED";

#[derive(Debug, Serialize, Deserialize)]
struct ToolError(String);

impl From<idem::Error> for ToolError {
    fn from(e: idem::Error) -> Self {
        ToolError(e.to_string())
    }
}

#[derive(Serialize)]
struct Deliver {
    key: u64,
}

/// Appends one line to the log (one `write` on a file opened for appending: a line is
/// whole or absent after a kill).
fn note(log: &Path, line: String) {
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .expect("the log");
    file.write_all(format!("{line}\n").as_bytes())
        .expect("a log line");
}

tokio::task_local! {
    static LOG: PathBuf;
}

/// The side effect: written down before the body returns, with a value no other
/// execution has.
#[idempotent(ttl = "1h", lease = "1s", name = "deliver")]
async fn deliver(input: Deliver) -> Result<String, ToolError> {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let value = format!(
        "{}-{}",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    LOG.with(|log| note(log, format!("exec {} {value}", input.key)));
    tokio::time::sleep(Duration::from_millis(20)).await;
    Ok(value)
}

/// The worker process: this test binary, started again by the test.
#[test]
#[ignore = "worker process of sqlite_processes; started by it"]
fn sqlite_worker() {
    let Ok(config) = std::env::var(WORKER_ENV) else {
        return;
    };
    let (db, log) = config.split_once(' ').expect("<database> <log>");
    let (db, log) = (PathBuf::from(db), PathBuf::from(log));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(LOG.scope(log.clone(), async move {
        let store = SqliteStore::open(&db).expect("the store opens");
        let run = Run::new(RUN_ID).with_store(store);
        let mut seed = u64::from(std::process::id()) | 1;
        let paced = std::env::var_os(PACED_ENV).is_some();
        for call in 0..CALLS {
            if paced && call > CALLS / 4 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let key = seed % KEYS;
            match run.scope(deliver(Deliver { key })).await {
                Ok(value) => note(&log, format!("ok {key} {value}")),
                Err(e) => {
                    note(&log, format!("error {key} {}", e.0));
                    std::process::exit(3);
                }
            }
        }
    }));
}

/// Starts a worker writing `log` (`paced`: see [`PACED_ENV`]); what its test harness
/// prints (a panic's message) goes to `log` with `.out` added.
fn start(db: &Path, log: &Path, paced: bool) -> Child {
    let out = std::fs::File::create(log.with_extension("out")).expect("the worker's output");
    let mut worker = Command::new(std::env::current_exe().unwrap());
    worker
        .args(["--ignored", "--exact", "sqlite_worker", "--quiet"])
        .env(WORKER_ENV, format!("{} {}", db.display(), log.display()))
        .stdout(out);
    if paced {
        worker.env(PACED_ENV, "1");
    }
    worker.spawn().expect("a worker process")
}

fn wait(child: &mut Child, deadline: Instant) -> std::process::ExitStatus {
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("a worker hung");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn lines(log: &Path) -> Vec<(String, u64, String)> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .map(|line| {
            let mut parts = line.splitn(3, ' ');
            let (what, key, value) = (parts.next(), parts.next(), parts.next());
            (
                what.unwrap().to_owned(),
                key.and_then(|k| k.parse().ok()).expect("a key"),
                value.unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

#[test]
fn four_processes_with_a_kill_run_each_key_once_and_agree() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("idem.sqlite");
    let log = |i: usize| dir.path().join(format!("worker-{i}.log"));
    // Kill one worker once it is well into its calls.
    let victim = std::process::id() as usize % WORKERS;
    let mut children: Vec<Child> = (0..WORKERS)
        .map(|i| start(&db, &log(i), i == victim))
        .collect();
    let started = Instant::now();
    while lines(&log(victim)).iter().filter(|l| l.0 == "ok").count() < CALLS as usize / 4 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the victim made no progress"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    children[victim].kill().unwrap();
    children[victim].wait().unwrap();
    let killed = log(victim);
    children.push(start(&db, &log(WORKERS), false));

    let deadline = Instant::now() + Duration::from_secs(120);
    for (i, child) in children.iter_mut().enumerate() {
        if i == victim {
            continue;
        }
        let status = wait(child, deadline);
        assert!(
            status.success(),
            "worker {i} failed: {status}: {:?}\n{}",
            lines(&log(i))
                .into_iter()
                .filter(|l| l.0 == "error")
                .collect::<Vec<_>>(),
            std::fs::read_to_string(log(i).with_extension("out")).unwrap_or_default()
        );
    }

    // What the processes wrote down.
    let mut execs: HashMap<u64, Vec<(String, bool)>> = HashMap::new(); // key -> (value, by the killed process)
    let mut answers: HashMap<u64, HashSet<String>> = HashMap::new();
    for i in 0..=WORKERS {
        for (what, key, value) in lines(&log(i)) {
            match what.as_str() {
                "exec" => execs
                    .entry(key)
                    .or_default()
                    .push((value, log(i) == killed)),
                "ok" => {
                    answers.entry(key).or_default().insert(value);
                }
                other => panic!("worker {i}: {other} {key} {value}"),
            }
        }
    }
    let victim_calls = lines(&killed).iter().filter(|l| l.0 == "ok").count();
    assert!(
        victim_calls < CALLS as usize,
        "the kill landed midway ({victim_calls} calls done)"
    );

    // What the store holds: value -> key through the executions.
    let key_of: HashMap<&str, u64> = execs
        .iter()
        .flat_map(|(key, values)| values.iter().map(move |(v, _)| (v.as_str(), *key)))
        .collect();
    let store = SqliteStore::open(&db).unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let filter = Filter {
        run_id: Some(RUN_ID.to_owned()),
        ..Filter::default()
    };
    let page = runtime.block_on(store.list(&filter, None, 1_000)).unwrap();
    assert!(page.unreadable.is_empty());
    let mut stored: HashMap<u64, String> = HashMap::new();
    for listed in &page.records {
        let State::Completed { result } = &listed.record.state else {
            panic!("{} is not completed: {:?}", listed.key, listed.record.state);
        };
        let value: String = serde_json::from_slice(result).unwrap();
        let key = key_of[value.as_str()];
        assert!(stored.insert(key, value).is_none(), "one record per key");
    }

    let mut in_window = 0;
    for (key, values) in &execs {
        let by_survivors = values.iter().filter(|(_, killed)| !killed).count();
        let by_killed = values.len() - by_survivors;
        assert!(
            by_survivors <= 1,
            "key {key}: the side effect ran {by_survivors} times in live processes: {values:?}"
        );
        if values.len() > 1 {
            // Only a killed process's execution, never stored, may be run again.
            assert!(
                values
                    .iter()
                    .all(|(v, killed)| *killed || Some(v) == stored.get(key)),
                "key {key}: {values:?}, stored {:?}",
                stored.get(key)
            );
            assert!(by_killed >= 1, "key {key}: {values:?}");
            in_window += 1;
        }
    }
    for (key, got) in &answers {
        assert_eq!(
            got.len(),
            1,
            "key {key}: callers got different values: {got:?}"
        );
        assert_eq!(
            got.iter().next(),
            stored.get(key),
            "key {key}: callers got what the store holds"
        );
    }
    assert_eq!(stored.len() as u64, KEYS, "every key was called and stored");
    println!(
        "{} workers + 1 replacement, {} executions over {} keys, {} re-run after the kill \
         (the crash window), worker {victim} killed after {victim_calls} calls",
        WORKERS,
        execs.values().map(Vec::len).sum::<usize>(),
        execs.len(),
        in_window
    );
}
