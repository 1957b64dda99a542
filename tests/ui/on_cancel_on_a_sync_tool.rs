#[idem::idempotent(on_cancel = "finish")]
fn send(to: String) -> Result<String, idem::Error> {
    Ok(to)
}

fn main() {}
