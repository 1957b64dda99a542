//! Settling a claim its call leaves without an outcome: released, or given up as
//! abandoned, by the delivery policy.
//!
//! Every owner holds a [`Settle`] guard from its body's start until its outcome is
//! recorded: dropped armed (the caller stopped waiting, a panic, the call dropped while
//! its own settling write was out), it settles the claim in the background. A call that
//! ends without an outcome settles it in line ([`Settle::settle`], [`Settle::release`]).

use std::any::Any;
use std::panic;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::Instrument;

use super::call::{Call, ToolName};
use super::claim::{Owner, LATE_CLAIM};
use crate::background;
use crate::error::{Error, LostTo};
use crate::heartbeat::{self, Beat};
use crate::key_text::Key;
use crate::options::{Delivery, Options};
use crate::record::Token;
use crate::store::{Fenced, Store};
use crate::telemetry::store_op;
use crate::wait;

/// How a claim left without an outcome is settled.
#[derive(Clone, Copy, Debug)]
pub(super) enum Settling {
    /// Released, whatever the policy: no body ran under it, or the body failed
    /// (returned `Err`, which releases the key).
    Release,
    /// By the delivery policy: at-least-once releases it, so a retry runs at once;
    /// at-most-once gives it up as abandoned (a zero-lease renewal), so a retry gets
    /// [`Error::OutcomeUnknown`] at once.
    ByPolicy,
}

/// The owner's duty to settle its claim, and the claim's heartbeat, from the body's
/// start until the outcome is recorded (see [`crate::heartbeat`]).
///
/// Armed until the call recorded an outcome or its own settling write has landed;
/// dropped armed (the caller stopped waiting, a panic unwound through the protocol,
/// the call was dropped while its own settling write was out), it settles the claim in
/// the background, at once, by the delivery policy (see [`crate::background`]: on the
/// runtime it is dropped in, or on idem's own when that one is shutting down or there
/// is none). Either way no caller in a live process waits out a lease, and waiters in
/// this process are woken.
pub(super) struct Settle<'a> {
    pub(super) call: &'a Call,
    pub(super) store: &'a Arc<dyn Store>,
    pub(super) token: Token,
    /// The claim's renewals, until it is settled.
    beat: Beat,
    /// How to settle if dropped; `None` once there is nothing to settle.
    settling: Option<Settling>,
}

impl<'a> Settle<'a> {
    /// The duty for `owner`'s claim, whose renewals start now.
    pub(super) fn new(call: &'a Call, owner: &'a Owner) -> Self {
        Settle {
            call,
            store: &owner.store,
            token: owner.token,
            beat: Beat::start(&owner.lease(call)),
            settling: Some(Settling::ByPolicy),
        }
    }

    /// The claim's heartbeat, which the body is driven by.
    pub(super) fn beat(&self) -> &Beat {
        &self.beat
    }

    /// The claim's renewals, taken out of the guard (to go on with a late record).
    pub(super) fn take_beat(&mut self) -> Beat {
        std::mem::replace(&mut self.beat, Beat::none())
    }

    /// Nothing is left to settle: the outcome is recorded, or the claim is not this
    /// call's any more. Its renewals stop.
    pub(super) fn disarm(&mut self) {
        drop(self.take_beat());
        self.settling = None;
    }

    /// Settles the claim now; stays armed until that has landed. Its renewals stop
    /// first, and one in flight is waited for.
    ///
    /// Boxed: a path off the hit and the miss, kept out of the size of their futures
    /// (which every poll of a finishing call moves).
    async fn settle_now(&mut self, how: Settling, why: &str) {
        self.settling = Some(how);
        let (beat, call) = (self.take_beat(), self.call);
        let (store, token) = (&**self.store, self.token);
        Box::pin(async move {
            beat.before_settling().await;
            let options = &call.options;
            settle_unfinished(store, &call.key, &call.tool, token, options, how, why).await
        })
        .await;
        self.settling = None;
    }

    /// Settles the claim now, by the delivery policy.
    pub(super) async fn settle(mut self, why: &str) {
        self.settle_now(Settling::ByPolicy, why).await;
    }

    /// Releases the claim now (a failed call, whatever the delivery policy).
    pub(super) async fn release(mut self) {
        self.settle_now(Settling::Release, "failed; its key is released for retries")
            .await;
    }

    /// The body panicked: settles the claim, then lets the panic go on, unchanged.
    pub(super) async fn panicked<T>(self, payload: Box<dyn Any + Send>) -> T {
        self.call.tally.panicked();
        tracing::error!(tool = %self.call.tool, key = %self.call.key, "idem: the body panicked; settling its claim");
        self.settle("panicked").await;
        panic::resume_unwind(payload)
    }
}

impl Drop for Settle<'_> {
    fn drop(&mut self) {
        let Some(how) = self.settling else {
            return;
        };
        // Its renewals stop here; one in flight is waited for before settling.
        let quiet = self.take_beat().end();
        let settling = Settlement {
            store: Arc::clone(self.store),
            key: self.call.key.clone(),
            tool: self.call.tool.clone(),
            token: self.token,
            options: self.call.options,
            how,
        };
        let again = settling.clone();
        let (quiet_again, span) = (quiet.clone(), self.call.tally.span().clone());
        let why = "was dropped before recording an outcome";
        background::detach(
            settling.after(quiet, why).instrument(span.clone()),
            Some(Box::new(move || {
                Box::pin(again.after(quiet_again, why).instrument(span))
            })),
            tokio::runtime::Handle::try_current().ok().as_ref(),
        );
    }
}

/// A claim to settle, owning what that needs.
#[derive(Clone)]
pub(super) struct Settlement {
    pub(super) store: Arc<dyn Store>,
    pub(super) key: Key,
    pub(super) tool: ToolName,
    pub(super) token: Token,
    pub(super) options: Options,
    pub(super) how: Settling,
}

impl Settlement {
    /// A release of `token`'s claim on `call`'s key.
    pub(super) fn release(call: &Call, store: &Arc<dyn Store>, token: Token) -> Self {
        Settlement {
            store: Arc::clone(store),
            key: call.key.clone(),
            tool: call.tool.clone(),
            token,
            options: call.options,
            how: Settling::Release,
        }
    }

    /// Settles the claim now.
    pub(super) async fn now(&self, why: &str) {
        let Settlement {
            store,
            key,
            tool,
            token,
            options,
            how,
        } = self;
        settle_unfinished(&**store, key, tool, *token, options, *how, why).await
    }

    /// Settles the claim, once no renewal of it is in flight (`quiet`).
    pub(super) async fn after(self, quiet: heartbeat::Quiet, why: &'static str) {
        quiet.before_settling().await;
        self.now(why).await
    }

    /// Settles the claim now (in the call's `span`) and again [`LATE_CLAIM`] later
    /// (fenced: a no-op on anyone else's claim; by then the call's span has ended): for
    /// a claim request whose answer never came, which may land late.
    pub(super) async fn twice(self, why: &'static str, span: tracing::Span) {
        self.now(why).instrument(span).await;
        crate::timer::sleep_until(Instant::now() + LATE_CLAIM).await;
        self.now(why).await;
    }
}

/// Delays between the background attempts to settle a claim the store failed to
/// settle at once (a connection that went with a runtime that shut down, a blip).
const SETTLE_AGAIN: [Duration; 3] = [
    Duration::from_millis(50),
    Duration::from_millis(250),
    Duration::from_secs(1),
];

/// Settles a claim left without an outcome (see [`Settling`]). A store that fails to is
/// asked again a few times, for about a second and a half (every write that settles a
/// claim is fenced by its token, so a second one changes nothing); after that the
/// claim holds until its lease runs out.
pub(super) async fn settle_unfinished(
    store: &dyn Store,
    key: &Key,
    tool: &str,
    token: Token,
    options: &Options,
    how: Settling,
    why: &str,
) {
    let release = matches!(how, Settling::Release) || options.delivery == Delivery::AtLeastOnce;
    let outcome = if release {
        "released: a retry runs again"
    } else {
        "recorded as outcome unknown (at-most-once)"
    };
    let mut again = SETTLE_AGAIN.iter();
    let settled = loop {
        let settled = if release {
            store_op(store.name(), "release", || store.release(key, token)).await
        } else {
            let renewing = || store.renew(key, token, Duration::ZERO, options.ttl);
            store_op(store.name(), "renew", renewing).await
        };
        match (settled, again.next()) {
            (Err(error), Some(delay)) => {
                tracing::debug!(%tool, %key, %error, "idem: settling a claim failed; trying again");
                crate::timer::sleep_until(Instant::now() + *delay).await;
            }
            (settled, _) => break settled,
        }
    };
    match settled {
        Ok(Fenced::Applied) => {
            tracing::info!(%tool, %key, "idem: a call {why}; its claim was {outcome}")
        }
        Ok(Fenced::LostLease) => {
            tracing::debug!(%tool, %key, "idem: a call {why}; the key held no claim of its own")
        }
        Err(error) => {
            tracing::warn!(%tool, %key, %error, "idem: a call {why}, and its claim could not be settled; it holds until its lease runs out")
        }
    }
    wait::notify(key);
}

/// The error of a call whose claim was lost, saying what holds its key now: another
/// call (whose outcome a retry receives), or nothing (the record was removed: a retry
/// runs the body again). Called boxed, off the miss's future.
pub(super) async fn lost_lease(call: &Call, store: &dyn Store) -> Error {
    let key = &call.key;
    let lost_to = match store_op(store.name(), "get", || store.get(key)).await {
        Ok(Some(_)) => LostTo::AnotherCall,
        Ok(None) => LostTo::Removal,
        Err(_) => LostTo::Unknown,
    };
    tracing::warn!(tool = %call.tool, %key, %lost_to, "idem: the claim was lost while the body ran; result not stored");
    Error::LostLease {
        key: key.clone(),
        lost_to,
    }
}
