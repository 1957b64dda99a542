//! A rig tool (rig-core 0.44) made idempotent with one attribute on `Tool::call`,
//! dispatched the way a rig driver dispatches a model's tool call: no LLM, no network.
//!
//! ```text
//! cargo run --example rig_tool
//! ```
//!
//! The tools are in `tools.rs` beside this file, and their tests in `tests.rs`
//! (`cargo test --example rig_tool`):
//!
//! ```ignore
//! impl Tool for SendEmail {
//!     const NAME: &'static str = "send_email";
//!     // ..
//!     #[idempotent(name = Self::NAME, run = ctx.scope::<Run>(), skip = [ctx])]
//!     async fn call(&self, ctx: &mut ToolContext, args: Email) -> Result<Receipt, MailError> { .. }
//! }
//! ```
//!
//! The host puts the agent's `Run` into the dispatch's scopes; the `ToolContext` is
//! never part of the key; `NAME` keeps two tools with identical arguments apart.

#[cfg(test)]
mod tests;
mod tools;

use idem::Run;
use tools::{DraftEmail, Mailbox, SendEmail, ToolSet};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mailbox = Mailbox::default();
    let tools = ToolSet::default()
        .with(SendEmail {
            mailbox: mailbox.clone(),
        })
        .with(DraftEmail {
            mailbox: mailbox.clone(),
        });

    // One agent run, on idem's default store ($IDEM_DIR, else ./.idem). A fresh id per
    // process here, so the demo sends once every time it is run.
    let run = Run::new(format!("rig-demo-{}", std::process::id()));
    let args = r#"{"to":"ada@example.com","subject":"Invoice","body":"Attached."}"#;

    let first = tools.call(Some(&run), "send_email", args).await;
    // The model timed out and the agent asked again, with the same arguments.
    let retry = tools.call(Some(&run), "send_email", args).await;
    let draft = tools.call(Some(&run), "draft_email", args).await;

    println!("first call:  {}", first.output().render());
    println!("retry:       {}", retry.output().render());
    println!("draft_email: {}", draft.output().render());
    println!(
        "emails sent: {}, drafts saved: {}",
        mailbox.count("sent"),
        mailbox.count("drafted")
    );
    Ok(())
}
