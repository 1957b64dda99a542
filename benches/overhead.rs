//! `cargo bench --bench overhead`, or `cargo bench --features postgres,redis --bench
//! overhead` with the server URLs set for the shared stores.
//!
//! Each group puts idem next to the floor of the same work (and the direct call), so
//! every report shows the ratio measured in one run:
//!
//! - `key_derivation/<size>`: the floor (JSON streamed into SHA-256, hex) and idem's key
//!   derivation, for 100 B, 10 KiB and 1 MiB inputs;
//! - `hit`: the direct call, then for memory and sled the floor (key + lookup + decode)
//!   and an idempotent hit;
//! - `sled_miss/<tasks>`: the floor (two insert + flush) and a durable miss, with 1, 8
//!   and 64 calls in flight (time per call);
//! - `sled_hit_by_size/<records>`: a hit with 10³, 10⁵ and 10⁶ records stored;
//! - `sled_purge/<records>`: purging that many expired records;
//! - `redis`, `postgres` (with `--features postgres,redis` and `IDEM_REDIS_URL` /
//!   `IDEM_POSTGRES_URL`): hit and miss next to one round trip, one query, two commits;
//!   for Redis also a miss done by hand (`SET NX GET`, then a script that writes only
//!   while the claim is there), and a hit answered by a `LocalCache` in front of the
//!   store.

use std::collections::HashMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{
    criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode, Throughput,
};
use idem::{MemoryStore, Run, SledStore};
use idem_testkit::scenario::{self, email, floor_key, message_id, send_email, MessageId, BODY};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Time per call of `iters` sequential calls of `op`, inside the runtime.
fn per_iter<F: std::future::Future>(
    rt: &tokio::runtime::Runtime,
    iters: u64,
    mut op: impl FnMut(u64) -> F,
) -> Duration {
    rt.block_on(async {
        let t = Instant::now();
        for i in 0..iters {
            black_box(op(i).await);
        }
        t.elapsed()
    })
}

fn key_derivation(c: &mut Criterion) {
    let run = Run::new("bench").with_store(MemoryStore::new());
    // The key of a call as the attribute derives it, through the public API.
    let tool = idem::Tool::new("send_email");
    let mut group = c.benchmark_group("key_derivation");
    for (label, size) in [("100B", 0usize), ("10KiB", 10 << 10), ("1MiB", 1 << 20)] {
        let input = email(0, size);
        let bytes = serde_json::to_vec(&input).unwrap().len();
        group.throughput(Throughput::Bytes(bytes as u64));
        group.bench_with_input(BenchmarkId::new("floor", label), &input, |b, input| {
            b.iter(|| floor_key(black_box(input)))
        });
        group.bench_with_input(BenchmarkId::new("idem", label), &input, |b, input| {
            b.iter(|| tool.key_of(&run, black_box(input)).unwrap())
        });
    }
    group.finish();
}

fn hit(c: &mut Criterion) {
    let rt = runtime();
    let input = email(0, BODY);
    let mut group = c.benchmark_group("hit");
    group.bench_function("direct call", |b| {
        b.iter(|| black_box(scenario::send(black_box(&email(0, BODY)))))
    });

    let mut map: HashMap<[u8; 64], Vec<u8>> = HashMap::new();
    map.insert(
        floor_key(&input),
        serde_json::to_vec(&message_id()).unwrap(),
    );
    group.bench_function("memory floor", |b| {
        b.iter(|| serde_json::from_slice::<MessageId>(&map[&floor_key(&input)]).unwrap())
    });
    let memory = Run::new("bench").with_store(MemoryStore::new());
    rt.block_on(send_email(&memory, &input)).unwrap();
    group.bench_function("memory idem", |b| {
        b.iter_custom(|iters| per_iter(&rt, iters, |_| send_email(&memory, &input)))
    });

    let dir = tempfile::tempdir().unwrap();
    let raw = sled::open(dir.path().join("floor")).unwrap();
    raw.insert(
        floor_key(&input),
        serde_json::to_vec(&message_id()).unwrap(),
    )
    .unwrap();
    group.bench_function("sled floor", |b| {
        b.iter(|| {
            let bytes = raw.get(floor_key(&input)).unwrap().unwrap();
            serde_json::from_slice::<MessageId>(&bytes).unwrap()
        })
    });
    let sled = Run::new("bench").with_store(SledStore::open(dir.path().join("idem")).unwrap());
    rt.block_on(send_email(&sled, &input)).unwrap();
    group.bench_function("sled idem", |b| {
        b.iter_custom(|iters| per_iter(&rt, iters, |_| send_email(&sled, &input)))
    });
    group.finish();
}

fn sled_miss(c: &mut Criterion) {
    let rt = runtime();
    let dir = tempfile::tempdir().unwrap();
    let raw = sled::open(dir.path().join("floor")).unwrap();
    let run = Run::new("bench").with_store(SledStore::open(dir.path().join("idem")).unwrap());
    let mut group = c.benchmark_group("sled_miss");
    group.sample_size(10);
    let mut k = 0u64;
    group.bench_function("floor/two flushes", |b| {
        b.iter(|| {
            k += 1;
            scenario::sled_two_flushes(&raw, k, None);
        })
    });
    let mut next = 0u64;
    for tasks in [1u64, 8, 64] {
        group.bench_function(BenchmarkId::new("idem", tasks), |b| {
            b.iter_custom(|iters| {
                let base = next;
                next += iters + tasks;
                rt.block_on(async {
                    let t = Instant::now();
                    let handles: Vec<_> = (0..tasks)
                        .map(|w| {
                            let run = run.clone();
                            tokio::spawn(async move {
                                let mut i = w;
                                while i < iters {
                                    send_email(&run, &email(base + i, BODY)).await.unwrap();
                                    i += tasks;
                                }
                            })
                        })
                        .collect();
                    for h in handles {
                        h.await.unwrap();
                    }
                    t.elapsed()
                })
            })
        });
    }
    group.finish();
}

fn sled_hit_by_size(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("sled_hit_by_size");
    for records in [1_000u64, 100_000, 1_000_000] {
        let dir = tempfile::tempdir().unwrap();
        let store = scenario::filled_store(dir.path(), records, Duration::from_secs(3600));
        let run = Run::new("bench-size").with_store(store);
        let probe = email(records / 2, BODY);
        group.bench_function(BenchmarkId::from_parameter(records), |b| {
            b.iter_custom(|iters| per_iter(&rt, iters, |_| send_email(&run, &probe)))
        });
    }
    group.finish();
}

fn sled_purge(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("sled_purge");
    // One purge per sample: each needs a freshly filled store.
    group.sample_size(10).sampling_mode(SamplingMode::Flat);
    for records in [100_000u64, 1_000_000] {
        group.bench_function(BenchmarkId::from_parameter(records), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let dir = tempfile::tempdir().unwrap();
                    let store =
                        scenario::filled_store(dir.path(), records, Duration::from_millis(1));
                    std::thread::sleep(Duration::from_millis(5));
                    let t = Instant::now();
                    let removed = rt.block_on(idem::Store::purge_expired(&store)).unwrap();
                    total += t.elapsed();
                    assert_eq!(removed, records);
                }
                total
            })
        });
    }
    group.finish();
}

/// Hits and misses on Redis and Postgres, next to one round trip / one query / two
/// commits on the same server, on a current-thread runtime (see the `bench` example).
/// Needs `--features postgres,redis` and the URLs.
fn network(c: &mut Criterion) {
    #[cfg(any(feature = "redis", feature = "postgres"))]
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    #[cfg(any(feature = "redis", feature = "postgres"))]
    let input = email(0, BODY);
    #[cfg(feature = "redis")]
    if let Ok(url) = std::env::var("IDEM_REDIS_URL") {
        let mut group = c.benchmark_group("redis");
        let prefix = format!("idem-bench-{}:", std::process::id());
        let (run, cached, floor) = rt.block_on(async {
            let run = scenario::redis_run(&url, &prefix, false).await;
            let cached = scenario::redis_run(&url, &prefix, true).await;
            (run, cached, scenario::RedisFloor::connect(&url).await)
        });
        rt.block_on(send_email(&run, &input)).unwrap();
        group.bench_function("floor/one round trip", |b| {
            b.iter_custom(|iters| per_iter(&rt, iters, |_| floor.round_trip()))
        });
        let mut k = 0u64;
        group.bench_function("floor/fenced miss", |b| {
            b.iter_custom(|iters| {
                let base = k;
                k += iters;
                per_iter(&rt, iters, |i| floor.fenced_miss(&prefix, base + i))
            })
        });
        bench_hit_and_miss(&mut group, &rt, &run, &input, 1_000_000);
        // A LocalCache keeps what its own process completed: complete through it first.
        let probe = email(1, BODY);
        rt.block_on(send_email(&cached, &probe)).unwrap();
        group.bench_function("hit, LocalCache", |b| {
            b.iter_custom(|iters| per_iter(&rt, iters, |_| send_email(&cached, &probe)))
        });
        group.finish();
        rt.block_on(floor.clean(&prefix));
    }
    #[cfg(feature = "postgres")]
    if let Ok(url) = std::env::var("IDEM_POSTGRES_URL") {
        let mut group = c.benchmark_group("postgres");
        let table = format!("idem_bench_{}", std::process::id());
        let (run, floor) = rt.block_on(scenario::postgres_run(&url, &table));
        rt.block_on(send_email(&run, &input)).unwrap();
        // The floor reads a row that exists, as a hit does.
        rt.block_on(floor.two_commits(-1));
        group.bench_function("floor/one query", |b| {
            b.iter_custom(|iters| per_iter(&rt, iters, |_| floor.query(-1)))
        });
        let mut k = 0i64;
        group.bench_function("floor/two commits", |b| {
            b.iter_custom(|iters| {
                let base = k;
                k += iters as i64;
                per_iter(&rt, iters, |i| floor.two_commits(base + i as i64))
            })
        });
        bench_hit_and_miss(&mut group, &rt, &run, &input, 2_000_000);
        group.finish();
        rt.block_on(floor.drop_tables(&table));
    }
    let _ = c;
}

/// `hit` (the same input again and again) and `miss` (a new input each time, numbered
/// from `first_miss`) in `group`.
#[cfg(any(feature = "redis", feature = "postgres"))]
fn bench_hit_and_miss(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    rt: &tokio::runtime::Runtime,
    run: &Run,
    input: &scenario::SendEmail,
    first_miss: u64,
) {
    group.bench_function("hit", |b| {
        b.iter_custom(|iters| per_iter(rt, iters, |_| send_email(run, input)))
    });
    let mut next = first_miss;
    group.bench_function("miss", |b| {
        b.iter_custom(|iters| {
            let base = next;
            next += iters;
            per_iter(rt, iters, |i| {
                let run = run.clone();
                async move { send_email(&run, &email(base + i, BODY)).await.unwrap() }
            })
        })
    });
}

criterion_group!(
    benches,
    key_derivation,
    hit,
    sled_miss,
    sled_hit_by_size,
    sled_purge,
    network
);
criterion_main!(benches);
