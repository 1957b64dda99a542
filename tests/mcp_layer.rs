//! `idem::mcp::Idempotent` around an rmcp server that knows nothing of idem: which
//! tools it protects, what it stores, and its options. An rmcp client talks to it over
//! an in-memory transport, as an agent would over stdio.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem::mcp::{Idempotent, WithoutRun, REPLAYED_META_KEY, RUN_META_KEY};
use idem::{MemoryStore, Store, Tool};
use idem_testkit::faults::Down;
use idem_testkit::mcp::connect;
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{
    CallToolRequestParams, CallToolResult, ContentBlock as Content, ErrorCode, ErrorData,
    RequestMetaObject, ServerCapabilities, ServerConfig,
};
use rmcp::service::ServiceError;
use rmcp::{tool, tool_handler, tool_router, ServerHandler};
use serde_json::{json, Value};

#[derive(Debug, serde::Serialize, serde::Deserialize, rmcp::schemars::JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
struct Order {
    item: String,
    qty: u32,
}

/// A shop whose tools count how many times they really ran.
#[derive(Clone, Default)]
struct Shop {
    orders: Arc<AtomicUsize>,
    lookups: Arc<AtomicUsize>,
    flaky: Arc<AtomicUsize>,
    tool_router: ToolRouter<Self>,
}

impl Shop {
    fn new() -> Self {
        Shop {
            tool_router: Self::tool_router(),
            ..Shop::default()
        }
    }

    fn idempotent(&self) -> Idempotent<Shop> {
        Idempotent::new(self.clone()).store(MemoryStore::new())
    }
}

#[tool_router]
impl Shop {
    #[tool(description = "Place an order.")]
    async fn order(
        &self,
        Parameters(order): Parameters<Order>,
    ) -> Result<CallToolResult, ErrorData> {
        let n = self.orders.fetch_add(1, Ordering::SeqCst) + 1;
        Ok(CallToolResult::success(vec![Content::text(format!(
            "order {n}: {} x {}",
            order.qty, order.item
        ))]))
    }

    #[tool(description = "Look up stock.", annotations(read_only_hint = true))]
    async fn stock(
        &self,
        Parameters(order): Parameters<Order>,
    ) -> Result<CallToolResult, ErrorData> {
        let n = self.lookups.fetch_add(1, Ordering::SeqCst) + 1;
        Ok(CallToolResult::success(vec![Content::text(format!(
            "lookup {n}: {}",
            order.item
        ))]))
    }

    #[tool(description = "Fails with a tool error on its first call, then succeeds.")]
    async fn flaky(
        &self,
        Parameters(order): Parameters<Order>,
    ) -> Result<CallToolResult, ErrorData> {
        let n = self.flaky.fetch_add(1, Ordering::SeqCst) + 1;
        let text = Content::text(format!("flaky {n}: {}", order.item));
        Ok(if n == 1 {
            CallToolResult::error(vec![text])
        } else {
            CallToolResult::success(vec![text])
        })
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for Shop {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }
}

fn call(tool: &str, arguments: Value, meta: &[(&str, Value)]) -> CallToolRequestParams {
    let arguments = arguments.as_object().cloned().unwrap_or_default();
    let mut params = CallToolRequestParams::new(tool.to_owned()).with_arguments(arguments);
    if !meta.is_empty() {
        let mut object = RequestMetaObject::new();
        for (key, value) in meta {
            object.insert((*key).to_owned(), value.clone());
        }
        params.meta = Some(object);
    }
    params
}

fn in_run(tool: &str, arguments: Value, run: &str) -> CallToolRequestParams {
    call(tool, arguments, &[(RUN_META_KEY, json!(run))])
}

fn text(result: &CallToolResult) -> String {
    result
        .content
        .first()
        .and_then(|c| c.as_text())
        .map(|t| t.text.clone())
        .unwrap_or_default()
}

fn replayed(result: &CallToolResult) -> bool {
    result
        .meta
        .as_ref()
        .and_then(|m| m.0.get(REPLAYED_META_KEY))
        == Some(&json!(true))
}

fn order() -> Value {
    json!({"item": "tea", "qty": 2})
}

#[tokio::test]
async fn a_retry_is_replayed_and_reordered_arguments_are_the_same_call() {
    let shop = Shop::new();
    let client = connect(shop.idempotent()).await;
    let first = client
        .call_tool(in_run("order", order(), "r1"))
        .await
        .unwrap();
    // The same arguments, keys in another order.
    let reordered = json!({"qty": 2, "item": "tea"});
    let retry = client
        .call_tool(in_run("order", reordered, "r1"))
        .await
        .unwrap();
    assert_eq!(shop.orders.load(Ordering::SeqCst), 1, "one order placed");
    assert_eq!(text(&first), text(&retry));
    assert!(
        !replayed(&first) && replayed(&retry),
        "{first:?} / {retry:?}"
    );
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn a_read_only_tool_runs_every_time_and_is_not_marked() {
    let shop = Shop::new();
    let client = connect(shop.idempotent()).await;
    for _ in 0..2 {
        let result = client
            .call_tool(in_run("stock", order(), "r1"))
            .await
            .unwrap();
        assert!(!replayed(&result));
    }
    // Without a run id too: a read-only tool needs none.
    client.call_tool(call("stock", order(), &[])).await.unwrap();
    assert_eq!(shop.lookups.load(Ordering::SeqCst), 3);

    let tools = client.list_all_tools().await.unwrap();
    let hint = |name: &str| {
        let tool = tools.iter().find(|t| t.name == name).expect("listed");
        tool.annotations.as_ref().and_then(|a| a.idempotent_hint)
    };
    assert_eq!(hint("order"), Some(true));
    assert_eq!(hint("flaky"), Some(true));
    assert_eq!(hint("stock"), None, "a read-only tool is left as it is");
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn a_tool_error_is_not_stored_unless_asked() {
    let shop = Shop::new();
    let client = connect(shop.idempotent()).await;
    let first = client
        .call_tool(in_run("flaky", order(), "r1"))
        .await
        .unwrap();
    assert_eq!(first.is_error, Some(true));
    let second = client
        .call_tool(in_run("flaky", order(), "r1"))
        .await
        .unwrap();
    assert_ne!(second.is_error, Some(true), "the retry ran: {second:?}");
    assert!(!replayed(&second));
    let third = client
        .call_tool(in_run("flaky", order(), "r1"))
        .await
        .unwrap();
    assert!(replayed(&third) && text(&third) == text(&second));
    assert_eq!(shop.flaky.load(Ordering::SeqCst), 2);
    client.cancel().await.unwrap();

    // Stored when asked: the retry gets the error, and the tool runs once.
    let shop = Shop::new();
    let client = connect(shop.idempotent().store_tool_errors()).await;
    let first = client
        .call_tool(in_run("flaky", order(), "r1"))
        .await
        .unwrap();
    let retry = client
        .call_tool(in_run("flaky", order(), "r1"))
        .await
        .unwrap();
    assert_eq!(retry.is_error, Some(true));
    assert!(replayed(&retry) && text(&retry) == text(&first));
    assert_eq!(shop.flaky.load(Ordering::SeqCst), 1);
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn exempt_and_added_tools() {
    let shop = Shop::new();
    let layer = shop.idempotent().exempt("order").tool(Tool::new("stock"));
    let client = connect(layer).await;
    for _ in 0..2 {
        client
            .call_tool(in_run("order", order(), "r1"))
            .await
            .unwrap();
        client
            .call_tool(in_run("stock", order(), "r1"))
            .await
            .unwrap();
    }
    assert_eq!(shop.orders.load(Ordering::SeqCst), 2, "exempt: ran twice");
    assert_eq!(shop.lookups.load(Ordering::SeqCst), 1, "added: ran once");
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn options_for_all_tools_and_for_one() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let shop = Shop::new();
    let layer = Idempotent::new(shop.clone())
        .shared_store(Arc::clone(&store))
        .defaults(|tool| tool.ttl(Duration::from_millis(300)))
        .tool(Tool::new("flaky").ttl(Duration::from_secs(3600)));
    let client = connect(layer).await;
    client
        .call_tool(in_run("order", order(), "r1"))
        .await
        .unwrap();
    client
        .call_tool(in_run("flaky", order(), "r1"))
        .await
        .unwrap(); // a tool error
    client
        .call_tool(in_run("flaky", order(), "r1"))
        .await
        .unwrap(); // stored, for an hour
    tokio::time::sleep(Duration::from_millis(600)).await;
    // `order`'s record lived 300 ms: it runs again. `flaky`'s lives on: replayed.
    client
        .call_tool(in_run("order", order(), "r1"))
        .await
        .unwrap();
    let flaky = client
        .call_tool(in_run("flaky", order(), "r1"))
        .await
        .unwrap();
    assert_eq!(shop.orders.load(Ordering::SeqCst), 2);
    assert_eq!(shop.flaky.load(Ordering::SeqCst), 2);
    assert!(replayed(&flaky));
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn the_run_id_field_can_be_renamed_and_calls_without_one_forwarded() {
    let shop = Shop::new();
    let layer = shop
        .idempotent()
        .run_meta_key("acme/session")
        .without_run(WithoutRun::Forward);
    let client = connect(layer).await;
    let meta = [("acme/session", json!("s1"))];
    client
        .call_tool(call("order", order(), &meta))
        .await
        .unwrap();
    let retry = client
        .call_tool(call("order", order(), &meta))
        .await
        .unwrap();
    assert!(replayed(&retry));
    assert_eq!(shop.orders.load(Ordering::SeqCst), 1);
    // No run id (absent, blank, not a string): forwarded, unprotected (runs each time).
    client.call_tool(call("order", order(), &[])).await.unwrap();
    client
        .call_tool(in_run("order", order(), "r1"))
        .await
        .unwrap();
    client
        .call_tool(call("order", order(), &[("acme/session", json!("  "))]))
        .await
        .unwrap();
    client
        .call_tool(call("order", order(), &[("acme/session", json!(7))]))
        .await
        .unwrap();
    assert_eq!(shop.orders.load(Ordering::SeqCst), 5);
    client.cancel().await.unwrap();

    // Refused by default, naming the renamed field.
    let shop = Shop::new();
    let client = connect(shop.idempotent().run_meta_key("acme/session")).await;
    let error = client.call_tool(in_run("order", order(), "r1")).await;
    let Err(ServiceError::McpError(error)) = error else {
        panic!("refused: {error:?}");
    };
    assert_eq!(error.code, ErrorCode::INVALID_PARAMS);
    assert!(
        error.message.contains("_meta[\"acme/session\"]"),
        "{}",
        error.message
    );
    assert_eq!(shop.orders.load(Ordering::SeqCst), 0);
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn an_unreachable_store_is_a_clear_error_and_the_tool_does_not_run() {
    let shop = Shop::new();
    let layer = Idempotent::new(shop.clone()).store(Down::new());
    let client = connect(layer).await;
    let error = client.call_tool(in_run("order", order(), "r1")).await;
    let Err(ServiceError::McpError(error)) = error else {
        panic!("an error: {error:?}");
    };
    assert_eq!(error.code, ErrorCode::INTERNAL_ERROR);
    assert!(error.message.contains("unreachable"), "{}", error.message);
    assert_eq!(shop.orders.load(Ordering::SeqCst), 0);
    client.cancel().await.unwrap();
}

/// A server written by hand, without rmcp's tool router: its `get_tool` does not
/// answer, and it lists its tools in two pages.
#[derive(Clone, Default)]
struct ByHand {
    reads: Arc<AtomicUsize>,
    writes: Arc<AtomicUsize>,
}

impl ServerHandler for ByHand {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }

    async fn list_tools(
        &self,
        request: Option<rmcp::model::PaginatedRequestParams>,
        _: rmcp::service::RequestContext<rmcp::RoleServer>,
    ) -> Result<rmcp::model::ListToolsResult, ErrorData> {
        let schema = Arc::new(serde_json::Map::new());
        let second_page = request.and_then(|r| r.cursor).is_some();
        let (tool, read_only) = if second_page {
            ("read", true)
        } else {
            ("write", false)
        };
        let annotations = rmcp::model::ToolAnnotations::new().read_only(read_only);
        let tool = rmcp::model::Tool::new(tool, "a tool", schema).annotate(annotations);
        let mut list = rmcp::model::ListToolsResult::with_all_items(vec![tool]);
        if !second_page {
            list.next_cursor = Some("page-2".into());
        }
        Ok(list)
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        _: rmcp::service::RequestContext<rmcp::RoleServer>,
    ) -> Result<rmcp::model::CallToolResponse, ErrorData> {
        let n = match &*request.name {
            "panic" => {
                self.writes.fetch_add(1, Ordering::SeqCst);
                panic!("a tool that panics")
            }
            "read" => self.reads.fetch_add(1, Ordering::SeqCst) + 1,
            _ => self.writes.fetch_add(1, Ordering::SeqCst) + 1,
        };
        let size = request
            .arguments
            .as_ref()
            .and_then(|a| a.get("size"))
            .and_then(Value::as_u64)
            .unwrap_or(0) as usize;
        let text = format!("{} {n}{}", request.name, "x".repeat(size));
        Ok(CallToolResult::success(vec![Content::text(text)]).into())
    }
}

#[tokio::test]
async fn a_read_only_tool_is_known_before_the_client_lists_the_tools() {
    let server = ByHand::default();
    let client = connect(Idempotent::new(server.clone()).store(MemoryStore::new())).await;
    // Not listed yet, its hint on the second page: it runs, without a run id too.
    client
        .call_tool(call("read", json!({}), &[]))
        .await
        .unwrap();
    client
        .call_tool(in_run("read", json!({}), "r1"))
        .await
        .unwrap();
    client
        .call_tool(in_run("read", json!({}), "r1"))
        .await
        .unwrap();
    assert_eq!(server.reads.load(Ordering::SeqCst), 3);
    // The other is protected.
    client
        .call_tool(in_run("write", json!({}), "r1"))
        .await
        .unwrap();
    client
        .call_tool(in_run("write", json!({}), "r1"))
        .await
        .unwrap();
    assert_eq!(server.writes.load(Ordering::SeqCst), 1);
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn a_result_too_large_to_store_is_returned_once_and_never_run_again() {
    let server = ByHand::default();
    let client = connect(Idempotent::new(server.clone()).store(MemoryStore::new())).await;
    let big = json!({"size": 5 << 20});
    let first = client
        .call_tool(in_run("write", big.clone(), "r1"))
        .await
        .unwrap();
    assert!(
        text(&first).len() > 5 << 20,
        "the caller gets the whole result"
    );
    assert_ne!(first.is_error, Some(true));
    let retry = client.call_tool(in_run("write", big, "r1")).await.unwrap();
    assert_eq!(retry.is_error, Some(true), "{retry:?}");
    assert!(text(&retry).contains("this call ran"), "{}", text(&retry));
    assert!(replayed(&retry));
    assert_eq!(server.writes.load(Ordering::SeqCst), 1, "never run again");
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn a_tool_that_panics_gets_its_client_an_error_and_its_claim_settled() {
    let server = ByHand::default();
    let client = connect(Idempotent::new(server.clone()).store(MemoryStore::new())).await;
    for _ in 0..2 {
        let answer = tokio::time::timeout(
            Duration::from_secs(10),
            client.call_tool(in_run("panic", json!({}), "r1")),
        )
        .await
        .expect("answered, not left hanging");
        let Err(ServiceError::McpError(error)) = answer else {
            panic!("an error: {answer:?}");
        };
        assert!(error.message.contains("panicked"), "{}", error.message);
    }
    // At least once (the default): the claim was released, so the retry ran again.
    assert_eq!(server.writes.load(Ordering::SeqCst), 2);
    client.cancel().await.unwrap();
}
