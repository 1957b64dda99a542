//! What purging expired records costs, and what calls see while it runs.
//!
//! ```text
//! cargo run --release --example purge
//! IDEM_POSTGRES_URL=postgres://root@127.0.0.1/test \
//!     cargo run --release --features postgres --example purge
//! ```
//!
//! For each store (memory, sled, and Postgres when `IDEM_POSTGRES_URL` is set), it
//! fills the store with expired records (10⁶ by default, `--records N`), then one task
//! makes a hit and a miss about every millisecond: for two seconds first, then while
//! `Store::purge_expired` runs in another task, and for a second after it returns. It
//! prints how long the purge took and the latency of those calls before, during and
//! after the purge (median, 99th percentile and worst). Redis needs no purge: its keys
//! expire on their own. Takes about a minute for 10⁶ records, most of it filling sled.

use std::time::{Duration, Instant};

use clap::Parser;
use idem::store::{Claim, ClaimRequest, Fenced, Fingerprint, Outcome, Token};
use idem::{Key, MemoryStore, Run, Store};
use idem_testkit::scenario::{self, email, message_id, send_email, BODY};

#[derive(Parser)]
#[command(about = "Purge expired records and measure the calls made meanwhile")]
struct Args {
    /// How many expired records each store holds when the purge starts.
    #[arg(long, default_value_t = 1_000_000)]
    records: u64,
}

/// How long calls are measured before the purge starts.
const BEFORE: Duration = Duration::from_secs(2);

/// How long calls are measured after the purge returns: a store may leave work behind
/// (the memory store frees what it removed on a blocking thread, sled flushes).
const AFTER: Duration = Duration::from_secs(1);

/// The latencies of the hits and the misses made in one phase.
#[derive(Default)]
struct Latencies {
    hits: Vec<Duration>,
    misses: Vec<Duration>,
}

/// The calls before, during and after a purge, and how long the purge took.
#[derive(Default)]
struct Phases {
    before: Latencies,
    during: Latencies,
    after: Latencies,
    took: Duration,
}

/// One timed call: when it started and ended, and whether it was a hit.
struct Timed {
    start: Instant,
    end: Instant,
    hit: bool,
}

/// Makes a hit (of a call completed beforehand) and a miss (of a new call) on `store`
/// about every millisecond; after [`BEFORE`], starts the purge in another task and goes
/// on until [`AFTER`] past its end. Sorts the calls into those that ended before the
/// purge began, those that overlapped it (a call the purge held up counts, even if it
/// started first), and those after it.
async fn measure<S: Store + Clone>(store: S, records: u64) -> Phases {
    let run = Run::new("purge").with_store(store.clone());
    let live = email(u64::MAX, BODY);
    send_email(&run, &live).await.unwrap();
    let start = Instant::now();
    let (mut purge, mut returned) = (None, None::<Instant>);
    let mut calls = Vec::new();
    for n in 1u64.. {
        match &purge {
            _ if returned.is_some_and(|at| at.elapsed() >= AFTER) => break,
            None if start.elapsed() >= BEFORE => {
                let store = store.clone();
                purge = Some(tokio::spawn(async move {
                    let began = Instant::now();
                    let removed = store.purge_expired().await.unwrap();
                    (removed, began, Instant::now())
                }));
            }
            Some(task) if returned.is_none() && task.is_finished() => {
                returned = Some(Instant::now());
            }
            _ => {}
        }
        // Above the numbers of the emails `scenario::filled_store` wrote.
        for (hit, input) in [(true, &live), (false, &email((1 << 40) + n, BODY))] {
            let t = Instant::now();
            send_email(&run, input).await.unwrap();
            calls.push(Timed {
                start: t,
                end: Instant::now(),
                hit,
            });
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let (removed, began, ended) = purge
        .expect("the loop ends once the purge has")
        .await
        .unwrap();
    assert_eq!(removed, records, "the purge removes every expired record");
    let mut phases = Phases {
        took: ended - began,
        ..Phases::default()
    };
    for call in calls {
        let phase = if call.end <= began {
            &mut phases.before
        } else if call.start < ended {
            &mut phases.during
        } else {
            &mut phases.after
        };
        let took = call.end - call.start;
        if call.hit {
            phase.hits.push(took)
        } else {
            phase.misses.push(took)
        }
    }
    phases
}

/// Fills a memory store through the `Store` trait: `records` completed records that
/// expire after a millisecond.
async fn filled_memory(records: u64) -> MemoryStore {
    let store = MemoryStore::new();
    let result = serde_json::to_vec(&message_id()).unwrap();
    for i in 0..records {
        let key = Key::from_text(format!("purge_fill.{i:064x}"));
        let request = ClaimRequest {
            origin: idem::store::Origin::new("purge", "purge_fill"),
            fingerprint: Fingerprint::from_bytes([7; 32]),
            token: Token::generate().unwrap(),
            lease: Duration::from_secs(60),
            ttl: Duration::from_secs(60),
            take_over_expired: true,
            retry_failed: true,
        };
        let claim = store.claim(&key, &request).await.unwrap();
        assert!(matches!(claim, Claim::Acquired { .. }));
        let outcome = Outcome::Completed(&result);
        let fenced = store
            .complete(&key, request.token, outcome, Duration::from_millis(1))
            .await
            .unwrap();
        assert_eq!(fenced, Fenced::Applied);
    }
    store
}

/// A Postgres store on a table of its own holding `records` completed records that
/// expired about an hour ago, a millisecond apart as records written over time do,
/// written by one `INSERT … SELECT` (a record's sizes: a 32-byte fingerprint, a 16-byte
/// token, a 114-byte result).
#[cfg(feature = "postgres")]
async fn filled_postgres(url: &str, table: &str, records: u64) -> idem::PostgresStore {
    let store = idem::PostgresStore::builder(url)
        .table(table)
        .connect()
        .await
        .unwrap();
    let client = store.pool().get().await.unwrap();
    client
        .batch_execute(&format!(
            "TRUNCATE {table};
             INSERT INTO {table}
             SELECT 'purge_fill.' || lpad(to_hex(g), 64, '0'), decode(repeat('07', 32), 'hex'),
                    1, decode(repeat('01', 16), 'hex'), NULL, decode(repeat('61', 114), 'hex'),
                    now() - interval '2 hours', now() - interval '1 hour' + g * interval '1 millisecond'
             FROM generate_series(1, {records}) AS g;"
        ))
        .await
        .unwrap();
    // A statement of its own: VACUUM cannot run inside the transaction a multi-statement
    // string forms.
    client
        .batch_execute(&format!("VACUUM ANALYZE {table}"))
        .await
        .unwrap();
    store
}

fn print_row(store: &str, phase: &str, seen: &mut Latencies) {
    let cell = |times: &mut Vec<Duration>| {
        if times.is_empty() {
            return format!("{:>29}", "none");
        }
        times.sort();
        let at = |q: f64| times[((times.len() as f64 * q) as usize).min(times.len() - 1)];
        format!(
            "{:>9} {:>9} {:>9}",
            fmt(at(0.5)),
            fmt(at(0.99)),
            fmt(times[times.len() - 1])
        )
    };
    println!(
        "{store:<10} {phase:<22} {:>6}   {}   {}",
        seen.hits.len() + seen.misses.len(),
        cell(&mut seen.hits),
        cell(&mut seen.misses)
    );
}

fn fmt(d: Duration) -> String {
    let us = d.as_secs_f64() * 1e6;
    if us < 1_000.0 {
        format!("{us:.0} µs")
    } else {
        format!("{:.1} ms", us / 1e3)
    }
}

fn report(store: &str, mut phases: Phases) {
    print_row(store, "before the purge", &mut phases.before);
    let during = format!("during it ({:.2} s)", phases.took.as_secs_f64());
    print_row("", &during, &mut phases.during);
    print_row("", "the second after it", &mut phases.after);
}

fn main() {
    let args = Args::parse();
    let records = args.records;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    println!(
        "{records} expired records; one task makes a hit and a miss about every millisecond\n"
    );
    println!(
        "{:<10} {:<22} {:>6}   {:>29}   {:>29}",
        "store", "phase", "calls", "hit: median, p99, max", "miss: median, p99, max"
    );
    rt.block_on(async {
        let memory = filled_memory(records).await;
        report("memory", measure(memory, records).await);

        let dir = tempfile::tempdir().unwrap();
        let sled = scenario::filled_store(dir.path(), records, Duration::from_millis(1));
        report("sled", measure(sled, records).await);

        #[cfg(feature = "postgres")]
        if let Ok(url) = std::env::var("IDEM_POSTGRES_URL") {
            let table = format!("idem_purge_bench_{}", std::process::id());
            let store = filled_postgres(&url, &table, records).await;
            report("postgres", measure(store.clone(), records).await);
            let client = store.pool().get().await.unwrap();
            client
                .batch_execute(&format!("DROP TABLE {table}"))
                .await
                .unwrap();
        }
    });
}
