//! The throughput table: idempotent calls from 1, 8 and 64 concurrent tasks for a fixed
//! time, on every store, next to a hand-written floor doing the same store work.
//!
//! ```text
//! cargo run --release --example throughput                  # memory and sled
//! IDEM_REDIS_URL=redis://127.0.0.1:6379 IDEM_POSTGRES_URL=postgres://root@127.0.0.1/test \
//!     cargo run --release --features postgres,redis --example throughput
//! cargo run --release --features sqlite --example throughput -- --only sqlite
//! cargo run --release --example throughput -- --seconds 5   # longer cells
//! cargo run --release --example throughput -- --rounds 5    # each pair 5 times
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
//! - SQLite (feature `sqlite`): the key, then a `SELECT` by key on an idle reading
//!   connection and a decode for a hit; two write transactions (an `INSERT`, then an
//!   `UPDATE` writing the encoded result) through one writing connection behind an async
//!   lock, as the store writes, on a file of its own with the store's settings (WAL,
//!   `synchronous = NORMAL`), for a miss. Its last row runs the 64 tasks of misses in 4
//!   processes of 16 tasks each, on one file (this program started 4 times over);
//! - Postgres: the key, one `SELECT` by primary key (a `text` key, as idem's) and a
//!   decode for a hit; the key, two commits (an `INSERT`, then an `UPDATE` writing the
//!   encoded result) for a miss;
//! - Redis: the key, one `GET` and a decode for a hit; the key, a claim (`SET NX GET`)
//!   and the encoded result written by a fenced script for a miss.
//!
//! Every floor derives the key and decodes or encodes the result, as a caller doing
//! this by hand must; only the store's work differs. Each cell also gives the CPU time
//! per call of this process and of the server's processes, where they run on this
//! machine (read from Linux's `/proc`).
//!
//! The input is the bench example's 513-byte email and the result its 114-byte message
//! id. It prints calls per second, the median and the 99th percentile latency, and
//! idem's throughput over the floor's, each pair measured one after the other. On a
//! machine whose speed wanders (a shared host), one pair's ratio can move by a third
//! from one run to the next: `--rounds N` measures each pair N times, idem and the
//! floor taking turns to go first, and shows the round whose ratio is the median,
//! with the range of all N.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem::{MemoryStore, Run, SledStore};
use idem_testkit::scenario::{email, floor_key, message_id, send_email, MessageId, BODY};

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
    /// CPU time per call of this process and of the server's processes, where known.
    cpu: Option<(Duration, Duration)>,
}

/// How each cell is measured: for `time`, `rounds` times over, idem's and its floor's
/// runs alternating which goes first.
#[derive(Clone, Copy)]
struct Cells {
    time: Duration,
    rounds: usize,
}

/// The CPU time (in nanoseconds) spent so far by this process (its `/proc/self/stat`,
/// in ticks of 10 ms, threads that ended included) and by the processes named `server`
/// on this machine (each thread's `schedstat`, in nanoseconds), or `None` where Linux's
/// `/proc` cannot be read. A server on another machine counts as zero.
fn cpu_time(server: Option<&str>) -> Option<(u64, u64)> {
    // utime and stime, the 14th and 15th fields, counted after the command's `)`.
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // Linux reports these in USER_HZ, which is 100 on every architecture it runs on.
    let client = ticks * 10_000_000;
    let mut server_ns = 0;
    if let Some(name) = server {
        for process in std::fs::read_dir("/proc").ok()?.flatten() {
            let comm = std::fs::read_to_string(process.path().join("comm")).unwrap_or_default();
            if comm.trim_end() != name {
                continue;
            }
            for task in std::fs::read_dir(process.path().join("task"))
                .into_iter()
                .flatten()
            {
                let Ok(task) = task else { continue };
                let stat = std::fs::read_to_string(task.path().join("schedstat"));
                // A thread that ended in between is no longer counted, whatever it spent.
                if let Some(ns) = stat
                    .ok()
                    .and_then(|s| s.split(' ').next()?.parse::<u64>().ok())
                {
                    server_ns += ns;
                }
            }
        }
    }
    Some((client, server_ns))
}

/// Runs `op(task)` in a loop from `tasks` tasks for `time`, after one untimed call from
/// each (which fills a hit's record); each call is timed.
async fn drive<F, Fut>(tasks: usize, time: Duration, server: Option<&str>, op: F) -> Measured
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
    let cpu_before = cpu_time(server);
    let started = Instant::now();
    *deadline.lock().unwrap() = Some(started + time);
    ready.wait().await;
    let mut latencies = Vec::new();
    for handle in handles {
        latencies.extend(handle.await.unwrap());
    }
    let elapsed = started.elapsed();
    let cpu_after = cpu_time(server);
    let calls = latencies.len() as u64;
    let cpu = cpu_before.zip(cpu_after).map(|((c0, s0), (c1, s1))| {
        let per_call = |ns: u64| Duration::from_nanos(ns / calls.max(1));
        (
            per_call(c1.saturating_sub(c0)),
            per_call(s1.saturating_sub(s0)),
        )
    });
    latencies.sort_unstable();
    let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q) as usize];
    Measured {
        per_second: latencies.len() as f64 / elapsed.as_secs_f64(),
        p50: at(0.5),
        p99: at(0.99),
        cpu,
    }
}

/// One row: idem's cell and its floor's, from the round whose ratio is the median, and
/// the ratio of every round.
struct Row {
    store: &'static str,
    kind: &'static str,
    tasks: usize,
    idem: Measured,
    floor: Measured,
    ratios: Vec<f64>,
}

impl Row {
    /// The row of `rounds` pairs (idem's cell, its floor's): the median round's.
    fn of(
        store: &'static str,
        kind: &'static str,
        tasks: usize,
        rounds: Vec<(Measured, Measured)>,
    ) -> Row {
        let ratio = |(idem, floor): &(Measured, Measured)| idem.per_second / floor.per_second;
        let mut rounds: Vec<_> = rounds.into_iter().map(|r| (ratio(&r), r)).collect();
        rounds.sort_unstable_by(|a, b| a.0.total_cmp(&b.0));
        let ratios = rounds.iter().map(|(ratio, _)| *ratio).collect();
        let (_, (idem, floor)) = rounds.swap_remove(rounds.len() / 2);
        Row {
            store,
            kind,
            tasks,
            idem,
            floor,
            ratios,
        }
    }
}

fn print(rows: &[Row]) {
    let rounds = rows.iter().map(|row| row.ratios.len()).max().unwrap_or(1);
    println!(
        "{:<9} {:<5} {:>5} | {:>8} {:>8} {:>8} {:>11} | {:>8} {:>8} {:>8} {:>11} | {:>6}{}",
        "store",
        "call",
        "tasks",
        "idem /s",
        "p50",
        "p99",
        "CPU c+s",
        "floor /s",
        "p50",
        "p99",
        "CPU c+s",
        "ratio",
        if rounds > 1 { "  of rounds" } else { "" },
    );
    let us = |d: Duration| format!("{:.0} µs", d.as_secs_f64() * 1e6);
    let cpu = |m: &Measured| match m.cpu {
        Some((client, server)) => format!(
            "{:.1}+{:.1}",
            client.as_secs_f64() * 1e6,
            server.as_secs_f64() * 1e6
        ),
        None => "-".to_owned(),
    };
    for row in rows {
        let range = match row.ratios.as_slice() {
            [] | [_] => String::new(),
            [low, .., high] => format!("  {low:.2}–{high:.2}x"),
        };
        println!(
            "{:<9} {:<5} {:>5} | {:>8.0} {:>8} {:>8} {:>11} | {:>8.0} {:>8} {:>8} {:>11} | {:>5.2}x{range}",
            row.store,
            row.kind,
            row.tasks,
            row.idem.per_second,
            us(row.idem.p50),
            us(row.idem.p99),
            cpu(&row.idem),
            row.floor.per_second,
            us(row.floor.p50),
            us(row.floor.p99),
            cpu(&row.floor),
            // The median round's own ratio.
            row.idem.per_second / row.floor.per_second,
        );
    }
}

/// The idem cells of `store` (hit and miss, every concurrency), each beside its
/// floor's, whose calls `floor(hit, n)` makes; each pair `cells.rounds` times.
async fn rows<F, Fut>(
    rows: &mut Vec<Row>,
    store: &'static str,
    server: Option<&'static str>,
    make_run: impl Fn(&str) -> Run,
    cells: Cells,
    floor: F,
) where
    F: Fn(bool, u64) -> Fut + Send + Sync + Clone + 'static,
    Fut: Future<Output = ()> + Send,
{
    for (kind, hit) in [("hit", true), ("miss", false)] {
        for tasks in TASKS {
            let run = make_run(&format!("throughput-{store}-{kind}-{tasks}"));
            let idem = || {
                eprintln!("{store}: {kind}, {tasks} tasks");
                let run = run.clone();
                drive(tasks, cells.time, server, move |task| {
                    let run = run.clone();
                    async move {
                        let n = if hit { HITS + task } else { next() };
                        send_email(&run, &email(n, BODY)).await.unwrap();
                    }
                })
            };
            let floor = || {
                eprintln!("{store}: {kind}, {tasks} tasks, the floor");
                let floor = floor.clone();
                drive(tasks, cells.time, server, move |task| {
                    let n = if hit { HITS + task } else { next() };
                    floor(hit, n)
                })
            };
            let mut pairs = Vec::new();
            for round in 0..cells.rounds {
                // Every other round the floor goes first: a machine that speeds up or
                // slows down over a pair then favours neither side.
                pairs.push(match round % 2 {
                    0 => (idem().await, floor().await),
                    _ => {
                        let floor = floor().await;
                        (idem().await, floor)
                    }
                });
            }
            rows.push(Row::of(store, kind, tasks, pairs));
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
    #[cfg(feature = "sqlite")]
    sqlite::child_if_asked();
    let mut cells = Cells {
        time: Duration::from_secs(2),
        rounds: 1,
    };
    let mut only = Only(None);
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--seconds" => {
                let seconds: f64 = args
                    .next()
                    .and_then(|s| s.parse().ok())
                    .expect("--seconds takes a number");
                cells.time = Duration::from_secs_f64(seconds);
            }
            "--rounds" => {
                cells.rounds = args
                    .next()
                    .and_then(|s| s.parse().ok())
                    .filter(|&rounds| rounds > 0)
                    .expect("--rounds takes a count of at least 1");
            }
            "--only" => {
                let stores = args
                    .next()
                    .expect("--only takes stores: memory,sled,sqlite,postgres,redis");
                only = Only(Some(stores.split(',').map(str::to_owned).collect()));
            }
            other => {
                panic!("unknown argument {other}; expected --seconds N, --rounds N, --only STORES")
            }
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(measure(cells, only));
}

async fn measure(cells: Cells, only: Only) {
    let started = Instant::now();
    let mut table = Vec::new();
    if only.has("memory") {
        memory(&mut table, cells).await;
    }
    if only.has("sled") {
        sled(&mut table, cells).await;
    }
    #[cfg(feature = "sqlite")]
    if only.has("sqlite") {
        sqlite::rows(&mut table, cells).await;
    }
    #[cfg(feature = "postgres")]
    if only.has("postgres") {
        match std::env::var("IDEM_POSTGRES_URL") {
            Ok(url) => postgres(&mut table, cells, &url).await,
            Err(_) => eprintln!("IDEM_POSTGRES_URL is not set: no Postgres rows"),
        }
    }
    #[cfg(feature = "redis")]
    if only.has("redis") {
        match std::env::var("IDEM_REDIS_URL") {
            Ok(url) => redis(&mut table, cells, &url).await,
            Err(_) => eprintln!("IDEM_REDIS_URL is not set: no Redis rows"),
        }
    }
    let rounds = match cells.rounds {
        1 => String::new(),
        n => format!(
            "; each pair {n} times, idem and the floor taking turns to go first, the median \
             round shown (its ratio the median) beside the range of the rounds' ratios"
        ),
    };
    println!(
        "calls per second, median and 99th percentile latency, {} s a cell, tokio with 2 workers{rounds}\n",
        cells.time.as_secs_f64()
    );
    print(&table);
    println!("\n(whole run: {:.1} s)", started.elapsed().as_secs_f64());
}

/// The memory store, and a map behind a mutex.
async fn memory(table: &mut Vec<Row>, cells: Cells) {
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
    rows(table, "memory", None, run, cells, floor).await;
}

/// The sled store, and a sled database of its own.
async fn sled(table: &mut Vec<Row>, cells: Cells) {
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
    rows(table, "sled", None, run, cells, floor).await;
}

/// The Postgres store with a table of its own, and the floor's table on its pool.
#[cfg(feature = "postgres")]
async fn postgres(table: &mut Vec<Row>, cells: Cells, url: &str) {
    let table_name = format!("idem_throughput_{}", std::process::id());
    let (run, floor) = idem_testkit::scenario::postgres_run(url, &table_name).await;
    let store = run.store().unwrap();
    let floor = Arc::new(floor);
    let floor_of_rows = Arc::clone(&floor);
    let floor_call = move |hit, n: u64| {
        let floor = Arc::clone(&floor_of_rows);
        async move {
            let input = email(n, BODY);
            // A hit's first call writes the row it reads from then on.
            if hit && floor.keyed_hit(&input).await {
                return;
            }
            floor.keyed_miss(&input).await;
        }
    };
    let run = |id: &str| Run::new(id).with_shared_store(Arc::clone(&store));
    rows(table, "postgres", Some("postgres"), run, cells, floor_call).await;
    floor.drop_tables(&table_name).await;
}

/// The Redis store under a prefix of its own, and the floor on a connection of its own.
#[cfg(feature = "redis")]
async fn redis(table: &mut Vec<Row>, cells: Cells, url: &str) {
    let prefix = format!("idem-throughput-{}:", std::process::id());
    let store = idem_testkit::scenario::redis_run(url, &prefix, false)
        .await
        .store()
        .unwrap();
    let floor = Arc::new(idem_testkit::scenario::RedisFloor::connect(url).await);
    let (floor_of_rows, floor_prefix) = (Arc::clone(&floor), prefix.clone());
    let floor_call = move |hit, n| {
        let (floor, prefix) = (Arc::clone(&floor_of_rows), floor_prefix.clone());
        async move {
            let input = email(n, BODY);
            if hit && floor.keyed_hit(&prefix, &input).await {
                return;
            }
            floor.keyed_miss(&prefix, &input).await;
        }
    };
    let run = |id: &str| Run::new(id).with_shared_store(Arc::clone(&store));
    rows(table, "redis", Some("redis-server"), run, cells, floor_call).await;
    floor.clean(&prefix).await;
}

/// The SQLite store, and a hand-written check on a file of its own.
#[cfg(feature = "sqlite")]
mod sqlite {
    use std::path::{Path, PathBuf};

    use super::*;

    /// What a child process runs: `<store file> <idem|floor> <seconds> <tasks>`.
    const CHILD: &str = "IDEM_THROUGHPUT_SQLITE_CHILD";
    const PROCESSES: usize = 4;

    /// The floor: a writing connection behind an async lock, and idle reading ones.
    struct Floor {
        writer: tokio::sync::Mutex<rusqlite::Connection>,
        readers: Mutex<Vec<rusqlite::Connection>>,
        path: PathBuf,
    }

    fn connect(path: &Path) -> rusqlite::Connection {
        let conn = rusqlite::Connection::open(path).unwrap();
        conn.busy_timeout(Duration::from_secs(5)).unwrap();
        conn.execute_batch(
            "PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL; \
             CREATE TABLE IF NOT EXISTS floor (key TEXT PRIMARY KEY NOT NULL, value);",
        )
        .unwrap();
        conn
    }

    impl Floor {
        fn open(path: &Path) -> Arc<Self> {
            Arc::new(Floor {
                writer: tokio::sync::Mutex::new(connect(path)),
                readers: Mutex::new(Vec::new()),
                path: path.to_owned(),
            })
        }

        async fn call(&self, hit: bool, n: u64) {
            let key = idem_testkit::scenario::keyed(&email(n, BODY));
            let reader = self.readers.lock().unwrap().pop();
            let reader = reader.unwrap_or_else(|| connect(&self.path));
            let found: Option<String> = reader
                .prepare_cached("SELECT value FROM floor WHERE key = ?1")
                .unwrap()
                .query_row([&key], |r| r.get(0))
                .ok();
            self.readers.lock().unwrap().push(reader);
            match found {
                Some(text) if hit => {
                    let id: MessageId = serde_json::from_str(&text).unwrap();
                    std::hint::black_box(id);
                }
                _ => {
                    let result = serde_json::to_string(&message_id()).unwrap();
                    let writer = self.writer.lock().await;
                    for (sql, value) in [
                        ("INSERT OR REPLACE INTO floor VALUES (?1, ?2)", "claim"),
                        (
                            "UPDATE floor SET value = ?2 WHERE key = ?1",
                            result.as_str(),
                        ),
                    ] {
                        let tx = writer.unchecked_transaction().unwrap();
                        tx.prepare_cached(sql)
                            .unwrap()
                            .execute([&key, value])
                            .unwrap();
                        tx.commit().unwrap();
                    }
                }
            }
        }
    }

    pub async fn rows(table: &mut Vec<Row>, cells: Cells) {
        let dir = tempfile::tempdir().unwrap();
        let store_path = dir.path().join("idem.sqlite");
        let store = idem::SqliteStore::open(&store_path).unwrap();
        let floor = Floor::open(&dir.path().join("floor.sqlite"));
        let call = move |hit, n| {
            let floor = Arc::clone(&floor);
            async move { floor.call(hit, n).await }
        };
        let run = |id: &str| Run::new(id).with_store(store.clone());
        super::rows(table, "sqlite", None, run, cells, call).await;

        // 64 tasks of misses in 4 processes on one file.
        eprintln!("sqlite: miss, 64 tasks in {PROCESSES} processes, and the floor");
        let floor_path = dir.path().join("floor.sqlite");
        let idem = || processes(&store_path, "idem", cells.time);
        let floor = || processes(&floor_path, "floor", cells.time);
        let pairs = (0..cells.rounds)
            .map(|round| match round % 2 {
                // In turns, as every other pair (see `rows`).
                0 => (idem(), floor()),
                _ => {
                    let floor = floor();
                    (idem(), floor)
                }
            })
            .collect();
        table.push(Row::of("sqlite 4p", "miss", 64, pairs));
    }

    /// Runs `kind`'s misses from [`PROCESSES`] processes of 16 tasks at once; their
    /// throughputs add up, the latencies are the processes' medians and worst p99.
    fn processes(path: &Path, kind: &str, time: Duration) -> Measured {
        let children: Vec<_> = (0..PROCESSES)
            .map(|_| {
                std::process::Command::new(std::env::current_exe().unwrap())
                    .env(
                        CHILD,
                        format!("{} {kind} {} 16", path.display(), time.as_secs_f64()),
                    )
                    .stdout(std::process::Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let mut measured: Vec<(f64, f64, f64)> = Vec::new();
        for child in children {
            let out = child.wait_with_output().unwrap();
            assert!(out.status.success(), "a {kind} process failed");
            let text = String::from_utf8(out.stdout).unwrap();
            let v: Vec<f64> = text
                .split_whitespace()
                .map(|x| x.parse().unwrap())
                .collect();
            measured.push((v[0], v[1], v[2]));
        }
        let mut p50s: Vec<f64> = measured.iter().map(|m| m.1).collect();
        p50s.sort_by(f64::total_cmp);
        Measured {
            per_second: measured.iter().map(|m| m.0).sum(),
            p50: Duration::from_secs_f64(p50s[p50s.len() / 2]),
            p99: Duration::from_secs_f64(measured.iter().map(|m| m.2).fold(0.0, f64::max)),
            cpu: None,
        }
    }

    /// In a child process: runs its misses and prints `<calls/s> <p50 s> <p99 s>`.
    pub fn child_if_asked() {
        let Ok(config) = std::env::var(CHILD) else {
            return;
        };
        let parts: Vec<&str> = config.split(' ').collect();
        let [path, kind, seconds, tasks] = parts[..] else {
            panic!("{CHILD}: <file> <idem|floor> <seconds> <tasks>");
        };
        let path = PathBuf::from(path);
        let time = Duration::from_secs_f64(seconds.parse().unwrap());
        let tasks: usize = tasks.parse().unwrap();
        // Keys of this process only.
        NEXT.store(u64::from(std::process::id()) << 32, Ordering::Relaxed);
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let measured = runtime.block_on(async move {
            match kind {
                "idem" => {
                    let store = idem::SqliteStore::open(&path).unwrap();
                    let run = Run::new("throughput-sqlite-processes").with_store(store);
                    drive(tasks, time, None, move |_| {
                        let run = run.clone();
                        async move {
                            send_email(&run, &email(next(), BODY)).await.unwrap();
                        }
                    })
                    .await
                }
                _ => {
                    let floor = Floor::open(&path);
                    drive(tasks, time, None, move |_| {
                        let floor = Arc::clone(&floor);
                        async move { floor.call(false, next()).await }
                    })
                    .await
                }
            }
        });
        println!(
            "{} {} {}",
            measured.per_second,
            measured.p50.as_secs_f64(),
            measured.p99.as_secs_f64()
        );
        std::process::exit(0);
    }
}
