//! The read-back check: an outcome is stored only if a retry reads it back as the value
//! the first caller got.
//!
//! Before an outcome is stored (a body's result, a cached error, a reconcile hook's
//! value), its JSON is read back into its type, and the value read back is compared
//! with the original: by the type's `PartialEq` where it has one, and by its JSON
//! (written again, and compared up to the order of map keys and sequence elements)
//! always. An outcome that fails is [`Error::Unreplayable`](crate::Error::Unreplayable)
//! at the call that ran, never a different value at every retry.
//!
//! The JSON comparison catches a result a retry could not read at all (a NaN, which
//! JSON writes as `null`; `skip_serializing_if` without `default`) and one it would
//! read as another value (an untagged enum whose variants overlap: `1` read as `1.0`).
//! `PartialEq` also catches a field the JSON never holds (`#[serde(skip_serializing,
//! default)]`, a `Serialize` that leaves a field out), which the JSON comparison
//! cannot see: the field is missing from both sides. Without `PartialEq` such a field
//! comes back as its default at every retry; implement `PartialEq` for the result
//! type, or serialize every field. Neither sees a value whose JSON is ambiguous in
//! both directions, such as `Some(())` in an `Option<()>` (both `Some(())` and `None`
//! are `null`) when the type has no `PartialEq`, nor a `Deserialize` that reorders a
//! sequence, since sequences are compared as unordered. A value that is not equal to
//! itself (a NaN inside, kept by a custom `Serialize`) is compared by its JSON only, as
//! is a generic `T` whose function does not require `T: PartialEq`.
//!
//! Whether a type has `PartialEq` is known only where its name is written, in the
//! attribute's generated code, which asks with [`Probe`] of the tool's return type
//! (autoref specialisation: a method found on `&Probe<Result<T, E>>` when `T:
//! PartialEq`, else on `Probe<R>`).

use std::marker::PhantomData;

use serde::de::DeserializeOwned;
use serde::Serialize;

/// How a value is compared with the value its JSON reads back as: by `PartialEq` (and
/// its JSON), or by its JSON only.
pub struct Equality<T>(Option<fn(&T, &T) -> bool>);

impl<T> Equality<T> {
    /// By its JSON only: for a type without `PartialEq`.
    pub const JSON: Self = Equality(None);
}

impl<T: PartialEq> Equality<T> {
    /// By `T`'s `PartialEq`, and by its JSON.
    pub fn partial_eq() -> Self {
        Equality(Some(<T as PartialEq>::eq))
    }
}

impl<T> Clone for Equality<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Equality<T> {}

/// [`Equality::JSON`] for a type the probe cannot name (the part of a return type that
/// is not a `Result`, or has no `PartialEq`).
#[derive(Clone, Copy, Debug)]
pub struct JsonOnly;

impl<T> From<JsonOnly> for Equality<T> {
    fn from(JsonOnly: JsonOnly) -> Self {
        Equality::JSON
    }
}

/// Asks whether the parts of a tool's return type `R` have `PartialEq`, in code that
/// names `R`:
///
/// ```
/// use idem_core::__private::{ErrByJson as _, ErrByPartialEq as _, OkByJson as _, OkByPartialEq as _, Equality, Probe};
/// # #[derive(PartialEq)] struct Receipt;
/// # struct Opaque;
/// let probe = &&Probe::<Result<Receipt, Opaque>>::new();
/// let ok: Equality<Receipt> = probe.ok().into();   // by `PartialEq`, then JSON
/// let err: Equality<Opaque> = probe.err().into();  // by JSON only
/// ```
///
/// An alias of `Result` is a `Result`; any other type is compared by JSON only (and
/// the attribute reports it as not a `Result` elsewhere).
pub struct Probe<R>(PhantomData<fn() -> R>);

impl<R> Probe<R> {
    /// A probe for `R`.
    pub const fn new() -> Self {
        Probe(PhantomData)
    }
}

impl<R> Default for Probe<R> {
    fn default() -> Self {
        Self::new()
    }
}

/// The probe's answer for a `Result` whose `Ok` type has `PartialEq` (found first, on
/// `&Probe<R>`).
pub trait OkByPartialEq<T> {
    /// [`Equality::partial_eq`] of the `Ok` type.
    fn ok(&self) -> Equality<T>;
}

impl<T: PartialEq, E> OkByPartialEq<T> for &Probe<Result<T, E>> {
    fn ok(&self) -> Equality<T> {
        Equality::partial_eq()
    }
}

/// The probe's answer for any other return type (found second, on `Probe<R>`).
pub trait OkByJson {
    /// [`JsonOnly`].
    fn ok(&self) -> JsonOnly;
}

impl<R> OkByJson for Probe<R> {
    fn ok(&self) -> JsonOnly {
        JsonOnly
    }
}

/// The probe's answer for a `Result` whose `Err` type has `PartialEq` (found first).
pub trait ErrByPartialEq<E> {
    /// [`Equality::partial_eq`] of the `Err` type.
    fn err(&self) -> Equality<E>;
}

impl<T, E: PartialEq> ErrByPartialEq<E> for &Probe<Result<T, E>> {
    fn err(&self) -> Equality<E> {
        Equality::partial_eq()
    }
}

/// The probe's answer for any other return type (found second).
pub trait ErrByJson {
    /// [`JsonOnly`].
    fn err(&self) -> JsonOnly;
}

impl<R> ErrByJson for Probe<R> {
    fn err(&self) -> JsonOnly {
        JsonOnly
    }
}

/// Whether `bytes`, the JSON of `value`, read back as `value` (see the module docs).
pub(crate) fn reads_back<T: Serialize + DeserializeOwned>(
    bytes: &[u8],
    value: &T,
    equality: Equality<T>,
) -> Result<(), serde_json::Error> {
    let back: T = serde_json::from_slice(bytes)?;
    same_json(bytes, &serde_json::to_vec(&back)?)?;
    match equality.0 {
        Some(eq) if eq(value, value) && !eq(&back, value) => Err(serde::de::Error::custom(
            "it reads back as another value: its JSON is the same, but its type's `PartialEq` \
             finds the value read back different from the original (a field its JSON does not \
             hold, `#[serde(skip_serializing)]` or a `Serialize` that leaves it out, comes \
             back as its default)",
        )),
        _ => Ok(()),
    }
}

/// Whether `again`, the JSON of a value read back from `bytes`, is the same JSON, up
/// to the order of map keys and of sequence elements. Not generic: one copy serves
/// every tool.
fn same_json(bytes: &[u8], again: &[u8]) -> Result<(), serde_json::Error> {
    if again == bytes {
        return Ok(());
    }
    // Maps are compared as maps, and sequences as sorted, by `Value`'s equality.
    let (stored, read): (serde_json::Value, serde_json::Value) = (
        serde_json::from_slice(bytes)?,
        serde_json::from_slice(again)?,
    );
    if sorted_sequences(stored) == sorted_sequences(read) {
        return Ok(());
    }
    let shown = |b: &[u8]| {
        let text = String::from_utf8_lossy(b);
        match text.char_indices().nth(120) {
            Some((i, _)) => format!("{}…", &text[..i]),
            None => text.into_owned(),
        }
    };
    Err(serde::de::Error::custom(format!(
        "it reads back as another value: {} was read back as {}",
        shown(bytes),
        shown(again)
    )))
}

/// `value` with every object's keys in sorted order and the elements of every sequence
/// in one order (by their JSON text, which sorted keys make the same whether or not
/// serde_json keeps insertion order).
fn sorted_sequences(value: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match value {
        Value::Array(items) => {
            let mut items: Vec<Value> = items.into_iter().map(sorted_sequences).collect();
            items.sort_by_cached_key(Value::to_string);
            Value::Array(items)
        }
        Value::Object(map) => {
            let mut entries: Vec<(String, Value)> = map
                .into_iter()
                .map(|(k, v)| (k, sorted_sequences(v)))
                .collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            Value::Object(entries.into_iter().collect())
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Charge {
        id: String,
        #[serde(skip_serializing, default)]
        amount: u64,
    }

    #[derive(Serialize, Deserialize)]
    struct Opaque {
        id: String,
    }

    #[test]
    // The probe's shape: a reference the compiler derefs to find the method, and a
    // conversion that is the identity for one of the two answers.
    #[allow(clippy::needless_borrow, clippy::useless_conversion)]
    fn the_probe_finds_partial_eq_where_the_type_has_it() {
        use super::{ErrByJson as _, ErrByPartialEq as _, OkByJson as _, OkByPartialEq as _};
        let ok = |e: Equality<Charge>| e.0.is_some();
        assert!(ok((&&Probe::<Result<Charge, Opaque>>::new()).ok().into()));
        let err = |e: Equality<Opaque>| e.0.is_some();
        assert!(!err((&&Probe::<Result<Charge, Opaque>>::new())
            .err()
            .into()));
        let opaque = |e: Equality<Opaque>| e.0.is_some();
        assert!(!opaque(
            (&&Probe::<Result<Opaque, Charge>>::new()).ok().into()
        ));
        assert!(ok((&&Probe::<Result<Opaque, Charge>>::new()).err().into()));
        // An alias of `Result` is a `Result`.
        type Answer<T> = Result<T, std::io::Error>;
        assert!(ok((&&Probe::<Answer<Charge>>::new()).ok().into()));
        // In generic code, only a bound in scope counts.
        fn generic<T>() -> bool {
            let e: Equality<T> = (&&Probe::<Result<T, ()>>::new()).ok().into();
            e.0.is_some()
        }
        fn bounded<T: PartialEq>() -> bool {
            let e: Equality<T> = (&&Probe::<Result<T, ()>>::new()).ok().into();
            e.0.is_some()
        }
        assert!(!generic::<Charge>());
        assert!(bounded::<Charge>());
    }

    #[test]
    fn a_field_the_json_never_holds_fails_by_partial_eq_only() {
        let charge = Charge {
            id: "ch_1".into(),
            amount: 4200,
        };
        let bytes = serde_json::to_vec(&charge).unwrap();
        let by_eq = reads_back(&bytes, &charge, Equality::partial_eq()).unwrap_err();
        assert!(by_eq.to_string().contains("PartialEq"), "{by_eq}");
        // By its JSON alone it passes: the field is missing from both sides.
        reads_back(&bytes, &charge, Equality::JSON).unwrap();
        // A default amount reads back as itself.
        let free = Charge {
            id: "ch_2".into(),
            amount: 0,
        };
        let bytes = serde_json::to_vec(&free).unwrap();
        reads_back(&bytes, &free, Equality::partial_eq()).unwrap();
    }

    #[test]
    fn a_value_not_equal_to_itself_is_compared_by_its_json() {
        #[derive(PartialEq, Serialize, Deserialize)]
        struct Ratio(#[serde(with = "as_text")] f64);
        mod as_text {
            pub fn serialize<S: serde::Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(&v.to_string())
            }
            pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
                let text: String = serde::Deserialize::deserialize(d)?;
                text.parse().map_err(serde::de::Error::custom)
            }
        }
        let nan = Ratio(f64::NAN);
        let bytes = serde_json::to_vec(&nan).unwrap();
        reads_back(&bytes, &nan, Equality::partial_eq()).unwrap();
    }
}
