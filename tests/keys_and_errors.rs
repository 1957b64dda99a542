//! Keys that never collide silently, records that always read back, and errors that say
//! whether the body ran: each test is one way a user could be given a wrong answer, and
//! checks what they observe (how often the body ran, what each caller got, what the
//! store holds) on every store where it applies.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem::store::Store;
use idem::{idempotent, Error, Key, LocalCache, MemoryStore, Run, SledStore};
use idem_testkit::faults::Faulty;
use serde::{Deserialize, Serialize};

/// Far below the 60-second leases of the tools that use it: a retry that took longer
/// waited one out.
const PROMPT: Duration = Duration::from_secs(5);

/// Counts how often a body really ran.
#[derive(Clone, Default)]
struct Ran(Arc<AtomicUsize>);

impl Ran {
    fn bump(&self) -> usize {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }
    fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

fn run(id: &str) -> Run {
    Run::new(id).with_store(MemoryStore::new())
}

fn unique(prefix: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!(
        "{prefix}_{}_{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

/// Every store a test runs on: memory, sled, `LocalCache`, and Postgres and Redis when
/// their URLs are set (said loudly when they are not).
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
                    .table(unique("idem_keys"))
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
                    .prefix(format!("{}:", unique("idem-keys")))
                    .connect()
                    .await
                    .unwrap(),
            ),
        )),
        Err(_) => eprintln!("SKIPPED the Redis store: IDEM_REDIS_URL is not set"),
    }
    #[cfg(not(all(feature = "postgres", feature = "redis")))]
    eprintln!("SKIPPED the network stores: built without the postgres and redis features");
    stores
}

// ----- Keys ------------------------------------------------------------------------

trait EmailTool {
    async fn send(&self, to: String) -> Result<String, Error>;
}

trait SmsTool {
    async fn send(&self, to: String) -> Result<String, Error>;
}

#[derive(Clone, Default)]
struct Notifier {
    emails: Ran,
    texts: Ran,
}

impl EmailTool for Notifier {
    #[idempotent]
    async fn send(&self, to: String) -> Result<String, Error> {
        Ok(format!("email {} to {to}", self.emails.bump()))
    }
}

impl SmsTool for Notifier {
    #[idempotent]
    async fn send(&self, to: String) -> Result<String, Error> {
        Ok(format!("sms {} to {to}", self.texts.bump()))
    }
}

#[tokio::test]
async fn two_traits_with_one_method_name_on_one_type_are_two_tools() {
    let (run, notifier) = (run("traits"), Notifier::default());
    let email = run
        .scope(EmailTool::send(&notifier, "+1555".into()))
        .await
        .unwrap();
    let sms = run
        .scope(SmsTool::send(&notifier, "+1555".into()))
        .await
        .unwrap();
    assert_eq!(
        (email.as_str(), sms.as_str()),
        ("email 1 to +1555", "sms 1 to +1555")
    );
    assert_eq!(
        (notifier.emails.get(), notifier.texts.get()),
        (1, 1),
        "the SMS was sent"
    );
    // Each still replays its own result.
    let again = run
        .scope(SmsTool::send(&notifier, "+1555".into()))
        .await
        .unwrap();
    assert_eq!(again, "sms 1 to +1555");
    assert_eq!(notifier.texts.get(), 1);
}

mod billing {
    use super::*;
    pub static RAN: AtomicUsize = AtomicUsize::new(0);
    #[idempotent]
    pub async fn notify(user: u64) -> Result<String, Error> {
        RAN.fetch_add(1, Ordering::SeqCst);
        Ok("billing".into())
    }
}

mod security {
    use super::*;
    pub static RAN: AtomicUsize = AtomicUsize::new(0);
    #[idempotent]
    pub async fn notify(user: u64) -> Result<String, Error> {
        RAN.fetch_add(1, Ordering::SeqCst);
        Ok("security".into())
    }
}

#[tokio::test]
async fn functions_of_one_name_in_two_modules_are_two_tools() {
    let run = run("modules");
    let billing = run.scope(billing::notify(7)).await.unwrap();
    let security = run.scope(security::notify(7)).await.unwrap();
    assert_eq!(
        (billing.as_str(), security.as_str()),
        ("billing", "security")
    );
    assert_eq!(billing::RAN.load(Ordering::SeqCst), 1);
    assert_eq!(security::RAN.load(Ordering::SeqCst), 1);
}

static GENERIC_RAN: AtomicUsize = AtomicUsize::new(0);

#[idempotent]
async fn store_number<T: Serialize + Send + 'static>(n: T) -> Result<String, Error> {
    GENERIC_RAN.fetch_add(1, Ordering::SeqCst);
    Ok(std::any::type_name::<T>().to_string())
}

#[tokio::test]
async fn a_generic_tool_called_with_two_types_is_two_tools() {
    // `1u8` and `1i64` write the same JSON: only the type parameter tells them apart.
    let run = run("generic");
    let a = run.scope(store_number(1u8)).await.unwrap();
    let b = run.scope(store_number(1i64)).await.unwrap();
    assert_eq!((a.as_str(), b.as_str()), ("u8", "i64"));
    assert_eq!(GENERIC_RAN.load(Ordering::SeqCst), 2);
}

/// A tool object carrying its own account: `scope` puts the account into the key.
#[derive(Clone)]
struct Payments {
    account: String,
    ran: Ran,
}

impl Payments {
    #[idempotent(scope = [self.account])]
    async fn pay(&self, cents: u64) -> Result<String, Error> {
        self.ran.bump();
        Ok(format!("{} paid {cents}", self.account))
    }

    /// The same without `scope`: the receiver is not part of the key.
    #[idempotent]
    async fn pay_unscoped(&self, cents: u64) -> Result<String, Error> {
        self.ran.bump();
        Ok(format!("{} paid {cents}", self.account))
    }
}

#[tokio::test]
async fn scope_keeps_two_receivers_apart_and_without_it_they_share_a_key() {
    let run = run("receivers");
    let ran = Ran::default();
    let alice = Payments {
        account: "alice".into(),
        ran: ran.clone(),
    };
    let bob = Payments {
        account: "bob".into(),
        ran: ran.clone(),
    };
    assert_eq!(run.scope(alice.pay(500)).await.unwrap(), "alice paid 500");
    assert_eq!(run.scope(bob.pay(500)).await.unwrap(), "bob paid 500");
    assert_eq!(run.scope(alice.pay(500)).await.unwrap(), "alice paid 500");
    assert_eq!(ran.get(), 2, "Bob paid, and Alice's retry replayed");

    // The documented trap `scope` exists for.
    assert_eq!(
        run.scope(alice.pay_unscoped(500)).await.unwrap(),
        "alice paid 500"
    );
    assert_eq!(
        run.scope(bob.pay_unscoped(500)).await.unwrap(),
        "alice paid 500"
    );
    assert_eq!(ran.get(), 3);
}

static SET_RAN: AtomicUsize = AtomicUsize::new(0);

#[idempotent]
async fn tag_all(tags: HashSet<String>) -> Result<usize, Error> {
    SET_RAN.fetch_add(1, Ordering::SeqCst);
    Ok(tags.len())
}

/// An input with a set inside, keyed as a set by one serde attribute.
#[derive(Serialize)]
struct Invite {
    event: String,
    #[serde(serialize_with = "idem::key::sorted")]
    guests: HashSet<String>,
}

static INVITES: AtomicUsize = AtomicUsize::new(0);

#[idempotent]
async fn invite(invite: Invite) -> Result<usize, Error> {
    INVITES.fetch_add(1, Ordering::SeqCst);
    Ok(invite.guests.len())
}

/// The same 40 elements in two sets whose hashers are seeded differently (as in two
/// processes): they iterate in different orders.
fn same_set_twice() -> (HashSet<String>, HashSet<String>) {
    let elements: Vec<String> = (0..40).map(|i| format!("tag-{i}")).collect();
    let a: HashSet<String> = elements.iter().cloned().collect();
    let b: HashSet<String> = elements.iter().rev().cloned().collect();
    assert_eq!(a, b);
    assert_ne!(
        a.iter().collect::<Vec<_>>(),
        b.iter().collect::<Vec<_>>(),
        "the two sets must iterate differently for this test to mean anything"
    );
    (a, b)
}

#[tokio::test]
async fn a_hash_set_gets_one_key_whatever_its_iteration_order() {
    let run = run("sets");
    let (a, b) = same_set_twice();
    assert_eq!(run.scope(tag_all(a)).await.unwrap(), 40);
    assert_eq!(run.scope(tag_all(b)).await.unwrap(), 40);
    assert_eq!(
        SET_RAN.load(Ordering::SeqCst),
        1,
        "the argument is keyed as a set"
    );

    let (a, b) = same_set_twice();
    let event = || "launch".to_string();
    run.scope(invite(Invite {
        event: event(),
        guests: a,
    }))
    .await
    .unwrap();
    run.scope(invite(Invite {
        event: event(),
        guests: b,
    }))
    .await
    .unwrap();
    assert_eq!(
        INVITES.load(Ordering::SeqCst),
        1,
        "the field is keyed as a set"
    );
}

/// Hashable, but with no order of its own.
#[derive(Serialize, Hash, PartialEq, Eq)]
struct Guest {
    name: String,
    plus_one: bool,
}

static GUESTS_RAN: AtomicUsize = AtomicUsize::new(0);

#[idempotent]
async fn seat(guests: HashSet<Guest>) -> Result<usize, Error> {
    GUESTS_RAN.fetch_add(1, Ordering::SeqCst);
    Ok(guests.len())
}

#[tokio::test]
async fn a_set_of_elements_without_an_order_is_keyed_as_a_set_too() {
    let run = run("guests");
    let guest = |i: usize| Guest {
        name: format!("guest-{i}"),
        plus_one: i % 2 == 0,
    };
    let a: HashSet<Guest> = (0..40).map(guest).collect();
    let b: HashSet<Guest> = (0..40).rev().map(guest).collect();
    let order = |s: &HashSet<Guest>| s.iter().map(|g| g.name.clone()).collect::<Vec<_>>();
    assert_ne!(order(&a), order(&b), "the sets must iterate differently");
    assert_eq!(run.scope(seat(a)).await.unwrap(), 40);
    assert_eq!(run.scope(seat(b)).await.unwrap(), 40);
    assert_eq!(GUESTS_RAN.load(Ordering::SeqCst), 1);
}

static WIDE_RAN: AtomicUsize = AtomicUsize::new(0);

#[idempotent]
async fn ledger(big: u128, small: i128) -> Result<String, Error> {
    WIDE_RAN.fetch_add(1, Ordering::SeqCst);
    Ok(format!("{big}/{small}"))
}

#[tokio::test]
async fn integers_wider_than_64_bits_are_inputs() {
    let run = run("wide");
    let cases = [
        (u128::MAX, i128::MIN),
        (u128::from(u64::MAX) + 1, i128::from(i64::MIN) - 1),
        (5, -5),
    ];
    for (big, small) in cases {
        let first = run.scope(ledger(big, small)).await.unwrap();
        assert_eq!(first, format!("{big}/{small}"));
        assert_eq!(run.scope(ledger(big, small)).await.unwrap(), first);
    }
    assert_eq!(WIDE_RAN.load(Ordering::SeqCst), 3, "each ran once");
}

mod workflow {
    /// The user's own type named `Run`: an input like any other.
    #[derive(serde::Serialize, Clone)]
    pub struct Run {
        pub step: u32,
    }
}

static STEPS: AtomicUsize = AtomicUsize::new(0);

#[idempotent]
async fn advance(run: workflow::Run) -> Result<u32, Error> {
    STEPS.fetch_add(1, Ordering::SeqCst);
    Ok(run.step + 1)
}

#[tokio::test]
async fn an_argument_of_the_users_own_run_type_is_an_input() {
    let idem_run = run("workflow");
    let one = idem_run
        .scope(advance(workflow::Run { step: 1 }))
        .await
        .unwrap();
    let two = idem_run
        .scope(advance(workflow::Run { step: 2 }))
        .await
        .unwrap();
    assert_eq!((one, two), (2, 3));
    assert_eq!(STEPS.load(Ordering::SeqCst), 2, "two inputs, two runs");
}

#[idempotent(ttl = "36500d", skip = [ran])]
async fn keep_for_a_century(n: u32, ran: &Ran) -> Result<u32, Error> {
    ran.bump();
    Ok(n)
}

#[tokio::test]
async fn the_largest_ttl_works_on_every_store() {
    let dir = tempfile::tempdir().unwrap();
    for (name, store) in stores(dir.path()).await {
        let run = Run::new(unique("century")).with_shared_store(store.clone());
        let ran = Ran::default();
        let first = run.scope(keep_for_a_century(1, &ran)).await;
        assert_eq!(first.unwrap(), 1, "{name}");
        assert_eq!(run.scope(keep_for_a_century(1, &ran)).await.unwrap(), 1);
        assert_eq!(ran.get(), 1, "{name}: replayed");

        // Longer than the attribute takes (`Duration::MAX`, through the dynamic API):
        // cut to the same 100 years.
        let forever = idem::Tool::new("forever").ttl(Duration::MAX);
        let got: Result<u32, Error> = forever.call(&run, &1, |_| async { Ok(9) }).await;
        assert_eq!(got.unwrap(), 9, "{name}");
    }
}

// ----- Records -----------------------------------------------------------------------

/// Fields that serialize into JSON their own type cannot read back.
#[derive(Serialize, Deserialize, Debug)]
struct Report {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    lines: Vec<String>,
}

#[derive(Serialize, Deserialize, Debug)]
struct Wide {
    #[serde(flatten)]
    inner: WideInner,
}

#[derive(Serialize, Deserialize, Debug)]
struct WideInner {
    total: u128,
}

#[idempotent(lease = "300ms", skip = [ran])]
async fn average(case: u8, ran: &Ran) -> Result<f64, Error> {
    ran.bump();
    Ok(match case {
        0 => f64::NAN,
        _ => f64::INFINITY,
    })
}

#[idempotent(lease = "300ms", skip = [ran])]
async fn samples(ran: &Ran) -> Result<Vec<f64>, Error> {
    ran.bump();
    Ok(vec![1.5, f64::INFINITY])
}

#[idempotent(lease = "300ms", skip = [ran])]
async fn report(ran: &Ran) -> Result<Report, Error> {
    ran.bump();
    Ok(Report { lines: Vec::new() })
}

#[idempotent(lease = "300ms", skip = [ran])]
async fn wide(ran: &Ran) -> Result<Wide, Error> {
    ran.bump();
    Ok(Wide {
        inner: WideInner {
            total: u128::from(u64::MAX) + 1,
        },
    })
}

#[idempotent(lease = "300ms", at_most_once, skip = [ran])]
async fn average_at_most_once(ran: &Ran) -> Result<f64, Error> {
    ran.bump();
    Ok(f64::NAN)
}

/// Two variants whose JSON overlaps: `I(1)` is written `1`, which reads back as `F(1.0)`.
#[derive(Serialize, Deserialize, Debug, PartialEq)]
#[serde(untagged)]
enum Amount {
    F(f64),
    I(u64),
}

#[idempotent(lease = "300ms", skip = [ran])]
async fn amount(ran: &Ran) -> Result<Amount, Error> {
    ran.bump();
    Ok(Amount::I(1))
}

/// Maps and sets serialize in hash order: their JSON changes from one serialization to
/// the next, and they still read back as the same value.
#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Index {
    by_name: std::collections::HashMap<String, u32>,
    tags: HashSet<String>,
}

#[idempotent(skip = [ran])]
async fn index(ran: &Ran) -> Result<Index, Error> {
    ran.bump();
    Ok(Index {
        by_name: (0..50).map(|i| (format!("name-{i}"), i)).collect(),
        tags: (0..50).map(|i| format!("tag-{i}")).collect(),
    })
}

#[idempotent(skip = [ran])]
async fn rows(n: u32, ran: &Ran) -> Result<Vec<std::collections::HashMap<String, u32>>, Error> {
    ran.bump();
    Ok((0..n)
        .map(|i| (0..6).map(|j| (format!("k{j}"), i * 10 + j)).collect())
        .collect())
}

#[idempotent(skip = [ran])]
async fn probabilities(n: u32, ran: &Ran) -> Result<Vec<f64>, Error> {
    ran.bump();
    Ok((0..n).map(|i| (-f64::from(i) / 1000.0).exp()).collect())
}

#[tokio::test]
async fn maps_in_a_sequence_and_floats_of_every_kind_are_stored_and_replayed_to_the_bit() {
    // This workspace builds serde_json with `preserve_order` (rig turns it on), so a
    // map's JSON follows its hash order: the sequence of maps must still compare equal.
    let run = run("rows");
    let ran = Ran::default();
    let first = run.scope(rows(12, &ran)).await.unwrap();
    assert_eq!(run.scope(rows(12, &ran)).await.unwrap(), first);
    assert_eq!(ran.get(), 1);

    // Floats a parser that is not exact reads back one unit off.
    let ran = Ran::default();
    let first = run.scope(probabilities(20_000, &ran)).await.unwrap();
    let replayed = run.scope(probabilities(20_000, &ran)).await.unwrap();
    assert!(first
        .iter()
        .zip(&replayed)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
    assert_eq!(ran.get(), 1);
}

/// The threads of this process (Linux).
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count())
}

#[test]
fn failing_calls_from_sync_tools_do_not_start_a_thread_each() {
    let store = Arc::new(Faulty::new(Arc::new(MemoryStore::new())));
    store.fail_completions(usize::MAX);
    store.fail_claims(usize::MAX);
    let run = Run::new("many-failures").with_shared_store(store);
    let ran = Ran::default();
    let _ = run.sync_scope(|| send_receipt_sync("warm-up".into(), &ran));
    let before = threads();
    for i in 0..300 {
        let err = run
            .sync_scope(|| send_receipt_sync(format!("to-{i}"), &ran))
            .unwrap_err();
        assert!(matches!(err, Error::Store { .. }), "{err}");
    }
    let after = threads();
    assert!(
        after < before + 8,
        "{before} threads before, {after} after 300 failed claims"
    );
    assert_eq!(ran.get(), 0);
}

#[tokio::test]
async fn a_result_that_reads_back_as_another_value_is_refused_and_sets_and_maps_are_not() {
    let run = run("misread");
    let ran = Ran::default();
    let err = run.scope(amount(&ran)).await.unwrap_err();
    assert_unreplayable(&err, "amount");
    assert!(err.to_string().contains("another value"), "{err}");

    let first = run.scope(index(&ran)).await.unwrap();
    let again = run.scope(index(&ran)).await.unwrap();
    assert_eq!(first, again);
    assert_eq!(ran.get(), 2, "the index ran once and was replayed");
}

/// The first call is told, naming the tool and why; nothing was stored.
fn assert_unreplayable(err: &Error, tool: &str) {
    match err {
        Error::Unreplayable { tool: t, .. } => assert!(t.ends_with(tool), "{t}"),
        other => panic!("expected Unreplayable for {tool}, got {other}"),
    }
    let text = err.to_string();
    assert!(
        text.contains(tool) && text.contains("read") && text.contains("body has run"),
        "{text}"
    );
}

#[tokio::test]
async fn a_result_that_cannot_be_read_back_is_refused_at_the_first_call_and_never_stored() {
    let dir = tempfile::tempdir().unwrap();
    for (name, store) in stores(dir.path()).await {
        let run = Run::new(unique("unreadable")).with_shared_store(store.clone());
        let ran = Ran::default();
        for case in [0, 1] {
            let err = run.scope(average(case, &ran)).await.unwrap_err();
            assert_unreplayable(&err, "average");
            // At-least-once: nothing stored, the key released: the retry runs again
            // (and is told again), never `StoredResult`.
            let key = err.key().unwrap().clone();
            assert!(store.get(&key).await.unwrap().is_none(), "{name}");
            let again = run.scope(average(case, &ran)).await.unwrap_err();
            assert_unreplayable(&again, "average");
        }
        assert_eq!(ran.get(), 4, "{name}");
        assert_unreplayable(&run.scope(samples(&ran)).await.unwrap_err(), "samples");
        assert_unreplayable(&run.scope(report(&ran)).await.unwrap_err(), "report");
        assert_unreplayable(&run.scope(wide(&ran)).await.unwrap_err(), "wide");

        // At-most-once: the outcome is recorded as unknown, and the retry says so at
        // once; the body ran once.
        let ran = Ran::default();
        let err = run.scope(average_at_most_once(&ran)).await.unwrap_err();
        assert_unreplayable(&err, "average_at_most_once");
        let retry = run.scope(average_at_most_once(&ran)).await.unwrap_err();
        assert!(
            matches!(retry, Error::OutcomeUnknown { .. }),
            "{name}: {retry}"
        );
        assert_eq!(ran.get(), 1, "{name}");
    }
}

// ----- A store that fails after the body ran -------------------------------------

#[idempotent(lease = "300ms", skip = [ran])]
async fn send_receipt(to: String, ran: &Ran) -> Result<String, Error> {
    Ok(format!("receipt-{}", ran.bump()))
}

#[idempotent(lease = "300ms", at_most_once, skip = [ran])]
async fn charge(cents: u64, ran: &Ran) -> Result<String, Error> {
    Ok(format!("charge-{}", ran.bump()))
}

#[tokio::test]
async fn a_store_failing_after_the_body_ran_gives_the_bodys_value_and_records_it_later() {
    let dir = tempfile::tempdir().unwrap();
    for (name, inner) in stores(dir.path()).await {
        // Fails once, then takes the outcome: the background records it, and a retry
        // replays it.
        let store = Arc::new(Faulty::new(inner.clone()));
        store.fail_completions(1);
        let run = Run::new(unique("late")).with_shared_store(store.clone());
        let ran = Ran::default();
        let first = run.scope(send_receipt("ada".into(), &ran)).await;
        assert_eq!(first.unwrap(), "receipt-1", "{name}: the body's own value");
        // The retry finds the claim still held, waits, and is answered by the late
        // record.
        let started = Instant::now();
        let retry = run.scope(send_receipt("ada".into(), &ran)).await;
        assert_eq!(retry.unwrap(), "receipt-1", "{name}: replayed");
        assert!(started.elapsed() < Duration::from_secs(10), "{name}");
        assert_eq!(ran.get(), 1, "{name}: the body ran once");
    }
}

#[tokio::test]
async fn an_outcome_the_store_takes_only_after_the_lease_still_answers_the_retry() {
    let dir = tempfile::tempdir().unwrap();
    for (name, inner) in stores(dir.path()).await {
        // The store refuses the outcome for about half a second, longer than the
        // 300 ms lease: the claim is renewed meanwhile, so a retry past the lease waits
        // for the outcome instead of taking the claim over and running again.
        let store = Arc::new(Faulty::new(inner.clone()));
        store.fail_completions(2);
        let run = Run::new(unique("outage")).with_shared_store(store.clone());
        let ran = Ran::default();
        let first = run.scope(send_receipt("ada".into(), &ran)).await;
        assert_eq!(first.unwrap(), "receipt-1", "{name}");
        tokio::time::sleep(Duration::from_millis(350)).await;
        let retry = run.scope(send_receipt("ada".into(), &ran)).await;
        assert_eq!(retry.unwrap(), "receipt-1", "{name}: replayed");
        assert_eq!(ran.get(), 1, "{name}: the body ran once");
    }
}

#[tokio::test]
async fn a_store_that_panics_while_recording_is_a_store_that_failed() {
    let store = Arc::new(Faulty::new(Arc::new(MemoryStore::new())));
    store.panic_in_completions(1);
    let run = Run::new(unique("panics")).with_shared_store(store.clone());
    let ran = Ran::default();
    // The caller gets the body's value, not a panic; the outcome is recorded later.
    let first = run.scope(send_receipt("ada".into(), &ran)).await;
    assert_eq!(first.unwrap(), "receipt-1");
    let retry = run.scope(send_receipt("ada".into(), &ran)).await;
    assert_eq!(retry.unwrap(), "receipt-1", "replayed");
    assert_eq!(ran.get(), 1, "the body ran once");
}

#[tokio::test]
async fn a_store_that_never_takes_the_outcome_leaves_the_retry_to_the_delivery_policy() {
    let dir = tempfile::tempdir().unwrap();
    for (name, inner) in stores(dir.path()).await {
        let store = Arc::new(Faulty::new(inner));
        store.fail_completions(usize::MAX);
        let run = Run::new(unique("never")).with_shared_store(store.clone());

        // At-least-once: the caller has its value; a retry after the lease runs again.
        let ran = Ran::default();
        let first = run.scope(send_receipt("ada".into(), &ran)).await;
        assert_eq!(first.unwrap(), "receipt-1", "{name}");
        let retry = run.scope(send_receipt("ada".into(), &ran)).await;
        assert_eq!(retry.unwrap(), "receipt-2", "{name}");

        // At-most-once: the caller has its value; a retry gets `OutcomeUnknown`, never
        // a second charge.
        let ran = Ran::default();
        let first = run.scope(charge(500, &ran)).await;
        assert_eq!(first.unwrap(), "charge-1", "{name}");
        let retry = run.scope(charge(500, &ran)).await.unwrap_err();
        assert!(
            matches!(retry, Error::OutcomeUnknown { .. }),
            "{name}: {retry}"
        );
        assert_eq!(ran.get(), 1, "{name}");
    }
}

#[idempotent(lease = "300ms", skip = [ran])]
fn send_receipt_sync(to: String, ran: &Ran) -> Result<String, Error> {
    Ok(format!("receipt-{}", ran.bump()))
}

#[test]
fn a_sync_tool_whose_store_fails_after_the_body_gets_its_value_and_the_retry_replays_it() {
    // No runtime at all: the late record runs on a thread of its own.
    sync_late_record_is_replayed("no runtime");
    // On a current-thread runtime's own thread, which the sync retry blocks: the late
    // record must not wait for that runtime.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async { sync_late_record_is_replayed("current-thread runtime") });
}

fn sync_late_record_is_replayed(context: &str) {
    let store = Arc::new(Faulty::new(Arc::new(MemoryStore::new())));
    store.fail_completions(1);
    let run = Run::new(unique("sync-late")).with_shared_store(store);
    let ran = Ran::default();
    let first = run.sync_scope(|| send_receipt_sync("ada".into(), &ran));
    assert_eq!(
        first.unwrap(),
        "receipt-1",
        "{context}: the body's own value"
    );
    let started = Instant::now();
    let retry = run.sync_scope(|| send_receipt_sync("ada".into(), &ran));
    assert_eq!(retry.unwrap(), "receipt-1", "{context}: replayed");
    assert!(started.elapsed() < Duration::from_secs(5), "{context}");
    assert_eq!(ran.get(), 1, "{context}: the body ran once");
}

#[test]
fn a_claim_the_store_fails_outside_a_runtime_is_an_error_at_once() {
    // The claim's late release (in case it landed after all) never holds the caller.
    let store = Arc::new(Faulty::new(Arc::new(MemoryStore::new())));
    store.fail_claims(1);
    let run = Run::new("claim-fails").with_shared_store(store);
    let ran = Ran::default();
    let started = Instant::now();
    let err = run
        .sync_scope(|| send_receipt_sync("ada".into(), &ran))
        .unwrap_err();
    assert!(matches!(err, Error::Store { .. }), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "took {:?}",
        started.elapsed()
    );
    assert_eq!(ran.get(), 0, "not run");
    // And the store works again for the retry.
    assert_eq!(
        run.sync_scope(|| send_receipt_sync("ada".into(), &ran))
            .unwrap(),
        "receipt-1"
    );
}

#[idempotent(lease = "300ms")]
async fn long_report(id: u32) -> Result<u32, Error> {
    tokio::time::sleep(Duration::from_millis(1600)).await;
    Ok(id)
}

/// A store that fails renewals: each failed renewal is tried again once, soon, and the
/// claim's schedule goes on from there. It must not add a second round of renewals per
/// failure (they would multiply while the store is down).
#[tokio::test]
async fn renewals_a_store_fails_are_retried_at_a_steady_pace() {
    for failures in [0, 3, usize::MAX] {
        let store = Arc::new(Faulty::new(Arc::new(MemoryStore::new())));
        store.fail_renewals(failures);
        let run = Run::new("renewals").with_shared_store(store.clone());
        let started = Instant::now();
        assert_eq!(run.scope(long_report(7)).await.unwrap(), 7);
        let took = started.elapsed();
        // One renewal a third of a lease (100 ms), a retry half of that after a failure:
        // at most one every 50 ms, whatever fails.
        let most = (took.as_millis() / 50 + 2) as usize;
        let renewals = store.renewals();
        assert!(
            (10..=most).contains(&renewals),
            "{failures} failures: {renewals} renewals in {took:?} (at most {most})"
        );
    }
}

// ----- A field the JSON never holds ----------------------------------------------

/// A receipt whose amount is never serialized: a retry would read it back as 0.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Receipt {
    id: String,
    #[serde(skip_serializing, default)]
    amount: u64,
}

#[idempotent(lease = "60s", skip = [ran])]
async fn issue_receipt(order: u32, ran: &Ran) -> Result<Receipt, Error> {
    Ok(Receipt {
        id: format!("rc-{}", ran.bump()),
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

#[idempotent(lease = "60s", skip = [ran])]
async fn issue_opaque_receipt(order: u32, ran: &Ran) -> Result<OpaqueReceipt, Error> {
    Ok(OpaqueReceipt {
        id: format!("rc-{}", ran.bump()),
        amount: 4200,
    })
}

#[tokio::test]
async fn a_field_the_result_never_serializes_is_refused_where_the_type_has_partial_eq() {
    let dir = tempfile::tempdir().unwrap();
    for (name, store) in stores(dir.path()).await {
        let run = Run::new(unique("skipped-field")).with_shared_store(store.clone());
        let ran = Ran::default();
        // Stored, the first caller would get 4200 and every retry 0: the first caller
        // is told instead, and nothing is stored.
        let first = run.scope(issue_receipt(1, &ran)).await.unwrap_err();
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
        let first = run.scope(issue_opaque_receipt(2, &ran)).await.unwrap();
        let retry = run.scope(issue_opaque_receipt(2, &ran)).await.unwrap();
        assert_eq!((first.amount, retry.amount), (4200, 0), "{name}");
        assert_eq!(first.id, retry.id, "{name}: replayed");
    }
}

// ----- A runtime shut down under a running body ----------------------------------

/// The email goes out at once; its answer takes `respond_after` (not part of the key).
#[idempotent(lease = "60s", skip = [ran, respond_after])]
async fn send_email(ran: Ran, to: String, respond_after: Duration) -> Result<String, Error> {
    let id = ran.bump();
    tokio::time::sleep(respond_after).await;
    Ok(format!("msg-{id}"))
}

#[idempotent(lease = "60s", at_most_once, skip = [ran, respond_after])]
async fn charge_card(ran: Ran, cents: u64, respond_after: Duration) -> Result<String, Error> {
    let id = ran.bump();
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
/// body is running when its runtime shuts down (the call itself, or its body finishing
/// alone after the agent's timeout dropped the call) has its claim settled at once (the
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
            for (at_most_once, timed_out) in
                [(false, false), (true, false), (false, true), (true, true)]
            {
                let run = Run::new(unique("runtime-gone")).with_shared_store(store.clone());
                let ran = Ran::default();
                let call = {
                    let (run, ran) = (run.clone(), ran.clone());
                    async move {
                        let long = Duration::from_secs(10);
                        match at_most_once {
                            false => run.scope(send_email(ran, "ada".into(), long)).await,
                            true => run.scope(charge_card(ran, 500, long)).await,
                        }
                    }
                };
                // The agent stops waiting as soon as the body has started.
                let body_started = {
                    let ran = ran.clone();
                    async move {
                        while ran.get() == 0 {
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                    }
                };
                drop(first.spawn(async move {
                    match timed_out {
                        true => tokio::select! {
                            _ = call => {}
                            () = body_started => {}
                        },
                        false => drop(call.await),
                    }
                }));
                firsts.push((*name, at_most_once, timed_out, run, ran));
            }
        }
        // Every body is running when the runtime goes, alone where its caller stopped
        // waiting (driven until then: a current-thread runtime runs its tasks only
        // inside `block_on`).
        first.block_on(async {
            let started = Instant::now();
            while firsts.iter().any(|(.., p)| p.get() == 0) {
                let idle: Vec<_> = firsts
                    .iter()
                    .filter(|(.., p)| p.get() == 0)
                    .map(|(name, at_most_once, timed_out, ..)| (name, at_most_once, timed_out))
                    .collect();
                assert!(
                    started.elapsed() < PROMPT,
                    "{shutdown:?}: these bodies never ran: {idle:?}"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        });
        match shutdown {
            Shutdown::Timeout => first.shutdown_timeout(Duration::from_millis(100)),
            _ => drop(first),
        }
        let second = runtime(Shutdown::DropCurrentThread);
        for (name, at_most_once, timed_out, run, ran) in firsts {
            let started = Instant::now();
            let retry = second.block_on(async {
                match at_most_once {
                    false => {
                        run.scope(send_email(ran.clone(), "ada".into(), Duration::ZERO))
                            .await
                    }
                    true => {
                        run.scope(charge_card(ran.clone(), 500, Duration::ZERO))
                            .await
                    }
                }
            });
            let waited = started.elapsed();
            let case = format!(
                "{name}, {shutdown:?}, at_most_once: {at_most_once}, timed out: {timed_out}"
            );
            assert!(waited < PROMPT, "{case}: the retry waited {waited:?}");
            match at_most_once {
                // The first body was stopped mid-way: at-least-once runs it again.
                false => {
                    assert_eq!(retry.unwrap(), "msg-2", "{case}");
                    assert_eq!(ran.get(), 2, "{case}");
                }
                // At-most-once never runs it again.
                true => {
                    assert!(
                        matches!(retry, Err(Error::OutcomeUnknown { .. })),
                        "{case}: {retry:?}"
                    );
                    assert_eq!(ran.get(), 1, "{case}");
                }
            }
        }
    }
}

// ----- A running call's record removed --------------------------------------------

/// Charges, then waits for `go` before answering; sends its key to `keys` first.
#[idempotent(lease = "60s", at_most_once, skip = [ran, keys, go])]
async fn charge_and_wait(
    order: u32,
    ran: &Ran,
    keys: &tokio::sync::mpsc::UnboundedSender<Key>,
    go: &tokio::sync::Notify,
) -> Result<usize, Error> {
    let n = ran.bump();
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
        let ran = Ran::default();
        let (keys, mut key) = tokio::sync::mpsc::unbounded_channel();
        let go = tokio::sync::Notify::new();
        let first = run.scope(charge_and_wait(1, &ran, &keys, &go));
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
        let retry = run.scope(charge_and_wait(1, &ran, &keys, &go)).await;
        assert_eq!(retry.unwrap(), 2, "{name}");
    }
}

// ----- A blank run id ---------------------------------------------------------------

#[tokio::test]
async fn a_blank_run_id_is_no_run_and_nothing_runs() {
    let store = MemoryStore::new();
    let ran = Ran::default();
    for id in [
        "",
        "   ",
        "\t\n",
        "\u{200b}",
        "\u{feff}",
        "\0",
        " \u{3000}\u{2060} ",
        "\u{e0020}\u{e0100}",
        "\u{2800}",
    ] {
        let run = Run::new(id).with_store(store.clone());
        let err = run
            .scope(send_email(ran.clone(), "ada".into(), Duration::ZERO))
            .await
            .unwrap_err();
        match &err {
            Error::NoRun { blank_id, .. } => assert_eq!(blank_id.as_deref(), Some(id)),
            other => panic!("{id:?}: {other}"),
        }
        assert!(err.to_string().contains("blank"), "{err}");
    }
    assert_eq!(ran.get(), 0, "nothing ran");
    // A run id with anything visible in it is a run: text, an emoji with its variation
    // selector, a combining mark, a Hangul syllable of jamo.
    let run = Run::new(" run-7 ").with_store(store.clone());
    let sent = run.scope(send_email(ran.clone(), "ada".into(), Duration::ZERO));
    assert_eq!(sent.await.unwrap(), "msg-1");
    for id in ["\u{2764}\u{fe0f}", "\u{0301}", "\u{1100}\u{1161}"] {
        let run = Run::new(id).with_store(store.clone());
        let sent = run.scope(send_email(ran.clone(), "ada".into(), Duration::ZERO));
        assert!(sent.await.is_ok(), "{id:?} is a run");
    }
}
