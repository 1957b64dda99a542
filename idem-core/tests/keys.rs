//! Key derivation as property tests: distinct calls never share a key; equal inputs
//! always do, whatever their map order.

use std::collections::{BTreeMap, HashMap};

use idem_core::__private::Call;
use idem_core::store::{Fingerprint, KeyParts};
use idem_core::{Key, MemoryStore, Options, Run};
use proptest::prelude::*;
use sha2::{Digest, Sha256};

/// Short strings over an alphabet of separators, escapes and unicode, where accidental
/// collisions of a naive `a:b:c` encoding would be common.
fn part() -> impl Strategy<Value = String> {
    proptest::string::string_regex("[a.:/|\\\\\\x00é\"{}]{0,4}").unwrap()
}

#[derive(Debug, Clone, PartialEq)]
struct Parts {
    tenant: Option<String>,
    run_id: String,
    call_id: Option<String>,
    tool: String,
    input: Vec<String>,
}

fn parts() -> impl Strategy<Value = Parts> {
    (
        proptest::option::of(part()),
        part(),
        proptest::option::of(part()),
        part(),
        proptest::collection::vec(part(), 0..3),
    )
        .prop_map(|(tenant, run_id, call_id, tool, input)| Parts {
            tenant,
            run_id,
            call_id,
            tool,
            input,
        })
}

fn key(p: &Parts) -> Key {
    let parts = KeyParts {
        tenant: p.tenant.as_deref(),
        run_id: &p.run_id,
        call_id: p.call_id.as_deref(),
        tool: &p.tool,
    };
    Key::derive(&parts, &p.input).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn distinct_parts_give_distinct_keys(a in parts(), b in parts()) {
        prop_assume!(a != b);
        prop_assert_ne!(key(&a), key(&b));
    }

    #[test]
    fn keys_are_short_printable_ascii(p in parts()) {
        let k = key(&p);
        prop_assert!(k.as_str().len() <= 255);
        prop_assert!(k.as_str().bytes().all(|b| b.is_ascii_graphic()));
    }

    #[test]
    fn equal_maps_give_equal_keys_in_any_order(entries in proptest::collection::vec((part(), any::<i64>()), 0..20)) {
        let forward: HashMap<String, i64> = entries.iter().cloned().collect();
        // Same contents, built in the opposite order (a different hasher seed, too).
        let mut backward: HashMap<String, i64> = HashMap::new();
        for (k, _) in entries.iter().rev() {
            backward.insert(k.clone(), forward[k]);
        }
        let sorted: BTreeMap<String, i64> = forward.clone().into_iter().collect();
        let fp = |v: &dyn erased::Ser| v.fingerprint();
        prop_assert_eq!(fp(&forward), fp(&backward));
        prop_assert_eq!(fp(&forward), fp(&sorted));
    }
}

/// Lets the property above fingerprint maps of different types through one closure.
mod erased {
    pub trait Ser {
        fn fingerprint(&self) -> idem_core::store::Fingerprint;
    }
    impl<T: serde::Serialize> Ser for T {
        fn fingerprint(&self) -> idem_core::store::Fingerprint {
            let parts = idem_core::store::KeyParts {
                tenant: None,
                run_id: "run",
                call_id: None,
                tool: "t",
            };
            idem_core::store::Fingerprint::of(&parts, self).unwrap()
        }
    }
}

/// Keys are stored: a key that changes between versions orphans every stored record,
/// and retries after an upgrade run again. These pinned values may change only with a
/// new key version (`idem/key/v3`) and a migration note.
#[test]
fn keys_are_stable_across_versions() {
    let input = serde_json::json!({
        "to": "ada@example.com",
        "body": "line one\nline \"two\"\t\\ é \u{1}",
        "n": [1, 1.5, -0.0, 1e300],
        "nested": {"b": true, "a": null},
    });
    let parts = KeyParts {
        tenant: Some("acme"),
        run_id: "run-42",
        call_id: None,
        tool: "send_email",
    };
    let key = Key::derive(&parts, &input).unwrap();
    assert_eq!(
        key.as_str(),
        "send_email.16504c3d38661d98ecf349a409c1a4f71a558ee444231becaaf29078ba18a42f"
    );
    // The same digest by hand: SHA-256 of the version, each part presence-tagged and
    // length-prefixed, then the input's canonical JSON, written out.
    let canonical = r#"{"body":"line one\nline \"two\"\t\\ é \u0001","n":[1,1.5,0,1e+300],"nested":{"a":null,"b":true},"to":"ada@example.com"}"#;
    let mut encoding = b"idem/key/v2\x01\x04acme\x01\x06run-42\x00\x01\x0asend_email".to_vec();
    encoding.extend_from_slice(canonical.as_bytes());
    let by_hand = Fingerprint::from_bytes(Sha256::digest(&encoding).into());
    assert_eq!(key, Key::of("send_email", &by_hand));
}

/// A call whose key covers the whole input hashes once: its key's digest is the
/// fingerprint its record stores. A key from part of the input is another digest,
/// while the fingerprint still covers all of it; another run is another call.
#[test]
fn the_default_keys_digest_is_the_whole_input_fingerprint() {
    let run = Run::new("run").with_store(MemoryStore::new());
    let input = ("ada@example.com", 1);
    let text = |fingerprint: &Fingerprint| {
        let hex: String = fingerprint
            .as_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        format!("send_email.{hex}")
    };
    let call = Call::new(Some(&run), "send_email", Options::new(), &input).unwrap();
    assert_eq!(call.key().as_str(), text(call.fingerprint()));

    let keyed = Call::with_key(Some(&run), "send_email", Options::new(), &input, &input.0).unwrap();
    assert_eq!(keyed.fingerprint(), call.fingerprint());
    assert_ne!(keyed.key(), call.key());
    assert_ne!(keyed.key().as_str(), text(keyed.fingerprint()));

    let other = Run::new("run2").with_store(MemoryStore::new());
    let elsewhere = Call::new(Some(&other), "send_email", Options::new(), &input).unwrap();
    assert_ne!(elsewhere.fingerprint(), call.fingerprint());
}
