//! A payment tool: at-most-once, and forwarding idem's key to the payment provider.
//!
//! Charging a card twice is worse than not knowing whether it was charged. So this
//! tool is `at_most_once`: if an attempt dies between claiming the key and recording
//! the outcome, later calls get `OutcomeUnknown` instead of charging again. And the
//! tool forwards `idem::current_key()` as the provider's idempotency key, so even the
//! crash window after the charge and before idem stores the result cannot double
//! charge: the provider recognises the key and returns the first charge.
//!
//! ```text
//! cargo run --example payment
//! ```
//!
//! The provider here is an in-process stand-in that honours idempotency keys the way
//! Stripe documents them: same key, same parameters → the stored charge.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use idem::{idempotent, Error, MemoryStore, Run, Store};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Charge {
    customer: String,
    cents: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct ChargeId(String);

#[derive(Debug, thiserror::Error)]
enum PaymentError {
    #[error(transparent)]
    Idem(#[from] Error),
}

/// The provider: charges, keyed by the caller's idempotency key.
#[derive(Default)]
struct Provider {
    charges: Mutex<HashMap<String, ChargeId>>,
    charged: Mutex<u32>,
}

impl Provider {
    fn charge(&self, idempotency_key: &str, charge: &Charge) -> ChargeId {
        let mut charges = self.charges.lock().unwrap();
        if let Some(id) = charges.get(idempotency_key) {
            println!("    provider: key seen before, returning {}", id.0);
            return id.clone();
        }
        let mut charged = self.charged.lock().unwrap();
        *charged += 1;
        let id = ChargeId(format!("ch_{}", *charged));
        println!(
            "    provider: charged {} cents to {} ({})",
            charge.cents, charge.customer, id.0
        );
        charges.insert(idempotency_key.to_owned(), id.clone());
        id
    }
}

static PROVIDER: std::sync::LazyLock<Provider> = std::sync::LazyLock::new(Provider::default);

#[idempotent(ttl = "24h", lease = "300ms", at_most_once, skip = [crash_after_charge])]
async fn charge_card(input: Charge, crash_after_charge: bool) -> Result<ChargeId, PaymentError> {
    // The key of this very call: the provider deduplicates on it too.
    let key = idem::current_key().expect("inside an idempotent call");
    let id = PROVIDER.charge(key.as_str(), &input);
    if crash_after_charge {
        // The worker dies after the provider charged, before idem stored the result.
        std::future::pending::<()>().await;
    }
    Ok(id)
}

#[tokio::main]
async fn main() -> Result<(), PaymentError> {
    let store = MemoryStore::new();
    let run = Run::new("checkout-7").with_store(store.clone());
    let order = Charge {
        customer: "cus_ada".into(),
        cents: 4200,
    };

    println!("1. A charge, and the agent's retry of it:");
    let first = run.scope(charge_card(order.clone(), false)).await?;
    let retry = run.scope(charge_card(order.clone(), false)).await?;
    println!("   first {}, retry {} (replayed by idem)", first.0, retry.0);

    println!("2. A worker that dies right after the provider charged:");
    let other = Charge {
        customer: "cus_bob".into(),
        cents: 990,
    };
    let crashed = tokio::time::timeout(
        Duration::from_millis(100),
        run.scope(charge_card(other.clone(), true)),
    )
    .await;
    println!("   the attempt never returned: {}", crashed.is_err());
    // The same call, after the dead worker's lease ran out.
    tokio::time::sleep(Duration::from_millis(400)).await;
    match run.scope(charge_card(other.clone(), true)).await {
        Err(PaymentError::Idem(Error::OutcomeUnknown { key })) => {
            println!("   retry: outcome unknown, not charged again (key {key})");
            // An operator (or the agent) asks the provider with the same key...
            let known = PROVIDER.charges.lock().unwrap().get(&key).cloned();
            println!("   provider knows this key: {:?}", known.map(|c| c.0));
            // ...and, knowing the outcome, clears the record so the call can complete.
            store.delete(&idem::Key::from_text(key)).await?;
            let settled = run.scope(charge_card(other, false)).await?;
            println!(
                "   after clearing the record: {} (the provider replayed it)",
                settled.0
            );
        }
        other => println!("   unexpected: {other:?}"),
    }

    println!();
    println!(
        "cards charged: {} (for 2 orders)",
        PROVIDER.charged.lock().unwrap()
    );
    Ok(())
}
