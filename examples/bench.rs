//! The overhead table: what an idempotent call costs next to calling the tool directly
//! and next to the floor of what any implementation must do.
//!
//! ```text
//! cargo run --release --example bench
//! IDEM_REDIS_URL=redis://127.0.0.1:6379 IDEM_POSTGRES_URL=postgres://root@127.0.0.1/test \
//!     cargo run --release --features postgres,redis --example bench
//! ```
//!
//! Every figure is the median of 15 batches, measured in this one run, so the ratios
//! compare like with like on a noisy machine. The input is a 513-byte email and the
//! result a 114-byte message id, as JSON.

use std::collections::HashMap;
use std::future::Future;
use std::time::{Duration, Instant};

use idem::{idempotent, Error, MemoryStore, Run, SledStore};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct SendEmail {
    to: String,
    cc: Vec<String>,
    subject: String,
    body: String,
    tags: HashMap<String, String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct MessageId {
    id: String,
    provider: String,
    accepted_at: u64,
    queue: String,
}

fn email(n: u64) -> SendEmail {
    let mut tags = HashMap::new();
    tags.insert("campaign".to_string(), "winter-sale".to_string());
    tags.insert("n".to_string(), n.to_string());
    SendEmail {
        to: "ada.lovelace@example.com".into(),
        cc: vec!["charles.babbage@example.com".into()],
        subject: "Your order #4711 has shipped".into(),
        body: "Hello Ada, your order is on its way. ".repeat(9),
        tags,
    }
}

fn message_id() -> MessageId {
    MessageId {
        id: "msg_01HZX3V6Q8R1N4KJ7T2W9Y5B0C".into(),
        provider: "mailer-eu-west-1".into(),
        accepted_at: 1_764_681_600_000,
        queue: "transactional".into(),
    }
}

/// The tool body: cheap, so the table shows idem's own cost.
fn send(_input: &SendEmail) -> MessageId {
    message_id()
}

#[idempotent(name = "send_email")]
async fn send_email(run: &Run, input: &SendEmail) -> Result<MessageId, Error> {
    Ok(send(input))
}

/// Median time per operation over `batches` batches of `n` operations.
fn median_per_op(batches: usize, n: usize, mut batch: impl FnMut(usize) -> Duration) -> Duration {
    let mut times: Vec<Duration> = (0..batches).map(|b| batch(b) / n as u32).collect();
    times.sort();
    times[times.len() / 2]
}

fn time<F: FnOnce()>(f: F) -> Duration {
    let t = Instant::now();
    f();
    t.elapsed()
}

async fn time_async<F: Future>(f: F) -> Duration {
    let t = Instant::now();
    f.await;
    t.elapsed()
}

/// The hand-written floor of key derivation: JSON, SHA-256, hex.
fn floor_key(input: &SendEmail) -> String {
    let json = serde_json::to_vec(input).unwrap();
    let digest = Sha256::digest(&json);
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

struct Row {
    what: String,
    value: Duration,
    floor: Option<(String, Duration)>,
}

fn fmt(d: Duration) -> String {
    let ns = d.as_nanos();
    if ns < 10_000 {
        format!("{:.2} µs", ns as f64 / 1000.0)
    } else if ns < 10_000_000 {
        format!("{:.1} µs", ns as f64 / 1000.0)
    } else {
        format!("{:.2} ms", ns as f64 / 1e6)
    }
}

const BATCHES: usize = 15;

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut rows = Vec::new();
    let input = email(0);
    println!(
        "input {} bytes, result {} bytes (JSON)",
        serde_json::to_vec(&input).unwrap().len(),
        serde_json::to_vec(&message_id()).unwrap().len()
    );

    // Direct call and key derivation.
    let n = 20_000;
    let direct = median_per_op(BATCHES, n, |_| {
        time(|| {
            for _ in 0..n {
                std::hint::black_box(send(std::hint::black_box(&input)));
            }
        })
    });
    rows.push(Row {
        what: "direct call of the tool body".into(),
        value: direct,
        floor: None,
    });
    let floor_derive = median_per_op(BATCHES, n, |_| {
        time(|| {
            for _ in 0..n {
                std::hint::black_box(floor_key(&input));
            }
        })
    });
    let run = Run::new("bench").with_store(MemoryStore::new());
    let derive = median_per_op(BATCHES, n, |_| {
        time(|| {
            for _ in 0..n {
                std::hint::black_box(
                    idem::Call::new(Some(&run), "send_email", idem::Options::new(), &[&input])
                        .unwrap(),
                );
            }
        })
    });
    rows.push(Row {
        what: "key derivation (canonical JSON + SHA-256 + key)".into(),
        value: derive,
        floor: Some(("serde_json + SHA-256 + hex".into(), floor_derive)),
    });

    // Memory: hit.
    rt.block_on(async {
        let run = Run::new("bench-mem").with_store(MemoryStore::new());
        send_email(&run, &input).await.unwrap();
        let mut map: HashMap<String, Vec<u8>> = HashMap::new();
        map.insert(
            floor_key(&input),
            serde_json::to_vec(&message_id()).unwrap(),
        );
        let floor = median_per_op(BATCHES, n, |_| {
            time(|| {
                for _ in 0..n {
                    let bytes = map.get(&floor_key(&input)).unwrap();
                    std::hint::black_box(serde_json::from_slice::<MessageId>(bytes).unwrap());
                }
            })
        });
        let mut hit = Vec::new();
        for _ in 0..BATCHES {
            hit.push(
                time_async(async {
                    for _ in 0..n {
                        std::hint::black_box(send_email(&run, &input).await.unwrap());
                    }
                })
                .await
                    / n as u32,
            );
        }
        hit.sort();
        rows.push(Row {
            what: "memory: hit".into(),
            value: hit[BATCHES / 2],
            floor: Some(("key + map lookup + decode".into(), floor)),
        });
    });

    // Sled: hit and miss.
    let dir = tempfile::tempdir().unwrap();
    let sled = SledStore::open(dir.path().join("idem")).unwrap();
    let raw = sled::open(dir.path().join("floor")).unwrap();
    rt.block_on(async {
        let run = Run::new("bench-sled").with_store(sled.clone());
        send_email(&run, &input).await.unwrap();
        raw.insert(
            floor_key(&input),
            serde_json::to_vec(&message_id()).unwrap(),
        )
        .unwrap();
        let floor = median_per_op(BATCHES, n, |_| {
            time(|| {
                for _ in 0..n {
                    let bytes = raw.get(floor_key(&input)).unwrap().unwrap();
                    std::hint::black_box(serde_json::from_slice::<MessageId>(&bytes).unwrap());
                }
            })
        });
        let mut hit = Vec::new();
        for _ in 0..BATCHES {
            hit.push(
                time_async(async {
                    for _ in 0..n {
                        std::hint::black_box(send_email(&run, &input).await.unwrap());
                    }
                })
                .await
                    / n as u32,
            );
        }
        hit.sort();
        rows.push(Row {
            what: "sled: hit".into(),
            value: hit[BATCHES / 2],
            floor: Some(("key + sled get + decode".into(), floor)),
        });

        let m = 40;
        let mut next = 1_000_000u64;
        let floor = median_per_op(BATCHES, m, |_| {
            time(|| {
                for _ in 0..m {
                    next += 1;
                    raw.insert(next.to_be_bytes(), &b"claim"[..]).unwrap();
                    raw.flush().unwrap();
                    raw.insert(next.to_be_bytes(), &b"result"[..]).unwrap();
                    raw.flush().unwrap();
                }
            })
        });
        let mut miss = Vec::new();
        for _ in 0..BATCHES {
            let t = Instant::now();
            for _ in 0..m {
                next += 1;
                send_email(&run, &email(next)).await.unwrap();
            }
            miss.push(t.elapsed() / m as u32);
        }
        miss.sort();
        let serial = miss[BATCHES / 2];
        rows.push(Row {
            what: "sled: miss, durable, serial".into(),
            value: serial,
            floor: Some(("two sled insert + flush".into(), floor)),
        });

        // 64 concurrent misses on distinct keys.
        let per_task = 10;
        let started = Instant::now();
        let tasks: Vec<_> = (0..64u64)
            .map(|t| {
                let run = run.clone();
                tokio::spawn(async move {
                    for i in 0..per_task {
                        send_email(&run, &email(10_000_000 + t * 1000 + i))
                            .await
                            .unwrap();
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        let per_call = started.elapsed() / (64 * per_task) as u32;
        rows.push(Row {
            what: "sled: miss, durable, 64 concurrent (time per call)".into(),
            value: per_call,
            floor: Some(("the serial miss above".into(), serial)),
        });
    });

    println!();
    println!(
        "{:<52} {:>10}   {:<30} {:>10} {:>7}",
        "operation", "median", "floor", "median", "ratio"
    );
    for row in &rows {
        match &row.floor {
            Some((what, floor)) => println!(
                "{:<52} {:>10}   {:<30} {:>10} {:>6.2}x",
                row.what,
                fmt(row.value),
                what,
                fmt(*floor),
                row.value.as_secs_f64() / floor.as_secs_f64()
            ),
            None => println!("{:<52} {:>10}", row.what, fmt(row.value)),
        }
    }
}
