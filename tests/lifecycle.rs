//! A call's life, as an agent that misbehaves sees it: its own timeout drops the call
//! after the side effect, `select!` loses it, its task is aborted, the body panics,
//! hangs, or runs longer than its lease or its TTL. Each test counts how often the
//! side effect really ran, what each caller got, and how long the retry took (a bound
//! with a wide margin against a 60-second lease, never a tight timing).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem::store::State;
use idem::{idempotent, Error, Key, MemoryStore, Reconciled, Run, Store};
use serde::{Deserialize, Serialize};

/// Far below the 60-second leases of these tools: a retry that took longer waited one
/// out.
const PROMPT: Duration = Duration::from_secs(5);

/// The provider's side: every delivery really happens, and is counted.
#[derive(Clone, Default)]
struct Provider(Arc<AtomicUsize>);

impl Provider {
    fn deliver(&self) -> String {
        let n = self.0.fetch_add(1, Ordering::SeqCst) + 1;
        format!("msg-{n}")
    }
    fn delivered(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

fn run() -> Run {
    Run::new("agent-run").with_store(MemoryStore::new())
}

/// The email goes out at once; the provider's answer takes `respond_after`.
#[idempotent(lease = "60s", skip = [provider])]
async fn send_email(
    provider: Provider,
    to: String,
    respond_after: Duration,
) -> Result<String, Error> {
    let id = provider.deliver();
    tokio::time::sleep(respond_after).await;
    Ok(id)
}

#[tokio::test]
async fn a_call_dropped_by_the_agents_timeout_finishes_and_the_retry_gets_its_result() {
    let (run, provider) = (run(), Provider::default());
    let call = || {
        send_email(
            provider.clone(),
            "ada@example.com".into(),
            Duration::from_secs(1),
        )
    };

    let first = tokio::time::timeout(Duration::from_millis(200), run.scope(call())).await;
    assert!(first.is_err(), "the agent's timeout fired: {first:?}");
    assert_eq!(
        provider.delivered(),
        1,
        "the email went out before the timeout"
    );

    let started = Instant::now();
    let retry = tokio::time::timeout(Duration::from_secs(30), run.scope(call())).await;
    let waited = started.elapsed();
    assert_eq!(
        retry.unwrap().unwrap(),
        "msg-1",
        "the retry gets the first message id"
    );
    assert!(waited < PROMPT, "the retry waited {waited:?}");
    assert_eq!(provider.delivered(), 1, "one email delivered");
}

#[tokio::test]
async fn retries_with_short_timeouts_of_their_own_get_the_first_result() {
    // The agent's every attempt gives up after 300 ms; the provider answers after 1 s.
    let (run, provider) = (run(), Provider::default());
    let started = Instant::now();
    let mut attempts = 0;
    let id = loop {
        attempts += 1;
        let call = send_email(
            provider.clone(),
            "ada@example.com".into(),
            Duration::from_secs(1),
        );
        match tokio::time::timeout(Duration::from_millis(300), run.scope(call)).await {
            Ok(answer) => break answer.unwrap(),
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
        assert!(started.elapsed() < PROMPT, "{attempts} attempts, no answer");
    };
    assert_eq!(id, "msg-1");
    assert!(attempts > 1, "the first attempt was meant to time out");
    assert_eq!(provider.delivered(), 1);
}

#[tokio::test]
async fn an_aborted_task_and_a_lost_select_branch_finish_in_the_background() {
    let (run, provider) = (run(), Provider::default());
    let call = |to: &str| send_email(provider.clone(), to.into(), Duration::from_millis(500));

    let task = tokio::spawn(run.scope(call("ada@example.com")));
    tokio::time::sleep(Duration::from_millis(100)).await;
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());

    tokio::select! {
        _ = run.scope(call("grace@example.com")) => panic!("the select was meant to lose the call"),
        _ = tokio::time::sleep(Duration::from_millis(100)) => {}
    }
    assert_eq!(provider.delivered(), 2);

    let started = Instant::now();
    let ada = run.scope(call("ada@example.com")).await.unwrap();
    let grace = run.scope(call("grace@example.com")).await.unwrap();
    assert!(
        started.elapsed() < PROMPT,
        "the retries waited {:?}",
        started.elapsed()
    );
    assert_eq!(provider.delivered(), 2, "no email went out twice");
    assert_ne!(ada, grace);
}

/// A body that borrows from its caller (`&Provider`) cannot outlive it.
#[idempotent(lease = "60s", skip = [provider])]
async fn send_borrowing(provider: &Provider, to: String) -> Result<String, Error> {
    let id = provider.deliver();
    tokio::time::sleep(Duration::from_secs(1)).await;
    Ok(id)
}

#[idempotent(lease = "60s", at_most_once, skip = [provider])]
async fn charge_borrowing(provider: &Provider, cents: u64) -> Result<String, Error> {
    let id = provider.deliver();
    tokio::time::sleep(Duration::from_secs(1)).await;
    Ok(format!("{id}: {cents}"))
}

#[tokio::test]
async fn a_borrowing_body_dropped_settles_at_once_by_its_delivery_policy() {
    let (run, provider) = (run(), Provider::default());

    // At-least-once: the claim is released, so the retry runs at once (the body was
    // dropped after its side effect, so it has now run twice: the documented cost).
    let dropped = tokio::time::timeout(
        Duration::from_millis(100),
        run.scope(send_borrowing(&provider, "ada@example.com".into())),
    )
    .await;
    assert!(dropped.is_err());
    let started = Instant::now();
    let retry = run
        .scope(send_borrowing(&provider, "ada@example.com".into()))
        .await;
    assert!(
        started.elapsed() < PROMPT,
        "the retry waited {:?}",
        started.elapsed()
    );
    assert_eq!(retry.unwrap(), "msg-2");
    assert_eq!(provider.delivered(), 2);

    // At-most-once: recorded as outcome-unknown, so the retry is told so at once.
    let dropped = tokio::time::timeout(
        Duration::from_millis(100),
        run.scope(charge_borrowing(&provider, 500)),
    )
    .await;
    assert!(dropped.is_err());
    let started = Instant::now();
    let retry = run.scope(charge_borrowing(&provider, 500)).await;
    assert!(
        started.elapsed() < PROMPT,
        "the retry waited {:?}",
        started.elapsed()
    );
    assert!(
        matches!(retry, Err(Error::OutcomeUnknown { .. })),
        "{retry:?}"
    );
    assert_eq!(provider.delivered(), 3, "the charge was not run again");
}

/// A tool object whose methods borrow `self`: `on_cancel = "finish"` runs the body on a
/// clone of it (a handle: the clone shares the outbox).
#[derive(Clone, Default)]
struct Mailer {
    provider: Provider,
    log: Arc<Mutex<Vec<String>>>,
}

impl Mailer {
    #[idempotent(lease = "60s", on_cancel = "finish")]
    async fn send(&self, to: &str, subject: &str) -> Result<String, Error> {
        let id = self.provider.deliver();
        tokio::time::sleep(Duration::from_millis(500)).await;
        self.log
            .lock()
            .unwrap()
            .push(format!("{id} to {to}: {subject}"));
        Ok(id)
    }

    #[idempotent(lease = "60s")]
    async fn send_by_default(&self, to: String) -> Result<String, Error> {
        let id = self.provider.deliver();
        tokio::time::sleep(Duration::from_millis(500)).await;
        Ok(format!("{id} to {to}"))
    }
}

#[tokio::test]
async fn on_cancel_finish_runs_a_method_to_its_end_on_a_clone_of_self() {
    let (run, mailer) = (run(), Mailer::default());
    let dropped = tokio::time::timeout(
        Duration::from_millis(100),
        run.scope(mailer.send("ada", "Hi")),
    )
    .await;
    assert!(dropped.is_err());
    let retry = run.scope(mailer.send("ada", "Hi")).await.unwrap();
    assert_eq!(retry, "msg-1");
    assert_eq!(mailer.provider.delivered(), 1);
    assert_eq!(
        *mailer.log.lock().unwrap(),
        ["msg-1 to ada: Hi"],
        "the body finished"
    );

    // Without the option, a method that uses `self` is settled: released, run again.
    let dropped = tokio::time::timeout(
        Duration::from_millis(100),
        run.scope(mailer.send_by_default("grace".into())),
    )
    .await;
    assert!(dropped.is_err());
    let retry = run
        .scope(mailer.send_by_default("grace".into()))
        .await
        .unwrap();
    assert_eq!(retry, "msg-3 to grace");
}

#[idempotent(lease = "60s", on_cancel = "abort", skip = [provider])]
async fn send_aborting(provider: Provider, to: String) -> Result<String, Error> {
    let id = provider.deliver();
    tokio::time::sleep(Duration::from_secs(1)).await;
    Ok(id)
}

#[tokio::test]
async fn on_cancel_abort_settles_an_owned_body_too() {
    let (run, provider) = (run(), Provider::default());
    let call = || send_aborting(provider.clone(), "ada@example.com".into());
    assert!(
        tokio::time::timeout(Duration::from_millis(100), run.scope(call()))
            .await
            .is_err()
    );
    let started = Instant::now();
    assert_eq!(run.scope(call()).await.unwrap(), "msg-2");
    assert!(started.elapsed() < PROMPT);
}

/// Panics on its first run, with a payload the caller must see unchanged.
#[idempotent(lease = "60s", skip = [provider])]
async fn flaky_provider(provider: Provider, to: String) -> Result<String, Error> {
    let id = provider.deliver();
    if id == "msg-1" {
        panic!("provider exploded on {to}");
    }
    Ok(id)
}

#[idempotent(lease = "60s", at_most_once, skip = [provider])]
async fn flaky_charge(provider: Provider, cents: u64) -> Result<String, Error> {
    let id = provider.deliver();
    if id == "msg-1" {
        panic!("provider exploded on {cents}");
    }
    Ok(id)
}

fn panic_message(error: tokio::task::JoinError) -> String {
    let payload = error.into_panic();
    match payload.downcast::<String>() {
        Ok(message) => *message,
        Err(payload) => payload
            .downcast::<&str>()
            .map(|m| m.to_string())
            .unwrap_or_default(),
    }
}

/// Panics anywhere in this test binary located in idem's own code, which never panics
/// (a body polled again after it panicked would panic there).
static IDEM_PANICS: AtomicUsize = AtomicUsize::new(0);

fn count_idem_panics() {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let report = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if info
                .location()
                .is_some_and(|l| l.file().contains("idem-core"))
            {
                IDEM_PANICS.fetch_add(1, Ordering::SeqCst);
            }
            report(info);
        }));
    });
}

#[tokio::test]
async fn a_panicking_body_settles_at_once_and_the_panic_reaches_the_caller() {
    count_idem_panics();
    let (run, provider) = (run(), Provider::default());
    let call = || run.scope(flaky_provider(provider.clone(), "ada".into()));
    let panicked = tokio::spawn(call()).await.unwrap_err();
    assert_eq!(panic_message(panicked), "provider exploded on ada");
    let started = Instant::now();
    assert_eq!(call().await.unwrap(), "msg-2", "the retry runs at once");
    assert!(
        started.elapsed() < PROMPT,
        "the retry waited {:?}",
        started.elapsed()
    );

    let (run, provider) = (self::run(), Provider::default());
    let call = || run.scope(flaky_charge(provider.clone(), 500));
    let panicked = tokio::spawn(call()).await.unwrap_err();
    assert_eq!(panic_message(panicked), "provider exploded on 500");
    let started = Instant::now();
    let retry = call().await;
    assert!(
        matches!(retry, Err(Error::OutcomeUnknown { .. })),
        "{retry:?}"
    );
    assert!(started.elapsed() < PROMPT);
    assert_eq!(provider.delivered(), 1);
    // The panicked body is not finished in the background as if its caller had left.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        IDEM_PANICS.load(Ordering::SeqCst),
        0,
        "idem panicked: a panicked body was polled again"
    );
}

#[idempotent(lease = "60s", skip = [provider])]
fn flaky_sync(provider: &Provider, to: String) -> Result<String, Error> {
    let id = provider.deliver();
    if id == "msg-1" {
        panic!("provider exploded on {to}");
    }
    Ok(id)
}

#[test]
fn a_panicking_sync_body_settles_at_once_and_the_panic_reaches_the_caller() {
    let (run, provider) = (run(), Provider::default());
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        run.sync_scope(|| flaky_sync(&provider, "ada".into()))
    }))
    .unwrap_err();
    assert_eq!(
        panicked.downcast_ref::<String>().map(String::as_str),
        Some("provider exploded on ada")
    );
    let started = Instant::now();
    let retry = run.sync_scope(|| flaky_sync(&provider, "ada".into()));
    assert_eq!(retry.unwrap(), "msg-2");
    assert!(started.elapsed() < PROMPT);
}

/// Four times longer than its lease.
#[idempotent(lease = "300ms", skip = [provider])]
async fn slow_report(provider: Provider, id: u32) -> Result<String, Error> {
    let n = provider.deliver();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    Ok(format!("report {id}: {n}"))
}

#[idempotent(lease = "300ms", fail_fast, skip = [provider])]
async fn slow_report_fail_fast(provider: Provider, id: u32) -> Result<String, Error> {
    let n = provider.deliver();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    Ok(format!("report {id}: {n}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_body_longer_than_its_lease_is_never_taken_over() {
    let (run, provider) = (run(), Provider::default());
    let call = || run.scope(slow_report(provider.clone(), 7));
    let duplicate = async {
        tokio::time::sleep(Duration::from_millis(700)).await;
        call().await
    };
    let (first, duplicate) = tokio::join!(call(), duplicate);
    assert_eq!(
        first.unwrap(),
        "report 7: msg-1",
        "the owner kept its claim"
    );
    assert_eq!(
        duplicate.unwrap(),
        "report 7: msg-1",
        "the duplicate waited for it"
    );
    assert_eq!(provider.delivered(), 1);

    // With `fail_fast`, a duplicate long after the lease is told the key is held.
    let provider = Provider::default();
    let call = || run.scope(slow_report_fail_fast(provider.clone(), 8));
    let duplicate = async {
        tokio::time::sleep(Duration::from_millis(900)).await;
        call().await
    };
    let (first, duplicate) = tokio::join!(call(), duplicate);
    assert!(first.is_ok(), "{first:?}");
    let error = duplicate.unwrap_err();
    assert!(matches!(error, Error::InProgress { .. }), "{error:?}");
    let message = error.to_string();
    assert!(
        message.contains("held by another call that is still running") && message.contains("retry"),
        "the error says what holds the key and what to do: {message}"
    );
    assert_eq!(provider.delivered(), 1);
}

#[idempotent(lease = "300ms", skip = [provider])]
fn slow_sync_report(provider: &Provider, id: u32) -> Result<String, Error> {
    let n = provider.deliver();
    std::thread::sleep(Duration::from_millis(1200));
    Ok(format!("report {id}: {n}"))
}

#[test]
fn a_live_sync_body_longer_than_its_lease_is_never_taken_over() {
    let (run, provider) = (run(), Provider::default());
    std::thread::scope(|scope| {
        let first = scope.spawn(|| run.sync_scope(|| slow_sync_report(&provider, 1)));
        std::thread::sleep(Duration::from_millis(700));
        let duplicate = run.sync_scope(|| slow_sync_report(&provider, 1));
        assert_eq!(first.join().unwrap().unwrap(), "report 1: msg-1");
        assert_eq!(duplicate.unwrap(), "report 1: msg-1");
    });
    assert_eq!(provider.delivered(), 1);
}

#[idempotent(lease = "60s", max_run = "500ms", skip = [provider])]
async fn hangs_once(provider: Provider, to: String) -> Result<String, Error> {
    let id = provider.deliver();
    if id == "msg-1" {
        std::future::pending::<()>().await;
    }
    Ok(id)
}

#[idempotent(lease = "60s", max_run = "500ms", at_most_once, skip = [provider])]
async fn charge_hangs(provider: Provider, cents: u64) -> Result<String, Error> {
    provider.deliver();
    std::future::pending::<()>().await;
    Ok(cents.to_string())
}

#[tokio::test]
async fn a_hung_body_is_stopped_at_max_run_and_settled() {
    let (run, provider) = (run(), Provider::default());
    let started = Instant::now();
    let hung = run.scope(hangs_once(provider.clone(), "ada".into())).await;
    let stopped_after = started.elapsed();
    assert!(
        matches!(hung, Err(Error::MaxRunExceeded { .. })),
        "{hung:?}"
    );
    assert!(
        stopped_after >= Duration::from_millis(500) && stopped_after < PROMPT,
        "stopped after {stopped_after:?}"
    );
    let retry = run.scope(hangs_once(provider.clone(), "ada".into())).await;
    assert_eq!(retry.unwrap(), "msg-2", "released: the retry runs again");

    let started = Instant::now();
    let hung = run.scope(charge_hangs(provider.clone(), 500)).await;
    assert!(
        matches!(hung, Err(Error::MaxRunExceeded { .. })),
        "{hung:?}"
    );
    let retry = run.scope(charge_hangs(provider.clone(), 500)).await;
    assert!(
        matches!(retry, Err(Error::OutcomeUnknown { .. })),
        "{retry:?}"
    );
    assert!(started.elapsed() < PROMPT);
    assert_eq!(provider.delivered(), 3);
}

/// A notification whose result is kept one second, and whose body takes two.
#[idempotent(ttl = "1s", lease = "300ms", skip = [provider])]
async fn notify(provider: Provider, to: String) -> Result<String, Error> {
    let id = provider.deliver();
    tokio::time::sleep(Duration::from_secs(2)).await;
    Ok(id)
}

#[idempotent(ttl = "1ms", skip = [provider])]
async fn notify_briefly(provider: Provider, to: String) -> Result<String, Error> {
    let id = provider.deliver();
    tokio::time::sleep(Duration::from_millis(20)).await;
    Ok(id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ttl_shorter_than_the_body_causes_no_duplicate_and_no_lost_lease() {
    let (run, provider) = (run(), Provider::default());
    let call = || run.scope(notify(provider.clone(), "ada".into()));
    let duplicate = async {
        tokio::time::sleep(Duration::from_millis(1200)).await;
        call().await
    };
    let (first, duplicate) = tokio::join!(call(), duplicate);
    assert_eq!(first.unwrap(), "msg-1");
    assert_eq!(duplicate.unwrap(), "msg-1");
    assert_eq!(provider.delivered(), 1);
    // The result lives its TTL from completion, then the key is free again.
    assert_eq!(call().await.unwrap(), "msg-1");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(call().await.unwrap(), "msg-2");

    let provider = Provider::default();
    let sent = run
        .scope(notify_briefly(provider.clone(), "grace".into()))
        .await;
    assert_eq!(sent.unwrap(), "msg-1", "a 1 ms TTL is no LostLease");
}

/// A `tracing` writer that keeps what it is given.
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
    /// Captures this thread's events at `level` and above while the guard lives.
    fn at(level: tracing::Level) -> (Self, tracing::subscriber::DefaultGuard) {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(level)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        (captured, tracing::subscriber::set_default(subscriber))
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

#[idempotent(name = "export_report", lease = "60s", skip = [provider])]
async fn export_report(provider: Provider, id: u32) -> Result<String, Error> {
    let n = provider.deliver();
    tokio::time::sleep(Duration::from_millis(1600)).await;
    Ok(n)
}

#[tokio::test]
async fn a_wait_that_lasts_is_logged_at_info_with_the_tool_the_key_and_the_claims_expiry() {
    let (captured, _logs) = Captured::at(tracing::Level::INFO);

    let (run, provider) = (run(), Provider::default());
    let call = || run.scope(export_report(provider.clone(), 3));
    let duplicate = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        call().await
    };
    let (first, duplicate) = tokio::join!(call(), duplicate);
    assert_eq!(first.unwrap(), duplicate.unwrap());

    let logs = captured.text();
    let line = logs
        .lines()
        .find(|l| l.contains("waiting for another call"))
        .unwrap_or_else(|| panic!("no wait logged:\n{logs}"));
    assert!(line.contains(" INFO "), "{line}");
    assert!(line.contains("tool=export_report"), "{line}");
    assert!(line.contains("key=export_report."), "{line}");
    assert!(line.contains("claim_expires_in="), "{line}");
    assert_eq!(
        logs.matches("waiting for another call").count(),
        1,
        "logged once:\n{logs}"
    );
}

/// A memory store whose answers come late: a claim is applied after `claim_delay` and
/// answered `claim_answer` after that; a release is applied only after `release_delay`,
/// a completion after `complete_delay` (and fails until `complete_fails_until`), and a
/// renewal (but a zero-lease one, which gives a claim up) after `renew_delay` (waiting)
/// or `renew_blocks` (blocking its thread after its first `.await`, as a store doing
/// blocking IO in an `async fn` does), and is answered `renew_answer` after it applied.
#[derive(Clone, Default)]
struct Slow {
    inner: MemoryStore,
    claim_delay: Duration,
    claim_answer: Duration,
    release_delay: Duration,
    complete_delay: Duration,
    complete_fails_until: Option<Instant>,
    renew_delay: Duration,
    renew_blocks: Duration,
    renew_answer: Duration,
    /// Renewals panic while this is set.
    renew_panics: Arc<std::sync::atomic::AtomicBool>,
}

#[async_trait::async_trait]
impl idem::Store for Slow {
    async fn claim(
        &self,
        key: &idem::Key,
        request: &idem::store::ClaimRequest,
    ) -> Result<idem::store::Claim, Error> {
        tokio::time::sleep(self.claim_delay).await;
        let claim = self.inner.claim(key, request).await;
        tokio::time::sleep(self.claim_answer).await;
        claim
    }
    async fn complete(
        &self,
        key: &idem::Key,
        token: idem::store::Token,
        outcome: idem::store::Outcome<'_>,
        ttl: Duration,
    ) -> Result<idem::store::Fenced, Error> {
        tokio::time::sleep(self.complete_delay).await;
        if self
            .complete_fails_until
            .is_some_and(|until| Instant::now() < until)
        {
            return Err(Error::store("slow", "the disk is full"));
        }
        self.inner.complete(key, token, outcome, ttl).await
    }
    async fn release(
        &self,
        key: &idem::Key,
        token: idem::store::Token,
    ) -> Result<idem::store::Fenced, Error> {
        tokio::time::sleep(self.release_delay).await;
        self.inner.release(key, token).await
    }
    async fn renew(
        &self,
        key: &idem::Key,
        token: idem::store::Token,
        lease: Duration,
        ttl: Duration,
    ) -> Result<idem::store::Fenced, Error> {
        if self.renew_panics.swap(false, Ordering::SeqCst) {
            panic!("a store's renewal panicked");
        }
        if lease.is_zero() {
            return self.inner.renew(key, token, lease, ttl).await;
        }
        tokio::task::yield_now().await;
        std::thread::sleep(self.renew_blocks);
        tokio::time::sleep(self.renew_delay).await;
        let renewed = self.inner.renew(key, token, lease, ttl).await;
        tokio::time::sleep(self.renew_answer).await;
        renewed
    }
    async fn get(&self, key: &idem::Key) -> Result<Option<idem::store::Record>, Error> {
        self.inner.get(key).await
    }
    async fn delete(&self, key: &idem::Key) -> Result<bool, Error> {
        self.inner.delete(key).await
    }
    async fn purge_expired(&self) -> Result<u64, Error> {
        self.inner.purge_expired().await
    }
}

/// A report whose body is quick and whose store takes three times its lease to record
/// the outcome. A lease of one second: a renewal (every third of it) would have to be
/// held up for two thirds of a second to lose the claim.
#[idempotent(name = "slow_record", lease = "1s", skip = [provider])]
async fn slow_record(provider: Provider, id: u32) -> Result<String, Error> {
    Ok(provider.deliver())
}

/// The same tool, for a duplicate that does not wait.
#[idempotent(name = "slow_record", lease = "1s", fail_fast, skip = [provider])]
async fn slow_record_fail_fast(provider: Provider, id: u32) -> Result<String, Error> {
    Ok(provider.deliver())
}

/// The claim is renewed while the store records the outcome, not only while the body
/// runs: a completion that takes longer than the lease leaves no gap in which a retry
/// takes the key over and runs the body again (and the first caller gets `LostLease`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_slower_than_the_lease_keeps_the_claim() {
    let store = Slow {
        complete_delay: Duration::from_secs(3),
        ..Slow::default()
    };
    let run = Run::new("slow-completion").with_store(store);
    let provider = Provider::default();
    let duplicates = async {
        // Past the lease, twice: the claim is still held.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let busy = run.scope(slow_record_fail_fast(provider.clone(), 1)).await;
        assert!(matches!(busy, Err(Error::InProgress { .. })), "{busy:?}");
        tokio::time::sleep(Duration::from_millis(1000)).await;
        // A duplicate that waits gets the first call's result.
        run.scope(slow_record(provider.clone(), 1)).await
    };
    let (first, waited) = tokio::join!(run.scope(slow_record(provider.clone(), 1)), duplicates);
    assert_eq!(first.unwrap(), "msg-1", "no LostLease");
    assert_eq!(waited.unwrap(), "msg-1");
    assert_eq!(provider.delivered(), 1, "the body ran once");
}

/// A store whose renewals block their thread for ten seconds (after their first
/// `.await`), for forty claims at once, holds up its own claims' renewals, not those of
/// every other claim in the process: a body on another store, three times its
/// one-second lease, keeps its claim throughout (a renewal would have to be two thirds
/// of a second late to lose it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_blocks_in_its_renewals_holds_up_no_other_claim() {
    let blocking = Run::new("blocking-renewals").with_store(Slow {
        renew_blocks: Duration::from_secs(10),
        ..Slow::default()
    });
    let (run, provider) = (run(), Provider::default());
    // More of its claims than it may block threads with at once.
    let stuck: Vec<_> = (0..40)
        .map(|n| {
            let (blocking, provider) = (blocking.clone(), provider.clone());
            tokio::spawn(async move { blocking.scope(slow_record_long(provider, 100 + n)).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let duplicate = async {
        tokio::time::sleep(Duration::from_millis(2000)).await;
        run.scope(slow_record_long_fail_fast(provider.clone(), 2))
            .await
    };
    let (owner, duplicate) =
        tokio::join!(run.scope(slow_record_long(provider.clone(), 2)), duplicate);
    assert!(
        matches!(duplicate, Err(Error::InProgress { .. })),
        "the claim was lost: {duplicate:?}"
    );
    assert!(owner.is_ok(), "no LostLease: {owner:?}");
    for stuck in stuck {
        stuck.abort();
    }
}

/// A report three times its one-second lease.
#[idempotent(name = "slow_record_long", lease = "1s", skip = [provider])]
async fn slow_record_long(provider: Provider, id: u32) -> Result<String, Error> {
    let n = provider.deliver();
    tokio::time::sleep(Duration::from_secs(3)).await;
    Ok(n)
}

/// The same tool, for a duplicate that does not wait.
#[idempotent(name = "slow_record_long", lease = "1s", fail_fast, skip = [provider])]
async fn slow_record_long_fail_fast(provider: Provider, id: u32) -> Result<String, Error> {
    Ok(provider.deliver())
}

/// A charge whose caller gives up while a renewal of its claim is still out.
#[idempotent(lease = "2s", at_most_once, on_cancel = "abort", fail_fast, skip = [provider])]
async fn charge_renewed_late(provider: Provider, cents: u64) -> Result<String, Error> {
    let n = provider.deliver();
    tokio::time::sleep(Duration::from_secs(30)).await;
    Ok(n)
}

/// A renewal slower than the call's wait for it (a lease) lands after the call gave its
/// claim up as outcome-unknown, and would make it live again for a lease: the claim is
/// given up again as soon as it lands, so a retry is told `OutcomeUnknown`, not that a
/// call nobody runs holds the key.
#[tokio::test]
async fn a_renewal_that_lands_after_its_claim_was_given_up_does_not_revive_it() {
    let run = Run::new("late-renewal").with_store(Slow {
        renew_delay: Duration::from_millis(2500),
        ..Slow::default()
    });
    let provider = Provider::default();
    // The first renewal goes out at 0.67 s and lands at 3.2 s; the call is dropped at
    // 1 s, waits a lease for the renewal, and gives the claim up at 3 s.
    let first = tokio::time::timeout(
        Duration::from_secs(1),
        run.scope(charge_renewed_late(provider.clone(), 500)),
    )
    .await;
    assert!(first.is_err());
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let retry = run.scope(charge_renewed_late(provider.clone(), 500)).await;
    assert!(
        matches!(retry, Err(Error::OutcomeUnknown { .. })),
        "{retry:?}"
    );
    assert_eq!(provider.delivered(), 1);
}

/// A report on a store that takes its outcome only after a few seconds.
#[idempotent(name = "recorded_late", lease = "3s", skip = [provider])]
async fn recorded_late(provider: Provider, id: u32) -> Result<String, Error> {
    Ok(provider.deliver())
}

/// A runtime shut down while an outcome the store refused is being recorded again:
/// the recording starts over on idem's own runtime, with renewals of its own, and a
/// renewal of the old one that lands afterwards (answered late) must not give the
/// claim up, since the call has not settled it: the waiting retry gets the first
/// value, and the body runs once.
#[test]
fn a_late_record_moved_off_a_runtime_that_shut_down_keeps_its_claim() {
    let started = Instant::now();
    let run = Run::new("late-record-rescued").with_store(Slow {
        complete_fails_until: Some(started + Duration::from_secs(3)),
        renew_answer: Duration::from_millis(2500),
        ..Slow::default()
    });
    let provider = Provider::default();
    let first = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let value = first.block_on(run.scope(recorded_late(provider.clone(), 1)));
    assert_eq!(value.unwrap(), "msg-1", "the body's own value");
    // Its first renewal goes out at 1 s, and is answered at 3.5 s.
    std::thread::sleep(Duration::from_millis(1500));
    drop(first);
    let second = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let retry = second.block_on(async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        run.scope(recorded_late(provider.clone(), 1)).await
    });
    assert_eq!(retry.unwrap(), "msg-1", "the retry gets the first value");
    assert_eq!(provider.delivered(), 1, "the body ran once");
}

#[idempotent(lease = "60s", skip = [provider])]
async fn send_quick(provider: Provider, to: String) -> Result<String, Error> {
    Ok(provider.deliver())
}

#[idempotent(lease = "60s", at_most_once, skip = [provider])]
async fn charge_quick(provider: Provider, cents: u64) -> Result<String, Error> {
    Ok(provider.deliver())
}

#[tokio::test]
async fn a_call_dropped_while_its_claim_is_answered_leaves_no_claim_behind() {
    let store = Slow {
        claim_answer: Duration::from_millis(300),
        ..Slow::default()
    };
    let run = Run::new("agent-run").with_store(store);
    let provider = Provider::default();

    // The claim lands; the caller gives up before its answer comes back.
    let dropped = tokio::time::timeout(
        Duration::from_millis(100),
        run.scope(send_quick(provider.clone(), "ada".into())),
    )
    .await;
    assert!(dropped.is_err());
    let started = Instant::now();
    let retry = run.scope(send_quick(provider.clone(), "ada".into())).await;
    assert_eq!(
        retry.unwrap(),
        "msg-1",
        "the retry runs the body, which never ran"
    );
    assert!(
        started.elapsed() < PROMPT,
        "the retry waited {:?}",
        started.elapsed()
    );

    // At-most-once too: no body ran, so the outcome is not unknown.
    let dropped = tokio::time::timeout(
        Duration::from_millis(100),
        run.scope(charge_quick(provider.clone(), 500)),
    )
    .await;
    assert!(dropped.is_err());
    let started = Instant::now();
    let retry = run.scope(charge_quick(provider.clone(), 500)).await;
    assert_eq!(retry.unwrap(), "msg-2");
    assert!(
        started.elapsed() < PROMPT,
        "the retry waited {:?}",
        started.elapsed()
    );
}

#[derive(Debug, PartialEq)]
struct Declined(String);

impl From<Error> for Declined {
    fn from(error: Error) -> Declined {
        Declined(error.to_string())
    }
}

#[tokio::test]
async fn a_claim_that_lands_after_its_caller_left_is_released_once_it_lands() {
    // The claim is applied 300 ms after it was sent; the caller gives up after 100 ms.
    let store = Slow {
        claim_delay: Duration::from_millis(300),
        ..Slow::default()
    };
    let run = Run::new("agent-run").with_store(store);
    let provider = Provider::default();
    let dropped = tokio::time::timeout(
        Duration::from_millis(100),
        run.scope(charge_quick(provider.clone(), 700)),
    )
    .await;
    assert!(dropped.is_err());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = Instant::now();
    let retry = run.scope(charge_quick(provider.clone(), 700)).await;
    assert_eq!(
        retry.unwrap(),
        "msg-1",
        "no body ran under the late claim: this one runs"
    );
    assert!(
        started.elapsed() < PROMPT,
        "the retry waited {:?}",
        started.elapsed()
    );
}

#[idempotent(lease = "60s", at_most_once, on_cancel = "abort", skip = [provider])]
async fn declined(provider: Provider, cents: u64) -> Result<String, Declined> {
    provider.deliver();
    Err(Declined(format!("{cents}: card declined")))
}

#[tokio::test]
async fn a_call_dropped_while_its_release_is_out_is_still_released() {
    let store = Slow {
        release_delay: Duration::from_millis(300),
        ..Slow::default()
    };
    let run = Run::new("agent-run").with_store(store);
    let provider = Provider::default();
    // The body returns `Err`, which releases the key; the caller gives up while the
    // release is out. The key must be released all the same (not left unknown, though
    // the tool is at-most-once: an `Err` releases).
    let dropped = tokio::time::timeout(
        Duration::from_millis(100),
        run.scope(declined(provider.clone(), 500)),
    )
    .await;
    assert!(dropped.is_err());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = Instant::now();
    let retry = run.scope(declined(provider.clone(), 500)).await;
    assert_eq!(
        retry.unwrap_err(),
        Declined("500: card declined".into()),
        "the retry ran again"
    );
    assert!(
        started.elapsed() < PROMPT,
        "the retry waited {:?}",
        started.elapsed()
    );
    assert_eq!(provider.delivered(), 2);
}

/// Blocks its thread (wrongly, but it happens) for four times its lease.
#[idempotent(name = "blocks_its_thread", lease = "300ms", skip = [provider])]
async fn blocks_its_thread(provider: Provider, id: u32) -> Result<String, Error> {
    let n = provider.deliver();
    // Blocks before it ever waits.
    std::thread::sleep(Duration::from_millis(1200));
    Ok(n)
}

/// The same tool, for a duplicate that does not wait.
#[idempotent(name = "blocks_its_thread", lease = "300ms", fail_fast, skip = [provider])]
async fn blocks_its_thread_fail_fast(provider: Provider, id: u32) -> Result<String, Error> {
    let n = provider.deliver();
    std::thread::sleep(Duration::from_millis(1200));
    Ok(n)
}

#[test]
fn a_body_that_blocks_its_thread_keeps_its_claim() {
    let (run, provider) = (run(), Provider::default());
    std::thread::scope(|scope| {
        let first = scope.spawn(|| {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(run.scope(blocks_its_thread(provider.clone(), 1)))
        });
        std::thread::sleep(Duration::from_millis(700));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let duplicate =
            runtime.block_on(run.scope(blocks_its_thread_fail_fast(provider.clone(), 1)));
        assert!(
            matches!(duplicate, Err(Error::InProgress { .. })),
            "{duplicate:?}"
        );
        assert_eq!(first.join().unwrap().unwrap(), "msg-1", "no LostLease");
    });
    assert_eq!(provider.delivered(), 1);
}

#[async_trait::async_trait]
trait Notify {
    async fn notify(&self, to: String) -> Result<String, Error>;
}

struct Notifier {
    provider: Provider,
}

/// Notifications really sent by `Notifier::notify`.
static NOTIFICATIONS: AtomicUsize = AtomicUsize::new(0);

#[async_trait::async_trait]
impl Notify for Notifier {
    /// Uses nothing of `self`: it finishes when its caller stops waiting.
    #[idempotent(name = "notifier_notify", lease = "60s")]
    async fn notify(&self, to: String) -> Result<String, Error> {
        let n = NOTIFICATIONS.fetch_add(1, Ordering::SeqCst) + 1;
        tokio::time::sleep(Duration::from_millis(300)).await;
        Ok(format!("notified {to}, message {n}"))
    }
}

#[tokio::test]
async fn an_async_trait_method_that_owns_what_it_uses_finishes_by_default() {
    let run = run();
    let notifier = Notifier {
        provider: Provider::default(),
    };
    let dropped = tokio::time::timeout(
        Duration::from_millis(100),
        run.scope(notifier.notify("ada".into())),
    )
    .await;
    assert!(dropped.is_err());
    // The dropped call finished alone: its result answers the retry.
    let retry = run.scope(notifier.notify("ada".into())).await;
    assert_eq!(retry.unwrap(), "notified ada, message 1");
    assert_eq!(notifier.provider.delivered(), 0);
    assert_eq!(NOTIFICATIONS.load(Ordering::SeqCst), 1, "one notification");
}

/// A tool object that counts how often it is cloned.
#[derive(Default)]
struct Counted {
    clones: Arc<AtomicUsize>,
    provider: Provider,
}

impl Clone for Counted {
    fn clone(&self) -> Self {
        self.clones.fetch_add(1, Ordering::SeqCst);
        Counted {
            clones: self.clones.clone(),
            provider: self.provider.clone(),
        }
    }
}

impl Counted {
    #[idempotent(lease = "60s", on_cancel = "finish")]
    async fn send(&self, to: &str) -> Result<String, Error> {
        Ok(format!("{} to {to}", self.provider.deliver()))
    }
}

#[tokio::test]
async fn on_cancel_finish_copies_self_only_when_the_body_runs() {
    let (run, tool) = (run(), Counted::default());
    for _ in 0..10 {
        assert_eq!(run.scope(tool.send("ada")).await.unwrap(), "msg-1 to ada");
    }
    assert_eq!(
        tool.clones.load(Ordering::SeqCst),
        1,
        "one clone, for the one run"
    );
}

#[idempotent(name = "kept_alive", lease = "300ms", skip = [provider])]
async fn kept_alive(provider: Provider, id: u32) -> Result<String, Error> {
    let n = provider.deliver();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    Ok(n)
}

/// The same tool, for a duplicate that does not wait.
#[idempotent(name = "kept_alive", lease = "300ms", fail_fast, skip = [provider])]
async fn kept_alive_fail_fast(provider: Provider, id: u32) -> Result<String, Error> {
    Ok(provider.deliver())
}

/// A body four times its lease, and a fail-fast duplicate at +700 ms: the duplicate
/// must find the claim held.
async fn claim_is_held_throughout(run: &Run) {
    let provider = Provider::default();
    let duplicate = async {
        tokio::time::sleep(Duration::from_millis(700)).await;
        run.scope(kept_alive_fail_fast(provider.clone(), 1)).await
    };
    let (owner, duplicate) = tokio::join!(run.scope(kept_alive(provider.clone(), 1)), duplicate);
    assert_eq!(owner.unwrap(), "msg-1");
    assert!(
        matches!(duplicate, Err(Error::InProgress { .. })),
        "{duplicate:?}"
    );
    assert_eq!(provider.delivered(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_panics_in_a_renewal_does_not_stop_the_heartbeat() {
    let store = Slow::default();
    let panics = store.renew_panics.clone();
    panics.store(true, Ordering::SeqCst);
    // The first renewal of this call panics, on idem's own thread; the next ones
    // keep its claim.
    let run = Run::new("panicking-renewal").with_store(store);
    claim_is_held_throughout(&run).await;
    assert!(
        !panics.load(Ordering::SeqCst),
        "the renewal ran, and panicked"
    );
    // And every other claim is still renewed.
    claim_is_held_throughout(&self::run()).await;
}

/// A store whose `claim` and `complete` are written by hand, as `async_trait` writes an
/// `async fn` out, and which panic before they return their future while told to.
#[derive(Default)]
struct PanicsEagerly {
    inner: MemoryStore,
    claim_panics: std::sync::atomic::AtomicBool,
    complete_panics: std::sync::atomic::AtomicBool,
}

/// What a hand-written `Store` method returns.
type StoreFuture<'a, T> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<T, Error>> + Send + 'a>>;

#[async_trait::async_trait]
impl idem::Store for PanicsEagerly {
    fn claim<'s, 'k, 'r, 'f>(
        &'s self,
        key: &'k idem::Key,
        request: &'r idem::store::ClaimRequest,
    ) -> StoreFuture<'f, idem::store::Claim>
    where
        's: 'f,
        'k: 'f,
        'r: 'f,
        Self: 'f,
    {
        if self.claim_panics.swap(false, Ordering::SeqCst) {
            panic!("the claim panicked before it made its future");
        }
        self.inner.claim(key, request)
    }
    fn complete<'s, 'k, 'o, 'f>(
        &'s self,
        key: &'k idem::Key,
        token: idem::store::Token,
        outcome: idem::store::Outcome<'o>,
        ttl: Duration,
    ) -> StoreFuture<'f, idem::store::Fenced>
    where
        's: 'f,
        'k: 'f,
        'o: 'f,
        Self: 'f,
    {
        if self.complete_panics.swap(false, Ordering::SeqCst) {
            panic!("the completion panicked before it made its future");
        }
        self.inner.complete(key, token, outcome, ttl)
    }
    async fn release(
        &self,
        key: &idem::Key,
        token: idem::store::Token,
    ) -> Result<idem::store::Fenced, Error> {
        self.inner.release(key, token).await
    }
    async fn renew(
        &self,
        key: &idem::Key,
        token: idem::store::Token,
        lease: Duration,
        ttl: Duration,
    ) -> Result<idem::store::Fenced, Error> {
        self.inner.renew(key, token, lease, ttl).await
    }
    async fn get(&self, key: &idem::Key) -> Result<Option<idem::store::Record>, Error> {
        self.inner.get(key).await
    }
    async fn delete(&self, key: &idem::Key) -> Result<bool, Error> {
        self.inner.delete(key).await
    }
    async fn purge_expired(&self) -> Result<u64, Error> {
        self.inner.purge_expired().await
    }
}

/// A run reaches its store through `Arc<dyn Store>`, whose impl hands each call straight
/// to the store's method: a panic there, before any future exists, is still the store's
/// failure, caught as one in the store's own code would be.
#[tokio::test]
async fn a_store_that_panics_before_its_future_is_made_fails_as_a_store() {
    let store = Arc::new(PanicsEagerly::default());
    let run = Run::new("eager-panics").with_shared_store(store.clone());
    let provider = Provider::default();
    let email = |to: &str| send_email(provider.clone(), to.to_owned(), Duration::ZERO);

    store.claim_panics.store(true, Ordering::SeqCst);
    let refused = run.scope(email("ada")).await;
    assert!(
        matches!(&refused, Err(e @ Error::Store { .. }) if e.to_string().contains("panicked in claim")),
        "{refused:?}"
    );
    assert_eq!(provider.delivered(), 0, "the body ran without a claim");

    // After the body ran: the caller gets its value, and a retry replays it.
    store.complete_panics.store(true, Ordering::SeqCst);
    assert_eq!(run.scope(email("bob")).await.unwrap(), "msg-1");
    assert_eq!(run.scope(email("bob")).await.unwrap(), "msg-1");
    assert_eq!(provider.delivered(), 1);
}

#[tokio::test]
async fn a_call_lets_go_of_its_store_when_it_ends() {
    let store: Arc<dyn idem::Store> = Arc::new(MemoryStore::new());
    let run = Run::new("agent-run").with_shared_store(store.clone());
    // A body that waits: its claim is renewed (with an hour's lease, not before long).
    #[idempotent(lease = "1h")]
    async fn waits(n: u32) -> Result<u32, Error> {
        tokio::time::sleep(Duration::from_millis(10)).await;
        Ok(n)
    }
    for n in 0..10 {
        run.scope(waits(n)).await.unwrap();
    }
    drop(run);
    assert_eq!(
        Arc::strong_count(&store),
        1,
        "something still holds the store after the calls ended"
    );
}

impl Mailer {
    /// `on_cancel = "finish"` with a `mut` argument the body reassigns.
    #[idempotent(lease = "60s", on_cancel = "finish")]
    async fn send_trimmed(&self, mut to: &str) -> Result<String, Error> {
        to = to.trim();
        Ok(format!("{} to {to}", self.provider.deliver()))
    }
}

#[tokio::test]
async fn on_cancel_finish_keeps_a_mut_argument_mutable() {
    let (run, mailer) = (run(), Mailer::default());
    assert_eq!(
        run.scope(mailer.send_trimmed(" ada ")).await.unwrap(),
        "msg-1 to ada"
    );
}

/// A tool generic over its impl's parameter: settled by default (the attribute takes a
/// one-letter capital type for a generic it cannot see), so it compiles.
struct Ledger<T>(std::marker::PhantomData<T>);

impl<T: serde::Serialize + Send + Sync> Ledger<T> {
    #[idempotent(name = "ledger_record", lease = "60s")]
    async fn record(&self, entry: T) -> Result<u32, Error> {
        let _ = serde_json::to_string(&entry);
        Ok(1)
    }
}

#[tokio::test]
async fn a_method_generic_over_its_impl_compiles_and_runs() {
    let run = run();
    let ledger = Ledger::<String>(std::marker::PhantomData);
    assert_eq!(run.scope(ledger.record("a".into())).await.unwrap(), 1);
}

// ----- Reconcile hooks: their values, and their time ---------------------------------

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
    let run = Run::new("reconcile-read-back").with_shared_store(store.clone());
    let provider = Provider::default();
    let (captured, _logs) = Captured::at(tracing::Level::WARN);
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
                    warning.contains(&format!("tool=lifecycle::{tool}")),
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

/// Blocks its thread past its tool's timeout, then says it never happened.
async fn blocks_then_answers(_key: &Key, _order: &u32, _p: &Provider) -> Reconciled<u64> {
    std::thread::sleep(Duration::from_millis(1200));
    Reconciled::NeverHappened
}

#[idempotent(
    lease = "60s",
    at_most_once,
    reconcile = blocks_then_answers,
    reconcile_timeout = "300ms",
    skip = [provider]
)]
async fn charge_blocking_hook(order: u32, provider: &Provider) -> Result<u64, Error> {
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
    let run = Run::new("hook-timeout").with_store(MemoryStore::new());
    let provider = Provider::default();
    let (captured, _logs) = Captured::at(tracing::Level::WARN);
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
        warning.contains("tool=lifecycle::charge_unreconcilable"),
        "{warning}"
    );
    assert!(warning.contains(err.key().unwrap().as_str()), "{warning}");
    // A hook that blocks its thread cannot be stopped, but its answer after the bound
    // counts as unknown: the body does not run again.
    let (p, r) = (provider.clone(), run.clone());
    abandon(async move { r.scope(charge_blocking_hook(12, &p)).await }).await;
    let retry = run.scope(charge_blocking_hook(12, &provider)).await;
    assert!(
        matches!(retry, Err(Error::OutcomeUnknown { .. })),
        "{retry:?}"
    );
    // A hook that answers within its bound settles the call.
    let (p, r) = (provider.clone(), run.clone());
    abandon(async move { r.scope(charge_reconciled_late(11, &p)).await }).await;
    let retry = run.scope(charge_reconciled_late(11, &provider)).await;
    assert_eq!(retry.unwrap(), 42);
    assert_eq!(provider.delivered(), 3, "each body ran once");
    assert_eq!(
        idem::Options::new().reconcile_timeout,
        Duration::from_secs(10),
        "the documented default"
    );
}
