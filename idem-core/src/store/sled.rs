//! `SledStore`: the embedded default store, on disk, no server needed.
//!
//! Records live in one sled tree ([`SledStore::TREE`]) of a database directory. Every
//! claim is one compare-and-swap loop around [`decide_claim`], and every write is
//! flushed before the call goes on: the claim is on disk before the operation starts,
//! the result is on disk before the call returns.
//!
//! sled allows one open handle per directory. Inside a process, every
//! [`SledStore::open`] of the same directory shares one handle; another process that
//! opens a directory in use gets an [`Error::Store`] within 1.5 seconds (never a hang).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use async_trait::async_trait;

use crate::record::{Record, Timestamp, Token};
use crate::store::{decide_claim, decide_fenced, Claim, ClaimRequest, Fenced, Outcome, Store};
use crate::{Error, Key};

/// The embedded, durable default store, backed by [sled](https://docs.rs/sled).
///
/// Cheap to clone; clones share one database handle.
///
/// ```no_run
/// # fn main() -> Result<(), idem_core::Error> {
/// let store = idem_core::SledStore::open("/var/lib/my-agent/idem")?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct SledStore {
    inner: Arc<Inner>,
}

struct Inner {
    path: PathBuf,
    tree: ::sled::Tree,
    commit: GroupCommit,
    // Keeps the database (and its file lock) open as long as any clone lives.
    _db: ::sled::Db,
}

/// Open databases of this process, by canonical path.
static OPEN: Mutex<Option<HashMap<PathBuf, Weak<Inner>>>> = Mutex::new(None);

/// How long `open` keeps trying a directory whose lock is held. A database this
/// process just closed releases its lock from sled's background thread a moment later;
/// a directory another process holds stays locked, and `open` gives up after this.
const LOCK_PATIENCE: Duration = Duration::from_millis(1500);

fn open_db(path: &Path) -> Result<::sled::Db, Error> {
    let deadline = std::time::Instant::now() + LOCK_PATIENCE;
    loop {
        match ::sled::Config::new().path(path).open() {
            Ok(db) => return Ok(db),
            Err(::sled::Error::Io(e))
                if e.to_string().contains("could not acquire lock")
                    && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(sled_error(e)),
        }
    }
}

fn sled_error(e: ::sled::Error) -> Error {
    Error::store("sled", e)
}

impl SledStore {
    /// The name of the sled tree that holds idem's records.
    pub const TREE: &'static str = "idem.records";

    /// Opens (creating if needed) the store in directory `path`.
    ///
    /// Opening a directory this process already has open returns a handle to the same
    /// database. A directory another process holds open is an [`Error::Store`].
    pub fn open(path: impl AsRef<Path>) -> Result<Self, Error> {
        let path = path.as_ref();
        std::fs::create_dir_all(path).map_err(|e| {
            Error::store(
                "sled",
                format!("cannot create store directory {}: {e}", path.display()),
            )
        })?;
        let path = path.canonicalize().map_err(|e| {
            Error::store(
                "sled",
                format!("cannot resolve store directory {}: {e}", path.display()),
            )
        })?;

        let mut open = OPEN.lock().unwrap_or_else(|p| p.into_inner());
        let open = open.get_or_insert_with(HashMap::new);
        open.retain(|_, weak| weak.strong_count() > 0);
        if let Some(inner) = open.get(&path).and_then(Weak::upgrade) {
            return Ok(SledStore { inner });
        }
        let db = open_db(&path)?;
        let tree = db.open_tree(Self::TREE).map_err(sled_error)?;
        tracing::debug!(path = %path.display(), "opened sled store");
        let inner = Arc::new(Inner {
            path: path.clone(),
            tree,
            commit: GroupCommit::default(),
            _db: db,
        });
        open.insert(path, Arc::downgrade(&inner));
        Ok(SledStore { inner })
    }

    /// The store's directory (canonical).
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// How many records the tree holds, expired ones included until purged.
    pub fn len(&self) -> usize {
        self.inner.tree.len()
    }

    /// Whether the tree holds no records.
    pub fn is_empty(&self) -> bool {
        self.inner.tree.is_empty()
    }

    /// Makes every write this caller made so far durable. Concurrent callers share
    /// flushes (group commit): see [`GroupCommit`].
    async fn flush(&self) -> Result<(), Error> {
        self.inner.commit.flush(&self.inner.tree).await
    }

    fn read(&self, key: &Key) -> Result<Option<(::sled::IVec, Record)>, Error> {
        match self.inner.tree.get(key.as_str()).map_err(sled_error)? {
            None => Ok(None),
            Some(bytes) => {
                let record = Record::decode(key.as_str(), &bytes)?;
                Ok(Some((bytes, record)))
            }
        }
    }

    /// Compare-and-swap loop: `decide` sees the current record and returns the record to
    /// write (or `None` to delete) and a result; retried until no concurrent writer
    /// changed the key in between.
    fn update<T>(
        &self,
        key: &Key,
        mut decide: impl FnMut(Option<&Record>, Timestamp) -> (T, Option<Option<Record>>),
    ) -> Result<(T, bool), Error> {
        loop {
            let current = self.read(key)?;
            let (result, write) = decide(current.as_ref().map(|(_, r)| r), Timestamp::now());
            let Some(new) = write else {
                return Ok((result, false));
            };
            let old = current.map(|(bytes, _)| bytes);
            let new = new.map(|r| r.encode());
            match self
                .inner
                .tree
                .compare_and_swap(key.as_str(), old, new)
                .map_err(sled_error)?
            {
                Ok(()) => return Ok((result, true)),
                Err(_) => continue,
            }
        }
    }

    async fn fenced(
        &self,
        key: &Key,
        token: Token,
        outcome: Option<(Outcome<'_>, Duration)>,
    ) -> Result<Fenced, Error> {
        let (fenced, wrote) = self.update(key, |current, now| {
            match decide_fenced(current, token, outcome, now) {
                Ok(write) => (Fenced::Applied, Some(write)),
                Err(lost) => (lost, None),
            }
        })?;
        if wrote {
            self.flush().await?;
        }
        Ok(fenced)
    }
}

/// Group commit: one flush at a time, shared by every caller that wrote before it
/// started.
///
/// A caller takes a ticket after its write. If a flush that started after the ticket
/// has finished, its write is durable; otherwise it waits for the running flush and
/// then starts the next one itself, for everyone who came in meanwhile. So 64
/// concurrent completions cost a few flushes, not 64.
///
/// The flush runs on a tokio blocking thread (or inline, in a sync tool), never on
/// sled's own thread pool: sled 0.34's `flush_async` blocks pool threads waiting for
/// writes that need those same threads, and many concurrent calls deadlock it.
#[derive(Default)]
struct GroupCommit {
    state: Mutex<CommitState>,
    done: event_listener::Event,
}

#[derive(Default)]
struct CommitState {
    /// Tickets handed out so far.
    issued: u64,
    /// Every ticket up to this one is durable.
    durable: u64,
    /// Whether a flush is running.
    running: bool,
}

impl GroupCommit {
    async fn flush(&self, tree: &::sled::Tree) -> Result<(), Error> {
        let ticket = {
            let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
            state.issued += 1;
            state.issued
        };
        loop {
            let listener = self.done.listen();
            let target = {
                let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
                if state.durable >= ticket {
                    return Ok(());
                }
                if state.running {
                    None
                } else {
                    state.running = true;
                    Some(state.issued)
                }
            };
            let Some(target) = target else {
                listener.await;
                continue;
            };
            // Hand the flush back even if this future is dropped mid-flush (a cancelled
            // call); otherwise every later caller would wait for it forever.
            let mut running = Running {
                commit: self,
                target,
                durable: false,
            };
            let result = flush_blocking(tree).await;
            running.durable = result.is_ok();
            drop(running);
            result?;
        }
    }
}

/// The running flush: on drop, marks it finished (and its target durable, if it
/// succeeded) and wakes the waiters.
struct Running<'a> {
    commit: &'a GroupCommit,
    target: u64,
    durable: bool,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        {
            let mut state = self.commit.state.lock().unwrap_or_else(|p| p.into_inner());
            state.running = false;
            if self.durable {
                state.durable = state.durable.max(self.target);
            }
        }
        self.commit.done.notify(usize::MAX);
    }
}

/// `tree.flush()` off the async threads when there are any.
async fn flush_blocking(tree: &::sled::Tree) -> Result<(), Error> {
    let flushed = match tokio::runtime::Handle::try_current() {
        Ok(handle) => {
            let tree = tree.clone();
            handle
                .spawn_blocking(move || tree.flush())
                .await
                .map_err(|e| Error::store("sled", format!("flush task failed: {e}")))?
        }
        // A sync tool outside any runtime: this thread may block.
        Err(_) => tree.flush(),
    };
    flushed.map(|_| ()).map_err(sled_error)
}

impl std::fmt::Debug for SledStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SledStore")
            .field("path", &self.inner.path)
            .finish()
    }
}

#[async_trait]
impl Store for SledStore {
    async fn claim(&self, key: &Key, request: &ClaimRequest) -> Result<Claim, Error> {
        let (claim, wrote) = self.update(key, |current, now| {
            let (claim, write) = decide_claim(current, request, now);
            (claim, write.map(Some))
        })?;
        if wrote {
            self.flush().await?;
        }
        Ok(claim)
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        outcome: Outcome<'_>,
        ttl: Duration,
    ) -> Result<Fenced, Error> {
        self.fenced(key, token, Some((outcome, ttl))).await
    }

    async fn release(&self, key: &Key, token: Token) -> Result<Fenced, Error> {
        self.fenced(key, token, None).await
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>, Error> {
        let now = Timestamp::now();
        Ok(self
            .read(key)?
            .map(|(_, r)| r)
            .filter(|r| !r.is_expired(now)))
    }

    async fn delete(&self, key: &Key) -> Result<bool, Error> {
        let now = Timestamp::now();
        let old = self.inner.tree.remove(key.as_str()).map_err(sled_error)?;
        self.flush().await?;
        // A record that no longer decodes was still there: report it as removed.
        Ok(old.is_some_and(|bytes| {
            Record::decode(key.as_str(), &bytes).map_or(true, |r| !r.is_expired(now))
        }))
    }

    /// Walks the tree and removes expired records, reading only their headers. The walk
    /// runs on a tokio blocking thread (when there is a runtime), so calls go on while
    /// a large store is purged; each removal is a compare-and-swap, so a key re-claimed
    /// meanwhile is left alone.
    async fn purge_expired(&self) -> Result<u64, Error> {
        let tree = self.inner.tree.clone();
        let walk = move || -> Result<u64, Error> {
            let now = Timestamp::now();
            let mut removed = 0u64;
            for entry in tree.iter() {
                let (k, bytes) = entry.map_err(sled_error)?;
                match Record::decode_expiry(&String::from_utf8_lossy(&k), &bytes) {
                    Ok(expires_at) if expires_at <= now => {
                        let swapped = tree
                            .compare_and_swap(&k, Some(&bytes), None as Option<&[u8]>)
                            .map_err(sled_error)?;
                        removed += u64::from(swapped.is_ok());
                    }
                    Ok(_) => {}
                    Err(e) => tracing::warn!(error = %e, "purge skipped an unreadable record"),
                }
            }
            Ok(removed)
        };
        let removed = match tokio::runtime::Handle::try_current() {
            Ok(handle) => handle
                .spawn_blocking(walk)
                .await
                .map_err(|e| Error::store("sled", format!("purge task failed: {e}")))??,
            Err(_) => walk()?,
        };
        if removed > 0 {
            self.flush().await?;
        }
        Ok(removed)
    }
}
