//! `LocalCache`: results this process completed, replayed from memory in front of a
//! shared store (its docs give what is kept and the trade it makes).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use async_trait::async_trait;

use crate::error::Error;
use crate::key::Fingerprint;
use crate::key_text::Key;
use crate::record::{Record, Token};
use crate::store::{
    Claim, ClaimRequest, Counts, Cursor, Fenced, Filter, Outcome, Page, Resolution, Store,
};

/// How long a result is kept by default.
pub(crate) const DEFAULT_MAX_AGE: Duration = Duration::from_secs(60);

/// How many bytes of results and keys are kept by default: 16 MiB.
pub(crate) const DEFAULT_MAX_BYTES: usize = 16 << 20;

/// What an entry costs besides its key and result: the map slot, the queue slot, the
/// `Arc` headers.
const ENTRY_OVERHEAD: usize = 96;

/// A store in front of another: results this process completed are replayed from
/// memory for up to `max_age`; everything else is the wrapped store's (see below for
/// what is kept and the trade it makes).
///
/// ```no_run
/// # async fn demo() -> Result<(), idem_core::Error> {
/// use std::time::Duration;
/// use idem_core::LocalCache;
/// # #[cfg(feature = "redis")] {
/// use idem_core::{RedisStore, Run};
///
/// let store = LocalCache::new(RedisStore::connect("redis://127.0.0.1:6379").await?)
///     .max_age(Duration::from_secs(30));
/// let run = Run::new("run-1").with_store(store);
/// # }
/// # Ok(()) }
/// ```
///
/// `LocalCache`: results this process completed, replayed from memory in front of a
/// shared store.
///
/// A hit on Postgres or Redis costs a round trip. When the retry of a call comes back
/// to the worker that ran it, [`LocalCache`] answers from memory instead: it keeps the
/// results this process itself stored, each for at most `max_age` and never longer than
/// its TTL from the moment its completion began (so not past its record's expiry), and
/// asks the store it wraps about everything else. Both are counted on the monotonic
/// clock, so a wall clock that jumps does not stretch them.
///
/// # What it keeps, and what it does not
///
/// - Only completed results that a claim *by this process* acquired and this process
///   completed: it knows their fingerprint (from the claim) and a time before their
///   record expires (the completion began before the store wrote the record, which
///   then lives for the TTL).
///   Results it only replayed from the store are not kept: their expiry would cost
///   another round trip to learn.
/// - Nothing in progress, failed or mismatched: the store decides those, so every
///   guarantee about concurrent duplicates, leases and fencing is the store's.
/// - A cached result is replayed only for the same fingerprint; another input falls
///   through to the store, which reports the mismatch.
///
/// # The trade
///
/// A record removed from the shared store by another process (its `delete`, or by hand
/// on the server) goes on being replayed here until `max_age` ends. A `delete` through
/// this cache takes effect here at once. Keep `max_age` below the time within which a
/// removal must be seen everywhere; the default is one minute.
///
/// Memory is bounded by `max_bytes` (results and keys; default 16 MiB): the oldest
/// entries go first.
pub struct LocalCache<S> {
    inner: S,
    max_age: Duration,
    max_bytes: usize,
    entries: Mutex<Entries>,
}

/// The cached entries, and the order they came in (oldest first).
#[derive(Default)]
struct Entries {
    map: HashMap<Key, Entry>,
    /// Keys with the `seq` of the entry they were pushed for; a key whose entry was
    /// replaced since is skipped when it comes up.
    order: VecDeque<(Key, u64)>,
    bytes: usize,
    next_seq: u64,
}

struct Entry {
    seq: u64,
    held: Held,
}

enum Held {
    /// This process's claim, waiting for its completion.
    Claimed {
        token: Token,
        fingerprint: Fingerprint,
    },
    /// A result this process completed, replayable until `until`.
    Completed {
        fingerprint: Fingerprint,
        result: Arc<[u8]>,
        until: Instant,
    },
}

impl Entries {
    fn size(key: &Key, held: &Held) -> usize {
        let result = match held {
            Held::Claimed { .. } => 0,
            Held::Completed { result, .. } => result.len(),
        };
        key.as_str().len() + result + ENTRY_OVERHEAD
    }

    /// The result under `key`, if it is completed for `fingerprint` and still fresh.
    fn result(&self, key: &Key, fingerprint: &Fingerprint) -> Option<Arc<[u8]>> {
        match &self.map.get(key)?.held {
            Held::Completed {
                fingerprint: f,
                result,
                until,
            } if f == fingerprint && Instant::now() < *until => Some(result.clone()),
            _ => None,
        }
    }

    fn insert(&mut self, key: &Key, held: Held, max_bytes: usize) {
        self.remove(key);
        let size = Self::size(key, &held);
        if size > max_bytes {
            return;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.bytes += size;
        self.map.insert(key.clone(), Entry { seq, held });
        self.order.push_back((key.clone(), seq));
        while self.bytes > max_bytes {
            let Some((oldest, seq)) = self.order.pop_front() else {
                break;
            };
            if self.map.get(&oldest).is_some_and(|e| e.seq == seq) {
                self.remove(&oldest);
            }
        }
        // Keys replaced or removed since they were pushed leave stale queue slots;
        // drop them before they outnumber the live ones.
        if self.order.len() > 2 * self.map.len() + 64 {
            let map = &self.map;
            self.order
                .retain(|(key, seq)| map.get(key).is_some_and(|e| e.seq == *seq));
        }
    }

    fn remove(&mut self, key: &Key) -> Option<Held> {
        let entry = self.map.remove(key)?;
        self.bytes -= Self::size(key, &entry.held);
        Some(entry.held)
    }

    /// Drops every result this process keeps (claims stay: their owners complete them).
    fn drop_results(&mut self) {
        let bytes = &mut self.bytes;
        self.map.retain(|key, entry| {
            let result = matches!(entry.held, Held::Completed { .. });
            if result {
                *bytes -= Self::size(key, &entry.held);
            }
            !result
        });
    }

    /// Drops the results no longer fresh at `now` (their queue slots go when they come
    /// up).
    fn drop_stale(&mut self, now: Instant) {
        let bytes = &mut self.bytes;
        self.map.retain(|key, entry| {
            let stale = matches!(entry.held, Held::Completed { until, .. } if until <= now);
            if stale {
                *bytes -= Self::size(key, &entry.held);
            }
            !stale
        });
    }

    /// Removes the claim `token` holds on `key`, returning its fingerprint.
    fn take_claim(&mut self, key: &Key, token: Token) -> Option<Fingerprint> {
        match self.map.get(key)?.held {
            Held::Claimed {
                token: t,
                fingerprint,
            } if t == token => {
                self.remove(key);
                Some(fingerprint)
            }
            _ => None,
        }
    }
}

impl<S: Store> LocalCache<S> {
    /// `inner` with a cache in front, keeping results for 60 s within 16 MiB (see
    /// [`LocalCache::max_age`] and [`LocalCache::max_bytes`]).
    pub fn new(inner: S) -> Self {
        LocalCache {
            inner,
            max_age: DEFAULT_MAX_AGE,
            max_bytes: DEFAULT_MAX_BYTES,
            entries: Mutex::default(),
        }
    }

    /// Keeps each result for at most `max_age` (and never longer than its TTL).
    /// This is also how long a removal by another process can go unseen here.
    pub fn max_age(mut self, max_age: Duration) -> Self {
        self.max_age = max_age;
        self
    }

    /// Keeps at most about `max_bytes` of results and keys; the oldest go first.
    pub fn max_bytes(mut self, max_bytes: usize) -> Self {
        self.max_bytes = max_bytes;
        self
    }

    /// The store this cache is in front of.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// How many results the cache holds (fresh or not yet dropped).
    pub fn cached(&self) -> usize {
        self.lock()
            .map
            .values()
            .filter(|e| matches!(e.held, Held::Completed { .. }))
            .count()
    }

    fn lock(&self) -> MutexGuard<'_, Entries> {
        crate::sync::lock(&self.entries)
    }
}

impl<S> std::fmt::Debug for LocalCache<S>
where
    S: std::fmt::Debug,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalCache")
            .field("inner", &self.inner)
            .field("max_age", &self.max_age)
            .field("max_bytes", &self.max_bytes)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl<S: Store> Store for LocalCache<S> {
    async fn claim(&self, key: &Key, request: &ClaimRequest) -> Result<Claim, Error> {
        if let Some(result) = self.lock().result(key, &request.fingerprint) {
            return Ok(Claim::Completed(result.to_vec()));
        }
        let claim = self.inner.claim(key, request).await?;
        if let Claim::Acquired { .. } = claim {
            let held = Held::Claimed {
                token: request.token,
                fingerprint: request.fingerprint,
            };
            self.lock().insert(key, held, self.max_bytes);
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
        // Before the store writes: the record expires no sooner than `started + ttl`.
        let started = Instant::now();
        let fenced = self.inner.complete(key, token, outcome, ttl).await;
        let mut entries = self.lock();
        let fingerprint = entries.take_claim(key, token);
        // A `max_age` past the end of `Instant` is not kept at all.
        let until = started.checked_add(ttl.min(self.max_age));
        if let (Ok(Fenced::Applied), Some(fingerprint), Outcome::Completed(result), Some(until)) =
            (&fenced, fingerprint, outcome, until)
        {
            let held = Held::Completed {
                fingerprint,
                result: Arc::from(result),
                until,
            };
            entries.insert(key, held, self.max_bytes);
        }
        fenced
    }

    async fn release(&self, key: &Key, token: Token) -> Result<Fenced, Error> {
        let fenced = self.inner.release(key, token).await;
        self.lock().take_claim(key, token);
        fenced
    }

    async fn renew(
        &self,
        key: &Key,
        token: Token,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Fenced, Error> {
        self.inner.renew(key, token, lease, ttl).await
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>, Error> {
        self.inner.get(key).await
    }

    async fn delete(&self, key: &Key) -> Result<bool, Error> {
        let deleted = self.inner.delete(key).await;
        // After the store's delete, so a completion that landed before it is dropped
        // too; also when the delete failed, as the record's state is then unknown.
        self.lock().remove(key);
        deleted
    }

    async fn purge_expired(&self) -> Result<u64, Error> {
        self.lock().drop_stale(Instant::now());
        self.inner.purge_expired().await
    }

    async fn list(
        &self,
        filter: &Filter,
        after: Option<&Cursor>,
        limit: usize,
    ) -> Result<Page, Error> {
        self.inner.list(filter, after, limit).await
    }

    async fn count(&self, filter: &Filter) -> Result<Counts, Error> {
        self.inner.count(filter).await
    }

    /// Also drops every result this process keeps: which of them matched is not known.
    async fn delete_matching(&self, filter: &Filter) -> Result<u64, Error> {
        let deleted = self.inner.delete_matching(filter).await;
        self.lock().drop_results();
        deleted
    }

    async fn delete_settled(&self, key: &Key) -> Result<bool, Error> {
        let deleted = self.inner.delete_settled(key).await;
        self.lock().remove(key);
        deleted
    }

    async fn resolve(
        &self,
        key: &Key,
        token: Token,
        resolution: Resolution<'_>,
    ) -> Result<Fenced, Error> {
        self.inner.resolve(key, token, resolution).await
    }

    fn max_result_bytes(&self) -> usize {
        self.inner.max_result_bytes()
    }

    /// The shared store's name: claims and completions are its operations.
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn renewals_block(&self) -> bool {
        self.inner.renewals_block()
    }

    fn with_completed_result(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        replay: &mut dyn FnMut(&[u8]),
    ) {
        // Out of the lock before `replay` runs user code.
        let cached = self.lock().result(key, fingerprint);
        match cached {
            Some(result) => replay(&result),
            None => self.inner.with_completed_result(key, fingerprint, replay),
        }
    }
}
