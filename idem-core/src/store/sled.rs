//! `SledStore`, the default store: records in an embedded sled database (its docs say
//! how durable they are, and what the store costs).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use async_trait::async_trait;

use crate::blocking;
use crate::error::Fault;
use crate::error::{Error, StoreErrorKind};
use crate::key::Fingerprint;
use crate::key_text::Key;
use crate::record::{Record, Timestamp, Token};
use crate::store::{
    decide_claim, decide_fenced, decide_resolution, decide_settled_removal, page_by_key, unhex,
    Claim, ClaimRequest, Cursor, Fenced, Filter, Outcome, OwnerWrite, Page, Resolution, Store,
    WALK_PAGE,
};

/// The embedded, durable default store, backed by [sled](https://docs.rs/sled).
///
/// Cheap to clone; clones share one database handle.
///
/// ```no_run
/// # fn main() -> Result<(), idem_core::Error> {
/// let store = idem_core::SledStore::open("/var/lib/my-agent/idem")?;
/// # Ok(()) }
/// ```
///
/// `SledStore`: the embedded default store, on disk, no server needed.
///
/// Records live in one sled tree ([`SledStore::TREE`]) of a database directory. Every
/// claim is one compare-and-swap loop around [`decide_claim`], and every write is
/// flushed before the call goes on: the claim is on disk before the operation starts,
/// the result is on disk before the call returns.
///
/// # Durability
///
/// By default a write is durable against a **process crash** (kill -9, panic, OOM
/// kill) before the call goes on: sled 0.34's flush writes its log and, on Linux, waits
/// for it with `sync_file_range`, which puts the data on its way to the device but
/// neither flushes the device's volatile cache nor syncs the file's size, and large
/// values (over about 128 KiB) go to separate blob files that are never synced. That
/// is not enough against **power loss or a kernel crash**: the last writes before it
/// may be gone. [`SledStoreBuilder::fsync`] adds an `fdatasync` of the database file
/// after each (group) flush and caps results at [`SledStore::FSYNC_MAX_RESULT_BYTES`]
/// so no blob file is ever needed: then a call's claim and result are on stable
/// storage before it goes on.
///
/// sled allows one open handle per directory. Inside a process, every
/// [`SledStore::open`] of the same directory shares one handle; another process that
/// opens a directory in use gets an [`Error::Store`] within 1.5 seconds (never a hang).
#[derive(Clone)]
pub struct SledStore {
    inner: Arc<Inner>,
}

struct Inner {
    path: PathBuf,
    tree: ::sled::Tree,
    commit: GroupCommit,
    /// The database file, synced after each flush in fsync mode.
    fsync: Option<Arc<std::fs::File>>,
    // Keeps the database (and its file lock) open as long as any clone lives.
    _db: ::sled::Db,
}

/// Open databases of this process, by canonical path.
static OPEN: Mutex<Option<HashMap<PathBuf, Weak<Inner>>>> = Mutex::new(None);

/// How long `open` keeps trying a directory whose lock is held, when this process
/// closed a store there a moment ago: sled's background thread lets go of the lock a
/// little after the last handle is dropped. A directory this process did not just close
/// is held by another process, and `open` fails at once.
const LOCK_PATIENCE: Duration = Duration::from_millis(1500);

/// Directories whose store this process closed, and when: their lock may still be
/// on its way out.
static CLOSED: Mutex<Option<HashMap<PathBuf, std::time::Instant>>> = Mutex::new(None);

impl Drop for Inner {
    fn drop(&mut self) {
        let mut closed = crate::sync::lock(&CLOSED);
        let closed = closed.get_or_insert_with(HashMap::new);
        closed.retain(|_, at| at.elapsed() < LOCK_PATIENCE);
        closed.insert(self.path.clone(), std::time::Instant::now());
    }
}

/// Whether this process closed a store in `path` within [`LOCK_PATIENCE`].
fn closed_here_lately(path: &Path) -> bool {
    let closed = crate::sync::lock(&CLOSED);
    closed
        .as_ref()
        .and_then(|c| c.get(path))
        .is_some_and(|at| at.elapsed() < LOCK_PATIENCE)
}

/// The error for a directory another process holds: sled takes one process per
/// directory.
fn held_elsewhere(path: &Path, source: std::io::Error) -> Error {
    Error::store_of_kind(
        "sled",
        StoreErrorKind::HeldElsewhere,
        Fault::new(
            format!(
                "the sled store in {} is held by another process (a sled directory serves one \
                 process at a time): give each process its own directory (IDEM_DIR, or \
                 SledStore::open), or use the Postgres or Redis store for several workers",
                path.display()
            ),
            source,
        ),
    )
}

fn open_db(path: &Path, cache_bytes: Option<u64>) -> Result<::sled::Db, Error> {
    let mut cleared = false;
    loop {
        let mut config = ::sled::Config::new().path(path);
        if let Some(bytes) = cache_bytes {
            config = config.cache_capacity(bytes);
        }
        match config.open() {
            Ok(db) => return Ok(db),
            Err(::sled::Error::Io(e)) if e.to_string().contains("could not acquire lock") => {
                if !closed_here_lately(path) {
                    return Err(held_elsewhere(path, e));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(::sled::Error::Corruption { .. }) if !cleared => {
                cleared = true;
                if !remove_unfinished_snapshots(path)? {
                    return Err(sled_error(::sled::Error::Corruption { at: None, bt: () }));
                }
            }
            Err(e) => return Err(sled_error(e)),
        }
    }
}

/// Removes the snapshots sled began and never finished (`snap.<lsn>.generating`);
/// returns whether there were any.
///
/// sled 0.34 writes a snapshot each time it opens a database: to `snap.<lsn>.generating`,
/// renamed to `snap.<lsn>` once complete, after which older snapshots are removed. A
/// process killed before the rename leaves the unfinished file, and sled then reads it
/// as the newest snapshot (it sorts after `snap.<lsn>`) and refuses to open the
/// database, for good (upstream issues 1509, 1527, 1533). Removing the file restores
/// the state from before that write began: the previous snapshot and the log are
/// untouched. Called only after sled reported corruption while it held the directory's
/// lock, so no live process is writing a snapshot there.
fn remove_unfinished_snapshots(path: &Path) -> Result<bool, Error> {
    let io = |e: std::io::Error| {
        Error::store(
            "sled",
            format!(
                "cannot clear unfinished snapshots in {}: {e}",
                path.display()
            ),
        )
    };
    let mut removed = false;
    for entry in std::fs::read_dir(path).map_err(io)? {
        let entry = entry.map_err(io)?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with("snap.") && name.ends_with(".generating") {
            std::fs::remove_file(entry.path()).map_err(io)?;
            tracing::warn!(path = %path.display(), file = %name, "idem: removed a sled snapshot that a stopped process left unfinished; sled would not open the store with it");
            removed = true;
        }
    }
    Ok(removed)
}

fn sled_error(e: ::sled::Error) -> Error {
    Error::store("sled", Fault::chained(e))
}

impl SledStore {
    /// The name of the sled tree that holds idem's records.
    pub const TREE: &'static str = "idem.records";

    /// The largest result stored in fsync mode: results above it would go to sled's
    /// blob files, which sled never syncs.
    pub const FSYNC_MAX_RESULT_BYTES: usize = 120 * 1024;

    /// Opens (creating if needed) the store in directory `path`, durable against
    /// process crashes (see [Durability](SledStore#durability)).
    ///
    /// Opening a directory this process already has open returns a handle to the same
    /// database. A directory another process holds open is an [`Error::Store`].
    pub fn open(path: impl AsRef<Path>) -> Result<Self, Error> {
        Self::builder(path).open()
    }

    /// A store in directory `path`, with options.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), idem_core::Error> {
    /// let store = idem_core::SledStore::builder("/var/lib/my-agent/idem")
    ///     .fsync(true) // durable against power loss, not only process crashes
    ///     .open()?;
    /// # Ok(()) }
    /// ```
    pub fn builder(path: impl AsRef<Path>) -> SledStoreBuilder {
        SledStoreBuilder {
            path: path.as_ref().to_owned(),
            fsync: false,
            cache_bytes: None,
        }
    }

    fn open_with(path: &Path, fsync: bool, cache_bytes: Option<u64>) -> Result<Self, Error> {
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

        let mut open = crate::sync::lock(&OPEN);
        let open = open.get_or_insert_with(HashMap::new);
        open.retain(|_, weak| weak.strong_count() > 0);
        if let Some(inner) = open.get(&path).and_then(Weak::upgrade) {
            if inner.fsync.is_some() != fsync {
                return Err(Error::store(
                    "sled",
                    format!(
                        "{} is already open in this process with fsync = {}",
                        path.display(),
                        inner.fsync.is_some()
                    ),
                ));
            }
            return Ok(SledStore { inner });
        }
        let db = open_db(&path, cache_bytes)?;
        let tree = db.open_tree(Self::TREE).map_err(sled_error)?;
        let fsync = if fsync {
            Some(Arc::new(sync_new_database(&path, &db)?))
        } else {
            None
        };
        tracing::debug!(path = %path.display(), fsync = fsync.is_some(), "opened sled store");
        let inner = Arc::new(Inner {
            path: path.clone(),
            tree,
            commit: GroupCommit::default(),
            fsync,
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

    /// Makes every write this caller made or saw so far durable. Concurrent callers
    /// share flushes (group commit): see [`GroupCommit`].
    async fn flush(&self) -> Result<(), Error> {
        self.flush_through(self.inner.commit.ticket()).await
    }

    /// Makes the writes up to `ticket` durable.
    async fn flush_through(&self, ticket: u64) -> Result<(), Error> {
        self.inner
            .commit
            .flush(ticket, &self.inner.tree, self.inner.fsync.as_ref())
            .await
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
    /// changed the key in between. Returns the result and, for a `durable` write that
    /// was made, its ticket: the caller flushes through it ([`SledStore::flush_through`])
    /// before going on. A durable write is announced to readers until it has its ticket
    /// (see [`GroupCommit`]).
    fn update<T>(
        &self,
        key: &Key,
        durable: bool,
        mut decide: impl FnMut(Option<&Record>, Timestamp) -> (T, Option<Option<Record>>),
    ) -> Result<(T, Option<u64>), Error> {
        let commit = &self.inner.commit;
        let _writing = durable.then(|| commit.writing());
        loop {
            let current = self.read(key)?;
            let (result, write) = decide(current.as_ref().map(|(_, r)| r), Timestamp::now());
            let Some(new) = write else {
                return Ok((result, None));
            };
            let old = current.map(|(bytes, _)| bytes);
            let new = new.map(|r| r.encode());
            match self
                .inner
                .tree
                .compare_and_swap(key.as_str(), old, new)
                .map_err(sled_error)?
            {
                Ok(()) => return Ok((result, durable.then(|| commit.ticket()))),
                Err(_) => continue,
            }
        }
    }

    /// A fenced write; flushed unless `durable` is false (renewals, which a crash may
    /// lose without harm: see [`Store::renew`]).
    /// Writes what `decide` returns (see [`SledStore::update`]) durably, or returns the
    /// answer of a write `decide` refused.
    async fn write_if(
        &self,
        key: &Key,
        durable: bool,
        decide: impl Fn(Option<&Record>, Timestamp) -> Result<Option<Record>, Fenced>,
    ) -> Result<Fenced, Error> {
        let (fenced, ticket) =
            self.update(key, durable, |current, now| match decide(current, now) {
                Ok(write) => (Fenced::Applied, Some(write)),
                Err(lost) => (lost, None),
            })?;
        if let Some(ticket) = ticket {
            self.flush_through(ticket).await?;
        }
        Ok(fenced)
    }

    async fn fenced(
        &self,
        key: &Key,
        token: Token,
        owner_write: OwnerWrite<'_>,
        durable: bool,
    ) -> Result<Fenced, Error> {
        self.write_if(key, durable, |current, now| {
            decide_fenced(current, token, owner_write, now)
        })
        .await
    }
}

/// Group commit: one flush at a time, shared by every caller that wrote before it
/// started.
///
/// A caller takes a ticket after its write (or after a read, to make what it read
/// durable). If a flush that started after the ticket has finished, its write is durable; otherwise it waits for the running flush and
/// then starts the next one itself, for everyone who came in meanwhile. So 64
/// concurrent completions cost a few flushes, not 64.
///
/// The flush runs on the calling thread (see [`flush_blocking`]), never on sled's own
/// thread pool: sled 0.34's `flush_async` blocks pool threads waiting for writes that
/// need those same threads, and many concurrent calls deadlock it.
///
/// A reader must not return an outcome that a crash could still take back (a duplicate
/// that replayed a result whose completion is still flushing, and then the process
/// dies: the result is gone, and the call runs again). So a durable write is announced
/// before it is made ([`GroupCommit::writing`], until its ticket is taken), and a reader
/// that found a record checks afterwards that every write it could have seen is durable
/// ([`GroupCommit::settled`]): two atomic loads when nothing is being written, else the
/// reader flushes like a writer.
#[derive(Default)]
struct GroupCommit {
    state: Mutex<CommitState>,
    done: event_listener::Event,
    /// Durable writes under way whose ticket is not taken yet.
    writing: AtomicU64,
    /// The last ticket taken (`CommitState::issued`), for readers.
    issued: AtomicU64,
    /// Every ticket up to this one is durable (`CommitState::durable`), for readers.
    durable: AtomicU64,
}

/// A durable write under way, until its ticket is taken.
struct Writing<'a>(&'a GroupCommit);

impl Drop for Writing<'_> {
    fn drop(&mut self) {
        self.0.writing.fetch_sub(1, Ordering::SeqCst);
    }
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
    /// Announces a durable write; drop the guard once the write's ticket is taken.
    fn writing(&self) -> Writing<'_> {
        self.writing.fetch_add(1, Ordering::SeqCst);
        Writing(self)
    }

    /// Whether every durable write a reader could have seen so far is durable. Call it
    /// after the read.
    fn settled(&self) -> bool {
        self.writing.load(Ordering::SeqCst) == 0
            && self.durable.load(Ordering::SeqCst) >= self.issued.load(Ordering::SeqCst)
    }

    /// A ticket for every write made (or seen) so far.
    fn ticket(&self) -> u64 {
        let mut state = crate::sync::lock(&self.state);
        state.issued += 1;
        self.issued.store(state.issued, Ordering::SeqCst);
        state.issued
    }

    /// Returns once every write up to `ticket` is durable.
    async fn flush(
        &self,
        ticket: u64,
        tree: &::sled::Tree,
        fsync: Option<&Arc<std::fs::File>>,
    ) -> Result<(), Error> {
        loop {
            let listener = self.done.listen();
            let target = {
                let mut state = crate::sync::lock(&self.state);
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
            let result = flush_blocking(tree, fsync).await;
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
            let mut state = crate::sync::lock(&self.commit.state);
            state.running = false;
            if self.durable {
                state.durable = state.durable.max(self.target);
                self.commit.durable.store(state.durable, Ordering::SeqCst);
            }
        }
        self.commit.done.notify(usize::MAX);
    }
}

/// `tree.flush()` (and, in fsync mode, `fdatasync` of the database file), without
/// stalling the async threads.
///
/// On a multi-threaded tokio runtime the flush runs in place under
/// [`tokio::task::block_in_place`], which first hands this worker's other tasks to
/// another thread. Handing the flush itself to a blocking thread instead
/// (`spawn_blocking`) costs a thread wake-up at each end, and a serial miss has two
/// flushes (the figures are in `docs/performance.md`). A current-thread runtime has no
/// other worker to hand its tasks to (and `block_in_place` panics there), so there the
/// flush goes to a blocking thread, or runs in place when the OS starts none; outside
/// any runtime (a sync tool) it simply blocks this thread. The flavor is that of the
/// runtime whose context the call runs in.
async fn flush_blocking(
    tree: &::sled::Tree,
    fsync: Option<&Arc<std::fs::File>>,
) -> Result<(), Error> {
    let flush = |tree: &::sled::Tree, fsync: Option<&std::fs::File>| -> Result<(), Error> {
        tree.flush().map_err(sled_error)?;
        if let Some(file) = fsync {
            file.sync_data()
                .map_err(|e| Error::store("sled", format!("fdatasync failed: {e}")))?;
        }
        Ok(())
    };
    match tokio::runtime::Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(|| flush(tree, fsync.map(|f| &**f)))
        }
        Ok(_) => {
            let (tree, fsync) = (tree.clone(), fsync.cloned());
            blocking::run(move || flush(&tree, fsync.as_deref()))
                .await
                .unwrap_or_else(|| Err(Error::store("sled", "the flush panicked")))
        }
        Err(_) => flush(tree, fsync.map(|f| &**f)),
    }
}

/// Fsync mode, at open: makes the database's files and their directory entries durable
/// (sled creates them without syncing) and returns the log file to sync after flushes.
fn sync_new_database(path: &Path, db: &::sled::Db) -> Result<std::fs::File, Error> {
    let io = |what: &str, e: std::io::Error| {
        Error::store(
            "sled",
            format!("fsync mode: {what} in {}: {e}", path.display()),
        )
    };
    db.flush().map_err(sled_error)?;
    let log = std::fs::File::open(path.join("db")).map_err(|e| io("cannot open the log", e))?;
    log.sync_all().map_err(|e| io("cannot sync the log", e))?;
    if let Ok(conf) = std::fs::File::open(path.join("conf")) {
        conf.sync_all().map_err(|e| io("cannot sync conf", e))?;
    }
    std::fs::File::open(path)
        .and_then(|dir| dir.sync_all())
        .map_err(|e| io("cannot sync the directory", e))?;
    Ok(log)
}

/// Options for [`SledStore`]; [`SledStore::builder`] makes one.
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `open` is called"]
pub struct SledStoreBuilder {
    path: PathBuf,
    fsync: bool,
    cache_bytes: Option<u64>,
}

impl SledStoreBuilder {
    /// Also `fdatasync` the database file after each (group) flush, so claims and
    /// results survive power loss and kernel crashes, not only process crashes. Results
    /// are then capped at [`SledStore::FSYNC_MAX_RESULT_BYTES`] (larger ones would go to
    /// sled's never-synced blob files). Costs one `fdatasync` per group commit.
    pub fn fsync(mut self, fsync: bool) -> Self {
        self.fsync = fsync;
        self
    }

    /// The most memory sled's page cache takes (sled's default: 1 GiB). A process that
    /// walks a large store once, as the `idem` command does, needs little. Ignored when
    /// the directory is already open in this process.
    pub fn cache_bytes(mut self, bytes: u64) -> Self {
        self.cache_bytes = Some(bytes);
        self
    }

    /// Opens (creating if needed) the store. See [`SledStore::open`].
    pub fn open(self) -> Result<SledStore, Error> {
        SledStore::open_with(&self.path, self.fsync, self.cache_bytes)
    }
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
    fn name(&self) -> &'static str {
        "sled"
    }

    async fn claim(&self, key: &Key, request: &ClaimRequest) -> Result<Claim, Error> {
        let (claim, ticket) = self.update(key, true, |current, now| {
            let (claim, write) = decide_claim(current, request, now);
            (claim, write.map(Some))
        })?;
        let replays = matches!(claim, Claim::Completed(_) | Claim::Failed(_));
        if let Some(ticket) = ticket {
            self.flush_through(ticket).await?;
        } else if replays && !self.inner.commit.settled() {
            // A replayed outcome may be one a concurrent call wrote and is still
            // flushing: it is returned only once it is durable.
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
        self.fenced(key, token, OwnerWrite::Complete { outcome, ttl }, true)
            .await
    }

    async fn release(&self, key: &Key, token: Token) -> Result<Fenced, Error> {
        self.fenced(key, token, OwnerWrite::Release, true).await
    }

    /// Not flushed: a renewal lost in a crash only shortens a dead process's lease.
    /// (A zero-lease renewal, which gives a claim up, is flushed: it answers retries.)
    async fn renew(
        &self,
        key: &Key,
        token: Token,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Fenced, Error> {
        let durable = lease.is_zero();
        self.fenced(key, token, OwnerWrite::Renew { lease, ttl }, durable)
            .await
    }

    fn max_result_bytes(&self) -> usize {
        if self.inner.fsync.is_some() {
            Self::FSYNC_MAX_RESULT_BYTES
        } else {
            crate::store::DEFAULT_MAX_RESULT_BYTES
        }
    }

    fn with_completed_result(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        replay: &mut dyn FnMut(&[u8]),
    ) {
        let now = Timestamp::now();
        // A record that cannot be read is not replayed: the claim reports it.
        if let Ok(Some(bytes)) = self.inner.tree.get(key.as_str()) {
            if let Some(result) = Record::replayable_result(&bytes, fingerprint, now) {
                // Only a durable result: one still being flushed is left to the claim,
                // which waits for the flush.
                if self.inner.commit.settled() {
                    replay(result);
                }
            }
        }
    }

    /// Pages in key order, walking the tree from the cursor on a blocking thread. A
    /// value that does not decode is listed as unreadable.
    async fn list(
        &self,
        filter: &Filter,
        after: Option<&Cursor>,
        limit: usize,
    ) -> Result<Page, Error> {
        let tree = self.inner.tree.clone();
        let (filter, after) = (filter.clone(), after.cloned());
        let walk = move || {
            let now = Timestamp::now();
            // The cursor is the last key's bytes in hex: a key that is not UTF-8 (no
            // key idem writes) still pages on.
            let range = match &after {
                Some(after) => {
                    let from = unhex(&after.0).ok_or_else(|| {
                        Error::store("sled", "a listing cursor this store did not make")
                    })?;
                    tree.range::<Vec<u8>, _>((
                        std::ops::Bound::Excluded(from),
                        std::ops::Bound::Unbounded,
                    ))
                }
                None => tree.iter(),
            };
            let entries = range.filter_map(|entry| match entry {
                Ok((k, bytes)) => {
                    let key = Key::from_text(String::from_utf8_lossy(&k));
                    let record = match std::str::from_utf8(&k) {
                        Ok(_) => Record::decode(key.as_str(), &bytes),
                        Err(_) => Err(Error::CorruptRecord {
                            key: key.clone(),
                            reason: "the key is not UTF-8: no key idem writes".to_owned(),
                        }),
                    };
                    match record {
                        Ok(record) if record.is_expired(now) => None,
                        record => Some(Ok((k, key, record))),
                    }
                }
                Err(e) => Some(Err(sled_error(e))),
            });
            let cursor = |k: ::sled::IVec| Cursor(k.iter().map(|b| format!("{b:02x}")).collect());
            page_by_key(entries, cursor, &filter, limit, now)
        };
        let page = blocking::run(walk)
            .await
            .unwrap_or_else(|| Err(Error::store("sled", "the listing walk panicked")))?;
        if !page.records.is_empty() && !self.inner.commit.settled() {
            // What is listed is what a crash would leave.
            self.flush().await?;
        }
        Ok(page)
    }

    async fn resolve(
        &self,
        key: &Key,
        token: Token,
        resolution: Resolution<'_>,
    ) -> Result<Fenced, Error> {
        self.write_if(key, true, |current, now| {
            decide_resolution(current, token, resolution, now)
        })
        .await
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>, Error> {
        let now = Timestamp::now();
        let record = self
            .read(key)?
            .map(|(_, r)| r)
            .filter(|r| !r.is_expired(now));
        if record.is_some() && !self.inner.commit.settled() {
            // What is returned is what a crash would leave.
            self.flush().await?;
        }
        Ok(record)
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

    /// A compare-and-swap: removed only if the record read is still there.
    async fn delete_settled(&self, key: &Key) -> Result<bool, Error> {
        Ok(self.write_if(key, true, decide_settled_removal).await? == Fenced::Applied)
    }

    /// Walks the listing; each record is judged again and removed in one
    /// compare-and-swap, and the removals are flushed once, at the end.
    async fn delete_matching(&self, filter: &Filter) -> Result<u64, Error> {
        let (mut removed, mut after) = (0, None);
        loop {
            let page = self.list(filter, after.as_ref(), WALK_PAGE).await?;
            for listed in &page.records {
                let (gone, _) = self.update(&listed.key, false, |current, now| match current {
                    Some(r) if !r.is_expired(now) && filter.matches(&listed.key, r, now) => {
                        (true, Some(None))
                    }
                    _ => (false, None),
                })?;
                removed += u64::from(gone);
            }
            match page.next {
                Some(next) => after = Some(next),
                None => break,
            }
        }
        self.flush().await?;
        Ok(removed)
    }

    /// Walks the tree and removes expired records, reading only their headers. The walk
    /// runs on a tokio blocking thread (when there is a runtime and the OS starts one),
    /// so calls go on while a large store is purged; each removal is a
    /// compare-and-swap, so a key re-claimed meanwhile is left alone.
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
        let removed = blocking::run(walk)
            .await
            .unwrap_or_else(|| Err(Error::store("sled", "the purge walk panicked")))?;
        if removed > 0 {
            self.flush().await?;
        }
        Ok(removed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::ClaimRequest;

    /// A completed record that a crash could still take back (a durable write is under
    /// way, not yet flushed) is not replayed without a claim; the claim replays it only
    /// after a flush, and once nothing is pending the hit path answers again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_result_is_replayed_only_once_it_is_durable() {
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open(dir.path()).unwrap();
        let key = Key::from_text("durable-replay");
        let fingerprint = Fingerprint::from_bytes([3; 32]);
        let request = |token| ClaimRequest {
            origin: crate::store::Origin::new("run", "tool"),
            fingerprint,
            token,
            lease: Duration::from_secs(60),
            ttl: Duration::from_secs(60),
            take_over_expired: true,
            retry_failed: true,
        };
        let owner = Token::generate().unwrap();
        store.claim(&key, &request(owner)).await.unwrap();
        store
            .complete(
                &key,
                owner,
                Outcome::Completed(b"\"m-1\""),
                Duration::from_secs(60),
            )
            .await
            .unwrap();
        let answers = |store: &SledStore| {
            let mut answered = false;
            store.with_completed_result(&key, &fingerprint, &mut |_| answered = true);
            answered
        };
        assert!(answers(&store), "a flushed result is replayed at once");

        // Another durable write is under way: what a reader sees may not be on disk.
        let writing = store.inner.commit.writing();
        assert!(!answers(&store), "replayed while a write was pending");
        let flushes = || store.inner.commit.state.lock().unwrap().durable;
        let before = flushes();
        let ticket = store.inner.commit.ticket();
        drop(writing);
        let claim = store
            .claim(&key, &request(Token::generate().unwrap()))
            .await;
        assert_eq!(claim.unwrap(), Claim::Completed(b"\"m-1\"".to_vec()));
        assert!(
            flushes() >= ticket && flushes() > before,
            "the claim replayed without a flush"
        );
        assert!(
            answers(&store),
            "nothing pending: the hit path answers again"
        );
    }
}
