//! Crashes, for real: a child process (this test binary, re-invoked) claims or completes
//! a key in a sled store and is killed with SIGKILL; a new process takes it from there.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering::SeqCst;
use std::time::{Duration, Instant};

use idem_core::__private::{execute, Call, ReleaseErrors};
use idem_core::{Error, Options, Run, SledStore};

const ROLE: &str = "IDEM_TEST_CRASH_ROLE";
const DIR: &str = "IDEM_TEST_CRASH_DIR";
const RUN: &str = "IDEM_TEST_CRASH_RUN";
const LEASE: Duration = Duration::from_millis(800);

fn options() -> Options {
    Options::new().lease(LEASE)
}

fn call(run: &Run, options: Options) -> Result<Call, Error> {
    Call::new(Some(run), "charge_card", options, &("card-1", 4200))
}

/// The child's side. Not a test on its own: the tests below start it in a process they
/// then kill. Without the role variable it returns at once.
#[test]
#[ignore = "child process of the crash tests; started by them"]
fn crash_child() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let dir = PathBuf::from(std::env::var(DIR).unwrap());
    let store_dir = match role.as_str() {
        "default-store" => "unused",
        _ => "store",
    };
    let store = SledStore::open(dir.join(store_dir)).unwrap();
    let run = Run::new(std::env::var(RUN).unwrap()).with_store(store);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        match role.as_str() {
            // Claim, start the side effect, and hang until killed.
            "hang" => {
                let _ = execute::<Result<String, Error>, ReleaseErrors, _>(
                    call(&run, options()),
                    async {
                        std::fs::write(dir.join("marker"), "claimed").unwrap();
                        std::future::pending::<()>().await;
                        Ok(String::new())
                    },
                )
                .await;
            }
            // Complete, say so, and wait to be killed.
            "complete" => {
                let v = execute::<Result<String, Error>, ReleaseErrors, _>(
                    call(&run, options()),
                    async { Ok("ch_from_the_child".to_string()) },
                )
                .await
                .unwrap()
                .unwrap();
                std::fs::write(dir.join("marker"), v).unwrap();
                std::future::pending::<()>().await;
            }
            // Complete a call on the default store (`IDEM_DIR`), then exit normally.
            "default-store" => {
                drop(run);
                let run = Run::new(std::env::var(RUN).unwrap());
                let v = execute::<Result<String, Error>, ReleaseErrors, _>(
                    call(&run, options()),
                    async { Ok("on_the_default_store".to_string()) },
                )
                .await
                .unwrap()
                .unwrap();
                std::fs::write(dir.join("marker"), v).unwrap();
                std::future::pending::<()>().await;
            }
            // Hold the store open.
            "hold" => {
                std::fs::write(dir.join("marker"), "open").unwrap();
                std::future::pending::<()>().await;
            }
            other => panic!("unknown role {other}"),
        }
    });
}

fn spawn_child(role: &str, dir: &Path, run_id: &str) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "crash_child", "--nocapture"])
        .env(ROLE, role)
        .env(DIR, dir)
        .env(RUN, run_id)
        .env("IDEM_DIR", dir.join("store"))
        .spawn()
        .unwrap()
}

/// Waits for the child's marker file, then returns its contents.
fn wait_for_marker(dir: &Path, child: &mut Child) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(text) = std::fs::read_to_string(dir.join("marker")) {
            if !text.is_empty() {
                return text;
            }
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("child exited early: {status}");
        }
        assert!(Instant::now() < deadline, "child never wrote its marker");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// SIGKILL (std's `Child::kill` on Unix), then reap.
fn kill_9(mut child: Child) {
    child.kill().unwrap();
    child.wait().unwrap();
}

/// Runs a child in `role` until it writes its marker, kills it with SIGKILL, and
/// returns its directory, a run on its store, and what the marker said.
fn killed_child(role: &str, run_id: &str) -> (tempfile::TempDir, Run, String) {
    let dir = tempfile::tempdir().unwrap();
    let mut child = spawn_child(role, dir.path(), run_id);
    let marker = wait_for_marker(dir.path(), &mut child);
    kill_9(child);
    let store = SledStore::open(dir.path().join("store")).unwrap();
    let run = Run::new(run_id).with_store(store);
    (dir, run, marker)
}

fn runs_in_parent(
    run: &Run,
    options: Options,
    ran: &AtomicUsize,
) -> Result<Result<String, Error>, Error> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(execute::<Result<String, Error>, ReleaseErrors, _>(
        call(run, options),
        async {
            ran.fetch_add(1, SeqCst);
            Ok("ch_from_the_parent".to_string())
        },
    ))
}

#[test]
fn crashed_claim_is_rerun_after_its_lease_by_default() {
    let (_dir, run, _) = killed_child("hang", "run-rerun");
    let ran = AtomicUsize::new(0);
    let started = Instant::now();
    // The claim is still there: this call waits out the lease, takes over and runs.
    let got = runs_in_parent(&run, options(), &ran).unwrap().unwrap();
    assert_eq!(got, "ch_from_the_parent");
    assert_eq!(ran.load(SeqCst), 1);
    assert!(started.elapsed() < LEASE + Duration::from_secs(5));
    // And it is now the stored result.
    let again = runs_in_parent(&run, options(), &ran).unwrap().unwrap();
    assert_eq!(
        (again.as_str(), ran.load(SeqCst)),
        ("ch_from_the_parent", 1)
    );
}

#[test]
fn crashed_claim_is_outcome_unknown_when_at_most_once() {
    let (_dir, run, _) = killed_child("hang", "run-amo");
    let ran = AtomicUsize::new(0);
    for _ in 0..2 {
        let err = runs_in_parent(&run, options().at_most_once(), &ran).unwrap_err();
        assert!(matches!(err, Error::OutcomeUnknown { .. }), "{err}");
    }
    assert_eq!(ran.load(SeqCst), 0);
}

#[test]
fn completed_call_survives_kill_9_and_is_replayed() {
    // Killed right after the call returned: the record must already be on disk.
    let (_dir, run, childs_value) = killed_child("complete", "run-done");
    let ran = AtomicUsize::new(0);
    let got = runs_in_parent(&run, options(), &ran).unwrap().unwrap();
    assert_eq!(got, childs_value);
    assert_eq!(ran.load(SeqCst), 0);
}

#[test]
fn a_sled_directory_held_by_another_process_is_a_prompt_error_naming_it_and_the_way_out() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = spawn_child("hold", dir.path(), "run-hold");
    wait_for_marker(dir.path(), &mut child);
    let path = dir.path().join("store");
    let started = Instant::now();
    let opened = SledStore::open(&path);
    let took = started.elapsed();
    kill_9(child);
    let err = opened.unwrap_err();
    assert!(took < Duration::from_millis(500), "took {took:?}");
    assert!(matches!(err, Error::Store { store: "sled", .. }), "{err}");
    let text = err.to_string();
    let dir_name = path.canonicalize().unwrap();
    for needle in [
        &*dir_name.to_string_lossy(),
        "held by another process",
        "IDEM_DIR",
        "Postgres or Redis",
    ] {
        assert!(text.contains(needle), "{needle:?} missing from: {text}");
    }
    // The OS error stays in the source chain, for an error reporter.
    let mut causes = Vec::new();
    let mut next = std::error::Error::source(&err);
    while let Some(cause) = next {
        causes.push(cause.to_string());
        next = cause.source();
    }
    assert!(causes.iter().any(|c| c.contains("lock")), "{causes:?}");
    // Once the other process is gone, the store opens.
    SledStore::open(&path).unwrap();
}

#[test]
fn default_store_is_sled_in_idem_dir() {
    // The child calls with `Run::new(..)` and no store; `IDEM_DIR` points at `store`.
    let (_dir, run, childs_value) = killed_child("default-store", "run-default");
    let ran = AtomicUsize::new(0);
    let got = runs_in_parent(&run, options(), &ran).unwrap().unwrap();
    assert_eq!((got.as_str(), ran.load(SeqCst)), (childs_value.as_str(), 0));
}
