struct Counter {
    sent: u32,
}

impl Counter {
    #[idem::idempotent(on_cancel = "finish")]
    async fn send(&mut self, to: String) -> Result<String, idem::Error> {
        self.sent += 1;
        Ok(to)
    }
}

fn main() {}
