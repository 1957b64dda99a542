//! What a Redis miss costs the server: idem's misses and the floor's (a claim by
//! `SET NX GET`, then the result written by a fenced script), each from 64 tasks for a
//! few seconds, rounds alternated, read from the server's own counters.
//!
//! ```text
//! IDEM_REDIS_URL=redis://127.0.0.1:6379 cargo run --release --features redis --example redis_server [-- ROUNDS SECONDS]
//! ```
//!
//! For each round it resets the server's statistics (`CONFIG RESETSTAT`), runs the
//! misses, and reads `INFO commandstats` (the time the server spent in each command,
//! a script's inner calls included) and `INFO cpu` (the server process's whole CPU,
//! its network work included). It prints, per miss: the server's CPU, and the time of
//! the `SET` claims and of the `EVALSHA` completions. The client's throughput is
//! printed too, but on a machine shared with the server it moves with the server's
//! load; the server's time per command is the steadier figure. Uses a key prefix of its
//! own, and deletes its keys at the end.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_testkit::scenario::{email, redis_run, send_email, RedisFloor, BODY};
use redis::aio::MultiplexedConnection;

const TASKS: usize = 64;

/// One miss on a new key `i`, boxed, so idem's and the floor's share one runner.
type Miss = Arc<dyn Fn(u64) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// Keys of misses: new for every call of the whole run.
static NEXT: AtomicU64 = AtomicU64::new(1);

async fn info(c: &mut MultiplexedConnection, section: &str) -> String {
    redis::cmd("INFO")
        .arg(section)
        .query_async(c)
        .await
        .unwrap()
}

/// The server's CPU time so far (user and system), in µs.
fn cpu(info: &str) -> f64 {
    info.lines()
        .filter_map(|l| {
            l.strip_prefix("used_cpu_sys:")
                .or_else(|| l.strip_prefix("used_cpu_user:"))
        })
        .map(|v| v.trim().parse::<f64>().unwrap_or(0.0) * 1e6)
        .sum()
}

/// The µs the server spent in `command` (its `cmdstat_<command>` line's `usec`).
fn usec(stats: &str, command: &str) -> f64 {
    let prefix = format!("cmdstat_{command}:");
    stats
        .lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|l| l.split(',').find_map(|f| f.strip_prefix("usec=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// Per miss: calls per second, server CPU, `SET` time, `EVALSHA` time (µs).
type Round = [f64; 4];

async fn round(c: &mut MultiplexedConnection, time: Duration, miss: Miss) -> Round {
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(c)
        .await
        .unwrap();
    let before = cpu(&info(c, "cpu").await);
    let started = Instant::now();
    let calls = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let (miss, calls) = (Arc::clone(&miss), Arc::clone(&calls));
            tokio::spawn(async move {
                while started.elapsed() < time {
                    miss(NEXT.fetch_add(1, Ordering::Relaxed)).await;
                    calls.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let elapsed = started.elapsed().as_secs_f64();
    let n = calls.load(Ordering::Relaxed) as f64;
    let server = cpu(&info(c, "cpu").await) - before;
    let stats = info(c, "commandstats").await;
    [
        n / elapsed,
        server / n,
        usec(&stats, "set") / n,
        usec(&stats, "evalsha") / n,
    ]
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let Ok(url) = std::env::var("IDEM_REDIS_URL") else {
        eprintln!("set IDEM_REDIS_URL (e.g. redis://127.0.0.1:6379)");
        std::process::exit(2);
    };
    let mut args = std::env::args().skip(1);
    let rounds: usize = args.next().map_or(4, |a| a.parse().expect("ROUNDS"));
    let time = Duration::from_secs_f64(args.next().map_or(3.0, |a| a.parse().expect("SECONDS")));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let prefix = format!("idem-redis-server-{}:", std::process::id());
        let run = redis_run(&url, &prefix, false).await;
        let floor = Arc::new(RedisFloor::connect(&url).await);
        let cleaner = Arc::clone(&floor);
        let client = redis::Client::open(url.as_str()).unwrap();
        let mut c = client.get_multiplexed_async_connection().await.unwrap();
        let idem_miss: Miss = Arc::new(move |i| {
            let run = run.clone();
            Box::pin(async move {
                send_email(&run, &email(i, BODY)).await.unwrap();
            })
        });
        let floor_prefix = prefix.clone();
        let floor_miss: Miss = Arc::new(move |i| {
            let (floor, prefix) = (Arc::clone(&floor), floor_prefix.clone());
            Box::pin(async move { floor.keyed_miss(&prefix, &email(i, BODY)).await })
        });
        let (mut idem, mut floor) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            idem.push(round(&mut c, time, Arc::clone(&idem_miss)).await);
            floor.push(round(&mut c, time, Arc::clone(&floor_miss)).await);
        }
        println!(
            "Redis misses from {TASKS} tasks, {rounds} rounds of {:.0} s each, alternated; \
             per miss, medians (ranges)\n",
            time.as_secs_f64()
        );
        println!(
            "{:<6} {:>22} {:>24} {:>22} {:>24}",
            "", "misses/s", "server CPU (µs)", "SET claims (µs)", "EVALSHA (µs)"
        );
        for (name, rows) in [("idem", &idem), ("floor", &floor)] {
            let column = |k: usize| {
                let v: Vec<f64> = rows.iter().map(|r| r[k]).collect();
                let (lo, hi) = (
                    v.iter().copied().fold(f64::INFINITY, f64::min),
                    v.iter().copied().fold(0.0, f64::max),
                );
                let digits = usize::from(k != 0);
                format!("{:.digits$} ({lo:.digits$}–{hi:.digits$})", median(v))
            };
            println!(
                "{name:<6} {:>22} {:>24} {:>22} {:>24}",
                column(0),
                column(1),
                column(2),
                column(3)
            );
        }
        // Every key this run wrote, idem's and the floor's, is under the prefix.
        cleaner.clean(&prefix).await;
    });
}
