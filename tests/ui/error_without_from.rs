#[derive(Debug)]
struct MyError;

#[idem::idempotent]
async fn tool(x: u32) -> Result<u32, MyError> {
    Ok(x)
}

fn main() {}
