//! Values a store holds that are not records this build reads (another program's keys
//! under the prefix, damaged records, keys that are not UTF-8) are reported by listings
//! and counts, never fatal to them, and never make a listing loop.
//!
//! The Redis test needs `IDEM_REDIS_URL`; without it, it says it skipped and checks
//! nothing.

#![cfg(all(feature = "redis", feature = "sled"))]

mod common;

use std::time::Duration;

use idem_core::store::{Claim, ClaimRequest, Filter, Fingerprint, Origin, Outcome, Token};
use idem_core::{Key, RedisStore, SledStore, Store};

/// Completes one record under `key`.
async fn one_record(store: &dyn Store, key: &str) {
    let request = ClaimRequest {
        origin: Origin::new("run", "tool"),
        fingerprint: Fingerprint::from_bytes([1; 32]),
        token: Token::generate().unwrap(),
        lease: Duration::from_secs(60),
        ttl: Duration::from_secs(60),
        take_over_expired: false,
        retry_failed: false,
    };
    let key = Key::from_text(key);
    assert_eq!(
        store.claim(&key, &request).await.unwrap(),
        Claim::Acquired { took_over: false }
    );
    let done = store.complete(&key, request.token, Outcome::Completed(b"1"), request.ttl);
    done.await.unwrap();
}

/// Walks every page of `limit`; returns the keys of records and of unreadable values.
async fn walk(store: &dyn Store, limit: usize) -> (Vec<String>, Vec<String>) {
    let (mut records, mut unreadable, mut after, mut pages) = (vec![], vec![], None, 0);
    loop {
        let page = store
            .list(&Filter::default(), after.as_ref(), limit)
            .await
            .unwrap();
        pages += 1;
        // SCAN walks the whole database a page at a time: other tests' keys count.
        assert!(pages < 100_000, "the listing does not end");
        records.extend(page.records.iter().map(|l| l.key.to_string()));
        unreadable.extend(page.unreadable.iter().map(|u| u.key.to_string()));
        match page.next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    records.sort();
    unreadable.sort();
    (records, unreadable)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sled_lists_past_values_it_cannot_read() {
    let dir = tempfile::tempdir().unwrap();
    {
        let db = sled::open(dir.path()).unwrap();
        let tree = db.open_tree(SledStore::TREE).unwrap();
        tree.insert(&b"tool.\xfe"[..], &b"junk"[..]).unwrap();
        tree.insert(&b"tool.\xff"[..], &b"junk"[..]).unwrap();
        tree.insert("tool.garbage", &b"not a record"[..]).unwrap();
        db.flush().unwrap();
    }
    let store = common::open_after_raw(dir.path());
    one_record(&store, "tool.a").await;
    one_record(&store, "tool.z").await;
    for limit in [1, 2, 1000] {
        let (records, unreadable) = walk(&store, limit).await;
        assert_eq!(records, ["tool.a", "tool.z"], "pages of {limit}");
        assert_eq!(unreadable.len(), 3, "pages of {limit}: {unreadable:?}");
    }
    let counts = store.count(&Filter::default()).await.unwrap();
    assert_eq!((counts.completed, counts.unreadable), (2, 3));
    assert!(store.delete(&Key::from_text("tool.garbage")).await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_lists_past_values_it_cannot_read() {
    let Some(url) = std::env::var("IDEM_REDIS_URL")
        .ok()
        .filter(|u| !u.is_empty())
    else {
        eprintln!("SKIPPED: IDEM_REDIS_URL is not set; this test checked nothing");
        return;
    };
    let seed = (Token::generate().unwrap().to_bits() >> 64) as u64;
    let prefix = format!("idem-unreadable-{}-{seed:016x}:", std::process::id());
    let store = RedisStore::builder(&url)
        .prefix(&prefix)
        .connect()
        .await
        .unwrap();
    one_record(&store, "tool.a").await;
    one_record(&store, "tool.kept").await;
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let at = |name: &str| format!("{prefix}{name}");
    let mut raw_key = at("tool.").into_bytes();
    raw_key.push(0xff);
    let copy: Vec<u8> = redis::cmd("GET")
        .arg(at("tool.kept"))
        .query_async(&mut conn)
        .await
        .unwrap();
    let mut pipe = redis::pipe();
    pipe.cmd("RPUSH").arg(at("tool.list")).arg("x").ignore();
    pipe.cmd("SET")
        .arg(at("tool.junk"))
        .arg("junk")
        .arg("PX")
        .arg(60_000)
        .ignore();
    // A record copied without its expiry.
    pipe.cmd("SET").arg(at("tool.forever")).arg(copy).ignore();
    pipe.cmd("SET")
        .arg(raw_key)
        .arg("junk")
        .arg("PX")
        .arg(60_000)
        .ignore();
    let _: () = pipe.query_async(&mut conn).await.unwrap();
    for limit in [10, 1000] {
        let (records, unreadable) = walk(&store, limit).await;
        assert_eq!(records, ["tool.a", "tool.kept"], "pages of {limit}");
        assert_eq!(unreadable.len(), 4, "pages of {limit}: {unreadable:?}");
    }
    let counts = store.count(&Filter::default()).await.unwrap();
    assert_eq!((counts.completed, counts.unreadable), (2, 4));
    let _: () = redis::cmd("EVAL")
        .arg("for _, k in ipairs(redis.call('KEYS', ARGV[1])) do redis.call('DEL', k) end")
        .arg(0)
        .arg(format!("{prefix}*"))
        .query_async(&mut conn)
        .await
        .unwrap();
}
