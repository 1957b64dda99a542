//! Store operations nobody awaits: a claim settled because its call was dropped, a
//! renewal the heartbeat sends, an outcome recorded again after the store failed to
//! take it.
//!
//! [`detach`] polls the operation once in place, then leaves the rest to the runtime it
//! belongs to. The in-process stores do their work in that first poll (a memory store
//! completely; sled writes the record there, and only its flush waits), so their part
//! is done even when no task will ever run again. A network store's operation goes on
//! on the caller's runtime, the one its connection lives on, when it can.
//!
//! Where it cannot, the operation goes to idem's own runtime (two worker threads,
//! `idem-background`, that live as long as the process): without a runtime, from a
//! sync tool's call (whose thread may be the one its runtime runs on, blocked), and
//! from a runtime that is shutting down (`drop(runtime)`, `shutdown_timeout`, the end
//! of `#[tokio::main]` while a call was under way). A runtime shutting down takes no
//! new task, and drops those it has: an operation it drops before its end is made
//! again, from the start, on idem's own runtime ([`Rescue`]), so a claim is settled
//! in a live process whatever happens to the runtime its call ran on. (A network
//! store's connections that lived on that runtime are gone with it; its pool opens
//! new ones.)
//!
//! [`run_blocking`] runs an operation off every thread that matters to anyone else: on
//! a thread of idem's own runtime's blocking pool, from start to end, where a store that
//! blocks (sled behind its IO, a custom store that does blocking IO in an `async fn`)
//! holds up only that thread. The heartbeat's renewals run so, never on the timer
//! thread and never behind each other.

use std::future::Future;
use std::panic::{self, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::OnceLock;
use std::task::{Context, Poll, Waker};

/// An operation run in the background.
pub(crate) type Op = Pin<Box<dyn Future<Output = ()> + Send>>;

/// How to make an operation again, from the start, if the runtime it ran on drops it
/// unfinished (it is shutting down): settling a claim again is safe, since every write
/// that settles one is fenced by its token.
pub(crate) type Rescue = Box<dyn FnOnce() -> Op + Send>;

/// Runs `operation` to its end without the caller waiting for it: one poll here (inside
/// `runtime`'s context, if given), then the rest as a task of `runtime`; or, without
/// one, from a sync tool's call, or when `runtime` is shutting down, on idem's own
/// runtime (first poll included). If `runtime` drops the task before its end, `rescue`
/// runs on idem's own runtime instead.
///
/// A panic in the operation (a store's code) is caught and logged: whoever calls this
/// (a `Drop`, the heartbeat) goes on.
pub(crate) fn detach(
    operation: impl Future<Output = ()> + Send + 'static,
    rescue: Option<Rescue>,
    runtime: Option<&tokio::runtime::Handle>,
) {
    let operation: Op = Box::pin(operation);
    match runtime {
        Some(runtime) if !crate::blocking::in_sync_tool() && takes_tasks(runtime) => {
            let mut detached = Detached {
                operation: Some(operation),
                rescue,
            };
            if detached.first_poll(runtime).is_pending() {
                drop(runtime.spawn(detached));
            }
        }
        _ => on_own_runtime(operation),
    }
}

/// Runs `operation` off the caller's thread (see the module docs): on a blocking thread
/// of idem's own runtime, to its end. `false` if no thread could take it (no runtime of
/// idem's own, or the OS starts no thread now): the caller tries again later.
pub(crate) fn run_blocking(operation: impl Future<Output = ()> + Send + 'static) -> bool {
    let Some(own) = own_runtime() else {
        return false;
    };
    let mut operation = Detached {
        operation: Some(Box::pin(operation)),
        rescue: None,
    };
    let handle = own.clone();
    // Tokio panics when the pool has no idle thread and the OS starts none.
    let spawned = panic::catch_unwind(AssertUnwindSafe(|| {
        own.spawn_blocking(move || {
            handle.block_on(std::future::poll_fn(|cx| operation.poll_once(cx)))
        })
    }));
    spawned.is_ok()
}

/// Spawns `task` on idem's own runtime, whatever runtime the caller is on (one that
/// is shut down, or no longer driven, leaves it running). `false` if there is no
/// runtime of idem's own; `task` is then dropped.
pub(crate) fn spawn(task: impl Future<Output = ()> + Send + 'static) -> bool {
    match own_runtime() {
        Some(own) => {
            drop(own.spawn(task));
            true
        }
        None => false,
    }
}

/// Runs `operation` on idem's own runtime: its first poll here, inside that runtime's
/// context (so what it registers, a timer or a connection, belongs to the runtime that
/// goes on with it), the rest there.
fn on_own_runtime(operation: Op) {
    let mut detached = Detached {
        operation: Some(operation),
        rescue: None,
    };
    let own = own_runtime();
    if own.is_none() {
        tracing::warn!("idem: no thread to finish a store operation nobody awaits; it is left undone after its first step (a claim it would settle runs out after its lease)");
    }
    if detached.first_poll_in(own).is_ready() {
        return;
    }
    if let Some(own) = own {
        drop(own.spawn(detached));
    }
}

/// Whether `runtime` takes new tasks. One that is shutting down (or gone) cancels a
/// task as it is spawned, before anyone could poll it: a probe spawned there is
/// finished with a cancellation at once, which a running runtime never does to a task
/// nobody aborted.
fn takes_tasks(runtime: &tokio::runtime::Handle) -> bool {
    let mut probe = runtime.spawn(std::future::ready(()));
    let polled = Pin::new(&mut probe).poll(&mut Context::from_waker(Waker::noop()));
    !matches!(polled, Poll::Ready(Err(error)) if error.is_cancelled())
}

/// A runtime of idem's own, on two worker threads (`idem-background`), started on first
/// use and never shut down; see the module docs. Two, so that one a store's code blocks
/// leaves the other to drive the connections and timers of every other operation. `None`
/// if the OS would not start it.
fn own_runtime() -> Option<&'static tokio::runtime::Handle> {
    static OWN: OnceLock<Option<tokio::runtime::Runtime>> = OnceLock::new();
    OWN.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("idem-background")
            .enable_all()
            .build()
            .ok()
    })
    .as_ref()
    .map(tokio::runtime::Runtime::handle)
}

/// An operation run in the background: its panic is caught and logged, not left to the
/// runtime, and dropped before its end (its runtime shut down), it is made again on
/// idem's own runtime, if it can be.
struct Detached {
    /// The operation, until it ends.
    operation: Option<Op>,
    rescue: Option<Rescue>,
}

impl Detached {
    /// The first poll, in `runtime`'s context.
    fn first_poll(&mut self, runtime: &tokio::runtime::Handle) -> Poll<()> {
        let _context = runtime.enter();
        self.poll_once(&mut Context::from_waker(Waker::noop()))
    }

    /// The first poll, in `runtime`'s context if there is one.
    fn first_poll_in(&mut self, runtime: Option<&tokio::runtime::Handle>) -> Poll<()> {
        let _context = runtime.map(tokio::runtime::Handle::enter);
        self.poll_once(&mut Context::from_waker(Waker::noop()))
    }

    fn poll_once(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let Some(operation) = self.operation.as_mut() else {
            return Poll::Ready(());
        };
        let polled = panic::catch_unwind(AssertUnwindSafe(|| operation.as_mut().poll(cx)));
        match polled {
            Ok(Poll::Pending) => return Poll::Pending,
            Ok(Poll::Ready(())) => {}
            Err(_) => tracing::error!("idem: a store operation run in the background panicked"),
        }
        self.operation = None;
        self.rescue = None;
        Poll::Ready(())
    }
}

impl Future for Detached {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.poll_once(cx)
    }
}

impl Drop for Detached {
    fn drop(&mut self) {
        let Some(operation) = self.operation.take() else {
            return;
        };
        // Its runtime is shutting down: what the operation registered there is gone,
        // so it is made again rather than moved.
        drop(operation);
        if let Some(rescue) = self.rescue.take() {
            tracing::debug!("idem: the runtime of a store operation shut down before its end; making it again on idem's own runtime");
            on_own_runtime(rescue());
        }
    }
}
