#[idem::idempotent]
async fn tool((a, b): (u32, u32)) -> Result<u32, idem::Error> {
    Ok(a + b)
}

fn main() {}
