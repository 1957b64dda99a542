//! Exactly once through a real downstream API: the tool forwards `idem::current_key()`
//! as the provider's `Idempotency-Key`. The tool's process is killed (SIGKILL) at many
//! points, including after the provider charged and before idem stored the result; the
//! agent retries in a new process; the provider must have charged each order once.
//!
//! The same campaign runs an `at_most_once` tool with a reconcile hook against a
//! provider that does not deduplicate (it only records keys, for lookups): the retry
//! asks the provider what happened to the abandoned call, and must get the one charge
//! made, or run the charge once, never `OutcomeUnknown` and never a second charge.
//!
//! `IDEM_KILL_POINTS=50 cargo test --test downstream -- --nocapture` runs a longer
//! campaign and prints where the kills landed.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use idem::{idempotent, Key, Reconciled, Run, SledStore};
use idem_testkit::provider::{self, Charge, ChargeRequest, Provider};

#[derive(Debug, thiserror::Error)]
enum PaymentError {
    #[error(transparent)]
    Idem(#[from] idem::Error),
    #[error("payment provider: {0}")]
    Provider(String),
}

/// The payment tool: charges through the provider, forwarding idem's key, then does
/// some slow bookkeeping (the window in which a crash loses idem's own record).
#[idempotent(name = "charge_card", lease = "300ms", skip = [http, base, bookkeeping_ms])]
async fn charge_card(
    run: &Run,
    input: ChargeRequest,
    http: &reqwest::Client,
    base: &str,
    bookkeeping_ms: u64,
) -> Result<Charge, PaymentError> {
    charge_card_body(input, http, base, bookkeeping_ms).await
}

/// The payment tool at most once, for a provider that does not deduplicate: it sends
/// idem's key only so that the provider records it, and its reconcile hook asks the
/// provider for the charge made under it.
#[idempotent(
    name = "charge_card_once",
    lease = "300ms",
    at_most_once,
    reconcile = charge_made,
    skip = [http, base, bookkeeping_ms]
)]
async fn charge_card_once(
    run: &Run,
    input: ChargeRequest,
    http: &reqwest::Client,
    base: &str,
    bookkeeping_ms: u64,
) -> Result<Charge, PaymentError> {
    charge_card_body(input, http, base, bookkeeping_ms).await
}

/// What every payment tool here does: one charge through the provider, carrying idem's
/// key, then `bookkeeping_ms` of bookkeeping.
async fn charge_card_body(
    input: ChargeRequest,
    http: &reqwest::Client,
    base: &str,
    bookkeeping_ms: u64,
) -> Result<Charge, PaymentError> {
    let key = idem::current_key().ok_or_else(|| PaymentError::Provider("no key".into()))?;
    let (charge, _) = provider::charge(http, base, key.as_str(), &input)
        .await
        .map_err(PaymentError::Provider)?;
    tokio::time::sleep(Duration::from_millis(bookkeeping_ms)).await;
    Ok(charge)
}

/// The reconcile hook: the provider's charge under the call's key, if it made one.
async fn charge_made(
    key: &Key,
    _input: &ChargeRequest,
    http: &&reqwest::Client,
    base: &&str,
    _bookkeeping_ms: &u64,
) -> Reconciled<Charge> {
    match provider::lookup(http, base, key.as_str()).await {
        Ok(Some(charge)) => Reconciled::Happened(charge),
        Ok(None) => Reconciled::NeverHappened,
        Err(_) => Reconciled::Unknown,
    }
}

/// The same tool without the hook: what `at_most_once` alone answers.
#[idempotent(
    name = "charge_card_once",
    lease = "300ms",
    at_most_once,
    skip = [http, base, bookkeeping_ms]
)]
async fn charge_card_once_unreconciled(
    run: &Run,
    input: ChargeRequest,
    http: &reqwest::Client,
    base: &str,
    bookkeeping_ms: u64,
) -> Result<Charge, PaymentError> {
    charge_card_body(input, http, base, bookkeeping_ms).await
}

fn order(i: u64) -> ChargeRequest {
    ChargeRequest {
        customer: format!("cus_{i}"),
        amount_cents: 1000 + i,
        currency: "eur".into(),
    }
}

const ROLE: &str = "IDEM_TEST_PAY_ROLE";
const URL: &str = "IDEM_TEST_PAY_URL";
const DIR: &str = "IDEM_TEST_PAY_DIR";
const ORDER: &str = "IDEM_TEST_PAY_ORDER";

/// The tool process. `charge`: one attempt (it may be killed at any point). `retry`: the
/// agent's retry in a new process, until it gets an answer, written to `answer`.
#[test]
#[ignore = "tool process of the downstream tests; started by them"]
fn payment_worker() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let url = std::env::var(URL).unwrap();
    let dir = PathBuf::from(std::env::var(DIR).unwrap());
    let i: u64 = std::env::var(ORDER).unwrap().parse().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let run =
            Run::new(format!("order-{i}")).with_store(SledStore::open(dir.join("store")).unwrap());
        let http = reqwest::Client::new();
        match role.as_str() {
            "charge" => {
                let _ = charge_card(&run, order(i), &http, &url, 80).await;
            }
            "charge_once" => {
                let _ = charge_card_once(&run, order(i), &http, &url, 80).await;
            }
            "retry_once" => {
                // The agent's retry, once: an `OutcomeUnknown` is written down, not retried.
                let answer = match charge_card_once(&run, order(i), &http, &url, 0).await {
                    Ok(charge) => charge.id,
                    Err(PaymentError::Idem(idem::Error::OutcomeUnknown { .. })) => "unknown".into(),
                    Err(e) => format!("error: {e}"),
                };
                std::fs::write(dir.join("answer"), answer).unwrap();
            }
            "retry" => {
                let deadline = Instant::now() + Duration::from_secs(30);
                let charge = loop {
                    match charge_card(&run, order(i), &http, &url, 0).await {
                        Ok(charge) => break charge,
                        Err(e) => assert!(Instant::now() < deadline, "retry never succeeded: {e}"),
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                };
                std::fs::write(dir.join("answer"), charge.id).unwrap();
            }
            other => panic!("unknown role {other}"),
        }
    });
}

fn spawn(role: &str, url: &str, dir: &Path, i: u64) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "payment_worker", "--quiet"])
        .env(ROLE, role)
        .env(URL, url)
        .env(DIR, dir)
        .env(ORDER, i.to_string())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap()
}

/// Where the kills of a campaign landed: before the charge, after it and before idem
/// stored the result, after the call finished.
struct Landed {
    before_charge: u64,
    in_window: u64,
    after_finish: u64,
}

/// The kill-point campaign: for each order, a `charge` process killed at a point spread
/// over its attempt (before the claim, during the request, after the charge during
/// bookkeeping, after the result is stored), then the agent's retry in a new process,
/// with the same run id. Each order must be charged once, and the retry get that charge.
async fn kill_points(provider: &Provider, charge: &str, retry: &str) -> Landed {
    let kill_points: u64 = std::env::var("IDEM_KILL_POINTS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(20);
    let mut landed = Landed {
        before_charge: 0,
        in_window: 0,
        after_finish: 0,
    };
    for i in 0..kill_points {
        let dir = tempfile::tempdir().unwrap();
        let charged_before = provider.charges().len();
        let mut first = spawn(charge, &provider.url(), dir.path(), i);
        tokio::time::sleep(Duration::from_millis((i * 37) % 180)).await;
        let finished = first.try_wait().unwrap().is_some();
        let _ = first.kill();
        first.wait().unwrap();
        match (provider.charges().len() - charged_before, finished) {
            (0, _) => landed.before_charge += 1,
            (_, false) => landed.in_window += 1,
            (_, true) => landed.after_finish += 1,
        }
        let mut retry = spawn(retry, &provider.url(), dir.path(), i);
        let status = tokio::task::spawn_blocking(move || retry.wait().unwrap())
            .await
            .unwrap();
        assert!(status.success(), "order {i}: the retry failed");
        let answer = std::fs::read_to_string(dir.path().join("answer")).unwrap();
        let charges = &provider.charges()[charged_before..];
        assert_eq!(
            charges.len(),
            1,
            "order {i}: charged {} times (the agent got {answer})",
            charges.len()
        );
        assert_eq!(answer, charges[0].id, "order {i}: the agent got {answer}");
    }
    assert_eq!(provider.charges().len() as u64, kill_points);
    assert!(
        landed.in_window > 0,
        "no kill landed in the window this test is about"
    );
    println!(
        "{kill_points} kill points: {} before the charge, {} after the charge and before idem \
         stored the result, {} after the call finished; charges made: {} for {kill_points} orders",
        landed.before_charge,
        landed.in_window,
        landed.after_finish,
        provider.charges().len()
    );
    landed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_charge_the_retry_is_replayed_by_the_provider() {
    let provider = Provider::start().await.unwrap();
    kill_points(&provider, "charge", "retry").await;
}

/// At most once with a reconcile hook, against a provider that does not deduplicate:
/// the retry (one, at once, within the dead claim's lease) asks the provider and gets
/// the charge that was made, or makes it once; never `OutcomeUnknown` (the retry would
/// answer `unknown`, which is no charge id).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_at_most_once_calls_are_reconciled_with_the_provider() {
    let provider = Provider::start_without_replay().await.unwrap();
    kill_points(&provider, "charge_once", "retry_once").await;
}

/// The agent's own timeout drops the call after the charge went out (the story idem
/// exists for). At most once alone, the retry can only say the outcome is unknown;
/// with the hook, it gets the charge that was made, and nothing is charged twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_timeout_after_the_charge_is_reconciled_not_unknown() {
    let provider = Provider::start_without_replay().await.unwrap();
    let http = reqwest::Client::new();
    let url = provider.url();
    let store = idem::MemoryStore::new();
    for (n, reconciled) in [(0, false), (1, true)] {
        let run = Run::new(format!("timeout-{n}")).with_store(store.clone());
        let timed_out = tokio::time::timeout(Duration::from_millis(150), async {
            match reconciled {
                true => charge_card_once(&run, order(n), &http, &url, 1_000).await,
                false => charge_card_once_unreconciled(&run, order(n), &http, &url, 1_000).await,
            }
        })
        .await;
        assert!(timed_out.is_err(), "the call outlived the agent's timeout");
        assert_eq!(
            provider.charges().len() as u64,
            n + 1,
            "the charge went out"
        );
        let retry = match reconciled {
            true => charge_card_once(&run, order(n), &http, &url, 0).await,
            false => charge_card_once_unreconciled(&run, order(n), &http, &url, 0).await,
        };
        match (reconciled, retry) {
            (false, Err(PaymentError::Idem(idem::Error::OutcomeUnknown { .. }))) => {}
            (true, Ok(charge)) => assert_eq!(charge, provider.charges()[n as usize]),
            (_, other) => panic!("reconciled: {reconciled}: {other:?}"),
        }
        assert_eq!(provider.charges().len() as u64, n + 1, "charged twice");
        // Every later retry replays the same charge.
        if reconciled {
            let again = charge_card_once(&run, order(n), &http, &url, 0)
                .await
                .unwrap();
            assert_eq!(again, provider.charges()[n as usize]);
        }
    }
}
