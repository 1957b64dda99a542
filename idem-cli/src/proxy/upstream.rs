//! The upstream MCP server as a child process on stdio, restarted when it exits.
//!
//! Messages are JSON-RPC, one per line, both ways. While the child restarts, messages
//! for it wait; a restarted child is first given the client's `initialize` request and
//! `notifications/initialized` again (its answer stays with the proxy), so the client's
//! session goes on as if the server had never stopped.

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::{mpsc, watch};

use super::session::Session;

/// The way to the upstream's stdin.
enum Link {
    /// Open: each line goes to the child's stdin.
    Up(mpsc::UnboundedSender<String>),
    /// A new child is being started: only the proxy's own handshake goes to it; the
    /// rest waits in the backlog.
    Starting(mpsc::UnboundedSender<String>, Vec<String>),
    /// No child: lines wait in the backlog for the next one.
    Down(Vec<String>),
}

/// Sends to the upstream server (see the module docs). Cheap to clone.
#[derive(Clone)]
pub struct Upstream {
    link: Arc<Mutex<Link>>,
}

impl Default for Upstream {
    fn default() -> Self {
        Upstream {
            link: Arc::new(Mutex::new(Link::Down(Vec::new()))),
        }
    }
}

impl Upstream {
    fn link(&self) -> std::sync::MutexGuard<'_, Link> {
        self.link.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sends one message, now or once the server is up.
    pub fn send(&self, message: Value) {
        self.send_line(message.to_string());
    }

    /// Sends one line as it is (a client's line that is not JSON: the server answers it).
    pub fn send_line(&self, line: String) {
        match &mut *self.link() {
            Link::Up(sender) => {
                let _ = sender.send(line);
            }
            Link::Starting(_, backlog) | Link::Down(backlog) => backlog.push(line),
        }
    }

    /// Sends one message to a child being started, ahead of the backlog.
    pub fn send_first(&self, message: Value) {
        match &*self.link() {
            Link::Up(sender) | Link::Starting(sender, _) => {
                let _ = sender.send(message.to_string());
            }
            Link::Down(_) => {}
        }
    }

    /// Opens the link to a server that needs no handshake of the proxy's (one over
    /// HTTP): what waited is sent now.
    pub fn connected(&self, sender: mpsc::UnboundedSender<String>) {
        self.starting(sender);
        self.open();
    }

    fn starting(&self, sender: mpsc::UnboundedSender<String>) {
        let mut link = self.link();
        let backlog = match &mut *link {
            Link::Down(backlog) | Link::Starting(_, backlog) => std::mem::take(backlog),
            Link::Up(_) => Vec::new(),
        };
        *link = Link::Starting(sender, backlog);
    }

    fn open(&self) {
        let mut link = self.link();
        if let Link::Starting(sender, backlog) = &mut *link {
            for line in backlog.drain(..) {
                let _ = sender.send(line);
            }
            *link = Link::Up(sender.clone());
        }
    }

    /// Closes the link to the server (its stdin closes once what was sent is written);
    /// what waits for it waits for the next one.
    pub fn close(&self) {
        let mut link = self.link();
        let backlog = match &mut *link {
            Link::Starting(_, backlog) => std::mem::take(backlog),
            _ => Vec::new(),
        };
        *link = Link::Down(backlog);
    }

    /// The server is gone: the link closes, and what waited for it is dropped (see
    /// `Session::upstream_exited`).
    pub fn reset(&self) {
        *self.link() = Link::Down(Vec::new());
    }
}

/// Starts `command` and keeps it running for `session` until `closing` turns true:
/// a child that exits is started again (after 0.1 s, doubling to 5 s while it keeps
/// failing at once). Returns an error if the first start fails.
pub async fn supervise(
    session: Arc<Session>,
    command: Vec<String>,
    mut closing: watch::Receiver<bool>,
    started: tokio::sync::oneshot::Sender<std::io::Result<()>>,
) {
    let mut started = Some(started);
    let mut backoff = Duration::from_millis(100);
    let mut generation = 0u64;
    loop {
        let child = spawn(&command);
        let child = match (child, started.take()) {
            (Ok(child), Some(started)) => {
                let _ = started.send(Ok(()));
                child
            }
            (Ok(child), None) => child,
            (Err(error), Some(started)) => {
                let _ = started.send(Err(error));
                return;
            }
            (Err(error), None) => {
                tracing::warn!(%error, "idem proxy: cannot restart the MCP server; trying again");
                if wait_or_close(&mut closing, backoff).await {
                    return;
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        let began = Instant::now();
        let status = run_child(&session, child, generation, &mut closing).await;
        let closed = is_closing(&closing);
        session.upstream_exited(closed);
        if closed {
            return;
        }
        tracing::warn!(?status, "idem proxy: the MCP server exited; restarting it");
        if began.elapsed() > Duration::from_secs(10) {
            backoff = Duration::from_millis(100);
        }
        if wait_or_close(&mut closing, backoff).await {
            return;
        }
        backoff = (backoff * 2).min(Duration::from_secs(5));
        generation += 1;
    }
}

fn spawn(command: &[String]) -> std::io::Result<Child> {
    let (program, args) = command
        .split_first()
        .ok_or_else(|| std::io::Error::other("no command"))?;
    Command::new(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
}

/// Runs one child until it exits (or the proxy closes, which kills it).
async fn run_child(
    session: &Arc<Session>,
    mut child: Child,
    generation: u64,
    closing: &mut watch::Receiver<bool>,
) -> Option<std::process::ExitStatus> {
    let (Some(mut stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
        return None;
    };
    let (sender, mut lines) = mpsc::unbounded_channel::<String>();
    session.upstream().starting(sender);
    let writer = tokio::spawn(async move {
        while let Some(mut line) = lines.recv().await {
            line.push('\n');
            if stdin.write_all(line.as_bytes()).await.is_err() || stdin.flush().await.is_err() {
                break;
            }
        }
    });
    let reading = {
        let session = Arc::clone(session);
        tokio::spawn(async move {
            let mut stdout = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = stdout.next_line().await {
                match serde_json::from_str::<Value>(&line) {
                    Ok(message) => session.on_upstream_message(message),
                    Err(_) => tracing::debug!(
                        line,
                        "idem proxy: the MCP server wrote a line that is not JSON-RPC; dropped"
                    ),
                }
            }
        })
    };
    // The handshake runs while the child is watched: a child that dies during it is
    // restarted like any other.
    let handshake = async {
        if generation > 0 {
            if let Some(initialize) = session.initialize_request() {
                reinitialize(session, initialize).await;
            }
        }
        session.upstream().open();
        std::future::pending::<()>().await
    };
    let status = tokio::select! {
        status = child.wait() => status.ok(),
        () = handshake => None,
        _ = closing.wait_for(|closing| *closing) => None,
    };
    let status = match status {
        Some(status) => Some(status),
        None => {
            // Closing: its stdin is closed, as a client that went away closes it, and it
            // has a few seconds to exit on its own.
            session.upstream().close();
            match tokio::time::timeout(Duration::from_secs(5), child.wait()).await {
                Ok(status) => status.ok(),
                Err(_) => {
                    let _ = child.kill().await;
                    None
                }
            }
        }
    };
    // Whatever the child wrote before it exited is passed on before it counts as gone
    // (bounded: a grandchild may hold its stdout open).
    let mut reading = reading;
    if tokio::time::timeout(Duration::from_secs(2), &mut reading)
        .await
        .is_err()
    {
        reading.abort();
    }
    writer.abort();
    status
}

/// Starts a restarted server's session as the client started the first one.
async fn reinitialize(session: &Arc<Session>, initialize: Value) {
    let asked = session.ask_upstream_first(initialize);
    match tokio::time::timeout(Duration::from_secs(30), asked).await {
        Ok(Some(response)) if response.get("result").is_some() => {
            session
                .upstream()
                .send_first(json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
            tracing::info!("idem proxy: the restarted MCP server is initialized");
        }
        answer => {
            tracing::warn!(?answer, "idem proxy: the restarted MCP server did not accept the client's initialize request")
        }
    }
}

/// Waits `delay`; whether the proxy is closing.
async fn wait_or_close(closing: &mut watch::Receiver<bool>, delay: Duration) -> bool {
    let closed = tokio::time::timeout(delay, closing.wait_for(|closing| *closing)).await;
    // `Ok(Err(_))`: whoever could close it is gone, which closes it too.
    closed.is_ok()
}

/// Whether the proxy is closing this upstream: it said so, or whoever could say so is
/// gone (a session dropped while it started), which must not leave a server restarting.
fn is_closing(closing: &watch::Receiver<bool>) -> bool {
    *closing.borrow() || closing.has_changed().is_err()
}
