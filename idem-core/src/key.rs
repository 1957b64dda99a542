//! Key derivation: the fingerprint of a call and its idempotency key.
//!
//! A key answers three questions, in one SHA-256 digest: *who* (the run id, and
//! optionally a tenant and a call id), *what* (the tool name) and *with what* (the
//! input).
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
//! # Fingerprint and key
//!
//! A [`Fingerprint`] is SHA-256 over an unambiguous encoding of the key parts
//! ([`KeyParts`]: tenant, run id, call id, tool) followed by an input's canonical JSON,
//! hashed in one pass. Each part is presence-tagged and length-prefixed, so a run id
//! containing a separator is data, not structure: two different calls can only share a
//! fingerprint through a SHA-256 collision.
//!
//! A [`Key`] is the fingerprint of the arguments that form the key (all of them by
//! default), as text: `<tool label>.<64 hex digits>`, printable ASCII, at most 129
//! characters, usable as an `Idempotency-Key` header downstream. The label (the tool
//! name with characters outside `[A-Za-z0-9_-]` replaced by `_`, keeping its last 64 characters) is only
//! there to make keys readable in a store; the digest alone carries identity. A record
//! stores the fingerprint of the whole input, so when the key covers the whole input
//! the key's digest and the record's fingerprint are one hash, computed once.
//!
//! The encoding starts with its version, `idem/key/v2`. Keys are stored: a new
//! version orphans every stored record, and a retry that spans the upgrade runs again.

use std::cell::RefCell;
use std::fmt;

use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::canonical;
use crate::error::Error;
pub use crate::key_text::Key;

/// The SHA-256 digest of a call: its key parts and the canonical form of an input.
///
/// A record stores the fingerprint of the call's whole input, and every hit compares
/// it: the same key with another fingerprint is a [`Error::PayloadMismatch`]. A key is
/// the fingerprint of the arguments that form it, as text (see [`Key`]); when the key
/// covers the whole input (the default) the two are one digest, computed once.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

thread_local! {
    /// The buffer a call's encoding is written into before hashing, reused by every
    /// call on the thread.
    static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Names the encoding, so that no other hash of these bytes is ever mistaken for one.
const VERSION: &[u8] = b"idem/key/v2";

impl Fingerprint {
    /// Fingerprints a call of `parts` with `input`: SHA-256 over the parts and the
    /// input's canonical JSON (see the module docs).
    pub fn of<T: Serialize + ?Sized>(parts: &KeyParts<'_>, input: &T) -> Result<Self, Error> {
        Self::hash(parts, |buf| canonical::write(buf, input))
    }

    /// Fingerprints a call of `parts` with a list of arguments: the same as
    /// fingerprinting them as one JSON array (or tuple).
    pub fn of_args(parts: &KeyParts<'_>, args: &[&dyn KeyInput]) -> Result<Self, Error> {
        Self::hash(parts, |buf| {
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

    /// SHA-256 of the encoded parts followed by what `write` appends, all written into
    /// the thread's scratch buffer and hashed in one pass.
    fn hash(
        parts: &KeyParts<'_>,
        write: impl Fn(&mut Vec<u8>) -> Result<(), serde_json::Error>,
    ) -> Result<Self, Error> {
        let hash = |buf: &mut Vec<u8>| {
            buf.clear();
            parts.encode(buf);
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
                tool: parts.tool.to_owned(),
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

/// `value` in canonical JSON: the exact bytes that follow the key parts into its
/// fingerprint.
#[cfg(test)]
fn canonical_json<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, serde_json::Error> {
    let mut out = Vec::new();
    canonical::write(&mut out, value)?;
    Ok(out)
}

/// The tool name the attribute gives a function without a `name` option: the path
/// of the function as [`std::any::type_name`] writes a closure defined in its body,
/// without the closures' own segments.
///
/// That path names the module, and for a method the type *and the trait*, with the
/// generic arguments of this instantiation: `my_agent::tools::send_email`,
/// `<my_agent::Notifier as my_agent::EmailTool>::send`, `my_agent::Queue<u32>::push`.
/// So no two tools, and no two instantiations of one generic tool, share a name. It
/// changes when the function moves, and could change with a compiler whose
/// `type_name` writes paths differently; a tool whose keys must outlive such a change
/// sets `name = "..."`.
pub fn default_tool_name(closure_type_name: &'static str) -> &'static str {
    let mut name = closure_type_name;
    while let Some(outer) = name.strip_suffix("::{{closure}}") {
        name = outer;
    }
    name
}

/// Keys a set-like collection as a set: its elements in the order of their canonical
/// JSON (the JSON the key is derived from, with maps sorted by key), so the same set serializes alike in every process. The
/// elements need only `Serialize`, not `Ord`.
///
/// A `HashSet` serializes in hash order, which differs from process to process (its
/// hasher is seeded at random): the same set would get a new key each time. The
/// attribute keys a `HashSet` argument this way by itself; for a set inside an input,
/// put `#[serde(serialize_with = "idem::key::sorted")]` on the field, or use a
/// `BTreeSet`. Sequences (`Vec`) keep their order, since order can be meaningful.
pub struct Sorted<'a, C: ?Sized>(pub &'a C);

impl<'a, C: ?Sized> Serialize for Sorted<'a, C>
where
    &'a C: IntoIterator,
    <&'a C as IntoIterator>::Item: Serialize,
{
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        sorted(self.0, serializer)
    }
}

/// Serializes a set-like collection with its elements in the order of their canonical
/// JSON: for `#[serde(serialize_with = "idem::key::sorted")]` on a `HashSet` field of
/// an input (see [`Sorted`]).
pub fn sorted<'a, C, S>(set: &'a C, serializer: S) -> Result<S::Ok, S::Error>
where
    C: ?Sized,
    &'a C: IntoIterator,
    <&'a C as IntoIterator>::Item: Serialize,
    S: serde::Serializer,
{
    let mut elements = Vec::new();
    for element in set {
        let mut canonical = Vec::new();
        canonical::write(&mut canonical, &element).map_err(serde::ser::Error::custom)?;
        elements.push((canonical, element));
    }
    elements.sort_by(|a, b| a.0.cmp(&b.0));
    serializer.collect_seq(elements.iter().map(|(_, element)| element))
}

/// An argument that can be part of an idempotency key: any `Serialize` type.
///
/// The attribute passes each argument as `&dyn KeyInput`, so an argument that does not
/// serialize is one compile error, at that argument; and each argument is then written
/// by fully typed code, with one dynamic call per argument.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be part of an idempotency key: it does not implement `serde::Serialize`",
    label = "this argument is hashed into the key",
    note = "derive `Serialize` for it, or, if it is context (a client, a connection) rather than input, list it in `skip = [...]`"
)]
pub trait KeyInput {
    /// Appends the canonical JSON of `self` to `out` (maps sorted by key, at every depth).
    fn write_canonical(&self, out: &mut Vec<u8>) -> Result<(), serde_json::Error>;
}

impl<T: Serialize + ?Sized> KeyInput for T {
    fn write_canonical(&self, out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
        crate::canonical::write(out, self)
    }
}

/// Who calls which tool: the parts of a key besides its input.
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
}

impl KeyParts<'_> {
    /// Appends the version, then each part presence-tagged and length-prefixed: no two
    /// sets of parts encode alike, and no encoding is a prefix of another, so the
    /// input that follows can never be read as a part.
    fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(VERSION);
        for part in [
            self.tenant,
            Some(self.run_id),
            self.call_id,
            Some(self.tool),
        ] {
            match part {
                None => out.push(0),
                Some(text) => {
                    out.push(1);
                    // LEB128: seven bits of the length per byte, low bits first.
                    let mut len = text.len();
                    while len >= 0x80 {
                        out.push((len & 0x7f) as u8 | 0x80);
                        len >>= 7;
                    }
                    out.push(len as u8);
                    out.extend_from_slice(text.as_bytes());
                }
            }
        }
    }
}

/// Longest tool label kept in a key's text.
const LABEL_MAX: usize = 64;

/// Each byte's two lowercase hex digits.
const HEX_PAIRS: [[u8; 2]; 256] = {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut pairs = [[0u8; 2]; 256];
    let mut b = 0;
    while b < 256 {
        pairs[b] = [HEX[b >> 4], HEX[b & 0xf]];
        b += 1;
    }
    pairs
};

impl Key {
    /// Derives the key of a call of `parts` whose key is formed by `key_input` (see
    /// the module docs): [`Key::of`] its fingerprint.
    pub fn derive<T: Serialize + ?Sized>(
        parts: &KeyParts<'_>,
        key_input: &T,
    ) -> Result<Key, Error> {
        Ok(Key::of(parts.tool, &Fingerprint::of(parts, key_input)?))
    }

    /// The label keys of `tool` carry ([`Key::label`]): its name shortened and with
    /// odd characters replaced, as [`Key::of`] writes it.
    pub fn label_of(tool: &str) -> String {
        let key = Key::of(tool, &Fingerprint::from_bytes([0; 32]));
        key.label().unwrap_or_default().to_owned()
    }

    /// The key whose digest is `fingerprint`, labelled with `tool`: the text form of
    /// the fingerprint of a call's key input.
    pub fn of(tool: &str, fingerprint: &Fingerprint) -> Key {
        // Built on the stack, then allocated once as the `Arc<str>`.
        let mut text = [0u8; LABEL_MAX + 1 + 64];
        let mut len = 0;
        // A long name keeps its end, where a path names the function.
        let label = match tool.len() > LABEL_MAX {
            // Only a name over 64 bytes can be over 64 characters.
            true => {
                let skip = tool.chars().count().saturating_sub(LABEL_MAX);
                &tool[tool.char_indices().nth(skip).map_or(0, |(i, _)| i)..]
            }
            false => tool,
        };
        // One byte per character: an ASCII one kept or replaced by `_`, a multi-byte
        // one replaced by `_` at its leading byte and its continuation bytes skipped.
        // At most `LABEL_MAX` characters are left after the cut above.
        for &b in label.as_bytes() {
            text[len] = match b {
                b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' | b'-' => b,
                0x80..=0xbf => continue,
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
        for &b in fingerprint.as_bytes() {
            text[len..len + 2].copy_from_slice(&HEX_PAIRS[usize::from(b)]);
            len += 2;
        }
        // Every byte written above is ASCII, so this never takes the fallback.
        Key::from_text(std::str::from_utf8(&text[..len]).unwrap_or("_"))
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

        /// Keys that share their first eight bytes or more, are prefixes of each other
        /// and hold NUL bytes (which read as the zeros a short key's head is padded
        /// with): sorted by raw key, as the reference sorts them.
        #[test]
        fn keys_alike_in_their_first_eight_bytes_are_sorted_by_the_rest(
            keys in proptest::collection::vec("(campaign){0,2}[a\\x00]{0,10}", 0..10),
        ) {
            let mut seen = std::collections::HashSet::new();
            let pairs: Vec<(String, Value)> = keys
                .into_iter()
                .filter(|k| seen.insert(k.clone()))
                .enumerate()
                .map(|(i, k)| (k, Value::from(i)))
                .collect();
            struct AsMap<'a>(&'a [(String, Value)]);
            impl Serialize for AsMap<'_> {
                fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                    s.collect_map(self.0.iter().map(|(k, v)| (k, v)))
                }
            }
            let map = AsMap(&pairs);
            prop_assert_eq!(canonical_json(&map).unwrap(), reference(&map).unwrap());
        }
    }

    /// Known answers: the exact keys of a few inputs, fixed when written. A change to
    /// the canonical writer, the encoding of the parts or the key's text that moves
    /// any of them moves every stored key, and a retry across the upgrade runs again.
    #[test]
    fn keys_are_the_ones_stored_before() {
        #[derive(Serialize)]
        struct Email {
            to: String,
            cc: Vec<String>,
            subject: String,
            body: String,
            tags: HashMap<String, String>,
            shape: Shape,
        }
        /// Pairs written in this order, a key twice: kept both, in the order written.
        struct Written(&'static [(&'static str, u32)]);
        impl Serialize for Written {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_map(self.0.iter().map(|(k, v)| (k, v)))
            }
        }
        let email = Email {
            to: "ada@example.com".into(),
            cc: vec!["b\\o\"b".into(), "\u{7}".into()],
            subject: "héllo\n".into(),
            body: "x".repeat(300),
            tags: [
                ("zeta", "1"),
                ("a\nb", "2"),
                ("\"", "3"),
                ("campaign-b", "4"),
                ("campaign-a", "5"),
                ("", "6"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
            shape: Shape::Struct {
                z: 0.5,
                a: Some(true),
            },
        };
        let written = Written(&[("b", 1), ("a", 2), ("b", 3), ("\u{1f}", 4), ("é", 5)]);
        let key = |value: &dyn KeyInput| {
            let parts = KeyParts {
                tenant: Some("acme"),
                run_id: "run-7",
                call_id: None,
                tool: "send_email",
            };
            Key::of(parts.tool, &Fingerprint::of_args(&parts, &[value]).unwrap()).to_string()
        };
        assert_eq!(
            key(&email),
            "send_email.e36a9a6c298943ca081626a18d10cd4cf17db2f579bc576162ac17818ff49171"
        );
        assert_eq!(
            key(&written),
            "send_email.ec3f9f466240dc149449a8c658f762cc2dd84d4404a1b7c578e910ca2e0ba80c"
        );
        assert_eq!(
            key(&serde_json::json!({"b": [1, {"y": null, "x": 2.0}], "a": -0.0})),
            "send_email.32350556a0b40919a22778bfe3f2b593a4755b11d5aef0f4e33324f6d723418a"
        );
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

    fn parts(tool: &str) -> KeyParts<'_> {
        KeyParts {
            tenant: None,
            run_id: "run",
            call_id: None,
            tool,
        }
    }

    #[test]
    fn hash_map_order_does_not_matter() {
        let a: HashMap<String, u32> = (0..50).map(|i| (format!("k{i}"), i)).collect();
        let b: BTreeMap<String, u32> = (0..50).rev().map(|i| (format!("k{i}"), i)).collect();
        assert_eq!(
            Fingerprint::of(&parts("t"), &a).unwrap(),
            Fingerprint::of(&parts("t"), &b).unwrap()
        );
    }

    #[test]
    fn non_string_map_keys_are_a_typed_error() {
        let m: HashMap<(u8, u8), u8> = [((1, 2), 3)].into_iter().collect();
        let err = Fingerprint::of(&parts("tool_x"), &m).unwrap_err();
        assert!(
            matches!(err, Error::Input { ref tool, .. } if tool == "tool_x"),
            "{err}"
        );
    }

    proptest! {
        /// The label as characters: the last 64 of the name, each outside
        /// `[A-Za-z0-9_-]` replaced by `_`, and `_` for an empty name.
        #[test]
        fn labels_are_the_names_last_characters_with_odd_ones_replaced(
            tool in "[a-zA-Z0-9_:<> .é€😀\\-]{0,80}",
        ) {
            let chars: Vec<char> = tool.chars().collect();
            let mut expected: String = chars[chars.len().saturating_sub(LABEL_MAX)..]
                .iter()
                .map(|&c| match c {
                    'a'..='z' | 'A'..='Z' | '0'..='9' | '_' | '-' => c,
                    _ => '_',
                })
                .collect();
            if expected.is_empty() {
                expected.push('_');
            }
            prop_assert_eq!(Key::label_of(&tool), expected);
        }
    }

    #[test]
    fn key_text_is_short_printable_ascii() {
        let long_tool = "ü/".repeat(500);
        for tool in ["send_email", "", long_tool.as_str(), "a.b c"] {
            let key = Key::derive(&parts(tool), "x").unwrap();
            let s = key.as_str();
            assert!(s.len() <= 129, "{s}");
            assert!(s.bytes().all(|b| b.is_ascii_graphic()), "{s}");
        }
    }

    #[test]
    fn separators_in_parts_are_data() {
        // Fingerprints, not keys: a key's text also shows the tool, which would tell
        // some of these apart by itself.
        let k = |tenant, run_id, call_id, tool, input: u32| {
            let parts = KeyParts {
                tenant,
                run_id,
                call_id,
                tool,
            };
            Fingerprint::of(&parts, &input).unwrap()
        };
        assert_ne!(k(None, "a.b", None, "c", 1), k(None, "a", None, "b.c", 1));
        assert_ne!(k(Some(""), "a", None, "c", 1), k(None, "a", None, "c", 1));
        assert_ne!(k(Some("a"), "", None, "c", 1), k(None, "a", None, "c", 1));
        assert_ne!(k(None, "a", Some(""), "c", 1), k(None, "a", None, "c", 1));
        // The input follows the tool: without the tool's length, both would hash
        // `send12`.
        assert_ne!(
            k(None, "a", None, "send1", 2),
            k(None, "a", None, "send", 12)
        );
    }

    /// Reads an encoding back: the parts, and what follows them.
    fn decode(mut bytes: &[u8]) -> Option<([Option<String>; 4], &[u8])> {
        bytes = bytes.strip_prefix(VERSION)?;
        let mut parts: [Option<String>; 4] = Default::default();
        for part in &mut parts {
            let (&present, rest) = bytes.split_first()?;
            bytes = rest;
            if present == 0 {
                continue;
            }
            let (mut len, mut shift) = (0usize, 0);
            loop {
                let (&byte, rest) = bytes.split_first()?;
                bytes = rest;
                len |= usize::from(byte & 0x7f) << shift;
                shift += 7;
                if byte & 0x80 == 0 {
                    break;
                }
            }
            let (text, rest) = bytes.split_at_checked(len)?;
            *part = Some(String::from_utf8(text.to_vec()).ok()?);
            bytes = rest;
        }
        Some((parts, bytes))
    }

    proptest! {
        /// The encoding reads back to the same parts and leaves the input untouched, so
        /// no two calls encode alike. Lengths cross LEB128's one-, two- and three-byte
        /// boundaries (128 and 16 384).
        #[test]
        fn parts_encoding_reads_back(
            tenant in proptest::option::of("[a.é\\x00]{0,3}"),
            run_id in prop_oneof!["[a.\\x00]{0,200}", "a{16380,16390}"],
            call_id in proptest::option::of("[\\x00-\\x7f]{126,130}"),
            tool in "\\PC{0,4}",
            input in proptest::collection::vec(any::<u8>(), 0..40),
        ) {
            let parts = KeyParts {
                tenant: tenant.as_deref(),
                run_id: &run_id,
                call_id: call_id.as_deref(),
                tool: &tool,
            };
            let mut out = Vec::new();
            parts.encode(&mut out);
            out.extend_from_slice(&input);
            let (read, rest) = decode(&out).expect("the encoding reads back");
            prop_assert_eq!(read, [tenant, Some(run_id.clone()), call_id, Some(tool.clone())]);
            prop_assert_eq!(rest, &input[..]);
        }
    }
}
