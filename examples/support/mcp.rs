//! An MCP server (rmcp) whose side-effecting tool is idempotent. Shared by the
//! `mcp_server` example (stdio) and the in-memory transport tests.
//!
//! The pattern: `#[idempotent]` above rmcp's `#[tool]`, the run id read from the
//! request's `_meta["idem/run"]`, the request context skipped from the key.

#![allow(dead_code)]

use std::sync::{Arc, Mutex};

use idem::{idempotent, Error, Run, Store};
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{ContentBlock, ErrorData, IntoContents, ServerCapabilities, ServerConfig};
use rmcp::schemars::JsonSchema;
use rmcp::service::RequestContext;
use rmcp::{tool, tool_handler, tool_router, RoleServer, ServerHandler};
use serde::{Deserialize, Serialize};

/// The request `_meta` field that carries the agent's run id. The id must stay the
/// same across the run's retries, reconnections and server restarts.
pub const RUN_META_KEY: &str = "idem/run";

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

/// What `send_email` returns, and what idem stores and replays.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sent {
    pub message_id: String,
    pub to: String,
}

impl IntoContents for Sent {
    fn into_contents(self) -> Vec<ContentBlock> {
        // Two strings and a derived Serialize: this cannot fail.
        let json = serde_json::to_string(&self).unwrap_or_default();
        vec![ContentBlock::text(json)]
    }
}

/// The MCP server: one email tool, an outbox that records every real send.
#[derive(Clone)]
pub struct Mailer {
    store: Arc<dyn Store>,
    outbox: Arc<Mutex<Vec<SendEmail>>>,
    tool_router: ToolRouter<Self>,
}

impl Mailer {
    /// A server keeping its idempotency records in `store`.
    pub fn new(store: Arc<dyn Store>) -> Self {
        Mailer {
            store,
            outbox: Arc::default(),
            tool_router: Self::tool_router(),
        }
    }

    /// Every email really sent, in order.
    pub fn outbox(&self) -> Vec<SendEmail> {
        self.outbox.lock().map(|o| o.clone()).unwrap_or_default()
    }

    /// The run a request belongs to: `_meta["idem/run"]`, if the client sent one.
    fn run_of(&self, ctx: &RequestContext<RoleServer>) -> Option<Run> {
        let id = ctx.meta.get(RUN_META_KEY)?.as_str()?;
        Some(Run::new(id).with_shared_store(self.store.clone()))
    }
}

#[tool_router]
impl Mailer {
    /// Send an email. Retrying with the same run id and arguments returns the first
    /// result without sending again.
    #[idempotent(name = "send_email", run = self.run_of(&ctx), skip = [ctx], map_error = mcp_error)]
    #[tool(description = "Send an email. Retries with the same run id and arguments send it once.")]
    async fn send_email(
        &self,
        Parameters(email): Parameters<SendEmail>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Sent, ErrorData> {
        let mut outbox = self
            .outbox
            .lock()
            .map_err(|_| ErrorData::internal_error("outbox poisoned", None))?;
        outbox.push(email.clone());
        Ok(Sent {
            message_id: format!("msg-{:04}", outbox.len()),
            to: email.to,
        })
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for Mailer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build()).with_instructions(
            "Tools with side effects are idempotent per run: send the agent's run id as \
             _meta[\"idem/run\"] on every tools/call, and retry freely.",
        )
    }
}

/// idem's errors as MCP errors. A request without a run id is the client's mistake
/// (invalid params), named precisely so the client can fix it.
pub fn mcp_error(error: Error) -> ErrorData {
    match error {
        Error::NoRun { tool } => ErrorData::invalid_params(
            format!(
                "`{tool}` has side effects and needs the agent's run id: send it as a string \
                 in the request's _meta[\"{RUN_META_KEY}\"], the same on every retry"
            ),
            None,
        ),
        Error::PayloadMismatch { .. } | Error::Input { .. } => {
            ErrorData::invalid_params(error.to_string(), None)
        }
        other => ErrorData::internal_error(other.to_string(), None),
    }
}
