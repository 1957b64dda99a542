//! Stores that fail on demand: [`Down`], a store whose server cannot be reached, and
//! [`Faulty`], a real store in front of which claims, completions and renewals fail (or
//! panic) a chosen number of times, and which counts the claims and renewals it is
//! asked.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem::store::{Claim, ClaimRequest, Fenced, Outcome, Record, Token};
use idem::{Error, Key, Store};

/// A store whose server is down: every operation fails with a store error whose
/// message says `unreachable: connection refused`, under the store name `custom` (the
/// name a store that does not give one has).
#[derive(Debug, Clone, Copy, Default)]
pub struct Down {
    panics_on_claim: bool,
}

impl Down {
    /// A store every operation of which fails.
    pub fn new() -> Self {
        Down::default()
    }

    /// This store, with a bug: its `claim` panics instead of failing.
    pub fn panicking_on_claim(mut self) -> Self {
        self.panics_on_claim = true;
        self
    }
}

fn unreachable() -> Error {
    Error::store(
        "custom",
        std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "unreachable: connection refused",
        ),
    )
}

#[async_trait]
impl Store for Down {
    async fn claim(&self, _: &Key, _: &ClaimRequest) -> Result<Claim, Error> {
        assert!(!self.panics_on_claim, "a bug in the store's claim");
        Err(unreachable())
    }
    async fn complete(
        &self,
        _: &Key,
        _: Token,
        _: Outcome<'_>,
        _: Duration,
    ) -> Result<Fenced, Error> {
        Err(unreachable())
    }
    async fn release(&self, _: &Key, _: Token) -> Result<Fenced, Error> {
        Err(unreachable())
    }
    async fn renew(&self, _: &Key, _: Token, _: Duration, _: Duration) -> Result<Fenced, Error> {
        Err(unreachable())
    }
    async fn get(&self, _: &Key) -> Result<Option<Record>, Error> {
        Err(unreachable())
    }
    async fn delete(&self, _: &Key) -> Result<bool, Error> {
        Err(unreachable())
    }
    async fn purge_expired(&self) -> Result<u64, Error> {
        Err(unreachable())
    }
}

/// `inner`, with faults: its next claims, completions or renewals fail (as a store
/// does whose connection resets, or whose disk fills, between the claim and the
/// completion), or its completions panic (a bug in the store's code), as many times as
/// asked. It counts every claim and renewal asked of it.
///
/// A handle: clones share the faults and the counts. Only the seven operations every
/// store has are passed on; the optional fast paths (`with_completed_result`) take
/// their defaults, so every hit goes through `claim` and is counted.
#[derive(Clone)]
pub struct Faulty<S> {
    inner: S,
    counts: Arc<Counts>,
}

#[derive(Default)]
struct Counts {
    claim_failures: AtomicUsize,
    complete_failures: AtomicUsize,
    complete_panics: AtomicUsize,
    renew_failures: AtomicUsize,
    claims: AtomicUsize,
    renewals: AtomicUsize,
}

impl<S: Default> Default for Faulty<S> {
    fn default() -> Self {
        Faulty::new(S::default())
    }
}

impl<S> Faulty<S> {
    /// `inner`, with no faults yet.
    pub fn new(inner: S) -> Self {
        Faulty {
            inner,
            counts: Arc::default(),
        }
    }

    /// The next `n` claims fail (`usize::MAX`: every one), with a store error.
    pub fn fail_claims(&self, n: usize) -> &Self {
        self.counts.claim_failures.store(n, Ordering::SeqCst);
        self
    }

    /// The next `n` completions fail, with a store error.
    pub fn fail_completions(&self, n: usize) -> &Self {
        self.counts.complete_failures.store(n, Ordering::SeqCst);
        self
    }

    /// The next `n` completions panic.
    pub fn panic_in_completions(&self, n: usize) -> &Self {
        self.counts.complete_panics.store(n, Ordering::SeqCst);
        self
    }

    /// The next `n` renewals fail, with a store error.
    pub fn fail_renewals(&self, n: usize) -> &Self {
        self.counts.renew_failures.store(n, Ordering::SeqCst);
        self
    }

    /// How many claims were asked of this store.
    pub fn claims(&self) -> usize {
        self.counts.claims.load(Ordering::SeqCst)
    }

    /// How many renewals were asked of this store.
    pub fn renewals(&self) -> usize {
        self.counts.renewals.load(Ordering::SeqCst)
    }
}

/// Takes one from `left`, if any is left.
fn take_one(left: &AtomicUsize) -> bool {
    left.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
}

#[async_trait]
impl<S: Store> Store for Faulty<S> {
    async fn claim(&self, key: &Key, request: &ClaimRequest) -> Result<Claim, Error> {
        self.counts.claims.fetch_add(1, Ordering::SeqCst);
        if take_one(&self.counts.claim_failures) {
            return Err(Error::store("failing", "connection reset"));
        }
        self.inner.claim(key, request).await
    }
    async fn complete(
        &self,
        key: &Key,
        token: Token,
        outcome: Outcome<'_>,
        ttl: Duration,
    ) -> Result<Fenced, Error> {
        assert!(
            !take_one(&self.counts.complete_panics),
            "a bug in the store's complete"
        );
        if take_one(&self.counts.complete_failures) {
            return Err(Error::store("failing", "no space left on device"));
        }
        self.inner.complete(key, token, outcome, ttl).await
    }
    async fn release(&self, key: &Key, token: Token) -> Result<Fenced, Error> {
        self.inner.release(key, token).await
    }
    async fn renew(
        &self,
        key: &Key,
        token: Token,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Fenced, Error> {
        self.counts.renewals.fetch_add(1, Ordering::SeqCst);
        if take_one(&self.counts.renew_failures) {
            return Err(Error::store("failing", "connection reset"));
        }
        self.inner.renew(key, token, lease, ttl).await
    }
    async fn get(&self, key: &Key) -> Result<Option<Record>, Error> {
        self.inner.get(key).await
    }
    async fn delete(&self, key: &Key) -> Result<bool, Error> {
        self.inner.delete(key).await
    }
    async fn purge_expired(&self) -> Result<u64, Error> {
        self.inner.purge_expired().await
    }
}
