use std::rc::Rc;

// Owns its inputs, so it finishes after a dropped caller by default: it must be `Send`.
#[idem::idempotent]
async fn send(to: String) -> Result<String, idem::Error> {
    let shared = Rc::new(to);
    std::future::ready(()).await;
    Ok(shared.to_string())
}

fn main() {}
