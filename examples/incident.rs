//! An incident to practise on with the `idem` command (`docs/operations.md` walks
//! through it): an agent run sends two emails, then its worker dies in the middle of
//! charging a card, after the charge went out and before idem recorded it. The charge
//! tool is `at_most_once`, so the agent's retry cannot know what happened:
//! `OutcomeUnknown`. An operator looks, asks the provider, and resolves it.
//!
//! ```text
//! cargo run --example incident -- crash    # sends two emails, then dies mid-charge
//! cargo run --example incident -- retry    # the agent's retry: OutcomeUnknown, or the charge once resolved
//! ```
//!
//! The records go to the default store (`$IDEM_DIR`, else `./.idem`), or to the store
//! `IDEM_STORE` names (`postgres://...`, `redis://...`, as the `idem` command reads it).

use idem::{idempotent, Run};
use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
enum ToolError {
    #[error(transparent)]
    Idem(#[from] idem::Error),
}

#[derive(Debug, Serialize, Deserialize)]
struct Email {
    to: String,
    subject: String,
}

#[derive(Debug, Serialize, Deserialize)]
struct MessageId {
    message_id: String,
}

#[derive(Debug, Serialize, Deserialize)]
struct ChargeRequest {
    customer: String,
    amount_cents: u64,
}

#[derive(Debug, Serialize, Deserialize)]
struct Charge {
    id: String,
    amount_cents: u64,
}

#[idempotent(name = "send_email")]
async fn send_email(email: Email) -> Result<MessageId, ToolError> {
    println!("  sent \"{}\" to {}", email.subject, email.to);
    Ok(MessageId {
        message_id: format!("msg-{}", email.to.split('@').next().unwrap_or("x")),
    })
}

/// The worker dies right after the provider charged (`crash`), before idem can record
/// the charge.
#[idempotent(name = "charge_card", at_most_once, lease = "2s")]
async fn charge_card(charge: ChargeRequest) -> Result<Charge, ToolError> {
    println!(
        "  charged {} cents to {} (provider charge ch_0042)",
        charge.amount_cents, charge.customer
    );
    if std::env::args().nth(1).as_deref() == Some("crash") {
        println!("  ... and the worker dies before idem records the charge");
        std::process::exit(1);
    }
    Ok(Charge {
        id: "ch_0042".into(),
        amount_cents: charge.amount_cents,
    })
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let run = Run::new("ticket-4711").with_tenant("acme");
    let run = match std::env::var("IDEM_STORE").ok().filter(|s| !s.is_empty()) {
        #[cfg(feature = "postgres")]
        Some(url) if url.starts_with("postgres") => {
            run.with_store(idem::PostgresStore::connect(&url).await?)
        }
        #[cfg(feature = "redis")]
        Some(url) if url.starts_with("redis") => run.with_store(idem::RedisStore::connect(&url).await?),
        Some(other) => return Err(format!("IDEM_STORE={other}: this build reads only postgres:// and redis:// (with their features); unset it for the default store").into()),
        None => run,
    };
    let step = std::env::args().nth(1).unwrap_or_default();
    if step != "crash" && step != "retry" {
        return Err("usage: incident crash | incident retry".into());
    }
    run.scope(async {
        println!("agent run ticket-4711 (tenant acme):");
        for (to, subject) in [
            ("ada@example.com", "Your refund"),
            ("ops@example.com", "Refund issued"),
        ] {
            let email = Email {
                to: to.into(),
                subject: subject.into(),
            };
            let sent = send_email(email).await?;
            println!("  -> {}", sent.message_id);
        }
        let order = ChargeRequest {
            customer: "cus_ada".into(),
            amount_cents: 4200,
        };
        match charge_card(order).await {
            Ok(charge) => println!("  -> charge {} ({} cents)", charge.id, charge.amount_cents),
            Err(ToolError::Idem(e @ idem::Error::OutcomeUnknown { .. })) => {
                println!("  -> {e}");
                println!(
                    "     (look with `idem ls --state abandoned`, settle with `idem resolve`)"
                );
            }
            Err(e) => return Err(e),
        }
        Ok::<_, ToolError>(())
    })
    .await?;
    Ok(())
}
