//! `MemoryStore`: records in a map behind a read-write lock, for tests and
//! single-process agents.

use std::collections::HashMap;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

use async_trait::async_trait;

use crate::record::{Record, State, Timestamp, Token};
use crate::store::{
    decide_claim, decide_fenced, is_replayable, Claim, ClaimRequest, Fenced, Outcome, Store,
};
use crate::{Error, Fingerprint, Key};

/// An in-process store: records live in a map behind a read-write lock and die with the
/// process. Hits share the read lock; claims, completions and releases take the write
/// lock. Records are shared (`Arc`), so a hit holds the lock only to find its record,
/// not while the result is decoded.
///
/// Cloning is cheap and clones share the map. Use it in tests and in agents that run in
/// one process and need no durability across restarts; use [`SledStore`](crate::SledStore)
/// (the default) when a completed call must survive a crash.
#[derive(Clone, Default)]
pub struct MemoryStore {
    records: Arc<RwLock<HashMap<Key, Arc<Record>>>>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many records the map holds, expired ones included until purged.
    pub fn len(&self) -> usize {
        self.read().len()
    }

    /// Whether the map holds no records.
    pub fn is_empty(&self) -> bool {
        self.read().is_empty()
    }

    // No code path panics while holding the lock; recover the map if one ever did.
    fn read(&self) -> RwLockReadGuard<'_, HashMap<Key, Arc<Record>>> {
        self.records
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, HashMap<Key, Arc<Record>>> {
        self.records
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn fenced(&self, key: &Key, token: Token, outcome: Option<(Outcome<'_>, Duration)>) -> Fenced {
        let mut map = self.write();
        match decide_fenced(map.get(key).map(|r| &**r), token, outcome, Timestamp::now()) {
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
    async fn claim(&self, key: &Key, request: &ClaimRequest) -> Result<Claim, Error> {
        let mut map = self.write();
        let (claim, write) = decide_claim(map.get(key).map(|r| &**r), request, Timestamp::now());
        if let Some(record) = write {
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
        Ok(self.fenced(key, token, Some((outcome, ttl))))
    }

    async fn release(&self, key: &Key, token: Token) -> Result<Fenced, Error> {
        Ok(self.fenced(key, token, None))
    }

    fn with_completed_result(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        replay: &mut dyn FnMut(&[u8]),
    ) {
        let now = Timestamp::now();
        // Out of the lock before `replay`, which runs the result's `Deserialize`.
        let record = self
            .read()
            .get(key)
            .filter(|r| is_replayable(r, fingerprint, now))
            .cloned();
        if let Some(State::Completed { result }) = record.as_deref().map(|r| &r.state) {
            replay(result);
        }
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>, Error> {
        let now = Timestamp::now();
        Ok(self
            .read()
            .get(key)
            .filter(|r| !r.is_expired(now))
            .map(|r| Record::clone(r)))
    }

    async fn delete(&self, key: &Key) -> Result<bool, Error> {
        let now = Timestamp::now();
        Ok(self.write().remove(key).is_some_and(|r| !r.is_expired(now)))
    }

    async fn purge_expired(&self) -> Result<u64, Error> {
        let now = Timestamp::now();
        let mut map = self.write();
        let before = map.len();
        map.retain(|_, r| !r.is_expired(now));
        Ok((before - map.len()) as u64)
    }
}
