//! idem's metrics on a Prometheus endpoint: the agent installs
//! `metrics-exporter-prometheus` as it would anyway, and idem (with its `metrics`
//! feature) counts calls by tool, outcome and store, times waits and store operations,
//! and counts takeovers and unknown outcomes.
//!
//! ```text
//! cargo run --features metrics --example prometheus             # prints the scrape
//! cargo run --features metrics --example prometheus -- --serve  # and keeps serving
//! ```
//!
//! The endpoint listens on `127.0.0.1:9464` (`--addr` to change it). The example makes
//! a few calls (sends, retries, a duplicate that waits), scrapes its own endpoint over
//! HTTP, and prints idem's lines.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use idem::{idempotent, MemoryStore, Run};
use metrics_exporter_prometheus::PrometheusBuilder;

#[derive(Parser)]
struct Args {
    /// Where the Prometheus endpoint listens.
    #[arg(long, default_value = "127.0.0.1:9464")]
    addr: SocketAddr,
    /// Keep serving the endpoint after the calls, until Ctrl-C.
    #[arg(long)]
    serve: bool,
}

#[idempotent(name = "send_email", ttl = "24h")]
async fn send_email(to: String) -> Result<String, idem::Error> {
    tokio::time::sleep(Duration::from_millis(50)).await;
    Ok(format!("msg-for-{to}"))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    PrometheusBuilder::new()
        .with_http_listener(args.addr)
        .install()?;
    // idem describes its metrics at its first call; after a recorder installed later,
    // this sends the descriptions again.
    idem::describe_metrics();

    let run = Run::new("run-42").with_store(MemoryStore::new());
    for to in ["ada@example.com", "bob@example.com", "cy@example.com"] {
        run.scope(send_email(to.into())).await?;
        // The agent's retry: replayed.
        run.scope(send_email(to.into())).await?;
    }
    // Two at once: one runs, the other waits for it.
    let (a, b) = tokio::join!(
        run.scope(send_email("di@example.com".into())),
        run.scope(send_email("di@example.com".into()))
    );
    a?;
    b?;

    let scrape = reqwest::get(format!("http://{}/metrics", args.addr))
        .await?
        .text()
        .await?;
    for line in scrape.lines().filter(|l| l.contains("idem_")) {
        println!("{line}");
    }
    if args.serve {
        println!("serving http://{}/metrics; Ctrl-C to stop", args.addr);
        tokio::signal::ctrl_c().await?;
    }
    Ok(())
}
