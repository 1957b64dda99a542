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
//! ## Options
//!
//! | option | meaning | default |
//! |---|---|---|
//! | `ttl = "24h"` | how long a result is kept and replayed, from completion (`ms`, `s`, `m`, `h`, `d`, combinable: `"1h30m"`) | 24 hours |
//! | `lease = "15s"` | how long a claim holds without a heartbeat: how soon a dead process's claim is taken over | 15 seconds, renewed every 5 |
//! | `max_run = "10m"` | the longest a body may run: its claim is renewed until then; an async body still running is stopped ([`Error::MaxRunExceeded`]) | 10 minutes |
//! | `on_cancel = "finish"` | a call its caller stops waiting for (a timeout, `select!`): `"finish"` runs the body on to its end in a task of its own and records its outcome; `"abort"` drops it and settles its claim at once | `"finish"` when the body uses nothing borrowed from its caller, else `"abort"` |
//! | `wait = "10s"` | how long a concurrent duplicate waits for the first call's result | `max_run` + `lease` |
//! | `fail_fast` | a concurrent duplicate gets [`Error::InProgress`] at once | off |
//! | `at_most_once` | a claim given up without an outcome (a crash, a dropped call, a panic) is [`Error::OutcomeUnknown`] instead of running again (payments) | at-least-once |
//! | `cache_errors` | store `Err` values and replay them too (needs `E: Serialize + Deserialize`) | errors release the key |
//! | `name = "send_email"` | the tool name in the key: a string literal, or an expression giving `&str` (`name = Self::NAME`) | the function's path: module, and for a method the type and the trait, with this call's generic arguments ([`key::default_tool_name`]) |
//! | `key = [input.to]` | the arguments or fields that form the key; the whole input is still fingerprinted, so the same key with another input is [`Error::PayloadMismatch`] | all arguments |
//! | `scope = [self.account]` | methods: fields of `self` that join the key (and the fingerprint), so two receivers with different configuration are two callers | the receiver is not in the key |
//! | `skip = [client]` | arguments that are context, not input (clients, connections) | none |
//! | `run = ctx.run()` | where the run comes from: an expression giving a `Run`, `&Run`, `Arc<Run>` or an `Option` of one (`None`: the ambient run) | a `Run` argument, else the ambient run |
//! | `map_error = path` | a function `idem::Error -> E`, when `E` has no `From<idem::Error>` | `From::from` |
//! | `crate = "my::idem"` | where the `idem` crate is, if you re-export it | `::idem` |
//!
//! **Two tools never share a key by default**: the default name is the function's path
//! as [`std::any::type_name`] writes it, so `notify` in two modules, `send` of two
//! traits on one type, and a generic tool at two types are separate tools. **Keep
//! `name` stable where keys must live long**: moving or renaming the function changes
//! its keys (calls made before run again), and the Rust project does not promise to
//! spell `type_name` alike in every compiler version; set `name` on tools whose keys
//! must outlive refactors or toolchain upgrades.
//!
//! **Methods: the receiver is not part of the key unless you say so.** A tool object
//! that carries its own configuration (two mail accounts, two tenants' clients) names
//! the fields that tell receivers apart: `#[idempotent(scope = [self.account])]`.
//! Without it, `alice.pay(500)` then `bob.pay(500)` in one run is one call.
//!
//! **Sets.** A `HashSet` argument is keyed as a set (sorted), since its own order is the
//! hash's and differs in every process; a `HashSet` elsewhere in an argument's type is
//! a compile error; inside an input struct, use `#[serde(serialize_with =
//! "idem::key::sorted")]` ([`key::sorted`]) or a `BTreeSet`.
//!
//! Durations over 100 years ([`Options::LONGEST`]) are compile errors at the literal.
//!
//! ## What the attribute accepts
//!
//! Async and sync functions, methods (`&self`, `&mut self`; the receiver joins the key
//! only through `scope`), generic functions, `impl Trait` and reference arguments (serialized, not
//! moved), destructured arguments (`Parameters(input): Parameters<T>`: the names they bind
//! are the input). An argument whose type is written `Run`, `&Run` or `idem::Run` is the
//! call's run (not part of the input; another crate's `Run` written by its path, like
//! `workflow::Run`, is an input);
//! otherwise the ambient run of [`Run::scope`] / [`Run::sync_scope`] is used, and with
//! neither the call is [`Error::NoRun`]. The function must return `Result<T, E>` with
//! `T: Serialize + DeserializeOwned` and `E: From<idem::Error>` (or `map_error`).
//!
//! An async tool that finishes when its caller stops waiting (the default for one whose
//! body uses nothing borrowed from its caller, or `on_cancel = "finish"`) must have a
//! `Send + 'static` body, with `T` and `E` `Send + 'static` too. With `on_cancel =
//! "finish"`, a method that uses `&self` runs on a clone of `self` (`Self: Clone`), and a
//! `&T` argument it uses on an owned copy (`T: ToOwned`).
//!
//! In `#[async_trait]` impls, put `#[idempotent]` on the method as usual: the impl's
//! `#[async_trait]` expands first and `#[idempotent]` wraps the boxed future it emits.
//!
//! ## TTL guidance
//!
//! The TTL must exceed the longest a run plus its retries can take: payments and
//! transactional emails 24 hours; notifications and record updates 1 hour; document
//! generation and exports 7 days. Reads (`get_customer`, `search_products`), logs and
//! analytics need no idempotency: leave them undecorated and save the store round trip.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

#[cfg(feature = "testing")]
pub use idem_core::testing;
pub use idem_core::{
    current_key, default_store, default_store_dir, key, options, protocol, record,
    set_default_store, store, sweeper, Call, Delivery, Error, Fingerprint, Key, LocalCache,
    MemoryStore, OnBusy, Options, Record, Run, State, Store,
};
#[cfg(feature = "postgres")]
pub use idem_core::{PostgresStore, PostgresStoreBuilder};
#[cfg(feature = "redis")]
pub use idem_core::{RedisStore, RedisStoreBuilder};
#[cfg(feature = "sled")]
pub use idem_core::{SledStore, SledStoreBuilder};
pub use idem_macros::idempotent;

/// What generated code calls. Not public API: may change in any release.
#[doc(hidden)]
pub mod __private {
    pub use idem_core::key::{default_tool_name, Sorted};
    pub use idem_core::protocol::{
        execute, execute_blocking, execute_finishing, from_idem_error, CacheErrors, Call, KeyInput,
        ReleaseErrors, RunArgument, RunSource, ToolOutput,
    };
    pub use idem_core::Options;
}
