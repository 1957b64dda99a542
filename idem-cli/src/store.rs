//! The store a command names: `--store` (`sled:PATH`, `sqlite:PATH`, `postgres://...`,
//! `redis://...`), `--table` and `--prefix`.

use std::sync::Arc;

use idem_core::{PostgresStore, RedisStore, SledStore, SqliteStore, Store, StoreErrorKind};

use crate::failure::{Exit, Failure};
use crate::Cli;

/// The store the command names.
pub async fn open(cli: &Cli) -> Result<Arc<dyn Store>, Failure> {
    let spec = match &cli.store {
        Some(spec) => spec.clone(),
        None => format!("sled:{}", idem_core::default_store_dir().display()),
    };
    if spec.starts_with("postgres://") || spec.starts_with("postgresql://") {
        let mut builder = PostgresStore::builder(&spec);
        if let Some(table) = &cli.table {
            builder = builder.table(table);
        }
        // No migration: an operator's look changes nothing (and may be read-only).
        return builder
            .build()
            .map(|store| Arc::new(store) as Arc<dyn Store>)
            .map_err(Failure::from);
    }
    if spec.starts_with("redis://") || spec.starts_with("rediss://") {
        let mut builder = RedisStore::builder(&spec);
        if let Some(prefix) = &cli.prefix {
            builder = builder.prefix(prefix);
        }
        return Ok(Arc::new(builder.connect().await?));
    }
    if let Some(path) = spec.strip_prefix("sqlite:") {
        if !std::path::Path::new(path).is_file() {
            // Opening would create an empty store: say there is none instead.
            return Err(Failure(
                Exit::NotFound,
                format!("no SQLite store at `{path}`"),
            ));
        }
        let mut builder = SqliteStore::builder(path);
        if let Some(table) = &cli.table {
            builder = builder.table(table);
        }
        return Ok(Arc::new(builder.open()?));
    }
    let Some(path) = spec.strip_prefix("sled:") else {
        return Err(Failure(
            Exit::Usage,
            format!(
                "unknown store `{spec}`: use sled:PATH, sqlite:PATH, postgres://... or redis://..."
            ),
        ));
    };
    if !std::path::Path::new(path).join("conf").exists() {
        // Opening would create an empty store: say there is none instead.
        return Err(Failure(
            Exit::NotFound,
            format!("no sled store in `{path}` (set --store, IDEM_STORE or IDEM_DIR)"),
        ));
    }
    // A walk over the store reads each page once: sled's cache need not hold it.
    match SledStore::builder(path).cache_bytes(CACHE_BYTES).open() {
        Ok(store) => Ok(Arc::new(store)),
        Err(error) if error.store_kind() == Some(StoreErrorKind::HeldElsewhere) => Err(Failure(
            Exit::Busy,
            format!(
                "the sled store in `{path}` is open in a running process (an agent): sled lets \
                 one process open a directory at a time.\n  To look now, copy it and look at the \
                 copy: rm -rf /tmp/idem-copy && cp -r {path} /tmp/idem-copy && idem --store \
                 sled:/tmp/idem-copy ls\n  \
                 To change records (evict, resolve), stop the agent first, or run it on the \
                 Postgres or Redis store."
            ),
        )),
        Err(error) => Err(error.into()),
    }
}

/// The sled cache of a command: 8 MiB (a listing of 10⁶ records is as fast as with
/// sled's default 1 GiB, and takes a quarter of the memory).
const CACHE_BYTES: u64 = 8 << 20;

/// The store a proxy keeps its records in: the one `--store` names (created if need
/// be, as a worker creates it), else a SQLite file every proxy of this user shares.
pub async fn open_for_proxy(cli: &Cli) -> Result<Arc<dyn Store>, Failure> {
    let spec = match &cli.store {
        Some(spec) => spec.clone(),
        None => {
            let path = proxy_store_path();
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir).map_err(|e| {
                    Failure(
                        Exit::Failed,
                        format!("cannot create {}: {e}", dir.display()),
                    )
                })?;
            }
            format!("sqlite:{}", path.display())
        }
    };
    let table = cli.table.as_deref();
    let store: Arc<dyn Store> =
        if spec.starts_with("postgres://") || spec.starts_with("postgresql://") {
            let mut builder = PostgresStore::builder(&spec);
            if let Some(table) = table {
                builder = builder.table(table);
            }
            Arc::new(builder.connect().await?)
        } else if spec.starts_with("redis://") || spec.starts_with("rediss://") {
            let mut builder = RedisStore::builder(&spec);
            if let Some(prefix) = &cli.prefix {
                builder = builder.prefix(prefix);
            }
            Arc::new(builder.connect().await?)
        } else if let Some(path) = spec.strip_prefix("sqlite:") {
            let mut builder = SqliteStore::builder(path);
            if let Some(table) = table {
                builder = builder.table(table);
            }
            Arc::new(builder.open()?)
        } else if let Some(path) = spec.strip_prefix("sled:") {
            Arc::new(SledStore::open(path)?)
        } else {
            return Err(Failure(
                Exit::Usage,
                format!(
                "unknown store `{spec}`: use sqlite:PATH, sled:PATH, postgres://... or redis://..."
            ),
            ));
        };
    Ok(store)
}

/// The proxy's default store: `$IDEM_DIR/proxy.sqlite` if `IDEM_DIR` is set, else
/// `proxy.sqlite` in the user's state directory (`$XDG_STATE_HOME/idem`, else
/// `~/.local/state/idem`).
fn proxy_store_path() -> std::path::PathBuf {
    use std::path::PathBuf;
    if let Some(dir) = std::env::var_os("IDEM_DIR") {
        return PathBuf::from(dir).join("proxy.sqlite");
    }
    let state = std::env::var_os("XDG_STATE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".local/state")))
        .unwrap_or_else(|| PathBuf::from("."));
    state.join("idem").join("proxy.sqlite")
}
