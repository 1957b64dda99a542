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
    version: Option<HeaderValue>,
    /// Whether the `GET` stream of the server's own messages is open.
    listening: bool,
}

struct Connection {
    session: Arc<Session>,
    url: String,
    http: reqwest::Client,
    remote: Mutex<Remote>,
}

/// Connects `session` to the server at `url`, until `closing` turns true.
pub async fn connect(session: Arc<Session>, url: String, mut closing: watch::Receiver<bool>) {
    let (sender, mut lines) = mpsc::unbounded_channel::<String>();
    session.upstream().connected(sender);
    let connection = Arc::new(Connection {
        session,
        url,
        http: reqwest::Client::new(),
        remote: Mutex::default(),
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

    fn headers(&self) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        headers.insert(
            ACCEPT,
            HeaderValue::from_static("application/json, text/event-stream"),
        );
        let remote = self.remote();
        if let Some(session) = &remote.session {
            headers.insert(SESSION_HEADER, session.clone());
        }
        if let Some(version) = &remote.version {
            headers.insert(VERSION_HEADER, version.clone());
        }
        headers
    }

    /// Sends one message and passes on what the server answers. `again`: a server
    /// that forgot the session is given `initialize` again and the message once more.
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
        let sent = self
            .http
            .post(&self.url)
            .headers(self.headers())
            .body(line.clone())
            .send()
            .await;
        let response = match sent {
            Ok(response) => response,
            Err(error) => return self.failed(id, &format!("cannot reach the MCP server: {error}")),
        };
        let status = response.status();
        if status == StatusCode::NOT_FOUND
            && again
            && self.remote().session.is_some()
            && !is_initialize
        {
            tracing::warn!("idem proxy: the MCP server forgot the session; initializing again");
            if self.reinitialize().await {
                return Box::pin(self.post(line, false)).await;
            }
        }
        if is_initialize && status.is_success() {
            let mut remote = self.remote();
            remote.session = response.headers().get(SESSION_HEADER).cloned();
        }
        if status == StatusCode::ACCEPTED || (id.is_none() && status.is_success()) {
            return;
        }
        if !status.is_success() {
            let body = response.text().await.unwrap_or_default();
            // A JSON-RPC error the server put in its answer is passed on as it is.
            if let Ok(answer) = serde_json::from_str::<Value>(&body) {
                if answer.get("error").is_some() && answer.get("id").is_some_and(|i| !i.is_null()) {
                    return self.session.on_upstream_message(answer);
                }
            }
            return self.failed(
                id,
                &format!("the MCP server answered HTTP {status}: {body}"),
            );
        }
        let answered = self.read(response).await;
        if is_initialize && answered {
            self.initialized();
        }
        if !answered {
            self.failed(
                id,
                "the MCP server closed the connection before it answered",
            );
        }
    }

    /// Passes on the messages of an answer (JSON, or server-sent events); whether it
    /// held a response.
    async fn read(self: &Arc<Self>, response: reqwest::Response) -> bool {
        let is_stream = response
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        if !is_stream {
            return match response.json::<Value>().await {
                Ok(message) => self.pass_on(message),
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
                    answered |= self.pass_on(message);
                }
            }
        }
        answered
    }

    /// Passes one message on to the session; whether it was a response.
    fn pass_on(&self, message: Value) -> bool {
        let is_response = message.get("method").is_none();
        if is_response {
            if let Some(version) = message
                .pointer("/result/protocolVersion")
                .and_then(Value::as_str)
            {
                self.remote().version = HeaderValue::from_str(version).ok();
            }
        }
        self.session.on_upstream_message(message);
        is_response
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
        let mut headers = self.headers();
        headers.insert(ACCEPT, HeaderValue::from_static("text/event-stream"));
        match self.http.get(&self.url).headers(headers).send().await {
            Ok(response) if response.status().is_success() => {
                self.read(response).await;
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
        self.remote().session = None;
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

    fn failed(&self, id: Option<Value>, why: &str) {
        tracing::warn!(why, "idem proxy: a request to the MCP server failed");
        if let Some(id) = id {
            self.session.request_failed(&id, why);
        }
    }

    /// Ends the upstream session (`DELETE`).
    async fn end(&self) {
        if self.remote().session.is_none() {
            return;
        }
        let _ = tokio::time::timeout(
            Duration::from_secs(5),
            self.http.delete(&self.url).headers(self.headers()).send(),
        )
        .await;
    }
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
