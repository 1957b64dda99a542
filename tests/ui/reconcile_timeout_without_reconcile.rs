#[idem::idempotent(at_most_once, reconcile_timeout = "30s")]
async fn tool(x: u32) -> Result<u32, idem::Error> {
    Ok(x)
}

fn main() {}
