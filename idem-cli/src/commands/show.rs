//! `idem show KEY`: one record, who made it, its history and its result.

use idem_core::store::Timestamp;
use idem_core::Store;

use crate::failure::{emit, Failure};
use crate::output::Output;

/// Shows the live record under `key`.
pub async fn run(store: &dyn Store, key: &str, out: &Output) -> Result<(), Failure> {
    let (key, record) = super::find(store, key).await?;
    emit(&out.record(&key, &record, Timestamp::now()))
}
