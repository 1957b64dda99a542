//! # idem: AI-agent tool calls that are safe to retry
//!
//! An agent calls a tool with a real side effect (send an email, charge a card). The call
//! times out, the agent retries, and the side effect happens twice. One attribute fixes
//! that:
//!
//! ```no_run
//! use idem::{idempotent, Run};
//! # #[derive(serde::Serialize)] struct SendEmail { to: String }
//! # #[derive(Debug, serde::Serialize, serde::Deserialize)] struct MessageId(String);
//! # #[derive(Debug)] enum ToolError { Idem(idem::Error) }
//! # impl From<idem::Error> for ToolError { fn from(e: idem::Error) -> Self { ToolError::Idem(e) } }
//!
//! #[idempotent(ttl = "24h")]
//! async fn send_email(input: SendEmail) -> Result<MessageId, ToolError> {
//!     // the side effect: runs at most once per (run, tool, input) within the TTL
//!     Ok(MessageId("msg-1".into()))
//! }
//!
//! # async fn agent() -> Result<(), ToolError> {
//! let run = Run::new("run-42"); // the default store: embedded sled in ./.idem
//! let input = SendEmail { to: "ada@example.com".into() };
//! let sent = run.scope(send_email(input)).await?;
//! # Ok(()) }
//! ```
//!
//! The attribute derives a key from the run id, the tool's name and a SHA-256 of the
//! input. A call whose key already completed returns the stored result without running
//! the body; concurrent duplicates wait for the first; a failed call releases the key
//! so a retry runs again.
//!
//! A call's life is settled whatever its caller or its body does. A call the agent
//! stops waiting for (its own `tokio::time::timeout`) finishes in the background and
//! records its result, so the retry gets it; a body that cannot outlive its caller (it
//! borrows from it) and a body that panics settle their claim at once (released, or
//! recorded as outcome-unknown under `at_most_once`); a running body's claim is renewed,
//! so only a dead process's claim waits out a lease. Inside the body, [`current_key`] gives the key to forward
//! downstream (Stripe's `Idempotency-Key`).
//!
//! ## Seeing what it does
//!
//! Every call runs in an `execute_tool` span (OpenTelemetry's GenAI conventions, with
//! `idem.outcome`: `executed`, `replayed`, ...), so `tracing-opentelemetry` shows it
//! under the agent's span. [`observe`] tells a caller whether a value was replayed.
//! The `metrics` feature counts calls by tool and outcome through the `metrics` facade
//! (`describe_metrics` lists them). See `docs/observability.md`.
//!
//! ## Without the attribute
//!
//! A tool known only at run time (a name from a request, a `serde_json::Value` input,
//! a plugin, an MCP server that forwards calls) uses [`Tool`], the same protocol with
//! the same keys and records:
//!
//! ```no_run
//! # async fn demo(run: idem::Run, args: serde_json::Value) -> Result<(), idem::Error> {
//! let tool = idem::Tool::new("send_email").ttl(std::time::Duration::from_secs(86_400));
//! let sent: serde_json::Value = tool
//!     .call(&run, &args, |key| async move { Ok(serde_json::json!({ "id": key.to_string() })) })
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! ## Options
//!
//! Every option, what the attribute accepts and the TTL guidance are on the attribute
//! itself: [`idempotent`].

#![forbid(unsafe_code)]
#![warn(missing_docs)]

#[cfg(feature = "metrics")]
pub use idem_core::describe_metrics;
pub use idem_core::sweeper;
pub use idem_core::{
    current_key, default_store, default_store_dir, observe, observe_sync, set_default_store,
    CallOutcome, CallReport, Delivery, Error, Key, LocalCache, LostTo, MemoryStore, OnBusy,
    OnCancel, Options, Reconciled, Run, Store, StoreErrorKind, Tool,
};
#[cfg(feature = "postgres")]
pub use idem_core::{PostgresStore, PostgresStoreBuilder};
#[cfg(feature = "redis")]
pub use idem_core::{RedisStore, RedisStoreBuilder};
#[cfg(feature = "sled")]
pub use idem_core::{SledStore, SledStoreBuilder};
#[cfg(feature = "sqlite")]
pub use idem_core::{SqliteStore, SqliteStoreBuilder};
pub use idem_macros::idempotent;

/// Exactly-once `tools/call` for MCP servers: [`Idempotent`](mcp::Idempotent) wraps
/// any rmcp server, and [`Policy`](mcp::Policy) holds the rules (which tools, where the
/// run id is, what a replay says). See `docs/frameworks.md`.
#[cfg(feature = "rmcp")]
pub use idem_core::mcp;

/// For authors of stores: the [`Store`] trait and its contract, the claim rule, records,
/// and (feature `testing`) the conformance suite every store must pass.
pub mod store {
    pub use idem_core::store::*;
    #[cfg(feature = "testing")]
    pub use idem_core::testing;
}

/// The dynamic API: [`Tool`], idempotency for a tool known only at run time (see
/// `docs/dynamic.md`), and what happens to a body's `Err`.
pub mod tool {
    pub use idem_core::tool::{CacheErrors, ErrorPolicy, ReleaseErrors, Tool};
}

/// Helpers for a tool's own input types.
pub mod key {
    pub use idem_core::input::{sorted, Sorted};
}

/// What generated code calls. Not public API: may change in any release. Its name
/// carries the version, which `idem-macros` writes into the code it generates, so an
/// `idem-macros` of another version fails to compile instead of misbehaving (rename it
/// with the version: every attribute test fails until then).
#[doc(hidden)]
pub mod __private_0_1_0 {
    pub use idem_core::__private::{
        default_tool_name, execute, execute_blocking, execute_finishing, from_idem_error,
        hook_answer, reconcile, CacheErrors, Call, Checked, Compare, Equality, ErrByJson,
        ErrByPartialEq, JsonOnly, KeyInput, OkByJson, OkByPartialEq, Probe, ReleaseErrors,
        Replayable, RunArgument, RunSource, Sorted, ToolName, ToolOutput,
    };
    pub use idem_core::{Key, Options};
}
