//! What `idem` prints: aligned text for people, JSON for scripts. Each function returns
//! the text; the caller writes it (and decides what a failed write means).

use std::fmt::Write as _;

use idem_core::store::{Counts, Record, State, StateKind, Timestamp};
use idem_core::Key;
use serde_json::{json, Value};

use crate::time;

/// Text or JSON.
pub(crate) struct Output {
    json: bool,
}

/// The width of the listing's text columns before the key, which comes last.
const STATE: usize = 9;
const ATTEMPTS: usize = 3;
const CLAIMED: usize = 20;
const TOOL: usize = 24;
const RUN: usize = 24;

impl Output {
    pub(crate) fn new(json: bool) -> Self {
        Output { json }
    }

    /// The listing's header line (none for JSON).
    pub(crate) fn list_header(&self) -> String {
        if self.json {
            return String::new();
        }
        format!(
            "{:STATE$}  {:>ATTEMPTS$}  {:CLAIMED$}  {:TOOL$}  {:RUN$}  KEY\n",
            "STATE", "TRY", "CLAIMED (UTC)", "TOOL", "RUN"
        )
    }

    /// One line of a listing.
    pub(crate) fn list_row(&self, key: &Key, record: &Record, now: Timestamp) -> String {
        if self.json {
            return format!("{}\n", summary(key, record, now));
        }
        let origin = record.meta.origin.as_ref();
        format!(
            "{:STATE$}  {:>ATTEMPTS$}  {:CLAIMED$}  {:TOOL$}  {:RUN$}  {}\n",
            StateKind::of(record, now).as_str(),
            record.meta.attempts,
            time(record.meta.claimed_at),
            clip(origin.map_or(key.label().unwrap_or("-"), |o| &o.tool), TOOL),
            clip(origin.map_or("-", |o| &o.run_id), RUN),
            clean(key.as_str()),
        )
    }

    /// One record in full, its result included.
    pub(crate) fn record(&self, key: &Key, record: &Record, now: Timestamp) -> String {
        let mut value = summary(key, record, now);
        let (label, payload) = match &record.state {
            State::Completed { result } => ("result", Some(result)),
            State::Failed { error } => ("error", Some(error)),
            State::InProgress { .. } => ("result", None),
        };
        let payload = payload.map(|bytes| {
            serde_json::from_slice::<Value>(bytes)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(bytes).into_owned()))
        });
        value["fingerprint"] = json!(hex(record.fingerprint.as_bytes()));
        value[label] = payload.clone().unwrap_or(Value::Null);
        if self.json {
            return format!("{value}\n");
        }
        let origin = record.meta.origin.as_ref();
        let state = StateKind::of(record, now);
        let mut state_text = state.as_str().to_owned();
        if let State::InProgress { lease_until, .. } = record.state {
            let verb = if state == StateKind::Running {
                "lease ends"
            } else {
                "lease ran out"
            };
            state_text += &format!(" ({verb} {})", time(lease_until));
        }
        let opt = |t: Option<Timestamp>| t.map_or("-".to_owned(), time);
        let part = |p: Option<&str>| p.map_or("-".to_owned(), clean);
        let rows = [
            ("key", clean(key.as_str())),
            ("state", state_text),
            ("tool", part(origin.map(|o| &*o.tool).or(key.label()))),
            ("run", part(origin.map(|o| &*o.run_id))),
            ("tenant", part(origin.and_then(|o| o.tenant.as_deref()))),
            ("call id", part(origin.and_then(|o| o.call_id.as_deref()))),
            ("claimed", time(record.meta.claimed_at)),
            ("renewed", opt(record.meta.renewed_at)),
            ("completed", opt(record.meta.completed_at)),
            ("expires", time(record.expires_at)),
            (
                "attempts",
                format!(
                    "{} ({} takeovers)",
                    record.meta.attempts, record.meta.takeovers
                ),
            ),
            ("fingerprint", hex(record.fingerprint.as_bytes())),
        ];
        let mut out = String::new();
        for (name, value) in rows {
            let _ = writeln!(out, "{name:12} {value}");
        }
        match payload {
            Some(payload) => {
                let pretty = serde_json::to_string_pretty(&payload).unwrap_or_default();
                let _ = writeln!(out, "{label}:");
                for line in pretty.lines() {
                    let _ = writeln!(out, "  {}", clean(line));
                }
            }
            None => {
                let _ = writeln!(out, "{label:12} - (no outcome yet)");
            }
        }
        if origin.is_none() {
            out += "(written by idem 0.1: no run, tenant or call id was kept)\n";
        }
        out
    }

    pub(crate) fn counts(&self, counts: &Counts) -> String {
        if self.json {
            let mut value = json!({ "total": counts.total(), "unreadable": counts.unreadable });
            for state in StateKind::ALL {
                value[state.as_str()] = json!(counts.get(state));
            }
            return format!("{value}\n");
        }
        let mut out = format!("{:10} {:>10}\n", "STATE", "RECORDS");
        for state in StateKind::ALL {
            let _ = writeln!(out, "{:10} {:>10}", state.as_str(), counts.get(state));
        }
        let _ = writeln!(out, "{:10} {:>10}", "unreadable", counts.unreadable);
        let _ = writeln!(out, "{:10} {:>10}", "total", counts.total());
        out
    }

    /// A change made: `what` for people, `{"done": what, "count": n}` for scripts.
    pub(crate) fn done(&self, what: &str, count: u64) -> String {
        if self.json {
            format!("{}\n", json!({ "done": what, "count": count }))
        } else {
            format!("{what}\n")
        }
    }
}

/// The record's metadata as JSON (no result).
fn summary(key: &Key, record: &Record, now: Timestamp) -> Value {
    let origin = record.meta.origin.as_ref();
    let ms = |t: Option<Timestamp>| t.map(time);
    let lease_until = match record.state {
        State::InProgress { lease_until, .. } => Some(lease_until),
        _ => None,
    };
    json!({
        "key": key.as_str(),
        "state": StateKind::of(record, now).as_str(),
        "tool": origin.map(|o| &*o.tool).or(key.label()),
        "run_id": origin.map(|o| &*o.run_id),
        "tenant": origin.and_then(|o| o.tenant.as_deref()),
        "call_id": origin.and_then(|o| o.call_id.as_deref()),
        "claimed_at": time(record.meta.claimed_at),
        "renewed_at": ms(record.meta.renewed_at),
        "completed_at": ms(record.meta.completed_at),
        "lease_until": ms(lease_until),
        "expires_at": time(record.expires_at),
        "attempts": record.meta.attempts,
        "takeovers": record.meta.takeovers,
    })
}

/// `text` for a terminal: control characters (a newline, a tab, an escape sequence an
/// agent put in a run id) and the invisible characters that reorder or hide text
/// (bidirectional overrides, zero-width marks) written as escapes, so they cannot
/// break a row, steer the operator's terminal, or disguise a key.
pub(crate) fn clean(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        let invisible = matches!(c, '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}'
            | '\u{2060}'..='\u{2069}' | '\u{feff}' | '\u{061c}');
        if c.is_control() || invisible {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// `text` cleaned and cut to `width` characters, the cut marked with `…`. (Characters,
/// not terminal cells: a wide character takes two, and shifts the row.)
fn clip(text: &str, width: usize) -> String {
    let text = clean(text);
    if text.chars().count() <= width {
        return text;
    }
    let mut out: String = text.chars().take(width - 1).collect();
    out.push('…');
    out
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Who made the record, for a question: `, tool send_email, run r-1`.
pub(crate) fn whose(record: &Record) -> String {
    match &record.meta.origin {
        Some(o) => format!(", tool {}, run {}", clean(&o.tool), clean(&o.run_id)),
        None => String::new(),
    }
}
