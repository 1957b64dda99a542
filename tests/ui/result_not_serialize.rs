#[derive(serde::Deserialize)]
struct Receipt;

#[idem::idempotent]
async fn tool(x: u32) -> Result<Receipt, idem::Error> {
    let _ = x;
    Ok(Receipt)
}

fn main() {}
