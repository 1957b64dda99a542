//! `MemoryStore`: records in maps behind read-write locks, for tests and single-process
//! agents (its docs say more).

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use async_trait::async_trait;

use crate::error::Error;
use crate::key::Fingerprint;
use crate::key_text::Key;
use crate::record::{Record, State, Timestamp, Token};
use crate::store::{
    decide_claim, decide_fenced, decide_resolution, is_replayable, page_by_key, Claim,
    ClaimRequest, Counts, Cursor, Fenced, Filter, Outcome, OwnerWrite, Page, Resolution, StateKind,
    Store,
};
use crate::{blocking, sync};

/// How many maps a [`MemoryStore`] spreads its records over, each behind its own lock.
/// A purge locks one map at a time, so a call waits at most for one map's share of the
/// walk (a few milliseconds with 10⁶ expired records, where one map made calls wait
/// 0.3 s: `cargo run --release --example purge`), and claims of keys in different maps
/// do not wait for each other.
const SHARDS: usize = 256;

const _: () = assert!(
    SHARDS.is_power_of_two(),
    "a shard is picked by the top bits of a hash"
);

/// One of the maps, behind its lock. Hashed with foldhash, seeded at random per
/// process as std's SipHash is, at a fraction of its cost on a key's 70-odd bytes.
type Shard = RwLock<HashMap<Key, Arc<Record>, foldhash::fast::RandomState>>;

/// An in-process store: records live in maps behind read-write locks and die with the
/// process. Hits share a read lock; claims, completions and releases take a write
/// lock, of the one map (of 256) that holds the key. Records are shared (`Arc`), so a
/// hit holds the lock only to find its record, not while the result is decoded.
///
/// Cloning is cheap and clones share the maps. Use it in tests and in agents that run
/// in one process and need no durability across restarts; use
/// [`SledStore`](crate::SledStore) (the default) when a completed call must survive a
/// crash.
#[derive(Clone)]
pub struct MemoryStore {
    shards: Arc<[Shard; SHARDS]>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore {
            shards: Arc::new(std::array::from_fn(|_| Shard::default())),
        }
    }
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many records the store holds, expired ones included until purged.
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|shard| sync::read(shard).len())
            .sum()
    }

    /// Whether the store holds no records.
    pub fn is_empty(&self) -> bool {
        self.shards.iter().all(|shard| sync::read(shard).is_empty())
    }

    /// The map that holds `key`: chosen by its last eight bytes, which for a derived key
    /// are hex digits of its SHA-256 digest, so keys spread evenly at the cost of a
    /// multiplication (hashing the whole key twice would slow every hit). Keys chosen
    /// by hand that share their last eight bytes share a map, which is still correct.
    fn shard(&self, key: &Key) -> &Shard {
        let bytes = key.as_str().as_bytes();
        let tail = match bytes.len().checked_sub(8) {
            Some(at) => bytes[at..].try_into().unwrap_or_default(),
            None => {
                let mut short = [0u8; 8];
                short[..bytes.len()].copy_from_slice(bytes);
                short
            }
        };
        // Fibonacci hashing: the product's top bits depend on every bit of the tail.
        let mixed = u64::from_le_bytes(tail).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        &self.shards[(mixed >> (64 - SHARDS.trailing_zeros())) as usize]
    }

    fn fenced(&self, key: &Key, token: Token, owner_write: OwnerWrite<'_>) -> Fenced {
        let mut map = sync::write(self.shard(key));
        match decide_fenced(
            map.get(key).map(|r| &**r),
            token,
            owner_write,
            Timestamp::now(),
        ) {
            Ok(Some(record)) => {
                map.insert(key.clone(), Arc::new(record));
                Fenced::Applied
            }
            Ok(None) => {
                map.remove(key);
                Fenced::Applied
            }
            Err(lost) => lost,
        }
    }
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("records", &self.len())
            .finish()
    }
}

#[async_trait]
impl Store for MemoryStore {
    fn name(&self) -> &'static str {
        "memory"
    }

    async fn claim(&self, key: &Key, request: &ClaimRequest) -> Result<Claim, Error> {
        let mut map = sync::write(self.shard(key));
        let (claim, new) = decide_claim(map.get(key).map(|r| &**r), request, Timestamp::now());
        if let Some(record) = new {
            map.insert(key.clone(), Arc::new(record));
        }
        Ok(claim)
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        outcome: Outcome<'_>,
        ttl: Duration,
    ) -> Result<Fenced, Error> {
        Ok(self.fenced(key, token, OwnerWrite::Complete { outcome, ttl }))
    }

    async fn release(&self, key: &Key, token: Token) -> Result<Fenced, Error> {
        Ok(self.fenced(key, token, OwnerWrite::Release))
    }

    async fn renew(
        &self,
        key: &Key,
        token: Token,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Fenced, Error> {
        Ok(self.fenced(key, token, OwnerWrite::Renew { lease, ttl }))
    }

    fn with_completed_result(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        replay: &mut dyn FnMut(&[u8]),
    ) {
        let now = Timestamp::now();
        // Out of the lock before `replay`, which runs the result's `Deserialize`.
        let record = sync::read(self.shard(key))
            .get(key)
            .filter(|r| is_replayable(r, fingerprint, now))
            .cloned();
        if let Some(State::Completed { result }) = record.as_deref().map(|r| &r.state) {
            replay(result);
        }
    }

    /// Pages in key order: each page walks the maps for the live records past the
    /// cursor that match, and sorts the first `limit` of them (the store is for one
    /// process's records, not for millions: a walk over all of them is quadratic).
    async fn list(
        &self,
        filter: &Filter,
        after: Option<&Cursor>,
        limit: usize,
    ) -> Result<Page, Error> {
        let now = Timestamp::now();
        let after = after.map(|c| c.0.as_str());
        let mut found = Vec::new();
        for shard in self.shards.iter() {
            found.extend(
                sync::read(shard)
                    .iter()
                    .filter(|(key, record)| {
                        after.is_none_or(|after| key.as_str() > after)
                            && !record.is_expired(now)
                            && filter.matches(key, record, now)
                    })
                    .map(|(key, record)| (key.clone(), Arc::clone(record))),
            );
        }
        // The first `limit + 1` in key order (one more, to know a next page exists).
        let keep = limit.max(1) + 1;
        if found.len() > keep {
            found.select_nth_unstable_by(keep - 1, |a, b| a.0.cmp(&b.0));
            found.truncate(keep);
        }
        found.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        let entries = found
            .into_iter()
            .map(|(key, record)| Ok((key.clone(), key, Ok(Record::clone(&record)))));
        let cursor = |key: Key| Cursor(key.as_str().to_owned());
        page_by_key(entries, cursor, filter, limit, now)
    }

    /// One walk of the maps.
    async fn count(&self, filter: &Filter) -> Result<Counts, Error> {
        let now = Timestamp::now();
        let mut counts = Counts::default();
        for shard in self.shards.iter() {
            for (key, record) in sync::read(shard).iter() {
                if !record.is_expired(now) && filter.matches(key, record, now) {
                    counts.add(StateKind::of(record, now));
                }
            }
        }
        Ok(counts)
    }

    async fn resolve(
        &self,
        key: &Key,
        token: Token,
        resolution: Resolution<'_>,
    ) -> Result<Fenced, Error> {
        let mut map = sync::write(self.shard(key));
        let now = Timestamp::now();
        match decide_resolution(map.get(key).map(|r| &**r), token, resolution, now) {
            Ok(Some(record)) => {
                map.insert(key.clone(), Arc::new(record));
            }
            Ok(None) => {
                map.remove(key);
            }
            Err(lost) => return Ok(lost),
        }
        Ok(Fenced::Applied)
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>, Error> {
        let now = Timestamp::now();
        Ok(sync::read(self.shard(key))
            .get(key)
            .filter(|r| !r.is_expired(now))
            .map(|r| Record::clone(r)))
    }

    async fn delete(&self, key: &Key) -> Result<bool, Error> {
        let now = Timestamp::now();
        Ok(sync::write(self.shard(key))
            .remove(key)
            .is_some_and(|r| !r.is_expired(now)))
    }

    /// Decided and removed under the map's lock.
    async fn delete_settled(&self, key: &Key) -> Result<bool, Error> {
        let now = Timestamp::now();
        let mut map = sync::write(self.shard(key));
        match map.get(key) {
            Some(r) if !r.is_expired(now) && StateKind::of(r, now) != StateKind::Running => {
                map.remove(key);
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// One walk of the maps, each record judged and removed under its map's lock.
    async fn delete_matching(&self, filter: &Filter) -> Result<u64, Error> {
        let now = Timestamp::now();
        let mut removed = 0;
        for shard in self.shards.iter() {
            sync::write(shard).retain(|key, record| {
                let matches = !record.is_expired(now) && filter.matches(key, record, now);
                removed += u64::from(matches);
                !matches
            });
        }
        Ok(removed)
    }

    /// Walks the maps one at a time, so calls wait at most for one map's walk. The
    /// removed records are freed after the map's lock is released, on a blocking thread
    /// when there is a tokio runtime (in place if the OS starts no thread), and the task
    /// yields between maps, so other tasks on its thread go on too.
    async fn purge_expired(&self) -> Result<u64, Error> {
        let now = Timestamp::now();
        let (mut removed, mut garbage) = (0, Vec::new());
        for shard in self.shards.iter() {
            let mut expired = Vec::new();
            sync::write(shard).retain(|key, record| {
                let keep = !record.is_expired(now);
                if !keep {
                    expired.push((key.clone(), Arc::clone(record)));
                }
                keep
            });
            if !expired.is_empty() {
                removed += expired.len() as u64;
                garbage.push(expired);
            }
            tokio::task::yield_now().await;
        }
        if garbage.is_empty() {
            return Ok(0);
        }
        // Freeing is most of a purge's work. On a tokio runtime it goes to one blocking
        // thread, off the threads that run calls; nothing waits for it.
        if let Err(free) = blocking::hand_off(move || drop(garbage)) {
            free();
        }
        Ok(removed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::KeyParts;

    fn derived(i: u32) -> Key {
        let parts = KeyParts {
            tenant: None,
            run_id: "run",
            call_id: None,
            tool: "send_email",
        };
        Key::derive(&parts, &i).unwrap()
    }

    fn shard_index(store: &MemoryStore, key: &Key) -> usize {
        let shard: *const Shard = store.shard(key);
        store
            .shards
            .iter()
            .position(|s| std::ptr::eq(s, shard))
            .unwrap()
    }

    #[test]
    fn derived_keys_spread_over_every_map() {
        let store = MemoryStore::new();
        let mut counts = [0usize; SHARDS];
        let keys = 100 * SHARDS as u32;
        for i in 0..keys {
            counts[shard_index(&store, &derived(i))] += 1;
        }
        // 100 keys a map on average; a binomial spread stays well within 50..150.
        let (min, max) = (counts.iter().min(), counts.iter().max());
        assert!(
            min >= Some(&50) && max <= Some(&150),
            "keys per map from {min:?} to {max:?}"
        );
    }

    #[test]
    fn keys_chosen_by_hand_of_any_length_have_a_map() {
        let store = MemoryStore::new();
        let spread: std::collections::HashSet<usize> = ["", "a", "order-1", "order-2", "order-10"]
            .iter()
            .map(|text| shard_index(&store, &Key::from_text(*text)))
            .collect();
        assert!(spread.len() > 1, "every short key landed in one map");
    }

    /// `records` records under derived keys, every other one expired after 1 ms; waits
    /// until those have expired. Returns a handle on one expired record, to see when it
    /// is freed.
    fn filled(store: &MemoryStore, records: u32) -> std::sync::Weak<Record> {
        let mut expired = None;
        for i in 0..records {
            let ttl = Duration::from_millis(if i % 2 == 0 { 1 } else { 60_000 });
            let record = Arc::new(Record {
                fingerprint: Fingerprint::from_bytes([1; 32]),
                created_at: Timestamp::now(),
                expires_at: Timestamp::now().after(ttl),
                state: State::Completed {
                    result: b"\"sent\"".to_vec(),
                },
                meta: crate::record::Meta::default(),
            });
            expired.get_or_insert_with(|| Arc::downgrade(&record));
            let key = derived(i);
            sync::write(store.shard(&key)).insert(key, record);
        }
        std::thread::sleep(Duration::from_millis(20));
        expired.unwrap_or_default()
    }

    async fn purged_every_map(store: &MemoryStore) {
        assert_eq!(store.purge_expired().await.unwrap(), 1_000);
        assert_eq!(store.len(), 1_000);
        for i in 0..2_000 {
            let record = store.get(&derived(i)).await.unwrap();
            assert_eq!(record.is_some(), i % 2 == 1, "record {i} after the purge");
        }
    }

    #[tokio::test]
    async fn purge_empties_every_map_of_expired_records_and_frees_them() {
        let store = MemoryStore::new();
        let expired = filled(&store, 2_000);
        purged_every_map(&store).await;
        let start = std::time::Instant::now();
        while expired.strong_count() > 0 {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "a purged record was never freed"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// A runtime whose blocking pool can start no thread: the OS cannot map the stack
    /// it asks for (`tokio::task::spawn_blocking` panics there).
    #[test]
    fn purge_on_a_runtime_that_starts_no_thread_frees_in_place() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .thread_stack_size(usize::MAX >> 2)
            .build()
            .unwrap();
        let store = MemoryStore::new();
        let expired = filled(&store, 2_000);
        runtime.block_on(purged_every_map(&store));
        assert_eq!(expired.strong_count(), 0, "a purged record is still alive");
    }

    #[test]
    fn purge_without_a_runtime_frees_in_place() {
        let store = MemoryStore::new();
        let expired = filled(&store, 2_000);
        pollster::block_on(purged_every_map(&store));
        assert_eq!(expired.strong_count(), 0, "a purged record is still alive");
    }
}
