#[derive(serde::Serialize)]
struct Email {
    to: String,
}

#[idem::idempotent(key = [email.to])]
async fn tool(input: Email) -> Result<u32, idem::Error> {
    let _ = input;
    Ok(1)
}

fn main() {}
