#[idem::idempotent(ttl = "1h", ttl = "2h")]
async fn tool(x: u32) -> Result<u32, idem::Error> {
    Ok(x)
}

fn main() {}
