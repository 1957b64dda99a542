//! Per-tool options: how long results live, how long a claim holds, what a concurrent
//! duplicate does, and what happens after a crash.

use std::time::Duration;

/// What happens to a call that finds an earlier claim whose lease ran out without an
/// outcome (the earlier caller crashed, was killed, or lost its connection).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Delivery {
    /// Take the key over and run the operation again (the default). The operation may
    /// then have run twice if the crash came after its side effect; forward
    /// [`current_key`](crate::current_key) to a downstream that deduplicates to close
    /// that window.
    #[default]
    AtLeastOnce,
    /// Return [`Error::OutcomeUnknown`](crate::Error::OutcomeUnknown) and never run the
    /// operation again for this key (payments).
    AtMostOnce,
}

/// What a call does when another call holds its key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnBusy {
    /// Wait for the other call's outcome, at most this long (`None`: at most one lease),
    /// then return [`Error::InProgress`](crate::Error::InProgress). A waiter in the same
    /// process is woken the moment the owner finishes; one in another process polls with
    /// backoff.
    Wait(Option<Duration>),
    /// Return [`Error::InProgress`](crate::Error::InProgress) at once.
    FailFast,
}

/// The options of one idempotent tool. Built in `const` context by the attribute.
///
/// Defaults: `ttl` 24 hours, `lease` 60 seconds, wait at most one lease for a
/// concurrent duplicate, at-least-once after a crash.
///
/// # Choosing the TTL
///
/// The TTL must exceed the longest a run plus its retries can take. Typical choices:
/// payments and transactional emails 24 hours; notifications and record updates 1 hour;
/// document generation and exports 7 days. Reads (`get_customer`, `search_products`),
/// logs and analytics need no idempotency at all: leave them undecorated and save the
/// store round trip.
///
/// # Choosing the lease
///
/// The lease is how long a claim holds before its owner is considered crashed. Set it
/// above the operation's longest run time: a call still running when its lease ends
/// may be taken over by a retry (and its own result is then rejected with
/// [`Error::LostLease`](crate::Error::LostLease)). After a real crash, retries wait up to
/// one lease before the key is taken over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Options {
    /// How long a completed result is kept and replayed.
    pub ttl: Duration,
    /// How long an in-progress claim holds before it is considered crashed.
    pub lease: Duration,
    /// What a concurrent duplicate does.
    pub on_busy: OnBusy,
    /// What a call does after an earlier claim's lease expired.
    pub delivery: Delivery,
}

impl Options {
    /// The default TTL: 24 hours.
    pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 60 * 60);
    /// The default lease: 60 seconds.
    pub const DEFAULT_LEASE: Duration = Duration::from_secs(60);

    /// The defaults.
    pub const fn new() -> Self {
        Options {
            ttl: Self::DEFAULT_TTL,
            lease: Self::DEFAULT_LEASE,
            on_busy: OnBusy::Wait(None),
            delivery: Delivery::AtLeastOnce,
        }
    }

    /// Sets how long results are kept.
    pub const fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// Sets how long a claim holds before it is considered crashed.
    pub const fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Waits at most `max` for a concurrent duplicate's outcome.
    pub const fn wait(mut self, max: Duration) -> Self {
        self.on_busy = OnBusy::Wait(Some(max));
        self
    }

    /// Fails at once with `InProgress` when another call holds the key.
    pub const fn fail_fast(mut self) -> Self {
        self.on_busy = OnBusy::FailFast;
        self
    }

    /// After a crash, reports `OutcomeUnknown` instead of running again.
    pub const fn at_most_once(mut self) -> Self {
        self.delivery = Delivery::AtMostOnce;
        self
    }

    /// How long a concurrent duplicate waits, all told.
    pub(crate) fn max_wait(&self) -> Option<Duration> {
        match self.on_busy {
            OnBusy::Wait(max) => Some(max.unwrap_or(self.lease)),
            OnBusy::FailFast => None,
        }
    }
}

impl Default for Options {
    fn default() -> Self {
        Self::new()
    }
}
