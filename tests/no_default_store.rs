//! Built without the `sled` feature there is no default store. Run with
//! `cargo test -p idem --no-default-features --test no_default_store` (CI does); with
//! the feature on, this file is empty.
#![cfg(not(feature = "sled"))]

use std::sync::atomic::{AtomicUsize, Ordering};

use idem::{idempotent, Error, MemoryStore, Run};

static SENT: AtomicUsize = AtomicUsize::new(0);

#[idempotent]
async fn send_email(to: String) -> Result<String, Error> {
    SENT.fetch_add(1, Ordering::SeqCst);
    Ok(format!("sent to {to}"))
}

#[tokio::test]
async fn without_sled_a_run_with_no_store_is_a_clear_error_until_one_is_given() {
    let run = Run::new("no-sled");
    let err = run.scope(send_email("ada".into())).await.unwrap_err();
    assert!(matches!(err, Error::NoStore), "{err}");
    let text = err.to_string();
    for needle in ["`sled` feature", "Run::with_store", "set_default_store"] {
        assert!(text.contains(needle), "{needle:?} missing from: {text}");
    }
    assert_eq!(SENT.load(Ordering::SeqCst), 0, "nothing ran");

    // A store given to the run works; so does a default one set for the process.
    let with_store = Run::new("no-sled").with_store(MemoryStore::new());
    assert_eq!(
        with_store.scope(send_email("ada".into())).await.unwrap(),
        "sent to ada"
    );
    idem::set_default_store(MemoryStore::new());
    assert_eq!(
        run.scope(send_email("bob".into())).await.unwrap(),
        "sent to bob"
    );
    assert_eq!(SENT.load(Ordering::SeqCst), 2);
}
