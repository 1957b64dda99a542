//! The crash campaign: for each store and each delivery policy, an agent loop of
//! idempotent tool calls runs in a worker process that is killed with SIGKILL at every
//! kind of point (before and after the claim, before and after the side effect, after
//! completion, at random moments), restarted with the same run id and left to finish.
//! Its agent also stops waiting for calls (before and after the side effect) and its
//! bodies panic (before and after the side effect); the agent retries at once. Then a
//! clean worker replays every op. Prints the table `docs/guarantees.md` publishes.
//!
//! ```text
//! cargo run --release --all-features --example crash_campaign -- --faults 1000
//! ```
//!
//! Postgres and Redis join when `IDEM_POSTGRES_URL` / `IDEM_REDIS_URL` are set (and
//! the `postgres` / `redis` features are on). The harness is in
//! `idem-testkit/src/campaign.rs`; `tests/crash_campaign.rs` runs it bounded in CI.

use std::process::Command;

use clap::Parser;
use idem_testkit::campaign::{self, Cell, Policy, StoreKind};

#[derive(Parser)]
#[command(
    about = "Kill -9 an agent, cancel its calls, panic its bodies at every kind of point; count duplicates and losses"
)]
struct Args {
    /// Faults per store and policy (kills, cancels and panics, in turn).
    #[arg(long, default_value_t = 60)]
    faults: u32,
    /// Seed of the kill plan (the same seed gives the same plan).
    #[arg(long, default_value_t = 0x1de3)]
    seed: u64,
    /// Only these stores (sled, postgres, redis); default: every one available.
    #[arg(long, value_delimiter = ',')]
    stores: Vec<String>,
    /// Only these policies (at-least-once, at-most-once, downstream); default: all.
    #[arg(long, value_delimiter = ',')]
    policies: Vec<String>,
}

fn main() {
    // Started again as a worker by the campaign itself.
    campaign::run_worker_if_asked();

    let args = Args::parse();
    let mut stores = vec![(StoreKind::Sled, String::new())];
    if cfg!(feature = "sqlite") {
        stores.push((StoreKind::Sqlite, String::new()));
    }
    if cfg!(feature = "postgres") {
        if let Ok(url) = std::env::var("IDEM_POSTGRES_URL") {
            stores.push((StoreKind::Postgres, url));
        }
    }
    if cfg!(feature = "redis") {
        if let Ok(url) = std::env::var("IDEM_REDIS_URL") {
            stores.push((StoreKind::Redis, url));
        }
    }
    if !args.stores.is_empty() {
        stores.retain(|(kind, _)| args.stores.contains(&kind.to_string()));
    }

    let worker = || Command::new(std::env::current_exe().expect("this program"));
    let mut reports = Vec::new();
    for (store, location) in &stores {
        for (i, policy) in [Policy::AtLeastOnce, Policy::AtMostOnce, Policy::Downstream]
            .into_iter()
            .enumerate()
        {
            let name = match policy {
                Policy::AtLeastOnce => "at-least-once",
                Policy::AtMostOnce => "at-most-once",
                Policy::Downstream => "downstream",
            };
            if !args.policies.is_empty() && !args.policies.iter().any(|p| p == name) {
                continue;
            }
            let cell = Cell {
                store: *store,
                location: location.clone(),
                policy,
                faults: args.faults,
                seed: args.seed + i as u64,
            };
            let report = campaign::run_cell(&cell, &worker);
            eprintln!(
                "{store} / {policy}: {} kills, {} cancels, {} panics {:?} in {:.1} s",
                report.kills, report.cancels, report.panics, report.kills_by_phase, report.seconds
            );
            reports.push(report);
        }
    }
    println!("{}", campaign::table(&reports));
}
