//! What running calls' renewals cost a Postgres server: many bodies held running under
//! a short lease, their claims renewed every third of it, while the server's CPU is
//! read.
//!
//! ```text
//! IDEM_POSTGRES_URL=postgres://root@127.0.0.1/test \
//!     cargo run --release --features postgres --example renewals [-- --bodies 2000 --lease-ms 600 --seconds 10 --connections 8]
//! ```
//!
//! One process, a tokio runtime with 2 worker threads, a table of its own. Every body
//! claims its key, then sleeps `--seconds`; meanwhile the heartbeat renews each claim
//! every third of `--lease-ms`. Over the middle of that time it prints the renewals a
//! second the schedule asks for, and the CPU time per renewal of this process and of
//! the server's processes on this machine (Linux's `/proc`); at the end, the renewals
//! the table took (its updated rows, from `pg_stat_user_tables`, less the completions)
//! and how many calls lost their claim or ran twice.

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem::{Error, PostgresStore, Run, Tool};

/// A command-line value after `flag`, or `default`.
fn arg(flag: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1))
        .map_or(default, |v| v.parse().expect("a number"))
}

/// The CPU time so far of this process and of every `postgres` process on this machine,
/// in nanoseconds (each thread's `schedstat`).
fn cpu() -> (u64, u64) {
    let of = |dir: &std::path::Path| -> u64 {
        std::fs::read_dir(dir.join("task"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|task| {
                let stat = std::fs::read_to_string(task.path().join("schedstat")).ok()?;
                stat.split(' ').next()?.parse::<u64>().ok()
            })
            .sum()
    };
    let client = of(std::path::Path::new("/proc/self"));
    let server = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|p| {
            std::fs::read_to_string(p.path().join("comm")).is_ok_and(|c| c.trim_end() == "postgres")
        })
        .map(|p| of(&p.path()))
        .sum();
    (client, server)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("IDEM_POSTGRES_URL").map_err(|_| "set IDEM_POSTGRES_URL")?;
    let bodies = arg("--bodies", 2000) as usize;
    let lease = Duration::from_millis(arg("--lease-ms", 600));
    let seconds = arg("--seconds", 10).max(3);
    let connections = arg("--connections", 8) as usize;
    let table = format!("idem_renewals_{}", std::process::id());
    let store = PostgresStore::builder(&url)
        .table(&table)
        .max_connections(connections)
        .timeout(Duration::from_secs(30))
        .connect()
        .await?;
    let run = Run::new("renewals").with_store(store.clone());
    let (started, ran) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let hold = Duration::from_secs(seconds);
    let calls: Vec<_> = (0..bodies)
        .map(|n| {
            let (run, started, ran) = (run.clone(), started.clone(), ran.clone());
            tokio::spawn(async move {
                Tool::new("held")
                    .lease(lease)
                    .call(&run, &n, move |_| async move {
                        ran.fetch_add(1, SeqCst);
                        started.fetch_add(1, SeqCst);
                        tokio::time::sleep(hold).await;
                        Ok::<_, Error>(n)
                    })
                    .await
            })
        })
        .collect();
    let since = Instant::now();
    while started.load(SeqCst) < bodies && since.elapsed() < hold / 2 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The middle of the hold: every body is running, none is completing.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (window, at) = (hold - since.elapsed() - Duration::from_millis(1000), cpu());
    tokio::time::sleep(window).await;
    let after = cpu();
    let asked = bodies as f64 * window.as_secs_f64() / (lease.as_secs_f64() / 3.0);
    let (mut lost, mut failed) = (0, 0);
    for call in calls {
        match call.await? {
            Ok(_) => {}
            Err(Error::LostLease { .. }) => lost += 1,
            Err(_) => failed += 1,
        }
    }
    drop((run, store));
    // A backend reports its counts as it ends; give the pool's a moment to.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (admin, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    let updated: i64 = admin
        .query_one(
            "SELECT n_tup_upd FROM pg_stat_user_tables WHERE relid = to_regclass($1)",
            &[&table],
        )
        .await?
        .get(0);
    admin
        .batch_execute(&format!("DROP TABLE IF EXISTS {table}"))
        .await?;
    let per = |ns: u64| ns as f64 / 1000.0 / asked;
    println!(
        "{bodies} bodies, lease {} ms, {connections} connections, {:.1} s measured",
        lease.as_millis(),
        window.as_secs_f64()
    );
    println!(
        "renewals asked: {:.0}/s; CPU per renewal: client {:.1} µs, server {:.1} µs",
        asked / window.as_secs_f64(),
        per(after.0 - at.0),
        per(after.1 - at.1)
    );
    println!(
        "renewals the table took: {} in {:.1} s; bodies run: {}; LostLease: {lost}; other errors: {failed}",
        updated - bodies as i64,
        since.elapsed().as_secs_f64(),
        ran.load(SeqCst)
    );
    Ok(())
}
