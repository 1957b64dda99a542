//! Store operations nobody awaits: a claim settled because its call was dropped, a
//! renewal sent by the timer thread, an outcome recorded again after the store
//! failed to take it.
//!
//! [`detach`] polls the operation once in place, then leaves the rest to the runtime it
//! belongs to. The in-process stores do their work in that first poll (a memory store
//! completely; sled writes the record there, and only its flush waits), so their part
//! is done even when no task will ever run again: a runtime shutting down, a call
//! dropped outside any runtime. A network store's operation goes on on the caller's
//! runtime, the one its connection lives on, when it can. What is left after the first
//! poll never blocks the caller: without a runtime, or from a sync tool's call (whose
//! thread may be the one its runtime runs on, blocked), it goes on on idem's one
//! background thread.

use std::future::Future;
use std::panic::{self, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::OnceLock;
use std::task::{Context, Poll, Waker};

/// Runs `operation` to its end without the caller waiting for it: one poll here (inside
/// `runtime`'s context, if given), then the rest as a task of `runtime`, or, without
/// one or from a sync tool's call, as a task of idem's own background thread.
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
        Some(runtime) if !crate::blocking::in_sync_tool() => {
            drop(runtime.spawn(Caught(operation)))
        }
        _ => match own_runtime() {
            Some(own) => drop(own.spawn(Caught(operation))),
            None => tracing::warn!("idem: no thread to finish a store operation nobody awaits; it is left undone (a claim it would settle runs out after its lease)"),
        },
    }
}

/// A runtime of idem's own, on one thread (`idem-background`), started on first use: for
/// what is left of an operation whose caller has no runtime, or blocks its runtime's
/// only thread in a sync tool. One thread for every such operation, however many.
/// `None` if the OS would not start it.
fn own_runtime() -> Option<&'static tokio::runtime::Handle> {
    static OWN: OnceLock<Option<tokio::runtime::Handle>> = OnceLock::new();
    OWN.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .ok()?;
        let handle = runtime.handle().clone();
        std::thread::Builder::new()
            .name("idem-background".into())
            .spawn(move || runtime.block_on(std::future::pending::<()>()))
            .ok()?;
        Some(handle)
    })
    .as_ref()
}

/// An operation whose panic is caught and logged, not left to the runtime.
struct Caught(Pin<Box<dyn Future<Output = ()> + Send>>);

impl Future for Caught {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let operation = &mut self.0;
        match panic::catch_unwind(AssertUnwindSafe(|| operation.as_mut().poll(cx))) {
            Ok(poll) => poll,
            Err(_) => {
                panicked();
                Poll::Ready(())
            }
        }
    }
}

fn panicked() {
    tracing::error!("idem: a store operation run in the background panicked");
}
