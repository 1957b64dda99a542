//! An MCP server (rmcp) with a side-effecting tool, made idempotent by one line:
//! [`Mailer::idempotent`] wraps it in `idem::mcp::Idempotent`. Shared by the
//! `mcp_server` (stdio), `mcp_http` (streamable HTTP) and `mcp_bench` examples and
//! the MCP tests; [`http`] serves it over streamable HTTP.
//!
//! The server itself knows nothing of idem: `send_email` sends, every time it runs.
//! The layer reads the agent's run id from each `tools/call` request's
//! `_meta["idem/run"]`, runs the tool once per run and arguments, answers retries with
//! the first result (`_meta["idem/replayed"] = true`), and lets a call whose request
//! was cancelled run to its end and record its result for the retry.

pub mod http;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem::mcp::Idempotent;
use idem::Store;
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::tool::schema_for_output;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolResult, ErrorData, Implementation, ServerCapabilities, ServerConfig};
use rmcp::schemars::JsonSchema;
use rmcp::service::RunningService;
use rmcp::{
    tool, tool_handler, tool_router, RoleClient, RoleServer, ServerHandler, Service, ServiceExt,
};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

/// The `send_email` tool's arguments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
pub struct SendEmail {
    /// Recipient address.
    pub to: String,
    /// Subject line.
    pub subject: String,
    /// Plain-text body.
    pub body: String,
}

/// What `send_email` returns: the tool's structured content, described by its output
/// schema, and what idem stores and replays.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
pub struct Sent {
    /// The provider's id of the message.
    pub message_id: String,
    /// The recipient.
    pub to: String,
}

/// The MCP server: one email tool, an outbox that records every real send.
#[derive(Clone)]
pub struct Mailer {
    outbox: Arc<Mutex<Vec<SendEmail>>>,
    /// How long the provider takes to answer after it sent an email.
    latency: Duration,
    /// How many emails went out so far, for anyone who waits for one.
    sent: watch::Sender<usize>,
    tool_router: ToolRouter<Self>,
}

impl Default for Mailer {
    fn default() -> Self {
        Mailer::new()
    }
}

impl Mailer {
    /// A server whose provider answers at once.
    pub fn new() -> Self {
        Mailer {
            outbox: Arc::default(),
            latency: Duration::ZERO,
            sent: watch::Sender::new(0),
            tool_router: Self::tool_router(),
        }
    }

    /// This server with a provider that answers `latency` after it sent an email.
    pub fn with_latency(mut self, latency: Duration) -> Self {
        self.latency = latency;
        self
    }

    /// This server (a handle: its outbox is shared) with its side-effecting tools
    /// idempotent, their records in `store`.
    pub fn idempotent(&self, store: Arc<dyn Store>) -> Idempotent<Mailer> {
        Idempotent::new(self.clone()).shared_store(store)
    }

    /// Every email really sent, in order.
    pub fn outbox(&self) -> Vec<SendEmail> {
        self.outbox.lock().map(|o| o.clone()).unwrap_or_default()
    }

    /// Waits until at least `n` emails went out.
    pub async fn sent_at_least(&self, n: usize) {
        let mut sent = self.sent.subscribe();
        let _ = sent.wait_for(|sent| *sent >= n).await;
    }
}

#[tool_router]
impl Mailer {
    /// Send an email: every call sends one. (Made idempotent by the layer around the
    /// server, not here.)
    #[tool(
        description = "Send an email. Retries with the same run id (_meta[\"idem/run\"]) and arguments send it once.",
        annotations(destructive_hint = false, read_only_hint = false),
        output_schema = schema_for_output::<Sent>()
    )]
    async fn send_email(
        &self,
        Parameters(email): Parameters<SendEmail>,
    ) -> Result<CallToolResult, ErrorData> {
        let message_id = {
            let mut outbox = self
                .outbox
                .lock()
                .map_err(|_| ErrorData::internal_error("outbox poisoned", None))?;
            outbox.push(email.clone());
            format!("msg-{:04}", outbox.len())
        };
        self.sent.send_modify(|sent| *sent += 1);
        // A zero sleep still waits for the timer's next millisecond tick.
        if !self.latency.is_zero() {
            tokio::time::sleep(self.latency).await;
        }
        let sent = Sent {
            message_id,
            to: email.to,
        };
        let value = serde_json::to_value(&sent)
            .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
        Ok(CallToolResult::structured(value))
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for Mailer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new(
                "idem-mailer",
                env!("CARGO_PKG_VERSION"),
            ))
            .with_instructions(
                "Tools with side effects are idempotent per run: send the agent's run id as \
                 _meta[\"idem/run\"] on every tools/call, and retry freely (with a new request \
                 id) when a request is lost.",
            )
    }
}

/// Serves `server` on one end of an in-memory pipe and connects an rmcp client to the
/// other, as an agent would connect over stdio.
pub async fn connect<S: Service<RoleServer>>(server: S) -> RunningService<RoleClient, ()> {
    let (server_end, client_end) = tokio::io::duplex(64 * 1024);
    tokio::spawn(async move {
        if let Ok(running) = server.serve(server_end).await {
            let _ = running.waiting().await;
        }
    });
    ().serve(client_end).await.expect("client connects")
}

/// The value after `name` in `args` (`--serve 8931`).
pub fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    let at = args.iter().position(|a| a == name)?;
    args.get(at + 1).map(String::as_str)
}

/// `--latency-ms N`: how long the provider takes to answer after it sent (none by
/// default).
pub fn latency_flag(args: &[String]) -> Result<Duration, std::num::ParseIntError> {
    match flag(args, "--latency-ms") {
        Some(ms) => Ok(Duration::from_millis(ms.parse()?)),
        None => Ok(Duration::ZERO),
    }
}
