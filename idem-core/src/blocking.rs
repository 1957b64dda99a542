//! Blocking work: which thread is blocked in a sync tool, and handing blocking work to
//! tokio's blocking pool without its one panic.
//!
//! `tokio::task::spawn_blocking` panics ("OS can't spawn worker thread") when the pool
//! has no thread and the OS refuses to start one: a process at its thread limit, or a
//! runtime built with a stack size the OS cannot map. The stores use the pool for work
//! that would otherwise stall async tasks (a sled flush on a current-thread runtime,
//! sled's purge walk, freeing purged memory records). [`hand_off`] does the same, but
//! when no thread can take the work it gives the work back, and the store runs it in
//! place, as it does when there is no runtime at all: slower for the other tasks of the
//! runtime, but the call goes on. (tokio's panic is caught, so the panic hook still
//! reports it; built with `panic = "abort"`, the process aborts there as before.)

use std::panic::{self, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

/// Work on the blocking pool, and its result to come (awaited by the sled and SQLite
/// stores; the memory store only hands work off).
#[cfg_attr(not(any(feature = "sled", feature = "sqlite")), allow(dead_code))]
pub(crate) struct HandedOff<F, R> {
    /// The work, until a pool thread takes it.
    work: Arc<Mutex<Option<F>>>,
    result: oneshot::Receiver<R>,
}

/// Takes the work out of its slot, whoever gets there first.
fn take<F>(work: &Mutex<Option<F>>) -> Option<F> {
    crate::sync::lock(work).take()
}

/// Hands `work` to the blocking pool of the tokio runtime this runs in. Gives it back,
/// to be run in place, when there is no runtime or its pool cannot start a thread.
pub(crate) fn hand_off<F, R>(work: F) -> Result<HandedOff<F, R>, F>
where
    F: FnOnce() -> R + Send + 'static,
    R: Send + 'static,
{
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return Err(work);
    };
    let work = Arc::new(Mutex::new(Some(work)));
    let (send, result) = oneshot::channel();
    let task = {
        let work = Arc::clone(&work);
        move || {
            if let Some(work) = take(&work) {
                // The caller may have stopped waiting (a detached hand-off, a
                // cancelled call): the work is done either way.
                let _ = send.send(work());
            }
        }
    };
    let spawned = panic::catch_unwind(AssertUnwindSafe(|| drop(runtime.spawn_blocking(task))));
    if spawned.is_err() {
        // The task sits in the pool's queue with no thread to run it. Unless a thread
        // started since has already taken it, take it back.
        if let Some(work) = take(&work) {
            tracing::warn!("no blocking thread could be started: running the work in place");
            return Err(work);
        }
    }
    Ok(HandedOff { work, result })
}

#[cfg(any(feature = "sled", feature = "sqlite"))]
impl<F: FnOnce() -> R, R> HandedOff<F, R> {
    /// Waits for the work's result. Runs the work in place if the pool dropped it
    /// unrun (the runtime is shutting down); `None` if the work panicked.
    pub(crate) async fn join(self) -> Option<R> {
        match self.result.await {
            Ok(result) => Some(result),
            Err(_) => take(&self.work).map(|work| work()),
        }
    }
}

/// Runs `work` on the blocking pool and waits for it, or runs it in place (see
/// [`hand_off`]); `None` if it panicked on the pool.
#[cfg(any(feature = "sled", feature = "sqlite"))]
pub(crate) async fn run<F, R>(work: F) -> Option<R>
where
    F: FnOnce() -> R + Send + 'static,
    R: Send + 'static,
{
    match hand_off(work) {
        Ok(handed) => handed.join().await,
        Err(work) => Some(work()),
    }
}

thread_local! {
    /// Whether this thread is inside a sync tool's call.
    static IN_SYNC_TOOL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks the thread as blocked in a sync tool's call while it lives.
pub(crate) struct InSyncTool(bool);

impl InSyncTool {
    pub(crate) fn enter() -> Self {
        InSyncTool(IN_SYNC_TOOL.with(|b| b.replace(true)))
    }
}

impl Drop for InSyncTool {
    fn drop(&mut self) {
        let previous = self.0;
        IN_SYNC_TOOL.with(|b| b.set(previous));
    }
}

/// Whether this thread is inside a sync tool's call: blocked, so whatever it would
/// drive (a current-thread runtime's timers and sockets) waits.
pub(crate) fn in_sync_tool() -> bool {
    IN_SYNC_TOOL.with(|b| b.get())
}
