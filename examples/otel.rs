//! idem's spans in OpenTelemetry, with no idem-specific setup: the agent installs
//! `tracing-opentelemetry` as it would anyway, and every idempotent call appears as an
//! `execute_tool {tool}` span under the agent's own span, with the GenAI attributes
//! and `idem.outcome`.
//!
//! ```text
//! cargo run --example otel
//! ```
//!
//! The exporter is OpenTelemetry's in-memory one, so this runs offline; the example
//! prints the exported spans as a tree. In production, put an OTLP exporter where the
//! in-memory one is.
//!
//! The agent's step sends an email, is retried (the retry is replayed), and sends a
//! second email twice at once (the duplicate waits and is replayed).

use std::collections::HashMap;
use std::time::Duration;

use idem::{idempotent, MemoryStore, Run};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry::Value;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use serde::{Deserialize, Serialize};
use tracing::Instrument;
use tracing_subscriber::layer::SubscriberExt;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct SendEmail {
    to: String,
    subject: String,
}

#[idempotent(name = "send_email", ttl = "24h")]
async fn send_email(email: SendEmail) -> Result<String, idem::Error> {
    // The provider answers after a while.
    tokio::time::sleep(Duration::from_millis(100)).await;
    Ok(format!("msg-for-{}", email.to.len()))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The agent's own tracing setup: OpenTelemetry through `tracing-opentelemetry`.
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("agent")));
    tracing::subscriber::set_global_default(subscriber)?;

    let run = Run::new("run-42")
        .with_call_id("call_0001")
        .with_store(MemoryStore::new());
    let ada = SendEmail {
        to: "ada@example.com".into(),
        subject: "Your invoice".into(),
    };
    let bob = SendEmail {
        to: "bob@example.com".into(),
        subject: "Your invoice".into(),
    };
    async {
        // The call, and the agent's retry of it.
        run.scope(send_email(ada.clone())).await?;
        run.scope(send_email(ada)).await?;
        // Two calls at once: one runs, the other waits for it.
        let (a, b) = tokio::join!(
            run.scope(send_email(bob.clone())),
            run.scope(send_email(bob))
        );
        a?;
        b?;
        Ok::<_, idem::Error>(())
    }
    .instrument(tracing::info_span!("agent_step", step = 1))
    .await?;

    provider.force_flush()?;
    let spans = exporter.get_finished_spans()?;
    print_tree(&spans);
    let calls = spans
        .iter()
        .filter(|s| s.name.starts_with("execute_tool"))
        .count();
    assert_eq!(calls, 4, "one span per call");
    provider.shutdown()?;
    Ok(())
}

/// Prints `spans` as a tree, children under their parents, with their attributes.
fn print_tree(spans: &[SpanData]) {
    let mut children: HashMap<_, Vec<&SpanData>> = HashMap::new();
    for span in spans {
        children.entry(span.parent_span_id).or_default().push(span);
    }
    for list in children.values_mut() {
        list.sort_by_key(|s| s.start_time);
    }
    let roots: Vec<&SpanData> = spans
        .iter()
        .filter(|s| {
            !spans
                .iter()
                .any(|p| p.span_context.span_id() == s.parent_span_id)
        })
        .collect();
    for root in roots {
        print_span(root, &children, 0);
    }
}

fn print_span(
    span: &SpanData,
    children: &HashMap<opentelemetry::trace::SpanId, Vec<&SpanData>>,
    depth: usize,
) {
    let took = span
        .end_time
        .duration_since(span.start_time)
        .unwrap_or_default();
    let indent = "    ".repeat(depth);
    println!("{indent}{} ({:.1} ms)", span.name, took.as_secs_f64() * 1e3);
    let mut attributes: Vec<_> = span
        .attributes
        .iter()
        .filter(|kv| !HIDDEN.contains(&kv.key.as_str()))
        .map(|kv| (kv.key.as_str(), shown(&kv.value)))
        .collect();
    attributes.sort();
    for (key, value) in attributes {
        println!("{indent}    {key} = {value}");
    }
    for event in span.events.iter() {
        println!("{indent}    event: {}", event.name);
    }
    for child in children
        .get(&span.span_context.span_id())
        .into_iter()
        .flatten()
    {
        print_span(child, children, depth + 1);
    }
}

/// What `tracing-opentelemetry` adds to every span; left out of the tree.
const HIDDEN: [&str; 9] = [
    "busy_ns",
    "idle_ns",
    "target",
    "code.file.path",
    "code.line.number",
    "code.module.name",
    "code.namespace",
    "thread.id",
    "thread.name",
];

fn shown(value: &Value) -> String {
    match value {
        Value::String(s) => format!("{:?}", s.as_str()),
        other => other.to_string(),
    }
}
