//! Compile errors of `#[idempotent]`: each points at the offending token and says what
//! to change. The expected messages are checked in beside each case (`tests/ui/*.stderr`);
//! regenerate them with `TRYBUILD=overwrite cargo test --test ui` after a deliberate change.

#[test]
fn compile_errors() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}
