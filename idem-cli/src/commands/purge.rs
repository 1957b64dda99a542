//! `idem purge`: removes expired records.

use idem_core::Store;

use crate::failure::{emit, Failure};
use crate::output::Output;

/// Removes the store's expired records.
pub async fn run(store: &dyn Store, out: &Output) -> Result<(), Failure> {
    let removed = store.purge_expired().await?;
    emit(&out.done(&format!("removed {removed} expired records"), removed))
}
