//! The overhead table: what an idempotent call costs next to calling the tool directly,
//! next to the floor of what any implementation must do, and next to the `cached`
//! crate's disk cache.
//!
//! ```text
//! cargo run --release --example bench
//! IDEM_REDIS_URL=redis://127.0.0.1:6379 IDEM_POSTGRES_URL=postgres://root@127.0.0.1/test \
//!     cargo run --release --features postgres,redis --example bench
//! cargo run --release --features metrics --example bench   # + the cost of observing
//! cargo run --release --example bench -- --rounds 5         # each pair five times
//! ```
//!
//! Every figure is measured in this one run, and each compared pair side by side, so
//! the ratios compare like with like on a noisy machine. A local figure is the median
//! of 15 batches (the batches of a pair alternate); a network figure is the median of
//! single operations (a pair's operations alternate one by one). The input is a
//! 513-byte email and the result a 114-byte message id, as JSON. Takes under a minute
//! (most of it filling two sled trees with 10⁶ records).
//!
//! One pair's ratio moves from run to run as much as the machine does. With
//! `--rounds N` each pair is measured N times, idem and its floor taking turns to go
//! first, and its row shows the round whose ratio is the median beside the range of
//! the N ratios.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idem::{MemoryStore, Run, SledStore};
use idem_testkit::scenario::{
    self, email, floor_key, message_id, send, send_email, send_email_owned, MessageId, BODY,
};

const BATCHES: usize = 15;

/// Median time per operation over `BATCHES` batches of `n` calls of `op`.
fn median(n: usize, mut op: impl FnMut(u64)) -> Duration {
    let mut i = 0u64;
    middle(
        (0..BATCHES)
            .map(|_| {
                let t = Instant::now();
                for _ in 0..n {
                    i += 1;
                    op(i);
                }
                t.elapsed() / n as u32
            })
            .collect(),
    )
}

/// Medians of `a` and of `b` (what `a` is compared with), measured side by side:
/// `BATCHES` times a batch of `a`, then a batch of `b`. A machine that speeds
/// up or slows down during the run moves both alike, so their ratio holds. The local
/// rows use it (their operations take microseconds, too short to time one by one);
/// the network rows use `network::paired`. Measured [`rounds`] times, `b` going first
/// in every other round.
async fn compare<F: Future, G: Future>(
    n: usize,
    mut a: impl FnMut(u64) -> F,
    mut b: impl FnMut(u64) -> G,
) -> Pair {
    let (mut i, mut j) = (0u64, 0u64);
    let mut measured = Vec::new();
    for round in 0..rounds() {
        let (mut ta, mut tb) = (Vec::new(), Vec::new());
        for _ in 0..BATCHES {
            if round % 2 == 0 {
                ta.push(batch(n, &mut i, &mut a).await);
                tb.push(batch(n, &mut j, &mut b).await);
            } else {
                tb.push(batch(n, &mut j, &mut b).await);
                ta.push(batch(n, &mut i, &mut a).await);
            }
        }
        measured.push((middle(ta), middle(tb)));
    }
    Pair::of(measured)
}

/// How many times each compared pair is measured: `--rounds N`, 1 by default.
static ROUNDS: AtomicUsize = AtomicUsize::new(1);

fn rounds() -> usize {
    ROUNDS.load(Ordering::Relaxed)
}

/// A compared pair: `a` and `b` (what `a` is compared with) as measured in the round
/// whose ratio `a / b` is the median of all rounds' (the upper middle of an even
/// count), and every round's ratio, sorted.
struct Pair {
    a: Duration,
    b: Duration,
    ratios: Vec<f64>,
}

impl Pair {
    /// The pair from its rounds' `(a, b)`.
    fn of(mut rounds: Vec<(Duration, Duration)>) -> Pair {
        let ratio = |(a, b): &(Duration, Duration)| a.as_secs_f64() / b.as_secs_f64();
        rounds.sort_by(|x, y| ratio(x).total_cmp(&ratio(y)));
        let (a, b) = rounds[rounds.len() / 2];
        Pair {
            a,
            b,
            ratios: rounds.iter().map(ratio).collect(),
        }
    }
}

/// Time per call of `calls` misses made by `tasks` concurrent tasks, each on a new
/// email numbered from `from` (apart for each concurrency).
async fn concurrent_misses(run: &Run, tasks: u64, calls: u64, from: u64) -> Duration {
    let per_task = calls / tasks;
    let started = Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|w| {
            let run = run.clone();
            tokio::spawn(async move {
                for i in 0..per_task {
                    send_email(&run, &email(from * (tasks + 1) + w * 1000 + i, BODY))
                        .await
                        .unwrap();
                }
            })
        })
        .collect();
    for h in handles {
        h.await.unwrap();
    }
    started.elapsed() / (tasks * per_task) as u32
}

/// A miss's two store operations on `store`, as a call makes them for a new key
/// `i`: the claim (a record with its origin), then the completion with a result of the
/// bench's size. What the store costs a miss, without the call around it.
async fn store_miss(store: &SledStore, i: u64) {
    use idem::store::{ClaimRequest, Fingerprint, Key, Origin, Outcome, Store, Token};
    let key = Key::from_text(format!("send_email.{i:064}"));
    let request = ClaimRequest {
        origin: Origin::new("bench-sled-store", "send_email"),
        fingerprint: Fingerprint::from_bytes([7; 32]),
        token: Token::from_bits(u128::from(i)),
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(86_400),
        take_over_expired: true,
        retry_failed: false,
    };
    let claim = store.claim(&key, &request).await.unwrap();
    assert!(
        matches!(claim, idem::store::Claim::Acquired { .. }),
        "{claim:?}"
    );
    let result = serde_json::to_vec(&message_id()).unwrap();
    let ttl = request.ttl;
    let done = store.complete(&key, request.token, Outcome::Completed(&result), ttl);
    std::hint::black_box(done.await.unwrap());
}

/// Time per call of `n` calls of `op`, numbered on from `i`.
async fn batch<F: Future>(n: usize, i: &mut u64, op: &mut impl FnMut(u64) -> F) -> Duration {
    let t = Instant::now();
    for _ in 0..n {
        *i += 1;
        op(*i).await;
    }
    t.elapsed() / n as u32
}

fn middle(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

/// A row: what, its median, what it is compared with, and the range of the ratios
/// of the rounds that measured the pair (with `--rounds` over 1).
struct Row {
    what: String,
    value: Duration,
    floor: Option<(String, Duration)>,
    range: Option<(f64, f64)>,
}

struct Table(Vec<Row>);

impl Table {
    fn row(&mut self, what: &str, value: Duration, floor: Option<(&str, Duration)>) {
        self.0.push(Row {
            what: what.into(),
            value,
            floor: floor.map(|(w, d)| (w.into(), d)),
            range: None,
        });
    }

    /// A compared pair's row: its median round, and the range of its rounds' ratios.
    fn pair(&mut self, what: &str, pair: &Pair, compared_with: &str) {
        self.0.push(Row {
            what: what.into(),
            value: pair.a,
            floor: Some((compared_with.into(), pair.b)),
            range: match pair.ratios.as_slice() {
                [first, .., last] => Some((*first, *last)),
                _ => None,
            },
        });
    }

    fn print(&self) {
        println!(
            "{:<46} {:>10}   {:<34} {:>10} {:>7}",
            "operation", "median", "compared with", "median", "ratio"
        );
        for row in &self.0 {
            let what = &row.what;
            match &row.floor {
                Some((f, d)) => {
                    let range = match row.range {
                        Some((low, high)) => format!("   {low:.2}-{high:.2}x"),
                        None => String::new(),
                    };
                    println!(
                        "{what:<46} {:>10}   {f:<34} {:>10} {:>6.2}x{range}",
                        fmt(row.value),
                        fmt(*d),
                        row.value.as_secs_f64() / d.as_secs_f64()
                    )
                }
                None => println!("{what:<46} {:>10}", fmt(row.value)),
            }
        }
    }
}

fn fmt(d: Duration) -> String {
    let ns = d.as_nanos() as f64;
    if ns < 10_000.0 {
        format!("{:.2} µs", ns / 1e3)
    } else if ns < 10_000_000.0 {
        format!("{:.1} µs", ns / 1e3)
    } else {
        format!("{:.2} ms", ns / 1e6)
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--rounds" => ROUNDS.store(
                args.next()
                    .and_then(|s| s.parse().ok())
                    .filter(|&rounds| rounds > 0)
                    .expect("--rounds takes a count of at least 1"),
                Ordering::Relaxed,
            ),
            other => panic!("unknown argument {other}; expected --rounds N"),
        }
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let started = Instant::now();
    let input = email(0, BODY);
    println!(
        "input {} bytes, result {} bytes (JSON); medians of {BATCHES} batches (local), \
         of single operations (network)",
        serde_json::to_vec(&input).unwrap().len(),
        serde_json::to_vec(&message_id()).unwrap().len()
    );
    match rounds() {
        1 => println!(),
        rounds => println!(
            "each pair measured {rounds} times, taking turns to go first: the round whose \
             ratio is the median, and the range of the rounds' ratios\n"
        ),
    }
    let mut t = Table(Vec::new());
    let n = 20_000;

    let direct = median(n, |_| {
        std::hint::black_box(send(std::hint::black_box(&input)));
    });
    t.row("direct call of the tool body", direct, None);
    let run = Run::new("bench").with_store(MemoryStore::new());
    // The key of a call as the attribute derives it, through the public API: the
    // dynamic tool prepares the call (options, run) and derives its key.
    let tool = idem::Tool::new("send_email");
    let derive = rt.block_on(compare(
        n,
        |_| async {
            std::hint::black_box(tool.key_of(&run, &input).unwrap());
        },
        |_| async {
            std::hint::black_box(floor_key(&input));
        },
    ));
    t.pair(
        "key derivation (canonical JSON, SHA-256, key)",
        &derive,
        "JSON streamed to SHA-256, hex",
    );
    // The digest alone: the key parts and the input's canonical JSON, hashed in one
    // pass. What key derivation adds to it is the key's text and the call itself.
    let parts = idem::store::KeyParts {
        tenant: None,
        run_id: "bench",
        call_id: None,
        tool: "send_email",
    };
    let alone = rt.block_on(compare(
        n,
        |_| async {
            std::hint::black_box(idem::store::Fingerprint::of(&parts, &[&input]).unwrap());
        },
        |_| async {
            std::hint::black_box(floor_key(&input));
        },
    ));
    t.pair(
        "fingerprint (parts + canonical JSON, SHA-256)",
        &alone,
        "JSON streamed to SHA-256, hex",
    );
    for (label, size) in [("100 B", 100), ("10 KiB", 10 << 10), ("1 MiB", 1 << 20)] {
        let blob = "x".repeat(size);
        let m = (2_000_000 / size).clamp(5, 20_000);
        let d = median(m, |_| {
            std::hint::black_box(idem::store::Fingerprint::of(&parts, &blob).unwrap());
        });
        t.row(&format!("fingerprint of a {label} input"), d, None);
    }

    rt.block_on(async {
        // Memory.
        let run = Run::new("bench-mem").with_store(MemoryStore::new());
        send_email(&run, &input).await.unwrap();
        let mut map: HashMap<[u8; 64], Vec<u8>> = HashMap::new();
        map.insert(
            floor_key(&input),
            serde_json::to_vec(&message_id()).unwrap(),
        );
        let hit = compare(
            n,
            |_| send_email(&run, &input),
            |_| async {
                let bytes = &map[&floor_key(&input)];
                std::hint::black_box(serde_json::from_slice::<MessageId>(bytes).unwrap());
            },
        )
        .await;
        t.pair("memory: hit", &hit, "key + map lookup + decode");

        // A miss: a new input each time (building it is in both sides of each pair).
        let claim = vec![0u8; 78];
        let result = serde_json::to_vec(&message_id()).unwrap();
        let floor_map = std::sync::Mutex::new(HashMap::<[u8; 64], Vec<u8>>::new());
        let run = &run;
        let miss = compare(
            n,
            |i| async move {
                std::hint::black_box(send_email(run, &email(i, BODY)).await.unwrap());
            },
            |i| {
                let (claim, result, floor_map) = (&claim, &result, &floor_map);
                async move {
                    let input = email(i, BODY);
                    let key = floor_key(&input);
                    floor_map.lock().unwrap().insert(key, claim.clone());
                    let value = serde_json::to_vec(&send(&input)).unwrap();
                    std::hint::black_box(&value == result);
                    floor_map.lock().unwrap().insert(key, value);
                }
            },
        )
        .await;
        t.pair("memory: miss", &miss, "key + claim write + encode + write");
        let owned = compare(
            n,
            |i| async move {
                std::hint::black_box(send_email_owned(run, email(i, BODY)).await.unwrap());
            },
            |i| async move {
                std::hint::black_box(send_email(run, &email(i, BODY)).await.unwrap());
            },
        )
        .await;
        t.pair(
            "memory: miss, input owned (finishes alone)",
            &owned,
            "input borrowed (settled if dropped)",
        );

        // With a subscriber and a recorder installed (feature `metrics`).
        #[cfg(feature = "metrics")]
        observed::rows(&mut t, n, run, &input).await;

        #[cfg(feature = "sqlite")]
        sqlite_rows(&mut t, n, &input).await;

        // Sled.
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open(dir.path().join("idem")).unwrap();
        let raw = sled::open(dir.path().join("floor")).unwrap();
        let run = Run::new("bench-sled").with_store(store.clone());
        send_email(&run, &input).await.unwrap();
        raw.insert(
            floor_key(&input),
            serde_json::to_vec(&message_id()).unwrap(),
        )
        .unwrap();
        let hit = compare(
            n,
            |_| send_email(&run, &input),
            |_| async {
                let bytes = raw.get(floor_key(&input)).unwrap().unwrap();
                std::hint::black_box(serde_json::from_slice::<MessageId>(&bytes).unwrap());
            },
        )
        .await;
        t.pair("sled: hit", &hit, "key + sled get + decode");

        use cached::IOCached;
        let disk: cached::DiskCache<String, MessageId> = cached::DiskCache::new("bench")
            .set_disk_directory(dir.path().join("cached"))
            .build()
            .unwrap();
        // What `#[io_cached(disk = true, convert = ..)]` does per call: build the key
        // from the arguments, then read the disk cache.
        disk.cache_set(format!("{input:?}"), message_id()).unwrap();
        let hit = compare(
            n,
            |_| send_email(&run, &input),
            |_| async {
                let key = format!("{input:?}");
                std::hint::black_box(disk.cache_get(&key).unwrap().unwrap());
            },
        )
        .await;
        t.pair("sled: hit", &hit, "cached 0.56 disk hit (key + get)");

        for records in [1_000u64, 100_000, 1_000_000] {
            let dir = tempfile::tempdir().unwrap();
            let probe = email(records / 2, BODY);
            // The two fills are independent: one on each core.
            let (store, raw) = std::thread::scope(|s| {
                let store = s.spawn(|| {
                    scenario::filled_store(
                        &dir.path().join("idem"),
                        records,
                        Duration::from_secs(3600),
                    )
                });
                let raw = scenario::filled_floor(&dir.path().join("floor"), records, &probe);
                (store.join().unwrap(), raw)
            });
            let run = Run::new("bench-size").with_store(store);
            let hit = compare(
                n / 4,
                |_| send_email(&run, &probe),
                |_| async {
                    let bytes = raw.get(floor_key(&probe)).unwrap().unwrap();
                    std::hint::black_box(serde_json::from_slice::<MessageId>(&bytes).unwrap());
                },
            )
            .await;
            t.pair(
                &format!("sled: hit, {records} records stored"),
                &hit,
                "key + sled get + decode, as many",
            );
        }

        let m = 40;
        let run = Run::new("bench-sled-miss").with_store(store.clone());
        let serial = compare(
            m,
            |i| {
                let run = run.clone();
                async move { send_email(&run, &email(1_000_000 + i, BODY)).await.unwrap() }
            },
            |k| {
                let raw = &raw;
                async move { scenario::sled_two_flushes(raw, k, None) }
            },
        )
        .await;
        t.pair(
            "sled: miss, durable, serial",
            &serial,
            "two sled insert + flush",
        );
        // The store's own part of that miss: its claim and its completion, called
        // directly, without the call around them (key, span, heartbeat, read-back).
        let stored = compare(
            m,
            |i| store_miss(&store, 30_000_000 + i),
            |k| {
                let raw = &raw;
                async move { scenario::sled_two_flushes(raw, 1 << 40 | k, None) }
            },
        )
        .await;
        t.pair(
            "sled: the miss's claim + completion alone",
            &stored,
            "two sled insert + flush",
        );
        for tasks in [8u64, 64] {
            let per_call = concurrent_misses(&run, tasks, 640, 10_000_000).await;
            t.row(
                &format!("sled: miss, durable, {tasks} concurrent, per call"),
                per_call,
                Some(("the serial miss", serial.a)),
            );
        }

        // Sled in fsync mode: each group commit also fdatasyncs the log.
        let synced = SledStore::builder(dir.path().join("idem-fsync"))
            .fsync(true)
            .open()
            .unwrap();
        let log = std::fs::File::open(dir.path().join("floor").join("db")).unwrap();
        let run = Run::new("bench-sled-fsync").with_store(synced);
        let synced_serial = compare(
            m,
            |i| {
                let run = run.clone();
                async move { send_email(&run, &email(2_000_000 + i, BODY)).await.unwrap() }
            },
            |k| {
                let (raw, log) = (&raw, &log);
                async move { scenario::sled_two_flushes(raw, 1_000_000 + k, Some(log)) }
            },
        )
        .await;
        t.pair(
            "sled, fsync mode: miss, serial",
            &synced_serial,
            "two insert + flush + fdatasync",
        );
        t.row(
            "sled, fsync mode: miss vs. default mode",
            synced_serial.a,
            Some(("default-mode serial miss", serial.a)),
        );
        let tasks = 64u64;
        let started = Instant::now();
        let handles: Vec<_> = (0..tasks)
            .map(|w| {
                let run = run.clone();
                tokio::spawn(async move {
                    for i in 0..10 {
                        send_email(&run, &email(90_000_000 + w * 1000 + i, BODY))
                            .await
                            .unwrap();
                    }
                })
            })
            .collect();
        for h in handles {
            h.await.unwrap();
        }
        t.row(
            "sled, fsync mode: miss, 64 concurrent, per call",
            started.elapsed() / (tasks * 10) as u32,
            Some(("its serial miss", synced_serial.a)),
        );
    });

    // Network stores on a current-thread runtime, as a single agent worker would run
    // them: a round trip then costs the network and the server, not a wake-up of
    // another thread. The floors are measured on the same runtime.
    #[cfg(any(feature = "redis", feature = "postgres"))]
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            #[cfg(feature = "redis")]
            if let Ok(url) = std::env::var("IDEM_REDIS_URL") {
                network::redis(&url, &input, &mut t).await;
            }
            #[cfg(feature = "postgres")]
            if let Ok(url) = std::env::var("IDEM_POSTGRES_URL") {
                network::postgres(&url, &input, &mut t).await;
            }
        });

    t.print();
    println!("\n(whole run: {:.1} s)", started.elapsed().as_secs_f64());
}

/// What a call costs with its span exported to OpenTelemetry and its metrics
/// recorded, next to the same call with nothing installed.
#[cfg(feature = "metrics")]
mod observed {
    use super::*;
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
    use tracing_subscriber::layer::SubscriberExt;

    /// A production-like setup, installed for one batch at a time (for this thread):
    /// `tracing-opentelemetry` at `info` exporting every span (to memory, emptied after
    /// each batch), and a Prometheus recorder.
    struct Installed {
        dispatch: tracing::Dispatch,
        recorder: metrics_exporter_prometheus::PrometheusRecorder,
        exporter: InMemorySpanExporter,
        _provider: SdkTracerProvider,
    }

    impl Installed {
        fn new() -> Self {
            let exporter = InMemorySpanExporter::default();
            let provider = SdkTracerProvider::builder()
                .with_simple_exporter(exporter.clone())
                .build();
            let subscriber = tracing_subscriber::registry()
                .with(tracing_subscriber::filter::LevelFilter::INFO)
                .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("bench")));
            Installed {
                dispatch: tracing::Dispatch::new(subscriber),
                recorder: metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder(),
                exporter,
                _provider: provider,
            }
        }
    }

    /// Medians of `op` with [`Installed`] and without, batches alternating, measured
    /// [`rounds`] times.
    async fn compare_installed<F: Future>(
        n: usize,
        installed: &Installed,
        mut op: impl FnMut(u64) -> F,
    ) -> Pair {
        let mut i = 0u64;
        let mut measured = Vec::new();
        for round in 0..rounds() {
            let (mut with, mut without) = (Vec::new(), Vec::new());
            for _ in 0..BATCHES {
                if round % 2 == 1 {
                    without.push(batch(n, &mut i, &mut op).await);
                }
                {
                    let _tracing = tracing::dispatcher::set_default(&installed.dispatch);
                    let _metrics = metrics::set_default_local_recorder(&installed.recorder);
                    with.push(batch(n, &mut i, &mut op).await);
                }
                installed.exporter.reset();
                if round % 2 == 0 {
                    without.push(batch(n, &mut i, &mut op).await);
                }
            }
            measured.push((middle(with), middle(without)));
        }
        Pair::of(measured)
    }

    pub(super) async fn rows(t: &mut Table, n: usize, run: &Run, input: &scenario::SendEmail) {
        let installed = Installed::new();
        let with = compare_installed(n, &installed, |_| send_email(run, input)).await;
        t.pair(
            "memory: hit, span exported + metrics",
            &with,
            "memory: hit, nothing installed",
        );
        let with = compare_installed(n, &installed, |i| async move {
            std::hint::black_box(send_email(run, &email(i, BODY)).await.unwrap());
        })
        .await;
        t.pair(
            "memory: miss, span exported + metrics",
            &with,
            "memory: miss, nothing installed",
        );
    }
}

#[cfg(any(feature = "redis", feature = "postgres"))]
mod network {
    use super::*;

    /// How many pairs [`paired`] measures for operations that take about `unit` each:
    /// as many as fit two seconds, from 200 to `most`. On a day of slow round trips the
    /// rows keep their sample and the run its minute.
    async fn fitted<F: Future>(most: usize, mut unit: impl FnMut() -> F) -> usize {
        let t = Instant::now();
        for _ in 0..10 {
            unit().await;
        }
        let unit = t.elapsed() / 10;
        let n = Duration::from_secs(2).as_nanos() / (2 * unit.as_nanos()).max(1);
        usize::try_from(n).unwrap_or(most).clamp(200, most)
    }

    /// Medians of `n` single operations of `a` and `n` of `b` (what `a` is compared
    /// with), numbered from 1 (and on, round after round) and interleaved one by one:
    /// `a` then `b`, then `b` then `a`, and so on; measured [`rounds`] times.
    ///
    /// Not batches, as the local rows: a loopback round trip on a busy machine stalls
    /// now and then for a millisecond or more, and a batch's mean then counts the
    /// stalls it met more than the operation (`redis-benchmark` here once put a `GET`
    /// at 31 µs at the median and 150 µs on average). The median of single operations
    /// is the operation; stalls, which fall on either side alike, stay out of it.
    async fn paired<F: Future, G: Future>(
        n: usize,
        mut a: impl FnMut(u64) -> F,
        mut b: impl FnMut(u64) -> G,
    ) -> Pair {
        let mut measured = Vec::new();
        for round in 0..rounds() as u64 {
            let (mut ta, mut tb) = (Vec::with_capacity(n), Vec::with_capacity(n));
            for i in round * n as u64 + 1..=(round + 1) * n as u64 {
                if i % 2 == 1 {
                    ta.push(timed(a(i)).await);
                    tb.push(timed(b(i)).await);
                } else {
                    tb.push(timed(b(i)).await);
                    ta.push(timed(a(i)).await);
                }
            }
            measured.push((middle(ta), middle(tb)));
        }
        Pair::of(measured)
    }

    async fn timed<F: Future>(op: F) -> Duration {
        let t = Instant::now();
        op.await;
        t.elapsed()
    }

    #[cfg(feature = "redis")]
    pub async fn redis(url: &str, input: &scenario::SendEmail, t: &mut Table) {
        let prefix = format!("idem-bench-{}:", std::process::id());
        let run = scenario::redis_run(url, &prefix, false).await;
        let floor = scenario::RedisFloor::connect(url).await;
        send_email(&run, input).await.unwrap();
        let n = fitted(5_000, || floor.round_trip()).await;
        let hit = paired(n, |_| send_email(&run, input), |_| floor.round_trip()).await;
        t.pair("redis: hit", &hit, "one round trip (GET of 168 B)");
        // The hit's command alone: what the store's command costs over a `GET`,
        // without the call around it.
        let record = format!("{prefix}floor-record");
        floor.write(&record, 270).await;
        let command = paired(n, |_| floor.claim_command(&record), |_| floor.round_trip()).await;
        t.pair(
            "redis: the hit's command alone (SET NX GET)",
            &command,
            "one round trip (GET of 168 B)",
        );
        // The hit's store operation alone: the store's claim of the hit's key (in a
        // streak of hits, a `GET` first), without the call around it (the key, the
        // result decoded, the span).
        {
            use idem::store::{Claim, ClaimRequest, Fingerprint, KeyParts, Origin, Store, Token};
            let store = idem::RedisStore::builder(url)
                .prefix(&prefix)
                .connect()
                .await
                .unwrap();
            let key = idem::Tool::new("send_email").key_of(&run, input).unwrap();
            let parts = KeyParts {
                tenant: None,
                run_id: run.id(),
                call_id: None,
                tool: "send_email",
            };
            let request = ClaimRequest {
                origin: Origin::new("bench-redis-store", "send_email"),
                fingerprint: Fingerprint::of(&parts, &[input]).unwrap(),
                token: Token::from_bits(1),
                lease: Duration::from_secs(30),
                ttl: Duration::from_secs(86_400),
                take_over_expired: true,
                retry_failed: false,
            };
            let claim = || async {
                let claim = store.claim(&key, &request).await.unwrap();
                assert!(matches!(claim, Claim::Completed(_)), "{claim:?}");
            };
            claim().await;
            let operation = paired(n, |_| claim(), |_| floor.round_trip()).await;
            t.pair(
                "redis: the hit's store operation alone",
                &operation,
                "one round trip (GET of 168 B)",
            );
        }
        // A LocalCache keeps what its own process completed: complete through it first.
        let cached = scenario::redis_run(url, &prefix, true).await;
        let probe = email(1, BODY);
        send_email(&cached, &probe).await.unwrap();
        let local = paired(n, |_| send_email(&cached, &probe), |_| floor.round_trip()).await;
        t.pair(
            "redis + LocalCache: hit",
            &local,
            "one round trip (GET of 168 B)",
        );
        let miss = paired(
            (n / 2).max(200),
            |i| {
                let run = run.clone();
                async move { send_email(&run, &email(2_000_000 + i, BODY)).await.unwrap() }
            },
            |_| async {
                floor.round_trip().await;
                floor.round_trip().await;
            },
        )
        .await;
        t.pair("redis: miss", &miss, "two round trips (GET, GET)");
        let miss = paired(
            (n / 2).max(200),
            |i| {
                let run = run.clone();
                async move { send_email(&run, &email(4_000_000 + i, BODY)).await.unwrap() }
            },
            |i| floor.fenced_miss(&prefix, i),
        )
        .await;
        t.pair("redis: miss", &miss, "SET NX GET + fenced SET (script)");
        floor.clean(&prefix).await;
    }

    #[cfg(feature = "postgres")]
    pub async fn postgres(url: &str, input: &scenario::SendEmail, t: &mut Table) {
        let table = format!("idem_bench_{}", std::process::id());
        let (run, floor) = scenario::postgres_run(url, &table).await;
        send_email(&run, input).await.unwrap();
        // The floor reads a row that exists, as a hit does.
        floor.two_commits(0).await;
        let n = fitted(5_000, || floor.query(0)).await;
        let hit = paired(n, |_| send_email(&run, input), |_| floor.query(0)).await;
        t.pair("postgres: hit", &hit, "one SELECT by primary key");
        let mut k = 1 << 40;
        let n = fitted(1_000, || {
            k += 1;
            floor.two_commits(k)
        })
        .await;
        let miss = paired(
            n,
            |i| {
                let run = run.clone();
                async move { send_email(&run, &email(3_000_000 + i, BODY)).await.unwrap() }
            },
            |i| floor.two_commits(i as i64),
        )
        .await;
        t.pair("postgres: miss", &miss, "two commits (INSERT, UPDATE)");
        floor.drop_tables(&table).await;
    }
}

/// SQLite: a hit against a raw `SELECT` by key and a decode, a miss against two raw
/// write transactions (an `INSERT`, then an `UPDATE`, as a claim and a completion), on
/// a file of its own with the store's settings (WAL, `synchronous = NORMAL`).
#[cfg(feature = "sqlite")]
async fn sqlite_rows(t: &mut Table, n: usize, input: &scenario::SendEmail) {
    let dir = tempfile::tempdir().unwrap();
    let store = idem::SqliteStore::open(dir.path().join("idem.sqlite")).unwrap();
    let raw = rusqlite::Connection::open(dir.path().join("floor.sqlite")).unwrap();
    raw.execute_batch(
        "PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL; \
         CREATE TABLE floor (key TEXT PRIMARY KEY NOT NULL, value);",
    )
    .unwrap();
    let run = Run::new("bench-sqlite").with_store(store.clone());
    send_email(&run, input).await.unwrap();
    let result = serde_json::to_string(&message_id()).unwrap();
    raw.execute(
        "INSERT INTO floor VALUES (?1, ?2)",
        (scenario::keyed(input), &result),
    )
    .unwrap();
    let hit = compare(
        n,
        |_| send_email(&run, input),
        |_| {
            let raw = &raw;
            async move {
                let mut stmt = raw
                    .prepare_cached("SELECT value FROM floor WHERE key = ?1")
                    .unwrap();
                let text: String = stmt
                    .query_row([scenario::keyed(input)], |r| r.get(0))
                    .unwrap();
                std::hint::black_box(serde_json::from_str::<MessageId>(&text).unwrap());
            }
        },
    )
    .await;
    t.pair("sqlite: hit", &hit, "key + SELECT + decode");

    let m = 200;
    let run = Run::new("bench-sqlite-miss").with_store(store.clone());
    let serial = compare(
        m,
        |i| {
            let run = run.clone();
            async move { send_email(&run, &email(1_000_000 + i, BODY)).await.unwrap() }
        },
        |k| {
            let raw = &raw;
            async move {
                let key = format!("send_email.{k:064}");
                for sql in [
                    "INSERT INTO floor VALUES (?1, zeroblob(78))",
                    "UPDATE floor SET value = zeroblob(170) WHERE key = ?1",
                ] {
                    let tx = raw.unchecked_transaction().unwrap();
                    tx.prepare_cached(sql).unwrap().execute([&key]).unwrap();
                    tx.commit().unwrap();
                }
            }
        },
    )
    .await;
    t.pair("sqlite: miss, serial", &serial, "two write transactions");
    for tasks in [8u64, 64] {
        let per_call = concurrent_misses(&run, tasks, 1280, 20_000_000).await;
        t.row(
            &format!("sqlite: miss, {tasks} concurrent, per call"),
            per_call,
            Some(("the serial miss", serial.a)),
        );
    }
}
