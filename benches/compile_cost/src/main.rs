//! What `#[idempotent]` costs a crate's build:
//!
//! ```sh
//! cargo run --release --manifest-path benches/compile_cost/Cargo.toml -- --tools 100 --rounds 5
//! ```
//!
//! (those are the defaults; `--idem DIR` measures the idem checkout in `DIR` instead of
//! this one; `--debug` times debug builds instead of release ones).
//!
//! Generates four crates of the same `--tools` async tools under
//! `target/compile-cost/`, each tool with its own input and output structs and called
//! once in one run, and builds each in release:
//!
//! - `plain`: the tools with no attribute;
//! - `floor`: each tool serializes its input and round-trips its output through
//!   serde_json by hand, the per-type code idem cannot avoid;
//! - `idem`: each tool is `#[idempotent(ttl = "24h")]`, run on a `MemoryStore`;
//! - `idem-one`: `plain` with its first tool idempotent, which tells what idem's
//!   runtime adds once from what each tool adds.
//!
//! The crates share one target directory, so their dependencies (idem among them) are
//! built once, first. Then, `--rounds` times and crate after crate, `src/main.rs` is
//! touched and `cargo build --release` timed: the rebuild of the tools alone. It prints
//! the median and range of those rebuilds, the release binary's size, and its size over
//! `plain` per tool. Run it on a quiet machine: the rebuilds use every core.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, PartialEq)]
enum Variant {
    Plain,
    Floor,
    Idem,
    /// `plain` with its first tool idempotent: what idem's runtime adds to a binary
    /// once, whatever the number of tools.
    IdemOne,
}

impl Variant {
    const ALL: [Variant; 4] = [
        Variant::Plain,
        Variant::Floor,
        Variant::Idem,
        Variant::IdemOne,
    ];

    fn name(self) -> &'static str {
        match self {
            Variant::Plain => "plain",
            Variant::Floor => "floor",
            Variant::Idem => "idem",
            Variant::IdemOne => "idem-one",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Variant::Plain => "plain, no attribute",
            Variant::Floor => "serde_json by hand (the floor)",
            Variant::Idem => "#[idempotent(ttl = \"24h\")]",
            Variant::IdemOne => "plain, one tool #[idempotent]",
        }
    }
}

fn main() {
    let (mut tools, mut rounds, mut debug) = (100usize, 5usize, false);
    let mut idem_dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .and_then(Path::parent)
        .expect("benches/compile_cost lies two levels below idem's root")
        .to_path_buf();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut number = |name: &str| -> usize {
            args.next()
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("{name} takes a number"))
        };
        match arg.as_str() {
            "--tools" => tools = number("--tools"),
            "--rounds" => rounds = number("--rounds"),
            "--idem" => idem_dir = args.next().expect("--idem takes a directory").into(),
            "--debug" => debug = true,
            other => panic!(
                "unknown argument {other}; expected --tools N, --rounds N, --idem DIR, --debug"
            ),
        }
    }
    let idem_dir = idem_dir.as_path();
    let root = idem_dir.join("target").join("compile-cost");
    let target = root.join("target");
    let profile = if debug {
        Profile::Debug
    } else {
        Profile::Release
    };
    for variant in Variant::ALL {
        write_crate(&root.join(variant.name()), variant, tools, idem_dir);
    }
    eprintln!("building the dependencies once");
    for variant in Variant::ALL {
        build(&root.join(variant.name()), &target, profile);
    }
    let mut times: Vec<Vec<Duration>> = vec![Vec::new(); Variant::ALL.len()];
    for round in 1..=rounds {
        eprintln!("round {round} of {rounds}");
        for (i, variant) in Variant::ALL.into_iter().enumerate() {
            let dir = root.join(variant.name());
            touch(&dir.join("src").join("main.rs"));
            times[i].push(build(&dir, &target, profile));
        }
    }
    let sizes: Vec<u64> = Variant::ALL
        .iter()
        .map(|v| {
            let binary = target
                .join(profile.name())
                .join(format!("tools-{}", v.name()));
            std::fs::metadata(&binary)
                .unwrap_or_else(|e| panic!("{}: {e}", binary.display()))
                .len()
        })
        .collect();
    let name = profile.name();
    println!("{tools} tools, {rounds} {name} rebuilds each (touch src/main.rs)\n");
    println!(
        "{:<34} {:>15} {:>13} {:>14} {:>13}",
        "the tools",
        "rebuild median",
        "range",
        format!("{name} binary"),
        "per tool"
    );
    let floor_median = median(&times[1]);
    for (i, variant) in Variant::ALL.into_iter().enumerate() {
        let (min, max) = (
            times[i].iter().min().unwrap(),
            times[i].iter().max().unwrap(),
        );
        let per_tool = match variant {
            Variant::Plain | Variant::IdemOne => String::new(),
            _ => format!(
                "{:.1} KB",
                (sizes[i] as f64 - sizes[0] as f64) / tools as f64 / 1000.0
            ),
        };
        println!(
            "{:<34} {:>13.2} s {:>5.2}–{:.2} s {:>11.2} MB {:>13}",
            variant.label(),
            median(&times[i]).as_secs_f64(),
            min.as_secs_f64(),
            max.as_secs_f64(),
            sizes[i] as f64 / 1e6,
            per_tool,
        );
    }
    println!(
        "\nidem's rebuild over the floor's: {:.2}x",
        median(&times[2]).as_secs_f64() / floor_median.as_secs_f64()
    );
    // Per tool, past what idem's runtime adds once (`idem-one` over `plain`).
    println!(
        "idem's binary per tool, over one idempotent tool: {:.1} KB (the floor's over plain: {:.1} KB; idem's runtime, once: {:.2} MB)",
        (sizes[2] as f64 - sizes[3] as f64) / (tools as f64 - 1.0) / 1000.0,
        (sizes[1] as f64 - sizes[0] as f64) / tools as f64 / 1000.0,
        (sizes[3] as f64 - sizes[0] as f64) / 1e6,
    );
}

fn median(times: &[Duration]) -> Duration {
    let mut sorted = times.to_vec();
    sorted.sort();
    sorted[sorted.len() / 2]
}

fn touch(file: &Path) {
    let text = std::fs::read(file).expect("read main.rs");
    std::fs::write(file, text).expect("touch main.rs");
}

/// Which build is timed.
#[derive(Clone, Copy)]
enum Profile {
    Release,
    Debug,
}

impl Profile {
    /// Its name, which is also where cargo puts its binaries.
    fn name(self) -> &'static str {
        match self {
            Profile::Release => "release",
            Profile::Debug => "debug",
        }
    }
}

fn build(dir: &Path, target: &Path, profile: Profile) -> Duration {
    let started = Instant::now();
    let mut args = vec!["build", "--quiet"];
    if let Profile::Release = profile {
        args.push("--release");
    }
    let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(args)
        .current_dir(dir)
        .env("CARGO_TARGET_DIR", target)
        .status()
        .expect("run cargo");
    assert!(status.success(), "cargo build failed in {}", dir.display());
    started.elapsed()
}

fn write_crate(dir: &Path, variant: Variant, tools: usize, idem_dir: &Path) {
    std::fs::create_dir_all(dir.join("src")).expect("create the crate's directory");
    let manifest = format!(
        r#"[package]
name = "tools-{name}"
version = "0.0.0"
edition = "2021"
publish = false

[workspace]

[dependencies]
idem = {{ path = {idem:?} }}
serde = {{ version = "1", features = ["derive"] }}
serde_json = "1"
tokio = {{ version = "1", features = ["rt", "macros"] }}
"#,
        name = variant.name(),
        idem = idem_dir.display().to_string(),
    );
    write_if_changed(&dir.join("Cargo.toml"), &manifest);
    // The lock file of idem's own workspace, so the same versions build.
    let lock = std::fs::read(idem_dir.join("Cargo.lock")).expect("read Cargo.lock");
    if !dir.join("Cargo.lock").exists() {
        std::fs::write(dir.join("Cargo.lock"), lock).expect("write Cargo.lock");
    }
    write_if_changed(&dir.join("src").join("main.rs"), &source(variant, tools));
}

fn write_if_changed(path: &PathBuf, text: &str) {
    if std::fs::read_to_string(path).ok().as_deref() != Some(text) {
        std::fs::write(path, text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }
}

/// The crate's `main.rs`: `tools` tools, each with its own input and output, and a
/// `main` that calls each once.
fn source(variant: Variant, tools: usize) -> String {
    let mut s = String::from(
        "#![allow(dead_code)]\nuse serde::{Deserialize, Serialize};\n\n\
         #[derive(Debug)]\npub struct ToolError(String);\n\
         impl From<idem::Error> for ToolError {\n    \
         fn from(e: idem::Error) -> Self { ToolError(e.to_string()) }\n}\n\n",
    );
    for i in 0..tools {
        let _ = write!(
            s,
            "#[derive(Debug, Clone, Serialize, Deserialize)]\n\
             pub struct Input{i} {{ pub to: String, pub subject: String, pub count: u64 }}\n\
             #[derive(Debug, Clone, Serialize, Deserialize)]\n\
             pub struct Output{i} {{ pub id: String, pub accepted: bool }}\n\n"
        );
        match variant {
            Variant::Plain => {
                let _ = write!(
                    s,
                    "pub async fn tool_{i}(input: Input{i}) -> Result<Output{i}, ToolError> {{\n    \
                     Ok(Output{i} {{ id: format!(\"{i}-{{}}\", input.to), accepted: input.count > 0 }})\n}}\n\n"
                );
            }
            Variant::Floor => {
                let _ = write!(
                    s,
                    "pub async fn tool_{i}(input: Input{i}) -> Result<Output{i}, ToolError> {{\n    \
                     let key = serde_json::to_vec(&input).map_err(|e| ToolError(e.to_string()))?;\n    \
                     std::hint::black_box(&key);\n    \
                     let output = Output{i} {{ id: format!(\"{i}-{{}}\", input.to), accepted: input.count > 0 }};\n    \
                     let bytes = serde_json::to_vec(&output).map_err(|e| ToolError(e.to_string()))?;\n    \
                     serde_json::from_slice(std::hint::black_box(&bytes)).map_err(|e| ToolError(e.to_string()))\n}}\n\n"
                );
            }
            Variant::IdemOne if i > 0 => {
                let _ = write!(
                    s,
                    "pub async fn tool_{i}(input: Input{i}) -> Result<Output{i}, ToolError> {{\n    \
                     Ok(Output{i} {{ id: format!(\"{i}-{{}}\", input.to), accepted: input.count > 0 }})\n}}\n\n"
                );
            }
            Variant::Idem | Variant::IdemOne => {
                let _ = write!(
                    s,
                    "#[idem::idempotent(ttl = \"24h\")]\n\
                     pub async fn tool_{i}(input: Input{i}) -> Result<Output{i}, ToolError> {{\n    \
                     Ok(Output{i} {{ id: format!(\"{i}-{{}}\", input.to), accepted: input.count > 0 }})\n}}\n\n"
                );
            }
        }
    }
    s.push_str(
        "#[tokio::main(flavor = \"current_thread\")]\nasync fn main() {\n    \
         let run = idem::Run::new(\"compile-cost\").with_store(idem::MemoryStore::new());\n    \
         run.scope(async {\n",
    );
    for i in 0..tools {
        let _ = writeln!(
            s,
            "        let out = tool_{i}(Input{i} {{ to: \"ada@example.com\".into(), subject: \"hi\".into(), count: {i} }}).await.unwrap();\n        \
             assert!(out.id.starts_with(\"{i}-\"));"
        );
    }
    s.push_str("    }).await;\n}\n");
    s
}
