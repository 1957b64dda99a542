//! The store conformance suite against the stores of this crate.

use std::sync::Arc;

use idem_core::testing;
use idem_core::{LocalCache, MemoryStore, SledStore};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_store_conforms() {
    testing::run_all(Arc::new(MemoryStore::new())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sled_store_conforms() {
    let dir = tempfile::tempdir().unwrap();
    testing::run_all(Arc::new(SledStore::open(dir.path()).unwrap())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sled_store_in_fsync_mode_conforms() {
    let dir = tempfile::tempdir().unwrap();
    let store = SledStore::builder(dir.path()).fsync(true).open().unwrap();
    testing::run_all(Arc::new(store)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn local_cache_over_the_memory_store_conforms() {
    testing::run_all(Arc::new(LocalCache::new(MemoryStore::new()))).await;
}
