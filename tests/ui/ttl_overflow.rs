#[idem::idempotent(ttl = "999999999999999d")]
async fn tool(x: u32) -> Result<u32, idem::Error> {
    Ok(x)
}

fn main() {}
