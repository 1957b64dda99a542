#[idem::idempotent(ttl = "3600")]
async fn tool(x: u32) -> Result<u32, idem::Error> {
    Ok(x)
}

fn main() {}
