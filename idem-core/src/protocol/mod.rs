//! The protocol: claim → run → complete (or release), and every answer in between.
//!
//! The `#[idempotent]` attribute turns a tool function into a call of [`execute`],
//! [`execute_finishing`] (async tools) or [`execute_blocking`] (sync tools), and
//! [`Tool`](crate::Tool) calls the same functions. They are the typed shim
//! (`typed.rs`): the only code a tool instantiates for its own types. Everything else
//! is compiled once, for every tool:
//!
//! | file | what |
//! |---|---|
//! | `call.rs` | the call: its run, key, fingerprint, options and telemetry |
//! | `claim.rs` | claiming the key, the hit path, and waiting for another call's claim |
//! | `finish.rs` | the owner's part: the body with its heartbeat, recording its outcome, finishing alone, the late record |
//! | `settle.rs` | settling a claim left without an outcome |
//! | `typed.rs` | the shim: a tool's types meet the protocol (serializing, decoding, the read-back check) |
//!
//! None of this is public API (the attribute reaches it through a hidden module); in
//! substance the generated code does this:
//!
//! ```
//! # async fn demo() -> Result<(), idem_core::Error> {
//! use idem_core::__private::{execute, Call, ReleaseErrors};
//! use idem_core::{MemoryStore, Options, Run};
//!
//! let run = Run::new("run-1").with_store(MemoryStore::new());
//! let to = "ada@example.com";
//! let call = Call::new(Some(&run), "send_email", Options::new(), &to);
//! let sent: Result<String, idem_core::Error> =
//!     execute::<_, ReleaseErrors, _>(call, async { Ok(format!("sent to {to}")) }).await?;
//! assert_eq!(sent?, "sent to ada@example.com");
//! # Ok(()) }
//! ```
//!
//! 1. **Claim** the key. Completed with the same fingerprint: replay the stored value,
//!    the operation does not run (an in-process store answers this case before the
//!    claim, through [`Store::with_completed_result`]). Another fingerprint: [`Error::PayloadMismatch`].
//!    Held by a live lease: wait (bounded; woken in-process, polling otherwise) or fail
//!    fast with [`Error::InProgress`]. Lease expired: take over and run
//!    ([`Delivery::AtLeastOnce`](crate::Delivery)) or [`Error::OutcomeUnknown`]
//!    ([`Delivery::AtMostOnce`](crate::Delivery)).
//! 2. **Run** the operation once, with [`current_key`](crate::current_key) set, renewing
//!    the claim every third of its lease while it runs (the heartbeat), up to `max_run`.
//! 3. `Ok`: **complete** the key with the serialized value (fenced by the token; an
//!    owner whose claim was taken over gets [`Error::LostLease`]). `Err`: **release** the
//!    key so a retry runs again, or, with [`CacheErrors`], store the error for replay.
//!
//! The protocol holds no lock while the operation runs. A call settles its claim
//! whatever happens to it:
//!
//! - dropped by its caller mid-operation: [`execute_finishing`] runs the operation on to
//!   its end in a task of its own; [`execute`] drops it and settles the claim at once;
//! - the operation panics: the claim is settled at once, then the panic goes on;
//! - the operation runs past `max_run`: it is stopped, the claim settled, and the caller
//!   gets [`Error::MaxRunExceeded`].
//!
//! To settle is to follow the delivery policy: at-least-once releases the claim (a
//! retry runs at once), at-most-once gives it up as abandoned (a retry gets
//! [`Error::OutcomeUnknown`] at once). Only a process that dies leaves its claim to run
//! out, one lease after its last renewal.

mod call;
mod claim;
mod finish;
mod settle;
mod typed;

pub(crate) use call::Refusal;
pub use call::{Call, ToolName};
pub use typed::{
    execute, execute_blocking, execute_finishing, from_idem_error, CacheErrors, Checked, Compare,
    ErrorCodec, ErrorPolicy, Execution, FinishesAlone, ReleaseErrors, Replayable, RunArgument,
    RunSource, ToolOutput,
};
