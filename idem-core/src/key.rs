//! Key derivation: the input fingerprint and the idempotency key.
//!
//! A key answers three questions: *who* (the run id, and optionally a tenant and a
//! call id), *what* (the tool name) and *with what* (a SHA-256 digest of the input).
//!
//! # Canonical input
//!
//! The input is serialized with serde into a canonical JSON form before it is hashed:
//! object keys are sorted (by their UTF-8 bytes) at every depth, integers are written
//! in one form whatever their Rust type (`1u8`, `1i64` and `1.0f64` all write `1`), and
//! there is no whitespace. A `HashMap` therefore hashes the same in every process and
//! whatever its iteration order, also when serde_json's `preserve_order` feature is on.
//! Non-finite floats (`NaN`, `inf`) serialize as `null`, as serde_json does.
//! An input serde cannot express as JSON (a map with non-string keys) is an
//! [`Error::Input`]: it is never hashed as a shared value.
//!
//! # Key text
//!
//! [`Key::derive`] hashes an unambiguous, length-prefixed encoding of every part, so a
//! run id containing a separator is data, not structure: two different sets of parts
//! can only share a key through a SHA-256 collision. The text form is
//! `<tool label>.<64 hex digits>`: printable ASCII, at most 129 characters, usable as
//! an `Idempotency-Key` header downstream. The label (the tool name with characters
//! outside `[A-Za-z0-9_-]` replaced by `_`, cut at 64) is only there to make keys
//! readable in a store; the digest alone carries identity.

use std::fmt;
use std::io::{self, Write};
use std::sync::Arc;

use serde::Serialize;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::Error;

/// The SHA-256 digest of an input's canonical serialization.
///
/// Stored with every record and compared on every hit: the same key with another
/// fingerprint is a [`Error::PayloadMismatch`].
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Fingerprints a value: SHA-256 over its canonical JSON (see the module docs).
    ///
    /// `tool` only names the tool in the error if the value cannot be serialized.
    pub fn of<T: Serialize + ?Sized>(tool: &str, value: &T) -> Result<Self, Error> {
        let value = serde_json::to_value(value).map_err(|source| Error::Input {
            tool: tool.to_owned(),
            source,
        })?;
        let mut hasher = HashWriter(Sha256::new());
        write_canonical(&mut hasher, &value).map_err(|e| Error::Input {
            tool: tool.to_owned(),
            source: serde_json::Error::io(e),
        })?;
        Ok(Fingerprint(hasher.0.finalize().into()))
    }

    /// Wraps raw digest bytes (as read back from a store).
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Fingerprint(bytes)
    }

    /// The raw digest bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint(")?;
        for byte in &self.0[..8] {
            write!(f, "{byte:02x}")?;
        }
        write!(f, "…)")
    }
}

/// Writes `value` in canonical JSON. Exposed for tests and for stores that want to
/// show users what was hashed.
pub fn canonical_json<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, serde_json::Error> {
    let value = serde_json::to_value(value)?;
    let mut out = Vec::new();
    write_canonical(&mut out, &value).map_err(serde_json::Error::io)?;
    Ok(out)
}

struct HashWriter(Sha256);

impl Write for HashWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Largest integer a double represents exactly; integral floats below it are written
/// as integers so `1.0` and `1` are one number.
const EXACT_INT: f64 = 9_007_199_254_740_992.0;

fn write_canonical<W: Write>(w: &mut W, value: &Value) -> io::Result<()> {
    match value {
        Value::Null => w.write_all(b"null"),
        Value::Bool(true) => w.write_all(b"true"),
        Value::Bool(false) => w.write_all(b"false"),
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                write!(w, "{u}")
            } else if let Some(i) = n.as_i64() {
                write!(w, "{i}")
            } else {
                let f = n.as_f64().unwrap_or(0.0);
                if f.fract() == 0.0 && f.abs() < EXACT_INT {
                    // Integral and exact: one form with the integers (`-0.0` is `0`).
                    write!(w, "{}", f as i64)
                } else {
                    serde_json::to_writer(&mut *w, &f).map_err(io::Error::other)
                }
            }
        }
        Value::String(s) => serde_json::to_writer(&mut *w, s).map_err(io::Error::other),
        Value::Array(items) => {
            w.write_all(b"[")?;
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    w.write_all(b",")?;
                }
                write_canonical(w, item)?;
            }
            w.write_all(b"]")
        }
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            w.write_all(b"{")?;
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    w.write_all(b",")?;
                }
                serde_json::to_writer(&mut *w, k).map_err(io::Error::other)?;
                w.write_all(b":")?;
                write_canonical(w, v)?;
            }
            w.write_all(b"}")
        }
    }
}

/// The parts a key is derived from.
///
/// `tenant` and `call_id` are optional; `None` and `Some("")` are different keys.
#[derive(Debug, Clone, Copy)]
pub struct KeyParts<'a> {
    /// Who owns the data (a tenant or user); results never cross tenants.
    pub tenant: Option<&'a str>,
    /// The agent run.
    pub run_id: &'a str,
    /// A discriminator for intentional repeats (e.g. the model's tool-call id).
    pub call_id: Option<&'a str>,
    /// The tool's name.
    pub tool: &'a str,
    /// Fingerprint of the arguments that form the key (all of them by default).
    pub input: &'a Fingerprint,
}

/// An idempotency key: `<tool label>.<64 hex digits>`, printable ASCII.
///
/// Cheap to clone. Its text can be forwarded downstream (an `Idempotency-Key` header,
/// an email provider's dedup id): see [`current_key`](crate::current_key).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key(Arc<str>);

/// Longest tool label kept in a key's text.
const LABEL_MAX: usize = 64;

impl Key {
    /// Derives the key of a call from its parts (see the module docs).
    pub fn derive(parts: &KeyParts<'_>) -> Key {
        let mut h = Sha256::new();
        h.update(b"idem/key/v1");
        field(&mut h, parts.tenant.map(str::as_bytes));
        field(&mut h, Some(parts.run_id.as_bytes()));
        field(&mut h, parts.call_id.map(str::as_bytes));
        field(&mut h, Some(parts.tool.as_bytes()));
        field(&mut h, Some(parts.input.as_bytes()));
        let digest: [u8; 32] = h.finalize().into();

        let mut text = String::with_capacity(LABEL_MAX + 1 + 64);
        text.extend(parts.tool.chars().take(LABEL_MAX).map(|c| match c {
            'a'..='z' | 'A'..='Z' | '0'..='9' | '_' | '-' => c,
            _ => '_',
        }));
        if text.is_empty() {
            text.push('_');
        }
        text.push('.');
        push_hex(&mut text, &digest);
        Key(text.into())
    }

    /// Wraps a key read back from a store or chosen by hand.
    pub fn from_text(text: impl Into<Arc<str>>) -> Key {
        Key(text.into())
    }

    /// The key's text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// One length-prefixed, presence-tagged field: no two field sequences encode alike.
fn field(h: &mut Sha256, bytes: Option<&[u8]>) {
    match bytes {
        None => h.update([0u8]),
        Some(b) => {
            h.update([1u8]);
            h.update((b.len() as u64).to_be_bytes());
            h.update(b);
        }
    }
}

fn push_hex(out: &mut String, bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for b in bytes {
        out.push(HEX[usize::from(b >> 4)] as char);
        out.push(HEX[usize::from(b & 0xf)] as char);
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({})", self.0)
    }
}

impl AsRef<str> for Key {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{BTreeMap, HashMap};

    fn canon<T: Serialize>(v: &T) -> String {
        String::from_utf8(canonical_json(v).unwrap()).unwrap()
    }

    #[test]
    fn objects_are_sorted_at_every_depth() {
        let v = serde_json::json!({"b": {"z": 1, "a": [ {"y": 2, "x": 3} ]}, "a": null});
        assert_eq!(canon(&v), r#"{"a":null,"b":{"a":[{"x":3,"y":2}],"z":1}}"#);
    }

    #[test]
    fn numbers_have_one_form() {
        assert_eq!(canon(&1u8), "1");
        assert_eq!(canon(&1i64), "1");
        assert_eq!(canon(&1.0f64), "1");
        assert_eq!(canon(&-0.0f64), "0");
        assert_eq!(canon(&-3i32), "-3");
        assert_eq!(canon(&1.5f64), "1.5");
        assert_eq!(canon(&1e300f64), "1e+300");
        assert_eq!(canon(&f64::NAN), "null");
    }

    #[test]
    fn hash_map_order_does_not_matter() {
        let a: HashMap<String, u32> = (0..50).map(|i| (format!("k{i}"), i)).collect();
        let b: BTreeMap<String, u32> = (0..50).rev().map(|i| (format!("k{i}"), i)).collect();
        assert_eq!(
            Fingerprint::of("t", &a).unwrap(),
            Fingerprint::of("t", &b).unwrap()
        );
    }

    #[test]
    fn non_string_map_keys_are_a_typed_error() {
        let m: HashMap<(u8, u8), u8> = [((1, 2), 3)].into_iter().collect();
        let err = Fingerprint::of("tool_x", &m).unwrap_err();
        assert!(
            matches!(err, Error::Input { ref tool, .. } if tool == "tool_x"),
            "{err}"
        );
    }

    #[test]
    fn key_text_is_short_printable_ascii() {
        let fp = Fingerprint::of("t", &"x").unwrap();
        let long_tool = "ü/".repeat(500);
        for tool in ["send_email", "", long_tool.as_str(), "a.b c"] {
            let key = Key::derive(&KeyParts {
                tenant: None,
                run_id: "run",
                call_id: None,
                tool,
                input: &fp,
            });
            let s = key.as_str();
            assert!(s.len() <= 129, "{s}");
            assert!(s.bytes().all(|b| b.is_ascii_graphic()), "{s}");
        }
    }

    #[test]
    fn separators_in_parts_are_data() {
        let fp = Fingerprint::of("t", &"x").unwrap();
        let k = |tenant, run_id, call_id, tool| {
            Key::derive(&KeyParts {
                tenant,
                run_id,
                call_id,
                tool,
                input: &fp,
            })
        };
        assert_ne!(k(None, "a.b", None, "c"), k(None, "a", None, "b.c"));
        assert_ne!(k(Some(""), "a", None, "c"), k(None, "a", None, "c"));
        assert_ne!(k(Some("a"), "", None, "c"), k(None, "a", None, "c"));
        assert_ne!(k(None, "a", Some(""), "c"), k(None, "a", None, "c"));
    }
}
