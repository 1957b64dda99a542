//! Key derivation with adversarial tenants, run ids, call ids and tool names: two
//! different sets of parts never give the same key, and every key is printable ASCII
//! of at most 129 characters.
#![no_main]

use arbitrary::Arbitrary;
use idem_core::store::{Key, KeyParts};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug, PartialEq)]
struct Parts {
    tenant: Option<String>,
    run_id: String,
    call_id: Option<String>,
    tool: String,
    input: Vec<u8>,
}

fn key(p: &Parts) -> Key {
    let parts = KeyParts {
        tenant: p.tenant.as_deref(),
        run_id: &p.run_id,
        call_id: p.call_id.as_deref(),
        tool: &p.tool,
    };
    Key::derive(&parts, &p.input).expect("a byte list always serializes")
}

fuzz_target!(|pair: (Parts, Parts)| {
    let (a, b) = pair;
    let (ka, kb) = (key(&a), key(&b));
    for k in [&ka, &kb] {
        assert!(k.as_str().len() <= 129, "{k}");
        assert!(k.as_str().bytes().all(|c| c.is_ascii_graphic()), "{k}");
    }
    assert_eq!(a == b, ka == kb, "{a:?} / {b:?}");
});
