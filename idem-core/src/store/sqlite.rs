//! `SqliteStore`: records in one SQLite file that several processes on one machine
//! share (feature `sqlite`).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use rusqlite::types::{ToSqlOutput, ValueRef};
use rusqlite::{Connection, ErrorCode, OpenFlags, OptionalExtension, Row, TransactionBehavior};

use crate::blocking;
use crate::error::{Error, Fault, StoreErrorKind};
use crate::key::Fingerprint;
use crate::key_text::Key;
use crate::record::{Meta, Origin, Record, State, Timestamp, Token};
use crate::store::{
    decide_claim, decide_fenced, decide_resolution, decide_settled_removal, page_by_key, unhex,
    Claim, ClaimRequest, Cursor, Fenced, Filter, Outcome, OwnerWrite, Page, Resolution, Store,
    WALK_PAGE,
};

/// `SqliteStore`: records in one SQLite database file, which several processes on one
/// machine open at once (feature `sqlite`; SQLite itself is compiled in, nothing to
/// install).
///
/// ```no_run
/// # fn main() -> Result<(), idem_core::Error> {
/// let store = idem_core::SqliteStore::open("/var/lib/my-agent/idem.sqlite")?;
/// # Ok(()) }
/// ```
///
/// Choose it over the default sled store when more than one process uses the records:
/// one MCP server process per client, an agent and a worker beside it, or an operator
/// running the `idem` command while agents run. Choose Postgres or Redis when the
/// processes are on several machines.
///
/// # Several processes
///
/// The database is in WAL mode: readers never wait for the writer, and writes take
/// SQLite's one write lock for a few statements. Every claim, completion, renewal and
/// release is one `BEGIN IMMEDIATE` transaction that reads the record, decides with
/// the same rules as every other store ([`decide_claim`], [`decide_fenced`]) and writes
/// it back: of any number of processes claiming one key, one acquires it. Times are
/// this machine's clock, which every process on it shares. A hit is one `SELECT`,
/// outside any transaction.
///
/// Writes of one store handle are queued in the process (an async lock around its one
/// writing connection). A write that finds the lock held by another process waits for
/// it asynchronously, trying again after a pause of 20 µs doubling up to 1 ms (its
/// thread runs other tasks meanwhile, and its caller may give up), for at most the
/// store's [timeout](SqliteStoreBuilder::timeout), then fails with an [`Error::Store`]
/// that says so: a process that holds the lock for long (a long transaction, a process
/// stopped with SIGSTOP mid-write) costs the others an error, never a hang. The timeout
/// bounds the whole write, its turn in the process's queue included.
///
/// # Durability
///
/// By default (`synchronous = NORMAL` in WAL mode) a committed claim or result survives
/// the crash of any process (kill -9, panic, OOM kill): it is in the WAL file before
/// the call goes on. Against **power loss or a kernel crash** the last commits may be
/// lost; [`SqliteStoreBuilder::fsync`] sets `synchronous = FULL`, which syncs the WAL
/// at every commit, like sled's option of the same name.
///
/// # Schema
///
/// One table (`idem_records` by default, [`SqliteStoreBuilder::table`]), readable in
/// SQL: `sqlite3 PATH "select tool, state, json_extract(result, '$.message_id') from
/// idem_records"`.
///
/// ```sql
/// CREATE TABLE idem_records (
///     key          TEXT PRIMARY KEY NOT NULL, -- `<tool>.<sha-256 hex>`
///     fingerprint  BLOB NOT NULL,             -- SHA-256 of the call: key parts and whole input
///     state        TEXT NOT NULL,             -- 'in_progress', 'completed' or 'failed'
///     token        BLOB,                      -- in progress: the claiming call's fencing token
///     lease_until  INTEGER,                   -- in progress: when the claim counts as abandoned
///     result,                                 -- completed / failed: the result or error, JSON text
///     created_at   INTEGER NOT NULL,          -- the row's last write
///     expires_at   INTEGER NOT NULL,          -- the row is absent to idem from then on
///     -- who and what happened, for operators (no decision reads them):
///     run_id TEXT, tenant TEXT, call_id TEXT, tool TEXT,
///     claimed_at INTEGER NOT NULL, completed_at INTEGER, renewed_at INTEGER,
///     attempts INTEGER NOT NULL, takeovers INTEGER NOT NULL
/// );
/// CREATE INDEX idem_records_expires_at ON idem_records (expires_at);
/// ```
///
/// Times are milliseconds since the Unix epoch (`datetime(expires_at / 1000,
/// 'unixepoch')` shows one). A result that is not UTF-8 (no JSON is; only a [`Store`]
/// used directly can store one) is kept as a `BLOB`, which `json_extract` refuses: a
/// query over such a table filters on `typeof(result) = 'text'`.
///
/// The file is the store: removing it (or its `-wal` and `-shm` files) while processes
/// use it loses every record, as with any database, and processes that had it open go
/// on writing to the removed file.
#[derive(Clone)]
pub struct SqliteStore {
    inner: Arc<Inner>,
}

struct Inner {
    path: PathBuf,
    timeout: Duration,
    fsync: bool,
    sql: Sql,
    /// The one connection this handle writes through; writes queue for it.
    writer: tokio::sync::Mutex<Connection>,
    /// Idle connections for reads (WAL readers do not wait for the writer).
    readers: Mutex<Vec<Connection>>,
}

/// How many idle reading connections a handle keeps.
const IDLE_READERS: usize = 8;

/// The most rows one statement of a purge deletes (one short write transaction).
const PURGE_BATCH: i64 = 1_000;

/// The columns of a record, in the order [`decode_row`] reads them.
const COLUMNS: &str = "fingerprint, state, token, lease_until, result, created_at, expires_at, \
     run_id, tenant, call_id, tool, claimed_at, completed_at, renewed_at, attempts, takeovers";

/// The statements, with the table name filled in.
struct Sql {
    table: String,
    read: String,
    replayable: String,
    insert: String,
    update: String,
    delete: String,
    delete_returning: String,
    purge: String,
    list_first: String,
    list_after: String,
}

impl Sql {
    fn new(t: &str) -> Self {
        Sql {
            read: format!("SELECT {COLUMNS} FROM {t} WHERE key = ?1"),
            replayable: format!(
                "SELECT result FROM {t} WHERE key = ?1 AND state = 'completed' \
                 AND fingerprint = ?2 AND expires_at > ?3"
            ),
            // An expired row is replaced by a new claim.
            insert: format!(
                "INSERT OR REPLACE INTO {t} (key, {COLUMNS}) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17)"
            ),
            // A row rewritten in place: its key's index entry stays.
            update: format!(
                "UPDATE {t} SET fingerprint = ?2, state = ?3, token = ?4, lease_until = ?5, \
                 result = ?6, created_at = ?7, expires_at = ?8, run_id = ?9, tenant = ?10, \
                 call_id = ?11, tool = ?12, claimed_at = ?13, completed_at = ?14, \
                 renewed_at = ?15, attempts = ?16, takeovers = ?17 WHERE key = ?1"
            ),
            delete: format!("DELETE FROM {t} WHERE key = ?1"),
            // Whether the row was live; a damaged expiry (not a number) counts as live.
            // `?1` the key's bytes as text, `?3` as a `BLOB`: a row written by hand may
            // have either.
            delete_returning: format!(
                "DELETE FROM {t} WHERE key = ?1 OR key = ?3 \
                 RETURNING typeof(expires_at) <> 'integer' OR expires_at > ?2"
            ),
            purge: format!(
                "DELETE FROM {t} WHERE key IN \
                 (SELECT key FROM {t} WHERE expires_at <= ?1 ORDER BY expires_at LIMIT ?2)"
            ),
            list_first: format!(
                "SELECT key, {COLUMNS} FROM {t} WHERE expires_at > ?1 ORDER BY key"
            ),
            list_after: format!(
                "SELECT key, {COLUMNS} FROM {t} WHERE expires_at > ?1 AND key > ?2 ORDER BY key"
            ),
            table: t.to_owned(),
        }
    }

    fn schema(&self, base: &str) -> String {
        let t = &self.table;
        format!(
            "CREATE TABLE IF NOT EXISTS {t} (
                key          TEXT PRIMARY KEY NOT NULL,
                fingerprint  BLOB NOT NULL,
                state        TEXT NOT NULL,
                token        BLOB,
                lease_until  INTEGER,
                result,
                created_at   INTEGER NOT NULL,
                expires_at   INTEGER NOT NULL,
                run_id       TEXT,
                tenant       TEXT,
                call_id      TEXT,
                tool         TEXT,
                claimed_at   INTEGER NOT NULL,
                completed_at INTEGER,
                renewed_at   INTEGER,
                attempts     INTEGER NOT NULL,
                takeovers    INTEGER NOT NULL
            );
            CREATE INDEX IF NOT EXISTS \"{base}_expires_at\" ON {t} (expires_at);"
        )
    }
}

fn sqlite_error(e: rusqlite::Error) -> Error {
    Error::store("sqlite", Fault::chained(e))
}

/// Whether `e` says the write lock is held by another connection.
fn is_busy(e: &rusqlite::Error) -> bool {
    matches!(e, rusqlite::Error::SqliteFailure(f, _)
        if matches!(f.code, ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked))
}

/// The error for a write lock that stayed held past the store's timeout.
fn held_too_long(path: &Path, timeout: Duration, source: rusqlite::Error) -> Error {
    Error::store_of_kind(
        "sqlite",
        StoreErrorKind::HeldElsewhere,
        Fault::new(
            format!(
                "the write lock of {} stayed held by another connection until the store's \
                 timeout ({timeout:?}) ran out: a long transaction in another process, or a \
                 process stopped while writing",
                path.display()
            ),
            source,
        ),
    )
}

/// Opens a connection to `path` with the store's settings.
fn connect(path: &Path, fsync: bool, timeout: Duration) -> Result<Connection, Error> {
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
        | OpenFlags::SQLITE_OPEN_CREATE
        | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = Connection::open_with_flags(path, flags).map_err(|e| cannot_open(path, e))?;
    conn.busy_timeout(timeout).map_err(sqlite_error)?;
    let synchronous = if fsync { "FULL" } else { "NORMAL" };
    // SQLite opens the file at the first statement: a file it cannot open fails here.
    conn.execute_batch(&format!("PRAGMA synchronous = {synchronous};"))
        .map_err(|e| cannot_open(path, e))?;
    Ok(conn)
}

/// The error for a file the store cannot open or set up, naming it and its cause.
fn cannot_open(path: &Path, source: rusqlite::Error) -> Error {
    Error::store(
        "sqlite",
        Fault::new(
            format!(
                "cannot open the store in {}: {source} (the file and its directory must be \
                 writable: the store keeps its -wal and -shm files beside it)",
                path.display()
            ),
            source,
        ),
    )
}

impl SqliteStore {
    /// The default table name.
    pub const DEFAULT_TABLE: &'static str = "idem_records";

    /// The default bound on each operation's wait for another process's write lock.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

    /// Opens (creating if needed) the store in database file `path`, durable against
    /// process crashes (see [Durability](SqliteStore#durability)), with the table
    /// made if missing. Any number of processes may have the file open at once.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, Error> {
        Self::builder(path).open()
    }

    /// A store in database file `path`, with options.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), idem_core::Error> {
    /// let store = idem_core::SqliteStore::builder("/var/lib/my-agent/idem.sqlite")
    ///     .fsync(true) // durable against power loss, not only process crashes
    ///     .timeout(std::time::Duration::from_secs(2))
    ///     .open()?;
    /// # Ok(()) }
    /// ```
    pub fn builder(path: impl AsRef<Path>) -> SqliteStoreBuilder {
        SqliteStoreBuilder {
            path: path.as_ref().to_owned(),
            fsync: false,
            timeout: Self::DEFAULT_TIMEOUT,
            table: Self::DEFAULT_TABLE.to_owned(),
        }
    }

    fn open_with(builder: SqliteStoreBuilder) -> Result<Self, Error> {
        let SqliteStoreBuilder {
            path,
            fsync,
            timeout,
            table,
        } = builder;
        crate::store::check_timeout("sqlite", timeout, Duration::ZERO, crate::store::MILLIS_I32)?;
        if !is_identifier(&table) {
            return Err(Error::store_of_kind(
                "sqlite",
                StoreErrorKind::Config,
                format!(
                    "invalid table name `{table}`: use letters, digits and underscores, not \
                     starting with a digit"
                ),
            ));
        }
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| {
                Error::store(
                    "sqlite",
                    format!("cannot create the directory {}: {e}", dir.display()),
                )
            })?;
        }
        let mut writer = connect(&path, fsync, timeout)?;
        // Every step names the file: a read-only file or filesystem fails here, at once.
        let setting_up = |e: rusqlite::Error| match is_busy(&e) {
            true => held_too_long(&path, timeout, e),
            false => cannot_open(&path, e),
        };
        if writer.is_readonly(rusqlite::MAIN_DB).map_err(setting_up)? {
            return Err(Error::store(
                "sqlite",
                format!(
                    "{} is read-only: the store writes every call",
                    path.display()
                ),
            ));
        }
        // Several processes may open a new file at once. Changing its journal mode needs
        // the file to itself: two connections that both read it and both ask for that
        // would wait on each other, so SQLite answers `SQLITE_BUSY` at once, whatever
        // the busy timeout. The setup is tried again until it goes through or the
        // timeout runs out; a file already in WAL mode is left as it is.
        let started = Instant::now();
        let until_free = |step: &mut dyn FnMut() -> rusqlite::Result<()>| loop {
            match step() {
                Err(e) if is_busy(&e) && started.elapsed() < timeout => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                done => return done,
            }
        };
        let mut mode = String::new();
        until_free(&mut || {
            mode = writer.query_row("PRAGMA journal_mode", [], |row| row.get(0))?;
            if !mode.eq_ignore_ascii_case("wal") {
                mode = writer.query_row("PRAGMA journal_mode = WAL", [], |row| row.get(0))?;
            }
            Ok(())
        })
        .map_err(setting_up)?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(Error::store(
                "sqlite",
                format!(
                    "{} cannot be put in WAL mode (its journal mode stays `{mode}`), which \
                     several processes need: keep it on a local filesystem",
                    path.display()
                ),
            ));
        }
        let sql = Sql::new(&format!("\"{table}\""));
        until_free(&mut || {
            let tx = writer.transaction_with_behavior(TransactionBehavior::Immediate)?;
            tx.execute_batch(&sql.schema(&table))?;
            tx.commit()
        })
        .map_err(setting_up)?;
        // A held lock is `SQLITE_BUSY` at once: writes wait for it themselves (see
        // `write_raw`).
        writer.busy_timeout(Duration::ZERO).map_err(sqlite_error)?;
        tracing::debug!(path = %path.display(), table, fsync, "opened sqlite store");
        Ok(SqliteStore {
            inner: Arc::new(Inner {
                path,
                timeout,
                fsync,
                sql,
                writer: tokio::sync::Mutex::new(writer),
                readers: Mutex::new(Vec::new()),
            }),
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Runs `f` on an idle reading connection (a new one if none is idle).
    fn with_reader<T>(&self, f: impl FnOnce(&Connection) -> Result<T, Error>) -> Result<T, Error> {
        let conn = self.reader()?;
        let result = f(&conn);
        self.give_back(conn);
        result
    }

    fn reader(&self) -> Result<Connection, Error> {
        let idle = crate::sync::lock(&self.inner.readers).pop();
        match idle {
            Some(conn) => Ok(conn),
            None => connect(&self.inner.path, self.inner.fsync, self.inner.timeout),
        }
    }

    fn give_back(&self, conn: Connection) {
        let mut idle = crate::sync::lock(&self.inner.readers);
        if idle.len() < IDLE_READERS {
            idle.push(conn);
        }
    }

    /// Runs `f` in a write transaction (`BEGIN IMMEDIATE`) and commits it. Writes of
    /// this handle take turns. A write lock held by another process is waited for
    /// asynchronously: the transaction is tried again after a pause (20 µs, doubling up
    /// to 1 ms; SQLite's own busy handler sleeps 1 to 100 ms, and blocks the thread),
    /// so the call's task can be abandoned meanwhile and its thread runs other tasks.
    /// The store's timeout bounds the whole: the turn and the wait for the lock (a
    /// write queued behind others waiting for a stopped process fails when its own
    /// timeout is up, not one timeout after theirs). No transaction stays open across
    /// a pause: each try begins, decides, writes and commits in one step.
    async fn write_raw<T>(
        &self,
        mut f: impl FnMut(&Connection) -> Result<T, Error>,
    ) -> Result<T, Error> {
        let deadline = Instant::now() + self.inner.timeout;
        // The writes ahead in the queue began earlier, so each ends by this deadline.
        let mut conn = self.inner.writer.lock().await;
        let mut transact = |conn: &mut Connection| -> Result<Result<T, Error>, rusqlite::Error> {
            let tx = Transaction::begin(conn)?;
            let result = f(tx.0);
            if result.is_ok() {
                tx.commit()?;
            }
            // Dropped without a commit: rolled back.
            Ok(result)
        };
        let mut pause = Duration::from_micros(20);
        loop {
            let attempt = match self.inner.fsync {
                // Every commit syncs the WAL, which takes milliseconds: off the worker.
                true => in_place(|| transact(&mut conn)),
                false => transact(&mut conn),
            };
            match attempt {
                Err(e) if is_busy(&e) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(held_too_long(&self.inner.path, self.inner.timeout, e));
                    }
                    crate::timer::sleep_until((now + pause).min(deadline)).await;
                    pause = (pause * 2).min(Duration::from_millis(1));
                }
                done => return done.map_err(sqlite_error)?,
            }
        }
    }

    /// A read-decide-write of the record under `key` in one write transaction: `decide`
    /// sees the live record (`None` if absent or expired) and returns a result and
    /// what to write (`Some(None)` deletes).
    async fn write<T>(
        &self,
        key: &Key,
        mut decide: impl FnMut(Option<&Record>, Timestamp) -> (T, Option<Option<Record>>),
    ) -> Result<T, Error> {
        let sql = &self.inner.sql;
        self.write_raw(|tx| {
            let current = read(tx, sql, key)?;
            let (result, write) = decide(current.as_ref(), Timestamp::now());
            match write {
                None => {}
                Some(Some(record)) => {
                    // `current` is `None` for an expired row too: that one is replaced.
                    let statement = match current {
                        Some(_) => &sql.update,
                        None => &sql.insert,
                    };
                    upsert(tx, statement, key, &record)?
                }
                Some(None) => {
                    tx.prepare_cached(&sql.delete)
                        .and_then(|mut s| s.execute([key.as_str()]))
                        .map_err(sqlite_error)?;
                }
            }
            Ok(result)
        })
        .await
    }

    /// A fenced write: applied only if `decide` accepts the current record.
    async fn write_if(
        &self,
        key: &Key,
        decide: impl Fn(Option<&Record>, Timestamp) -> Result<Option<Record>, Fenced>,
    ) -> Result<Fenced, Error> {
        self.write(key, |current, now| match decide(current, now) {
            Ok(write) => (Fenced::Applied, Some(write)),
            Err(fenced) => (fenced, None),
        })
        .await
    }
}

/// A write transaction (`BEGIN IMMEDIATE`) through statements prepared once (rusqlite's
/// `Transaction` prepares `BEGIN` and `COMMIT` anew each time: 3,900 instructions a
/// miss); rolled back unless committed.
struct Transaction<'c>(&'c Connection);

impl<'c> Transaction<'c> {
    fn begin(conn: &'c Connection) -> rusqlite::Result<Self> {
        conn.prepare_cached("BEGIN IMMEDIATE")?.execute([])?;
        Ok(Transaction(conn))
    }

    fn commit(self) -> rusqlite::Result<()> {
        self.0.prepare_cached("COMMIT")?.execute([])?;
        Ok(())
    }
}

impl Drop for Transaction<'_> {
    fn drop(&mut self) {
        if !self.0.is_autocommit() {
            // Still open (not committed, or its commit failed): give it up, so the next
            // write can begin.
            if let Err(e) = self.0.execute_batch("ROLLBACK") {
                tracing::warn!(error = %e, "idem: a SQLite rollback failed");
            }
        }
    }
}

/// Runs `work` where it may block for milliseconds: in `block_in_place` on a
/// multi-threaded tokio runtime, in place otherwise.
fn in_place<R>(work: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(work)
        }
        _ => work(),
    }
}

/// Whether `name` is a plain SQL identifier.
fn is_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && name.len() <= 64
}

/// The record under `key`, `None` if absent or expired.
fn read(conn: &Connection, sql: &Sql, key: &Key) -> Result<Option<Record>, Error> {
    let now = Timestamp::now();
    let mut stmt = conn.prepare_cached(&sql.read).map_err(sqlite_error)?;
    let record = stmt
        .query_row([key.as_str()], |row| Ok(decode_row(key, row, 0)))
        .optional()
        .map_err(sqlite_error)?
        .transpose()?;
    Ok(record.filter(|r| !r.is_expired(now)))
}

/// A key column's value as stored, text or `BLOB`: where a listing goes on from.
struct RawKey {
    blob: bool,
    bytes: Vec<u8>,
}

impl RawKey {
    /// The cursor: `t` or `b`, then the bytes in hex.
    fn cursor(self) -> Cursor {
        Cursor(format!(
            "{}{}",
            if self.blob { 'b' } else { 't' },
            hex(&self.bytes)
        ))
    }

    /// The key as an SQL literal of its bytes, `x'…'`: how a key that is not UTF-8
    /// text is listed, and what [`SqliteStore::delete`] takes for it.
    fn literal(&self) -> String {
        format!("x'{}'", hex(&self.bytes))
    }

    /// The bytes a key given to `delete` stands for: those of its text, or those an
    /// `x'…'` literal spells (no key idem writes looks like one).
    fn of(key: &Key) -> Vec<u8> {
        let text = key.as_str();
        text.strip_prefix("x'")
            .and_then(|rest| rest.strip_suffix('\''))
            .and_then(unhex)
            .unwrap_or_else(|| text.as_bytes().to_vec())
    }

    fn from_cursor(cursor: &Cursor) -> Option<Self> {
        let (kind, hex) = cursor.0.split_at_checked(1)?;
        let blob = match kind {
            "t" => false,
            "b" => true,
            _ => return None,
        };
        Some(RawKey {
            blob,
            bytes: unhex(hex)?,
        })
    }
}

impl rusqlite::ToSql for RawKey {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(ToSqlOutput::Borrowed(match self.blob {
            true => ValueRef::Blob(&self.bytes),
            false => ValueRef::Text(&self.bytes),
        }))
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A payload as SQL: JSON text, or a `BLOB` if it is not UTF-8.
struct Payload<'a>(&'a [u8]);

impl rusqlite::ToSql for Payload<'_> {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(ToSqlOutput::Borrowed(match std::str::from_utf8(self.0) {
            Ok(_) => ValueRef::Text(self.0),
            Err(_) => ValueRef::Blob(self.0),
        }))
    }
}

fn ms(t: Timestamp) -> i64 {
    i64::try_from(t.0).unwrap_or(i64::MAX)
}

/// Writes `record` under `key` with `statement` (`Sql::insert` or `Sql::update`).
fn upsert(conn: &Connection, statement: &str, key: &Key, record: &Record) -> Result<(), Error> {
    let (state, token, lease, payload) = match &record.state {
        State::InProgress { token, lease_until } => (
            "in_progress",
            Some(token.0.to_be_bytes()),
            Some(ms(*lease_until)),
            None,
        ),
        State::Completed { result } => ("completed", None, None, Some(Payload(result))),
        State::Failed { error } => ("failed", None, None, Some(Payload(error))),
    };
    let meta = &record.meta;
    let origin = meta.origin.as_ref();
    let mut stmt = conn.prepare_cached(statement).map_err(sqlite_error)?;
    stmt.execute(rusqlite::params![
        key.as_str(),
        record.fingerprint.as_bytes().as_slice(),
        state,
        token.as_ref().map(|t| t.as_slice()),
        lease,
        payload,
        ms(record.created_at),
        ms(record.expires_at),
        origin.map(|o| &*o.run_id),
        origin.and_then(|o| o.tenant.as_deref()),
        origin.and_then(|o| o.call_id.as_deref()),
        origin.map(|o| &*o.tool),
        ms(meta.claimed_at),
        meta.completed_at.map(ms),
        meta.renewed_at.map(ms),
        meta.attempts,
        meta.takeovers,
    ])
    .map_err(sqlite_error)?;
    Ok(())
}

/// The record in a row whose columns from `at` on are [`COLUMNS`]. A value of the
/// wrong type or shape is [`Error::CorruptRecord`] (a row written by hand, say).
fn decode_row(key: &Key, row: &Row<'_>, at: usize) -> Result<Record, Error> {
    let corrupt = |reason: String| Error::CorruptRecord {
        key: key.clone(),
        reason,
    };
    let column = |i: usize| -> Result<ValueRef<'_>, Error> {
        row.get_ref(at + i)
            .map_err(|e| corrupt(format!("column {i}: {e}")))
    };
    let int = |i: usize, name: &str| -> Result<Option<i64>, Error> {
        match column(i)? {
            ValueRef::Null => Ok(None),
            ValueRef::Integer(n) => Ok(Some(n)),
            _ => Err(corrupt(format!("{name} is not an integer"))),
        }
    };
    let time = |i: usize, name: &str| -> Result<Option<Timestamp>, Error> {
        Ok(int(i, name)?.map(|ms| Timestamp(ms.max(0) as u64)))
    };
    let required = |i: usize, name: &str| -> Result<Timestamp, Error> {
        time(i, name)?.ok_or_else(|| corrupt(format!("{name} is NULL")))
    };
    let text = |i: usize, name: &str| -> Result<Option<Arc<str>>, Error> {
        match column(i)? {
            ValueRef::Null => Ok(None),
            ValueRef::Text(t) => std::str::from_utf8(t)
                .map(|t| Some(Arc::from(t)))
                .map_err(|_| corrupt(format!("{name} is not UTF-8"))),
            _ => Err(corrupt(format!("{name} is not text"))),
        }
    };
    let bytes = |i: usize| -> Result<Option<&[u8]>, Error> {
        match column(i)? {
            ValueRef::Null => Ok(None),
            ValueRef::Blob(b) | ValueRef::Text(b) => Ok(Some(b)),
            _ => Err(corrupt(format!("column {i} is a number"))),
        }
    };
    let fingerprint: [u8; 32] = bytes(0)?
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| corrupt("fingerprint is not 32 bytes".into()))?;
    let state = match (
        text(1, "state")?.as_deref(),
        bytes(2)?,
        int(3, "lease_until")?,
    ) {
        (Some("in_progress"), Some(token), Some(lease)) => {
            let token: [u8; 16] = token
                .try_into()
                .map_err(|_| corrupt("token is not 16 bytes".into()))?;
            State::InProgress {
                token: Token(u128::from_be_bytes(token)),
                lease_until: Timestamp(lease.max(0) as u64),
            }
        }
        (Some("completed"), ..) => State::Completed {
            result: bytes(4)?
                .ok_or_else(|| corrupt("a completed record without a result".into()))?
                .to_vec(),
        },
        (Some("failed"), ..) => State::Failed {
            error: bytes(4)?
                .ok_or_else(|| corrupt("a failed record without an error".into()))?
                .to_vec(),
        },
        (state, ..) => {
            return Err(corrupt(format!(
                "state {state:?} with missing fields (in_progress needs token and lease_until)"
            )))
        }
    };
    let origin = match (text(7, "run_id")?, text(10, "tool")?) {
        (Some(run_id), Some(tool)) => Some(Origin {
            tenant: text(8, "tenant")?,
            run_id,
            call_id: text(9, "call_id")?,
            tool,
        }),
        _ => None,
    };
    let count = |i: usize, name: &str| -> Result<u32, Error> {
        Ok(int(i, name)?.unwrap_or(0).clamp(0, i64::from(u32::MAX)) as u32)
    };
    Ok(Record {
        fingerprint: Fingerprint::from_bytes(fingerprint),
        created_at: required(5, "created_at")?,
        expires_at: required(6, "expires_at")?,
        state,
        meta: Meta {
            origin,
            claimed_at: required(11, "claimed_at")?,
            completed_at: time(12, "completed_at")?,
            renewed_at: time(13, "renewed_at")?,
            attempts: count(14, "attempts")?,
            takeovers: count(15, "takeovers")?,
        },
    })
}

/// Options for [`SqliteStore`]; [`SqliteStore::builder`] makes one.
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `open` is called"]
pub struct SqliteStoreBuilder {
    path: PathBuf,
    fsync: bool,
    timeout: Duration,
    table: String,
}

impl SqliteStoreBuilder {
    /// Sync the WAL at every commit (`synchronous = FULL`), so claims and results
    /// survive power loss and kernel crashes, not only process crashes. Costs one
    /// `fsync` per write.
    pub fn fsync(mut self, fsync: bool) -> Self {
        self.fsync = fsync;
        self
    }

    /// The longest an operation waits for the write lock while another process holds
    /// it (SQLite's busy timeout); past it, the operation fails with [`Error::Store`].
    /// Default: [`SqliteStore::DEFAULT_TIMEOUT`]. Zero waits not at all; at most
    /// `i32::MAX` milliseconds (about 24.8 days, the most SQLite takes), or opening the
    /// store fails with a [`StoreErrorKind::Config`] error.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The table of records (default [`SqliteStore::DEFAULT_TABLE`]): letters, digits
    /// and underscores.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// Opens (creating if needed) the store. See [`SqliteStore::open`].
    pub fn open(self) -> Result<SqliteStore, Error> {
        SqliteStore::open_with(self)
    }
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.inner.path)
            .field("table", &self.inner.sql.table)
            .finish()
    }
}

#[async_trait]
impl Store for SqliteStore {
    fn name(&self) -> &'static str {
        "sqlite"
    }

    async fn claim(&self, key: &Key, request: &ClaimRequest) -> Result<Claim, Error> {
        self.write(key, |current, now| {
            let (claim, write) = decide_claim(current, request, now);
            (claim, write.map(Some))
        })
        .await
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        outcome: Outcome<'_>,
        ttl: Duration,
    ) -> Result<Fenced, Error> {
        let write = OwnerWrite::Complete { outcome, ttl };
        self.write_if(key, |current, now| {
            decide_fenced(current, token, write, now)
        })
        .await
    }

    async fn release(&self, key: &Key, token: Token) -> Result<Fenced, Error> {
        self.write_if(key, |current, now| {
            decide_fenced(current, token, OwnerWrite::Release, now)
        })
        .await
    }

    async fn renew(
        &self,
        key: &Key,
        token: Token,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Fenced, Error> {
        let write = OwnerWrite::Renew { lease, ttl };
        self.write_if(key, |current, now| {
            decide_fenced(current, token, write, now)
        })
        .await
    }

    /// One `SELECT` on an idle reading connection; the result is lent from SQLite's
    /// row, not copied.
    fn with_completed_result(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        replay: &mut dyn FnMut(&[u8]),
    ) {
        let now = ms(Timestamp::now());
        // Any error leaves the answer to the claim, which reports it.
        let _ = self.with_reader(|conn| {
            let mut stmt = conn
                .prepare_cached(&self.inner.sql.replayable)
                .map_err(sqlite_error)?;
            let mut rows = stmt
                .query(rusqlite::params![
                    key.as_str(),
                    fingerprint.as_bytes().as_slice(),
                    now
                ])
                .map_err(sqlite_error)?;
            if let Some(row) = rows.next().map_err(sqlite_error)? {
                if let Ok(ValueRef::Text(result) | ValueRef::Blob(result)) = row.get_ref(0) {
                    replay(result);
                }
            }
            Ok(())
        });
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>, Error> {
        self.with_reader(|conn| read(conn, &self.inner.sql, key))
    }

    async fn delete(&self, key: &Key) -> Result<bool, Error> {
        let sql = &self.inner.sql;
        let now = ms(Timestamp::now());
        let bytes = RawKey::of(key);
        let (text, blob) = (
            RawKey {
                blob: false,
                bytes: bytes.clone(),
            },
            RawKey { blob: true, bytes },
        );
        self.write_raw(|tx| {
            let mut stmt = tx
                .prepare_cached(&sql.delete_returning)
                .map_err(sqlite_error)?;
            let mut rows = stmt
                .query(rusqlite::params![text, now, blob])
                .map_err(sqlite_error)?;
            // Whether a row removed was live (a damaged expiry counts as live).
            let mut live = false;
            while let Some(row) = rows.next().map_err(sqlite_error)? {
                live |= row.get::<_, Option<bool>>(0).map_err(sqlite_error)? == Some(true);
            }
            Ok(live)
        })
        .await
    }

    async fn delete_settled(&self, key: &Key) -> Result<bool, Error> {
        Ok(self.write_if(key, decide_settled_removal).await? == Fenced::Applied)
    }

    /// Walks the listing; each record is judged again and removed in its own write
    /// transaction.
    async fn delete_matching(&self, filter: &Filter) -> Result<u64, Error> {
        let (mut removed, mut after) = (0, None);
        loop {
            let page = self.list(filter, after.as_ref(), WALK_PAGE).await?;
            for listed in &page.records {
                let gone = self
                    .write(&listed.key, |current, now| match current {
                        Some(r) if filter.matches(&listed.key, r, now) => (true, Some(None)),
                        _ => (false, None),
                    })
                    .await?;
                removed += u64::from(gone);
            }
            match page.next {
                Some(next) => after = Some(next),
                None => return Ok(removed),
            }
        }
    }

    /// Deletes expired rows by the expiry index, 1,000 a transaction, so
    /// calls of other processes go on between batches.
    async fn purge_expired(&self) -> Result<u64, Error> {
        let sql = &self.inner.sql;
        let mut removed = 0;
        loop {
            let now = ms(Timestamp::now());
            let batch = self
                .write_raw(|tx| {
                    tx.prepare_cached(&sql.purge)
                        .and_then(|mut s| s.execute(rusqlite::params![now, PURGE_BATCH]))
                        .map_err(sqlite_error)
                })
                .await?;
            removed += batch as u64;
            if (batch as i64) < PURGE_BATCH {
                return Ok(removed);
            }
        }
    }

    /// Pages in key order, read on a blocking thread from an idle connection. A row
    /// that does not decode is listed as unreadable.
    async fn list(
        &self,
        filter: &Filter,
        after: Option<&Cursor>,
        limit: usize,
    ) -> Result<Page, Error> {
        let conn = self.reader()?;
        let this = self.clone();
        let (filter, after) = (filter.clone(), after.cloned());
        let walk = move || {
            let page = (|| {
                let now = Timestamp::now();
                let sql = &this.inner.sql;
                let mut stmt = match &after {
                    Some(_) => conn.prepare_cached(&sql.list_after),
                    None => conn.prepare_cached(&sql.list_first),
                }
                .map_err(sqlite_error)?;
                // A key as stored: no key idem writes is other than UTF-8 text, but a
                // row written by hand may be, and is listed as unreadable.
                let decode =
                    |row: &Row<'_>| -> rusqlite::Result<(RawKey, Key, Result<Record, Error>)> {
                        let raw = match row.get_ref(0)? {
                            ValueRef::Text(t) => RawKey {
                                blob: false,
                                bytes: t.to_vec(),
                            },
                            ValueRef::Blob(b) => RawKey {
                                blob: true,
                                bytes: b.to_vec(),
                            },
                            other => RawKey {
                                blob: false,
                                bytes: format!("{other:?}").into_bytes(),
                            },
                        };
                        let (key, record) = match (raw.blob, std::str::from_utf8(&raw.bytes)) {
                            (false, Ok(key)) => {
                                let key = Key::from_text(key);
                                let record = decode_row(&key, row, 1);
                                (key, record)
                            }
                            // Shown as its bytes, in a form `delete` takes back.
                            _ => {
                                let key = Key::from_text(raw.literal());
                                let reason = "the key is not UTF-8 text (no key idem writes): \
                                              shown as an SQL literal of its bytes"
                                    .to_owned();
                                (key.clone(), Err(Error::CorruptRecord { key, reason }))
                            }
                        };
                        Ok((raw, key, record))
                    };
                let after = match &after {
                    Some(cursor) => Some(RawKey::from_cursor(cursor).ok_or_else(|| {
                        Error::store("sqlite", "a listing cursor this store did not make")
                    })?),
                    None => None,
                };
                let rows = match &after {
                    Some(after) => stmt.query_map(rusqlite::params![ms(now), after], decode),
                    None => stmt.query_map(rusqlite::params![ms(now)], decode),
                }
                .map_err(sqlite_error)?;
                let entries = rows.map(|row| row.map_err(sqlite_error));
                page_by_key(entries, RawKey::cursor, &filter, limit, now)
            })();
            this.give_back(conn);
            page
        };
        blocking::run(walk)
            .await
            .unwrap_or_else(|| Err(Error::store("sqlite", "the listing walk panicked")))
    }

    async fn resolve(
        &self,
        key: &Key,
        token: Token,
        resolution: Resolution<'_>,
    ) -> Result<Fenced, Error> {
        self.write_if(key, |current, now| {
            decide_resolution(current, token, resolution, now)
        })
        .await
    }
}
