//! `idem proxy`: exactly-once `tools/call` in front of an MCP server written in any
//! language, with no change to it.
//!
//! ```text
//! idem proxy -- npx -y some-mcp-server                     # stdio in front of a stdio server
//! idem proxy --listen 127.0.0.1:8931 -- python server.py   # streamable HTTP in front of it
//! idem proxy --listen 127.0.0.1:8931 --upstream http://127.0.0.1:9000/mcp   # HTTP in front of HTTP
//! ```
//!
//! Every message passes through unchanged in both directions (initialize, lists,
//! resources, prompts, notifications, progress, the server's own requests), except
//! `tools/call` of a tool with side effects, which follows `idem_core::mcp`'s rules:
//! the key is the run id in `_meta["idem/run"]`, the tool and its arguments; a retry
//! gets the first result, marked `_meta["idem/replayed"] = true`. See
//! `docs/frameworks.md`.

mod http;
mod remote;
mod session;
mod upstream;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use idem_core::mcp::{Policy, WithoutRun};
use idem_core::{OnCancel, Store, Tool};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::{mpsc, oneshot, watch};

use session::{ClientSink, Session};
use upstream::Upstream;

/// `idem proxy`'s options.
#[derive(Args, Clone, Debug)]
pub struct ProxyArgs {
    /// Serve MCP's streamable HTTP at this address (`http://ADDR/mcp`), one upstream
    /// process per client session, instead of stdio.
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// The MCP server is at this streamable HTTP URL (`http://HOST:PORT/mcp`), instead of
    /// a command the proxy starts.
    #[arg(long, conflicts_with = "command")]
    pub upstream: Option<String>,
    /// How long a call's result is kept for retries.
    #[arg(long, default_value = "24h", value_parser = humantime::parse_duration)]
    pub ttl: Duration,
    /// How long a claim of a proxy that died is held before another may take it.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub lease: Option<Duration>,
    /// At most once: a call that may have run when its server or proxy died is never
    /// run again; its retry gets an `outcome unknown` error until an operator resolves
    /// it (`idem resolve`). By default, at least once: it runs again.
    #[arg(long)]
    pub at_most_once: bool,
    /// Protect this tool too, even if it is declared read-only (repeatable).
    #[arg(long = "protect", value_name = "TOOL")]
    pub protect: Vec<String>,
    /// Leave this tool unprotected (repeatable).
    #[arg(long = "exempt", value_name = "TOOL")]
    pub exempt: Vec<String>,
    /// The request `_meta` field the run id is read from.
    #[arg(long, default_value = idem_core::mcp::RUN_META_KEY)]
    pub run_meta_key: String,
    /// Forward calls without a run id unprotected, instead of refusing them.
    #[arg(long)]
    pub forward_without_run: bool,
    /// Store tool results with `isError: true` too (by default the next call runs).
    #[arg(long)]
    pub store_tool_errors: bool,
    /// The name this server's records are kept under, in every key (default: its
    /// command line, or its URL): proxies in front of one server share records, and
    /// two servers' tools of one name never do. Give proxies one name to share records
    /// across different command lines.
    #[arg(long, value_name = "NAME")]
    pub scope: Option<String>,
    /// The MCP server to start, and its arguments.
    #[arg(
        last = true,
        required_unless_present = "upstream",
        value_name = "COMMAND"
    )]
    pub command: Vec<String>,
}

impl ProxyArgs {
    /// The rules these options give, with records in `store`.
    fn policy(&self, store: Arc<dyn Store>) -> Policy {
        let options = self.clone();
        let scope = Value::String(self.server_name());
        let make = move |tool: Tool| {
            // The proxy drops a call whose server died under it: its claim is then
            // settled by the delivery policy (see `Session::protected_call`).
            let mut tool = tool
                .ttl(options.ttl)
                .on_cancel(OnCancel::Abort)
                .scope(scope.clone());
            if let Some(lease) = options.lease {
                tool = tool.lease(lease);
            }
            if options.at_most_once {
                tool = tool.at_most_once();
            }
            tool
        };
        let mut policy = Policy::new()
            .shared_store(store)
            .run_meta_key(self.run_meta_key.as_str())
            .without_run(if self.forward_without_run {
                WithoutRun::Forward
            } else {
                WithoutRun::Refuse
            });
        if self.store_tool_errors {
            policy = policy.store_tool_errors();
        }
        for name in &self.protect {
            policy = policy.tool(make(Tool::new(name.as_str())));
        }
        for name in &self.exempt {
            policy = policy.exempt(name.as_str());
        }
        policy.defaults(make)
    }

    /// The name of the server's records: `--scope`, else its URL or command line.
    fn server_name(&self) -> String {
        match (&self.scope, &self.upstream) {
            (Some(scope), _) => scope.clone(),
            (None, Some(url)) => url.clone(),
            (None, None) => self.command.join(" "),
        }
    }
}

/// Runs the proxy until its client goes away (stdio) or it is stopped (HTTP).
pub async fn run(args: ProxyArgs, store: Arc<dyn Store>) -> Result<(), String> {
    // stdout may carry the protocol: logs go to stderr (`RUST_LOG` for more).
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("idem=info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
    let policy = args.policy(store);
    let server = match args.upstream {
        Some(url) => Server::Url(url),
        None => Server::Command(args.command),
    };
    match args.listen {
        Some(addr) => http::serve(addr, policy, server).await,
        None => stdio(policy, server).await,
    }
}

/// The upstream MCP server: a command the proxy starts (and restarts), or a URL.
#[derive(Clone, Debug)]
pub enum Server {
    Command(Vec<String>),
    Url(String),
}

/// Messages for a stdio client: one line each on stdout, in order.
struct Stdout(mpsc::UnboundedSender<Value>);

impl ClientSink for Stdout {
    fn send(&self, message: Value) {
        let _ = self.0.send(message);
    }
}

impl Stdout {
    fn start() -> (Arc<Self>, tokio::task::JoinHandle<()>) {
        let (sender, mut messages) = mpsc::unbounded_channel::<Value>();
        let writer = tokio::spawn(async move {
            let mut stdout = tokio::io::stdout();
            while let Some(message) = messages.recv().await {
                let mut line = message.to_string();
                line.push('\n');
                if stdout.write_all(line.as_bytes()).await.is_err() || stdout.flush().await.is_err()
                {
                    break;
                }
            }
        });
        (Arc::new(Stdout(sender)), writer)
    }
}

/// Starts the upstream for `session`; an error if it cannot be started.
async fn start_upstream(
    session: &Arc<Session>,
    server: Server,
) -> Result<(watch::Sender<bool>, tokio::task::JoinHandle<()>), String> {
    let (closing, closing_seen) = watch::channel(false);
    let command = match server {
        Server::Url(url) => {
            let connection = remote::connect(Arc::clone(session), url, closing_seen);
            return Ok((closing, tokio::spawn(connection)));
        }
        Server::Command(command) => command,
    };
    let (started, start) = oneshot::channel();
    let supervisor = tokio::spawn(upstream::supervise(
        Arc::clone(session),
        command.clone(),
        closing_seen,
        started,
    ));
    match start.await {
        Ok(Ok(())) => Ok((closing, supervisor)),
        Ok(Err(error)) => Err(format!("cannot start `{}`: {error}", command.join(" "))),
        Err(_) => Err(format!("cannot start `{}`", command.join(" "))),
    }
}

/// Stdio in front of a stdio server: the client's stdin to the server, the server's
/// stdout to the client's, until the client closes stdin; then the calls in flight
/// finish and record their results before the server is stopped.
async fn stdio(policy: Policy, server: Server) -> Result<(), String> {
    let (stdout, writer) = Stdout::start();
    let session = Session::new(policy, Upstream::default(), stdout);
    let (closing, supervisor) = start_upstream(&session, server).await?;
    let mut stdin = BufReader::new(tokio::io::stdin()).lines();
    loop {
        match stdin.next_line().await {
            Ok(Some(line)) => on_client_line(&session, line),
            Ok(None) => break,
            Err(error) => {
                tracing::warn!(%error, "idem proxy: cannot read stdin; stopping");
                break;
            }
        }
    }
    finish_calls(&session).await;
    let _ = closing.send(true);
    let _ = supervisor.await;
    drop(session);
    // What is left for the client is written before the proxy exits.
    let _ = tokio::time::timeout(Duration::from_secs(2), writer).await;
    Ok(())
}

/// One line from the client: a message (or a batch of them), or, if it is not JSON,
/// passed on for the server to answer.
fn on_client_line(session: &Arc<Session>, line: String) {
    if line.trim().is_empty() {
        return;
    }
    match serde_json::from_str::<Value>(&line) {
        Ok(Value::Array(batch)) => batch.into_iter().for_each(|m| session.on_client_message(m)),
        Ok(message) => session.on_client_message(message),
        Err(_) => session.upstream().send_line(line),
    }
}

/// Waits for the client's calls in flight to finish and record their results (up to an
/// hour: a client that went away retries later, and gets them), and for its other
/// requests to be answered (up to [`FORWARDED_GRACE`]: nothing is recorded of them, and
/// a server that never answers one must not hold the proxy).
async fn finish_calls(session: &Session) {
    let start = tokio::time::Instant::now();
    loop {
        let waited = start.elapsed();
        let calls = session.calls_in_flight() > 0 && waited < Duration::from_secs(3600);
        let others = session.forwarded_in_flight() > 0 && waited < FORWARDED_GRACE;
        if !calls && !others {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// How long a closing session waits for the answers to requests other than calls.
const FORWARDED_GRACE: Duration = Duration::from_secs(5);
