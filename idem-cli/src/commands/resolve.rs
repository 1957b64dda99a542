//! `idem resolve KEY`: settles a call whose outcome is unknown.

use std::time::Duration;

use idem_core::store::{Fenced, Resolution, State, StateKind, Timestamp};
use idem_core::Store;

use super::find;
use crate::failure::{emit, Exit, Failure};
use crate::output::Output;

/// Settles the abandoned claim under `key`: completed with `completed` (JSON), or
/// released.
pub async fn run(
    store: &dyn Store,
    key: &str,
    completed: Option<String>,
    release: bool,
    ttl: Option<Duration>,
    out: &Output,
) -> Result<(), Failure> {
    let (key, record) = find(store, key).await?;
    let now = Timestamp::now();
    let State::InProgress { token, lease_until } = record.state else {
        return Err(Failure(
            Exit::Refused,
            format!(
                "`{key}` is {}: only an abandoned claim (state abandoned) has an unknown \
                 outcome; to make its next call run again, evict it",
                StateKind::of(&record, now)
            ),
        ));
    };
    if lease_until > now {
        return Err(Failure(
            Exit::Refused,
            format!(
                "`{key}` is running: its call holds it for {} more (its lease, renewed while \
                 its process lives); resolve it once it is abandoned",
                humantime::format_duration(Duration::from_secs(
                    lease_until.remaining(now).as_secs()
                ))
            ),
        ));
    }
    let text;
    let resolution = match completed {
        Some(json) => {
            text = json.trim().to_owned();
            if let Err(e) = serde_json::from_str::<serde_json::Value>(&text) {
                return Err(Failure(
                    Exit::Usage,
                    format!("--completed is not JSON: {e}"),
                ));
            }
            // The TTL the call claimed with: its record expires that long after its lease.
            let claimed = record.expires_at.remaining(lease_until);
            Resolution::Completed {
                result: text.as_bytes(),
                ttl: ttl.unwrap_or(claimed),
            }
        }
        // clap requires one of `--completed` and `--release`.
        None => Resolution::Released,
    };
    debug_assert!(release || matches!(resolution, Resolution::Completed { .. }));
    let what = match resolution {
        Resolution::Completed { .. } => "completed: its next call replays the result",
        Resolution::Released => "released: its next call runs",
    };
    match store.resolve(&key, token, resolution).await? {
        Fenced::Applied => {
            emit(&out.done(&format!("resolved {key} as {what}"), 1))
        }
        Fenced::LostLease => Err(Failure(
            Exit::Refused,
            format!("`{key}` changed while it was being resolved (a call took it over, or it was evicted); look again with `idem show {key}`"),
        )),
    }
}
