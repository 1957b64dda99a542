//! How many instructions an idempotent call costs, counted by callgrind:
//!
//! ```sh
//! cargo run --release --manifest-path benches/instructions/Cargo.toml
//! ```
//!
//! (needs `valgrind` on the `PATH`). Instruction counts do not depend on the machine's
//! load, so a change to the hot path can be priced to a fraction of a percent, where a
//! wall-clock benchmark on a shared machine cannot.
//!
//! The program runs itself under `valgrind --tool=callgrind` once per path and count:
//! 1,000 and 3,000 calls of one path on a `MemoryStore`, on a current-thread runtime,
//! after one call that fills the store. The difference of the two totals over 2,000 is
//! the cost of one call, the process's start and end cancelled out; the same for a loop
//! that builds the inputs and makes no call is subtracted. The paths:
//!
//! - `hit`: an attribute tool whose key completed, replayed;
//! - `miss, input borrowed`: an attribute tool taking `&Input` (its body cannot finish
//!   alone: the call runs it in place), on a new key each call;
//! - `miss, input owned`: an attribute tool taking `Input` (its body finishes alone if
//!   its caller stops waiting), on a new key each call;
//! - `Tool hit` and `Tool miss`: the same through the dynamic API, `idem::Tool`.
//!
//! The result is a 3-field struct that derives `PartialEq`, so the read-back check
//! compares by it.
//!
//! `--calls N` changes the smaller count (the larger is 3 N).

use std::process::Command;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Input {
    to: String,
    subject: String,
    count: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    id: String,
    accepted: bool,
    count: u64,
}

#[derive(Debug)]
struct ToolError;

impl From<idem::Error> for ToolError {
    fn from(_: idem::Error) -> Self {
        ToolError
    }
}

fn receipt(input: &Input) -> Receipt {
    Receipt {
        id: input.to.clone(),
        accepted: true,
        count: input.count,
    }
}

#[idem::idempotent(ttl = "24h")]
async fn owned(input: Input) -> Result<Receipt, ToolError> {
    Ok(receipt(&input))
}

#[idem::idempotent(ttl = "24h")]
async fn borrowed(input: &Input) -> Result<Receipt, ToolError> {
    Ok(receipt(input))
}

fn input(count: u64) -> Input {
    Input {
        to: "ada@example.com".into(),
        subject: "hello".into(),
        count,
    }
}

/// The paths measured: the argument the child takes, and the row's label.
const PATHS: [(&str, &str); 5] = [
    ("hit", "hit"),
    ("borrowed", "miss, input borrowed"),
    ("owned", "miss, input owned"),
    ("tool-hit", "Tool hit"),
    ("tool-miss", "Tool miss"),
];

/// A call of `tool`, whose body makes what `owned` makes.
async fn dynamic(tool: &idem::Tool, run: &idem::Run, count: u64) -> Result<Receipt, ToolError> {
    let input = input(count);
    tool.call(run, &input, move |_| async move {
        Ok(Receipt {
            id: "ada@example.com".into(),
            accepted: true,
            count,
        })
    })
    .await
}

/// One call of `path` (`None`: the loop alone).
async fn call(path: Option<&str>, tool: &idem::Tool, run: &idem::Run, i: u64) -> Receipt {
    let result = match path {
        Some("hit") => owned(input(u64::MAX)).await,
        Some("owned") => owned(input(i)).await,
        Some("borrowed") => borrowed(&input(i)).await,
        Some("tool-hit") => dynamic(tool, run, u64::MAX).await,
        Some("tool-miss") => dynamic(tool, run, i).await,
        _ => Ok(receipt(&input(i))),
    };
    result.unwrap_or_else(|_| panic!("the call failed"))
}

/// The child: `calls` calls of `path` after one that fills the store.
fn child(path: Option<&str>, calls: u64) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime");
    let run = idem::Run::new("run").with_store(idem::MemoryStore::new());
    let tool = idem::Tool::new("owned").ttl(std::time::Duration::from_secs(86_400));
    runtime.block_on(run.clone().scope(async move {
        call(Some("hit"), &tool, &run, u64::MAX).await;
        call(Some("tool-hit"), &tool, &run, u64::MAX).await;
        for i in 0..calls {
            std::hint::black_box(call(path, &tool, &run, i).await);
        }
    }));
}

/// The instructions callgrind counts for the child running `path` `calls` times.
fn instructions(path: &str, calls: u64) -> u64 {
    let me = std::env::current_exe().expect("this program's path");
    let output = Command::new("valgrind")
        .args(["--tool=callgrind", "--callgrind-out-file=/dev/null"])
        .arg(me)
        .args(["--child", path, &calls.to_string()])
        .output()
        .expect("run valgrind (is it installed?)");
    let text = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "valgrind failed: {text}");
    text.lines()
        .find_map(|line| line.split("Collected : ").nth(1))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no instruction count in valgrind's output: {text}"))
}

/// Instructions per call of `path`: the difference of `3 calls` and `calls` calls.
fn per_call(path: &str, calls: u64) -> f64 {
    let (few, many) = (instructions(path, calls), instructions(path, 3 * calls));
    (many as f64 - few as f64) / (2 * calls) as f64
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["--child", path, calls] => {
            let calls = calls.parse().expect("a number of calls");
            child(PATHS.iter().any(|(p, _)| *p == path).then_some(path), calls)
        }
        [] => run(1_000),
        ["--calls", calls] => run(calls.parse().expect("--calls takes a number")),
        _ => panic!("expected no argument, or --calls N"),
    }
}

fn run(calls: u64) {
    let base = per_call("loop", calls);
    println!(
        "instructions per call (callgrind; {calls} and {} calls, MemoryStore, current-thread runtime)\n",
        3 * calls
    );
    println!("{:<24} {:>12}", "path", "instructions");
    for (path, label) in PATHS {
        println!("{label:<24} {:>12.0}", per_call(path, calls) - base);
    }
    println!("\n(the loop alone, subtracted above: {base:.0})");
}
