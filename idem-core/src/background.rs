//! Store operations nobody awaits: a claim settled because its call was dropped, a
//! renewal sent by the timer thread, an outcome recorded again after the store
//! failed to take it.
//!
//! [`detach`] polls the operation once in place, then leaves the rest to the runtime it
//! belongs to. The in-process stores do their work in that first poll (a memory store
//! completely; sled writes the record there, and only its flush waits), so their part
//! is done even when no task will ever run again: a runtime shutting down, a call
//! dropped outside any runtime. A network store's operation runs on its runtime, the
//! one its connection lives on. What is left after the first poll never blocks the
//! caller: without a runtime, or from a sync tool's call (whose thread may be the one
//! its runtime runs on, blocked), it goes on on a thread of its own.

use std::future::Future;
use std::panic::{self, AssertUnwindSafe};
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

/// Runs `operation` to its end without the caller waiting for it: one poll here (inside
/// `runtime`'s context, if given), then the rest as a task of `runtime`, or, without
/// one or from a sync tool's call, on a thread of its own (in `runtime`'s context).
///
/// A panic in the operation (a store's code) is caught and logged: whoever calls this
/// (a `Drop`, the timer thread) goes on.
pub(crate) fn detach(
    operation: impl Future<Output = ()> + Send + 'static,
    runtime: Option<&tokio::runtime::Handle>,
) {
    let mut operation: Pin<Box<dyn Future<Output = ()> + Send>> = Box::pin(operation);
    let first = panic::catch_unwind(AssertUnwindSafe(|| {
        let _context = runtime.map(tokio::runtime::Handle::enter);
        operation
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
    }));
    match first {
        Ok(Poll::Ready(())) => return,
        Ok(Poll::Pending) => {}
        Err(_) => return panicked(),
    }
    match runtime {
        // A runtime shutting down drops the task: what the first poll did stays done.
        Some(runtime) if !crate::blocking::in_sync_tool() => drop(runtime.spawn(operation)),
        runtime => {
            let runtime = runtime.cloned();
            let apart = move || {
                let _context = runtime.as_ref().map(tokio::runtime::Handle::enter);
                if panic::catch_unwind(AssertUnwindSafe(|| pollster::block_on(operation))).is_err()
                {
                    panicked();
                }
            };
            let spawned = std::thread::Builder::new()
                .name("idem-background".into())
                .spawn(apart);
            if let Err(error) = spawned {
                tracing::warn!(%error, "idem: cannot start a thread for a store operation nobody awaits; it is left undone (a claim it would settle runs out after its lease)");
            }
        }
    }
}

fn panicked() {
    tracing::error!("idem: a store operation run in the background panicked");
}
