//! The crash campaign, bounded: for each store and each policy, a worker process is
//! killed with SIGKILL at every kind of point (before and after the claim, before and
//! after the side effect, after completion, and at random moments), restarted with the
//! same run id, and left to finish; its agent also stops waiting for a call (before and
//! after the side effect) and its body panics (before and after the side effect), and
//! the agent retries at once; then a clean worker replays every op.
//!
//! Sled always runs, SQLite with the `sqlite` feature; Postgres and Redis need `IDEM_POSTGRES_URL` / `IDEM_REDIS_URL`
//! (and the `postgres` / `redis` features) and print SKIPPED otherwise.
//! `cargo run --release --all-features --example crash_campaign -- --kills 1000` runs
//! the long campaign and prints the table.

use std::process::Command;

use idem_testkit::campaign::{self, Cell, Policy, Report, StoreKind};

/// Faults per store and policy: one at each of the ten kinds of point (six kills, two
/// cancels, two panics).
const FAULTS: u32 = 10;
/// The campaign tool's lease: a retry that took this long waited one out.
const LEASE_MS: f64 = 300.0;

/// The worker process: this test binary, started again by the campaign.
#[test]
#[ignore = "worker process of the crash campaign; started by it"]
fn campaign_worker() {
    campaign::run_worker_if_asked();
}

fn worker() -> Command {
    let mut command = Command::new(std::env::current_exe().expect("the test binary"));
    command.args(["--ignored", "--exact", "campaign_worker", "--quiet"]);
    command
}

fn check(store: StoreKind, location: &str) {
    let mut reports = Vec::new();
    for (i, policy) in [Policy::AtLeastOnce, Policy::AtMostOnce, Policy::Downstream]
        .into_iter()
        .enumerate()
    {
        let cell = Cell {
            store,
            location: location.to_owned(),
            policy,
            faults: FAULTS,
            seed: 0x1de3 + i as u64,
        };
        reports.push(campaign::run_cell(&cell, &worker));
    }
    println!("{}", campaign::table(&reports));
    for r in &reports {
        let cell = format!("{} / {}", r.store, r.policy);
        assert_eq!(
            r.kills + r.cancels + r.panics,
            FAULTS,
            "{cell}: every planned fault landed"
        );
        assert_eq!(
            r.kills_by_phase.len(),
            FAULTS as usize,
            "{cell}: faults at every kind of point: {:?}",
            r.kills_by_phase
        );
        assert!(
            r.max_retry_ms < LEASE_MS,
            "{cell}: a retry after a cancel or panic took {} ms: it waited out the lease",
            r.max_retry_ms
        );
        assert_eq!(r.duplicates_elsewhere, 0, "{cell}: duplicate side effects");
        assert_eq!(r.lost_completions, 0, "{cell}: lost completions");
        assert_eq!(
            r.inconsistent_answers, 0,
            "{cell}: callers saw different values"
        );
        assert_eq!(r.reopen_failures, 0, "{cell}: the store did not reopen");
        assert_eq!(r.worker_failures, 0, "{cell}: a worker failed or hung");
        match r.policy.as_str() {
            "at-least-once" => assert_eq!(r.unknown, 0, "{cell}"),
            _ => assert_eq!(
                r.duplicates_in_window, 0,
                "{cell}: no duplicate even in the crash window"
            ),
        }
        assert!(r.executions >= r.ops - r.unknown, "{cell}: every op ran");
    }
    let at_least_once: &Report = &reports[0];
    assert!(
        at_least_once.kills_by_phase.contains_key("AfterEffect"),
        "the crash window was exercised"
    );
}

#[test]
fn sled_survives_the_crash_campaign() {
    check(StoreKind::Sled, "");
}

#[cfg(feature = "sqlite")]
#[test]
fn sqlite_survives_the_crash_campaign() {
    check(StoreKind::Sqlite, "");
}

#[cfg(feature = "postgres")]
#[test]
fn postgres_survives_the_crash_campaign() {
    match std::env::var("IDEM_POSTGRES_URL") {
        Ok(url) => check(StoreKind::Postgres, &url),
        Err(_) => println!("SKIPPED postgres crash campaign: IDEM_POSTGRES_URL is not set"),
    }
}

#[cfg(feature = "redis")]
#[test]
fn redis_survives_the_crash_campaign() {
    match std::env::var("IDEM_REDIS_URL") {
        Ok(url) => check(StoreKind::Redis, &url),
        Err(_) => println!("SKIPPED redis crash campaign: IDEM_REDIS_URL is not set"),
    }
}
