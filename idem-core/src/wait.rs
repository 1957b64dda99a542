//! Waiting for a concurrent duplicate: in-process wake-ups, and pauses that work in
//! async and in blocking code.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use event_listener::{Event, EventListener, Listener};

use crate::key_text::Key;

/// Keys some call in this process is waiting on, each with the event its owner fires.
/// Keys end in a SHA-256 digest, so a fast hasher spreads them (no SipHash on every
/// completion).
type Waiters = HashMap<Key, Arc<Event>, foldhash::fast::RandomState>;

static WAITERS: Mutex<Option<Waiters>> = Mutex::new(None);

fn with_waiters<T>(f: impl FnOnce(&mut Waiters) -> T) -> T {
    let mut guard = crate::sync::lock(&WAITERS);
    f(guard.get_or_insert_with(Waiters::default))
}

/// Starts listening for the owner of `key` (in this process) to finish.
pub(crate) fn listen(key: &Key) -> EventListener {
    with_waiters(|map| map.entry(key.clone()).or_default().listen())
}

/// While alive, a call waits on `key`; when it ends (answered, given up, or the call's
/// future dropped), the key's entry goes if nobody else listens.
pub(crate) struct Waiting<'a> {
    key: &'a Key,
    listener: Option<EventListener>,
}

impl<'a> Waiting<'a> {
    pub(crate) fn new(key: &'a Key) -> Self {
        Waiting {
            key,
            listener: None,
        }
    }

    /// Listens afresh, returning the previous listener, if any.
    pub(crate) fn relisten(&mut self) -> Option<EventListener> {
        self.listener.replace(listen(self.key))
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if self.listener.take().is_some() {
            forget(self.key);
        }
    }
}

/// Wakes every call in this process waiting on `key`. Every completion calls this,
/// and nobody waits on most keys: an empty table is not hashed into.
pub(crate) fn notify(key: &Key) {
    let waiting = with_waiters(|map| match map.is_empty() {
        true => None,
        false => map.remove(key),
    });
    if let Some(event) = waiting {
        event.notify(usize::MAX);
    }
}

/// Drops the entry for `key` if nobody listens any more (the owner was elsewhere).
pub(crate) fn forget(key: &Key) {
    with_waiters(|map| {
        if map.get(key).is_some_and(|e| e.total_listeners() == 0) {
            map.remove(key);
        }
    });
}

/// How a waiting call pauses: awaiting (async tools) or blocking (sync tools).
pub(crate) trait Pause {
    /// Returns when `listener` fires or `max` has passed.
    fn pause(listener: EventListener, max: Duration) -> impl Future<Output = ()> + Send;
}

/// Pauses without blocking the thread, on the timer thread (which, unlike
/// tokio's, is there on any executor and any runtime).
pub(crate) struct AsyncPause;

impl Pause for AsyncPause {
    async fn pause(listener: EventListener, max: Duration) {
        let Some(at) = std::time::Instant::now().checked_add(max) else {
            return listener.await;
        };
        let mut listener = std::pin::pin!(listener);
        let mut timer = std::pin::pin!(crate::timer::sleep_until(at));
        std::future::poll_fn(|cx| {
            if listener.as_mut().poll(cx).is_ready() || timer.as_mut().poll(cx).is_ready() {
                return std::task::Poll::Ready(());
            }
            std::task::Poll::Pending
        })
        .await
    }
}

/// Pauses by blocking the thread (sync tools).
pub(crate) struct BlockingPause;

impl Pause for BlockingPause {
    async fn pause(listener: EventListener, max: Duration) {
        listener.wait_timeout(max);
    }
}
