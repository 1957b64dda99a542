//! The concurrency campaign: many tasks make random, overlapping calls over a set of
//! keys, with a short lease that slow bodies outlive, so claims are taken over while
//! their first owner still runs (takeover) and that owner's late completion must be
//! refused (fencing). For memory, sled, Postgres and Redis (each network store through
//! several independent connections, as separate workers would hold).
//!
//! Checked per key: every caller that got a value got the same one; the store holds
//! that value (no stale owner overwrote it); and the body ran exactly once per
//! completion: one execution completed, and every other execution's owner was told it
//! lost its lease.
//!
//! Postgres and Redis need `IDEM_POSTGRES_URL` / `IDEM_REDIS_URL`; without them those
//! cases print SKIPPED.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem::{idempotent, Error, Key, MemoryStore, Run, State, Store};

const TASKS: u64 = 24;
const CALLS_PER_TASK: u64 = 20;
const KEYS: u64 = 12;

/// What the bodies did, per key: the value of each execution.
#[derive(Default)]
struct Ledger {
    executions: Mutex<HashMap<u64, Vec<String>>>,
    keys: Mutex<HashMap<u64, Key>>,
}

static NONCE: AtomicU64 = AtomicU64::new(0);

/// A tool whose body sometimes outlives its 150 ms lease (a third of the calls sleep
/// 400 ms), so waiting duplicates take the claim over while it still runs.
#[idempotent(name = "slow_tool", lease = "150ms", wait = "20s", skip = [ledger, slow])]
async fn slow_tool(ledger: &Ledger, k: u64, slow: bool) -> Result<String, Error> {
    let value = format!("k{k}-v{}", NONCE.fetch_add(1, Ordering::SeqCst));
    if let Some(key) = idem::current_key() {
        ledger.keys.lock().unwrap().insert(k, key);
    }
    ledger
        .executions
        .lock()
        .unwrap()
        .entry(k)
        .or_default()
        .push(value.clone());
    let pause = if slow { 400 } else { (k * 7) % 30 };
    tokio::time::sleep(Duration::from_millis(pause)).await;
    Ok(value)
}

#[derive(Default)]
struct Seen {
    values: HashMap<u64, Vec<String>>,
    lost_lease: HashMap<u64, u32>,
}

/// Runs the campaign with `stores[i % n]` as task `i`'s store handle (all handles
/// reach the same records).
async fn campaign(stores: Vec<Arc<dyn Store>>) {
    let run_id = format!(
        "concurrency-{}-{}",
        std::process::id(),
        NONCE.fetch_add(1, Ordering::SeqCst)
    );
    let ledger = Arc::new(Ledger::default());
    let seen = Arc::new(Mutex::new(Seen::default()));
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let run =
            Run::new(run_id.clone()).with_shared_store(stores[t as usize % stores.len()].clone());
        let ledger = ledger.clone();
        let seen = seen.clone();
        tasks.push(tokio::spawn(async move {
            let mut rng = t.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            for _ in 0..CALLS_PER_TASK {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let k = rng % KEYS;
                let slow = rng % 3 == 0;
                let result = run.scope(slow_tool(&ledger, k, slow)).await;
                let mut seen = seen.lock().unwrap();
                match result {
                    Ok(value) => seen.values.entry(k).or_default().push(value),
                    Err(Error::LostLease { .. }) => *seen.lost_lease.entry(k).or_default() += 1,
                    Err(e) => panic!("key {k}: unexpected error {e}"),
                }
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }

    let executions = ledger.executions.lock().unwrap().clone();
    let keys = ledger.keys.lock().unwrap().clone();
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    let mut takeovers = 0;
    for k in 0..KEYS {
        let Some(values) = seen.values.get(&k) else {
            continue;
        };
        let first = &values[0];
        assert!(
            values.iter().all(|v| v == first),
            "key {k}: callers saw different values: {values:?}"
        );
        // The store holds what the callers got: no stale owner overwrote it.
        let record = stores[0].get(&keys[&k]).await.unwrap().expect("a record");
        let State::Completed { result } = record.state else {
            panic!("key {k}: not completed: {:?}", record.state);
        };
        let stored: String = serde_json::from_slice(&result).unwrap();
        assert_eq!(&stored, first, "key {k}: the store holds another value");
        // Exactly one execution completed; every other one's owner lost its lease.
        let ran = executions[&k].len() as u32;
        let lost = seen.lost_lease.get(&k).copied().unwrap_or(0);
        assert_eq!(
            ran,
            1 + lost,
            "key {k}: {ran} executions, 1 completion and {lost} lost leases"
        );
        assert!(executions[&k].contains(first));
        takeovers += lost;
    }
    let calls: usize = seen.values.values().map(Vec::len).sum();
    println!(
        "{} stores: {calls} calls answered, {takeovers} takeovers (stale owners fenced off)",
        stores.len()
    );
    assert!(
        takeovers > 0,
        "no lease expired mid-body: the campaign tested nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_store_concurrency_campaign() {
    campaign(vec![Arc::new(MemoryStore::new())]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sled_store_concurrency_campaign() {
    let dir = tempfile::tempdir().unwrap();
    campaign(vec![Arc::new(idem::SledStore::open(dir.path()).unwrap())]).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_store_concurrency_campaign() {
    let Ok(url) = std::env::var("IDEM_POSTGRES_URL") else {
        println!("SKIPPED postgres concurrency campaign: IDEM_POSTGRES_URL is not set");
        return;
    };
    let mut stores: Vec<Arc<dyn Store>> = Vec::new();
    for _ in 0..3 {
        let store = idem::PostgresStore::builder(&url)
            .table("idem_concurrency")
            .connect()
            .await
            .unwrap();
        stores.push(Arc::new(store));
    }
    campaign(stores).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_store_concurrency_campaign() {
    let Ok(url) = std::env::var("IDEM_REDIS_URL") else {
        println!("SKIPPED redis concurrency campaign: IDEM_REDIS_URL is not set");
        return;
    };
    let mut stores: Vec<Arc<dyn Store>> = Vec::new();
    for _ in 0..3 {
        let store = idem::RedisStore::builder(&url)
            .prefix("idem-concurrency:")
            .connect()
            .await
            .unwrap();
        stores.push(Arc::new(store));
    }
    campaign(stores).await;
}
