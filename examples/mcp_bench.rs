//! What `idem::mcp::Idempotent` costs a `tools/call`: the same rmcp server called
//! plain and through the layer, by an rmcp client over an in-memory pipe (what an agent
//! does over stdio, without the process hop), records in a `MemoryStore`.
//!
//! ```text
//! cargo run --release --features rmcp --example mcp_bench [-- --calls 2000]
//! ```
//!
//! Rows: the plain server; the layer on a miss (a new run each call: claimed, the tool
//! run, the result recorded); the layer on a hit (one run: answered from the store,
//! the tool not run). The three are called in turn, one call each, so a machine that
//! slows down moves them alike; medians and p99 of single calls, in µs.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idem::mcp::RUN_META_KEY;
use idem::MemoryStore;
use idem_testkit::mcp;
use rmcp::model::{CallToolRequestParams, RequestMetaObject};
use rmcp::service::{RoleClient, RunningService};
use serde_json::{json, Value};

const WARM_UP: usize = 200;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let calls: usize = mcp::flag(&args, "--calls").unwrap_or("2000").parse()?;

    let mailer = mcp::Mailer::new();
    let plain = mcp::connect(mailer.clone()).await;
    let layered = mcp::connect(mailer.idempotent(Arc::new(MemoryStore::new()))).await;

    let mut times: [Vec<Duration>; 3] = Default::default();
    for i in 0..WARM_UP + calls {
        let plain_call = time(&plain, call(None)).await?;
        let miss = time(&layered, call(Some(&format!("run-{i}")))).await?;
        let hit = time(&layered, call(Some("run-hit"))).await?;
        if i >= WARM_UP {
            for (row, t) in times.iter_mut().zip([plain_call, miss, hit]) {
                row.push(t);
            }
        }
    }
    let [plain_times, miss_times, hit_times] = &mut times;
    let base = percentile(plain_times, 50);
    println!("{calls} calls a row after {WARM_UP} to warm up; single calls, µs");
    println!();
    println!("| call | median | p99 | over plain | ratio |");
    println!("|---|---|---|---|---|");
    for (name, row) in [
        ("plain server", plain_times),
        ("layer, miss (claimed, run, recorded)", miss_times),
        ("layer, hit (answered from the store)", hit_times),
    ] {
        let median = percentile(row, 50);
        println!(
            "| {name} | {:.1} | {:.1} | {:+.1} | {:.2}× |",
            micros(median),
            micros(percentile(row, 99)),
            micros(median) - micros(base),
            micros(median) / micros(base),
        );
    }
    plain.cancel().await?;
    layered.cancel().await?;
    Ok(())
}

/// A `send_email` call, under `run` if one is given.
fn call(run: Option<&str>) -> CallToolRequestParams {
    let arguments = json!({"to": "ada@example.com", "subject": "hi", "body": "the report"});
    let arguments = arguments.as_object().cloned().unwrap_or_default();
    let mut params = CallToolRequestParams::new("send_email").with_arguments(arguments);
    if let Some(run) = run {
        let mut meta = RequestMetaObject::new();
        meta.insert(RUN_META_KEY.to_owned(), Value::String(run.to_owned()));
        params.meta = Some(meta);
    }
    params
}

/// How long one call takes; an error if it is not answered with a result.
async fn time(
    client: &RunningService<RoleClient, ()>,
    params: CallToolRequestParams,
) -> Result<Duration, Box<dyn std::error::Error>> {
    let started = Instant::now();
    let result = client.call_tool(params).await?;
    let took = started.elapsed();
    if result.is_error == Some(true) {
        return Err(format!("the call failed: {result:?}").into());
    }
    Ok(took)
}

fn percentile(times: &mut [Duration], p: usize) -> Duration {
    times.sort_unstable();
    times[(times.len() * p / 100).min(times.len() - 1)]
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}
