//! The runtime of [idem](https://docs.rs/idem): keys, records, the [`Store`] trait, the
//! idempotency protocol and the stores.
//!
//! Most users depend on the `idem` crate and write `#[idempotent]`; this crate is what
//! the attribute calls, and what a custom store implements. `docs/layout.md` in the
//! repository maps every file, and says which threads idem starts and when.
//!
//! # Logging
//!
//! Every call runs in an `execute_tool` span (OpenTelemetry's GenAI conventions, with
//! `idem.outcome`); see `telemetry.rs` and `docs/observability.md`. Inside it, idem
//! logs through [`tracing`]: `debug` for misses, hits and short waits; `info` for a
//! takeover after a crash, a wait that lasts (over a second), and a claim settled because
//! its call was dropped or panicked; `warn` for payload mismatches, lost leases, failed
//! renewals, bodies stopped at `max_run` and unknown outcomes; `error` for a body that
//! panicked.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod background;
mod blocking;
mod canonical;
mod error;
mod heartbeat;
mod key;
mod key_text;
#[cfg(feature = "mcp")]
pub mod mcp;
mod options;
mod protocol;
mod read_back;
mod reconcile;
mod record;
mod run;
pub mod store;
pub mod sweeper;
mod sync;
mod telemetry;
#[cfg(feature = "testing")]
pub mod testing;
mod timer;
pub mod tool;
mod wait;

/// Helpers for a tool's own input types.
pub mod input {
    pub use crate::key::{sorted, Sorted};
}

pub use error::{Error, LostTo, StoreErrorKind};
pub use key_text::Key;
pub use options::{Delivery, OnBusy, OnCancel, Options};
pub use reconcile::Reconciled;
pub use run::{current_key, default_store, default_store_dir, set_default_store, Run};
pub use store::local_cache::LocalCache;
pub use store::memory::MemoryStore;
#[cfg(feature = "postgres")]
pub use store::postgres::{PostgresStore, PostgresStoreBuilder};
#[cfg(feature = "redis")]
pub use store::redis::{RedisStore, RedisStoreBuilder};
#[cfg(feature = "sled")]
pub use store::sled::{SledStore, SledStoreBuilder};
#[cfg(feature = "sqlite")]
pub use store::sqlite::{SqliteStore, SqliteStoreBuilder};
pub use store::Store;
#[cfg(feature = "metrics")]
pub use telemetry::describe_metrics;
pub use telemetry::{observe, observe_sync, CallOutcome, CallReport};
pub use tool::Tool;

/// What the `#[idempotent]` attribute's code calls, through the `idem` facade. Not
/// public API: it may change in any release.
#[doc(hidden)]
pub mod __private {
    pub use crate::key::{default_tool_name, KeyInput, Sorted};
    pub use crate::protocol::{
        execute, execute_blocking, execute_finishing, from_idem_error, CacheErrors, Call, Checked,
        Compare, ErrorCodec, ErrorPolicy, Execution, FinishesAlone, ReleaseErrors, Replayable,
        RunArgument, RunSource, ToolName, ToolOutput,
    };
    pub use crate::read_back::{
        Equality, ErrByJson, ErrByPartialEq, JsonOnly, OkByJson, OkByPartialEq, Probe,
    };
    pub use crate::reconcile::{hook_answer, reconcile};
}
