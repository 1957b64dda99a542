//! The runtime of [idem](https://docs.rs/idem): keys, records, the [`Store`] trait, the
//! idempotency protocol and the stores.
//!
//! Most users depend on the `idem` crate and write `#[idempotent]`; this crate is what
//! the attribute calls, and what a custom store implements. Where to find things:
//!
//! | concept | module |
//! |---|---|
//! | key derivation, canonical input, fingerprint | [`key`] |
//! | records and their encoding | [`record`] |
//! | the `Store` trait and the claim rule | [`store`] |
//! | the protocol (claim → run → complete / release) | [`protocol`] |
//! | per-tool options (TTL, lease, waiting, delivery) | [`options`] |
//! | the run context, `current_key`, the default store | [`run`] |
//! | the stores | [`MemoryStore`], [`SledStore`], `PostgresStore` (feature `postgres`), `RedisStore` (feature `redis`) |
//! | replaying this process's results from memory, in front of a shared store | [`LocalCache`] |
//! | removing expired records in the background | [`sweeper`] |
//! | the store conformance suite (feature `testing`) | `testing` |
//!
//! # Logging
//!
//! idem logs through [`tracing`]: `debug` for misses, hits and short waits; `info` for a
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
pub mod key;
mod key_text;
pub mod options;
pub mod protocol;
pub mod record;
pub mod run;
pub mod store;
pub mod sweeper;
mod sync;
#[cfg(feature = "testing")]
pub mod testing;
mod timer;
mod wait;

pub use error::Error;
pub use key::{Fingerprint, Key, KeyParts};
pub use options::{Delivery, OnBusy, Options};
pub use protocol::{
    execute, execute_blocking, execute_finishing, CacheErrors, Call, ErrorPolicy, KeyInput,
    ReleaseErrors, Replayable, RunSource, ToolOutput,
};
pub use record::{Record, State, Timestamp, Token};
pub use run::{current_key, default_store, default_store_dir, set_default_store, Run};
pub use store::local_cache::LocalCache;
pub use store::memory::MemoryStore;
#[cfg(feature = "postgres")]
pub use store::postgres::{PostgresStore, PostgresStoreBuilder};
#[cfg(feature = "redis")]
pub use store::redis::{RedisStore, RedisStoreBuilder};
#[cfg(feature = "sled")]
pub use store::sled::{SledStore, SledStoreBuilder};
pub use store::Store;
