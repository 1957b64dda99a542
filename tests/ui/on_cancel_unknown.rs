#[idem::idempotent(on_cancel = "later")]
async fn send(to: String) -> Result<String, idem::Error> {
    Ok(to)
}

fn main() {}
