//! Renewals of many bodies running at once on the Redis store, in a test binary of
//! their own: what it checks is timing (each claim renewed within its lease while a
//! thousand run), which the other server tests, run beside it in one binary, would
//! load on a 2-core machine. The server comes from `IDEM_REDIS_URL`; without it the
//! test says it skipped.

#![cfg(feature = "redis")]

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use idem_core::{Error, RedisStore, Run, Tool};

/// Renewals keep up with many bodies running at once: 1,000 bodies, each running past
/// three of its 300 ms leases on one store. Two leases in, another worker (a second
/// store on the same prefix) calls every key without waiting: each claim is still
/// held, so it gets `InProgress` and runs nothing. Each body runs once, and each first
/// caller gets its value. (Renewals run on threads, 32 at a time, fell behind here:
/// the other worker found lapsed claims, took them over and ran the bodies again.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_renewals_of_many_running_bodies_keep_their_claims() {
    let Some(url) = std::env::var("IDEM_REDIS_URL")
        .ok()
        .filter(|u| !u.is_empty())
    else {
        eprintln!("SKIPPED: IDEM_REDIS_URL is not set; this Redis test checked nothing");
        return;
    };
    const BODIES: u32 = 2_000;
    let prefix = format!("idem-renewals-{}:", std::process::id());
    let connect = || RedisStore::builder(&url).prefix(prefix.clone()).connect();
    let (first, second) = (connect().await.unwrap(), connect().await.unwrap());
    let lease = Duration::from_millis(400);
    let ran = Arc::new(AtomicUsize::new(0));
    let tool = Tool::new("long_body")
        .lease(lease)
        .ttl(Duration::from_secs(60));
    let call = |store: &RedisStore, tool: &Tool, n: u32| {
        let (run, ran, tool) = (
            Run::new("renewals").with_store(store.clone()),
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
                eprintln!("the other worker's call of {n}: {other:?}");
            }
        }
    }
    assert_eq!(taken, 0, "claims the other worker found lapsed");
    for (n, first) in (0..BODIES).zip(firsts) {
        assert_eq!(
            first.await.unwrap().unwrap(),
            n * 2,
            "the first caller of {n}"
        );
    }
    assert_eq!(ran.load(SeqCst), BODIES as usize, "each body ran once");
}
