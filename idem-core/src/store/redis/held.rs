//! The claims this process holds in Redis, byte for byte.
//!
//! A completion (or a renewal) keeps part of the claim it replaces: the fingerprint,
//! and the claim's history and origin. The Store API hands `complete` only the key and
//! the token, so the store's scripts take those parts from the stored claim and splice
//! them into the new record on the server: four `string.sub`s and a concatenation in
//! Lua, a third of what a miss costs the server. The store wrote each claim it holds
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

use crate::key_text::Key;
use crate::record::{Timestamp, Token, FINGERPRINT_AT, TOKEN_AT};
use crate::sync;

/// How many claims the table keeps at most. A claim is forgotten when it is completed,
/// released or given up; one its caller never settles (a future leaked without being
/// dropped) stays until the table is full, which then drops every claim whose lease
/// has ended. A claim not kept only costs its completion a second round trip.
const MAX_HELD: usize = 16_384;

/// The claims this process holds, by key.
#[derive(Default)]
pub(super) struct Held {
    claims: Mutex<HashMap<Key, HeldClaim, foldhash::fast::RandomState>>,
}

struct HeldClaim {
    /// The claim as stored: the exact bytes this process wrote.
    bytes: Vec<u8>,
    /// When its lease ends, in this process's clock.
    until: Timestamp,
}

impl Held {
    /// Keeps `bytes`, the claim just written under `key`, whose lease ends at `until`.
    pub(super) fn hold(&self, key: &Key, bytes: Vec<u8>, until: Timestamp) {
        let mut claims = sync::lock(&self.claims);
        if claims.len() >= MAX_HELD && !claims.contains_key(key) {
            let now = Timestamp::now();
            claims.retain(|_, claim| claim.until > now);
            if claims.len() >= MAX_HELD {
                return;
            }
        }
        claims.insert(key.clone(), HeldClaim { bytes, until });
    }

    /// The claim held under `key` with `token`, no longer kept. A claim of the key
    /// with another token (the one that took this one over) stays.
    pub(super) fn take(&self, key: &Key, token: Token) -> Option<Vec<u8>> {
        let mut claims = sync::lock(&self.claims);
        let held = claims.remove(key)?;
        let token = token.to_bits().to_be_bytes();
        if held.bytes.get(TOKEN_AT..TOKEN_AT + 16) == Some(&token[..]) {
            return Some(held.bytes);
        }
        // Rare: an old owner, after this process took its claim over.
        claims.insert(key.clone(), held);
        None
    }

    /// How many claims are kept.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        sync::lock(&self.claims).len()
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

    /// A full table drops the claims whose lease has ended to make room, and keeps
    /// no more than [`MAX_HELD`] live ones.
    #[test]
    fn a_full_table_drops_ended_leases_and_never_grows_past_its_bound() {
        let held = Held::default();
        let (past, future) = (
            Timestamp(1),
            Timestamp::now().after(Duration::from_secs(60)),
        );
        for i in 0..MAX_HELD {
            held.hold(&Key::from_text(format!("ended-{i}")), claim(1), past);
        }
        held.hold(&Key::from_text("live-0"), claim(1), future);
        assert_eq!(held.len(), 1, "the ended leases made room");
        for i in 1..MAX_HELD + 10 {
            held.hold(&Key::from_text(format!("live-{i}")), claim(1), future);
        }
        assert_eq!(held.len(), MAX_HELD);
        let last = Key::from_text(format!("live-{}", MAX_HELD + 5));
        assert_eq!(
            held.take(&last, Token::from_bits(1)),
            None,
            "not kept: no room"
        );
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
