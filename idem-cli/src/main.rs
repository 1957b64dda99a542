//! `idem`: the operator's command for idem's idempotency records.
//!
//! It lists a store's records (by run, tenant, tool, state and age), shows one with its
//! result, counts them by state, evicts one or a run's, resolves a call whose outcome is
//! unknown, and purges expired records, in a sled directory, a Postgres table or a
//! Redis prefix. Output is aligned text for people, or JSON with `--json` (one object
//! per line for listings, so a million records stream). See `docs/operations.md`.
//!
//! Exit codes: 0 done (also when the reader of the output went away, as `| head` does);
//! 1 the store failed, or the output could not be written; 2 bad usage; 3 no such record
//! (or no such store); 4 refused (the record is not in a state the command applies to,
//! or eviction was not confirmed); 5 the sled directory is held by a running process.

mod output;
mod proxy;

use std::io::{BufRead, IsTerminal, Write};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use clap::{ArgGroup, Args, Parser, Subcommand};
use idem_core::store::{
    delete_settled_matching, Fenced, Filter, Record, Resolution, State, StateKind, Timestamp,
};
use idem_core::{Error, Key, PostgresStore, RedisStore, SledStore, SqliteStore, Store};

use output::Output;

/// Inspect and operate idem's idempotency records.
#[derive(Parser)]
#[command(name = "idem", version, about, long_about = None)]
struct Cli {
    /// The store: `sled:PATH`, `sqlite:PATH`, `postgres://...` or `redis://...`.
    /// Default: the sled store the library opens by default (`$IDEM_DIR`, else
    /// `.idem`). A SQLite store can be read and changed while agents run on it.
    #[arg(long, global = true, env = "IDEM_STORE")]
    store: Option<String>,
    /// The Postgres or SQLite table (`idem_records` by default).
    #[arg(long, global = true)]
    table: Option<String>,
    /// The Redis key prefix (`idem:` by default).
    #[arg(long, global = true)]
    prefix: Option<String>,
    /// JSON instead of text: one object per line for `ls`, one object otherwise.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List records, a page at a time (a million records never sit in memory).
    Ls {
        #[command(flatten)]
        filter: FilterArgs,
        /// Stop after this many records.
        #[arg(long)]
        limit: Option<u64>,
    },
    /// Show one record: who made it, its history and its result.
    Show {
        /// The record's key (as `ls` prints it).
        key: String,
    },
    /// Count records by state.
    Stats {
        #[command(flatten)]
        filter: FilterArgs,
    },
    /// Remove a record (the next call with its input runs again), or all of a run's. A
    /// running call's claim is left alone unless --force is given.
    Evict {
        /// The record's key.
        #[arg(required_unless_present = "run", conflicts_with = "run")]
        key: Option<String>,
        /// Remove every record of this run instead.
        #[arg(long)]
        run: Option<String>,
        /// With `--run`: only the run's records in this tenant.
        #[arg(long, requires = "run")]
        tenant: Option<String>,
        /// Remove running calls' claims too: each such call loses its claim, its result
        /// is not stored, and a retry runs its body again, at-most-once or not.
        #[arg(long)]
        force: bool,
        /// Do not ask.
        #[arg(long, short)]
        yes: bool,
    },
    /// Settle a call whose outcome is unknown (an abandoned claim): --completed JSON or
    /// --release.
    #[command(group(ArgGroup::new("how").required(true).args(["completed", "release"])))]
    Resolve {
        /// The record's key.
        key: String,
        /// It happened, with this result: the JSON the tool's `Ok` value serializes to
        /// (a retry that cannot read it as that type gets `StoredResult`). The next call
        /// replays it.
        #[arg(long, value_name = "JSON")]
        completed: Option<String>,
        /// It never happened: remove the claim, so the next call runs.
        #[arg(long)]
        release: bool,
        /// How long the result is kept (default: the TTL the call claimed with).
        #[arg(
            long,
            value_parser = humantime::parse_duration,
            requires = "completed",
            conflicts_with = "release"
        )]
        ttl: Option<Duration>,
    },
    /// Remove expired records (Redis expires its own: nothing to do there).
    Purge,
    /// Serve an MCP server (any language) with exactly-once `tools/call`: a retried call
    /// with the same run id (`_meta["idem/run"]`) gets the first result. Stdio by
    /// default; `--listen` for streamable HTTP. Records go to `--store` (default: a
    /// SQLite file that every proxy of this user shares; see `docs/frameworks.md`).
    Proxy(proxy::ProxyArgs),
}

#[derive(Args, Clone)]
struct FilterArgs {
    /// Only this run's records.
    #[arg(long)]
    run: Option<String>,
    /// Only this tenant's records.
    #[arg(long)]
    tenant: Option<String>,
    /// Only this tool's records.
    #[arg(long)]
    tool: Option<String>,
    /// Only records in this state: running, abandoned, completed or failed.
    #[arg(long)]
    state: Option<StateKind>,
    /// Only records first claimed longer ago than this (`90s`, `1h`, `2days`).
    #[arg(long, value_parser = humantime::parse_duration)]
    older_than: Option<Duration>,
}

impl FilterArgs {
    fn filter(&self) -> Filter {
        let now = Timestamp::now().as_millis();
        Filter {
            run_id: self.run.clone(),
            tenant: self.tenant.clone(),
            tool: self.tool.clone(),
            state: self.state,
            claimed_before: self.older_than.map(|age| {
                let age = u64::try_from(age.as_millis()).unwrap_or(u64::MAX);
                Timestamp::from_millis(now.saturating_sub(age))
            }),
        }
    }
}

/// How a command ended, as an exit code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Exit {
    /// The reader of the output went away (`| head`): stop, quietly.
    Closed = 0,
    Failed = 1,
    Usage = 2,
    NotFound = 3,
    Refused = 4,
    Busy = 5,
}

/// A failure to report: its exit code and message.
struct Failure(Exit, String);

impl From<Error> for Failure {
    fn from(error: Error) -> Self {
        let mut text = error.to_string();
        if text.contains("SQLSTATE 42P01") {
            return Failure(
                Exit::NotFound,
                format!(
                    "{text}\n  The table does not exist in this database: check --table; \
                     workers create it (PostgresStore::connect runs migrate)"
                ),
            );
        }
        let mut source = std::error::Error::source(&error);
        while let Some(cause) = source {
            let cause_text = cause.to_string();
            if !text.contains(&cause_text) {
                text += &format!("\n  caused by: {cause_text}");
            }
            source = cause.source();
        }
        Failure(Exit::Failed, text)
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::from(Exit::Failed as u8);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure(Exit::Closed, _)) => ExitCode::SUCCESS,
        Err(Failure(exit, message)) => {
            // Each line cleaned: a key or a run id in a message is data, not terminal input.
            let message: Vec<String> = message.lines().map(output::clean).collect();
            eprintln!("error: {}", message.join("\n"));
            ExitCode::from(exit as u8)
        }
    }
}

async fn run(cli: Cli) -> Result<(), Failure> {
    if let Command::Proxy(args) = &cli.command {
        let store = open_for_proxy(&cli).await?;
        return proxy::run(args.clone(), store)
            .await
            .map_err(|message| Failure(Exit::Failed, message));
    }
    let store = open(&cli).await?;
    let out = Output::new(cli.json);
    match cli.command {
        Command::Ls { filter, limit } => ls(&*store, &filter.filter(), limit, &out).await,
        Command::Show { key } => {
            let (key, record) = find(&*store, &key).await?;
            emit(&out.record(&key, &record, Timestamp::now()))
        }
        Command::Stats { filter } => {
            let counts = store.count(&filter.filter()).await?;
            emit(&out.counts(&counts))
        }
        Command::Evict {
            key: Some(key),
            force,
            yes,
            ..
        } => evict_key(&*store, Key::from_text(key), force, yes, &out).await,
        Command::Evict {
            run,
            tenant,
            force,
            yes,
            ..
        } => {
            let filter = Filter {
                run_id: run.clone(),
                tenant,
                ..Filter::default()
            };
            let run = output::clean(&run.unwrap_or_default());
            evict_run(&*store, filter, &run, force, yes, &out).await
        }
        Command::Resolve {
            key,
            completed,
            release,
            ttl,
        } => resolve(&*store, &key, completed, release, ttl, &out).await,
        Command::Purge => {
            let removed = store.purge_expired().await?;
            emit(&out.done(&format!("removed {removed} expired records"), removed))
        }
        Command::Proxy(_) => unreachable!("the proxy runs above"),
    }
}

/// Evicts one record. A running call's claim is refused without `force`: removing it
/// would make the call lose its claim and its result, and a retry run the body again.
/// Without `force` the record is removed only if it is still not a running call's claim
/// when the store removes it (`Store::delete_settled`).
async fn evict_key(
    store: &dyn Store,
    key: Key,
    force: bool,
    yes: bool,
    out: &Output,
) -> Result<(), Failure> {
    let now = Timestamp::now();
    let record = match store.get(&key).await {
        Ok(Some(record)) => Some(record),
        Ok(None) => return Err(not_found(&key)),
        // What cannot be read can still be removed.
        Err(e @ (Error::CorruptRecord { .. } | Error::UnsupportedFormat { .. })) => {
            confirm(
                yes,
                &format!("Evict {key}? It holds a value this build cannot read: {e}"),
            )?;
            None
        }
        Err(e) => return Err(e.into()),
    };
    let Some(record) = record else {
        let removed = store.delete(&key).await?;
        return emit(&out.done(&format!("evicted {key}"), u64::from(removed)));
    };
    let state = StateKind::of(&record, now);
    if let (StateKind::Running, State::InProgress { lease_until, .. }, false) =
        (state, &record.state, force)
    {
        return Err(Failure(
            Exit::Refused,
            format!(
                "`{key}` is running: its call holds it for {} more (its lease, renewed while \
                 its process lives). Evicting it would make that call lose its claim: its \
                 result would not be stored, and a retry would run its body again, \
                 at-most-once or not. Wait for it to end, or pass --force",
                humantime::format_duration(Duration::from_secs(
                    lease_until.remaining(now).as_secs()
                ))
            ),
        ));
    }
    confirm(
        yes,
        &format!(
            "Evict {key} ({state}{})? The next call with its input runs again.",
            output::whose(&record)
        ),
    )?;
    let removed = match force {
        true => store.delete(&key).await?,
        // Removed only if it is still not a running call's claim when the store removes
        // it (a call may have taken an abandoned claim over, or claimed an expired
        // record again, since it was read).
        false => {
            if !store.delete_settled(&key).await? {
                return Err(Failure(
                    Exit::Refused,
                    format!(
                        "`{key}` changed while it was being evicted (a call took it over, or \
                         it was settled or removed); look again with `idem show {key}`"
                    ),
                ));
            }
            true
        }
    };
    emit(&out.done(&format!("evicted {key}"), u64::from(removed)))
}

/// Evicts a run's records. Without `force`, its running calls' claims stay (and are
/// counted): the run's completed, failed and abandoned records are removed, each only
/// if still so when the store removes it (`store::delete_settled_matching`).
async fn evict_run(
    store: &dyn Store,
    filter: Filter,
    run: &str,
    force: bool,
    yes: bool,
    out: &Output,
) -> Result<(), Failure> {
    let counts = store.count(&filter).await?;
    let running = counts.get(StateKind::Running);
    // Unreadable values match no run.
    let total = counts.total() - counts.unreadable;
    let n = if force { total } else { total - running };
    let running_left = match (force, running) {
        (false, 1..) => format!(" ({running} running, left alone: --force evicts them too)"),
        _ => String::new(),
    };
    if n == 0 {
        return emit(&out.done(&format!("nothing to evict{running_left}"), 0));
    }
    confirm(
        yes,
        &format!(
            "Evict the {n} records of run {run}{running_left}? Its calls run again when retried."
        ),
    )?;
    if force {
        let removed = store.delete_matching(&filter).await?;
        return emit(&out.done(&format!("evicted {removed} records of run {run}"), removed));
    }
    // Each record is removed only if it is still in a settled state when the store
    // removes it, so a call that claims one meanwhile keeps its claim.
    let removed = delete_settled_matching(store, &filter).await?;
    // What is left now: running calls' claims (some maybe made while this ran).
    let left = store.count(&filter).await?;
    let left = left.total() - left.unreadable;
    let left = match left {
        0 => String::new(),
        n => format!(" ({n} left: running calls' claims; --force evicts them too)"),
    };
    emit(&out.done(
        &format!("evicted {removed} records of run {run}{left}"),
        removed,
    ))
}

/// The store a proxy keeps its records in: the one `--store` names (created if need
/// be, as a worker creates it), else a SQLite file every proxy of this user shares.
async fn open_for_proxy(cli: &Cli) -> Result<Arc<dyn Store>, Failure> {
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
            Arc::new(builder.connect().await.map_err(usage)?)
        } else if spec.starts_with("redis://") || spec.starts_with("rediss://") {
            let mut builder = RedisStore::builder(&spec);
            if let Some(prefix) = &cli.prefix {
                builder = builder.prefix(prefix);
            }
            Arc::new(builder.connect().await.map_err(usage)?)
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

/// The store the command names.
async fn open(cli: &Cli) -> Result<Arc<dyn Store>, Failure> {
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
            .map_err(usage);
    }
    if spec.starts_with("redis://") || spec.starts_with("rediss://") {
        let mut builder = RedisStore::builder(&spec);
        if let Some(prefix) = &cli.prefix {
            builder = builder.prefix(prefix);
        }
        return Ok(Arc::new(builder.connect().await.map_err(usage)?));
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
        Err(error) if held_elsewhere(&error) => Err(Failure(
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

/// Whether opening sled failed because another process holds the directory.
fn held_elsewhere(error: &Error) -> bool {
    let mut source: Option<&dyn std::error::Error> = Some(error);
    while let Some(e) = source {
        if e.to_string().contains("held by another process") {
            return true;
        }
        source = e.source();
    }
    false
}

/// A store's error on opening: a bad setting (an invalid table name, a URL that does
/// not parse) is bad usage; anything else, a failure.
fn usage(error: Error) -> Failure {
    let text = error.to_string();
    let bad_setting = [
        "invalid table name",
        "invalid connection URL",
        "InvalidClientConfig",
    ]
    .iter()
    .any(|s| text.contains(s));
    match bad_setting {
        true => Failure(Exit::Usage, text),
        false => error.into(),
    }
}

/// The live record under `key`, or the "not found" failure.
async fn find(store: &dyn Store, key: &str) -> Result<(Key, Record), Failure> {
    let key = Key::from_text(key);
    match store.get(&key).await? {
        Some(record) => Ok((key, record)),
        None => Err(not_found(&key)),
    }
}

fn not_found(key: &Key) -> Failure {
    Failure(
        Exit::NotFound,
        format!("no record under `{key}` (it may have expired)"),
    )
}

/// Writes `text` to stdout. A reader that went away ends the command quietly; any other
/// failure to write is one.
fn emit(text: &str) -> Result<(), Failure> {
    write_to(&mut std::io::stdout().lock(), text)
}

fn write_to(out: &mut impl Write, text: &str) -> Result<(), Failure> {
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
            Err(Failure(Exit::Closed, String::new()))
        }
        Err(e) => Err(Failure(
            Exit::Failed,
            format!("cannot write the output: {e}"),
        )),
    }
}

/// Asks `question` on the terminal unless `yes`; refuses without a terminal.
fn confirm(yes: bool, question: &str) -> Result<(), Failure> {
    if yes {
        return Ok(());
    }
    if !std::io::stdin().is_terminal() {
        return Err(Failure(
            Exit::Refused,
            format!("{question}\n  Not confirmed: stdin is not a terminal; pass --yes"),
        ));
    }
    eprint!("{question} [y/N] ");
    let _ = std::io::stderr().flush();
    let mut answer = String::new();
    let _ = std::io::stdin().lock().read_line(&mut answer);
    if matches!(answer.trim(), "y" | "Y" | "yes") {
        Ok(())
    } else {
        Err(Failure(
            Exit::Refused,
            "not confirmed; nothing changed".into(),
        ))
    }
}

/// Streams the listing, a page at a time.
async fn ls(
    store: &dyn Store,
    filter: &Filter,
    limit: Option<u64>,
    out: &Output,
) -> Result<(), Failure> {
    let (mut after, mut shown) = (None, 0u64);
    let mut stdout = std::io::stdout().lock();
    let mut header = Some(out.list_header());
    loop {
        let page = store.list(filter, after.as_ref(), 1_000).await?;
        for unreadable in &page.unreadable {
            let key = output::clean(unreadable.key.as_str());
            eprintln!(
                "warning: `{key}` holds a value this build cannot read ({}); \
                 `idem evict {key} --yes` removes it",
                output::clean(&unreadable.error.to_string())
            );
        }
        // The header once the store answered, so a failure is not preceded by it.
        let mut text = header.take().unwrap_or_default();
        for listed in &page.records {
            if limit.is_some_and(|limit| shown >= limit) {
                break;
            }
            text += &out.list_row(&listed.key, &listed.record, page.now);
            shown += 1;
        }
        write_to(&mut stdout, &text)?;
        match page.next {
            Some(next) if limit.is_none_or(|limit| shown < limit) => after = Some(next),
            _ => return Ok(()),
        }
    }
}

async fn resolve(
    store: &dyn Store,
    key: &str,
    completed: Option<String>,
    release: bool,
    ttl: Option<Duration>,
    out: &Output,
) -> Result<(), Failure> {
    let (key, record) = find(store, key).await?;
    let now = Timestamp::now();
    let State::InProgress { token, lease_until } = record.state else {
        return Err(Failure(
            Exit::Refused,
            format!(
                "`{key}` is {}: only an abandoned claim (state abandoned) has an unknown \
                 outcome; to make its next call run again, evict it",
                StateKind::of(&record, now)
            ),
        ));
    };
    if lease_until > now {
        return Err(Failure(
            Exit::Refused,
            format!(
                "`{key}` is running: its call holds it for {} more (its lease, renewed while \
                 its process lives); resolve it once it is abandoned",
                humantime::format_duration(Duration::from_secs(
                    lease_until.remaining(now).as_secs()
                ))
            ),
        ));
    }
    let text;
    let resolution = match completed {
        Some(json) => {
            text = json.trim().to_owned();
            if let Err(e) = serde_json::from_str::<serde_json::Value>(&text) {
                return Err(Failure(
                    Exit::Usage,
                    format!("--completed is not JSON: {e}"),
                ));
            }
            // The TTL the call claimed with: its record expires that long after its lease.
            let claimed = record.expires_at.remaining(lease_until);
            Resolution::Completed {
                result: text.as_bytes(),
                ttl: ttl.unwrap_or(claimed),
            }
        }
        // clap requires one of `--completed` and `--release`.
        None => Resolution::Released,
    };
    debug_assert!(release || matches!(resolution, Resolution::Completed { .. }));
    let what = match resolution {
        Resolution::Completed { .. } => "completed: its next call replays the result",
        Resolution::Released => "released: its next call runs",
    };
    match store.resolve(&key, token, resolution).await? {
        Fenced::Applied => {
            emit(&out.done(&format!("resolved {key} as {what}"), 1))
        }
        Fenced::LostLease => Err(Failure(
            Exit::Refused,
            format!("`{key}` changed while it was being resolved (a call took it over, or it was evicted); look again with `idem show {key}`"),
        )),
    }
}

/// Milliseconds since the epoch as a time people read.
fn time(t: Timestamp) -> String {
    let at = SystemTime::UNIX_EPOCH + Duration::from_millis(t.as_millis());
    humantime::format_rfc3339_seconds(at).to_string()
}
