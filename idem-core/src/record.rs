//! Records: what a store keeps under a key, and their byte encoding.
//!
//! # Encoding (format version 1)
//!
//! ```text
//! offset  size  field
//! 0       4     magic "idem"
//! 4       1     format version (1)
//! 5       1     state: 0 in progress, 1 completed, 2 failed
//! 6       32    input fingerprint (SHA-256)
//! 38      8     created at, ms since the Unix epoch, big-endian
//! 46      8     expires at, ms since the Unix epoch, big-endian
//! 54      ..    in progress: owner token (16 bytes) + lease until (8 bytes)
//!               completed / failed: the serialized result / error (JSON), to the end
//! ```
//!
//! The Redis store keeps these same bytes with its times counted from the moment Redis
//! stored the record, since a native `SET` cannot read the server's clock (see the
//! Redis store's module docs, feature `redis`).
//!
//! Bytes that do not start with the magic, are too short, or carry an unknown state are
//! an [`Error::CorruptRecord`]; a known magic with an unknown version is an
//! [`Error::UnsupportedFormat`]. Both name the key. Decoding never panics.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::key::Fingerprint;
use crate::{Error, Key};

/// A point in time: milliseconds since the Unix epoch, by the clock of whoever wrote it.
///
/// The memory and sled stores use the process clock ([`Timestamp::now`]); a store
/// shared by several machines documents which clock it uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
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
    /// When the record was written.
    pub created_at: Timestamp,
    /// When the record stops existing. Every read path treats an expired record as absent.
    pub expires_at: Timestamp,
    /// In progress, completed or failed.
    pub state: State,
}

const MAGIC: &[u8; 4] = b"idem";
/// The record format version this build writes.
pub const FORMAT_VERSION: u8 = 1;
/// The length of the fixed header, which completed and failed records follow with
/// their payload.
pub(crate) const HEADER: usize = 4 + 1 + 1 + 32 + 8 + 8;
/// The first bytes of every encoded in-progress record: magic, version, state 0.
#[cfg(feature = "redis")]
pub(crate) const IN_PROGRESS_TAG: [u8; 6] =
    [MAGIC[0], MAGIC[1], MAGIC[2], MAGIC[3], FORMAT_VERSION, 0];
/// Where the fingerprint is in an encoded record.
pub(crate) const FINGERPRINT_AT: usize = 6;
/// Where the owner token is in an encoded in-progress record.
#[cfg(feature = "redis")]
pub(crate) const TOKEN_AT: usize = HEADER;
/// The length of an encoded in-progress record.
pub(crate) const IN_PROGRESS_LEN: usize = HEADER + 16 + 8;

impl Record {
    /// Whether the record has expired at `now` (and so must be treated as absent).
    pub fn is_expired(&self, now: Timestamp) -> bool {
        self.expires_at <= now
    }

    /// Encodes the record (see the module docs for the layout).
    pub fn encode(&self) -> Vec<u8> {
        let payload = match &self.state {
            State::InProgress { .. } => IN_PROGRESS_LEN - HEADER,
            State::Completed { result } => result.len(),
            State::Failed { error } => error.len(),
        };
        let mut out = Vec::with_capacity(HEADER + payload);
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
        match &self.state {
            State::InProgress { token, lease_until } => {
                out.extend_from_slice(&token.0.to_be_bytes());
                out.extend_from_slice(&lease_until.0.to_be_bytes());
            }
            State::Completed { result: bytes } | State::Failed { error: bytes } => {
                out.extend_from_slice(bytes)
            }
        }
        out
    }

    /// Reads only the expiry of an encoded record (for purging without copying
    /// results). The same checks as [`Record::decode`] on the header.
    pub fn decode_expiry(key: &str, bytes: &[u8]) -> Result<Timestamp, Error> {
        if bytes.len() < 5 || &bytes[..4] != MAGIC {
            return Err(Error::CorruptRecord {
                key: Key::from_text(key),
                reason: "not an idem record (bad magic)".to_owned(),
            });
        }
        if bytes[4] != FORMAT_VERSION {
            return Err(Error::UnsupportedFormat {
                key: Key::from_text(key),
                version: bytes[4],
            });
        }
        let mut b = [0u8; 8];
        match bytes.get(46..54) {
            Some(slice) => b.copy_from_slice(slice),
            None => {
                return Err(Error::CorruptRecord {
                    key: Key::from_text(key),
                    reason: "truncated header".to_owned(),
                })
            }
        }
        Ok(Timestamp(u64::from_be_bytes(b)))
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
        let header = bytes.get(..HEADER)?;
        let mut expires_at = [0u8; 8];
        expires_at.copy_from_slice(&header[46..54]);
        let replayable = header[..4] == *MAGIC
            && header[4] == FORMAT_VERSION
            && header[5] == 1
            && header[6..38] == fingerprint.as_bytes()[..]
            && Timestamp(u64::from_be_bytes(expires_at)) > now;
        replayable.then(|| &bytes[HEADER..])
    }

    /// Decodes a record read under `key`. Never panics, whatever the bytes.
    pub fn decode(key: &str, bytes: &[u8]) -> Result<Record, Error> {
        let corrupt = |reason: &str| Error::CorruptRecord {
            key: Key::from_text(key),
            reason: reason.to_owned(),
        };
        if bytes.len() < 5 || &bytes[..4] != MAGIC {
            return Err(corrupt("not an idem record (bad magic)"));
        }
        if bytes[4] != FORMAT_VERSION {
            return Err(Error::UnsupportedFormat {
                key: Key::from_text(key),
                version: bytes[4],
            });
        }
        if bytes.len() < HEADER {
            return Err(corrupt("truncated header"));
        }
        let u64_at = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&bytes[at..at + 8]);
            u64::from_be_bytes(b)
        };
        let mut fp = [0u8; 32];
        fp.copy_from_slice(&bytes[FINGERPRINT_AT..FINGERPRINT_AT + 32]);
        let rest = &bytes[HEADER..];
        let state = match bytes[5] {
            0 => {
                if bytes.len() != IN_PROGRESS_LEN {
                    return Err(corrupt("in-progress record of wrong length"));
                }
                let mut t = [0u8; 16];
                t.copy_from_slice(&rest[..16]);
                State::InProgress {
                    token: Token(u128::from_be_bytes(t)),
                    lease_until: Timestamp(u64_at(HEADER + 16)),
                }
            }
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
            created_at: Timestamp(u64_at(38)),
            expires_at: Timestamp(u64_at(46)),
            state,
        })
    }
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
        }
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
        assert_eq!(bytes.len(), IN_PROGRESS_LEN);
        assert_eq!(bytes[..6], IN_PROGRESS_TAG);
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
        let mut tag = good;
        tag[5] = 7;
        assert!(matches!(
            Record::decode("k3", &tag),
            Err(Error::CorruptRecord { .. })
        ));
    }
}
