//! `idem stats`: how many records a filter matches, by state.

use idem_core::store::Filter;
use idem_core::Store;

use crate::failure::{emit, Failure};
use crate::output::Output;

/// Counts the records `filter` matches.
pub async fn run(store: &dyn Store, filter: &Filter, out: &Output) -> Result<(), Failure> {
    let counts = store.count(filter).await?;
    emit(&out.counts(&counts))
}
