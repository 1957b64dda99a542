//! idem's metrics as Prometheus scrapes them: a real `metrics-exporter-prometheus`
//! endpoint on 127.0.0.1, real calls of every kind, and the counts read back over
//! HTTP. (The recorder is process-wide, so this file holds one test.)

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem::{idempotent, Error, MemoryStore, Run};
use metrics_exporter_prometheus::PrometheusBuilder;

#[derive(Clone, Default)]
struct Provider(Arc<AtomicUsize>);

impl Provider {
    fn deliver(&self) -> usize {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }
}

#[idempotent(name = "send_email", skip = [provider])]
async fn send_email(provider: Provider, to: String) -> Result<usize, Error> {
    tokio::time::sleep(Duration::from_millis(100)).await;
    let _ = to;
    Ok(provider.deliver())
}

#[idempotent(name = "charge", at_most_once, skip = [provider, panics])]
async fn charge(provider: Provider, cents: u64, panics: bool) -> Result<usize, Error> {
    let n = provider.deliver();
    assert!(!panics, "the card network went away ({cents} cents)");
    Ok(n)
}

/// A sync body past its `max_run`: its claim runs out and is taken over.
#[idempotent(name = "export", lease = "100ms", max_run = "100ms", skip = [provider, takes])]
fn export(provider: Provider, rows: u32, takes: Duration) -> Result<usize, Error> {
    let n = provider.deliver();
    std::thread::sleep(takes);
    let _ = rows;
    Ok(n)
}

/// One sample of a scrape: a metric's name and labels, and its value.
type Samples = BTreeMap<(String, BTreeMap<String, String>), f64>;

/// Parses Prometheus' text format (the lines idem's metrics give).
fn parse(scrape: &str) -> Samples {
    let mut samples = Samples::new();
    for line in scrape
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let (series, value) = line.rsplit_once(' ').expect("a sample line");
        let (name, labels) = match series.split_once('{') {
            Some((name, labels)) => (name, labels.trim_end_matches('}')),
            None => (series, ""),
        };
        let labels = labels
            .split(',')
            .filter(|l| !l.is_empty())
            .map(|l| {
                let (k, v) = l.split_once('=').expect("a label");
                (k.to_owned(), v.trim_matches('"').to_owned())
            })
            .collect();
        samples.insert((name.to_owned(), labels), value.parse().expect("a value"));
    }
    samples
}

fn value(samples: &Samples, name: &str, labels: &[(&str, &str)]) -> f64 {
    let labels = labels
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    samples
        .get(&(name.to_owned(), labels))
        .copied()
        .unwrap_or(0.0)
}

/// A free port on 127.0.0.1.
fn free_addr() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_count_every_call_by_tool_and_outcome() {
    let addr = free_addr();
    PrometheusBuilder::new()
        .with_http_listener(addr)
        .install()
        .expect("the exporter listens");
    let provider = Provider::default();
    let run = Run::new("metrics-run").with_store(MemoryStore::new());

    // send_email: two executed, two replayed, one duplicate waited then replayed.
    for to in ["ada", "bob"] {
        run.scope(send_email(provider.clone(), to.into()))
            .await
            .unwrap();
        run.scope(send_email(provider.clone(), to.into()))
            .await
            .unwrap();
    }
    let (a, b) = tokio::join!(
        run.scope(send_email(provider.clone(), "cy".into())),
        run.scope(send_email(provider.clone(), "cy".into()))
    );
    assert_eq!(a.unwrap(), b.unwrap());

    // charge: a panic mid-call (at-most-once), then an unknown outcome for its retry.
    let panicked = tokio::spawn(run.scope(charge(provider.clone(), 500, true))).await;
    assert!(panicked.unwrap_err().is_panic());
    let unknown = run.scope(charge(provider.clone(), 500, false)).await;
    assert!(
        matches!(unknown, Err(Error::OutcomeUnknown { .. })),
        "{unknown:?}"
    );

    // export: a claim whose owner stopped renewing it is taken over.
    let stuck = std::thread::spawn({
        let (run, provider) = (run.clone(), provider.clone());
        move || run.sync_scope(|| export(provider, 1, Duration::from_millis(800)))
    });
    tokio::time::sleep(Duration::from_millis(450)).await;
    let (run2, provider2) = (run.clone(), provider.clone());
    let retry = tokio::task::spawn_blocking(move || {
        run2.sync_scope(|| export(provider2, 1, Duration::ZERO))
    })
    .await
    .unwrap();
    assert!(retry.is_ok(), "{retry:?}");
    assert!(matches!(
        stuck.join().unwrap(),
        Err(Error::LostLease { .. })
    ));

    let scrape = reqwest::get(format!("http://{addr}/metrics"))
        .await
        .expect("the endpoint answers")
        .text()
        .await
        .unwrap();
    let samples = parse(&scrape);
    let calls = |tool: &str, outcome: &str| {
        value(
            &samples,
            "idem_calls_total",
            &[("outcome", outcome), ("store", "memory"), ("tool", tool)],
        )
    };
    assert_eq!(calls("send_email", "executed"), 3.0, "{scrape}");
    assert_eq!(calls("send_email", "replayed"), 2.0, "{scrape}");
    assert_eq!(calls("send_email", "waited_then_replayed"), 1.0, "{scrape}");
    assert_eq!(calls("charge", "not_recorded"), 1.0, "{scrape}");
    assert_eq!(calls("charge", "outcome_unknown"), 1.0, "{scrape}");
    assert_eq!(calls("export", "took_over"), 1.0, "{scrape}");
    assert_eq!(calls("export", "not_recorded"), 1.0, "{scrape}");

    let tool = |name| [("store", "memory"), ("tool", name)];
    assert_eq!(
        value(&samples, "idem_lease_takeovers_total", &tool("export")),
        1.0
    );
    assert_eq!(
        value(&samples, "idem_outcome_unknown_total", &tool("charge")),
        1.0
    );
    assert_eq!(
        value(
            &samples,
            "idem_wait_duration_seconds_count",
            &tool("send_email")
        ),
        1.0,
        "{scrape}"
    );
    let claims = value(
        &samples,
        "idem_store_operation_duration_seconds_count",
        &[("operation", "claim"), ("store", "memory")],
    );
    // Every call but the in-memory hits claims once; the waiting duplicate claims
    // again after each wait.
    assert!(claims >= 8.0, "{claims} claims\n{scrape}");
    // Described, with their units.
    assert!(scrape.contains("# HELP idem_calls_total"), "{scrape}");
    assert!(
        scrape.contains("# TYPE idem_calls_total counter"),
        "{scrape}"
    );
    // The key is never a label.
    assert!(!scrape.contains("key="), "{scrape}");
    assert!(!scrape.contains("metrics-run"), "{scrape}");
}
