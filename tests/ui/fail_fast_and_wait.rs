#[idem::idempotent(fail_fast, wait = "10s")]
async fn tool(x: u32) -> Result<u32, idem::Error> {
    Ok(x)
}

fn main() {}
