trait Tool {
    #[idem::idempotent]
    fn call(&self, x: u32) -> Result<u32, idem::Error>;
}

fn main() {}
