//! Per-tool options: how long results live, how long a claim holds without a
//! heartbeat, how long a body may run, what a concurrent duplicate does, and what
//! happens after a crash.

use std::time::Duration;

/// What happens to a call that finds an earlier claim given up without an outcome: its
/// process died (the lease ran out with no heartbeat), or, in this process, it was
/// cancelled, panicked or stopped at its `max_run`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Delivery {
    /// Run the operation again (the default). A claim given up in a live process is
    /// released at once, so the retry runs at once; a crashed process's claim is taken
    /// over when its lease runs out. The operation may then have run twice if it was
    /// stopped after its side effect; forward [`current_key`](crate::current_key) to a
    /// downstream that deduplicates to close that window.
    #[default]
    AtLeastOnce,
    /// Return [`Error::OutcomeUnknown`](crate::Error::OutcomeUnknown) and never run the
    /// operation again for this key (payments). A claim given up in a live process is
    /// recorded as outcome-unknown at once.
    AtMostOnce,
}

/// What a call does when its caller stops waiting (its own timeout, `select!`, an
/// aborted task, a disconnected client) while the body runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum OnCancel {
    /// The body runs on, in a task of its own, to its end; its outcome is recorded, so
    /// a retry gets it (the default for a body that owns what it uses).
    #[default]
    Finish,
    /// The body is dropped with the call, and its claim settled at once by the
    /// [`Delivery`] policy.
    Abort,
}

/// What a call does when another call holds its key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnBusy {
    /// Wait for the other call's outcome, at most this long (`None`: as long as the other
    /// call can hold the key, its `max_run` plus one lease), then return
    /// [`Error::InProgress`](crate::Error::InProgress). A waiter in the same process is
    /// woken the moment the owner finishes; one in another process polls with backoff.
    Wait(Option<Duration>),
    /// Return [`Error::InProgress`](crate::Error::InProgress) at once.
    FailFast,
}

/// The options of one idempotent tool. Built in `const` context by the attribute.
///
/// Defaults: `ttl` 24 hours, `lease` 15 seconds (renewed every 5 seconds while the body
/// runs), `max_run` 10 minutes, a concurrent duplicate waits for the first call's
/// outcome, at-least-once after a crash, a reconcile hook answers within 10 seconds.
///
/// # Choosing the TTL
///
/// The TTL is how long a result is kept and replayed, counted from the moment the call
/// completed. It must exceed the longest a run plus its retries can take. Typical
/// choices: payments and transactional emails 24 hours; notifications and record updates
/// 1 hour; document generation and exports 7 days. Reads (`get_customer`,
/// `search_products`), logs and analytics need no idempotency at all: leave them
/// undecorated and save the store round trip. A TTL shorter than the body is legal: the
/// claim lives by its lease, not by the TTL.
///
/// # The lease, the heartbeat and `max_run`
///
/// While the body runs, its claim is renewed every third of the lease (a heartbeat), so
/// a live body never loses its key however long it takes, up to `max_run`. The lease is
/// therefore not a bound on the body: it is how long a *crashed* process's claim holds
/// before another call may take it over (at-least-once) or report it unknown
/// (at-most-once). Keep it well above the store's round trip (a few hundred
/// milliseconds at the very least) and the longest pause you expect a live process to
/// make; 15 seconds tolerates a renewal that runs into a network store's whole 5-second
/// timeout.
///
/// `max_run` bounds the heartbeat: an async body still running then is stopped (dropped
/// at its current `.await`), its claim is settled by the [`Delivery`] policy, and the
/// caller gets [`Error::MaxRunExceeded`](crate::Error::MaxRunExceeded). A sync body
/// cannot be stopped from outside: its claim is no longer renewed, and a takeover after
/// its lease makes its late result [`Error::LostLease`](crate::Error::LostLease).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Options {
    /// How long a completed result is kept and replayed, from completion.
    pub ttl: Duration,
    /// How long a claim holds without a heartbeat before its owner is considered dead.
    pub lease: Duration,
    /// The longest a body may run; its claim is renewed until then.
    pub max_run: Duration,
    /// What a concurrent duplicate does.
    pub on_busy: OnBusy,
    /// What a call does after an earlier claim was given up without an outcome.
    pub delivery: Delivery,
    /// The longest a tool's reconcile hook may take to answer; past it, the answer
    /// counts as `Reconciled::Unknown` (see [`crate::Reconciled`]).
    pub reconcile_timeout: Duration,
}

impl Options {
    /// The default TTL: 24 hours.
    pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 60 * 60);
    /// The default lease: 15 seconds. A crashed process's claim is taken over (or
    /// reported unknown) at most this long after its last heartbeat.
    pub const DEFAULT_LEASE: Duration = Duration::from_secs(15);
    /// The default longest run: 10 minutes. Agent tool calls take seconds; a body still
    /// running after ten minutes is almost certainly hung, and holding its key longer
    /// would block every retry of it.
    pub const DEFAULT_MAX_RUN: Duration = Duration::from_secs(10 * 60);
    /// The default bound on a reconcile hook: 10 seconds. A hook asks a downstream
    /// system one question (a lookup by idempotency key), and every retry of its key
    /// waits for the answer.
    pub const DEFAULT_RECONCILE_TIMEOUT: Duration = Duration::from_secs(10);

    /// The longest duration any option takes: 100 years (36,500 days). The attribute
    /// refuses a longer literal at compile time; a longer value set in code is cut to it
    /// when the call is made. Every store represents every time up to it, so the largest
    /// TTL is the same everywhere.
    pub const LONGEST: Duration = Duration::from_secs(36_500 * 24 * 60 * 60);

    /// The defaults.
    pub const fn new() -> Self {
        Options {
            ttl: Self::DEFAULT_TTL,
            lease: Self::DEFAULT_LEASE,
            max_run: Self::DEFAULT_MAX_RUN,
            on_busy: OnBusy::Wait(None),
            delivery: Delivery::AtLeastOnce,
            reconcile_timeout: Self::DEFAULT_RECONCILE_TIMEOUT,
        }
    }

    /// Sets how long results are kept, from completion.
    pub const fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// Sets how long a claim holds without a heartbeat.
    pub const fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Sets the longest a body may run.
    pub const fn max_run(mut self, max_run: Duration) -> Self {
        self.max_run = max_run;
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

    /// Reports `OutcomeUnknown` instead of running again after a claim was given up.
    pub const fn at_most_once(mut self) -> Self {
        self.delivery = Delivery::AtMostOnce;
        self
    }

    /// Sets the longest a reconcile hook may take to answer.
    pub const fn reconcile_timeout(mut self, timeout: Duration) -> Self {
        self.reconcile_timeout = timeout;
        self
    }

    /// These options with every duration cut to [`Options::LONGEST`].
    pub(crate) fn clamped(mut self) -> Self {
        let cut = |d: Duration| d.min(Self::LONGEST);
        self.ttl = cut(self.ttl);
        self.lease = cut(self.lease);
        self.max_run = cut(self.max_run);
        self.reconcile_timeout = cut(self.reconcile_timeout);
        if let OnBusy::Wait(Some(max)) = self.on_busy {
            self.on_busy = OnBusy::Wait(Some(cut(max)));
        }
        self
    }

    /// How long a concurrent duplicate waits, all told.
    pub(crate) fn max_wait(&self) -> Option<Duration> {
        match self.on_busy {
            OnBusy::Wait(max) => {
                Some(max.unwrap_or_else(|| self.max_run.saturating_add(self.lease)))
            }
            OnBusy::FailFast => None,
        }
    }

    /// How often a running body's claim is renewed: a third of the lease, so two
    /// renewals in a row may fail or come late before the claim is lost.
    pub(crate) fn renew_every(&self) -> Duration {
        (self.lease / 3).max(Duration::from_millis(1))
    }
}

impl Default for Options {
    fn default() -> Self {
        Self::new()
    }
}
