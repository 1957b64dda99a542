#[idem::idempotent(run = idem::Run::new("a"))]
async fn tool(run: &idem::Run, x: u32) -> Result<u32, idem::Error> {
    let _ = run;
    Ok(x)
}

fn main() {}
