// The largest TTL is the same on every store: 100 years. A longer one is refused here,
// at the literal, rather than failing at run time on one store and not another.
#[idem::idempotent(ttl = "36501d")]
async fn tool(x: u32) -> Result<u32, idem::Error> {
    Ok(x)
}

fn main() {}
