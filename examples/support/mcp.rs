//! An MCP server (rmcp) whose side-effecting tool is idempotent. Shared by the
//! `mcp_server` (stdio) and `mcp_http` (streamable HTTP) examples and the MCP tests.
//!
//! The pattern: the run id read from the request's `_meta["idem/run"]`, the request
//! context skipped from the key, and a tool that stops waiting when rmcp cancels the
//! request (`ctx.ct`: the client sent `notifications/cancelled`, or hung up) while the
//! idempotent call inside it, `on_cancel = "finish"`, runs to its end and records its
//! outcome, so the client's retry gets that result and the side effect happens once.

#![allow(dead_code)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem::{idempotent, Error, Run, Store};
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::tool::{schema_for_output, IntoCallToolResult};
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{
    CallToolResponse, CallToolResult, ErrorData, MetaObject, ServerCapabilities, ServerConfig,
};
use rmcp::schemars::JsonSchema;
use rmcp::service::RequestContext;
use rmcp::{tool, tool_handler, tool_router, RoleServer, ServerHandler};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

/// The request `_meta` field that carries the agent's run id. The id must stay the
/// same across the run's retries, reconnections and server restarts.
pub const RUN_META_KEY: &str = "idem/run";

/// The result `_meta` field that says the result was replayed: an earlier call with
/// the same run and arguments ran the tool, and this call returns its result.
pub const REPLAYED_META_KEY: &str = "idem/replayed";

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

/// What `send_email` returns, and what idem stores and replays: the tool's structured
/// content, described by its output schema.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
pub struct Sent {
    /// The provider's id of the message.
    pub message_id: String,
    /// The recipient.
    pub to: String,
}

impl IntoCallToolResult for Sent {
    fn into_call_tool_result(self) -> Result<CallToolResponse, ErrorData> {
        self.into_result(false).map(Into::into)
    }
}

impl Sent {
    /// The tool's result: this receipt as structured content, and, when it was
    /// replayed (the email was sent by an earlier call, not now),
    /// `_meta["idem/replayed"] = true`.
    pub fn into_result(self, replayed: bool) -> Result<CallToolResult, ErrorData> {
        let value = serde_json::to_value(&self)
            .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
        let mut result = CallToolResult::structured(value);
        if replayed {
            let mut meta = MetaObject::new();
            meta.0.insert(REPLAYED_META_KEY.to_owned(), true.into());
            result.meta = Some(meta);
        }
        Ok(result)
    }
}

/// The MCP server: one email tool, an outbox that records every real send.
#[derive(Clone)]
pub struct Mailer {
    store: Arc<dyn Store>,
    outbox: Arc<Mutex<Vec<SendEmail>>>,
    /// How long the provider takes to answer after it sent an email.
    latency: Duration,
    /// How many emails went out so far, for anyone who waits for one.
    sent: watch::Sender<usize>,
    tool_router: ToolRouter<Self>,
}

impl Mailer {
    /// A server keeping its idempotency records in `store`.
    pub fn new(store: Arc<dyn Store>) -> Self {
        Mailer {
            store,
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

    /// Every email really sent, in order.
    pub fn outbox(&self) -> Vec<SendEmail> {
        self.outbox.lock().map(|o| o.clone()).unwrap_or_default()
    }

    /// Waits until at least `n` emails went out.
    pub async fn sent_at_least(&self, n: usize) {
        let mut sent = self.sent.subscribe();
        let _ = sent.wait_for(|sent| *sent >= n).await;
    }

    /// The run a request belongs to: `_meta["idem/run"]`, if the client sent one.
    fn run_of(&self, ctx: &RequestContext<RoleServer>) -> Option<Run> {
        let id = ctx.meta.get(RUN_META_KEY)?.as_str()?;
        Some(Run::new(id).with_shared_store(self.store.clone()))
    }
}

impl Mailer {
    /// The side effect, at most once per run and email. When the request that started
    /// it is cancelled, it runs on to its end (`on_cancel = "finish"`, on a clone of the
    /// server: a handle, whose outbox is shared).
    #[idempotent(
        name = "send_email",
        run = self.run_of(&ctx),
        skip = [ctx],
        map_error = mcp_error,
        on_cancel = "finish"
    )]
    async fn deliver(
        &self,
        email: SendEmail,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Sent, ErrorData> {
        let message_id = {
            let mut outbox = self
                .outbox
                .lock()
                .map_err(|_| ErrorData::internal_error("outbox poisoned", None))?;
            outbox.push(email.clone());
            format!("msg-{:04}", outbox.len())
        };
        self.sent.send_modify(|sent| *sent += 1);
        tokio::time::sleep(self.latency).await;
        Ok(Sent {
            message_id,
            to: email.to,
        })
    }
}

#[tool_router]
impl Mailer {
    /// Send an email. Retrying with the same run id and arguments returns the first
    /// result without sending again; so does a retry after the request was lost. A
    /// replayed result says so in its `_meta["idem/replayed"]`.
    #[tool(
        description = "Send an email. Retries with the same run id (_meta[\"idem/run\"]) and arguments send it once.",
        annotations(idempotent_hint = true, destructive_hint = false, read_only_hint = false),
        output_schema = schema_for_output::<Sent>()
    )]
    async fn send_email(
        &self,
        Parameters(email): Parameters<SendEmail>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let cancelled = ctx.ct.clone();
        tokio::select! {
            (sent, call) = idem::observe(self.deliver(email, ctx)) => {
                sent?.into_result(call.is_some_and(|call| call.replayed()))
            }
            () = cancelled.cancelled() => {
                tracing::info!("send_email: the request was cancelled; the email finishes in the background");
                Err(ErrorData::internal_error("request cancelled", None))
            }
        }
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for Mailer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build()).with_instructions(
            "Tools with side effects are idempotent per run: send the agent's run id as \
             _meta[\"idem/run\"] on every tools/call, and retry freely (with a new request id) \
             when a request is lost.",
        )
    }
}

/// idem's errors as MCP errors. A request without a run id, or with a blank one (every
/// such client would share one run), is the client's mistake (invalid params), named
/// precisely so the client can fix it.
pub fn mcp_error(error: Error) -> ErrorData {
    match error {
        Error::NoRun { tool, .. } => ErrorData::invalid_params(
            format!(
                "`{tool}` has side effects and needs the agent's run id: send it as a \
                 non-empty string in the request's _meta[\"{RUN_META_KEY}\"], the same on \
                 every retry"
            ),
            None,
        ),
        Error::PayloadMismatch { .. } | Error::Input { .. } => {
            ErrorData::invalid_params(error.to_string(), None)
        }
        other => ErrorData::internal_error(other.to_string(), None),
    }
}
