//! The one error type of idem.

use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

use crate::key_text::Key;

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
    /// `Run::sync_scope`), or a run whose id is blank (empty, or only whitespace and
    /// invisible characters, as a request's `_meta["idem/run"] = ""` gives). idem never
    /// derives a key from a missing run id, since every run would then share it: a
    /// second agent's identical call would get the first one's result and never run.
    #[error("{}", no_run(tool, blank_id.as_deref()))]
    NoRun {
        /// The tool that was called.
        tool: String,
        /// The run's id, when a run was given but its id is blank; `None` when no run
        /// was given at all.
        blank_id: Option<String>,
    },

    /// The run has no store, and there is no default one: idem was built without its
    /// `sled` feature (the default store), and no store was set. Nothing was run. Give
    /// the run a store with `Run::with_store(..)`, set a process-wide one with
    /// `idem::set_default_store(..)`, or enable the `sled` feature.
    #[error(
        "no store for this run: idem was built without its `sled` feature, which provides \
         the default store; give the run a store with `Run::with_store(..)`, set one with \
         `idem::set_default_store(..)`, or enable the `sled` feature"
    )]
    NoStore,

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
        key: Key,
    },

    /// Another call with the same key is running: its claim is alive (renewed by its
    /// heartbeat while its body runs). This call did not wait for it (`fail_fast`) or
    /// waited as long as it was allowed to (`wait`). Nothing was run. Retry later: the
    /// retry returns the first call's result once it completes.
    #[error(
        "key `{key}` is held by another call that is still running (its claim holds for \
         {lease_left} more, renewed while that call runs, up to its max_run); this call waited \
         {waited}; retry later to receive its result, or raise `wait` to wait for it",
        lease_left = Human(*lease_left),
        waited = Human(*waited)
    )]
    InProgress {
        /// The idempotency key.
        key: Key,
        /// How long the other call's claim held when this call gave up, unless renewed.
        lease_left: Duration,
        /// How long this call waited for it.
        waited: Duration,
    },

    /// An earlier call with this key claimed it and stopped without recording an outcome,
    /// and the tool is at-most-once: it is unknown whether the side effect happened, so it
    /// is not run again. The earlier call's process died (its lease ran out), or, in a live
    /// process, the call was cancelled, panicked or was stopped at its `max_run`. Check the
    /// downstream system, then settle the record: `idem resolve KEY --completed JSON` (it
    /// happened: every call replays that result) or `idem resolve KEY --release` (it did
    /// not: the next call runs), or `Store::resolve` in code; a `reconcile` hook on the tool
    /// does this before answering. Otherwise this answer stands until the record expires.
    #[error(
        "outcome unknown for key `{key}`: an earlier call claimed it and stopped without \
         recording an outcome (its process died, or it was cancelled, panicked or stopped at \
         its max_run); the tool is at-most-once, so it is not run again: check the downstream \
         system, then settle the record (`idem resolve {key} --completed JSON` if it happened, \
         `--release` if not), or this answer stands for {expires_in}, until the record expires",
        expires_in = Human(*expires_in)
    )]
    OutcomeUnknown {
        /// The idempotency key.
        key: Key,
        /// How long the record of the unfinished call lives on.
        expires_in: Duration,
    },

    /// This call ran the operation, but lost its claim while it ran, and its result was
    /// not stored (fencing); an async body still running when the loss was noticed was
    /// stopped. [`LostTo`] says what holds the key now: another call took it over (the
    /// process was paused past the lease, a stopped process or a VM migration, or its
    /// renewals could not reach the store for a whole lease), and a retry receives that
    /// call's outcome; or the record was removed (`idem evict --force`,
    /// `Store::delete`), nothing is stored, and a retry runs the body again.
    #[error(
        "lease lost for key `{key}`: this call's claim was {what} while its body ran; its \
         result was not stored: {then}",
        what = lost_to.what(),
        then = lost_to.then()
    )]
    LostLease {
        /// The idempotency key.
        key: Key,
        /// What holds the key now.
        lost_to: LostTo,
    },

    /// The body ran longer than the tool's `max_run` and was stopped (dropped at its
    /// current `.await`). Its claim was settled by the tool's delivery policy: at-least-once
    /// released it, so a retry runs the body again; at-most-once recorded the outcome as
    /// unknown, so a retry gets [`Error::OutcomeUnknown`]. The body may have had side
    /// effects before it was stopped. Raise `max_run` if the body needs longer.
    #[error(
        "the body for key `{key}` ran past its max_run of {max_run} and was stopped; its claim \
         was settled by the tool's delivery policy (at-least-once: a retry runs it again; \
         at-most-once: a retry gets OutcomeUnknown); raise `max_run` if it needs longer",
        max_run = Human(*max_run)
    )]
    MaxRunExceeded {
        /// The idempotency key.
        key: Key,
        /// The limit it ran into.
        max_run: Duration,
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
    /// at-most-once tools record the outcome as unknown, so a retry gets
    /// [`Error::OutcomeUnknown`] at once. Change the result type so it serializes.
    #[error("result for key `{key}` cannot be serialized for storage: {source}")]
    Output {
        /// The idempotency key.
        key: Key,
        /// What serde reported.
        #[source]
        source: serde_json::Error,
    },

    /// The tool's result is larger than the store takes ([`Store::max_result_bytes`](crate::Store::max_result_bytes)),
    /// so it was not stored. The body has run. At-least-once tools release the key (a
    /// retry runs again); at-most-once tools record the outcome as unknown, so a retry
    /// gets [`Error::OutcomeUnknown`] at once. Return a reference to large data (an id,
    /// a URL) instead of the data.
    #[error(
        "result for key `{key}` is {size} bytes, over the store's limit of {limit}; it was not stored"
    )]
    ResultTooLarge {
        /// The idempotency key.
        key: Key,
        /// The serialized result's size in bytes.
        size: usize,
        /// The store's limit.
        limit: usize,
    },

    /// The operation's result (or error, when errors are cached) serializes to JSON that
    /// does not read back as the same value of its own type, so a retry could not
    /// replay it: it was not stored. The body has run. At-least-once tools release the
    /// key; at-most-once tools record the outcome as unknown, so a retry gets
    /// [`Error::OutcomeUnknown`] at once. Typical causes: a NaN or infinite float (JSON
    /// writes it as `null`), `skip_serializing_if` without a matching `default`,
    /// `#[serde(flatten)]` over a field serde_json cannot read back (`u128`), an
    /// untagged enum whose variants overlap (`1` read back as `1.0`).
    #[error(
        "the result of tool `{tool}` (key `{key}`) cannot be stored: a retry could not read \
         it back as the same value ({source}); the body has run, and its claim was settled \
         by the tool's delivery policy"
    )]
    Unreplayable {
        /// The tool that was called.
        tool: String,
        /// The idempotency key.
        key: Key,
        /// What serde reported when reading the result back.
        #[source]
        source: serde_json::Error,
    },

    /// A completed result is stored under the key but does not deserialize into the
    /// function's return type. idem stores only results that read back, so the type
    /// changed since it was stored (or the record was written by a build without that
    /// check). Nothing was run. Delete the key, or keep the old type's fields
    /// deserializable.
    #[error(
        "stored result for key `{key}` does not deserialize into the tool's return type \
         (the type changed since the result was stored?): {source}"
    )]
    StoredResult {
        /// The idempotency key.
        key: Key,
        /// What serde reported.
        #[source]
        source: serde_json::Error,
    },

    /// The bytes stored under the key are not a record idem can read. Nothing was run and
    /// nothing else in the store was touched. Delete the key to start over.
    #[error("corrupt record under key `{key}`: {reason}")]
    CorruptRecord {
        /// The idempotency key (lossily decoded, if the stored key was not UTF-8).
        key: Key,
        /// What is wrong with the bytes.
        reason: String,
    },

    /// The record under the key was written in a format version this build of idem does
    /// not know (written by a newer idem). Nothing was run. Upgrade idem.
    #[error("record under key `{key}` has unknown format version {version}; upgrade idem")]
    UnsupportedFormat {
        /// The idempotency key.
        key: Key,
        /// The version byte found.
        version: u8,
    },

    /// The operating system's random source failed, so idem cannot make the token
    /// that fences a claim. Nothing was run.
    #[error(
        "the operating system's random source failed ({reason}): idem cannot make a claim \
         token; the operation was not run"
    )]
    Random {
        /// What the random source reported.
        reason: String,
    },

    /// The store does not offer this operation (a custom store that implements only
    /// the protocol's methods of [`Store`](crate::Store), not the operator's). Nothing
    /// was changed.
    #[error("the {store} store does not support `{operation}`")]
    Unsupported {
        /// Which store.
        store: &'static str,
        /// The operation asked for (`list`, `resolve`).
        operation: &'static str,
    },

    /// The store could not be reached or failed (I/O error, lost connection, locked
    /// database) before the operation ran: it was **not run**. Retry when the store is
    /// back.
    ///
    /// A store that fails *after* the body ran never gives this error: the caller gets
    /// the body's own value, and idem tries to record it again in the background (see
    /// `docs/errors.md`).
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

    /// Wraps a store's own error of a known [`StoreErrorKind`].
    pub fn store_of_kind(
        store: &'static str,
        kind: StoreErrorKind,
        source: impl Into<Box<dyn StdError + Send + Sync>>,
    ) -> Self {
        Error::store(
            store,
            Kinded {
                kind,
                source: source.into(),
            },
        )
    }

    /// What kind of failure an [`Error::Store`] is (`None` for any other error): a bad
    /// setting, a store another process holds, a missing table, or
    /// [`StoreErrorKind::Other`]. For a program that acts on the failure (an exit code,
    /// a hint) without reading its message, which may be reworded.
    pub fn store_kind(&self) -> Option<StoreErrorKind> {
        let Error::Store { source, .. } = self else {
            return None;
        };
        Some(
            source
                .downcast_ref::<Kinded>()
                .map_or(StoreErrorKind::Other, |k| k.kind),
        )
    }

    /// The idempotency key the error is about, if it is about one key.
    pub fn key(&self) -> Option<&Key> {
        match self {
            Error::PayloadMismatch { key }
            | Error::InProgress { key, .. }
            | Error::OutcomeUnknown { key, .. }
            | Error::LostLease { key, .. }
            | Error::MaxRunExceeded { key, .. }
            | Error::Output { key, .. }
            | Error::ResultTooLarge { key, .. }
            | Error::Unreplayable { key, .. }
            | Error::StoredResult { key, .. }
            | Error::CorruptRecord { key, .. }
            | Error::UnsupportedFormat { key, .. } => Some(key),
            Error::NoRun { .. }
            | Error::NoStore
            | Error::Input { .. }
            | Error::Random { .. }
            | Error::Unsupported { .. }
            | Error::Store { .. } => None,
        }
    }

    /// The variant's name in snake case (`payload_mismatch`, `outcome_unknown`, `store`,
    /// ...): a fixed, low-cardinality class of the error, for logs and metric labels.
    /// It is the `error.type` of the call's span.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::NoRun { .. } => "no_run",
            Error::NoStore => "no_store",
            Error::PayloadMismatch { .. } => "payload_mismatch",
            Error::InProgress { .. } => "in_progress",
            Error::OutcomeUnknown { .. } => "outcome_unknown",
            Error::LostLease { .. } => "lost_lease",
            Error::MaxRunExceeded { .. } => "max_run_exceeded",
            Error::Input { .. } => "input",
            Error::Output { .. } => "output",
            Error::ResultTooLarge { .. } => "result_too_large",
            Error::Unreplayable { .. } => "unreplayable",
            Error::StoredResult { .. } => "stored_result",
            Error::CorruptRecord { .. } => "corrupt_record",
            Error::UnsupportedFormat { .. } => "unsupported_format",
            Error::Random { .. } => "random",
            Error::Unsupported { .. } => "unsupported",
            Error::Store { .. } => "store",
        }
    }
}

/// What kind of failure an [`Error::Store`] is: see [`Error::store_kind`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreErrorKind {
    /// A setting the store was given is invalid (a table name, a connection URL):
    /// nothing was opened, and retrying will not help.
    Config,
    /// Another process holds the store: a sled directory (one process at a time), or a
    /// SQLite file whose write lock was held past the store's timeout.
    HeldElsewhere,
    /// The store's table does not exist (Postgres: SQLSTATE `42P01`): a store built
    /// without `connect`, or pointed at another database or table.
    TableMissing,
    /// Anything else: the store is unreachable, an I/O error, a lost connection.
    Other,
}

/// A store's error with its [`StoreErrorKind`]; reads as the error it wraps.
#[derive(Debug)]
struct Kinded {
    kind: StoreErrorKind,
    source: Box<dyn StdError + Send + Sync>,
}

impl fmt::Display for Kinded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.source, f)
    }
}

impl StdError for Kinded {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source.source()
    }
}

/// What holds a key after the call that claimed it lost its claim
/// ([`Error::LostLease`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LostTo {
    /// Another call: it holds the key now, or its outcome is stored. A retry receives
    /// that outcome (or waits for it).
    AnotherCall,
    /// Nothing: the record is gone. It was removed while the body ran (`idem evict
    /// --force`, `Store::delete`), or it expired (a sync body past its `max_run` is no
    /// longer renewed, and its record lives one lease and its TTL). Nothing is stored
    /// under the key, so a retry runs the body again, at-most-once or not.
    Removal,
    /// The store could not be read to tell which.
    Unknown,
}

impl LostTo {
    /// What happened to the claim, for the error's message.
    fn what(self) -> &'static str {
        match self {
            LostTo::AnotherCall => {
                "taken over by another call (this process was paused past its lease, or its \
                 renewals could not reach the store for a whole lease)"
            }
            LostTo::Removal => {
                "removed (evicted by an operator with `idem evict --force`, or deleted with \
                 `Store::delete`; or, with its renewals stopped at `max_run`, expired)"
            }
            LostTo::Unknown => "taken over by another call or removed",
        }
    }

    /// What a retry gets, for the error's message.
    fn then(self) -> &'static str {
        match self {
            LostTo::AnotherCall => "retry to receive the other call's outcome",
            LostTo::Removal => "nothing is stored under the key, so a retry runs the body again",
            LostTo::Unknown => {
                "the store could not be read to tell which: a retry receives the other call's \
                 outcome, or runs the body again if the record was removed"
            }
        }
    }
}

impl fmt::Display for LostTo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LostTo::AnotherCall => "another call",
            LostTo::Removal => "removal",
            LostTo::Unknown => "unknown",
        })
    }
}

/// [`Error::NoRun`]'s message.
fn no_run(tool: &str, blank_id: Option<&str>) -> String {
    match blank_id {
        None => format!(
            "no run for idempotent tool `{tool}`: call it inside `Run::scope` / \
             `Run::sync_scope`, or pass a `&Run` argument"
        ),
        Some(id) => format!(
            "the run id for idempotent tool `{tool}` is blank ({id:?}): every caller with a \
             blank run id would share one run, and get each other's results; give each agent \
             run an id of its own"
        ),
    }
}

/// An error as idem logs it: its `Display`, less what may quote the input or the
/// result (the serializer's message of an input or output error, the JSON of a result
/// that does not read back). idem never logs inputs or results; the caller's error
/// keeps the whole message.
pub(crate) struct Logged<'a>(pub(crate) &'a Error);

impl fmt::Display for Logged<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const LEFT_OUT: &str = "(the details, which may quote it, are in the caller's error)";
        match self.0 {
            Error::Input { tool, .. } => write!(
                f,
                "input of tool `{tool}` cannot be serialized into an idempotency key {LEFT_OUT}"
            ),
            Error::Output { key, .. } => {
                write!(
                    f,
                    "result for key `{key}` cannot be serialized for storage {LEFT_OUT}"
                )
            }
            Error::Unreplayable { tool, key, .. } => write!(
                f,
                "the result of tool `{tool}` (key `{key}`) cannot be stored: a retry could not \
                 read it back as the same value {LEFT_OUT}"
            ),
            Error::StoredResult { key, .. } => write!(
                f,
                "stored result for key `{key}` does not deserialize into the tool's return \
                 type {LEFT_OUT}"
            ),
            other => fmt::Display::fmt(other, f),
        }
    }
}

/// A store's failure as people read it, keeping the error it came from as its
/// [`source`](StdError::source): what `{}` prints says why (the server's message and
/// code, the OS error), and an error reporter can still walk the original chain.
#[derive(Debug)]
#[cfg_attr(
    not(any(feature = "sled", feature = "postgres", feature = "redis")),
    allow(dead_code)
)]
pub(crate) struct Fault {
    text: String,
    source: Box<dyn StdError + Send + Sync>,
}

#[cfg_attr(
    not(any(
        feature = "sled",
        feature = "sqlite",
        feature = "postgres",
        feature = "redis"
    )),
    allow(dead_code)
)]
impl Fault {
    /// `text`, caused by `source`.
    pub(crate) fn new(
        text: impl Into<String>,
        source: impl Into<Box<dyn StdError + Send + Sync>>,
    ) -> Self {
        Fault {
            text: text.into(),
            source: source.into(),
        }
    }

    /// `source` described by its whole chain (see [`chain`]), with `source` kept.
    #[cfg(any(feature = "sled", feature = "sqlite"))]
    pub(crate) fn chained(source: impl Into<Box<dyn StdError + Send + Sync>>) -> Self {
        let source = source.into();
        Fault {
            text: chain(&*source),
            source,
        }
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl StdError for Fault {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(&*self.source)
    }
}

/// `error` and its sources as one line, `outer: inner: innermost`, leaving out a
/// source whose message the one before it already includes.
#[cfg_attr(
    not(any(feature = "sled", feature = "postgres", feature = "redis")),
    allow(dead_code)
)]
pub(crate) fn chain(error: &(dyn StdError + 'static)) -> String {
    let mut text = error.to_string();
    let mut last = text.clone();
    let mut next = error.source();
    while let Some(source) = next {
        let message = source.to_string();
        if !message.is_empty() && !last.contains(&message) {
            text.push_str(": ");
            text.push_str(&message);
        }
        last = message;
        next = source.source();
    }
    text
}

/// A duration as people read it: `150 ms`, `4.2 s`, `12 min 5 s`, `3 h 20 min`, `2 d 4 h`.
pub(crate) struct Human(pub(crate) Duration);

impl fmt::Display for Human {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = self.0.as_millis();
        let s = ms / 1000;
        match ms {
            0..1_000 => write!(f, "{ms} ms"),
            1_000..60_000 => write!(f, "{}.{} s", s, (ms % 1000) / 100),
            60_000..3_600_000 => write!(f, "{} min {} s", s / 60, s % 60),
            3_600_000..86_400_000 => write!(f, "{} h {} min", s / 3600, s % 3600 / 60),
            _ => write!(f, "{} d {} h", s / 86_400, s % 86_400 / 3600),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_store_error_keeps_its_kind_and_reads_as_its_source() {
        let io = std::io::Error::other("disk on fire");
        let error = Error::store_of_kind("sled", StoreErrorKind::HeldElsewhere, io);
        assert_eq!(error.store_kind(), Some(StoreErrorKind::HeldElsewhere));
        assert_eq!(
            error.to_string(),
            "sled store failed: disk on fire; the operation was not run"
        );
        let plain = Error::store("sled", "gone");
        assert_eq!(plain.store_kind(), Some(StoreErrorKind::Other));
        assert_eq!(Error::NoStore.store_kind(), None);
    }

    #[test]
    fn durations_read_as_people_write_them() {
        let cases = [
            (0, "0 ms"),
            (150, "150 ms"),
            (4_250, "4.2 s"),
            (59_999, "59.9 s"),
            (725_000, "12 min 5 s"),
            (12_000_000, "3 h 20 min"),
            (187_200_000, "2 d 4 h"),
        ];
        for (ms, text) in cases {
            assert_eq!(Human(Duration::from_millis(ms)).to_string(), text);
        }
        assert!(!Human(Duration::MAX).to_string().is_empty());
    }
}
