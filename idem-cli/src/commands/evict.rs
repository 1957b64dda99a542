//! `idem evict`: removes one record, or a run's.

use std::time::Duration;

use idem_core::store::{delete_settled_matching, Filter, State, StateKind, Timestamp};
use idem_core::{Error, Key, Store};

use super::not_found;
use crate::failure::{confirm, emit, Exit, Failure};
use crate::output::{self, Output};

/// Evicts one record. A running call's claim is refused without `force`: removing it
/// would make the call lose its claim and its result, and a retry run the body again.
/// Without `force` the record is removed only if it is still not a running call's claim
/// when the store removes it (`Store::delete_settled`).
pub async fn key(
    store: &dyn Store,
    key: Key,
    force: bool,
    yes: bool,
    out: &Output,
) -> Result<(), Failure> {
    let now = Timestamp::now();
    let record = match store.get(&key).await {
        Ok(Some(record)) => Some(record),
        Ok(None) => return Err(not_found(&key)),
        // What cannot be read can still be removed.
        Err(e @ (Error::CorruptRecord { .. } | Error::UnsupportedFormat { .. })) => {
            confirm(
                yes,
                &format!("Evict {key}? It holds a value this build cannot read: {e}"),
            )?;
            None
        }
        Err(e) => return Err(e.into()),
    };
    let Some(record) = record else {
        let removed = store.delete(&key).await?;
        return emit(&out.done(&format!("evicted {key}"), u64::from(removed)));
    };
    let state = StateKind::of(&record, now);
    if let (StateKind::Running, State::InProgress { lease_until, .. }, false) =
        (state, &record.state, force)
    {
        return Err(Failure(
            Exit::Refused,
            format!(
                "`{key}` is running: its call holds it for {} more (its lease, renewed while \
                 its process lives). Evicting it would make that call lose its claim: its \
                 result would not be stored, and a retry would run its body again, \
                 at-most-once or not. Wait for it to end, or pass --force",
                humantime::format_duration(Duration::from_secs(
                    lease_until.remaining(now).as_secs()
                ))
            ),
        ));
    }
    confirm(
        yes,
        &format!(
            "Evict {key} ({state}{})? The next call with its input runs again.",
            output::whose(&record)
        ),
    )?;
    let removed = match force {
        true => store.delete(&key).await?,
        // Removed only if it is still not a running call's claim when the store removes
        // it (a call may have taken an abandoned claim over, or claimed an expired
        // record again, since it was read).
        false => {
            if !store.delete_settled(&key).await? {
                return Err(Failure(
                    Exit::Refused,
                    format!(
                        "`{key}` changed while it was being evicted (a call took it over, or \
                         it was settled or removed); look again with `idem show {key}`"
                    ),
                ));
            }
            true
        }
    };
    emit(&out.done(&format!("evicted {key}"), u64::from(removed)))
}

/// Evicts a run's records. Without `force`, its running calls' claims stay (and are
/// counted): the run's completed, failed and abandoned records are removed, each only
/// if still so when the store removes it (`store::delete_settled_matching`).
pub async fn run(
    store: &dyn Store,
    filter: Filter,
    run: &str,
    force: bool,
    yes: bool,
    out: &Output,
) -> Result<(), Failure> {
    let counts = store.count(&filter).await?;
    let running = counts.get(StateKind::Running);
    // Unreadable values match no run.
    let total = counts.total() - counts.unreadable;
    let n = if force { total } else { total - running };
    let running_left = match (force, running) {
        (false, 1..) => format!(" ({running} running, left alone: --force evicts them too)"),
        _ => String::new(),
    };
    if n == 0 {
        return emit(&out.done(&format!("nothing to evict{running_left}"), 0));
    }
    confirm(
        yes,
        &format!(
            "Evict the {n} records of run {run}{running_left}? Its calls run again when retried."
        ),
    )?;
    if force {
        let removed = store.delete_matching(&filter).await?;
        return emit(&out.done(&format!("evicted {removed} records of run {run}"), removed));
    }
    // Each record is removed only if it is still in a settled state when the store
    // removes it, so a call that claims one meanwhile keeps its claim.
    let removed = delete_settled_matching(store, &filter).await?;
    // What is left now: running calls' claims (some maybe made while this ran).
    let left = store.count(&filter).await?;
    let left = left.total() - left.unreadable;
    let left = match left {
        0 => String::new(),
        n => format!(" ({n} left: running calls' claims; --force evicts them too)"),
    };
    emit(&out.done(
        &format!("evicted {removed} records of run {run}{left}"),
        removed,
    ))
}
