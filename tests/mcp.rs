//! idem inside an MCP server (rmcp): the server runs in-process and an rmcp client
//! talks to it over an in-memory transport, as an agent would over stdio.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use idem::mcp::{REPLAYED_META_KEY, RUN_META_KEY};
use idem::{idempotent, MemoryStore, Run, Store};
use idem_testkit::mcp::{connect, Mailer, Sent};
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{
    CallToolRequestParams, CallToolResult, ErrorCode, ErrorData, RequestMetaObject,
    ServerCapabilities, ServerConfig,
};
use rmcp::service::{RequestContext, ServiceError};
use rmcp::{tool, tool_handler, tool_router, RoleServer, ServerHandler};
use serde_json::json;

/// Serves `server` on one end of an in-memory pipe and connects a client to the other.
fn call(tool: &str, arguments: serde_json::Value, run: Option<&str>) -> CallToolRequestParams {
    let arguments = arguments.as_object().cloned().unwrap_or_default();
    let mut params = CallToolRequestParams::new(tool.to_owned()).with_arguments(arguments);
    if let Some(run) = run {
        let mut meta = RequestMetaObject::new();
        meta.insert(RUN_META_KEY.to_owned(), json!(run));
        params.meta = Some(meta);
    }
    params
}

fn email() -> serde_json::Value {
    json!({"to": "ada@example.com", "subject": "Invoice", "body": "Attached."})
}

/// Whether the result says it was replayed (`_meta["idem/replayed"]`).
fn replayed(result: &CallToolResult) -> bool {
    let flag = result
        .meta
        .as_ref()
        .and_then(|m| m.0.get(REPLAYED_META_KEY));
    match flag {
        None => false,
        Some(flag) => {
            assert_eq!(flag, &json!(true), "{result:?}");
            true
        }
    }
}

fn sent(result: &CallToolResult) -> Sent {
    assert_ne!(result.is_error, Some(true), "tool failed: {result:?}");
    let text = result
        .content
        .first()
        .and_then(|c| c.as_text())
        .map(|t| t.text.clone())
        .expect("text content");
    serde_json::from_str(&text).expect("a Sent receipt")
}

#[tokio::test]
async fn same_run_and_arguments_send_once_and_return_the_same_result() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let mailer = Mailer::new();
    let client = connect(mailer.idempotent(store.clone())).await;

    let first = client
        .call_tool(call("send_email", email(), Some("run-1")))
        .await
        .unwrap();
    let retry = client
        .call_tool(call("send_email", email(), Some("run-1")))
        .await
        .unwrap();

    assert_eq!(mailer.outbox().len(), 1, "the retry must not send again");
    assert_eq!(sent(&first), sent(&retry));
    assert_eq!(
        first.content, retry.content,
        "the retry gets the same result"
    );
    assert!(!replayed(&first), "the first call ran: {first:?}");
    assert!(
        replayed(&retry),
        "the retry says it was replayed: {retry:?}"
    );

    // Another run is another agent task: it sends.
    let other = client
        .call_tool(call("send_email", email(), Some("run-2")))
        .await
        .unwrap();
    assert_eq!(mailer.outbox().len(), 2);
    assert_ne!(sent(&other).message_id, sent(&first).message_id);
    assert!(!replayed(&other));

    // Other arguments in the same run are another call.
    let mut other_email = email();
    other_email["to"] = json!("grace@example.com");
    client
        .call_tool(call("send_email", other_email, Some("run-1")))
        .await
        .unwrap();
    assert_eq!(mailer.outbox().len(), 3);
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn a_retry_on_a_new_connection_is_replayed() {
    // The agent timed out, reconnected (a new MCP session) and retried.
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let mailer = Mailer::new();

    let first_session = connect(mailer.idempotent(store.clone())).await;
    let first = first_session
        .call_tool(call("send_email", email(), Some("run-7")))
        .await
        .unwrap();
    first_session.cancel().await.unwrap();

    let second_session = connect(mailer.idempotent(store.clone())).await;
    let retry = second_session
        .call_tool(call("send_email", email(), Some("run-7")))
        .await
        .unwrap();
    assert_eq!(sent(&first), sent(&retry));
    assert_eq!(mailer.outbox().len(), 1);
    assert!(replayed(&retry));
    second_session.cancel().await.unwrap();
}

#[tokio::test]
async fn a_request_the_client_cancels_finishes_and_its_retry_gets_the_result() {
    use rmcp::model::{CallToolRequest, ClientRequest};
    use rmcp::service::PeerRequestOptions;
    use std::time::{Duration, Instant};

    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let mailer = Mailer::new().with_latency(Duration::from_secs(1));
    let client = connect(mailer.idempotent(store.clone())).await;
    let request = ClientRequest::CallToolRequest(CallToolRequest::new(call(
        "send_email",
        email(),
        Some("run-cancel"),
    )));
    let handle = client
        .send_cancellable_request(request, PeerRequestOptions::no_options())
        .await
        .unwrap();
    mailer.sent_at_least(1).await;
    handle
        .cancel(Some("the agent gave up".into()))
        .await
        .unwrap();

    let started = Instant::now();
    let retry = client
        .call_tool(call("send_email", email(), Some("run-cancel")))
        .await
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(
        sent(&retry).message_id,
        "msg-0001",
        "the first call's result"
    );
    assert!(
        replayed(&retry),
        "the retry says it was replayed: {retry:?}"
    );
    assert_eq!(mailer.outbox().len(), 1, "one email");
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn concurrent_duplicates_send_once() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let mailer = Mailer::new();
    let client = Arc::new(connect(mailer.idempotent(store.clone())).await);
    let calls = (0..8).map(|_| {
        let client = client.clone();
        tokio::spawn(async move {
            client
                .call_tool(call("send_email", email(), Some("run-c")))
                .await
        })
    });
    let mut results = Vec::new();
    let mut replays = 0;
    for call in calls {
        let result = call.await.unwrap().unwrap();
        replays += usize::from(replayed(&result));
        results.push(sent(&result));
    }
    assert_eq!(mailer.outbox().len(), 1);
    assert_eq!(
        replays, 7,
        "all but the call that sent say they were replayed"
    );
    assert!(results.iter().all(|r| *r == results[0]));
}

#[tokio::test]
async fn a_call_without_a_run_id_is_refused_and_sends_nothing() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let mailer = Mailer::new();
    let client = connect(mailer.idempotent(store.clone())).await;

    let error = client
        .call_tool(call("send_email", email(), None))
        .await
        .expect_err("no run id: refused");
    let ServiceError::McpError(error) = error else {
        panic!("expected an MCP error, got {error:?}");
    };
    assert_eq!(error.code, ErrorCode::INVALID_PARAMS);
    assert!(
        error.message.contains("_meta[\"idem/run\"]"),
        "the error names where the run id goes: {}",
        error.message
    );

    // A run id that is not a string is no run id.
    let mut params = call("send_email", email(), None);
    let mut meta = RequestMetaObject::new();
    meta.insert(RUN_META_KEY.to_owned(), json!(42));
    params.meta = Some(meta);
    assert!(client.call_tool(params).await.is_err());

    // A blank run id is no run id either: every client sending one would share one
    // run, and a second agent's identical email would be answered with the first's
    // message id and never sent.
    for blank in ["", "  "] {
        let error = client
            .call_tool(call("send_email", email(), Some(blank)))
            .await
            .expect_err("a blank run id: refused");
        let ServiceError::McpError(error) = error else {
            panic!("expected an MCP error, got {error:?}");
        };
        assert_eq!(error.code, ErrorCode::INVALID_PARAMS, "{blank:?}");
        assert!(error.message.contains("non-empty"), "{}", error.message);
    }

    assert!(mailer.outbox().is_empty(), "nothing was sent");
    client.cancel().await.unwrap();
}

/// idem's errors as MCP errors, for tools made idempotent with the attribute: the
/// rules `idem::mcp` gives the layer's calls.
fn mcp_error(error: idem::Error) -> ErrorData {
    let (code, message) = idem::mcp::rpc_error(&error, RUN_META_KEY);
    ErrorData::new(ErrorCode(code as i32), message, None)
}

/// The other attribute order: `#[tool]` above `#[idempotent]`, so `#[idempotent]` sees
/// the boxed future `#[tool]` emits. Two tools whose arguments serialize identically,
/// to check they never share a key.
#[derive(Clone)]
struct Counter {
    store: Arc<dyn Store>,
    charged: Arc<AtomicUsize>,
    refunded: Arc<AtomicUsize>,
    tool_router: ToolRouter<Self>,
}

#[derive(Debug, serde::Serialize, serde::Deserialize, rmcp::schemars::JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
struct Amount {
    cents: u64,
}

impl Counter {
    fn new() -> Self {
        Counter {
            store: Arc::new(MemoryStore::new()),
            charged: Arc::default(),
            refunded: Arc::default(),
            tool_router: Self::tool_router(),
        }
    }

    fn run_of(&self, ctx: &RequestContext<RoleServer>) -> Option<Run> {
        let id = ctx.meta.get(RUN_META_KEY)?.as_str()?;
        Some(Run::new(id).with_shared_store(self.store.clone()))
    }
}

#[tool_router]
impl Counter {
    #[tool(description = "Charge an amount.")]
    #[idempotent(run = self.run_of(&ctx), skip = [ctx], map_error = mcp_error)]
    async fn charge(
        &self,
        Parameters(amount): Parameters<Amount>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<String, ErrorData> {
        let n = self.charged.fetch_add(1, Ordering::SeqCst) + 1;
        Ok(format!("charge {n}: {} cents", amount.cents))
    }

    #[tool(description = "Refund an amount.")]
    #[idempotent(run = self.run_of(&ctx), skip = [ctx], map_error = mcp_error)]
    async fn refund(
        &self,
        Parameters(amount): Parameters<Amount>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<String, ErrorData> {
        let n = self.refunded.fetch_add(1, Ordering::SeqCst) + 1;
        Ok(format!("refund {n}: {} cents", amount.cents))
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for Counter {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }
}

#[tokio::test]
async fn idempotent_below_tool_works_and_tools_never_share_keys() {
    let counter = Counter::new();
    let client = connect(counter.clone()).await;
    let amount = json!({"cents": 500});

    let first = client
        .call_tool(call("charge", amount.clone(), Some("run-1")))
        .await
        .unwrap();
    let retry = client
        .call_tool(call("charge", amount.clone(), Some("run-1")))
        .await
        .unwrap();
    assert_eq!(counter.charged.load(Ordering::SeqCst), 1);
    assert_eq!(first.content, retry.content);

    // Same run, identical arguments, another tool: its own key, so it runs.
    let refund = client
        .call_tool(call("refund", amount.clone(), Some("run-1")))
        .await
        .unwrap();
    assert_eq!(counter.refunded.load(Ordering::SeqCst), 1);
    assert_ne!(refund.content, first.content);
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn the_request_context_is_not_part_of_the_key() {
    // Each request has its own id and context; only the run and arguments form the key.
    let counter = Counter::new();
    let client = connect(counter.clone()).await;
    for _ in 0..3 {
        let mut params = call("charge", json!({"cents": 1}), Some("run-ctx"));
        if let Some(meta) = params.meta.as_mut() {
            meta.insert("progressToken".to_owned(), json!(rand_token()));
        }
        client.call_tool(params).await.unwrap();
    }
    assert_eq!(counter.charged.load(Ordering::SeqCst), 1);
    client.cancel().await.unwrap();
}

fn rand_token() -> u64 {
    use std::time::{SystemTime, UNIX_EPOCH};
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

#[tokio::test]
async fn tools_are_listed_with_their_schema() {
    // The attribute leaves the signature alone, so rmcp still derives the input schema.
    let client = connect(Mailer::new().idempotent(Arc::new(MemoryStore::new()))).await;
    let tools = client.list_all_tools().await.unwrap();
    let send = tools
        .iter()
        .find(|t| t.name == "send_email")
        .expect("send_email is listed");
    let properties = send.input_schema.get("properties").expect("a schema");
    assert!(properties.get("to").is_some() && properties.get("body").is_some());
    client.cancel().await.unwrap();
}
