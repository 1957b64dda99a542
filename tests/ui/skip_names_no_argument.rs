#[idem::idempotent(skip = [client])]
async fn tool(x: u32) -> Result<u32, idem::Error> {
    Ok(x)
}

fn main() {}
