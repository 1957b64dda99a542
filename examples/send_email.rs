//! The story idem exists for: an email that must not go out twice.
//!
//! **Act 1: the agent's own timeout.** The agent calls the tool inside
//! `tokio::time::timeout`, as most agent loops do. The provider accepts the email at
//! once but answers slowly, so the timeout drops the call after the email went out. The
//! agent retries with exponential backoff. Without idem the retry sends a second email.
//! With idem the dropped call finishes in the background and records the message id;
//! the retry waits for it and gets that same id. One email.
//!
//! **Act 2: a lost response.** The tool finishes, but its response is lost on the way
//! back. The retry gets the stored message id at once. Still one email.
//!
//! ```text
//! cargo run --example send_email               # run id "demo-run-1"
//! cargo run --example send_email               # again: 0 emails sent, same message ids
//! cargo run --example send_email -- run-43     # another run: sends once more
//! RUST_LOG=idem=debug cargo run --example send_email   # see idem's decisions
//! ```
//!
//! Records live in the embedded default store (`./.idem`, or `$IDEM_DIR`).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

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

/// How long the provider takes to answer after it accepted an email.
const PROVIDER_ANSWERS_AFTER: Duration = Duration::from_millis(1200);
/// How long the agent waits for a tool call before it gives up on it.
const AGENT_TIMEOUT: Duration = Duration::from_millis(500);

/// Sends the email at once; the provider's answer takes `PROVIDER_ANSWERS_AFTER`.
async fn deliver(email: &SendEmail) -> MessageId {
    DELIVERED.fetch_add(1, Ordering::SeqCst);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    println!(
        "    provider: delivered \"{}\" to {}",
        email.subject, email.to
    );
    tokio::time::sleep(PROVIDER_ANSWERS_AFTER).await;
    MessageId(format!("msg-{:x}", nanos & 0xffff_ffff_ffff))
}

/// The tool. One attribute: retries of the same call in the same run are answered with
/// the first call's result; a call the agent stops waiting for finishes anyway.
#[idempotent(ttl = "24h")]
async fn send_email(input: SendEmail) -> Result<MessageId, ToolError> {
    Ok(deliver(&input).await)
}

/// The agent's retry policy: exponential backoff with jitter, at most 6 retries.
fn backoff() -> ExponentialBuilder {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(50))
        .with_max_times(6)
        .with_jitter()
}

/// Calls `attempt` with the agent's retry policy, printing each attempt.
async fn with_retries<F, Fut>(attempt: F) -> Result<MessageId, ToolError>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<MessageId, ToolError>>,
{
    let started = Instant::now();
    let attempts = AtomicUsize::new(0);
    (|| async {
        let n = attempts.fetch_add(1, Ordering::SeqCst) + 1;
        let result = attempt().await;
        let at = started.elapsed().as_secs_f64();
        match &result {
            Ok(id) => println!("  attempt {n} (t = {at:.2} s): ok, message id {}", id.0),
            Err(e) => println!("  attempt {n} (t = {at:.2} s): error: {e}"),
        }
        result
    })
    .retry(backoff())
    .when(|e| matches!(e, ToolError::Timeout))
    .await
}

/// The network between the agent and the tool server loses the next response.
static LOSE_NEXT_RESPONSE: AtomicBool = AtomicBool::new(true);

/// Act 2's tool-calling layer: the server finishes the call, and the response is lost.
async fn call_over_a_lossy_network(run: &Run, input: SendEmail) -> Result<MessageId, ToolError> {
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
    println!(
        "idem send_email example: run id {run_id:?}, store {}",
        idem::default_store_dir().display()
    );

    println!();
    println!(
        "Act 1: the agent gives up after {AGENT_TIMEOUT:?}; the provider answers after {PROVIDER_ANSWERS_AFTER:?}"
    );
    let shipped = SendEmail {
        to: "ada@example.com".into(),
        subject: "Your order has shipped".into(),
        body: "It will arrive on Tuesday.".into(),
    };
    let act1 = with_retries(|| async {
        let call = run.scope(send_email(shipped.clone()));
        match tokio::time::timeout(AGENT_TIMEOUT, call).await {
            Ok(result) => result,
            Err(_elapsed) => Err(ToolError::Timeout),
        }
    })
    .await?;
    let after_act1 = DELIVERED.load(Ordering::SeqCst);
    println!("  emails delivered: {after_act1}");

    println!();
    println!("Act 2: the tool finishes, and its response is lost on the way back");
    let delivered = SendEmail {
        to: "ada@example.com".into(),
        subject: "Your order was delivered".into(),
        body: "Enjoy!".into(),
    };
    let act2 = with_retries(|| call_over_a_lossy_network(&run, delivered.clone())).await?;
    println!(
        "  emails delivered: {}",
        DELIVERED.load(Ordering::SeqCst) - after_act1
    );

    println!();
    println!(
        "emails delivered by this process: {} (one per email, at most)",
        DELIVERED.load(Ordering::SeqCst)
    );
    println!(
        "message ids the agent received:   {} and {}",
        act1.0, act2.0
    );
    println!();
    println!(
        "Run it again with the same run id: nothing is delivered, the same message ids come back."
    );
    println!("Pass another run id (cargo run --example send_email -- run-43) to send once more.");
    Ok(())
}
