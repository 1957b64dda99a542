//! One client's MCP session through the proxy: every JSON-RPC message passes between
//! the client and the upstream server unchanged, except
//!
//! - `tools/call` of a tool the policy protects: made idempotent (forwarded under an id
//!   of the proxy's own, answered by the proxy, replayed to retries);
//! - `notifications/cancelled` of such a call: kept from the upstream, so the call runs
//!   to its end and its result is recorded for the retry;
//! - `tools/list` results: protected tools gain `idempotentHint: true`.
//!
//! The session learns each tool's `readOnlyHint` from the `tools/list` results it
//! passes on, and asks the upstream itself when a call names a tool it has not seen.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use idem_core::mcp::{
    is_outcome, read_only_hint, Answer, Plan, Policy, Protected, INTERNAL_ERROR, INVALID_PARAMS,
};
use serde_json::{json, Map, Value};
use tokio::sync::oneshot;

use super::upstream::Upstream;

/// JSON-RPC's code for a request that is not a valid one.
const INVALID_REQUEST: i64 = -32600;

/// Where messages for the client go: stdout, or an HTTP session's responses and stream.
pub trait ClientSink: Send + Sync + 'static {
    /// Sends one message to the client.
    fn send(&self, message: Value);
}

/// The start of the JSON-RPC ids the proxy gives the requests it sends upstream:
/// `idem-proxy-` and a random nonce, so that no client's id is ever one of them.
fn own_id_prefix() -> String {
    let mut nonce = [0u8; 8];
    if getrandom::fill(&mut nonce).is_err() {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
        nonce = now.map_or(0, |d| d.as_nanos() as u64).to_le_bytes();
    }
    let nonce: String = nonce.iter().map(|b| format!("{b:02x}")).collect();
    format!("idem-proxy-{nonce}-")
}

/// A message's id, as a map key (`1` and `"1"` stay apart).
fn id_key(id: &Value) -> String {
    id.to_string()
}

#[derive(Default)]
struct State {
    /// The proxy's own requests upstream, by id: who waits for the response.
    own: HashMap<String, oneshot::Sender<Value>>,
    next_own: u64,
    /// Client requests forwarded upstream and not answered yet, by id: answered with
    /// an error if the upstream exits first.
    forwarded: HashMap<String, Value>,
    /// Forwarded requests whose answer is on its way to the client: still in flight
    /// for [`Session::in_flight`] until it got there, and no longer the upstream's to
    /// answer.
    answering: HashSet<String>,
    /// Which of those are `tools/list`, whose result gains the hints.
    listing: HashSet<String>,
    /// Protected calls in flight, by the client's id; `true` once the client cancelled.
    protected: HashMap<String, bool>,
    /// `tools/call` requests received and not answered yet, protected or (until they
    /// are forwarded) not, by id.
    calls: HashSet<String>,
    /// Each tool's `readOnlyHint`, as the last list gave it.
    hints: HashMap<String, Option<bool>>,
    /// Whether `hints` holds a whole list (none asked since the last `list_changed`).
    listed: bool,
    /// The client's `initialize` request, to start a restarted upstream with.
    initialize: Option<Value>,
}

/// One client's session (see the module docs).
pub struct Session {
    policy: Policy,
    own_id: String,
    upstream: Upstream,
    client: Arc<dyn ClientSink>,
    state: Mutex<State>,
}

impl Session {
    pub fn new(policy: Policy, upstream: Upstream, client: Arc<dyn ClientSink>) -> Arc<Self> {
        Arc::new(Session {
            policy,
            own_id: own_id_prefix(),
            upstream,
            client,
            state: Mutex::default(),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn upstream(&self) -> &Upstream {
        &self.upstream
    }

    /// The client's `initialize` request, if it sent one.
    pub fn initialize_request(&self) -> Option<Value> {
        self.state().initialize.clone()
    }

    /// How many `tools/call` requests are in flight: received, and not answered yet.
    pub fn calls_in_flight(&self) -> usize {
        self.state().calls.len()
    }

    /// How many of the client's requests the upstream has not answered yet, other than
    /// the calls of [`Session::calls_in_flight`].
    pub fn forwarded_in_flight(&self) -> usize {
        self.state().forwarded.len()
    }

    /// Whether a request of the client with this id is in flight: a second one could not
    /// be told from it.
    pub fn in_flight(&self, id: &Value) -> bool {
        let key = id_key(id);
        let state = self.state();
        state.calls.contains(&key)
            || state.forwarded.contains_key(&key)
            || state.answering.contains(&key)
    }

    /// A message from the client.
    pub fn on_client_message(self: &Arc<Self>, message: Value) {
        let method = message.get("method").and_then(Value::as_str);
        let id = message.get("id").filter(|_| method.is_some()).cloned();
        if let Some(id) = id.as_ref().filter(|id| self.in_flight(id)) {
            // Its answer could not be told from the other's, and the other's call would
            // no longer count as in flight once either is answered.
            tracing::warn!(%id, "idem proxy: a request reuses the id of one in flight; refused");
            self.client.send(error_response(
                id,
                INVALID_REQUEST,
                "a request with this id is still in flight: send it under another id",
            ));
            return;
        }
        match (method, id) {
            (Some("tools/call"), Some(id)) => {
                // In flight from now: a client that closes stdin right after sending it
                // still gets its answer.
                self.state().calls.insert(id_key(&id));
                let session = Arc::clone(self);
                tokio::spawn(async move { session.tools_call(id, message).await });
            }
            (Some("notifications/cancelled"), None) => {
                let request = message.pointer("/params/requestId").map(id_key);
                if let Some(request) = request {
                    if let Some(cancelled) = self.state().protected.get_mut(&request) {
                        // The call runs on and records its result: the upstream is not told.
                        *cancelled = true;
                        tracing::info!(request, "idem proxy: a protected call was cancelled by the client; it runs on and records its result for the retry");
                        return;
                    }
                }
                self.upstream.send(message);
            }
            (Some(method), Some(id)) => {
                {
                    let mut state = self.state();
                    let key = id_key(&id);
                    if method == "initialize" {
                        state.initialize = Some(message.clone());
                    }
                    if method == "tools/list" {
                        state.listing.insert(key.clone());
                    }
                    state.forwarded.insert(key, id);
                    // Sent under the lock it was registered under: see `upstream_exited`.
                    self.upstream.send(message);
                }
            }
            // Notifications, and responses to the upstream's own requests.
            _ => self.upstream.send(message),
        }
    }

    /// A message from the upstream.
    pub fn on_upstream_message(&self, mut message: Value) {
        let is_request_or_notification = message.get("method").is_some();
        let is_response = !is_request_or_notification
            && (message.get("result").is_some() || message.get("error").is_some());
        if !is_request_or_notification && !is_response {
            tracing::warn!(%message, "idem proxy: the MCP server sent a message that is neither a request, a notification nor a response; dropped");
            return;
        }
        if is_response {
            let key = message.get("id").map(id_key).unwrap_or_default();
            let mut state = self.state();
            if let Some(waiter) = state.own.remove(&key) {
                let _ = waiter.send(message);
                return;
            }
            let answering = state.forwarded.remove(&key).is_some();
            if answering {
                state.answering.insert(key.clone());
            }
            if state.listing.remove(&key) {
                if let Some(tools) = message
                    .pointer_mut("/result/tools")
                    .and_then(Value::as_array_mut)
                {
                    learn_hints(&mut state, tools);
                    self.policy.mark_listed(tools);
                }
            }
        } else if message.get("method").and_then(Value::as_str)
            == Some("notifications/tools/list_changed")
        {
            // A tool may have changed its hints: ask again at its next call.
            let mut state = self.state();
            state.listed = false;
            state.hints.clear();
        }
        let answered = is_response.then(|| message.get("id").map(id_key).unwrap_or_default());
        self.client.send(message);
        if let Some(key) = answered {
            self.state().answering.remove(&key);
        }
    }

    /// The upstream exited: requests it did not answer get an error (protected calls
    /// learn it from their own request, see [`Session::tools_call`]), and none of them
    /// reaches the next upstream. A request is registered and sent under one lock, and
    /// this runs under it too: each request is either answered here and dropped with
    /// the old link, or registered after, and sent to the next upstream.
    pub fn upstream_exited(&self, closing: bool) {
        let forwarded: Vec<Value> = {
            let mut state = self.state();
            self.upstream.reset();
            state.listing.clear();
            state.own.clear();
            state.listed = false;
            state.forwarded.drain().map(|(_, id)| id).collect()
        };
        let why = match closing {
            true => {
                "the MCP server was stopped (the proxy is closing) before it answered this request"
            }
            false => {
                "the MCP server exited before it answered this request; idem proxy restarts it"
            }
        };
        for id in forwarded {
            self.client.send(error_response(&id, INTERNAL_ERROR, why));
        }
    }

    /// A request the upstream will not answer (its connection failed): who waits for
    /// it learns so (a protected call is then settled by its delivery policy), and a
    /// client's request gets an error.
    pub fn request_failed(&self, id: &Value, why: &str) {
        let key = id_key(id);
        let forwarded = {
            let mut state = self.state();
            // Dropped, the waiter's sender tells it: no answer.
            if state.own.remove(&key).is_some() {
                return;
            }
            state.listing.remove(&key);
            state.forwarded.remove(&key)
        };
        if let Some(id) = forwarded {
            self.client.send(error_response(&id, INTERNAL_ERROR, why));
        }
    }

    /// A request the upstream never ran (it was not sent, or was refused before any
    /// work): answered with an error. A protected call gets it as the server's answer,
    /// so its claim is released whatever the delivery policy: a retry runs it.
    pub fn request_refused(&self, id: &Value, why: &str) {
        let key = id_key(id);
        let waiter = self.state().own.remove(&key);
        match waiter {
            Some(waiter) => {
                let _ = waiter.send(error_response(id, INTERNAL_ERROR, why));
            }
            None => self.request_failed(id, why),
        }
    }

    /// Sends `request` upstream under an id of the proxy's own; the response, or
    /// `None` if the upstream exited first.
    pub async fn ask_upstream(&self, request: Value) -> Option<Value> {
        self.ask(request, false).await
    }

    /// [`Session::ask_upstream`] to a restarting upstream, ahead of what waits for it.
    pub async fn ask_upstream_first(&self, request: Value) -> Option<Value> {
        self.ask(request, true).await
    }

    async fn ask(&self, mut request: Value, first: bool) -> Option<Value> {
        let (sender, receiver) = oneshot::channel();
        {
            let mut state = self.state();
            state.next_own += 1;
            let id = format!("{}{}", self.own_id, state.next_own);
            state.own.insert(id_key(&Value::String(id.clone())), sender);
            request["id"] = Value::String(id);
            // Sent under the lock it was registered under: see `upstream_exited`.
            if first {
                self.upstream.send_first(request);
            } else {
                self.upstream.send(request);
            }
        }
        receiver.await.ok()
    }

    /// A `tools/call` request from the client.
    async fn tools_call(self: Arc<Self>, id: Value, request: Value) {
        let params = request.get("params").and_then(Value::as_object);
        let name = params
            .and_then(|p| p.get("name"))
            .and_then(Value::as_str)
            .filter(|name| !name.is_empty())
            .map(str::to_owned);
        let Some(name) = name else {
            // Keyed as no name, distinct calls would share a key.
            self.client.send(error_response(
                &id,
                INVALID_PARAMS,
                "a tools/call needs the tool's name, a non-empty string",
            ));
            self.state().calls.remove(&id_key(&id));
            return;
        };
        let meta = params
            .and_then(|p| p.get("_meta"))
            .and_then(Value::as_object);
        let read_only = self.read_only_hint(&name).await;
        let key = id_key(&id);
        let protected = match self.policy.plan(&name, read_only, meta) {
            Plan::Protect(protected) => protected,
            Plan::Forward => {
                {
                    let mut state = self.state();
                    state.calls.remove(&key);
                    state.forwarded.insert(key, id.clone());
                    self.upstream.send(request);
                }
                return;
            }
        };
        self.state().protected.insert(key.clone(), false);
        let response = self.protected_call(&id, request, protected).await;
        let cancelled = self.state().protected.remove(&key).unwrap_or(false);
        if !cancelled {
            self.client.send(response);
        }
        // In flight until its answer reached the client: a request under its id meanwhile
        // is refused, never given this answer.
        self.state().calls.remove(&key);
    }

    /// Runs a protected call; the response for the client.
    async fn protected_call(
        self: &Arc<Self>,
        id: &Value,
        request: Value,
        protected: Protected,
    ) -> Value {
        let arguments = match request.pointer("/params/arguments") {
            None | Some(Value::Null) => None,
            Some(Value::Object(arguments)) => Some(arguments.clone()),
            // Keyed as no arguments, it would replay another call's result.
            Some(_) => {
                return error_response(
                    id,
                    INVALID_PARAMS,
                    "a tools/call's `arguments` must be an object",
                )
            }
        };
        let (lost, upstream_lost) = oneshot::channel::<()>();
        let session = Arc::clone(self);
        let call = protected.call(arguments.as_ref(), move || async move {
            match session.ask_upstream(request).await {
                Some(mut response) => match response.get_mut("result") {
                    Some(result) if is_outcome(result) => Ok(result.take()),
                    // An error, or a request for the client's input or a task to poll:
                    // passed on, not stored.
                    _ => Err(response),
                },
                None => {
                    // Gone without an answer: the caller drops this call, which settles
                    // its claim by the delivery policy (see below).
                    let _ = lost.send(());
                    std::future::pending().await
                }
            }
        });
        let answer = tokio::select! {
            answer = call => answer,
            Ok(()) = upstream_lost => {
                // Dropping the call (its tool's `on_cancel` is `abort`) settles the claim
                // by policy: released (at-least-once: a retry runs the tool again), or
                // outcome unknown (at-most-once: a retry is told so, and nothing runs).
                return error_response(
                    id,
                    INTERNAL_ERROR,
                    "the MCP server went away during this call (it exited, or the connection to \
                     it failed), which may or may not have taken effect. An at-least-once tool \
                     runs again on retry; an at-most-once tool answers the retry with `outcome \
                     unknown`",
                );
            }
        };
        match answer {
            Answer::Result(result) => json!({"jsonrpc": "2.0", "id": id, "result": result}),
            Answer::Unstored(mut response) => {
                response["id"] = id.clone();
                response
            }
            Answer::Refused(error) => {
                let (code, message) = idem_core::mcp::rpc_error(&error, self.policy.run_key());
                error_response(id, code, &message)
            }
        }
    }

    /// The tool's `readOnlyHint`, from the lists seen; if the tool is in none, the
    /// upstream is asked for its whole list first.
    async fn read_only_hint(&self, name: &str) -> Option<bool> {
        {
            let state = self.state();
            if let Some(hint) = state.hints.get(name) {
                return *hint;
            }
            if state.listed {
                return None;
            }
        }
        let mut cursor: Option<Value> = None;
        let mut tools = Vec::new();
        for _ in 0..100 {
            let mut params = Map::new();
            if let Some(cursor) = cursor.take() {
                params.insert("cursor".to_owned(), cursor);
            }
            let request = json!({"jsonrpc": "2.0", "method": "tools/list", "params": params});
            let response = self.ask_upstream(request).await?;
            let Some(result) = response.get("result") else {
                tracing::warn!(%response, "idem proxy: the MCP server did not list its tools; calls of unknown tools are protected");
                break;
            };
            if let Some(page) = result.get("tools").and_then(Value::as_array) {
                tools.extend(page.iter().cloned());
            }
            match result.get("nextCursor") {
                Some(next) if !next.is_null() => cursor = Some(next.clone()),
                _ => break,
            }
        }
        let mut state = self.state();
        learn_hints(&mut state, &mut tools);
        state.listed = true;
        state.hints.get(name).copied().flatten()
    }
}

/// Records each listed tool's `readOnlyHint`.
fn learn_hints(state: &mut State, tools: &mut [Value]) {
    for tool in tools.iter() {
        let Some(tool) = tool.as_object() else {
            continue;
        };
        if let Some(name) = tool.get("name").and_then(Value::as_str) {
            state.hints.insert(name.to_owned(), read_only_hint(tool));
        }
    }
}

/// A JSON-RPC error response.
pub fn error_response(id: &Value, code: i64, message: &str) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}})
}
