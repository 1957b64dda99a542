//! The `Mailer` MCP server over rmcp's streamable HTTP transport on 127.0.0.1, and the
//! client side of MCP's 2026-07-28 revision spoken in plain HTTP: each `tools/call` is
//! one stateless POST whose `_meta` carries the protocol version, the client's
//! capabilities and the agent's run id. Used by the `mcp_http` example and test.
//!
//! A client that lost a request (its connection dropped) sends it again with a new
//! JSON-RPC id and the same `_meta`; with idem, the retry gets the first request's
//! result and the tool's side effect happens once.

use std::net::SocketAddr;
use std::sync::Arc;

use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;

use idem::mcp::{Idempotent, RUN_META_KEY};

use super::Mailer;

/// The protocol revision the client speaks.
pub const PROTOCOL_VERSION: &str = "2026-07-28";

/// Serves `service` at `http://<addr>/mcp` on 127.0.0.1 (port 0: any free port), on the
/// current tokio runtime. Returns the address it listens on.
pub async fn serve(service: Idempotent<Mailer>, port: u16) -> std::io::Result<SocketAddr> {
    let mut config = StreamableHttpServerConfig::default();
    config.legacy_session_mode = false;
    config.json_response = true;
    let service = StreamableHttpService::new(
        move || Ok(service.clone()),
        Arc::new(LocalSessionManager::default()),
        config,
    );
    let app = axum::Router::new().nest_service("/mcp", service);
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok(addr)
}

/// A `tools/call` request of `tool` with `arguments`, JSON-RPC id `id`, in `run`.
pub fn tools_call(id: u64, tool: &str, arguments: Value, run: &str) -> Value {
    json!({
        "jsonrpc": "2.0",
        "id": id,
        "method": "tools/call",
        "params": {
            "name": tool,
            "arguments": arguments,
            "_meta": {
                "io.modelcontextprotocol/protocolVersion": PROTOCOL_VERSION,
                "io.modelcontextprotocol/clientCapabilities": {},
                RUN_META_KEY: run,
            }
        }
    })
}

/// The HTTP headers of a request: the protocol version, and the method and name the
/// body names (SEP-2243's `Mcp-Method` and `Mcp-Name`).
fn headers(request: &Value) -> Vec<(&'static str, String)> {
    let mut headers = vec![
        ("Content-Type", "application/json".to_owned()),
        ("Accept", "application/json, text/event-stream".to_owned()),
        ("MCP-Protocol-Version", PROTOCOL_VERSION.to_owned()),
    ];
    if let Some(method) = request["method"].as_str() {
        headers.push(("Mcp-Method", method.to_owned()));
    }
    if let Some(name) = request["params"]["name"].as_str() {
        headers.push(("Mcp-Name", name.to_owned()));
    }
    headers
}

/// Sends `request` and returns the JSON-RPC response.
pub async fn post(addr: SocketAddr, request: &Value) -> Result<Value, String> {
    let mut post = reqwest::Client::new()
        .post(format!("http://{addr}/mcp"))
        .body(request.to_string());
    for (name, value) in headers(request) {
        post = post.header(name, value);
    }
    let response = post.send().await.map_err(|e| e.to_string())?;
    let status = response.status();
    let body = response.text().await.map_err(|e| e.to_string())?;
    if !status.is_success() {
        return Err(format!("HTTP {status}: {body}"));
    }
    serde_json::from_str(&body).map_err(|e| format!("{e}: {body}"))
}

/// Sends `request` on a connection of its own, waits for `started` (the server began
/// the call), then drops the connection without reading the response: a client that
/// went away mid-call.
pub async fn post_and_hang_up(
    addr: SocketAddr,
    request: &Value,
    started: impl std::future::Future<Output = ()>,
) -> std::io::Result<()> {
    let body = request.to_string();
    let mut head = format!("POST /mcp HTTP/1.1\r\nHost: {addr}\r\n");
    for (name, value) in headers(request) {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    let mut connection = tokio::net::TcpStream::connect(addr).await?;
    connection.write_all(head.as_bytes()).await?;
    connection.write_all(body.as_bytes()).await?;
    started.await;
    drop(connection);
    Ok(())
}

/// The tool result's structured content, or what went wrong.
pub fn structured(response: &Value) -> Result<&Value, String> {
    let result = response
        .get("result")
        .ok_or_else(|| format!("no result: {response}"))?;
    if result.get("isError") == Some(&Value::Bool(true)) {
        return Err(format!("the tool failed: {result}"));
    }
    result
        .get("structuredContent")
        .ok_or_else(|| format!("no structured content: {result}"))
}
