//! The claims this process holds in Redis, byte for byte.
//!
//! A completion (or a renewal) keeps part of the claim it replaces: the fingerprint,
//! and the claim's history and origin. The Store API hands `complete` only the key and
//! the token, so the store's scripts take those parts from the stored claim and splice
//! them into the new record on the server: four `string.sub`s and a concatenation in
//! Lua, about a fifth of the completion's time on the server (`docs/performance.md`,
//! "A Redis completion that writes the whole record"). The store wrote each claim it holds
//! itself, though, and so knows its bytes: it keeps them here from the claim to its
//! completion, builds the whole new record itself, and writes it with a plain
//! compare-and-set (the record is written only if the key still holds, byte for byte,
//! the claim this process wrote).
//!
//! Equal bytes mean the same state, token and lease as the splicing script checks, so
//! the fence is the same. When the bytes differ (a renewal whose answer was lost, a
//! claim taken over, a claim this process does not know), the write is not applied and
//! the store sends the splicing script, which decides as it always did: the table is
//! a shortcut, never an authority, and whatever it holds, a write is applied exactly
//! when the script would apply it.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use crate::key_text::Key;
use crate::record::{Timestamp, Token, FINGERPRINT_AT, TOKEN_AT};
use crate::sync;

/// How much the table keeps at most, counted as each claim's bytes, its key's and 64
/// for the entry (16 MiB: some 50,000 claims of a usual size). A claim is forgotten
/// when it is completed, released or given up; one its caller never settles (a future
/// leaked without being dropped) stays until the table is full. A claim not kept only
/// costs its completion a second round trip.
const MAX_BYTES: usize = 16 << 20;

/// How often, at most, a full table looks for claims whose lease has ended, to drop
/// them: each look walks the whole table under its lock.
const PRUNE_EVERY: Duration = Duration::from_secs(1);

/// The claims this process holds, by key.
#[derive(Default)]
pub(super) struct Held {
    table: Mutex<Table>,
}

#[derive(Default)]
struct Table {
    claims: HashMap<Key, HeldClaim, foldhash::fast::RandomState>,
    /// What the claims kept count against [`MAX_BYTES`].
    bytes: usize,
    /// When a full table may next look for claims whose lease has ended.
    next_prune: Timestamp,
}

struct HeldClaim {
    /// The claim as stored: the exact bytes this process wrote.
    bytes: Vec<u8>,
    /// When its lease ends, in this process's clock.
    until: Timestamp,
}

/// What keeping `bytes` under `key` counts against [`MAX_BYTES`].
fn cost(key: &Key, bytes: &[u8]) -> usize {
    key.as_str().len() + bytes.len() + 64
}

impl Table {
    fn remove(&mut self, key: &Key) -> Option<HeldClaim> {
        let held = self.claims.remove(key)?;
        self.bytes -= cost(key, &held.bytes);
        Some(held)
    }

    fn insert(&mut self, key: &Key, held: HeldClaim) {
        self.bytes += cost(key, &held.bytes);
        self.claims.insert(key.clone(), held);
    }
}

impl Held {
    /// Keeps `bytes`, the claim just written under `key`, whose lease ends at `until`
    /// (in place of any claim of the key kept before). Not kept if the table is full
    /// of claims whose lease has not ended.
    pub(super) fn hold(&self, key: &Key, bytes: Vec<u8>, until: Timestamp) {
        let mut table = sync::lock(&self.table);
        table.remove(key);
        let size = cost(key, &bytes);
        if table.bytes + size > MAX_BYTES {
            let now = Timestamp::now();
            if now >= table.next_prune {
                table.next_prune = now.after(PRUNE_EVERY);
                table.claims.retain(|_, claim| claim.until > now);
                table.bytes = table.claims.iter().map(|(k, c)| cost(k, &c.bytes)).sum();
            }
            if table.bytes + size > MAX_BYTES {
                return;
            }
        }
        table.insert(key, HeldClaim { bytes, until });
    }

    /// The claim held under `key` with `token`, no longer kept. A claim of the key
    /// with another token (the one that took this one over) stays.
    pub(super) fn take(&self, key: &Key, token: Token) -> Option<Vec<u8>> {
        let mut table = sync::lock(&self.table);
        let held = table.remove(key)?;
        let token = token.to_bits().to_be_bytes();
        if held.bytes.get(TOKEN_AT..TOKEN_AT + 16) == Some(&token[..]) {
            return Some(held.bytes);
        }
        // Rare: an old owner, after this process took its claim over.
        table.insert(key, held);
        None
    }

    /// How many claims are kept.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        sync::lock(&self.table).claims.len()
    }
}

/// The record the store's splicing script writes over `claim`: `header`'s first bytes,
/// the claim's fingerprint, `header` on to `split`, the claim's own bytes from `split`
/// on, then `payload`. `None` if either is too short to cut there (not a record this
/// store wrote).
pub(super) fn splice(claim: &[u8], header: &[u8], split: usize, payload: &[u8]) -> Option<Vec<u8>> {
    let fingerprint = FINGERPRINT_AT..FINGERPRINT_AT + 32;
    let (kept, tail) = (claim.get(fingerprint.clone())?, claim.get(split..)?);
    let (head, middle) = (
        header.get(..fingerprint.start)?,
        header.get(fingerprint.end..split)?,
    );
    let mut record =
        Vec::with_capacity(head.len() + kept.len() + middle.len() + tail.len() + payload.len());
    for part in [head, kept, middle, tail, payload] {
        record.extend_from_slice(part);
    }
    Some(record)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn claim(token: u128) -> Vec<u8> {
        let mut bytes = vec![0; TOKEN_AT + 16];
        bytes[TOKEN_AT..].copy_from_slice(&token.to_be_bytes());
        bytes
    }

    #[test]
    fn only_the_token_that_holds_a_claim_takes_it() {
        let held = Held::default();
        let key = Key::from_text("k");
        held.hold(
            &key,
            claim(2),
            Timestamp::now().after(Duration::from_secs(30)),
        );
        assert_eq!(held.take(&key, Token::from_bits(1)), None);
        assert_eq!(held.len(), 1, "another token's take leaves the claim");
        assert_eq!(held.take(&key, Token::from_bits(2)), Some(claim(2)));
        assert_eq!(held.take(&key, Token::from_bits(2)), None);
    }

    /// A full table drops the claims whose lease has ended to make room (at most once
    /// a second), and never keeps more than [`MAX_BYTES`] of live ones.
    #[test]
    fn a_full_table_drops_ended_leases_and_never_grows_past_its_bound() {
        let held = Held::default();
        let (past, future) = (
            Timestamp(1),
            Timestamp::now().after(Duration::from_secs(60)),
        );
        let big = |token| {
            let mut bytes = claim(token);
            bytes.resize(16 << 10, 0);
            bytes
        };
        let fits = MAX_BYTES / cost(&Key::from_text("ended-0000"), &big(1));
        for i in 0..fits {
            held.hold(&Key::from_text(format!("ended-{i:04}")), big(1), past);
        }
        assert_eq!(held.len(), fits, "all fit");
        held.hold(&Key::from_text("live-0000"), big(1), future);
        assert_eq!(held.len(), 1, "the ended leases made room");
        for i in 1..fits + 10 {
            held.hold(&Key::from_text(format!("live-{i:04}")), big(1), future);
        }
        assert_eq!(held.len(), fits, "no more than the bound");
        assert!(sync::lock(&held.table).bytes <= MAX_BYTES);
        let last = Key::from_text(format!("live-{:04}", fits + 5));
        assert_eq!(
            held.take(&last, Token::from_bits(1)),
            None,
            "not kept: no room"
        );
        // Taking a claim gives its room back, to the byte.
        let first = Key::from_text("live-0001");
        assert!(held.take(&first, Token::from_bits(1)).is_some());
        held.hold(&last, big(1), future);
        assert_eq!(held.take(&last, Token::from_bits(1)), Some(big(1)));
        let table = sync::lock(&held.table);
        let counted: usize = table.claims.iter().map(|(k, c)| cost(k, &c.bytes)).sum();
        assert_eq!(table.bytes, counted);
    }

    #[test]
    fn a_splice_cut_past_either_end_is_none() {
        let claim = vec![1; 120];
        let header = vec![2; 120];
        let record = splice(&claim, &header, 94, b"p").unwrap();
        assert_eq!(record.len(), 6 + 32 + (94 - 38) + (120 - 94) + 1);
        assert_eq!(&record[..6], &[2; 6]);
        assert_eq!(&record[6..38], &[1; 32]);
        assert_eq!(record.last(), Some(&b'p'));
        assert_eq!(splice(&claim[..90], &header, 94, b""), None);
        assert_eq!(splice(&claim, &header[..90], 94, b""), None);
    }
}
