//! Renewals of many bodies running at once, in a test binary of their own: what it
//! checks is timing (each of two thousand claims renewed within its lease), which the
//! server tests run beside it in one binary would load on a 2-core machine. The Redis
//! server comes from `IDEM_REDIS_URL`; without it that test says it skipped.

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use idem_core::{Error, MemoryStore, Run, Store, Tool};

/// 2,000 bodies, each running past three of its 1 s leases, called through `first`.
/// Two leases in, another caller (through `second`, a store sharing `first`'s records)
/// calls every key without waiting: each claim is still held, so it gets `InProgress`
/// and runs nothing. Each body runs once, and each first caller gets its value.
/// The stores' tests take turns, so that each has the machine to itself.
async fn many_running_bodies_keep_their_claims(first: Arc<dyn Store>, second: Arc<dyn Store>) {
    static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _turn = ONE_AT_A_TIME.lock().await;
    const BODIES: u32 = 2_000;
    let lease = Duration::from_millis(1_000);
    let ran = Arc::new(AtomicUsize::new(0));
    let tool = Tool::new("long_body")
        .lease(lease)
        .ttl(Duration::from_secs(60));
    let call = |store: &Arc<dyn Store>, tool: &Tool, n: u32| {
        let (run, ran, tool) = (
            Run::new("renewals").with_shared_store(Arc::clone(store)),
            ran.clone(),
            tool.clone(),
        );
        tokio::spawn(async move {
            tool.call(&run, &n, move |_| async move {
                ran.fetch_add(1, SeqCst);
                tokio::time::sleep(lease * 3).await;
                Ok::<_, Error>(n * 2)
            })
            .await
        })
    };
    let firsts: Vec<_> = (0..BODIES).map(|n| call(&first, &tool, n)).collect();
    tokio::time::sleep(lease * 2).await;
    let impatient = tool.clone().fail_fast();
    let seconds: Vec<_> = (0..BODIES).map(|n| call(&second, &impatient, n)).collect();
    let mut taken = 0;
    for (n, second) in (0..BODIES).zip(seconds) {
        match second.await.unwrap() {
            Err(Error::InProgress { .. }) => {}
            other => {
                taken += 1;
                eprintln!("the other caller's call of {n}: {other:?}");
            }
        }
    }
    assert_eq!(taken, 0, "claims the other caller found lapsed");
    for (n, first) in (0..BODIES).zip(firsts) {
        assert_eq!(
            first.await.unwrap().unwrap(),
            n * 2,
            "the first caller of {n}"
        );
    }
    assert_eq!(ran.load(SeqCst), BODIES as usize, "each body ran once");
}

/// On the memory store, whose renewals are a write to a map.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_renewals_of_many_running_bodies_keep_their_claims() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    many_running_bodies_keep_their_claims(Arc::clone(&store), store).await;
}

/// On Redis, the other caller through a second store on the same prefix (another
/// worker). Run on threads, 32 at most at once, the renewals fell behind under a
/// lease of 300–400 ms: the other worker found lapsed claims, took them over and ran
/// the bodies again. The lease here is 1 s so that the test holds with both cores
/// busy (at 400 ms a busy machine lapsed claims whatever runs the renewals); it
/// catches renewals that stall, not every slowdown.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_renewals_of_many_running_bodies_keep_their_claims() {
    let Some(url) = std::env::var("IDEM_REDIS_URL")
        .ok()
        .filter(|u| !u.is_empty())
    else {
        eprintln!("SKIPPED: IDEM_REDIS_URL is not set; this Redis test checked nothing");
        return;
    };
    let prefix = format!("idem-renewals-{}:", std::process::id());
    let connect = || {
        idem_core::RedisStore::builder(&url)
            .prefix(prefix.clone())
            .connect()
    };
    let (first, second) = (connect().await.unwrap(), connect().await.unwrap());
    many_running_bodies_keep_their_claims(Arc::new(first), Arc::new(second)).await;
}
