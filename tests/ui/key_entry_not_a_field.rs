#[idem::idempotent(key = [to.len()])]
async fn tool(to: String) -> Result<u32, idem::Error> {
    Ok(to.len() as u32)
}

fn main() {}
