//! An upstream MCP server reached over streamable HTTP (`--upstream URL`).
//!
//! Each message for it is one `POST` (concurrently: a slow tool call holds up nothing
//! else); its answer, a JSON body or a stream of server-sent events, is read message
//! by message. The server's `Mcp-Session-Id` (from its answer to `initialize`) goes on
//! every later request, and a `GET` stream carries the server's own messages. A server
//! that forgot the session (404: it restarted) is given the client's `initialize` again
//! and the message sent once more. A request whose connection fails before its answer
//! is answered with an error (a protected call is settled by its delivery policy).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use reqwest::header::{HeaderMap, HeaderValue, ACCEPT, CONTENT_TYPE};
use reqwest::StatusCode;
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch};

use super::session::Session;

const SESSION_HEADER: &str = "mcp-session-id";
const VERSION_HEADER: &str = "mcp-protocol-version";

/// The upstream's session: its id and the protocol version agreed.
#[derive(Default)]
struct Remote {
    session: Option<HeaderValue>,
    /// How many sessions the server has given: a request that met a 404 under one
    /// knows whether another has been started since.
    generation: u64,
    version: Option<HeaderValue>,
    /// Whether the `GET` stream of the server's own messages is open.
    listening: bool,
}

struct Connection {
    session: Arc<Session>,
    url: String,
    http: reqwest::Client,
    remote: Mutex<Remote>,
    /// Held while a new upstream session is started: one at a time.
    reinitializing: tokio::sync::Mutex<()>,
}

/// Connects `session` to the server at `url`, until `closing` turns true.
pub async fn connect(session: Arc<Session>, url: String, mut closing: watch::Receiver<bool>) {
    let (sender, mut lines) = mpsc::unbounded_channel::<String>();
    session.upstream().connected(sender);
    let connection = Arc::new(Connection {
        session,
        url,
        // A fresh connection for each request: one reused after the server went away
        // fails after the request was written, which reads as "may have run"; a fresh
        // one to a server that is down is refused at connect, which reads as "not run".
        http: reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .build()
            .unwrap_or_default(),
        remote: Mutex::default(),
        reinitializing: tokio::sync::Mutex::new(()),
    });
    loop {
        tokio::select! {
            line = lines.recv() => match line {
                Some(line) => {
                    let connection = Arc::clone(&connection);
                    tokio::spawn(async move { connection.post(line, true).await });
                }
                None => break,
            },
            _ = closing.wait_for(|closing| *closing) => break,
        }
    }
    connection.end().await;
}

impl Connection {
    fn remote(&self) -> std::sync::MutexGuard<'_, Remote> {
        self.remote.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The headers of a request; an `initialize` carries no session id.
    fn headers(&self, initialize: bool) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        headers.insert(
            ACCEPT,
            HeaderValue::from_static("application/json, text/event-stream"),
        );
        let remote = self.remote();
        if let (Some(session), false) = (&remote.session, initialize) {
            headers.insert(SESSION_HEADER, session.clone());
        }
        if let Some(version) = &remote.version {
            headers.insert(VERSION_HEADER, version.clone());
        }
        headers
    }

    /// Sends one message and passes on what the server answers. `again`: a server
    /// that forgot the session is given `initialize` again (once, whoever meets the
    /// 404 first) and the message sent once more.
    async fn post(self: &Arc<Self>, line: String, again: bool) {
        let message: Option<Value> = serde_json::from_str(&line).ok();
        let id = message
            .as_ref()
            .filter(|m| m.get("method").is_some())
            .and_then(|m| m.get("id"))
            .cloned();
        let is_initialize = message
            .as_ref()
            .and_then(|m| m.get("method"))
            .is_some_and(|m| m == "initialize");
        let generation = self.remote().generation;
        let sent = self
            .http
            .post(&self.url)
            .headers(self.headers(is_initialize))
            .body(line.clone())
            .send()
            .await;
        let response = match sent {
            Ok(response) => response,
            // Never sent: the request did not run.
            Err(error) if error.is_connect() => {
                let why = format!(
                    "cannot reach the MCP server at {}: {error}; the request was not sent",
                    self.url
                );
                return self.refused(id, &why);
            }
            Err(error) => {
                let why = format!("the connection to the MCP server failed: {error}");
                return self.failed(id, &why);
            }
        };
        let status = response.status();
        if status == StatusCode::NOT_FOUND && again && !is_initialize {
            if self.new_session_since(generation).await {
                return Box::pin(self.post(line, false)).await;
            }
            return self.refused(
                id,
                "the MCP server forgot the session and did not start a new one",
            );
        }
        if is_initialize && status.is_success() {
            let mut remote = self.remote();
            remote.session = response.headers().get(SESSION_HEADER).cloned();
            remote.generation += 1;
        }
        if id.is_none() && status.is_success() {
            return;
        }
        if status == StatusCode::ACCEPTED {
            // A request's answer is JSON or a stream: an empty 202 holds none, and what
            // the server did with the request is unknown.
            return self.failed(id, "the MCP server accepted the request but sent no answer");
        }
        if !status.is_success() {
            let body = if is_stream(&response) {
                // A stream may still hold the server's JSON-RPC error for this request.
                if self.read(response, id.as_ref()).await {
                    return;
                }
                "(a stream with no answer to this request)".to_owned()
            } else {
                response.text().await.unwrap_or_default()
            };
            // The server's JSON-RPC error for this request is its answer, passed on.
            if let Ok(answer) = serde_json::from_str::<Value>(&body) {
                if answer.get("error").is_some() && id.is_some() && answer.get("id") == id.as_ref()
                {
                    return self.session.on_upstream_message(answer);
                }
            }
            let why = format!("the MCP server answered HTTP {status}: {body}");
            // Refused (a 4xx, or 503: unavailable) before any work; anything else may
            // have come after it.
            if status.is_client_error() || status == StatusCode::SERVICE_UNAVAILABLE {
                return self.refused(id, &why);
            }
            return self.failed(id, &why);
        }
        let answered = self.read(response, id.as_ref()).await;
        if is_initialize && answered {
            self.initialized();
        }
        if !answered {
            self.failed(
                id,
                "the MCP server's answer held no response to this request",
            );
        }
    }

    /// After a 404 on a request sent under session `generation`: whether a new session
    /// is there now, started by this request or by another that met the 404 first.
    async fn new_session_since(self: &Arc<Self>, generation: u64) -> bool {
        let _one_at_a_time = self.reinitializing.lock().await;
        if self.remote().generation != generation {
            return true;
        }
        tracing::warn!("idem proxy: the MCP server forgot the session; initializing again");
        self.reinitialize().await
    }

    /// Passes on the messages of an answer (JSON, or server-sent events); whether it
    /// held the response to the request with id `id`. A response under another id (or
    /// `null`) is not this request's answer: the request is still unanswered.
    async fn read(self: &Arc<Self>, response: reqwest::Response, id: Option<&Value>) -> bool {
        if !is_stream(&response) {
            return match response.json::<Value>().await {
                Ok(message) => self.pass_on(message, id),
                Err(_) => false,
            };
        }
        let mut answered = false;
        let mut events = Events::default();
        let mut body = response.bytes_stream();
        while let Some(chunk) = body.next().await {
            let Ok(chunk) = chunk else {
                break;
            };
            for data in events.push(&chunk) {
                if let Ok(message) = serde_json::from_str::<Value>(&data) {
                    answered |= self.pass_on(message, id);
                }
            }
        }
        answered
    }

    /// Passes one message on to the session; whether it was the response to `id` (any
    /// other response is dropped).
    fn pass_on(&self, message: Value, id: Option<&Value>) -> bool {
        let is_response = message.get("method").is_none();
        let answers = is_response
            && (message.get("result").is_some() || message.get("error").is_some())
            && id.is_some()
            && message.get("id") == id;
        if is_response && !answers {
            // Not this request's answer: passed on, it could answer another request of
            // the client's under that id.
            tracing::warn!(%message, "idem proxy: the MCP server answered a request with a response that is not its own; dropped");
            return false;
        }
        if answers {
            if let Some(version) = message
                .pointer("/result/protocolVersion")
                .and_then(Value::as_str)
            {
                self.remote().version = HeaderValue::from_str(version).ok();
            }
        }
        self.session.on_upstream_message(message);
        answers
    }

    /// After `initialize`: `notifications/initialized` is the session's to send; the
    /// `GET` stream of the server's own messages opens.
    fn initialized(self: &Arc<Self>) {
        let mut remote = self.remote();
        if remote.listening {
            return;
        }
        remote.listening = true;
        let connection = Arc::clone(self);
        tokio::spawn(async move { connection.listen().await });
    }

    /// The `GET` stream: the server's requests and notifications, while it lasts.
    async fn listen(self: Arc<Self>) {
        let mut headers = self.headers(false);
        headers.insert(ACCEPT, HeaderValue::from_static("text/event-stream"));
        match self.http.get(&self.url).headers(headers).send().await {
            Ok(response) if response.status().is_success() => {
                self.read(response, None).await;
            }
            Ok(response) => {
                tracing::debug!(status = %response.status(), "idem proxy: the MCP server offers no stream of its own messages");
            }
            Err(error) => {
                tracing::debug!(%error, "idem proxy: no stream of the server's own messages")
            }
        }
        self.remote().listening = false;
    }

    /// Starts a new upstream session with the client's `initialize`.
    async fn reinitialize(self: &Arc<Self>) -> bool {
        let Some(initialize) = self.session.initialize_request() else {
            return false;
        };
        let asked = self.session.ask_upstream_first(initialize);
        match tokio::time::timeout(Duration::from_secs(30), asked).await {
            Ok(Some(answer)) if answer.get("result").is_some() => {
                self.session
                    .upstream()
                    .send_first(json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
                true
            }
            _ => false,
        }
    }

    /// A request that may have reached the server, and whose answer is lost.
    fn failed(&self, id: Option<Value>, why: &str) {
        tracing::warn!(why, "idem proxy: a request to the MCP server failed");
        if let Some(id) = id {
            self.session.request_failed(&id, why);
        }
    }

    /// A request the server never ran: not sent, or refused before any work.
    fn refused(&self, id: Option<Value>, why: &str) {
        tracing::warn!(why, "idem proxy: the MCP server did not take a request");
        if let Some(id) = id {
            self.session.request_refused(&id, why);
        }
    }

    /// Ends the upstream session (`DELETE`).
    async fn end(&self) {
        if self.remote().session.is_none() {
            return;
        }
        let _ = tokio::time::timeout(
            Duration::from_secs(5),
            self.http
                .delete(&self.url)
                .headers(self.headers(false))
                .send(),
        )
        .await;
    }
}

/// Whether an answer is a stream of server-sent events.
fn is_stream(response: &reqwest::Response) -> bool {
    response
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"))
}

/// Server-sent events, parsed as their bytes arrive: the `data` of each event.
#[derive(Default)]
struct Events {
    pending: Vec<u8>,
    data: Vec<String>,
}

impl Events {
    fn push(&mut self, chunk: &[u8]) -> Vec<String> {
        self.pending.extend_from_slice(chunk);
        let mut done = Vec::new();
        while let Some(end) = self.pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.pending.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line);
            let line = line.trim_end_matches(['\n', '\r']);
            if line.is_empty() {
                if !self.data.is_empty() {
                    done.push(self.data.join("\n"));
                    self.data.clear();
                }
            } else if let Some(data) = line.strip_prefix("data:") {
                self.data
                    .push(data.strip_prefix(' ').unwrap_or(data).to_owned());
            }
        }
        done
    }
}
