use idem::{Key, Reconciled};

async fn check(_key: &Key, _x: &u32) -> Reconciled<u32> {
    Reconciled::Unknown
}

#[idem::idempotent(at_most_once, reconcile = check)]
fn tool(x: u32) -> Result<u32, idem::Error> {
    Ok(x)
}

fn main() {}
