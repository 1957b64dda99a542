//! MCP's streamable HTTP in front of the upstream server: `POST /mcp` carries the client's
//! messages (a request is answered in the response, as `application/json`), `GET /mcp`
//! opens the stream of the server's own messages (notifications, and requests such as
//! sampling or elicitation), `DELETE /mcp` ends the session. Each session
//! (`Mcp-Session-Id`, given with the answer to `initialize`) has its own upstream: a
//! process of its own, as a stdio server expects one client, or a session of its own
//! with an HTTP server.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idem_core::mcp::Policy;
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot, watch};

use super::session::{ClientSink, Session};
use super::upstream::Upstream;
use super::{finish_calls, start_upstream, Server};

const SESSION_HEADER: &str = "mcp-session-id";

/// Serves `http://addr/mcp` until Ctrl-C (or SIGTERM).
pub async fn serve(addr: SocketAddr, policy: Policy, server: Server) -> Result<(), String> {
    let proxy = Arc::new(Proxy {
        policy,
        server,
        sessions: Mutex::default(),
    });
    tokio::spawn(expire_idle(Arc::downgrade(&proxy)));
    let app = Router::new()
        .route("/mcp", post(post_mcp).get(get_mcp).delete(delete_mcp))
        .with_state(Arc::clone(&proxy));
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    eprintln!("idem proxy: serving MCP at http://{local}/mcp");
    let stopping = Arc::clone(&proxy);
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            stopped().await;
            // Open streams would hold the shutdown forever: they end now.
            for session in stopping.lock().values() {
                session.sink.close_stream();
            }
        })
        .await
        .map_err(|e| e.to_string())?;
    let sessions: Vec<Arc<HttpSession>> = proxy.lock().drain().map(|(_, s)| s).collect();
    for session in sessions {
        session.close().await;
    }
    Ok(())
}

/// How long a session may go without a message from its client before the proxy ends
/// it (a client that went away without `DELETE`), stopping its server.
const IDLE: Duration = Duration::from_secs(3600);

/// Ends idle sessions, once a minute.
async fn expire_idle(proxy: std::sync::Weak<Proxy>) {
    loop {
        tokio::time::sleep(Duration::from_secs(60)).await;
        let Some(proxy) = proxy.upgrade() else {
            return;
        };
        let idle: Vec<Arc<HttpSession>> = {
            let mut sessions = proxy.lock();
            let ids: Vec<String> = sessions
                .iter()
                .filter(|(_, s)| s.idle() > IDLE && s.session.calls_in_flight() == 0)
                .map(|(id, _)| id.clone())
                .collect();
            ids.iter().filter_map(|id| sessions.remove(id)).collect()
        };
        for session in idle {
            tracing::info!("idem proxy: ending a session idle for an hour");
            tokio::spawn(async move { session.close().await });
        }
    }
}

/// Ctrl-C or SIGTERM.
async fn stopped() {
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(term) => term,
                Err(_) => return std::future::pending().await,
            };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
}

struct Proxy {
    policy: Policy,
    server: Server,
    sessions: Mutex<HashMap<String, Arc<HttpSession>>>,
}

impl Proxy {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<HttpSession>>> {
        self.sessions.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One client session and its upstream.
struct HttpSession {
    session: Arc<Session>,
    sink: Arc<HttpSink>,
    closing: watch::Sender<bool>,
    /// When the client last sent anything.
    seen: Mutex<Instant>,
}

impl HttpSession {
    fn touch(&self) {
        *self.seen.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
    }

    fn idle(&self) -> Duration {
        self.seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .elapsed()
    }

    /// Lets the calls in flight finish and record, then stops the upstream.
    async fn close(&self) {
        finish_calls(&self.session).await;
        let _ = self.closing.send(true);
    }
}

/// Where an HTTP session's messages for the client go: a response to the POST that
/// waits for it; anything else to the open `GET` stream (or held until one opens).
#[derive(Default)]
struct HttpSink {
    /// By request id: the POST that waits (its number, and where its answer goes).
    waiting: Mutex<HashMap<String, (u64, oneshot::Sender<Value>)>>,
    /// Numbers the POSTs that wait, so each takes out only its own entry.
    posts: std::sync::atomic::AtomicU64,
    stream: Mutex<Stream>,
}

#[derive(Default)]
struct Stream {
    open: Option<mpsc::UnboundedSender<Value>>,
    held: Vec<Value>,
}

impl HttpSink {
    /// Ends the `GET` stream, if one is open.
    fn close_stream(&self) {
        self.stream.lock().unwrap_or_else(|p| p.into_inner()).open = None;
    }
}

impl ClientSink for HttpSink {
    fn send(&self, message: Value) {
        let is_response = message.get("method").is_none();
        if is_response {
            let key = message.get("id").map(Value::to_string).unwrap_or_default();
            let waiter = self
                .waiting
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&key);
            // A response nobody waits for (its client hung up) is dropped: the call's
            // result is recorded, and the retry gets it.
            if let Some((_, waiter)) = waiter {
                let _ = waiter.send(message);
            }
            return;
        }
        let mut stream = self.stream.lock().unwrap_or_else(|p| p.into_inner());
        let unsent = match &stream.open {
            Some(open) => open.send(message).err().map(|e| e.0),
            None => Some(message),
        };
        if let Some(message) = unsent {
            stream.open = None;
            if stream.held.len() < 1000 {
                stream.held.push(message);
            }
        }
    }
}

/// Takes a POST's waiter out again if the POST goes away before its answer (and only
/// its own: once answered, another POST may wait under the same id).
struct Waiting<'a> {
    sink: &'a HttpSink,
    key: String,
    post: u64,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut waiting = self.sink.waiting.lock().unwrap_or_else(|p| p.into_inner());
        if waiting
            .get(&self.key)
            .is_some_and(|(post, _)| *post == self.post)
        {
            waiting.remove(&self.key);
        }
    }
}

fn bad_request(message: &str) -> Response {
    let body = json!({"jsonrpc": "2.0", "id": null, "error": {"code": -32600, "message": message}});
    (StatusCode::BAD_REQUEST, Json(body)).into_response()
}

fn session_of(
    proxy: &Proxy,
    headers: &HeaderMap,
) -> Result<Option<Arc<HttpSession>>, (StatusCode, &'static str)> {
    let Some(id) = headers.get(SESSION_HEADER) else {
        return Ok(None);
    };
    let id = id.to_str().unwrap_or_default();
    match proxy.lock().get(id) {
        Some(session) => Ok(Some(Arc::clone(session))),
        None => Err((StatusCode::NOT_FOUND, "no such MCP session")),
    }
}

async fn post_mcp(State(proxy): State<Arc<Proxy>>, headers: HeaderMap, body: String) -> Response {
    let message: Value = match serde_json::from_str(&body) {
        Ok(message) => message,
        Err(error) => {
            let body = json!({"jsonrpc": "2.0", "id": null, "error": {"code": -32700, "message": format!("parse error: {error}")}});
            return (StatusCode::BAD_REQUEST, Json(body)).into_response();
        }
    };
    if message.is_array() {
        // Each message of a batch would need its own answer and protection.
        return bad_request("JSON-RPC batches are not supported: send one message per POST");
    }
    let method = message.get("method").and_then(Value::as_str);
    let id = message.get("id").filter(|_| method.is_some()).cloned();
    if id.as_ref().is_some_and(Value::is_null) {
        return bad_request("a request's id may not be null");
    }
    let (session, mut starting) = match session_of(&proxy, &headers) {
        Err(response) => return response.into_response(),
        Ok(Some(session)) => {
            session.touch();
            (session, None)
        }
        Ok(None) if method == Some("initialize") && id.is_none() => {
            return bad_request("initialize is a request: it needs an id");
        }
        Ok(None) if method == Some("initialize") => match start_session(&proxy).await {
            Ok(session) => (
                Arc::clone(&session),
                Some(Starting {
                    session: Some(session),
                }),
            ),
            Err(error) => {
                tracing::warn!(%error, "idem proxy: cannot start the MCP server for a session");
                let body = json!({"jsonrpc": "2.0", "id": id, "error": {"code": -32603, "message": error}});
                return (StatusCode::INTERNAL_SERVER_ERROR, Json(body)).into_response();
            }
        },
        Ok(None) => {
            return bad_request("no Mcp-Session-Id header: start a session with initialize")
        }
    };
    let Some(id) = id else {
        // A notification, or the client's response to the server's request.
        session.session.on_client_message(message);
        return StatusCode::ACCEPTED.into_response();
    };
    let key = id.to_string();
    let post = session
        .sink
        .posts
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let (sender, answer) = oneshot::channel();
    {
        let mut waiting = session
            .sink
            .waiting
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        // Its answer could not be told from the other's (that one's POST may have gone
        // away: its call runs on, and would answer this one).
        if waiting.contains_key(&key) || session.session.in_flight(&id) {
            let body = json!({"jsonrpc": "2.0", "id": id, "error": {"code": -32600,
                "message": "a request with this id is still in flight in this session: send it under another id"}});
            return (StatusCode::BAD_REQUEST, Json(body)).into_response();
        }
        waiting.insert(key.clone(), (post, sender));
    }
    let _waiting = Waiting {
        sink: &session.sink,
        key,
        post,
    };
    session.session.on_client_message(message);
    let Ok(answer) = answer.await else {
        return (StatusCode::BAD_GATEWAY, "the session ended").into_response();
    };
    let failed = answer.get("error").is_some();
    let mut response = Json(answer).into_response();
    // A session starts with its server's answer to `initialize`; a failed one (and one
    // whose client went away first: see `Starting`) leaves nothing running.
    if let Some(session) = starting.as_mut().and_then(|s| s.session.take()) {
        if failed {
            tokio::spawn(async move { session.close().await });
        } else {
            let new_id = session_id();
            if let Ok(value) = new_id.parse() {
                response.headers_mut().insert(SESSION_HEADER, value);
            }
            proxy.lock().insert(new_id, session);
        }
    }
    response
}

/// A session whose `initialize` is not answered yet: it is not in the proxy's map, and
/// if its POST goes away before the answer, its server is stopped.
struct Starting {
    session: Option<Arc<HttpSession>>,
}

impl Drop for Starting {
    fn drop(&mut self) {
        if let Some(session) = self.session.take() {
            tokio::spawn(async move { session.close().await });
        }
    }
}

async fn start_session(proxy: &Arc<Proxy>) -> Result<Arc<HttpSession>, String> {
    let sink = Arc::new(HttpSink::default());
    let session = Session::new(
        proxy.policy.clone(),
        Upstream::default(),
        Arc::clone(&sink) as Arc<dyn ClientSink>,
    );
    let (closing, _supervisor) = start_upstream(&session, proxy.server.clone()).await?;
    Ok(Arc::new(HttpSession {
        session,
        sink,
        closing,
        seen: Mutex::new(Instant::now()),
    }))
}

fn session_id() -> String {
    let mut bytes = [0u8; 16];
    if getrandom::fill(&mut bytes).is_err() {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        bytes = nanos.to_le_bytes();
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

async fn get_mcp(State(proxy): State<Arc<Proxy>>, headers: HeaderMap) -> Response {
    let session = match session_of(&proxy, &headers) {
        Ok(Some(session)) => session,
        Ok(None) => return bad_request("no Mcp-Session-Id header"),
        Err(response) => return response.into_response(),
    };
    session.touch();
    let (sender, receiver) = mpsc::unbounded_channel::<Value>();
    {
        let mut stream = session
            .sink
            .stream
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        for message in stream.held.drain(..) {
            let _ = sender.send(message);
        }
        stream.open = Some(sender);
    }
    let events = futures_util::stream::unfold(receiver, |mut receiver| async move {
        let message = receiver.recv().await?;
        let event = Event::default().event("message").data(message.to_string());
        Some((Ok::<_, Infallible>(event), receiver))
    });
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

async fn delete_mcp(State(proxy): State<Arc<Proxy>>, headers: HeaderMap) -> Response {
    let Some(id) = headers.get(SESSION_HEADER).and_then(|id| id.to_str().ok()) else {
        return bad_request("no Mcp-Session-Id header");
    };
    let Some(session) = proxy.lock().remove(id) else {
        return (StatusCode::NOT_FOUND, "no such MCP session").into_response();
    };
    tokio::spawn(async move { session.close().await });
    StatusCode::OK.into_response()
}
