//! What the network stores (Postgres, Redis) share: every operation bounded by the
//! store's timeout, failures described with their whole cause, server times moved to
//! this process's clock, a fenced write's count turned into [`Fenced`], and the guess
//! of which request a claim sends first ([`Streak`]).

use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Duration;

use crate::error::Fault;
use crate::error::{Error, StoreErrorKind};
use crate::record::Timestamp;
use crate::store::{Claim, Fenced};

/// An error if there is no tokio runtime here: the network stores' connections live on
/// one, and waiting for one would never end.
fn runtime_here(store: &'static str) -> Result<(), Error> {
    match tokio::runtime::Handle::try_current() {
        Ok(_) => Ok(()),
        Err(_) => Err(Error::store(
            store,
            "this store runs on tokio, and there is no tokio runtime here: call the tool inside \
             one (a sync tool: inside tokio::task::spawn_blocking)",
        )),
    }
}

/// A network store's failure with its whole cause (see [`Fault`]): `describe` may add
/// what the chain's own text leaves out (Postgres adds the SQLSTATE).
pub(crate) fn failure(
    store: &'static str,
    error: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    describe: impl FnOnce(&(dyn std::error::Error + 'static), &mut String) -> StoreErrorKind,
) -> Error {
    let error = error.into();
    let mut text = crate::error::chain(&*error);
    match describe(&*error, &mut text) {
        StoreErrorKind::Other => Error::store(store, Fault::new(text, error)),
        kind => Error::store_of_kind(store, kind, Fault::new(text, error)),
    }
}

/// A fenced write's outcome from the number of records it changed: the one the caller
/// owns, or none (the claim is not the caller's any more).
pub(crate) fn fenced(changed: u64) -> Fenced {
    if changed == 1 {
        Fenced::Applied
    } else {
        Fenced::LostLease
    }
}

/// A claim decided by a server's clock, as the caller needs it: a `Busy` lease end (and
/// an `Abandoned` record's expiry) is moved from the server's clock (`server_now`) to
/// this process's clock, the one a waiting call sleeps by, so clock skew does not
/// stretch or shorten the wait.
pub(crate) fn in_local_clock(claim: Claim, server_now: Timestamp) -> Claim {
    let local = |t: Timestamp| Timestamp::now().after(t.remaining(server_now));
    match claim {
        Claim::Busy { lease_until } => Claim::Busy {
            lease_until: local(lease_until),
        },
        Claim::Abandoned { expires_at } => Claim::Abandoned {
            expires_at: local(expires_at),
        },
        claim => claim,
    }
}

/// Runs a network store's operation within its timeout, failing closed: an
/// [`Error::Store`] when the server does not answer in time, or at once when there is
/// no tokio runtime to drive it.
///
/// Inside a sync tool the thread is blocked, and tokio's timer may be one this very
/// thread drives (a current-thread runtime's own thread): there the bound is kept by
/// the timer thread, so the call ends in an error instead of hanging.
pub(crate) fn bounded<F>(store: &'static str, timeout: Duration, operation: F) -> Bounded<F> {
    Bounded {
        operation,
        bound: Bound::Unarmed,
        store,
        timeout,
    }
}

/// `timeout` from now, or as far as an `Instant` goes.
fn far_from_now(timeout: Duration) -> std::time::Instant {
    let now = std::time::Instant::now();
    let century = Duration::from_secs(100 * 365 * 24 * 3600);
    now.checked_add(timeout)
        .or_else(|| now.checked_add(century))
        .unwrap_or(now)
}

pin_project_lite::pin_project! {
    /// A network store's operation within its timeout (see [`bounded`]). A future of
    /// its own, not an `async fn`: that would hold the operation twice (as it was
    /// handed in, and as it runs), and every store operation's future, moved whole into
    /// its box, is made of these.
    pub(crate) struct Bounded<F> {
        #[pin]
        operation: F,
        #[pin]
        bound: Bound,
        store: &'static str,
        timeout: Duration,
    }
}

pin_project_lite::pin_project! {
    /// What keeps an operation's time, set at its first poll.
    #[project = BoundProj]
    enum Bound {
        Unarmed,
        /// tokio's timer, on a runtime's thread: polled outside the task's budget, so
        /// an operation that spends the budget at every poll still times out (as
        /// `tokio::time::timeout` does it).
        Tokio { #[pin] sleep: tokio::task::Unconstrained<tokio::time::Sleep> },
        /// The timer thread's, inside a sync tool.
        Thread { deadline: crate::timer::Deadline },
    }
}

impl<T, F: std::future::Future<Output = Result<T, Error>>> std::future::Future for Bounded<F> {
    type Output = Result<T, Error>;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        use std::task::Poll;
        let mut this = self.project();
        let (store, timeout) = (*this.store, *this.timeout);
        if let BoundProj::Unarmed = this.bound.as_mut().project() {
            runtime_here(store)?;
            this.bound.set(match crate::blocking::in_sync_tool() {
                false => Bound::Tokio {
                    sleep: tokio::task::unconstrained(tokio::time::sleep(timeout)),
                },
                true => Bound::Thread {
                    // A timeout past what an `Instant` holds (`Duration::MAX`) is a
                    // deadline centuries away, not a panic.
                    deadline: crate::timer::Deadline::new(far_from_now(timeout)),
                },
            });
        }
        if let Poll::Ready(result) = this.operation.poll(cx) {
            return Poll::Ready(result);
        }
        let in_sync_tool = match this.bound.project() {
            BoundProj::Tokio { sleep } => {
                std::task::ready!(sleep.poll(cx));
                false
            }
            BoundProj::Thread { deadline } => {
                std::task::ready!(deadline.poll(cx));
                true
            }
            BoundProj::Unarmed => return Poll::Pending,
        };
        Poll::Ready(Err(Error::store(
            store,
            match in_sync_tool {
                false => format!("no answer within {timeout:?}"),
                true => format!(
                    "no answer within {timeout:?}; a sync tool blocks its thread while it waits \
                     for the store, and if that thread is the one driving tokio (a \
                     current-thread runtime's, or every worker of a multi-threaded one) the \
                     answer can never arrive: call the tool inside \
                     tokio::task::spawn_blocking, or make it async"
                ),
            },
        )))
    }
}

/// Which request a claim sends first, guessed from the claims just made on this store.
///
/// A network store's claim is one request that serves a key with a record and a key
/// without one alike, and costs the server more than either case needs (each store
/// says what it pays). A plainer request serves one case alone: a read answers a hit
/// (a completed record, a live claim, another fingerprint), an insertion claims a new
/// key. Each costs the other case one more round trip.
///
/// So while claims come in a streak of one kind, [`Streak::AFTER`] of them in a row,
/// the next claim sends that kind's request first: a run being replayed (or a call
/// waiting for another's claim) makes a streak of hits, a run doing new work a streak
/// of misses. The first claim of the other kind ends the streak: it pays the round
/// trip, and the claims after it send the claim's own request until a streak is seen
/// again. A workload of hits and misses mixed pays that round trip at most once per
/// streak of `AFTER`.
///
/// Only a choice of requests: a read decides by the same rule (`decide_claim`) as the
/// claim; an insertion claims only a key without a record; anything else is left to
/// the claim's own request.
pub(crate) struct Streak {
    /// Claims in a row that found a record and wrote nothing (above 0), or that claimed
    /// a new key (below 0), counted up to `AFTER` either way.
    streak: AtomicI32,
    /// What every claim sends first, whatever the streak (tests).
    #[cfg(test)]
    pub(crate) fixed: Option<First>,
}

/// The request a claim sends first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum First {
    /// The claim's own: reads, and claims the key where it has no record.
    Claim,
    /// A read: a streak of hits.
    Read,
    /// An insertion: a streak of misses.
    Insert,
}

impl Default for Streak {
    fn default() -> Self {
        Streak {
            streak: AtomicI32::new(0),
            #[cfg(test)]
            fixed: None,
        }
    }
}

impl Streak {
    /// How many claims of one kind in a row make a streak.
    pub(crate) const AFTER: i32 = 16;

    /// The request the next claim sends first.
    pub(crate) fn first(&self) -> First {
        #[cfg(test)]
        if let Some(first) = self.fixed {
            return first;
        }
        match self.streak.load(Ordering::Relaxed) {
            n if n >= Self::AFTER => First::Read,
            n if n <= -Self::AFTER => First::Insert,
            _ => First::Claim,
        }
    }

    /// A claim found a record and wrote nothing.
    pub(crate) fn found(&self) {
        match self.streak.load(Ordering::Relaxed) {
            n if n < 0 => self.streak.store(1, Ordering::Relaxed),
            n if n < Self::AFTER => {
                self.streak.fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        }
    }

    /// A claim claimed a new key: it had no record.
    pub(crate) fn inserted(&self) {
        match self.streak.load(Ordering::Relaxed) {
            n if n > 0 => self.streak.store(-1, Ordering::Relaxed),
            n if n > -Self::AFTER => {
                self.streak.fetch_sub(1, Ordering::Relaxed);
            }
            _ => {}
        }
    }

    /// A claim took a record over (expired, abandoned, failed): no streak. (A claim
    /// whose first request guessed wrong goes on to the claim's own, and what that
    /// finds moves the streak: a new key ends a streak of hits, a record one of misses.)
    pub(crate) fn broken(&self) {
        if self.streak.load(Ordering::Relaxed) != 0 {
            self.streak.store(0, Ordering::Relaxed);
        }
    }
}

/// The URL of a test's server in the environment variable `var`, or `None`, said
/// loudly: without it the test checks nothing.
#[cfg(test)]
pub(crate) fn test_server(var: &str) -> Option<String> {
    let url = std::env::var(var).ok().filter(|u| !u.is_empty());
    if url.is_none() {
        eprintln!("SKIPPED: {var} is not set; this test checked nothing");
    }
    url
}

/// `prefix` followed by this process's id and a fresh token: a name of a test's own.
#[cfg(test)]
pub(crate) fn unique_name(prefix: &str) -> String {
    let token = crate::record::Token::generate().map_or(0, |t| t.to_bits());
    format!("{prefix}{}_{token:x}", std::process::id())
}

/// A claim request of `fingerprint` for the streak tests, with a fresh token.
#[cfg(test)]
pub(crate) fn streak_request(fingerprint: u8) -> crate::store::ClaimRequest {
    crate::store::ClaimRequest {
        origin: crate::record::Origin::new("run", "tool"),
        fingerprint: crate::key::Fingerprint::from_bytes([fingerprint; 32]),
        token: crate::record::Token::generate().expect("a token"),
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(3600),
        take_over_expired: true,
        retry_failed: true,
    }
}

/// What a network store's streak of hits must do (its in-crate test): `Streak::AFTER`
/// claims that found a record and wrote nothing (a hit, a busy key, another
/// fingerprint) make claims read first, answered as before; a new key (`key("fresh")`)
/// then ends the streak, and is claimed once, by its caller's token.
#[cfg(test)]
pub(crate) async fn a_streak_of_hits_reads_first(
    store: &dyn crate::store::Store,
    streak: &Streak,
    key: impl Fn(&str) -> crate::key_text::Key,
) {
    use crate::record::State;
    use crate::store::Outcome;
    let request = streak_request;
    let (done, busy, fresh) = (key("done"), key("busy"), key("fresh"));
    let owner = request(1);
    assert_eq!(
        store.claim(&done, &owner).await.unwrap(),
        Claim::Acquired { took_over: false }
    );
    let ttl = Duration::from_secs(3600);
    let completed = store.complete(&done, owner.token, Outcome::Completed(b"42"), ttl);
    assert_eq!(completed.await.unwrap(), Fenced::Applied);
    store.claim(&busy, &request(1)).await.unwrap();
    for i in 0..Streak::AFTER {
        assert_eq!(streak.first(), First::Claim, "after {i} hits");
        let claim = match i % 3 {
            0 => store.claim(&done, &request(1)).await.unwrap(),
            1 => store.claim(&busy, &request(1)).await.unwrap(),
            _ => store.claim(&done, &request(2)).await.unwrap(),
        };
        assert!(!matches!(claim, Claim::Acquired { .. }), "{claim:?}");
    }
    assert_eq!(streak.first(), First::Read);
    // Read first: the same answers, and the streak goes on.
    assert_eq!(
        store.claim(&done, &request(1)).await.unwrap(),
        Claim::Completed(b"42".to_vec())
    );
    assert!(matches!(
        store.claim(&busy, &request(1)).await.unwrap(),
        Claim::Busy { .. }
    ));
    assert_eq!(
        store.claim(&done, &request(2)).await.unwrap(),
        Claim::Mismatch
    );
    assert_eq!(streak.first(), First::Read);
    // A new key: the claim's own request claims it, once, and the streak is over.
    let first = request(1);
    assert_eq!(
        store.claim(&fresh, &first).await.unwrap(),
        Claim::Acquired { took_over: false }
    );
    assert_eq!(streak.first(), First::Claim);
    assert!(matches!(
        store.claim(&fresh, &request(1)).await.unwrap(),
        Claim::Busy { .. }
    ));
    let stored = store.get(&fresh).await.unwrap().expect("the claim");
    assert!(
        matches!(stored.state, State::InProgress { token, .. } if token == first.token),
        "{:?}",
        stored.state
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An operation that spends the task's budget at every poll and never ends still
    /// times out: the bound's timer is polled outside the budget.
    #[tokio::test]
    #[allow(unreachable_code)]
    async fn an_operation_that_spends_the_budget_at_every_poll_still_times_out() {
        let spinning = async {
            loop {
                tokio::task::consume_budget().await;
            }
            Ok::<(), Error>(())
        };
        let answer = tokio::time::timeout(
            Duration::from_secs(5),
            bounded("test", Duration::from_millis(50), spinning),
        )
        .await;
        assert!(
            matches!(&answer, Ok(Err(Error::Store { .. }))),
            "{answer:?}"
        );
    }
}
