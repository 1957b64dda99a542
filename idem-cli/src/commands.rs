//! One module per subcommand of `idem` (`proxy`, larger, is a folder of its own at
//! `src/proxy/`), and what they share.

pub mod evict;
pub mod ls;
pub mod purge;
pub mod resolve;
pub mod show;
pub mod stats;

use idem_core::store::Record;
use idem_core::{Key, Store};

use crate::failure::{Exit, Failure};

/// The live record under `key`, or the "not found" failure.
pub async fn find(store: &dyn Store, key: &str) -> Result<(Key, Record), Failure> {
    let key = Key::from_text(key);
    match store.get(&key).await? {
        Some(record) => Ok((key, record)),
        None => Err(not_found(&key)),
    }
}

pub fn not_found(key: &Key) -> Failure {
    Failure(
        Exit::NotFound,
        format!("no record under `{key}` (it may have expired)"),
    )
}
