//! The story idem exists for: an email that must not go out twice.
//!
//! An agent asks a tool to send an email. The provider sends it, but the response is
//! lost on the way back (a timeout). The agent retries with exponential backoff, as any
//! sane agent does. Without idem the customer gets two emails; with idem the retry
//! receives the first attempt's message id and nothing is sent again.
//!
//! ```text
//! cargo run --example send_email               # run id "demo-run-1"
//! cargo run --example send_email               # again: 0 emails sent, same message id
//! cargo run --example send_email -- run-43     # another run: sends once more
//! RUST_LOG=idem=debug cargo run --example send_email   # see idem's decisions
//! ```
//!
//! Records live in the embedded default store (`./.idem`, or `$IDEM_DIR`).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use backon::{ExponentialBuilder, Retryable};
use idem::{idempotent, Run};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct SendEmail {
    to: String,
    subject: String,
    body: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct MessageId(String);

#[derive(Debug, thiserror::Error)]
enum ToolError {
    #[error("timed out waiting for the tool's response")]
    Timeout,
    #[error(transparent)]
    Idem(#[from] idem::Error),
}

/// The email provider: every call to `deliver` really sends (here: counts) an email.
static DELIVERED: AtomicUsize = AtomicUsize::new(0);

fn deliver(email: &SendEmail) -> MessageId {
    DELIVERED.fetch_add(1, Ordering::SeqCst);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    println!(
        "    provider: delivered \"{}\" to {}",
        email.subject, email.to
    );
    MessageId(format!("msg-{:x}", nanos & 0xffff_ffff_ffff))
}

/// The tool. One attribute: retries of the same call in the same run are replayed.
#[idempotent(ttl = "24h")]
async fn send_email(input: SendEmail) -> Result<MessageId, ToolError> {
    Ok(deliver(&input))
}

/// The network between the agent and the tool server loses the first response.
static LOSE_NEXT_RESPONSE: AtomicBool = AtomicBool::new(true);

/// What the agent's tool-calling layer does: send the call to the tool server, wait for
/// the response. The server finishes the call even when the response is lost.
async fn call_tool(run: &Run, input: SendEmail) -> Result<MessageId, ToolError> {
    let server = tokio::spawn(run.scope(send_email(input)));
    let response = server.await.map_err(|_| ToolError::Timeout)?;
    if LOSE_NEXT_RESPONSE.swap(false, Ordering::SeqCst) {
        return Err(ToolError::Timeout);
    }
    response
}

#[tokio::main]
async fn main() -> Result<(), ToolError> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let run_id = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "demo-run-1".into());
    let run = Run::new(&run_id);
    let input = SendEmail {
        to: "ada@example.com".into(),
        subject: "Your order has shipped".into(),
        body: "It will arrive on Tuesday.".into(),
    };
    println!(
        "idem send_email example: run id {run_id:?}, store {}",
        idem::default_store_dir().display()
    );

    // The agent's retry policy: exponential backoff with jitter, at most 4 retries.
    let attempts = AtomicUsize::new(0);
    let result = (|| async {
        let n = attempts.fetch_add(1, Ordering::SeqCst) + 1;
        let result = call_tool(&run, input.clone()).await;
        match &result {
            Ok(id) => println!("  attempt {n}: ok, message id {}", id.0),
            Err(e) => println!("  attempt {n}: error: {e}"),
        }
        result
    })
    .retry(
        ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(50))
            .with_max_times(4)
            .with_jitter(),
    )
    .when(|e| matches!(e, ToolError::Timeout))
    .await;

    println!();
    println!(
        "attempts made:                   {}",
        attempts.load(Ordering::SeqCst)
    );
    println!(
        "emails delivered by this process: {}",
        DELIVERED.load(Ordering::SeqCst)
    );
    if let Ok(id) = &result {
        println!("message id the agent received:   {}", id.0);
    }
    println!();
    println!(
        "Run it again with the same run id: nothing is delivered, the same message id comes back."
    );
    println!("Pass another run id (cargo run --example send_email -- run-43) to send once more.");
    result.map(|_| ())
}
