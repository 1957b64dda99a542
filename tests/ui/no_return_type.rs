#[idem::idempotent]
fn tool(x: u32) {
    let _ = x;
}

fn main() {}
