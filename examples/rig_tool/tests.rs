//! idem inside rig tools (rig-core 0.44): `#[idempotent]` on `Tool::call`, dispatched
//! through rig's erased tool boundary with raw JSON arguments, no LLM, no network.

use super::tools::{DraftEmail, MailError, Mailbox, Receipt, SendEmail, ToolSet};
use idem::{MemoryStore, Run};
use rig_core::tool::{Tool, ToolContext, ToolResult};

const ARGS: &str = r#"{"to":"ada@example.com","subject":"Invoice","body":"Attached."}"#;

fn tools(mailbox: &Mailbox) -> ToolSet {
    ToolSet::default()
        .with(SendEmail {
            mailbox: mailbox.clone(),
        })
        .with(DraftEmail {
            mailbox: mailbox.clone(),
        })
}

fn receipt(result: &ToolResult) -> Receipt {
    assert!(result.is_success(), "tool failed: {result:?}");
    let json = result.output().as_json().expect("a JSON output").clone();
    serde_json::from_value(json).expect("a receipt")
}

fn run(id: &str) -> Run {
    Run::new(id).with_store(MemoryStore::new())
}

#[tokio::test]
async fn same_arguments_twice_in_one_run_send_once() {
    let mailbox = Mailbox::default();
    let tools = tools(&mailbox);
    let run = run("run-1");

    let first = tools.call(Some(&run), "send_email", ARGS).await;
    let retry = tools.call(Some(&run), "send_email", ARGS).await;
    assert_eq!(mailbox.count("sent"), 1, "the retry must not send again");
    assert_eq!(receipt(&first), receipt(&retry));

    // Whitespace and key order in the model's JSON do not change the call.
    let reordered = r#"{ "body": "Attached.", "subject": "Invoice", "to": "ada@example.com" }"#;
    let again = tools.call(Some(&run), "send_email", reordered).await;
    assert_eq!(receipt(&again), receipt(&first));
    assert_eq!(mailbox.count("sent"), 1);
}

#[tokio::test]
async fn another_run_sends_again() {
    let mailbox = Mailbox::default();
    let tools = tools(&mailbox);
    let store = MemoryStore::new();
    let one = Run::new("run-1").with_store(store.clone());
    let two = Run::new("run-2").with_store(store);

    let first = tools.call(Some(&one), "send_email", ARGS).await;
    let second = tools.call(Some(&two), "send_email", ARGS).await;
    assert_eq!(mailbox.count("sent"), 2);
    assert_ne!(receipt(&first).id, receipt(&second).id);
}

#[tokio::test]
async fn tools_with_identically_serialized_arguments_never_share_a_key() {
    let mailbox = Mailbox::default();
    let tools = tools(&mailbox);
    let run = run("run-1");

    let sent = tools.call(Some(&run), "send_email", ARGS).await;
    let drafted = tools.call(Some(&run), "draft_email", ARGS).await;
    assert_eq!(mailbox.count("sent"), 1);
    assert_eq!(mailbox.count("drafted"), 1, "draft_email ran its own body");
    assert_ne!(receipt(&sent), receipt(&drafted));

    // Each is still idempotent on its own.
    tools.call(Some(&run), "draft_email", ARGS).await;
    assert_eq!(mailbox.count("drafted"), 1);
}

#[tokio::test]
async fn the_tool_context_is_not_part_of_the_key() {
    // Direct calls, each with a different context: one side effect.
    let mailbox = Mailbox::default();
    let tool = SendEmail {
        mailbox: mailbox.clone(),
    };
    let run = std::sync::Arc::new(run("run-ctx"));
    let args: super::tools::Email = serde_json::from_str(ARGS).unwrap();
    let mut first = ToolContext::default().with_scope(run.clone());
    let mut second = ToolContext::default()
        .with_scope(run.clone())
        .with_scope(std::sync::Arc::new("unrelated scope".to_string()));
    let a = tool.call(&mut first, args.clone()).await.unwrap();
    let b = tool.call(&mut second, args).await.unwrap();
    assert_eq!(a, b);
    assert_eq!(mailbox.count("sent"), 1);
}

#[tokio::test]
async fn the_ambient_run_is_used_when_the_dispatch_carries_none() {
    let mailbox = Mailbox::default();
    let tools = tools(&mailbox);
    let run = run("run-ambient");
    run.scope(async {
        tools.call(None, "send_email", ARGS).await;
        tools.call(None, "send_email", ARGS).await;
    })
    .await;
    assert_eq!(mailbox.count("sent"), 1);
}

#[tokio::test]
async fn without_any_run_the_call_fails_and_sends_nothing() {
    let mailbox = Mailbox::default();
    let tools = tools(&mailbox);
    let result = tools.call(None, "send_email", ARGS).await;
    let error = result.error().expect("the call failed");
    assert!(
        matches!(
            error.downcast_ref::<MailError>(),
            Some(MailError::Idem(idem::Error::NoRun { .. }))
        ),
        "a typed NoRun error: {error:?}"
    );
    assert_eq!(mailbox.count("sent"), 0);
}
