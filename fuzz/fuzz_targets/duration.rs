//! The attribute's duration parser on arbitrary text: never a panic; what parses is a
//! positive number of milliseconds that prints back to the same total.
#![no_main]

#[path = "../../idem-macros/src/duration.rs"]
#[allow(dead_code)]
mod duration;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|text: &str| {
    if let Ok(millis) = duration::parse_millis(text) {
        assert!(millis > 0, "{text:?} parsed to zero");
        // Re-parsing the canonical spelling gives the same total.
        let canonical = format!("{millis}ms");
        assert_eq!(duration::parse_millis(&canonical), Ok(millis));
    }
});
