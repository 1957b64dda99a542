struct Pair {
    a: u32,
    b: u32,
}

#[idem::idempotent]
async fn tool(Pair { a, .. }: Pair) -> Result<u32, idem::Error> {
    Ok(a)
}

#[idem::idempotent]
async fn other((a, _): (u32, u32)) -> Result<u32, idem::Error> {
    Ok(a)
}

fn main() {}
