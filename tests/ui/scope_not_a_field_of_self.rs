struct Mailer {
    account: String,
}

impl Mailer {
    #[idem::idempotent(scope = [account])]
    async fn send(&self, to: String) -> Result<String, idem::Error> {
        Ok(format!("{} to {to}", self.account))
    }
}

#[idem::idempotent(scope = [self.account])]
async fn free(to: String) -> Result<String, idem::Error> {
    Ok(to)
}

fn main() {}
