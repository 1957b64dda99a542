//! A fleet: N worker processes share one store and race on the same tool calls.
//!
//! ```text
//! cargo run --features postgres,redis --example fleet -- postgres   # or: redis
//! cargo run --features postgres,redis --example fleet -- redis 8    # 8 workers
//! ```
//!
//! Every worker calls the same 20 tool calls (same run, same inputs) from 8 tasks at
//! once. The tool's side effect increments a counter in Redis, where every worker can
//! see it. At the end the example prints how many side effects happened per call: one.
//!
//! Servers: `IDEM_POSTGRES_URL` (default `postgres://root@127.0.0.1:5432/test`) and
//! `IDEM_REDIS_URL` (default `redis://127.0.0.1:6379`); the side effects are always
//! counted in Redis.

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem::{idempotent, PostgresStore, RedisStore, Run, Store};

const CALLS: u32 = 20;
const TASKS: u32 = 8;

fn postgres_url() -> String {
    std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://root@127.0.0.1:5432/test".into())
}

fn redis_url() -> String {
    std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// The tool: "sends an invoice", counting each real send in Redis.
#[idempotent(name = "send_invoice", ttl = "1h", skip = [counters])]
async fn send_invoice(
    invoice: u32,
    counters: &redis::aio::MultiplexedConnection,
) -> Result<String, idem::Error> {
    let mut c = counters.clone();
    let fleet = std::env::var("FLEET_ID").unwrap_or_default();
    let counter = format!("{fleet}:sent:{invoice}");
    let _: () = redis::pipe()
        .cmd("INCR")
        .arg(&counter)
        .ignore()
        .cmd("EXPIRE")
        .arg(&counter)
        .arg(3600)
        .ignore()
        .query_async(&mut c)
        .await
        .map_err(|e| idem::Error::store("redis", e))?;
    tokio::time::sleep(Duration::from_millis(5)).await;
    Ok(format!(
        "invoice {invoice} sent by worker {}",
        std::process::id()
    ))
}

async fn worker(kind: &str, fleet: &str) -> Result<(), idem::Error> {
    let store: Arc<dyn Store> = match kind {
        "postgres" => Arc::new(
            PostgresStore::builder(&postgres_url())
                .table(fleet.replace('-', "_"))
                .build()?,
        ),
        _ => Arc::new(
            RedisStore::builder(&redis_url())
                .prefix(format!("{fleet}:idem:"))
                .build()?,
        ),
    };
    let counters = redis::Client::open(redis_url())
        .map_err(|e| idem::Error::store("redis", e))?
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| idem::Error::store("redis", e))?;
    let run = Run::new(fleet).with_shared_store(store);
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let (run, counters) = (run.clone(), counters.clone());
        tasks.push(tokio::spawn(async move {
            for i in 0..CALLS {
                let invoice = (i + t * 3) % CALLS;
                run.scope(send_invoice(invoice, &counters)).await?;
            }
            Ok::<_, idem::Error>(())
        }));
    }
    for t in tasks {
        t.await
            .map_err(|e| idem::Error::store("task", e.to_string()))??;
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--worker") {
        let fleet = std::env::var("FLEET_ID")?;
        return Ok(worker(&args[2], &fleet).await?);
    }
    let kind = args.get(1).cloned().unwrap_or_else(|| "redis".into());
    if kind != "postgres" && kind != "redis" {
        return Err(format!("unknown store `{kind}`: use postgres or redis").into());
    }
    let workers: u32 = args.get(2).and_then(|n| n.parse().ok()).unwrap_or(4);
    let fleet = format!("fleet-{}", std::process::id());
    if kind == "postgres" {
        PostgresStore::builder(&postgres_url())
            .table(fleet.replace('-', "_"))
            .connect()
            .await?;
    }

    println!("{workers} workers x {TASKS} tasks x {CALLS} calls on one {kind} store");
    let started = Instant::now();
    let children: Vec<_> = (0..workers)
        .map(|_| {
            Command::new(std::env::current_exe()?)
                .args(["--worker", &kind])
                .env("FLEET_ID", &fleet)
                .spawn()
        })
        .collect::<Result<_, _>>()?;
    for mut child in children {
        if !child.wait()?.success() {
            return Err("a worker failed".into());
        }
    }

    let mut c = redis::Client::open(redis_url())?
        .get_multiplexed_async_connection()
        .await?;
    let mut total = 0;
    let mut per_call = Vec::new();
    for invoice in 0..CALLS {
        let n: i64 = redis::cmd("GET")
            .arg(format!("{fleet}:sent:{invoice}"))
            .query_async::<Option<i64>>(&mut c)
            .await?
            .unwrap_or(0);
        total += n;
        per_call.push(n);
    }
    println!(
        "{} tool calls made, {} invoices, {total} actually sent, in {:?}",
        workers * TASKS * CALLS,
        CALLS,
        started.elapsed()
    );
    println!("sends per invoice: {per_call:?}");
    if kind == "postgres" {
        let (client, connection) =
            tokio_postgres::connect(&postgres_url(), tokio_postgres::NoTls).await?;
        tokio::spawn(connection);
        client
            .batch_execute(&format!("DROP TABLE IF EXISTS {}", fleet.replace('-', "_")))
            .await?;
    }
    if per_call.iter().all(|&n| n == 1) {
        println!("every invoice was sent exactly once");
        Ok(())
    } else {
        Err("some invoice was not sent exactly once".into())
    }
}
