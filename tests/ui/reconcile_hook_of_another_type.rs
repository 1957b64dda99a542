use idem::{Key, Reconciled};

// The hook answers with a `String`, the tool's value is a `u32`.
async fn check(_key: &Key, _x: &u32) -> Reconciled<String> {
    Reconciled::Unknown
}

#[idem::idempotent(at_most_once, reconcile = check)]
async fn tool(x: u32) -> Result<u32, idem::Error> {
    Ok(x)
}

fn main() {}
