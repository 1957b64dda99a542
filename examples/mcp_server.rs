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
//! The tool itself is in `examples/support/mcp.rs`: `send_email` stops waiting when
//! rmcp cancels the request (`ctx.ct`), while the idempotent call inside it finishes and
//! records its result, so the client's retry gets it:
//!
//! ```ignore
//! #[idempotent(name = "send_email", run = self.run_of(&ctx), skip = [ctx],
//!              map_error = mcp_error, on_cancel = "finish")]
//! async fn deliver(&self, email: SendEmail, ctx: RequestContext<RoleServer>)
//!     -> Result<Sent, ErrorData> { .. }
//! ```
//!
//! `cargo run --example mcp_http` serves the same tool over streamable HTTP.

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
