//! The canonical JSON writer: one serde `Serializer` that writes an input straight into
//! a byte buffer in the form [`key`](crate::key) documents, with no intermediate value
//! tree.
//!
//! Maps and structs are the only places that buffer: their entries are written in
//! place, then sorted by key and rewritten. Everything else streams.

use std::cell::RefCell;
use std::ops::Range;

use serde::ser::{self, Error as _, Impossible, Serialize};
use serde_json::Error;

/// Largest integer a double represents exactly; integral floats below it are written
/// as integers so `1.0` and `1` are one number.
const EXACT_INT: f64 = 9_007_199_254_740_992.0;

/// How deep arrays and objects may nest. Deeper input is an error rather than a stack
/// overflow (serde_json's parser stops at the same depth).
const MAX_DEPTH: u32 = 128;

/// A per-thread buffer bigger than this (after a large input) is given back rather than
/// kept for the next call.
pub(crate) const SCRATCH_KEEP: usize = 256 * 1024;

/// The buffers objects are sorted with, reused by every input written on a thread, so
/// steady-state writing allocates nothing.
struct Scratch {
    /// The entries of the objects being written, innermost last: each object's
    /// entries sit above its parent's and are gone before the parent's next entry.
    entries: Vec<Entry>,
    /// The copy an object is rewritten from.
    tail: Vec<u8>,
}

/// An object entry: where its key text and its canonical value were written, and the
/// key's [`head`].
struct Entry {
    key: Range<usize>,
    value: Range<usize>,
    head: u64,
}

/// A key's first eight bytes as a big-endian number, zeros past its end. Two keys
/// whose heads differ are in the order of their heads, since a byte that differs within
/// the first eight decides both orders alike (a key that ends there reads as zeros,
/// and sorts first either way); keys with equal heads are compared whole. Most keys
/// differ within eight bytes, so sorting an object's entries seldom reads their text.
fn head(key: &[u8]) -> u64 {
    match key.first_chunk::<8>() {
        Some(first) => u64::from_be_bytes(*first),
        // Shifted in, then up into place (a copy into an array of eight would call
        // `memcpy` for a length known only here).
        None => key
            .iter()
            .fold(0u64, |h, &b| (h << 8) | u64::from(b))
            .checked_shl(8 * (8 - key.len() as u32))
            .unwrap_or(0),
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = const {
        RefCell::new(Scratch { entries: Vec::new(), tail: Vec::new() })
    };
}

/// Writes `value` canonically at the end of `out`.
pub(crate) fn write<T: Serialize + ?Sized>(out: &mut Vec<u8>, value: &T) -> Result<(), Error> {
    with_scratch(&mut Writing { out, value })
}

/// A value to write, and where: what [`with_scratch`] runs, through a trait of one
/// method so that each type's part is one function.
struct Writing<'a, T: ?Sized> {
    out: &'a mut Vec<u8>,
    value: &'a T,
}

trait WriteWith {
    fn write_with(&mut self, scratch: &mut Scratch) -> Result<(), Error>;
}

impl<T: Serialize + ?Sized> WriteWith for Writing<'_, T> {
    fn write_with(&mut self, scratch: &mut Scratch) -> Result<(), Error> {
        self.value.serialize(Canonical {
            out: &mut *self.out,
            scratch,
            depth: 0,
        })
    }
}

/// Runs `writing` with this thread's scratch buffers (fresh ones if they are in use: a
/// `Serialize` impl that writes canonical JSON itself). Not generic: one copy serves
/// every input type.
fn with_scratch(writing: &mut dyn WriteWith) -> Result<(), Error> {
    let mut run = |scratch: &mut Scratch| {
        // A write that failed half-way may have left entries behind.
        scratch.entries.clear();
        let written = writing.write_with(scratch);
        if scratch.tail.capacity() > SCRATCH_KEEP {
            scratch.tail = Vec::new();
        }
        written
    };
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut scratch) => run(&mut scratch),
        Err(_) => run(&mut Scratch {
            entries: Vec::new(),
            tail: Vec::new(),
        }),
    })
}

/// The serializer: where to write, the thread's scratch buffers, and how deep the value
/// being written is nested.
struct Canonical<'a> {
    out: &'a mut Vec<u8>,
    scratch: &'a mut Scratch,
    depth: u32,
}

/// The depth inside a new array or object, or an error past [`MAX_DEPTH`].
fn enter(depth: u32) -> Result<u32, Error> {
    if depth >= MAX_DEPTH {
        Err(Error::custom(format!(
            "input nested deeper than {MAX_DEPTH} levels"
        )))
    } else {
        Ok(depth + 1)
    }
}

/// Writes `s` as a JSON string, escaped exactly as serde_json escapes it (`\"`, `\\`,
/// `\b \f \n \r \t`, other control characters as `\u00xx`; nothing else), so the
/// canonical form is serde_json's. Runs that need no escaping are found by
/// [`clean_prefix_len`] and copied whole. Works on bytes: UTF-8 puts no byte below 0x80
/// inside a multi-byte character, so escaping never splits one.
fn write_str(out: &mut Vec<u8>, bytes: &[u8]) {
    out.reserve(bytes.len() + 2);
    out.push(b'"');
    let mut rest = bytes;
    loop {
        let clean = clean_prefix_len(rest);
        out.extend_from_slice(&rest[..clean]);
        match rest.get(clean..) {
            Some([b, after @ ..]) => {
                write_escape(out, *b);
                rest = after;
            }
            _ => break,
        }
    }
    out.push(b'"');
}

fn needs_escape(b: u8) -> bool {
    b < 0x20 || b == b'"' || b == b'\\'
}

/// How many bytes at the start of `bytes` need no escaping. Checks 16 bytes at a time
/// with a fold that never stops early, which the compiler turns into vector compares;
/// then the rest, and the 16 bytes that hold an escape, one byte at a time: faster on
/// the benchmark's strings than checking eight bytes at a time with bit tricks.
fn clean_prefix_len(bytes: &[u8]) -> usize {
    const CHUNK: usize = 16;
    let mut n = 0;
    for chunk in bytes.chunks_exact(CHUNK) {
        let any = chunk.iter().fold(false, |any, &b| {
            any | (b < 0x20) | (b == b'"') | (b == b'\\')
        });
        if any {
            break;
        }
        n += CHUNK;
    }
    n + bytes[n..]
        .iter()
        .position(|&b| needs_escape(b))
        .unwrap_or(bytes.len() - n)
}

fn write_escape(out: &mut Vec<u8>, b: u8) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let short = match b {
        b'"' => b'"',
        b'\\' => b'\\',
        0x08 => b'b',
        0x0c => b'f',
        b'\n' => b'n',
        b'\r' => b'r',
        b'\t' => b't',
        _ => {
            let hex = [HEX[usize::from(b >> 4)], HEX[usize::from(b & 0xf)]];
            out.extend_from_slice(b"\\u00");
            out.extend_from_slice(&hex);
            return;
        }
    };
    out.extend_from_slice(&[b'\\', short]);
}

fn write_int(out: &mut Vec<u8>, v: impl itoa::Integer) {
    out.extend_from_slice(itoa::Buffer::new().format(v).as_bytes());
}

fn write_f64(out: &mut Vec<u8>, f: f64) -> Result<(), Error> {
    if f.is_nan() {
        // Bare tokens no JSON value can produce: a non-finite float never shares a
        // fingerprint with `null`, with a string, or with another non-finite float.
        out.extend_from_slice(b"NaN");
        Ok(())
    } else if f.is_infinite() {
        out.extend_from_slice(if f > 0.0 { b"Infinity" } else { b"-Infinity" });
        Ok(())
    } else if f.fract() == 0.0 && f.abs() < EXACT_INT {
        write_int(out, f as i64);
        Ok(())
    } else {
        serde_json::to_writer(out, &f)
    }
}

/// `{"variant":` — the opening of an externally tagged enum variant.
fn open_variant(out: &mut Vec<u8>, variant: &str) {
    out.push(b'{');
    write_str(out, variant.as_bytes());
    out.push(b':');
}

impl<'a> ser::Serializer for Canonical<'a> {
    type Ok = ();
    type Error = Error;
    type SerializeSeq = Seq<'a>;
    type SerializeTuple = Seq<'a>;
    type SerializeTupleStruct = Seq<'a>;
    type SerializeTupleVariant = Seq<'a>;
    type SerializeMap = Map<'a>;
    type SerializeStruct = Map<'a>;
    type SerializeStructVariant = Map<'a>;

    fn serialize_bool(self, v: bool) -> Result<(), Error> {
        self.out
            .extend_from_slice(if v { b"true" } else { b"false" });
        Ok(())
    }
    fn serialize_i8(self, v: i8) -> Result<(), Error> {
        write_int(self.out, v);
        Ok(())
    }
    fn serialize_i16(self, v: i16) -> Result<(), Error> {
        write_int(self.out, v);
        Ok(())
    }
    fn serialize_i32(self, v: i32) -> Result<(), Error> {
        write_int(self.out, v);
        Ok(())
    }
    fn serialize_i64(self, v: i64) -> Result<(), Error> {
        write_int(self.out, v);
        Ok(())
    }
    /// Every `i128` is written in full, as serde_json writes it; values that fit an
    /// `i64` or `u64` write exactly as those do, so their keys are unchanged.
    fn serialize_i128(self, v: i128) -> Result<(), Error> {
        write_int(self.out, v);
        Ok(())
    }
    fn serialize_u8(self, v: u8) -> Result<(), Error> {
        write_int(self.out, v);
        Ok(())
    }
    fn serialize_u16(self, v: u16) -> Result<(), Error> {
        write_int(self.out, v);
        Ok(())
    }
    fn serialize_u32(self, v: u32) -> Result<(), Error> {
        write_int(self.out, v);
        Ok(())
    }
    fn serialize_u64(self, v: u64) -> Result<(), Error> {
        write_int(self.out, v);
        Ok(())
    }
    /// Every `u128` is written in full, as serde_json writes it (see `serialize_i128`).
    fn serialize_u128(self, v: u128) -> Result<(), Error> {
        write_int(self.out, v);
        Ok(())
    }
    fn serialize_f32(self, v: f32) -> Result<(), Error> {
        write_f64(self.out, f64::from(v))
    }
    fn serialize_f64(self, v: f64) -> Result<(), Error> {
        write_f64(self.out, v)
    }
    fn serialize_char(self, v: char) -> Result<(), Error> {
        write_str(self.out, v.encode_utf8(&mut [0u8; 4]).as_bytes());
        Ok(())
    }
    fn serialize_str(self, v: &str) -> Result<(), Error> {
        write_str(self.out, v.as_bytes());
        Ok(())
    }
    fn serialize_bytes(self, v: &[u8]) -> Result<(), Error> {
        self.out.push(b'[');
        for (i, b) in v.iter().enumerate() {
            if i > 0 {
                self.out.push(b',');
            }
            write_int(self.out, *b);
        }
        self.out.push(b']');
        Ok(())
    }
    fn serialize_none(self) -> Result<(), Error> {
        self.serialize_unit()
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<(), Error> {
        value.serialize(self)
    }
    fn serialize_unit(self) -> Result<(), Error> {
        self.out.extend_from_slice(b"null");
        Ok(())
    }
    fn serialize_unit_struct(self, _: &'static str) -> Result<(), Error> {
        self.serialize_unit()
    }
    fn serialize_unit_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
    ) -> Result<(), Error> {
        write_str(self.out, variant.as_bytes());
        Ok(())
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        value: &T,
    ) -> Result<(), Error> {
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<(), Error> {
        let depth = enter(self.depth)?;
        open_variant(self.out, variant);
        value.serialize(Canonical {
            out: &mut *self.out,
            scratch: &mut *self.scratch,
            depth,
        })?;
        self.out.push(b'}');
        Ok(())
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Seq<'a>, Error> {
        Seq::new(self, false)
    }
    fn serialize_tuple(self, len: usize) -> Result<Seq<'a>, Error> {
        self.serialize_seq(Some(len))
    }
    fn serialize_tuple_struct(self, _: &'static str, len: usize) -> Result<Seq<'a>, Error> {
        self.serialize_seq(Some(len))
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _: usize,
    ) -> Result<Seq<'a>, Error> {
        open_variant(self.out, variant);
        Seq::new(self, true)
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Map<'a>, Error> {
        Map::new(self, false)
    }
    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Map<'a>, Error> {
        Map::new(self, false)
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _: usize,
    ) -> Result<Map<'a>, Error> {
        open_variant(self.out, variant);
        Map::new(self, true)
    }
}

/// Arrays (and tuples, and tuple variants): streamed.
struct Seq<'a> {
    out: &'a mut Vec<u8>,
    scratch: &'a mut Scratch,
    depth: u32,
    first: bool,
    close_variant: bool,
}

impl<'a> Seq<'a> {
    fn new(into: Canonical<'a>, close_variant: bool) -> Result<Self, Error> {
        let depth = enter(into.depth)?;
        into.out.push(b'[');
        Ok(Seq {
            out: into.out,
            scratch: into.scratch,
            depth,
            first: true,
            close_variant,
        })
    }
    fn element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        if !self.first {
            self.out.push(b',');
        }
        self.first = false;
        value.serialize(Canonical {
            out: &mut *self.out,
            scratch: &mut *self.scratch,
            depth: self.depth,
        })
    }
    fn finish(self) -> Result<(), Error> {
        self.out.push(b']');
        if self.close_variant {
            self.out.push(b'}');
        }
        Ok(())
    }
}

impl ser::SerializeSeq for Seq<'_> {
    type Ok = ();
    type Error = Error;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        self.element(value)
    }
    fn end(self) -> Result<(), Error> {
        self.finish()
    }
}

impl ser::SerializeTuple for Seq<'_> {
    type Ok = ();
    type Error = Error;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        self.element(value)
    }
    fn end(self) -> Result<(), Error> {
        self.finish()
    }
}

impl ser::SerializeTupleStruct for Seq<'_> {
    type Ok = ();
    type Error = Error;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        self.element(value)
    }
    fn end(self) -> Result<(), Error> {
        self.finish()
    }
}

impl ser::SerializeTupleVariant for Seq<'_> {
    type Ok = ();
    type Error = Error;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        self.element(value)
    }
    fn end(self) -> Result<(), Error> {
        self.finish()
    }
}

/// Objects (maps, structs, struct variants): entries are written raw after `start`
/// (key text unquoted, then the canonical value), then sorted by key and rewritten.
struct Map<'a> {
    out: &'a mut Vec<u8>,
    scratch: &'a mut Scratch,
    depth: u32,
    start: usize,
    /// Where this object's entries begin on the scratch entry stack.
    base: usize,
    key: Option<Range<usize>>,
    close_variant: bool,
}

impl<'a> Map<'a> {
    fn new(into: Canonical<'a>, close_variant: bool) -> Result<Self, Error> {
        let depth = enter(into.depth)?;
        Ok(Map {
            start: into.out.len(),
            base: into.scratch.entries.len(),
            out: into.out,
            scratch: into.scratch,
            depth,
            key: None,
            close_variant,
        })
    }

    fn raw_key(&mut self, key: &str) {
        let at = self.out.len();
        self.out.extend_from_slice(key.as_bytes());
        self.key = Some(at..self.out.len());
    }

    fn value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        let key = self
            .key
            .take()
            .ok_or_else(|| Error::custom("map value without a key"))?;
        let at = self.out.len();
        value.serialize(Canonical {
            out: &mut *self.out,
            scratch: &mut *self.scratch,
            depth: self.depth,
        })?;
        let end = self.out.len();
        let head = head(&self.out[key.clone()]);
        self.scratch.entries.push(Entry {
            key,
            value: at..end,
            head,
        });
        Ok(())
    }

    fn finish(self) -> Result<(), Error> {
        let Map {
            out,
            scratch: Scratch { entries, tail },
            start,
            base,
            close_variant,
            ..
        } = self;
        let mine = entries.get_mut(base..).unwrap_or_default();
        tail.clear();
        tail.extend_from_slice(&out[start..]);
        let bytes = |r: &Range<usize>| &tail[r.start - start..r.end - start];
        // Stable: a map that writes a key twice keeps both, in the order written.
        mine.sort_by(|a, b| {
            a.head
                .cmp(&b.head)
                .then_with(|| bytes(&a.key).cmp(bytes(&b.key)))
        });
        out.truncate(start);
        out.push(b'{');
        for (i, entry) in mine.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            write_str(out, bytes(&entry.key));
            out.push(b':');
            out.extend_from_slice(bytes(&entry.value));
        }
        out.push(b'}');
        if close_variant {
            out.push(b'}');
        }
        entries.truncate(base);
        Ok(())
    }
}

impl ser::SerializeMap for Map<'_> {
    type Ok = ();
    type Error = Error;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), Error> {
        let at = self.out.len();
        key.serialize(KeyText(&mut *self.out))?;
        self.key = Some(at..self.out.len());
        Ok(())
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        self.value(value)
    }
    fn end(self) -> Result<(), Error> {
        self.finish()
    }
}

impl ser::SerializeStruct for Map<'_> {
    type Ok = ();
    type Error = Error;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<(), Error> {
        self.raw_key(key);
        self.value(value)
    }
    fn end(self) -> Result<(), Error> {
        self.finish()
    }
}

impl ser::SerializeStructVariant for Map<'_> {
    type Ok = ();
    type Error = Error;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<(), Error> {
        self.raw_key(key);
        self.value(value)
    }
    fn end(self) -> Result<(), Error> {
        self.finish()
    }
}

/// A map key as text, appended raw, as serde_json accepts keys: strings, chars,
/// integers, finite floats, bools, unit variants and newtypes of those. Anything else
/// is an error.
struct KeyText<'a>(&'a mut Vec<u8>);

fn key_must_be_a_string() -> Error {
    Error::custom("key must be a string")
}

macro_rules! int_keys {
    ($($f:ident: $t:ty),*) => {$(
        fn $f(self, v: $t) -> Result<(), Error> {
            write_int(self.0, v);
            Ok(())
        }
    )*};
}

impl ser::Serializer for KeyText<'_> {
    type Ok = ();
    type Error = Error;
    type SerializeSeq = Impossible<(), Error>;
    type SerializeTuple = Impossible<(), Error>;
    type SerializeTupleStruct = Impossible<(), Error>;
    type SerializeTupleVariant = Impossible<(), Error>;
    type SerializeMap = Impossible<(), Error>;
    type SerializeStruct = Impossible<(), Error>;
    type SerializeStructVariant = Impossible<(), Error>;

    int_keys!(serialize_i8: i8, serialize_i16: i16, serialize_i32: i32, serialize_i64: i64,
        serialize_i128: i128, serialize_u8: u8, serialize_u16: u16, serialize_u32: u32,
        serialize_u64: u64, serialize_u128: u128);

    fn serialize_bool(self, v: bool) -> Result<(), Error> {
        self.0.extend_from_slice(if v { b"true" } else { b"false" });
        Ok(())
    }
    fn serialize_f32(self, v: f32) -> Result<(), Error> {
        self.serialize_f64(f64::from(v))
    }
    fn serialize_f64(self, v: f64) -> Result<(), Error> {
        if v.is_finite() {
            serde_json::to_writer(self.0, &v)
        } else {
            Err(Error::custom("float key must be finite"))
        }
    }
    fn serialize_char(self, v: char) -> Result<(), Error> {
        self.0
            .extend_from_slice(v.encode_utf8(&mut [0u8; 4]).as_bytes());
        Ok(())
    }
    fn serialize_str(self, v: &str) -> Result<(), Error> {
        self.0.extend_from_slice(v.as_bytes());
        Ok(())
    }
    fn serialize_unit_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
    ) -> Result<(), Error> {
        self.serialize_str(variant)
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        value: &T,
    ) -> Result<(), Error> {
        value.serialize(self)
    }
    fn serialize_bytes(self, _: &[u8]) -> Result<(), Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_none(self) -> Result<(), Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_some<T: Serialize + ?Sized>(self, _: &T) -> Result<(), Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_unit(self) -> Result<(), Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_unit_struct(self, _: &'static str) -> Result<(), Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: &T,
    ) -> Result<(), Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Self::SerializeSeq, Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_tuple(self, _: usize) -> Result<Self::SerializeTuple, Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_tuple_struct(
        self,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleStruct, Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleVariant, Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Self::SerializeMap, Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Self::SerializeStruct, Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeStructVariant, Error> {
        Err(key_must_be_a_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn string(s: &str) -> String {
        let mut out = Vec::new();
        write_str(&mut out, s.as_bytes());
        String::from_utf8(out).unwrap()
    }

    /// A `Serialize` impl that breaks serde's contract: a key written twice with no
    /// value between keeps the second, and a key never given a value is dropped, as
    /// serde_json's own `Value` serializer does.
    #[test]
    fn a_key_without_a_value_is_dropped() {
        use serde::ser::SerializeMap;
        struct Odd(&'static [&'static str]);
        impl Serialize for Odd {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                let mut map = s.serialize_map(None)?;
                for step in self.0 {
                    match step.strip_prefix('=') {
                        Some(value) => map.serialize_value(value)?,
                        None => map.serialize_key(step)?,
                    }
                }
                map.end()
            }
        }
        let canon = |steps| {
            let mut out = Vec::new();
            write(&mut out, &Odd(steps)).unwrap();
            String::from_utf8(out).unwrap()
        };
        assert_eq!(canon(&["b", "=1", "a", "=2"]), r#"{"a":"2","b":"1"}"#);
        assert_eq!(canon(&["b", "a", "=2"]), r#"{"a":"2"}"#);
        assert_eq!(canon(&["b", "=1", "\n", "a", "=2"]), r#"{"a":"2","b":"1"}"#);
        assert_eq!(canon(&["b", "=1", "a"]), r#"{"b":"1"}"#);
        assert_eq!(canon(&["a"]), "{}");
        assert_eq!(canon(&["z", "=1", "y", "=2", "x"]), r#"{"y":"2","z":"1"}"#);
    }

    #[test]
    fn strings_are_escaped_as_serde_json_escapes_them() {
        // Every ASCII byte (so every one that needs escaping, and those either side of
        // each class boundary) at every offset of an 8-byte word.
        for b in 0u8..0x80 {
            let c = char::from(b);
            for at in 0..17 {
                let s: String = "abcdefghijklmnopq"
                    .chars()
                    .take(at)
                    .chain([c, 'é', c])
                    .collect();
                assert_eq!(string(&s), serde_json::to_string(&s).unwrap(), "{s:?}");
            }
        }
    }

    proptest! {
        #[test]
        fn any_string_is_escaped_as_serde_json_escapes_it(s in "(?s).{0,80}") {
            prop_assert_eq!(string(&s), serde_json::to_string(&s).unwrap());
        }

        #[test]
        fn control_heavy_strings_are_escaped_as_serde_json_escapes_them(
            s in "[\\x00-\\x21\"\\\\a-z\\x7f-\\u{10ffff}]{0,40}"
        ) {
            prop_assert_eq!(string(&s), serde_json::to_string(&s).unwrap());
        }
    }

    #[test]
    fn a_failed_serialization_leaves_nothing_behind_for_the_next() {
        #[derive(serde::Serialize)]
        struct Outer {
            z: u8,
            bad: HashMap<(u8, u8), u8>,
        }
        #[derive(serde::Serialize)]
        struct Good {
            b: u8,
            a: Vec<Vec<u8>>,
        }
        let bad = Outer {
            z: 1,
            bad: [((1, 2), 3)].into(),
        };
        let good = Good {
            b: 2,
            a: vec![vec![1]],
        };
        for _ in 0..3 {
            assert!(write(&mut Vec::new(), &bad).is_err());
            let mut out = Vec::new();
            write(&mut out, &good).unwrap();
            assert_eq!(out, br#"{"a":[[1]],"b":2}"#);
        }
    }

    #[test]
    fn every_integer_is_written_as_serde_json_writes_it() {
        let check = |v: &dyn erased::Int| {
            let mut out = Vec::new();
            v.write(&mut out).unwrap();
            assert_eq!(out, v.json(), "{}", String::from_utf8_lossy(&out));
        };
        for v in [
            0,
            5,
            u128::from(u64::MAX),
            u128::from(u64::MAX) + 1,
            u128::MAX,
        ] {
            check(&v);
        }
        for v in [
            i128::MIN,
            i128::from(i64::MIN) - 1,
            i128::from(i64::MIN),
            -5,
            i128::from(u64::MAX),
            i128::MAX,
        ] {
            check(&v);
        }
        // Values that fit 64 bits write alike whatever their width: keys are unchanged.
        let narrow = |v: &dyn erased::Int| {
            let mut out = Vec::new();
            v.write(&mut out).unwrap();
            out
        };
        assert_eq!(narrow(&5u128), narrow(&5u64));
        assert_eq!(narrow(&-5i128), narrow(&-5i64));
    }

    mod erased {
        pub trait Int {
            fn write(&self, out: &mut Vec<u8>) -> Result<(), serde_json::Error>;
            fn json(&self) -> Vec<u8>;
        }
        impl<T: serde::Serialize> Int for T {
            fn write(&self, out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
                super::write(out, self)
            }
            fn json(&self) -> Vec<u8> {
                serde_json::to_vec(self).unwrap()
            }
        }
    }

    #[test]
    fn nesting_is_bounded_and_the_bound_is_per_input() {
        fn nested(depth: u32) -> serde_json::Value {
            (0..depth).fold(serde_json::json!(1), |v, _| serde_json::json!([v]))
        }
        assert!(write(&mut Vec::new(), &nested(MAX_DEPTH)).is_ok());
        for _ in 0..3 {
            let err = write(&mut Vec::new(), &nested(MAX_DEPTH + 1)).unwrap_err();
            assert!(err.to_string().contains("nested deeper"), "{err}");
        }
        assert!(write(&mut Vec::new(), &nested(MAX_DEPTH)).is_ok());
    }
}
