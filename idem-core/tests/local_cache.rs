//! `LocalCache` in front of a store: what it answers from memory, what it leaves to the
//! store, and the trade it documents (a removal elsewhere is seen after `max_age`).
//!
//! The store behind the cache counts the claims that reach it, so each test can say
//! which calls the cache answered.

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use idem_core::__private::{execute, CacheErrors, Call, ReleaseErrors};
use idem_core::store::{Claim, ClaimRequest, Fenced, Fingerprint, Outcome, Token};
use idem_core::{Error, Key, LocalCache, MemoryStore, Options, Run, Store};
use idem_testkit::faults::Faulty;

/// The store behind the cache: a memory store that counts the claims it is asked.
type Counted = Faulty<MemoryStore>;

/// A shared store (`behind`, as other processes see it) and this process's cache in
/// front of it.
fn cached(max_age: Duration) -> (Counted, Arc<LocalCache<Counted>>) {
    let behind = Counted::default();
    let cache = Arc::new(LocalCache::new(behind.clone()).max_age(max_age));
    (behind, cache)
}

/// Calls tool `send` with `input` on `run`, counting runs of its body in `runs`.
async fn send(
    run: &Run,
    options: Options,
    input: &str,
    runs: &AtomicUsize,
) -> Result<String, Error> {
    let call = Call::new(Some(run), "send", options, input);
    execute::<Result<String, Error>, ReleaseErrors, _>(call, async {
        let n = runs.fetch_add(1, SeqCst) + 1;
        Ok(format!("sent {input} #{n}"))
    })
    .await?
}

const MINUTE: Duration = Duration::from_secs(60);

#[tokio::test]
async fn results_this_process_completed_are_replayed_without_asking_the_store() {
    let (behind, cache) = cached(MINUTE);
    let run = Run::new("r").with_store(cache.clone());
    let runs = AtomicUsize::new(0);
    let first = send(&run, Options::new(), "a", &runs).await.unwrap();
    assert_eq!(behind.claims(), 1);
    for _ in 0..5 {
        assert_eq!(send(&run, Options::new(), "a", &runs).await.unwrap(), first);
    }
    assert_eq!(runs.load(SeqCst), 1, "the body ran once");
    assert_eq!(behind.claims(), 1, "no hit reached the store");
    assert_eq!(cache.cached(), 1);
    // The store holds the result too, for every other process.
    let other = Run::new("r").with_store(behind.clone());
    assert_eq!(
        send(&other, Options::new(), "a", &runs).await.unwrap(),
        first
    );
    assert_eq!(runs.load(SeqCst), 1);
}

#[tokio::test]
async fn a_result_is_not_replayed_past_its_ttl() {
    let (behind, cache) = cached(MINUTE);
    let run = Run::new("r").with_store(cache);
    let runs = AtomicUsize::new(0);
    let options = Options::new().ttl(Duration::from_millis(150));
    let first = send(&run, options, "a", &runs).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let second = send(&run, options, "a", &runs).await.unwrap();
    assert_ne!(first, second, "the record expired, so the call ran again");
    assert_eq!(runs.load(SeqCst), 2);
    assert_eq!(behind.claims(), 2);
}

/// The documented trade: a removal behind the cache is seen once `max_age` ends, and a
/// removal through the cache at once.
#[tokio::test]
async fn a_removal_elsewhere_is_seen_after_max_age_and_through_the_cache_at_once() {
    // Long enough that the replay right after the removal is surely within it.
    let (behind, cache) = cached(Duration::from_millis(500));
    let run = Run::new("r").with_store(cache.clone());
    let runs = AtomicUsize::new(0);
    let first = send(&run, Options::new(), "a", &runs).await.unwrap();
    let key = Call::new(Some(&run), "send", Options::new(), "a")
        .unwrap()
        .key()
        .clone();

    assert!(behind.delete(&key).await.unwrap());
    assert_eq!(
        send(&run, Options::new(), "a", &runs).await.unwrap(),
        first,
        "within max_age the cache still replays"
    );
    tokio::time::sleep(Duration::from_millis(600)).await;
    let second = send(&run, Options::new(), "a", &runs).await.unwrap();
    assert_ne!(
        second, first,
        "after max_age the store decides: absent, so it ran"
    );
    assert_eq!(runs.load(SeqCst), 2);

    assert!(cache.delete(&key).await.unwrap());
    let third = send(&run, Options::new(), "a", &runs).await.unwrap();
    assert_ne!(
        third, second,
        "deleted through the cache: ran again at once"
    );
    assert_eq!(runs.load(SeqCst), 3);
}

#[tokio::test]
async fn another_input_under_a_cached_key_is_a_mismatch() {
    let (_, cache) = cached(MINUTE);
    let run = Run::new("r").with_store(cache);
    let runs = AtomicUsize::new(0);
    let call =
        |input: &'static str| Call::with_key(Some(&run), "send", Options::new(), input, "same key");
    let first = execute::<Result<String, Error>, ReleaseErrors, _>(call("a"), async {
        runs.fetch_add(1, SeqCst);
        Ok("sent a".to_owned())
    })
    .await
    .unwrap()
    .unwrap();
    assert_eq!(first, "sent a");
    let other = execute::<Result<String, Error>, ReleaseErrors, _>(call("b"), async {
        runs.fetch_add(1, SeqCst);
        Ok("sent b".to_owned())
    })
    .await;
    assert!(
        matches!(other, Err(Error::PayloadMismatch { .. })),
        "{other:?}"
    );
    assert_eq!(runs.load(SeqCst), 1);
}

#[tokio::test]
async fn results_replayed_from_the_store_are_not_kept() {
    let (behind, cache) = cached(MINUTE);
    let runs = AtomicUsize::new(0);
    // Another process ran it.
    let elsewhere = Run::new("r").with_store(behind.clone());
    let first = send(&elsewhere, Options::new(), "a", &runs).await.unwrap();
    let run = Run::new("r").with_store(cache.clone());
    for _ in 0..3 {
        assert_eq!(send(&run, Options::new(), "a", &runs).await.unwrap(), first);
    }
    assert_eq!(runs.load(SeqCst), 1);
    assert_eq!(behind.claims(), 4, "each hit here was the store's");
    assert_eq!(cache.cached(), 0);
}

/// A stale owner's completion is refused by the store, and the cache keeps nothing of
/// it: the next call replays the new owner's result.
#[tokio::test]
async fn a_stale_owner_leaves_nothing_in_the_cache() {
    let (behind, cache) = cached(MINUTE);
    let key = Key::from_text("stale");
    let request = |token| ClaimRequest {
        origin: idem_core::store::Origin::new("run", "stale"),
        fingerprint: Fingerprint::from_bytes([1; 32]),
        token,
        lease: Duration::from_millis(100),
        ttl: MINUTE,
        take_over_expired: true,
        retry_failed: false,
    };
    let stale = Token::generate().unwrap();
    let owner = Token::generate().unwrap();
    assert_eq!(
        cache.claim(&key, &request(stale)).await.unwrap(),
        Claim::Acquired { took_over: false }
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Another process takes the abandoned claim over and completes.
    assert_eq!(
        behind.claim(&key, &request(owner)).await.unwrap(),
        Claim::Acquired { took_over: true }
    );
    let fresh = Outcome::Completed(b"\"fresh\"");
    assert_eq!(
        behind.complete(&key, owner, fresh, MINUTE).await.unwrap(),
        Fenced::Applied
    );
    let late = Outcome::Completed(b"\"stale\"");
    assert_eq!(
        cache.complete(&key, stale, late, MINUTE).await.unwrap(),
        Fenced::LostLease
    );
    assert_eq!(cache.cached(), 0);
    assert_eq!(
        cache
            .claim(&key, &request(Token::generate().unwrap()))
            .await
            .unwrap(),
        Claim::Completed(b"\"fresh\"".to_vec())
    );
}

#[tokio::test]
async fn cached_errors_are_left_to_the_store() {
    let (behind, cache) = cached(MINUTE);
    let run = Run::new("r").with_store(cache.clone());
    let runs = AtomicUsize::new(0);
    for _ in 0..3 {
        let call = Call::new(Some(&run), "charge", Options::new(), "card");
        let declined = execute::<Result<String, String>, CacheErrors, _>(call, async {
            runs.fetch_add(1, SeqCst);
            Err("declined".to_owned())
        })
        .await
        .unwrap();
        assert_eq!(declined, Err("declined".to_owned()));
    }
    assert_eq!(runs.load(SeqCst), 1, "the stored error was replayed");
    assert_eq!(behind.claims(), 3, "by the store, every time");
    assert_eq!(cache.cached(), 0);
}

/// The cache keeps about `max_bytes`, dropping the oldest results first; a dropped
/// result is the store's to replay again.
#[tokio::test]
async fn memory_is_bounded_and_the_oldest_go_first() {
    let behind = Counted::default();
    let cache = Arc::new(LocalCache::new(behind.clone()).max_bytes(4 << 10));
    let run = Run::new("r").with_store(cache.clone());
    let runs = AtomicUsize::new(0);
    for i in 0..100 {
        send(&run, Options::new(), &format!("{i}"), &runs)
            .await
            .unwrap();
    }
    let kept = cache.cached();
    assert!(kept > 0 && kept < 100, "{kept} results kept");
    let claims = behind.claims();
    send(&run, Options::new(), "99", &runs).await.unwrap();
    assert_eq!(behind.claims(), claims, "the newest is kept");
    send(&run, Options::new(), "0", &runs).await.unwrap();
    assert_eq!(behind.claims(), claims + 1, "the oldest was dropped");
    assert_eq!(runs.load(SeqCst), 100, "and replayed by the store");
}

/// Purging drops the results whose time is up, as it drops the store's expired records.
#[tokio::test]
async fn purge_drops_stale_results() {
    let (_, cache) = cached(Duration::from_millis(100));
    let run = Run::new("r").with_store(cache.clone());
    let runs = AtomicUsize::new(0);
    send(&run, Options::new(), "a", &runs).await.unwrap();
    send(&run, Options::new().ttl(MINUTE), "b", &runs)
        .await
        .unwrap();
    assert_eq!(cache.cached(), 2);
    tokio::time::sleep(Duration::from_millis(200)).await;
    cache.purge_expired().await.unwrap();
    assert_eq!(cache.cached(), 0, "max_age is up for both");
}
