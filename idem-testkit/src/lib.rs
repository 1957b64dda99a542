//! idem's own test harness, shared by its tests, examples and benches; not published.
//!
//! - [`campaign`]: the crash campaign, a worker process killed at chosen and random
//!   points, with a ledger of every side effect.
//! - [`scenario`]: the workload the benchmarks measure, and the hand-written floors
//!   they compare against.
//! - [`provider`]: a local payment provider that honours `Idempotency-Key`.
//! - [`faults`]: stores that fail, panic or count on demand.
//! - [`mcp`]: an rmcp server with a side-effecting tool, over stdio or streamable HTTP.
//!
//! Each feature (`sled`, `postgres`, `redis`, `sqlite`, `rmcp`) turns on idem's feature
//! of the same name and the support that needs it; the `idem` package turns them on
//! from its own features.

#![warn(missing_docs)]

pub mod campaign;
pub mod faults;
#[cfg(feature = "rmcp")]
pub mod mcp;
pub mod provider;
#[cfg(feature = "sled")]
pub mod scenario;
