// A hash set inside an argument serializes in hash order: a new key in every process.
use std::collections::HashSet;

#[idem::idempotent]
async fn tag(tags: Option<HashSet<String>>) -> Result<u32, idem::Error> {
    Ok(tags.map_or(0, |t| t.len() as u32))
}

fn main() {}
