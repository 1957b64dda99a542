//! A background task that purges expired records on an interval.
//!
//! Expired records are already invisible to every read; purging only frees space.

use std::sync::Arc;
use std::time::Duration;

use crate::store::Store;

/// A running sweeper. It stops when this handle is dropped.
#[derive(Debug)]
pub struct Sweeper {
    task: tokio::task::JoinHandle<()>,
}

/// Spawns a task on the current tokio runtime that calls
/// [`Store::purge_expired`] every `every`. Errors are logged and the next round
/// tries again.
///
/// Must be called from inside a tokio runtime.
pub fn spawn(store: Arc<dyn Store>, every: Duration) -> Sweeper {
    let task = tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            match store.purge_expired().await {
                Ok(0) => {}
                Ok(n) => tracing::debug!(removed = n, "idem: purged expired records"),
                Err(e) => tracing::warn!(error = %e, "idem: purge failed"),
            }
        }
    });
    Sweeper { task }
}

impl Drop for Sweeper {
    fn drop(&mut self) {
        self.task.abort();
    }
}
