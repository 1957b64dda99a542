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
//! (or no such store or table); 4 refused (the record is not in a state the command
//! applies to, or eviction was not confirmed); 5 another process holds the store (a sled
//! directory, or a SQLite write lock held past the store's timeout).
//!
//! `main` parses and dispatches: each subcommand is a module of `commands` (`proxy`
//! has its own folder), the store is opened in `store`, and `failure` maps errors to
//! exit codes by their kind, never by their text.

mod commands;
mod failure;
mod output;
mod proxy;
mod store;

use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use clap::{ArgGroup, Args, Parser, Subcommand};
use idem_core::store::{Filter, StateKind, Timestamp};
use idem_core::Key;

use failure::{Exit, Failure};
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

/// Runs the command.
async fn run(cli: Cli) -> Result<(), Failure> {
    let store = match &cli.command {
        Command::Proxy(_) => store::open_for_proxy(&cli).await?,
        _ => store::open(&cli).await?,
    };
    let out = Output::new(cli.json);
    let records = &*store;
    match cli.command {
        Command::Ls { filter, limit } => {
            commands::ls::run(records, &filter.filter(), limit, &out).await
        }
        Command::Show { key } => commands::show::run(records, &key, &out).await,
        Command::Stats { filter } => commands::stats::run(records, &filter.filter(), &out).await,
        Command::Evict {
            key: Some(key),
            force,
            yes,
            ..
        } => commands::evict::key(records, Key::from_text(key), force, yes, &out).await,
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
            commands::evict::run(records, filter, &run, force, yes, &out).await
        }
        Command::Resolve {
            key,
            completed,
            release,
            ttl,
        } => commands::resolve::run(records, &key, completed, release, ttl, &out).await,
        Command::Purge => commands::purge::run(records, &out).await,
        Command::Proxy(args) => proxy::run(args, store)
            .await
            .map_err(|message| Failure(Exit::Failed, message)),
    }
}

/// The latest time RFC 3339 writes: 9999-12-31T23:59:59Z.
const LATEST: Duration = Duration::from_secs(253_402_300_799);

/// Milliseconds since the epoch as a time people read (RFC 3339, to the second). A time
/// past year 9999 (a Postgres `infinity`, written into the table by hand) reads as the
/// latest one RFC 3339 writes.
fn time(t: Timestamp) -> String {
    let since = Duration::from_millis(t.as_millis()).min(LATEST);
    humantime::format_rfc3339_seconds(SystemTime::UNIX_EPOCH + since).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_past_year_9999_read_as_its_last_second() {
        assert_eq!(time(Timestamp::from_millis(0)), "1970-01-01T00:00:00Z");
        assert_eq!(time(Timestamp::from_millis(1_500)), "1970-01-01T00:00:01Z");
        for far in [253_402_300_799_000, 253_402_300_800_000, u64::MAX] {
            assert_eq!(time(Timestamp::from_millis(far)), "9999-12-31T23:59:59Z");
        }
    }
}
