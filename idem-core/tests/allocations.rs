//! Key derivation allocates nothing beyond the key itself: the canonical form is
//! written into a per-thread buffer that is reused, hashed, and the key text is built
//! on the stack and allocated once. Counted with a counting global allocator (this
//! file is its own test binary, with one test, so nothing else allocates meanwhile).

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use idem_core::store::{Fingerprint, KeyParts};
use idem_core::Key;

struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocations_of<T>(f: impl FnOnce() -> T) -> (usize, T) {
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    let value = f();
    (ALLOCATIONS.load(Ordering::Relaxed) - before, value)
}

#[derive(serde::Serialize)]
struct SendEmail {
    to: String,
    cc: Vec<String>,
    subject: String,
    body: String,
    tags: HashMap<String, String>,
}

#[test]
fn key_derivation_allocates_only_the_key() {
    let input = SendEmail {
        to: "ada@example.com".into(),
        cc: vec!["charles@example.com".into()],
        subject: "Your order has shipped".into(),
        body: "Hello Ada,\n\"your\" order is on its way. ".repeat(10),
        tags: [("campaign", "winter"), ("n", "0000007"), ("a", "b")]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
    };
    let parts = KeyParts {
        tenant: Some("acme"),
        run_id: "run-42",
        call_id: None,
        tool: "send_email",
    };
    // The first call on the thread sizes its buffers.
    let first = Fingerprint::of(&parts, &input).unwrap();

    let (n, fingerprint) = allocations_of(|| Fingerprint::of(&parts, &input).unwrap());
    assert_eq!(n, 0, "fingerprinting allocated");
    assert_eq!(fingerprint, first);

    let (n, key) = allocations_of(|| Key::derive(&parts, &input).unwrap());
    assert_eq!(n, 1, "a key is one allocation: its text");
    assert_eq!(key, Key::of("send_email", &fingerprint));
}
