#[idem::idempotent(name = 42)]
async fn tool(x: u32) -> Result<u32, idem::Error> {
    Ok(x)
}

#[idem::idempotent(name = "")]
async fn unnamed(x: u32) -> Result<u32, idem::Error> {
    Ok(x)
}

fn main() {}
