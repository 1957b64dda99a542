//! An MCP server on stdio whose `send_email` tool is idempotent per agent run.
//!
//! ```text
//! cargo run --example mcp_server
//! ```
//!
//! Point an MCP client at it, and send the agent's run id in each `tools/call`
//! request's `_meta["idem/run"]`. A retried call (same run id, same arguments) returns
//! the first call's result and sends nothing; a call without a run id is refused with
//! an `invalid params` error that says where the id goes. Records are kept in idem's
//! default store (`$IDEM_DIR`, else `./.idem`), so a retry after a server restart is
//! replayed too. The server logs to stderr (`RUST_LOG=idem=debug` for each decision).
//!
//! The tool itself is in `examples/support/mcp.rs`:
//!
//! ```ignore
//! #[idempotent(name = "send_email", run = self.run_of(&ctx), skip = [ctx], map_error = mcp_error)]
//! #[tool(description = "Send an email. Retries with the same run id and arguments send it once.")]
//! async fn send_email(
//!     &self,
//!     Parameters(email): Parameters<SendEmail>,
//!     ctx: RequestContext<RoleServer>,
//! ) -> Result<Sent, ErrorData> { .. }
//! ```

#[path = "support/mcp.rs"]
mod mcp;

use rmcp::ServiceExt;
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // stdout carries the protocol: logs go to stderr.
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();

    let store = idem::default_store()?;
    let server = mcp::Mailer::new(store)
        .serve(rmcp::transport::stdio())
        .await?;
    server.waiting().await?;
    Ok(())
}
