// The user's own type named `Run`, imported by its bare name: the attribute takes it for
// idem's run, and the error says so, and how to make it an input.
mod workflow {
    #[derive(serde::Serialize)]
    pub struct Run {
        pub step: u32,
    }
}

use workflow::Run;

#[idem::idempotent]
async fn advance(run: Run) -> Result<u32, idem::Error> {
    Ok(run.step + 1)
}

fn main() {}
