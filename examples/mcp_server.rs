//! An MCP server on stdio whose `send_email` tool is idempotent per agent run.
//!
//! ```text
//! cargo run --features rmcp --example mcp_server [-- --latency-ms 2000]
//! ```
//!
//! Point an MCP client at it, and send the agent's run id in each `tools/call`
//! request's `_meta["idem/run"]`. A retried call (same run id, same arguments) returns
//! the first call's result and sends nothing; a call without a run id is refused with
//! an `invalid params` error that says where the id goes. Records are kept in idem's
//! default store (`$IDEM_DIR`, else `./.idem`), so a retry after a server restart is
//! replayed too. `--latency-ms` makes the provider answer that long after it sent, so a
//! client can give up mid-call and retry. The server logs to stderr
//! (`RUST_LOG=idem=debug` for each decision).
//!
//! The server in `idem-testkit/src/mcp.rs` knows nothing of idem; one line makes its
//! side-effecting tools idempotent:
//!
//! ```ignore
//! let service = idem::mcp::Idempotent::new(Mailer::new()).shared_store(store);
//! ```
//!
//! `cargo run --example mcp_http` serves the same tool over streamable HTTP.

use idem_testkit::mcp;
use rmcp::ServiceExt;
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // stdout carries the protocol: logs go to stderr.
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();

    let args: Vec<String> = std::env::args().skip(1).collect();
    let mailer = mcp::Mailer::new().with_latency(mcp::latency_flag(&args)?);
    let store = idem::default_store()?;
    let server = idem::mcp::Idempotent::new(mailer)
        .shared_store(store)
        .serve(rmcp::transport::stdio())
        .await?;
    server.waiting().await?;
    Ok(())
}
