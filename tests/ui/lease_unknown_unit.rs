#[idem::idempotent(lease = "2w")]
async fn tool(x: u32) -> Result<u32, idem::Error> {
    Ok(x)
}

fn main() {}
