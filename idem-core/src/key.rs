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
//! Non-finite floats are written as the bare tokens `NaN`, `Infinity` and `-Infinity`,
//! which no JSON value can produce, so they never share a fingerprint with `null`, a
//! string, or each other (serde_json would write all three as `null`).
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

use std::cell::RefCell;
use std::fmt;
use std::sync::Arc;

use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::protocol::KeyInput;
use crate::{canonical, Error};

/// The SHA-256 digest of an input's canonical serialization.
///
/// Stored with every record and compared on every hit: the same key with another
/// fingerprint is a [`Error::PayloadMismatch`].
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

thread_local! {
    /// The buffer canonical input is written into before hashing, reused by every call
    /// on the thread.
    static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

impl Fingerprint {
    /// Fingerprints a value: SHA-256 over its canonical JSON (see the module docs).
    ///
    /// `tool` only names the tool in the error if the value cannot be serialized.
    pub fn of<T: Serialize + ?Sized>(tool: &str, value: &T) -> Result<Self, Error> {
        Self::hash(tool, |buf| canonical::write(buf, value))
    }

    /// Fingerprints a list of arguments: the same as fingerprinting them as one JSON
    /// array (or tuple).
    pub fn of_args(tool: &str, args: &[&dyn KeyInput]) -> Result<Self, Error> {
        Self::hash(tool, |buf| {
            buf.push(b'[');
            for (i, arg) in args.iter().enumerate() {
                if i > 0 {
                    buf.push(b',');
                }
                arg.write_canonical(buf)?;
            }
            buf.push(b']');
            Ok(())
        })
    }

    /// SHA-256 of what `write` puts into the thread's scratch buffer.
    fn hash(
        tool: &str,
        write: impl Fn(&mut Vec<u8>) -> Result<(), serde_json::Error>,
    ) -> Result<Self, Error> {
        let hash = |buf: &mut Vec<u8>| {
            buf.clear();
            let written = write(buf);
            let digest = written.map(|()| Fingerprint(Sha256::digest(&buf[..]).into()));
            if buf.capacity() > canonical::SCRATCH_KEEP {
                *buf = Vec::new();
            }
            digest
        };
        SCRATCH
            .with(|cell| match cell.try_borrow_mut() {
                Ok(mut buf) => hash(&mut buf),
                // A `Serialize` impl that fingerprints something itself: use a fresh buffer.
                Err(_) => hash(&mut Vec::new()),
            })
            .map_err(|source| Error::Input {
                tool: tool.to_owned(),
                source,
            })
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

/// `value` in canonical JSON: the exact bytes that are hashed into its fingerprint.
pub fn canonical_json<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, serde_json::Error> {
    let mut out = Vec::new();
    canonical::write(&mut out, value)?;
    Ok(out)
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

        // Built on the stack, then allocated once as the `Arc<str>`.
        let mut text = [0u8; LABEL_MAX + 1 + 64];
        let mut len = 0;
        for c in parts.tool.chars().take(LABEL_MAX) {
            text[len] = match c {
                'a'..='z' | 'A'..='Z' | '0'..='9' | '_' | '-' => c as u8,
                _ => b'_',
            };
            len += 1;
        }
        if len == 0 {
            text[0] = b'_';
            len = 1;
        }
        text[len] = b'.';
        len += 1;
        const HEX: &[u8; 16] = b"0123456789abcdef";
        for b in digest {
            text[len] = HEX[usize::from(b >> 4)];
            text[len + 1] = HEX[usize::from(b & 0xf)];
            len += 2;
        }
        // Every byte written above is ASCII, so this never takes the fallback.
        Key(std::str::from_utf8(&text[..len]).unwrap_or("_").into())
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
    use proptest::prelude::*;
    use serde_json::Value;
    use std::collections::{BTreeMap, HashMap};
    use std::io::{self, Write};

    /// The reference: canonical JSON by way of a `serde_json::Value` tree. The
    /// streaming writer must produce the same bytes.
    fn reference<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, serde_json::Error> {
        let value = serde_json::to_value(value)?;
        let mut out = Vec::new();
        write_value(&mut out, &value).map_err(serde_json::Error::io)?;
        Ok(out)
    }

    fn write_value<W: Write>(w: &mut W, value: &Value) -> io::Result<()> {
        match value {
            Value::Null => w.write_all(b"null"),
            Value::Bool(b) => w.write_all(if *b { b"true" } else { b"false" }),
            Value::Number(n) => {
                if let Some(u) = n.as_u64() {
                    write!(w, "{u}")
                } else if let Some(i) = n.as_i64() {
                    write!(w, "{i}")
                } else {
                    let f = n.as_f64().unwrap();
                    if f.fract() == 0.0 && f.abs() < 9_007_199_254_740_992.0 {
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
                    write_value(w, item)?;
                }
                w.write_all(b"]")
            }
            Value::Object(map) => {
                let mut entries: Vec<_> = map.iter().collect();
                entries.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
                w.write_all(b"{")?;
                for (i, (k, v)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        w.write_all(b",")?;
                    }
                    serde_json::to_writer(&mut *w, k).map_err(io::Error::other)?;
                    w.write_all(b":")?;
                    write_value(w, v)?;
                }
                w.write_all(b"}")
            }
        }
    }

    fn json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<f64>().prop_map(Value::from),
            "\\PC{0,8}".prop_map(Value::from),
        ];
        leaf.prop_recursive(4, 64, 8, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                proptest::collection::vec(("\\PC{0,6}", inner), 0..6)
                    .prop_map(|kv| Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    #[derive(Serialize)]
    enum Shape {
        Unit,
        Newtype(u8),
        Tuple(i32, String),
        Struct { z: f32, a: Option<bool> },
    }

    #[derive(Serialize)]
    struct Everything {
        zeta: Vec<Shape>,
        alpha: HashMap<u32, char>,
        bytes: serde_bytes_like::Bytes,
        unit: (),
        tuple: (u8, i128, u128),
        float: f64,
        nested: BTreeMap<String, BTreeMap<String, Vec<Option<i16>>>>,
    }

    mod serde_bytes_like {
        pub struct Bytes(pub Vec<u8>);
        impl serde::Serialize for Bytes {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_bytes(&self.0)
            }
        }
    }

    #[test]
    fn streaming_writer_matches_the_reference_on_every_serde_shape() {
        let v = Everything {
            zeta: vec![
                Shape::Unit,
                Shape::Newtype(7),
                Shape::Tuple(-1, "é\"\n".into()),
                Shape::Struct { z: 0.1, a: None },
            ],
            alpha: (0..12)
                .map(|i| (i * 7, char::from(b'a' + i as u8)))
                .collect(),
            bytes: serde_bytes_like::Bytes(vec![0, 1, 255]),
            unit: (),
            tuple: (1, -5, 9),
            float: 2.5e-8,
            nested: [(
                "b".to_string(),
                [("y".to_string(), vec![Some(1), None])].into(),
            )]
            .into(),
        };
        assert_eq!(canonical_json(&v).unwrap(), reference(&v).unwrap());
    }

    proptest! {
        #[test]
        fn streaming_writer_matches_the_reference(v in json()) {
            prop_assert_eq!(canonical_json(&v).unwrap(), reference(&v).unwrap());
        }

        /// Maps in arbitrary order (a `Vec` of pairs serialized as a map), with keys
        /// that need escaping and keys that are prefixes of each other: sorted by raw
        /// key, whatever the order written.
        #[test]
        fn unordered_maps_match_the_reference(
            pairs in proptest::collection::vec(
                ("[a!\"\\\\\\x00\\x1f\\n é]{0,3}", json()), 0..8),
        ) {
            struct AsMap<'a>(&'a [(String, Value)]);
            impl Serialize for AsMap<'_> {
                fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                    s.collect_map(self.0.iter().map(|(k, v)| (k, v)))
                }
            }
            // Duplicate keys are not a map the reference can hold.
            let mut seen = std::collections::HashSet::new();
            let pairs: Vec<_> = pairs.into_iter().filter(|(k, _)| seen.insert(k.clone())).collect();
            let map = AsMap(&pairs);
            prop_assert_eq!(canonical_json(&map).unwrap(), reference(&map).unwrap());
        }
    }

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
        // Non-finite floats get tokens of their own, never JSON's `null`.
        assert_eq!(canon(&f64::NAN), "NaN");
        assert_eq!(canon(&f64::INFINITY), "Infinity");
        assert_eq!(canon(&f64::NEG_INFINITY), "-Infinity");
        assert_eq!(canon(&Option::<f64>::None), "null");
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
