//! idem in an MCP server over a real transport: rmcp's streamable HTTP server on
//! 127.0.0.1, and a client speaking MCP's 2026-07-28 revision in plain HTTP. The
//! client drops its connection after the server started a slow, side-effecting call,
//! then sends the call again with a new JSON-RPC id and the same run id.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem::MemoryStore;
use idem_testkit::mcp::http::{
    self as mcp_http, post, post_and_hang_up, serve, structured, tools_call,
};
use idem_testkit::mcp::Mailer;
use serde_json::json;

fn email() -> serde_json::Value {
    json!({"to": "ada@example.com", "subject": "Invoice", "body": "Attached."})
}

/// A `tracing` writer that keeps what it is given.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn a_call_whose_client_hung_up_is_answered_on_retry_with_one_side_effect() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_env_filter("idem=debug")
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _logs = tracing::subscriber::set_default(subscriber);

    // The provider sends at once and answers after 1.5 s.
    let mailer = Mailer::new().with_latency(Duration::from_millis(1500));
    let addr = serve(mailer.idempotent(Arc::new(MemoryStore::new())), 0)
        .await
        .unwrap();

    let first = tools_call(1, "send_email", email(), "run-http-1");
    post_and_hang_up(addr, &first, mailer.sent_at_least(1))
        .await
        .unwrap();
    assert_eq!(mailer.outbox().len(), 1, "the server started the call");

    let started = Instant::now();
    let retry = tools_call(2, "send_email", email(), "run-http-1");
    let answer = post(addr, &retry).await.unwrap();
    let waited = started.elapsed();
    let sent = structured(&answer).unwrap();
    assert_eq!(answer["id"], 2, "the answer is to the new request");
    assert_eq!(
        sent,
        &json!({"message_id": "msg-0001", "to": "ada@example.com"})
    );
    assert_eq!(
        mailer.outbox().len(),
        1,
        "one email, although the first request was lost"
    );
    assert!(waited < Duration::from_secs(5), "the retry took {waited:?}");

    // Later retries are replays.
    let again = post(addr, &tools_call(3, "send_email", email(), "run-http-1"))
        .await
        .unwrap();
    assert_eq!(structured(&again).unwrap(), sent);
    assert_eq!(mailer.outbox().len(), 1);

    // The hang-up really cancelled the server's handler: idem finished the body alone.
    let logs = String::from_utf8_lossy(&captured.0.lock().unwrap()).into_owned();
    assert!(
        logs.contains("the caller stopped waiting"),
        "the first request's handler was never dropped:\n{logs}"
    );
}

#[tokio::test]
async fn the_tool_is_listed_as_idempotent_with_an_output_schema() {
    let mailer = Mailer::new();
    let addr = serve(mailer.idempotent(Arc::new(MemoryStore::new())), 0)
        .await
        .unwrap();
    let list = json!({
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/list",
        "params": {"_meta": {
            "io.modelcontextprotocol/protocolVersion": mcp_http::PROTOCOL_VERSION,
            "io.modelcontextprotocol/clientCapabilities": {},
        }}
    });
    let tools = post(addr, &list).await.unwrap();
    let send = tools["result"]["tools"]
        .as_array()
        .and_then(|tools| tools.iter().find(|t| t["name"] == "send_email"))
        .unwrap_or_else(|| panic!("send_email is listed: {tools}"));
    assert_eq!(send["annotations"]["idempotentHint"], true, "{send}");
    assert_eq!(send["annotations"]["destructiveHint"], false, "{send}");
    let properties = &send["outputSchema"]["properties"];
    assert!(
        properties.get("message_id").is_some() && properties.get("to").is_some(),
        "{send}"
    );
}

#[tokio::test]
async fn a_call_without_a_run_id_is_refused_over_http_and_sends_nothing() {
    let mailer = Mailer::new();
    let addr = serve(mailer.idempotent(Arc::new(MemoryStore::new())), 0)
        .await
        .unwrap();
    let mut call = tools_call(1, "send_email", email(), "unused");
    call["params"]["_meta"]
        .as_object_mut()
        .unwrap()
        .remove(idem::mcp::RUN_META_KEY);
    let answer = post(addr, &call).await;
    let text = format!("{answer:?}");
    assert!(text.contains("_meta[\\\"idem/run\\\"]"), "{text}");
    assert!(mailer.outbox().is_empty());
}
