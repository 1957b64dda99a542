//! Records: what a store keeps under a key, and their byte encoding.
//!
//! # Encoding (format version 2)
//!
//! ```text
//! offset  size  field
//! 0       4     magic "idem"
//! 4       1     format version (2)
//! 5       1     state: 0 in progress, 1 completed, 2 failed
//! 6       32    input fingerprint (SHA-256)
//! 38      8     written at: the record's last write (claim, renewal, completion)
//! 46      8     expires at
//! 54      16    owner token (in progress; zero otherwise)
//! 70      8     lease until (in progress; zero otherwise)
//! 78      8     completed at (zero: not completed)
//! 86      8     last renewed at (zero: never renewed)
//! 94      8     first claimed at
//! 102     4     attempts: claims that ran the body (the first, takeovers, retries)
//! 106     4     takeovers of an abandoned claim
//! 110     4     origin length N (zero: no origin)
//! 114     N     origin: tenant, run id, call id, tool; each a presence byte (0 or 1),
//!               then, if present, a 4-byte length and the UTF-8 text
//! 114+N   ..    completed / failed: the serialized result / error (JSON), to the end
//! ```
//!
//! Times are milliseconds since the Unix epoch, every integer is big-endian. The
//! input itself is never stored: its fingerprint is enough to tell inputs apart, and
//! inputs may hold personal data.
//!
//! Records of format version 1 (idem 0.1: the first 54 bytes above, then the token and
//! lease of a claim or the payload) still decode, with no origin ([`Meta::origin`] is
//! `None`), and are replayed; every write is in version 2.
//!
//! The Redis store keeps these same bytes with the header's times (written at,
//! expires at, lease until) counted from the moment Redis stored the record, since a
//! native `SET` cannot read the server's clock (see the Redis store's module docs,
//! feature `redis`); the metadata's times (completed, renewed, claimed) are the
//! writing worker's clock there.
//!
//! Bytes that do not start with the magic, are too short, or carry an unknown state are
//! an [`Error::CorruptRecord`]; a known magic with an unknown version is an
//! [`Error::UnsupportedFormat`]. Both name the key. Decoding never panics.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::error::Error;
use crate::key::Fingerprint;
use crate::key_text::Key;

/// A point in time: milliseconds since the Unix epoch, by the clock of whoever wrote it.
///
/// The memory and sled stores use the process clock ([`Timestamp::now`]); a store
/// shared by several machines documents which clock it uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(pub(crate) u64);

impl Timestamp {
    /// The time `ms` milliseconds after the Unix epoch.
    pub const fn from_millis(ms: u64) -> Self {
        Timestamp(ms)
    }

    /// Milliseconds since the Unix epoch: what a store writes down.
    pub const fn as_millis(self) -> u64 {
        self.0
    }

    /// The process clock now. A clock set before 1970 reads as 0.
    pub fn now() -> Self {
        let ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0);
        Timestamp(ms)
    }

    /// This time plus `d`, saturating instead of overflowing.
    pub fn after(self, d: Duration) -> Self {
        Timestamp(self.0.saturating_add(millis(d)))
    }

    /// How long from `now` until this time (zero if it has passed).
    pub fn remaining(self, now: Timestamp) -> Duration {
        Duration::from_millis(self.0.saturating_sub(now.0))
    }
}

/// A duration in whole milliseconds, saturating at `u64::MAX`: the unit every record
/// and every store speaks.
pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Identifies one claim of a key: the fencing token.
///
/// Every call gets a token no other call gets. Completing or releasing a key requires
/// the token of its current in-progress record, so an owner whose lease was taken over
/// cannot overwrite the new owner's result.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Token(pub(crate) u128);

impl Token {
    /// The token written down as `bits` (by [`Token::to_bits`]).
    pub const fn from_bits(bits: u128) -> Self {
        Token(bits)
    }

    /// The token as a number, for a store that writes it down.
    pub const fn to_bits(self) -> u128 {
        self.0
    }

    /// A token unique to this call: 64 random bits drawn once per process, mixed with
    /// the wall clock's nanoseconds, then a per-process counter. The counter keeps this
    /// process's tokens apart, the random bits other processes'; the clock keeps a forked
    /// child's apart from its parent's (they share the random bits and the counter's
    /// value) without a system call per token (`getpid` is one, and on a hit it cost
    /// more than the whole store lookup).
    pub fn generate() -> Result<Self, Error> {
        static SEED: OnceLock<Result<u64, String>> = OnceLock::new();
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let seed = SEED.get_or_init(|| {
            let mut bytes = [0u8; 8];
            getrandom::fill(&mut bytes)
                .map(|()| u64::from_be_bytes(bytes))
                .map_err(|e| e.to_string())
        });
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let seed = match seed {
            Ok(seed) => *seed ^ nanos,
            Err(reason) => {
                return Err(Error::Random {
                    reason: reason.clone(),
                })
            }
        };
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        Ok(Token(u128::from(seed) << 64 | u128::from(n)))
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Token({:032x})", self.0)
    }
}

/// The state of a key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum State {
    /// A call claimed the key and is running (or crashed) ; nobody else runs it until
    /// `lease_until` passes.
    InProgress {
        /// The claiming call's fencing token.
        token: Token,
        /// When the claim is considered abandoned.
        lease_until: Timestamp,
    },
    /// The call returned `Ok`; its value, serialized as JSON.
    Completed {
        /// The serialized value.
        result: Vec<u8>,
    },
    /// The call returned `Err` and the tool caches errors; the error, serialized as JSON.
    Failed {
        /// The serialized error.
        error: Vec<u8>,
    },
}

/// What a store keeps under a key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// Fingerprint of the whole input of the call that created the record.
    pub fingerprint: Fingerprint,
    /// When the record was last written: claimed, renewed or completed.
    pub created_at: Timestamp,
    /// When the record stops existing. Every read path treats an expired record as absent.
    pub expires_at: Timestamp,
    /// In progress, completed or failed.
    pub state: State,
    /// Whose record it is and what happened to it: for operators, never for decisions.
    pub meta: Meta,
}

/// Who made a record, and its history: what an operator lists and filters records by
/// (see `Store::list`). No decision of the protocol reads it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Meta {
    /// The run, tenant, call id and tool of the call that first claimed the key;
    /// `None` for a record written by idem 0.1 (format version 1), which kept none.
    pub origin: Option<Origin>,
    /// When the key was first claimed (kept across renewals, takeovers and retries).
    pub claimed_at: Timestamp,
    /// When the outcome was recorded; `None` while in progress.
    pub completed_at: Option<Timestamp>,
    /// When the running call last renewed its claim; `None` if it never did.
    pub renewed_at: Option<Timestamp>,
    /// How many claims ran the body: the first, then each takeover and each retry of a
    /// cached error. 0 for a record of format version 1, which did not count.
    pub attempts: u32,
    /// How many of those attempts took over an abandoned claim.
    pub takeovers: u32,
}

/// Who calls: the parts of a key besides its input, kept in the record in clear (the
/// key itself holds only their hash). Cheap to clone.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Origin {
    /// The tenant, if the run has one.
    pub tenant: Option<Arc<str>>,
    /// The run id.
    pub run_id: Arc<str>,
    /// The call id, if the run has one.
    pub call_id: Option<Arc<str>>,
    /// The tool.
    pub tool: Arc<str>,
}

impl Origin {
    /// An origin of `tool` in run `run_id`, without tenant or call id.
    pub fn new(run_id: impl Into<Arc<str>>, tool: impl Into<Arc<str>>) -> Self {
        Origin {
            tenant: None,
            run_id: run_id.into(),
            call_id: None,
            tool: tool.into(),
        }
    }

    fn parts(&self) -> [Option<&str>; 4] {
        [
            self.tenant.as_deref(),
            Some(&self.run_id),
            self.call_id.as_deref(),
            Some(&self.tool),
        ]
    }

    /// The encoded length: a presence byte per part, and a length and the text of each
    /// present one.
    fn encoded_len(&self) -> usize {
        self.parts()
            .iter()
            .map(|part| 1 + part.map_or(0, |text| 4 + text.len()))
            .sum()
    }

    fn encode(&self, out: &mut Vec<u8>) {
        for part in self.parts() {
            match part {
                None => out.push(0),
                Some(text) => {
                    out.push(1);
                    out.extend_from_slice(&len32(text.len()).to_be_bytes());
                    out.extend_from_slice(text.as_bytes());
                }
            }
        }
    }

    fn decode(mut bytes: &[u8]) -> Result<Origin, &'static str> {
        let mut part = || -> Result<Option<Arc<str>>, &'static str> {
            let (&tag, rest) = bytes.split_first().ok_or("truncated origin")?;
            bytes = rest;
            match tag {
                0 => Ok(None),
                1 => {
                    let len = bytes.get(..4).ok_or("truncated origin")?;
                    let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize;
                    let text = bytes.get(4..4 + len).ok_or("truncated origin")?;
                    bytes = &bytes[4 + len..];
                    std::str::from_utf8(text)
                        .map(|text| Some(Arc::from(text)))
                        .map_err(|_| "origin is not UTF-8")
                }
                _ => Err("bad origin part tag"),
            }
        };
        let (tenant, run_id, call_id, tool) = (part()?, part()?, part()?, part()?);
        if !bytes.is_empty() {
            return Err("trailing bytes in origin");
        }
        Ok(Origin {
            tenant,
            run_id: run_id.ok_or("origin without run id")?,
            call_id,
            tool: tool.ok_or("origin without tool")?,
        })
    }
}

/// A length as the encoding writes it; a text longer than 4 GiB cannot reach a store
/// (a key part is bounded by memory long before), and saturates.
fn len32(len: usize) -> u32 {
    u32::try_from(len).unwrap_or(u32::MAX)
}

const MAGIC: &[u8; 4] = b"idem";
/// The record format version this build writes. Version 1 still decodes.
pub const FORMAT_VERSION: u8 = 2;
/// The length of format 1's header, which its records follow with a claim's token and
/// lease or with a payload.
const HEADER_V1: usize = 4 + 1 + 1 + 32 + 8 + 8;
/// The length of the fixed part of a record, which its origin follows.
pub(crate) const HEADER: usize = HEADER_V1 + 16 + 8 + 8 + 8 + 8 + 4 + 4 + 4;
/// The first bytes of every encoded in-progress record: magic, version, state 0.
#[cfg(feature = "redis")]
pub(crate) const IN_PROGRESS_TAG: [u8; 6] =
    [MAGIC[0], MAGIC[1], MAGIC[2], MAGIC[3], FORMAT_VERSION, 0];
/// Where the fingerprint is in an encoded record.
pub(crate) const FINGERPRINT_AT: usize = 6;
/// Where the owner token is in an encoded record.
#[cfg(feature = "redis")]
pub(crate) const TOKEN_AT: usize = HEADER_V1;
/// Where the completion time is: a completion writes the fields before it and keeps
/// the ones after it.
#[cfg(feature = "redis")]
pub(crate) const COMPLETED_AT: usize = HEADER_V1 + 24;
/// Where the first claim's time is: a renewal writes the fields before it and keeps
/// the ones after it.
#[cfg(feature = "redis")]
pub(crate) const CLAIMED_AT: usize = HEADER_V1 + 40;
/// Where the origin's length is.
const ORIGIN_LEN_AT: usize = HEADER - 4;

impl Record {
    /// Whether the record has expired at `now` (and so must be treated as absent).
    pub fn is_expired(&self, now: Timestamp) -> bool {
        self.expires_at <= now
    }

    /// Encodes the record (see the module docs for the layout).
    pub fn encode(&self) -> Vec<u8> {
        let origin = self.meta.origin.as_ref().map_or(0, Origin::encoded_len);
        let payload = match &self.state {
            State::InProgress { .. } => 0,
            State::Completed { result } => result.len(),
            State::Failed { error } => error.len(),
        };
        let mut out = Vec::with_capacity(HEADER + origin + payload);
        out.extend_from_slice(MAGIC);
        out.push(FORMAT_VERSION);
        out.push(match self.state {
            State::InProgress { .. } => 0,
            State::Completed { .. } => 1,
            State::Failed { .. } => 2,
        });
        out.extend_from_slice(self.fingerprint.as_bytes());
        out.extend_from_slice(&self.created_at.0.to_be_bytes());
        out.extend_from_slice(&self.expires_at.0.to_be_bytes());
        let (token, lease_until) = match self.state {
            State::InProgress { token, lease_until } => (token.0, lease_until.0),
            _ => (0, 0),
        };
        out.extend_from_slice(&token.to_be_bytes());
        out.extend_from_slice(&lease_until.to_be_bytes());
        let meta = &self.meta;
        for time in [meta.completed_at, meta.renewed_at] {
            out.extend_from_slice(&time.map_or(0, |t| t.0).to_be_bytes());
        }
        out.extend_from_slice(&meta.claimed_at.0.to_be_bytes());
        out.extend_from_slice(&meta.attempts.to_be_bytes());
        out.extend_from_slice(&meta.takeovers.to_be_bytes());
        out.extend_from_slice(&len32(origin).to_be_bytes());
        if let Some(o) = &meta.origin {
            o.encode(&mut out);
        }
        if let State::Completed { result: bytes } | State::Failed { error: bytes } = &self.state {
            out.extend_from_slice(bytes);
        }
        out
    }

    /// Checks the magic and the version: `Ok` with the version of a record this build
    /// reads.
    fn version(key: &str, bytes: &[u8]) -> Result<u8, Error> {
        if bytes.len() < 5 || &bytes[..4] != MAGIC {
            return Err(Error::CorruptRecord {
                key: Key::from_text(key),
                reason: "not an idem record (bad magic)".to_owned(),
            });
        }
        match bytes[4] {
            version @ (1 | FORMAT_VERSION) => Ok(version),
            version => Err(Error::UnsupportedFormat {
                key: Key::from_text(key),
                version,
            }),
        }
    }

    /// Reads only the expiry of an encoded record (for purging without copying
    /// results). The same checks as [`Record::decode`] on the header.
    pub fn decode_expiry(key: &str, bytes: &[u8]) -> Result<Timestamp, Error> {
        Self::version(key, bytes)?;
        u64_at(bytes, 46)
            .map(Timestamp)
            .ok_or_else(|| Error::CorruptRecord {
                key: Key::from_text(key),
                reason: "truncated header".to_owned(),
            })
    }

    /// The result in an encoded record, read in place, if a claim would replay it: the
    /// record is completed, live at `now` and for `fingerprint` (the rule of
    /// [`is_replayable`](crate::store::is_replayable)). `None` for anything else, bytes
    /// that do not decode included. Never panics, whatever the bytes.
    pub fn replayable_result<'a>(
        bytes: &'a [u8],
        fingerprint: &Fingerprint,
        now: Timestamp,
    ) -> Option<&'a [u8]> {
        let header = bytes.get(..HEADER_V1)?;
        let replayable = header[..4] == *MAGIC
            && header[5] == 1
            && header[6..38] == fingerprint.as_bytes()[..]
            && Timestamp(u64_at(header, 46)?) > now;
        if !replayable {
            return None;
        }
        match header[4] {
            FORMAT_VERSION => {
                let origin = u32_at(bytes, ORIGIN_LEN_AT)? as usize;
                bytes.get(HEADER.checked_add(origin)?..)
            }
            1 => Some(&bytes[HEADER_V1..]),
            _ => None,
        }
    }

    /// Decodes a record read under `key`. Never panics, whatever the bytes.
    pub fn decode(key: &str, bytes: &[u8]) -> Result<Record, Error> {
        let corrupt = |reason: &str| Error::CorruptRecord {
            key: Key::from_text(key),
            reason: reason.to_owned(),
        };
        let version = Self::version(key, bytes)?;
        if bytes.len() < HEADER_V1 {
            return Err(corrupt("truncated header"));
        }
        let mut fp = [0u8; 32];
        fp.copy_from_slice(&bytes[FINGERPRINT_AT..FINGERPRINT_AT + 32]);
        let at = |offset: usize| u64_at(bytes, offset).map(Timestamp);
        let (created_at, expires_at) = (at(38), at(46));
        let (created_at, expires_at) = created_at
            .zip(expires_at)
            .ok_or_else(|| corrupt("truncated header"))?;
        if version == 1 {
            return Self::decode_v1(bytes, fp, created_at, expires_at).map_err(corrupt);
        }
        if bytes.len() < HEADER {
            return Err(corrupt("truncated header"));
        }
        let some = |t: Timestamp| (t.0 != 0).then_some(t);
        let origin_len = u32_at(bytes, ORIGIN_LEN_AT).unwrap_or(0) as usize;
        let origin = bytes
            .get(HEADER..HEADER.saturating_add(origin_len))
            .ok_or_else(|| corrupt("truncated origin"))?;
        let rest = &bytes[HEADER + origin_len..];
        let meta = Meta {
            origin: if origin.is_empty() {
                None
            } else {
                Some(Origin::decode(origin).map_err(corrupt)?)
            },
            completed_at: at(78).and_then(some),
            renewed_at: at(86).and_then(some),
            claimed_at: at(94).unwrap_or_default(),
            attempts: u32_at(bytes, 102).unwrap_or(0),
            takeovers: u32_at(bytes, 106).unwrap_or(0),
        };
        let state = match bytes[5] {
            0 if rest.is_empty() => State::InProgress {
                token: Token(u128_at(bytes, 54).unwrap_or(0)),
                lease_until: at(70).unwrap_or_default(),
            },
            0 => return Err(corrupt("in-progress record with a payload")),
            1 => State::Completed {
                result: rest.to_vec(),
            },
            2 => State::Failed {
                error: rest.to_vec(),
            },
            other => return Err(corrupt(&format!("unknown state tag {other}"))),
        };
        Ok(Record {
            fingerprint: Fingerprint::from_bytes(fp),
            created_at,
            expires_at,
            state,
            meta,
        })
    }

    /// Format 1's body: a claim's token and lease, or the payload. Such a record has
    /// no origin and did not count its attempts; its first claim is taken to be its
    /// last write.
    fn decode_v1(
        bytes: &[u8],
        fingerprint: [u8; 32],
        created_at: Timestamp,
        expires_at: Timestamp,
    ) -> Result<Record, &'static str> {
        let rest = &bytes[HEADER_V1..];
        let state = match bytes[5] {
            0 if rest.len() == 24 => State::InProgress {
                token: Token(u128_at(rest, 0).unwrap_or(0)),
                lease_until: Timestamp(u64_at(rest, 16).unwrap_or(0)),
            },
            0 => return Err("in-progress record of wrong length"),
            1 => State::Completed {
                result: rest.to_vec(),
            },
            2 => State::Failed {
                error: rest.to_vec(),
            },
            _ => return Err("unknown state tag"),
        };
        let completed_at = (!matches!(state, State::InProgress { .. })).then_some(created_at);
        Ok(Record {
            fingerprint: Fingerprint::from_bytes(fingerprint),
            created_at,
            expires_at,
            state,
            meta: Meta {
                claimed_at: created_at,
                completed_at,
                ..Meta::default()
            },
        })
    }
}

/// `record` as idem 0.1 encoded it (format 1: no metadata), for checking that such
/// records still read back.
#[cfg(any(test, feature = "testing"))]
pub(crate) fn encode_format_1(record: &Record) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    out.push(1);
    out.push(match record.state {
        State::InProgress { .. } => 0,
        State::Completed { .. } => 1,
        State::Failed { .. } => 2,
    });
    out.extend_from_slice(record.fingerprint.as_bytes());
    out.extend_from_slice(&record.created_at.0.to_be_bytes());
    out.extend_from_slice(&record.expires_at.0.to_be_bytes());
    match &record.state {
        State::InProgress { token, lease_until } => {
            out.extend_from_slice(&token.0.to_be_bytes());
            out.extend_from_slice(&lease_until.0.to_be_bytes());
        }
        State::Completed { result: b } | State::Failed { error: b } => out.extend_from_slice(b),
    }
    out
}

fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_be_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(bytes: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_be_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
}

fn u128_at(bytes: &[u8], at: usize) -> Option<u128> {
    Some(u128::from_be_bytes(
        bytes.get(at..at + 16)?.try_into().ok()?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..128)) {
            let _ = Record::decode("k", &bytes);
            let _ = Record::decode_expiry("k", &bytes);
            let _ = Record::replayable_result(&bytes, &Fingerprint::from_bytes([0; 32]), Timestamp(0));
        }

        #[test]
        fn decoding_damaged_records_never_panics(cut in 0usize..80, flip in 0usize..80, bit in 0u8..8) {
            let mut bytes = sample(State::InProgress { token: Token(7), lease_until: Timestamp(9) }).encode();
            if flip < bytes.len() {
                bytes[flip] ^= 1 << bit;
            }
            bytes.truncate(cut);
            let _ = Record::decode("k", &bytes);
        }

        /// The in-place read of the hit path agrees with decoding the record and
        /// asking `is_replayable`, on damaged records of every state.
        #[test]
        fn replayable_result_agrees_with_decode(
            state in 0usize..3,
            cut in 0usize..90,
            flip in 0usize..90,
            bit in 0u8..8,
            other_fingerprint: bool,
            now in prop_oneof![Just(0u64), Just(u64::MAX - 1), Just(u64::MAX), any::<u64>()],
        ) {
            let state = [
                State::InProgress { token: Token(7), lease_until: Timestamp(9) },
                State::Completed { result: b"{\"id\":\"m-1\"}".to_vec() },
                State::Failed { error: b"\"declined\"".to_vec() },
            ][state].clone();
            let mut bytes = sample(state).encode();
            if flip < bytes.len() {
                bytes[flip] ^= 1 << bit;
            }
            bytes.truncate(cut);
            let fingerprint = Fingerprint::from_bytes(if other_fingerprint { [8; 32] } else { [7; 32] });
            let now = Timestamp(now);
            let decoded = Record::decode("k", &bytes).ok().filter(|r| crate::store::is_replayable(r, &fingerprint, now));
            let expected = decoded.as_ref().map(|r| match &r.state {
                State::Completed { result } => &result[..],
                _ => unreachable!("is_replayable admits only completed records"),
            });
            prop_assert_eq!(Record::replayable_result(&bytes, &fingerprint, now), expected);
        }
    }

    fn sample(state: State) -> Record {
        Record {
            fingerprint: Fingerprint::from_bytes([7; 32]),
            created_at: Timestamp(1),
            expires_at: Timestamp(u64::MAX),
            state,
            meta: Meta {
                origin: Some(Origin {
                    tenant: Some("acme".into()),
                    run_id: "run-1".into(),
                    call_id: None,
                    tool: "send_email".into(),
                }),
                claimed_at: Timestamp(1),
                completed_at: Some(Timestamp(2)),
                renewed_at: None,
                attempts: 2,
                takeovers: 1,
            },
        }
    }

    #[test]
    fn records_of_format_1_read_back_and_replay() {
        // A completed record exactly as idem 0.1 stored it (bytes written out by hand).
        let mut golden = b"idem\x01\x01".to_vec();
        golden.extend_from_slice(&[7; 32]);
        golden.extend_from_slice(&1_000u64.to_be_bytes());
        golden.extend_from_slice(&5_000u64.to_be_bytes());
        golden.extend_from_slice(b"\"m-1\"");
        let states = [
            State::InProgress {
                token: Token(u128::MAX - 5),
                lease_until: Timestamp(3_000),
            },
            State::Completed {
                result: b"\"m-1\"".to_vec(),
            },
            State::Completed { result: vec![] },
            State::Failed {
                error: b"\"declined\"".to_vec(),
            },
        ];
        let v1 = |state: &State| {
            encode_format_1(&Record {
                fingerprint: Fingerprint::from_bytes([7; 32]),
                created_at: Timestamp(1_000),
                expires_at: Timestamp(5_000),
                state: state.clone(),
                meta: Meta::default(),
            })
        };
        assert_eq!(v1(&states[1]), golden);
        for state in states {
            let bytes = v1(&state);
            let record = Record::decode("k", &bytes).unwrap();
            let done = !matches!(state, State::InProgress { .. });
            assert_eq!(
                record,
                Record {
                    fingerprint: Fingerprint::from_bytes([7; 32]),
                    created_at: Timestamp(1_000),
                    expires_at: Timestamp(5_000),
                    state: state.clone(),
                    meta: Meta {
                        claimed_at: Timestamp(1_000),
                        completed_at: done.then_some(Timestamp(1_000)),
                        ..Meta::default()
                    },
                }
            );
            assert_eq!(
                Record::decode_expiry("k", &bytes).unwrap(),
                Timestamp(5_000)
            );
            let fp = Fingerprint::from_bytes([7; 32]);
            let replayed = Record::replayable_result(&bytes, &fp, Timestamp(4_999));
            match &state {
                State::Completed { result } => assert_eq!(replayed, Some(&result[..])),
                _ => assert_eq!(replayed, None),
            }
            assert_eq!(
                Record::replayable_result(&bytes, &fp, Timestamp(5_000)),
                None
            );
            // Written again, it is format 2 and reads back the same.
            let again = record.encode();
            assert_eq!(again[4], FORMAT_VERSION);
            assert_eq!(Record::decode("k", &again).unwrap(), record);
        }
    }

    #[test]
    fn every_origin_shape_round_trips() {
        for (tenant, call_id) in [
            (None, None),
            (Some(""), Some("call-7")),
            (Some("é\0"), None),
        ] {
            let mut r = sample(State::Completed {
                result: b"1".to_vec(),
            });
            r.meta.origin = Some(Origin {
                tenant: tenant.map(Arc::from),
                run_id: "".into(),
                call_id: call_id.map(Arc::from),
                tool: "t".into(),
            });
            assert_eq!(Record::decode("k", &r.encode()).unwrap(), r);
        }
        let mut r = sample(State::Completed {
            result: b"1".to_vec(),
        });
        r.meta = Meta::default();
        assert_eq!(Record::decode("k", &r.encode()).unwrap(), r);
    }

    /// The Redis store's scripts read in-progress records by these offsets.
    #[cfg(feature = "redis")]
    #[test]
    fn in_progress_layout_is_where_the_constants_say() {
        let bytes = sample(State::InProgress {
            token: Token(0x0102_0304),
            lease_until: Timestamp(9),
        })
        .encode();
        assert_eq!(bytes[..6], IN_PROGRESS_TAG);
        assert_eq!(bytes[COMPLETED_AT..COMPLETED_AT + 8], 2u64.to_be_bytes());
        assert_eq!(bytes[CLAIMED_AT..CLAIMED_AT + 8], 1u64.to_be_bytes());
        assert_eq!(bytes[FINGERPRINT_AT..FINGERPRINT_AT + 32], [7; 32]);
        assert_eq!(
            bytes[TOKEN_AT..TOKEN_AT + 16],
            0x0102_0304u128.to_be_bytes()
        );
    }

    #[test]
    fn every_state_round_trips() {
        for state in [
            State::InProgress {
                token: Token(u128::MAX - 3),
                lease_until: Timestamp(99),
            },
            State::Completed {
                result: b"{\"id\":1}".to_vec(),
            },
            State::Completed { result: vec![] },
            State::Failed {
                error: b"\"boom\"".to_vec(),
            },
        ] {
            let r = sample(state);
            assert_eq!(Record::decode("k", &r.encode()).unwrap(), r);
        }
    }

    #[test]
    fn bad_bytes_are_typed_errors_naming_the_key() {
        let good = sample(State::InProgress {
            token: Token(1),
            lease_until: Timestamp(2),
        })
        .encode();
        let mut future = good.clone();
        future[4] = 9;
        assert!(matches!(
            Record::decode("k1", &future),
            Err(Error::UnsupportedFormat { ref key, version: 9 }) if key == "k1"
        ));
        for bad in [&b""[..], b"garbage", &good[..good.len() - 1], &good[..20]] {
            assert!(matches!(
                Record::decode("k2", bad),
                Err(Error::CorruptRecord { ref key, .. }) if key == "k2"
            ));
        }
        assert_eq!(
            Record::decode_expiry("k", &good).unwrap(),
            Timestamp(u64::MAX)
        );
        assert!(Record::decode_expiry("k", &good[..50]).is_err());
        let mut origin = good.clone();
        origin[ORIGIN_LEN_AT + 3] += 1;
        assert!(matches!(
            Record::decode("k4", &origin),
            Err(Error::CorruptRecord { ref key, .. }) if key == "k4"
        ));
        let mut tag = good;
        tag[5] = 7;
        assert!(matches!(
            Record::decode("k3", &tag),
            Err(Error::CorruptRecord { .. })
        ));
    }
}
