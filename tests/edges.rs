//! Guarantees at the edges: each test is a way a retry could get a value the first
//! caller did not, run the side effect a second time, or wait out a lease in a live
//! process, tried as a user would. Each counts how often the side effect really ran,
//! what each caller got, and how long the retry took (a bound with a wide margin
//! against a 60-second lease, never a tight timing).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem::store::State;
use idem::{idempotent, Error, Key, LocalCache, MemoryStore, Reconciled, Run, SledStore, Store};
use serde::{Deserialize, Serialize};

/// Far below the 60-second leases of these tools: a retry that took longer waited one
/// out.
const PROMPT: Duration = Duration::from_secs(5);

/// The provider's side: every delivery really happens, and is counted.
#[derive(Clone, Default)]
struct Provider(Arc<AtomicUsize>);

impl Provider {
    fn deliver(&self) -> usize {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }
    fn delivered(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

fn unique(prefix: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!(
        "{prefix}_{}_{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

/// Every store, made on the current runtime (a network store's connections live on
/// it): memory, sled, `LocalCache`, and Postgres and Redis when their URLs are set
/// (said loudly when they are not).
async fn stores(dir: &std::path::Path) -> Vec<(&'static str, Arc<dyn Store>)> {
    #[cfg_attr(not(any(feature = "postgres", feature = "redis")), allow(unused_mut))]
    let mut stores: Vec<(&'static str, Arc<dyn Store>)> = vec![
        ("memory", Arc::new(MemoryStore::new())),
        (
            "sled",
            Arc::new(SledStore::open(dir.join(unique("sled"))).unwrap()),
        ),
        ("local-cache", Arc::new(LocalCache::new(MemoryStore::new()))),
    ];
    #[cfg(feature = "postgres")]
    match std::env::var("IDEM_POSTGRES_URL") {
        Ok(url) => stores.push((
            "postgres",
            Arc::new(
                idem::PostgresStore::builder(&url)
                    .table(unique("idem_edges"))
                    .connect()
                    .await
                    .unwrap(),
            ),
        )),
        Err(_) => eprintln!("SKIPPED the Postgres store: IDEM_POSTGRES_URL is not set"),
    }
    #[cfg(feature = "redis")]
    match std::env::var("IDEM_REDIS_URL") {
        Ok(url) => stores.push((
            "redis",
            Arc::new(
                idem::RedisStore::builder(&url)
                    .prefix(format!("{}:", unique("idem-edges")))
                    .connect()
                    .await
                    .unwrap(),
            ),
        )),
        Err(_) => eprintln!("SKIPPED the Redis store: IDEM_REDIS_URL is not set"),
    }
    stores
}

/// Log lines, captured.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    /// Captures this thread's warnings while it lives.
    fn warnings() -> (Self, tracing::subscriber::DefaultGuard) {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::WARN)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        (captured, tracing::subscriber::set_default(subscriber))
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

// ----- 1. A reconcile hook's value passes the read-back check ---------------------

/// Two variants whose JSON overlaps: `I(1)` is written `1`, which reads back as
/// `F(1.0)`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
enum Amount {
    F(f64),
    I(u64),
}

/// What each hook answers `Happened` with.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Answer {
    Nan,
    Overlapping,
    Valid,
}

/// Whether the charge's body panics (the first call's does, leaving its claim
/// abandoned).
static PANIC_FIRST: Mutex<Vec<u32>> = Mutex::new(Vec::new());

fn body(order: u32, provider: &Provider) -> u64 {
    provider.deliver();
    let mut first = PANIC_FIRST.lock().unwrap();
    if !first.contains(&order) {
        first.push(order);
        drop(first);
        panic!("the charge's process fell over after charging");
    }
    7
}

async fn answers_nan(_key: &Key, _order: &u32, _p: &Provider) -> Reconciled<f64> {
    Reconciled::Happened(f64::NAN)
}

#[idempotent(lease = "60s", at_most_once, reconcile = answers_nan, skip = [provider])]
async fn charge_as_float(order: u32, provider: &Provider) -> Result<f64, Error> {
    Ok(body(order, provider) as f64)
}

async fn answers_overlapping(_key: &Key, _order: &u32, _p: &Provider) -> Reconciled<Amount> {
    Reconciled::Happened(Amount::I(1))
}

#[idempotent(lease = "60s", at_most_once, reconcile = answers_overlapping, skip = [provider])]
async fn charge_as_amount(order: u32, provider: &Provider) -> Result<Amount, Error> {
    Ok(Amount::I(body(order, provider)))
}

async fn answers_valid(_key: &Key, _order: &u32, _p: &Provider) -> Reconciled<Amount> {
    Reconciled::Happened(Amount::F(2.5))
}

#[idempotent(lease = "60s", at_most_once, reconcile = answers_valid, skip = [provider])]
async fn charge_reconciled(order: u32, provider: &Provider) -> Result<Amount, Error> {
    Ok(Amount::I(body(order, provider)))
}

/// Runs `call` on a task of its own, where its body panics: its claim is left
/// abandoned (at-most-once).
async fn abandon<T: Send + std::fmt::Debug + 'static>(
    call: impl std::future::Future<Output = T> + Send + 'static,
) {
    let panicked = tokio::spawn(call).await.unwrap_err();
    assert!(panicked.is_panic());
}

#[tokio::test]
async fn a_reconcile_value_that_does_not_read_back_counts_as_unknown() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let run = Run::new(unique("reconcile-read-back")).with_shared_store(store.clone());
    let provider = Provider::default();
    let (captured, _logs) = Captured::warnings();
    for answer in [Answer::Nan, Answer::Overlapping, Answer::Valid] {
        let order = match answer {
            Answer::Nan => 1,
            Answer::Overlapping => 2,
            Answer::Valid => 3,
        };
        let (p, r) = (provider.clone(), run.clone());
        let (tool, retry): (&str, Result<String, Error>) = match answer {
            Answer::Nan => {
                abandon(async move { r.scope(charge_as_float(order, &p)).await }).await;
                let retry = run.scope(charge_as_float(order, &provider)).await;
                ("charge_as_float", retry.map(|v| format!("{v:?}")))
            }
            Answer::Overlapping => {
                abandon(async move { r.scope(charge_as_amount(order, &p)).await }).await;
                let retry = run.scope(charge_as_amount(order, &provider)).await;
                ("charge_as_amount", retry.map(|v| format!("{v:?}")))
            }
            Answer::Valid => {
                abandon(async move { r.scope(charge_reconciled(order, &p)).await }).await;
                let retry = run.scope(charge_reconciled(order, &provider)).await;
                ("charge_reconciled", retry.map(|v| format!("{v:?}")))
            }
        };
        match answer {
            // Stored, every retry for the TTL would get `StoredResult` (NaN) or the
            // other variant (`F(1.0)`): the value is refused, and the outcome stays
            // unknown, which is what the call answers.
            Answer::Nan | Answer::Overlapping => {
                let err = retry.unwrap_err();
                assert!(
                    matches!(err, Error::OutcomeUnknown { .. }),
                    "{answer:?}: {err}"
                );
                let key = err.key().unwrap().clone();
                let record = store.get(&key).await.unwrap().unwrap();
                assert!(
                    matches!(record.state, State::InProgress { .. }),
                    "{answer:?}: the claim is left abandoned, nothing is stored"
                );
                let logs = captured.text();
                let warning = logs
                    .lines()
                    .find(|l| l.contains("reconcile hook's result cannot be stored"))
                    .unwrap_or_else(|| panic!("{answer:?}: no warning:\n{logs}"));
                assert!(
                    warning.contains(&format!("tool=edges::{tool}")),
                    "{warning}"
                );
                assert!(warning.contains(key.as_str()), "{warning}");
                // A second retry asks again, and answers the same.
                let again = match answer {
                    Answer::Nan => run.scope(charge_as_float(order, &provider)).await.err(),
                    _ => run.scope(charge_as_amount(order, &provider)).await.err(),
                };
                assert!(matches!(again, Some(Error::OutcomeUnknown { .. })));
            }
            // A value that reads back as itself is recorded and replayed.
            Answer::Valid => {
                assert_eq!(retry.unwrap(), "F(2.5)");
                let replayed = run.scope(charge_reconciled(order, &provider)).await;
                assert_eq!(replayed.unwrap(), Amount::F(2.5));
            }
        }
        captured.0.lock().unwrap().clear();
    }
    assert_eq!(
        provider.delivered(),
        3,
        "each charge ran once, and never again"
    );
}

// ----- 2. A field the JSON never holds ---------------------------------------------

/// A receipt whose amount is never serialized: a retry would read it back as 0.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Receipt {
    id: String,
    #[serde(skip_serializing, default)]
    amount: u64,
}

#[idempotent(lease = "60s", skip = [provider])]
async fn issue_receipt(order: u32, provider: &Provider) -> Result<Receipt, Error> {
    Ok(Receipt {
        id: format!("rc-{}", provider.deliver()),
        amount: 4200,
    })
}

/// The same receipt without `PartialEq`, which the check then cannot compare.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct OpaqueReceipt {
    id: String,
    #[serde(skip_serializing, default)]
    amount: u64,
}

#[idempotent(lease = "60s", skip = [provider])]
async fn issue_opaque_receipt(order: u32, provider: &Provider) -> Result<OpaqueReceipt, Error> {
    Ok(OpaqueReceipt {
        id: format!("rc-{}", provider.deliver()),
        amount: 4200,
    })
}

#[tokio::test]
async fn a_field_the_result_never_serializes_is_refused_where_the_type_has_partial_eq() {
    let dir = tempfile::tempdir().unwrap();
    for (name, store) in stores(dir.path()).await {
        let run = Run::new(unique("skipped-field")).with_shared_store(store.clone());
        let provider = Provider::default();
        // Stored, the first caller would get 4200 and every retry 0: the first caller
        // is told instead, and nothing is stored.
        let first = run.scope(issue_receipt(1, &provider)).await.unwrap_err();
        assert!(
            matches!(first, Error::Unreplayable { .. }),
            "{name}: {first}"
        );
        assert!(first.to_string().contains("PartialEq"), "{name}: {first}");
        let key = first.key().unwrap().clone();
        assert!(
            store.get(&key).await.unwrap().is_none(),
            "{name}: nothing stored, the claim released"
        );
        // Without `PartialEq` the check cannot see it (the docs say so): the retry gets
        // the default. This is the case the docs tell users to avoid.
        let first = run.scope(issue_opaque_receipt(2, &provider)).await.unwrap();
        let retry = run.scope(issue_opaque_receipt(2, &provider)).await.unwrap();
        assert_eq!((first.amount, retry.amount), (4200, 0), "{name}");
        assert_eq!(first.id, retry.id, "{name}: replayed");
    }
}

// ----- 3. A runtime shut down under a running body --------------------------------

/// The email goes out at once; the provider's answer takes ten seconds, longer than
/// the tests wait.
#[idempotent(lease = "60s", skip = [provider, respond_after])]
async fn send_email(
    provider: Provider,
    to: String,
    respond_after: Duration,
) -> Result<String, Error> {
    let id = provider.deliver();
    tokio::time::sleep(respond_after).await;
    Ok(format!("msg-{id}"))
}

#[idempotent(lease = "60s", at_most_once, skip = [provider, respond_after])]
async fn charge_card(
    provider: Provider,
    cents: u64,
    respond_after: Duration,
) -> Result<String, Error> {
    let id = provider.deliver();
    tokio::time::sleep(respond_after).await;
    Ok(format!("charge-{id}"))
}

/// How the runtime under a running body goes away.
#[derive(Clone, Copy, Debug)]
enum Shutdown {
    /// `drop(runtime)`, a multi-threaded runtime.
    DropMultiThread,
    /// `drop(runtime)`, a current-thread runtime.
    DropCurrentThread,
    /// `runtime.shutdown_timeout(..)`.
    Timeout,
}

fn runtime(shutdown: Shutdown) -> tokio::runtime::Runtime {
    match shutdown {
        Shutdown::DropCurrentThread => tokio::runtime::Builder::new_current_thread(),
        _ => {
            let mut builder = tokio::runtime::Builder::new_multi_thread();
            builder.worker_threads(2);
            builder
        }
    }
    .enable_all()
    .build()
    .unwrap()
}

/// On each store, for each way a runtime goes and each delivery policy: a call whose
/// body is running when its runtime shuts down has its claim settled at once (the
/// process lives on), so a retry on a new runtime runs at once (at-least-once) or is
/// told `OutcomeUnknown` at once (at-most-once), instead of waiting out the lease.
#[test]
fn a_runtime_shut_down_under_a_running_body_settles_its_claim_at_once() {
    let dir = tempfile::tempdir().unwrap();
    for shutdown in [
        Shutdown::DropMultiThread,
        Shutdown::DropCurrentThread,
        Shutdown::Timeout,
    ] {
        // The stores are made on the runtime that goes away: their connections die
        // with it.
        let first = runtime(shutdown);
        let stores = first.block_on(stores(dir.path()));
        let mut firsts = Vec::new();
        for (name, store) in &stores {
            for at_most_once in [false, true] {
                let run = Run::new(unique("runtime-gone")).with_shared_store(store.clone());
                let provider = Provider::default();
                let call = {
                    let (run, provider) = (run.clone(), provider.clone());
                    async move {
                        let long = Duration::from_secs(10);
                        match at_most_once {
                            false => run.scope(send_email(provider, "ada".into(), long)).await,
                            true => run.scope(charge_card(provider, 500, long)).await,
                        }
                    }
                };
                drop(first.spawn(call));
                firsts.push((*name, at_most_once, run, provider));
            }
        }
        // Every body is running when the runtime goes (driven until then: a
        // current-thread runtime runs its tasks only inside `block_on`).
        first.block_on(async {
            let started = Instant::now();
            while firsts.iter().any(|(.., p)| p.delivered() == 0) {
                assert!(
                    started.elapsed() < PROMPT,
                    "{shutdown:?}: the bodies never ran"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        });
        match shutdown {
            Shutdown::Timeout => first.shutdown_timeout(Duration::from_millis(100)),
            _ => drop(first),
        }
        let second = runtime(Shutdown::DropCurrentThread);
        for (name, at_most_once, run, provider) in firsts {
            let started = Instant::now();
            let retry = second.block_on(async {
                match at_most_once {
                    false => {
                        run.scope(send_email(provider.clone(), "ada".into(), Duration::ZERO))
                            .await
                    }
                    true => {
                        run.scope(charge_card(provider.clone(), 500, Duration::ZERO))
                            .await
                    }
                }
            });
            let waited = started.elapsed();
            let case = format!("{name}, {shutdown:?}, at_most_once: {at_most_once}");
            assert!(waited < PROMPT, "{case}: the retry waited {waited:?}");
            match at_most_once {
                // The first body was stopped mid-way: at-least-once runs it again.
                false => {
                    assert_eq!(retry.unwrap(), "msg-2", "{case}");
                    assert_eq!(provider.delivered(), 2, "{case}");
                }
                // At-most-once never runs it again.
                true => {
                    assert!(
                        matches!(retry, Err(Error::OutcomeUnknown { .. })),
                        "{case}: {retry:?}"
                    );
                    assert_eq!(provider.delivered(), 1, "{case}");
                }
            }
        }
    }
}

// ----- 4. A running call's record removed ------------------------------------------

/// Charges, then waits for `go` before answering; sends its key to `keys` first.
#[idempotent(lease = "60s", at_most_once, skip = [provider, keys, go])]
async fn charge_and_wait(
    order: u32,
    provider: &Provider,
    keys: &tokio::sync::mpsc::UnboundedSender<Key>,
    go: &tokio::sync::Notify,
) -> Result<usize, Error> {
    let n = provider.deliver();
    keys.send(idem::current_key().unwrap()).unwrap();
    go.notified().await;
    Ok(n)
}

/// A running call whose record an operator removes (`idem evict --force`,
/// `Store::delete`) gets `LostLease`, whose message says what is true then: nothing is
/// stored, and a retry runs the body again, at-most-once or not. (`idem evict` without
/// `--force` refuses a running claim: the command's own tests.)
#[tokio::test]
async fn a_removed_running_claim_is_a_lost_lease_that_says_nothing_is_stored() {
    let dir = tempfile::tempdir().unwrap();
    for (name, store) in stores(dir.path()).await {
        let run = Run::new(unique("removed")).with_shared_store(store.clone());
        let provider = Provider::default();
        let (keys, mut key) = tokio::sync::mpsc::unbounded_channel();
        let go = tokio::sync::Notify::new();
        let first = run.scope(charge_and_wait(1, &provider, &keys, &go));
        let operator = async {
            let key = key.recv().await.unwrap();
            assert!(store.delete(&key).await.unwrap(), "{name}");
            go.notify_one();
        };
        let (first, ()) = tokio::join!(first, operator);
        let err = first.unwrap_err();
        assert!(
            matches!(
                err,
                Error::LostLease {
                    lost_to: idem::LostTo::Removal,
                    ..
                }
            ),
            "{name}: {err:?}"
        );
        let message = err.to_string();
        assert!(
            message.contains("removed") && message.contains("a retry runs the body again"),
            "{name}: {message}"
        );
        assert!(!message.contains("retry to receive"), "{name}: {message}");
        // And so it does.
        go.notify_one();
        let retry = run.scope(charge_and_wait(1, &provider, &keys, &go)).await;
        assert_eq!(retry.unwrap(), 2, "{name}");
    }
}

// ----- 5. A reconcile hook that never answers --------------------------------------

async fn never_answers(_key: &Key, _order: &u32, _p: &Provider) -> Reconciled<u64> {
    std::future::pending().await
}

#[idempotent(
    lease = "60s",
    at_most_once,
    reconcile = never_answers,
    reconcile_timeout = "500ms",
    skip = [provider]
)]
async fn charge_unreconcilable(order: u32, provider: &Provider) -> Result<u64, Error> {
    Ok(body(order, provider))
}

async fn answers_late(_key: &Key, _order: &u32, _p: &Provider) -> Reconciled<u64> {
    tokio::time::sleep(Duration::from_millis(200)).await;
    Reconciled::Happened(42)
}

#[idempotent(
    lease = "60s",
    at_most_once,
    reconcile = answers_late,
    reconcile_timeout = "30s",
    skip = [provider]
)]
async fn charge_reconciled_late(order: u32, provider: &Provider) -> Result<u64, Error> {
    Ok(body(order, provider))
}

#[tokio::test]
async fn a_reconcile_hook_past_its_timeout_counts_as_unknown() {
    let run = Run::new(unique("hook-timeout")).with_store(MemoryStore::new());
    let provider = Provider::default();
    let (captured, _logs) = Captured::warnings();
    let (p, r) = (provider.clone(), run.clone());
    abandon(async move { r.scope(charge_unreconcilable(10, &p)).await }).await;
    let started = Instant::now();
    let retry = run.scope(charge_unreconcilable(10, &provider)).await;
    let waited = started.elapsed();
    let err = retry.unwrap_err();
    assert!(matches!(err, Error::OutcomeUnknown { .. }), "{err}");
    assert!(
        waited >= Duration::from_millis(500) && waited < PROMPT,
        "answered after {waited:?}"
    );
    let logs = captured.text();
    let warning = logs
        .lines()
        .find(|l| l.contains("did not answer within its reconcile_timeout"))
        .unwrap_or_else(|| panic!("no warning:\n{logs}"));
    assert!(
        warning.contains("tool=edges::charge_unreconcilable"),
        "{warning}"
    );
    assert!(warning.contains(err.key().unwrap().as_str()), "{warning}");
    // A hook that answers within its bound settles the call.
    let (p, r) = (provider.clone(), run.clone());
    abandon(async move { r.scope(charge_reconciled_late(11, &p)).await }).await;
    let retry = run.scope(charge_reconciled_late(11, &provider)).await;
    assert_eq!(retry.unwrap(), 42);
    assert_eq!(provider.delivered(), 2, "each body ran once");
    assert_eq!(
        idem::Options::new().reconcile_timeout,
        Duration::from_secs(10),
        "the documented default"
    );
}

// ----- 7. A blank run id is no run ---------------------------------------------------

#[tokio::test]
async fn a_blank_run_id_is_no_run_and_nothing_runs() {
    let store = MemoryStore::new();
    let provider = Provider::default();
    for id in ["", "   ", "\t\n"] {
        let run = Run::new(id).with_store(store.clone());
        let err = run
            .scope(send_email(provider.clone(), "ada".into(), Duration::ZERO))
            .await
            .unwrap_err();
        match &err {
            Error::NoRun { blank_id, .. } => assert_eq!(blank_id.as_deref(), Some(id)),
            other => panic!("{id:?}: {other}"),
        }
        assert!(err.to_string().contains("blank"), "{err}");
    }
    assert_eq!(provider.delivered(), 0, "nothing ran");
    // A run id with text in it is a run.
    let run = Run::new(" run-7 ").with_store(store);
    let sent = run.scope(send_email(provider.clone(), "ada".into(), Duration::ZERO));
    assert_eq!(sent.await.unwrap(), "msg-1");
}
