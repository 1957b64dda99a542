//! Bad input and hostile data: each case is a typed error or a documented behaviour,
//! never a panic, and nothing else in the store is damaged.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem_core::__private::{execute, Call, ReleaseErrors};
use idem_core::store::{Fingerprint, KeyParts, State, DEFAULT_MAX_RESULT_BYTES};
use idem_core::{Error, MemoryStore, Options, Run, SledStore, Store};

/// Runs `tool` with `input` in `run`; the body counts its runs and returns `output`.
async fn call<I: serde::Serialize>(
    run: &Run,
    options: Options,
    input: &I,
    runs: &AtomicUsize,
    output: String,
) -> Result<String, Error> {
    let call = Call::new(Some(run), "tool", options, input);
    execute::<Result<String, Error>, ReleaseErrors, _>(call, async move {
        runs.fetch_add(1, Ordering::SeqCst);
        Ok(output)
    })
    .await?
}

fn big_result() -> String {
    "x".repeat(DEFAULT_MAX_RESULT_BYTES + 1)
}

#[tokio::test]
async fn a_result_over_the_store_limit_is_a_typed_error_and_is_not_stored() {
    let dir = tempfile::tempdir().unwrap();
    for store in [
        Arc::new(MemoryStore::new()) as Arc<dyn Store>,
        Arc::new(SledStore::open(dir.path()).unwrap()),
    ] {
        let run = Run::new("run-big").with_shared_store(store.clone());
        let runs = AtomicUsize::new(0);
        // A neighbour record that must survive untouched.
        call(&run, Options::new(), &"small", &runs, "ok".into())
            .await
            .unwrap();

        let err = call(&run, Options::new(), &"big", &runs, big_result())
            .await
            .unwrap_err();
        let Error::ResultTooLarge {
            size,
            limit,
            ref key,
        } = err
        else {
            panic!("expected ResultTooLarge, got {err}");
        };
        assert_eq!(limit, DEFAULT_MAX_RESULT_BYTES);
        assert_eq!(size, DEFAULT_MAX_RESULT_BYTES + 3, "the JSON string's size");
        assert!(err.to_string().contains("not stored"), "{err}");
        // At-least-once: nothing stored, the key released, so a retry runs again.
        let key = idem_core::Key::from_text(key.as_str());
        assert!(store.get(&key).await.unwrap().is_none());
        call(&run, Options::new(), &"big", &runs, "smaller now".into())
            .await
            .unwrap();
        assert_eq!(runs.load(Ordering::SeqCst), 3);
        // The neighbour is intact and replayed.
        assert_eq!(
            call(&run, Options::new(), &"small", &runs, "other".into())
                .await
                .unwrap(),
            "ok"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 3);
    }
}

#[tokio::test]
async fn an_unstorable_result_under_at_most_once_is_never_run_twice() {
    let run = Run::new("run-big-amo").with_store(MemoryStore::new());
    let runs = AtomicUsize::new(0);
    let options = Options::new().at_most_once().lease(Duration::from_secs(60));
    let err = call(&run, options, &"big", &runs, big_result())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::ResultTooLarge { .. }), "{err}");
    // The outcome is recorded as unknown: the retry is told so at once, without waiting
    // out the minute-long lease.
    let started = std::time::Instant::now();
    let err = call(&run, options, &"big", &runs, "retry".into())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::OutcomeUnknown { .. }), "{err}");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_ten_mib_input_is_keyed_and_replayed() {
    let run = Run::new("run-10mib").with_store(MemoryStore::new());
    let runs = AtomicUsize::new(0);
    let input = "y".repeat(10 << 20);
    let first = call(&run, Options::new(), &input, &runs, "done".into())
        .await
        .unwrap();
    let again = call(&run, Options::new(), &input, &runs, "again".into())
        .await
        .unwrap();
    assert_eq!((first.as_str(), again.as_str()), ("done", "done"));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // One byte more is another input.
    let longer = format!("{input}y");
    call(&run, Options::new(), &longer, &runs, "longer".into())
        .await
        .unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[test]
fn maps_with_integer_keys_are_canonical_and_other_keys_are_typed_errors() {
    let fp = |v: &dyn erased::Input| v.fingerprint();
    // Integer keys: JSON object keys, sorted as text, whatever the map's order.
    let hash: HashMap<u32, &str> = [(10, "a"), (9, "b"), (100, "c")].into();
    let btree: BTreeMap<u32, &str> = [(100, "c"), (9, "b"), (10, "a")].into();
    assert_eq!(fp(&hash).unwrap(), fp(&btree).unwrap());
    // ...and the same as the string-keyed map they print as.
    let strings: BTreeMap<&str, &str> = [("10", "a"), ("9", "b"), ("100", "c")].into();
    assert_eq!(fp(&hash).unwrap(), fp(&strings).unwrap());

    // Keys JSON cannot express: a typed error, never a shared fingerprint.
    let tuples: HashMap<(u8, u8), u8> = [((1, 2), 3)].into();
    assert!(matches!(fp(&tuples), Err(Error::Input { .. })));
    let lists: BTreeMap<Vec<u8>, u8> = [(vec![1], 1)].into();
    assert!(matches!(fp(&lists), Err(Error::Input { .. })));
    let nan_key: Vec<(f64, u8)> = vec![(f64::NAN, 1)];
    assert!(
        fp(&nan_key).is_ok(),
        "a NaN inside a list is a value, not a key"
    );
}

#[test]
fn non_finite_floats_never_share_a_fingerprint() {
    let of = |v: Option<f64>| Fingerprint::of(&PARTS, &v).unwrap();
    let nan = of(Some(f64::NAN));
    let inf = of(Some(f64::INFINITY));
    let neg = of(Some(f64::NEG_INFINITY));
    let null = of(None);
    let all = [nan, inf, neg, null];
    for (i, a) in all.iter().enumerate() {
        for b in &all[i + 1..] {
            assert_ne!(a, b);
        }
    }
    // The same input twice is the same call, also for NaN (whatever its payload).
    assert_eq!(nan, of(Some(f64::NAN)));
    assert_eq!(nan, of(Some(-f64::NAN)));
    // Nor with the strings a lenient encoder would write for them.
    assert_ne!(nan, Fingerprint::of(&PARTS, &Some("NaN")).unwrap());
    assert_ne!(inf, Fingerprint::of(&PARTS, &Some("Infinity")).unwrap());
}

#[tokio::test]
async fn a_tenant_never_reads_another_tenants_result() {
    let store = MemoryStore::new();
    let runs = AtomicUsize::new(0);
    let a = Run::new("run-shared")
        .with_store(store.clone())
        .with_tenant("a");
    let b = Run::new("run-shared")
        .with_store(store.clone())
        .with_tenant("b");
    let none = Run::new("run-shared").with_store(store.clone());
    let empty = Run::new("run-shared").with_store(store).with_tenant("");

    let got_a = call(&a, Options::new(), &"input", &runs, "secret of a".into())
        .await
        .unwrap();
    for (run, own) in [(&b, "b"), (&none, "none"), (&empty, "empty")] {
        let got = call(run, Options::new(), &"input", &runs, own.into())
            .await
            .unwrap();
        assert_eq!(
            got, own,
            "same run id, tool and input: still its own result"
        );
    }
    assert_eq!(got_a, "secret of a");
    assert_eq!(runs.load(Ordering::SeqCst), 4);
    // And each replays its own.
    assert_eq!(
        call(&b, Options::new(), &"input", &runs, "x".into())
            .await
            .unwrap(),
        "b"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 4);
}

#[tokio::test]
async fn a_stored_result_that_no_longer_deserializes_is_a_typed_error_and_stays() {
    let store = MemoryStore::new();
    let run = Run::new("run-types").with_store(store.clone());
    let runs = AtomicUsize::new(0);
    call(&run, Options::new(), &1, &runs, "a string".into())
        .await
        .unwrap();
    // A later version of the program expects another type under the same key.
    let key = Call::new(Some(&run), "tool", Options::new(), &1)
        .unwrap()
        .key()
        .clone();
    let err = execute::<Result<u64, Error>, ReleaseErrors, _>(
        Call::new(Some(&run), "tool", Options::new(), &1),
        async { Ok(7) },
    )
    .await
    .unwrap_err();
    assert!(matches!(err, Error::StoredResult { .. }), "{err}");
    // The record is untouched: the old version still replays it.
    let record = store.get(&key).await.unwrap().unwrap();
    assert!(matches!(record.state, State::Completed { .. }));
    assert_eq!(
        call(&run, Options::new(), &1, &runs, "other".into())
            .await
            .unwrap(),
        "a string"
    );
}

/// The parts every fingerprint in these tests is taken with.
const PARTS: KeyParts<'static> = KeyParts {
    tenant: None,
    run_id: "run",
    call_id: None,
    tool: "tool",
};

/// Fingerprinting through `&dyn`, as the attribute does.
mod erased {
    use idem_core::store::Fingerprint;
    use idem_core::Error;

    pub trait Input {
        fn fingerprint(&self) -> Result<Fingerprint, Error>;
    }

    impl<T: serde::Serialize> Input for T {
        fn fingerprint(&self) -> Result<Fingerprint, Error> {
            Fingerprint::of(&super::PARTS, self)
        }
    }
}
