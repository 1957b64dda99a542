struct Client;

#[idem::idempotent]
async fn tool(client: Client, x: u32) -> Result<u32, idem::Error> {
    let _ = client;
    Ok(x)
}

fn main() {}
