//! An MCP server over streamable HTTP on 127.0.0.1 whose `send_email` tool is
//! idempotent per agent run, and a client that loses a request.
//!
//! ```text
//! cargo run --features rmcp --example mcp_http                # the story: a client hangs up mid-call, retries
//! cargo run --features rmcp --example mcp_http -- --serve 8931 [--latency-ms 2000]
//!                                       # serve http://127.0.0.1:8931/mcp for a real client
//! ```
//!
//! The client speaks MCP's 2026-07-28 revision in plain HTTP: every `tools/call` is one
//! POST whose `_meta` carries the protocol version, its capabilities and the agent's
//! run id (`idem/run`). It sends `send_email`, the server sends the email, and the
//! client hangs up before the slow provider answers. As the revision tells a client
//! that lost a request, it sends the call again with a new JSON-RPC id and the same
//! `_meta`. rmcp cancels the first request; `idem::mcp::Idempotent` answers it at once
//! while the tool runs on and records the message id. The retry gets that id: one
//! email.
//!
//! `--serve` keeps records in idem's default store (`$IDEM_DIR`, else `./.idem`), and
//! `--latency-ms` makes the provider answer that long after it sent, so a real client
//! can give up mid-call and retry; the story keeps records in memory, so it can be told
//! again.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idem::MemoryStore;
use idem_testkit::mcp::http::{post, post_and_hang_up, serve, structured, tools_call};
use idem_testkit::mcp::{self, Mailer};
use serde_json::json;
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // idem's own events by default; `RUST_LOG` for more (rmcp reports the cancelled
    // request's closed channel at `error`).
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("idem=info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(port) = mcp::flag(&args, "--serve") {
        let mailer = Mailer::new().with_latency(mcp::latency_flag(&args)?);
        let addr = serve(mailer.idempotent(idem::default_store()?), port.parse()?).await?;
        println!("serving MCP at http://{addr}/mcp (Ctrl-C to stop)");
        tokio::signal::ctrl_c().await?;
        return Ok(());
    }

    let latency = Duration::from_millis(1500);
    let mailer = Mailer::new().with_latency(latency);
    let addr = serve(mailer.idempotent(Arc::new(MemoryStore::new())), 0).await?;
    println!(
        "MCP server at http://{addr}/mcp; the email provider answers {latency:?} after sending"
    );
    let email = json!({"to": "ada@example.com", "subject": "Invoice", "body": "Attached."});
    let run = "mcp-demo-run";

    println!("request 1 (id 1): tools/call send_email, run {run:?}");
    let started = Instant::now();
    post_and_hang_up(
        addr,
        &tools_call(1, "send_email", email.clone(), run),
        mailer.sent_at_least(1),
    )
    .await?;
    println!(
        "  t = {:.2} s: the server sent the email; the client hangs up without its answer",
        started.elapsed().as_secs_f64()
    );

    println!("request 2 (id 2): the same call again, same run id");
    let answer = post(addr, &tools_call(2, "send_email", email.clone(), run)).await?;
    println!(
        "  t = {:.2} s: answer to id {}: {}",
        started.elapsed().as_secs_f64(),
        answer["id"],
        structured(&answer)?
    );

    println!("request 3 (id 3): once more");
    let answer = post(addr, &tools_call(3, "send_email", email, run)).await?;
    println!(
        "  t = {:.2} s: answer to id {}: {}",
        started.elapsed().as_secs_f64(),
        answer["id"],
        structured(&answer)?
    );

    let sent = mailer.outbox().len();
    println!();
    println!("emails sent: {sent}");
    if sent != 1 {
        return Err(format!("{sent} emails went out for one request").into());
    }
    Ok(())
}
