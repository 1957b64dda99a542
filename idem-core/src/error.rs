//! The one error type of idem.

use std::error::Error as StdError;

/// Everything that can go wrong around an idempotent call.
///
/// Each variant says what happened and what the caller can do. None of them means the
/// operation ran twice: when idem cannot prove that running the operation is safe, it
/// returns one of these instead of running it (it *fails closed*).
///
/// Tool functions return `Result<T, E>` with `E: From<idem::Error>`, so these errors reach
/// the agent through the tool's own error type.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The call had no run id: no `Run` argument and no ambient run (`Run::scope` or
    /// `Run::sync_scope`). idem never derives a key from a missing run id, since every
    /// run would then share it.
    #[error(
        "no run for idempotent tool `{tool}`: call it inside `Run::scope` / `Run::sync_scope`, \
         or pass a `&Run` argument"
    )]
    NoRun {
        /// The tool that was called.
        tool: String,
    },

    /// The key already belongs to a call with a different input. This happens when the key
    /// is built from only some arguments (`key = [...]`) and another argument changed. The
    /// stored result belongs to the other input and is not returned. Use a new run id, or
    /// put the changed argument into the key.
    #[error(
        "payload mismatch for key `{key}`: the key was first used with a different input; \
         the stored result is not replayed for this one"
    )]
    PayloadMismatch {
        /// The idempotency key.
        key: String,
    },

    /// Another call with the same key is running and its lease has not expired; this call
    /// did not wait for it (fail-fast policy) or waited as long as it was allowed to. Retry
    /// later: the retry returns the first call's result once it completes.
    #[error(
        "call with key `{key}` is already in progress elsewhere; retry later to receive its result"
    )]
    InProgress {
        /// The idempotency key.
        key: String,
    },

    /// An earlier call with this key claimed it and then stopped (crash, kill, lost
    /// connection) before recording an outcome, and the tool is at-most-once: it is unknown
    /// whether the side effect happened, so it is not run again. Check the downstream
    /// system, then remove the record (`Store::delete`) to allow a new attempt.
    #[error(
        "outcome unknown for key `{key}`: an earlier call claimed it and never finished; \
         the tool is at-most-once, so it is not run again (check downstream, then delete the key)"
    )]
    OutcomeUnknown {
        /// The idempotency key.
        key: String,
    },

    /// This call ran the operation, but its lease expired while it ran and another caller
    /// took the key over, so this call's result was not stored (fencing). The result
    /// returned by the new owner is the one the store keeps: retry to receive it. Raise the
    /// tool's lease above its longest run time to avoid this.
    #[error(
        "lease lost for key `{key}`: the operation outlived its lease and another caller took \
         over; this result was not stored (retry to receive the stored one, or raise the lease)"
    )]
    LostLease {
        /// The idempotency key.
        key: String,
    },

    /// The input (or the part of it that forms the key) cannot be serialized, for example
    /// a map whose keys are not strings. Nothing was run. Change the argument's type, or
    /// leave the argument out of the key.
    #[error("input of tool `{tool}` cannot be serialized into an idempotency key: {source}")]
    Input {
        /// The tool that was called.
        tool: String,
        /// What serde reported.
        #[source]
        source: serde_json::Error,
    },

    /// The operation's result (or error, when errors are cached) cannot be serialized, so
    /// it cannot be stored. The body has run. At-least-once tools release the key;
    /// at-most-once tools keep the claim, so a retry gets [`Error::OutcomeUnknown`].
    /// Change the result type so it serializes.
    #[error("result for key `{key}` cannot be serialized for storage: {source}")]
    Output {
        /// The idempotency key.
        key: String,
        /// What serde reported.
        #[source]
        source: serde_json::Error,
    },

    /// The tool's result is larger than the store takes ([`Store::max_result_bytes`](crate::Store::max_result_bytes)),
    /// so it was not stored. The body has run. At-least-once tools release the key (a
    /// retry runs again); at-most-once tools keep the claim, so a retry gets
    /// [`Error::OutcomeUnknown`]. Return a reference to large data (an id, a URL)
    /// instead of the data.
    #[error(
        "result for key `{key}` is {size} bytes, over the store's limit of {limit}; it was not stored"
    )]
    ResultTooLarge {
        /// The idempotency key.
        key: String,
        /// The serialized result's size in bytes.
        size: usize,
        /// The store's limit.
        limit: usize,
    },

    /// A completed result is stored under the key but no longer deserializes into the
    /// function's return type (its type changed since it was stored). Nothing was run.
    /// Delete the key, or keep the old type's fields deserializable.
    #[error(
        "stored result for key `{key}` no longer deserializes into the expected type: {source}"
    )]
    StoredResult {
        /// The idempotency key.
        key: String,
        /// What serde reported.
        #[source]
        source: serde_json::Error,
    },

    /// The bytes stored under the key are not a record idem can read. Nothing was run and
    /// nothing else in the store was touched. Delete the key to start over.
    #[error("corrupt record under key `{key}`: {reason}")]
    CorruptRecord {
        /// The idempotency key (lossily decoded, if the stored key was not UTF-8).
        key: String,
        /// What is wrong with the bytes.
        reason: String,
    },

    /// The record under the key was written in a format version this build of idem does
    /// not know (written by a newer idem). Nothing was run. Upgrade idem.
    #[error("record under key `{key}` has unknown format version {version}; upgrade idem")]
    UnsupportedFormat {
        /// The idempotency key.
        key: String,
        /// The version byte found.
        version: u8,
    },

    /// The store could not be reached or failed (I/O error, lost connection, locked
    /// database). The operation was not run unguarded. Retry when the store is back.
    #[error("{store} store failed: {source}; the operation was not run")]
    Store {
        /// Which store ("sled", "memory", ...).
        store: &'static str,
        /// The underlying error.
        #[source]
        source: Box<dyn StdError + Send + Sync>,
    },
}

impl Error {
    /// Wraps a store's own error.
    pub fn store(store: &'static str, source: impl Into<Box<dyn StdError + Send + Sync>>) -> Self {
        Error::Store {
            store,
            source: source.into(),
        }
    }

    /// The idempotency key the error is about, if it is about one key.
    pub fn key(&self) -> Option<&str> {
        match self {
            Error::PayloadMismatch { key }
            | Error::InProgress { key }
            | Error::OutcomeUnknown { key }
            | Error::LostLease { key }
            | Error::Output { key, .. }
            | Error::ResultTooLarge { key, .. }
            | Error::StoredResult { key, .. }
            | Error::CorruptRecord { key, .. }
            | Error::UnsupportedFormat { key, .. } => Some(key),
            Error::NoRun { .. } | Error::Input { .. } | Error::Store { .. } => None,
        }
    }
}
