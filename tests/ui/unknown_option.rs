#[idem::idempotent(ttl = "1h", retries = 3)]
async fn tool(x: u32) -> Result<u32, idem::Error> {
    Ok(x)
}

fn main() {}
