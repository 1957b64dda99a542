//! What idem-core's test binaries share.

use idem_core::SledStore;

/// The store in `path`, once the raw `sled::Db` the test wrote with has let go of the
/// directory: sled's background thread drops its lock a moment after the last handle
/// (later on a busy machine), and `SledStore::open` waits only for stores it closed
/// itself, taking any other holder for another process.
pub fn open_after_raw(path: &std::path::Path) -> SledStore {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match SledStore::open(path) {
            Ok(store) => return store,
            Err(e)
                if e.to_string().contains("held by another process")
                    && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(std::time::Duration::from_millis(20))
            }
            Err(e) => panic!("{e}"),
        }
    }
}
