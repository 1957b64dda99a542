#[idem::idempotent]
async fn tool(x: u32) -> u32 {
    x
}

fn main() {}
