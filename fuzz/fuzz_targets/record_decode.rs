//! Record decoding from arbitrary bytes: never a panic; what decodes re-encodes to the
//! same bytes.
#![no_main]

use idem_core::store::Record;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(record) = Record::decode("fuzz", data) {
        let encoded = record.encode();
        let again = Record::decode("fuzz", &encoded).expect("a re-encoded record decodes");
        assert_eq!(again.encode(), encoded);
    }
    let _ = Record::decode_expiry("fuzz", data);
});
