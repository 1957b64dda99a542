//! A payment tool that charges through an HTTP payment provider and forwards idem's key
//! as the provider's `Idempotency-Key`: exactly one charge, even when the tool dies after
//! the provider charged and before idem stored the result.
//!
//! idem alone cannot close that window: the charge happened, but no record says so, and
//! after the lease runs out the retry runs the body again. Forwarding
//! `idem::current_key()` closes it: the re-run sends the same key, and the provider
//! returns the first charge instead of charging again.
//!
//! ```text
//! cargo run --example payment
//! ```
//!
//! The provider is a real HTTP server on 127.0.0.1 (an ephemeral port) that honours
//! `Idempotency-Key` the way Stripe documents it. The agent retries with exponential
//! backoff and jitter (`backon`). A tool that must never run twice without knowing the
//! outcome, even with a downstream that does not deduplicate, uses `at_most_once`: the
//! retry then gets `Error::OutcomeUnknown` (see `cargo run --example crash_campaign`).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use idem::{idempotent, MemoryStore, Run};
use idem_testkit::provider::{self, Charge, ChargeRequest, Provider};

#[derive(Debug, thiserror::Error)]
enum PaymentError {
    #[error("no response from the tool within the agent's timeout")]
    Timeout,
    #[error("payment provider: {0}")]
    Provider(String),
    #[error(transparent)]
    Idem(#[from] idem::Error),
}

/// The first attempt's worker hangs right after the provider charged: it never stores
/// the result (as if it had been killed).
static HANG_AFTER_CHARGE: AtomicBool = AtomicBool::new(true);

/// How many times the tool's body ran, in this process.
static BODY_RUNS: AtomicUsize = AtomicUsize::new(0);

/// The tool: one HTTP request to the provider, carrying idem's key for this call.
#[idempotent(name = "charge_card", ttl = "24h", lease = "300ms", skip = [http, base])]
async fn charge_card(
    input: ChargeRequest,
    http: &reqwest::Client,
    base: &str,
) -> Result<Charge, PaymentError> {
    BODY_RUNS.fetch_add(1, Ordering::SeqCst);
    let key = idem::current_key().ok_or_else(|| PaymentError::Provider("no key".into()))?;
    let (charge, replayed) = provider::charge(http, base, key.as_str(), &input)
        .await
        .map_err(PaymentError::Provider)?;
    println!(
        "    tool: provider answered {} ({})",
        charge.id,
        if replayed { "replayed" } else { "charged" }
    );
    if HANG_AFTER_CHARGE.swap(false, Ordering::SeqCst) {
        println!("    tool: the worker hangs after the charge, before idem stores the result");
        std::future::pending::<()>().await;
    }
    Ok(charge)
}

#[tokio::main]
async fn main() -> Result<(), PaymentError> {
    let provider = Provider::start()
        .await
        .map_err(|e| PaymentError::Provider(e.to_string()))?;
    let http = reqwest::Client::new();
    let base = provider.url();
    let run = Run::new("checkout-7").with_store(MemoryStore::new());
    let order = ChargeRequest {
        customer: "cus_ada".into(),
        amount_cents: 4200,
        currency: "eur".into(),
    };
    println!("provider on {base}");

    // The agent: each attempt gets 200 ms; a timeout is retried with exponential backoff
    // and jitter. The attempt that timed out is abandoned, its claim left to expire.
    let attempts = AtomicUsize::new(0);
    let attempt = || async {
        let n = attempts.fetch_add(1, Ordering::SeqCst) + 1;
        let call = run.scope(charge_card(order.clone(), &http, &base));
        let result = match tokio::time::timeout(Duration::from_millis(200), call).await {
            Ok(result) => result,
            Err(_) => Err(PaymentError::Timeout),
        };
        match &result {
            Ok(charge) => println!("  attempt {n}: ok, {}", charge.id),
            Err(e) => println!("  attempt {n}: {e}"),
        }
        result
    };
    let charge = attempt
        .retry(
            ExponentialBuilder::default()
                .with_min_delay(Duration::from_millis(50))
                .with_max_times(5)
                .with_jitter(),
        )
        .when(|e| matches!(e, PaymentError::Timeout))
        .await?;

    // Later, the agent asks again (a replayed conversation): idem answers, no request.
    let again = run.scope(charge_card(order.clone(), &http, &base)).await?;

    println!();
    println!(
        "attempts by the agent:    {}",
        attempts.load(Ordering::SeqCst)
    );
    println!(
        "tool bodies run:          {} (the hung one, and the re-run after its lease)",
        BODY_RUNS.load(Ordering::SeqCst)
    );
    println!("charge the agent got:     {}", charge.id);
    println!("charge on a later call:   {} (replayed by idem)", again.id);
    println!(
        "cards really charged:     {} (for 1 order)",
        provider.charges().len()
    );
    Ok(())
}
