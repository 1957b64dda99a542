//! The throughput table: idempotent calls from 1, 8 and 64 concurrent tasks for a fixed
//! time, on every store, next to a hand-written floor doing the same store work.
//!
//! ```text
//! cargo run --release --example throughput                  # memory and sled
//! IDEM_REDIS_URL=redis://127.0.0.1:6379 IDEM_POSTGRES_URL=postgres://root@127.0.0.1/test \
//!     cargo run --release --features postgres,redis --example throughput
//! cargo run --release --example throughput -- --seconds 5   # longer cells
//! cargo run --release --features postgres,redis --example throughput -- --only postgres
//! ```
//!
//! One process, a tokio runtime with 2 worker threads, the stores' default settings
//! (Postgres: a pool of 16 connections; Redis: one multiplexed connection). Each cell
//! runs its tasks for `--seconds` (2 by default): every task calls in a loop, timing
//! each call. A hit calls a key that completed (each task its own); a miss calls a new
//! key every time. Beside each idem cell, its floor runs the same way, on the same
//! client and pool:
//!
//! - memory: the key (JSON streamed into SHA-256), then a map behind a mutex: a lookup
//!   and a decode for a hit; a claim written, the result encoded and written for a miss;
//! - sled: the key, then a `get` and a decode for a hit; two inserts, each made durable
//!   by a flush on a blocking thread, for a miss (sled 0.34's `flush_async` blocks its
//!   own pool's threads and hangs under 64 concurrent flushes; concurrent `flush`es
//!   share the log's writes);
//! - Postgres: one `SELECT` by primary key for a hit; two commits (an `INSERT`, then an
//!   `UPDATE`) for a miss;
//! - Redis: one `GET` for a hit; a claim (`SET NX GET`) and a fenced write (a script)
//!   for a miss.
//!
//! The input is the bench example's 513-byte email and the result its 114-byte message
//! id. It prints calls per second, the median and the 99th percentile latency, and
//! idem's throughput over the floor's, each pair measured one after the other.

#[path = "support/scenario.rs"]
mod scenario;

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem::{MemoryStore, Run, SledStore};
use scenario::{email, floor_key, message_id, send_email, MessageId, BODY};

/// The concurrency of each row.
const TASKS: [usize; 3] = [1, 8, 64];

/// Inputs of hits are numbered from here, apart from every miss's.
const HITS: u64 = 1 << 40;

/// Keys of misses: new for every call of the whole run.
static NEXT: AtomicU64 = AtomicU64::new(1);

fn next() -> u64 {
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// What a cell measured.
struct Measured {
    per_second: f64,
    p50: Duration,
    p99: Duration,
}

/// Runs `op(task)` in a loop from `tasks` tasks for `time`, after one untimed call from
/// each (which fills a hit's record); each call is timed.
async fn drive<F, Fut>(tasks: usize, time: Duration, op: F) -> Measured
where
    F: Fn(u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send,
{
    let op = Arc::new(op);
    let ready = Arc::new(tokio::sync::Barrier::new(tasks + 1));
    let deadline = Arc::new(Mutex::new(None::<Instant>));
    let handles: Vec<_> = (0..tasks as u64)
        .map(|task| {
            let (op, ready, deadline) =
                (Arc::clone(&op), Arc::clone(&ready), Arc::clone(&deadline));
            tokio::spawn(async move {
                op(task).await;
                ready.wait().await;
                ready.wait().await;
                let deadline = deadline.lock().unwrap().expect("set before the start");
                let mut latencies = Vec::new();
                while Instant::now() < deadline {
                    let started = Instant::now();
                    op(task).await;
                    latencies.push(started.elapsed());
                }
                latencies
            })
        })
        .collect();
    ready.wait().await;
    let started = Instant::now();
    *deadline.lock().unwrap() = Some(started + time);
    ready.wait().await;
    let mut latencies = Vec::new();
    for handle in handles {
        latencies.extend(handle.await.unwrap());
    }
    let elapsed = started.elapsed();
    latencies.sort_unstable();
    let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q) as usize];
    Measured {
        per_second: latencies.len() as f64 / elapsed.as_secs_f64(),
        p50: at(0.5),
        p99: at(0.99),
    }
}

/// One row: idem's cell, then its floor's.
struct Row {
    store: &'static str,
    kind: &'static str,
    tasks: usize,
    idem: Measured,
    floor: Measured,
}

fn print(rows: &[Row]) {
    println!(
        "{:<9} {:<5} {:>5} | {:>11} {:>9} {:>9} | {:>11} {:>9} {:>9} | {:>6}",
        "store", "call", "tasks", "idem /s", "p50", "p99", "floor /s", "p50", "p99", "ratio"
    );
    let us = |d: Duration| format!("{:.0} µs", d.as_secs_f64() * 1e6);
    for row in rows {
        println!(
            "{:<9} {:<5} {:>5} | {:>11.0} {:>9} {:>9} | {:>11.0} {:>9} {:>9} | {:>5.2}x",
            row.store,
            row.kind,
            row.tasks,
            row.idem.per_second,
            us(row.idem.p50),
            us(row.idem.p99),
            row.floor.per_second,
            us(row.floor.p50),
            us(row.floor.p99),
            row.idem.per_second / row.floor.per_second,
        );
    }
}

/// The idem cells of `store` (hit and miss, every concurrency), each followed by its
/// floor's, whose calls `floor(hit, n)` makes.
async fn rows<F, Fut>(
    rows: &mut Vec<Row>,
    store: &'static str,
    make_run: impl Fn(&str) -> Run,
    time: Duration,
    floor: F,
) where
    F: Fn(bool, u64) -> Fut + Send + Sync + Clone + 'static,
    Fut: Future<Output = ()> + Send,
{
    for (kind, hit) in [("hit", true), ("miss", false)] {
        for tasks in TASKS {
            eprintln!("{store}: {kind}, {tasks} tasks");
            let run = make_run(&format!("throughput-{store}-{kind}-{tasks}"));
            let idem = drive(tasks, time, move |task| {
                let run = run.clone();
                async move {
                    let n = if hit { HITS + task } else { next() };
                    send_email(&run, &email(n, BODY)).await.unwrap();
                }
            })
            .await;
            eprintln!("{store}: {kind}, {tasks} tasks, the floor");
            let floor = floor.clone();
            let floor = drive(tasks, time, move |task| {
                let n = if hit { HITS + task } else { next() };
                floor(hit, n)
            })
            .await;
            rows.push(Row {
                store,
                kind,
                tasks,
                idem,
                floor,
            });
        }
    }
}

/// Which stores to measure (`--only a,b`; all by default).
struct Only(Option<Vec<String>>);

impl Only {
    fn has(&self, store: &str) -> bool {
        self.0
            .as_ref()
            .is_none_or(|only| only.iter().any(|s| s == store))
    }
}

fn main() {
    let mut time = Duration::from_secs(2);
    let mut only = Only(None);
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--seconds" => {
                let seconds: f64 = args
                    .next()
                    .and_then(|s| s.parse().ok())
                    .expect("--seconds takes a number");
                time = Duration::from_secs_f64(seconds);
            }
            "--only" => {
                let stores = args
                    .next()
                    .expect("--only takes stores: memory,sled,postgres,redis");
                only = Only(Some(stores.split(',').map(str::to_owned).collect()));
            }
            other => panic!("unknown argument {other}; expected --seconds N, --only STORES"),
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(measure(time, only));
}

async fn measure(time: Duration, only: Only) {
    let started = Instant::now();
    let mut table = Vec::new();
    if only.has("memory") {
        memory(&mut table, time).await;
    }
    if only.has("sled") {
        sled(&mut table, time).await;
    }
    #[cfg(feature = "postgres")]
    if only.has("postgres") {
        match std::env::var("IDEM_POSTGRES_URL") {
            Ok(url) => postgres(&mut table, time, &url).await,
            Err(_) => eprintln!("IDEM_POSTGRES_URL is not set: no Postgres rows"),
        }
    }
    #[cfg(feature = "redis")]
    if only.has("redis") {
        match std::env::var("IDEM_REDIS_URL") {
            Ok(url) => redis(&mut table, time, &url).await,
            Err(_) => eprintln!("IDEM_REDIS_URL is not set: no Redis rows"),
        }
    }
    println!(
        "calls per second, median and 99th percentile latency, {} s a cell, tokio with 2 workers\n",
        time.as_secs_f64()
    );
    print(&table);
    println!("\n(whole run: {:.1} s)", started.elapsed().as_secs_f64());
}

/// The memory store, and a map behind a mutex.
async fn memory(table: &mut Vec<Row>, time: Duration) {
    let memory = MemoryStore::new();
    let map = Arc::new(Mutex::new(HashMap::<[u8; 64], Vec<u8>>::new()));
    let floor = move |hit, n| {
        let map = Arc::clone(&map);
        async move {
            let key = floor_key(&email(n, BODY));
            let found = map.lock().unwrap().get(&key).cloned();
            match found {
                Some(bytes) if hit => {
                    let id: MessageId = serde_json::from_slice(&bytes).unwrap();
                    std::hint::black_box(id);
                }
                _ => {
                    map.lock().unwrap().insert(key, vec![0; 78]);
                    let bytes = serde_json::to_vec(&message_id()).unwrap();
                    map.lock().unwrap().insert(key, bytes);
                }
            }
        }
    };
    let run = |id: &str| Run::new(id).with_store(memory.clone());
    rows(table, "memory", run, time, floor).await;
}

/// The sled store, and a sled database of its own.
async fn sled(table: &mut Vec<Row>, time: Duration) {
    let dir = tempfile::tempdir().unwrap();
    let store = SledStore::open(dir.path().join("idem")).unwrap();
    let raw = sled::open(dir.path().join("floor")).unwrap();
    let floor = move |hit, n| {
        let raw = raw.clone();
        async move {
            let key = floor_key(&email(n, BODY));
            match raw.get(key).unwrap() {
                Some(bytes) if hit => {
                    let id: MessageId = serde_json::from_slice(&bytes).unwrap();
                    std::hint::black_box(id);
                }
                _ => {
                    let flush = || {
                        let raw = raw.clone();
                        tokio::task::spawn_blocking(move || raw.flush().unwrap())
                    };
                    raw.insert(key, &[0u8; 78][..]).unwrap();
                    flush().await.unwrap();
                    let bytes = serde_json::to_vec(&message_id()).unwrap();
                    raw.insert(key, bytes).unwrap();
                    flush().await.unwrap();
                }
            }
        }
    };
    let run = |id: &str| Run::new(id).with_store(store.clone());
    rows(table, "sled", run, time, floor).await;
}

/// The Postgres store with a table of its own, and the floor's table on its pool.
#[cfg(feature = "postgres")]
async fn postgres(table: &mut Vec<Row>, time: Duration, url: &str) {
    let table_name = format!("idem_throughput_{}", std::process::id());
    let (run, floor) = scenario::postgres_run(url, &table_name).await;
    let store = run.store().unwrap();
    let floor = Arc::new(floor);
    let floor_of_rows = Arc::clone(&floor);
    let floor_call = move |hit, n: u64| {
        let floor = Arc::clone(&floor_of_rows);
        async move {
            // A hit's first call writes the row it reads from then on.
            if hit && floor.query_found(n as i64).await {
                return;
            }
            floor.two_commits(n as i64).await;
        }
    };
    let run = |id: &str| Run::new(id).with_shared_store(Arc::clone(&store));
    rows(table, "postgres", run, time, floor_call).await;
    floor.drop_tables(&table_name).await;
}

/// The Redis store under a prefix of its own, and the floor on a connection of its own.
#[cfg(feature = "redis")]
async fn redis(table: &mut Vec<Row>, time: Duration, url: &str) {
    let prefix = format!("idem-throughput-{}:", std::process::id());
    let store = scenario::redis_run(url, &prefix, false)
        .await
        .store()
        .unwrap();
    let floor = Arc::new(scenario::RedisFloor::connect(url).await);
    let (floor_of_rows, floor_prefix) = (Arc::clone(&floor), prefix.clone());
    let floor_call = move |hit, n| {
        let (floor, prefix) = (Arc::clone(&floor_of_rows), floor_prefix.clone());
        async move {
            if hit {
                floor.round_trip().await;
            } else {
                floor.fenced_miss(&prefix, n).await;
            }
        }
    };
    let run = |id: &str| Run::new(id).with_shared_store(Arc::clone(&store));
    rows(table, "redis", run, time, floor_call).await;
    floor.clean(&prefix).await;
}
