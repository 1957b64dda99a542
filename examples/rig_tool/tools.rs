//! rig tools (rig-core 0.44) whose `call` is idempotent, and a small tool set that
//! dispatches them the way a rig driver does. Used by the `rig_tool` example and its
//! tests.
//!
//! The pattern: `#[idempotent]` on `Tool::call`, the run taken from the dispatch's
//! scopes (`ctx.scope::<Run>()`, which a host fills with `serve_inline_with` or a
//! driver's scopes), the `ToolContext` skipped from the key, and the tool's `NAME` as
//! the tool name in the key.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use idem::{idempotent, Run};
use rig_core::effect::{EffectKind, Outcome};
use rig_core::serve::adapters::ToolAdapter;
use rig_core::serve::{serve_inline_with, ErasedHandler};
use rig_core::tool::{Tool, ToolContext, ToolExecutionError, ToolResult};
use serde::{Deserialize, Serialize};
use serde_json::json;

/// The arguments both email tools take.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Email {
    pub to: String,
    pub subject: String,
    pub body: String,
}

/// What the tools return, and what idem stores and replays.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Receipt {
    pub id: String,
    pub to: String,
}

/// The tools' error: idem's, or the mail system's.
#[derive(Debug, thiserror::Error)]
pub enum MailError {
    #[error(transparent)]
    Idem(#[from] idem::Error),
    #[error("mail system: {0}")]
    Mail(String),
}

/// Every email the tools really sent or drafted, in order.
#[derive(Debug, Clone, Default)]
pub struct Mailbox {
    entries: Arc<Mutex<Vec<(String, Email)>>>,
}

impl Mailbox {
    fn push(&self, what: &str, email: &Email) -> Result<usize, MailError> {
        let mut entries = self
            .entries
            .lock()
            .map_err(|_| MailError::Mail("mailbox poisoned".into()))?;
        entries.push((what.to_owned(), email.clone()));
        Ok(entries.len())
    }

    /// How many times `what` ("sent", "drafted") really happened.
    pub fn count(&self, what: &str) -> usize {
        self.entries
            .lock()
            .map(|e| e.iter().filter(|(w, _)| w == what).count())
            .unwrap_or(0)
    }
}

fn email_schema() -> serde_json::Value {
    json!({
        "type": "object",
        "properties": {
            "to": {"type": "string"},
            "subject": {"type": "string"},
            "body": {"type": "string"}
        },
        "required": ["to", "subject", "body"]
    })
}

/// Sends an email. Idempotent per run: the recommended shape.
pub struct SendEmail {
    pub mailbox: Mailbox,
}

impl Tool for SendEmail {
    const NAME: &'static str = "send_email";
    type Args = Email;
    type Output = Receipt;
    type Error = MailError;

    fn description(&self) -> String {
        "Send an email. Retries within one run send it once.".into()
    }

    fn parameters(&self) -> serde_json::Value {
        email_schema()
    }

    #[idempotent(name = Self::NAME, run = ctx.scope::<Run>(), skip = [ctx])]
    async fn call(&self, ctx: &mut ToolContext, args: Email) -> Result<Receipt, MailError> {
        let n = self.mailbox.push("sent", &args)?;
        Ok(Receipt {
            id: format!("sent-{n:04}"),
            to: args.to,
        })
    }
}

/// Drafts an email: its arguments serialize exactly like `SendEmail`'s. It keeps the
/// default tool name (`<type>::call`), which differs from `send_email`'s too.
pub struct DraftEmail {
    pub mailbox: Mailbox,
}

impl Tool for DraftEmail {
    const NAME: &'static str = "draft_email";
    type Args = Email;
    type Output = Receipt;
    type Error = MailError;

    fn description(&self) -> String {
        "Save an email as a draft.".into()
    }

    fn parameters(&self) -> serde_json::Value {
        email_schema()
    }

    #[idempotent(run = ctx.scope::<Run>(), skip = [ctx])]
    async fn call(&self, ctx: &mut ToolContext, args: Email) -> Result<Receipt, MailError> {
        let n = self.mailbox.push("drafted", &args)?;
        Ok(Receipt {
            id: format!("draft-{n:04}"),
            to: args.to,
        })
    }
}

/// A tool set: rig tools behind rig's erased dispatch boundary (`ToolAdapter` as an
/// `ErasedHandler`), called with the model's raw JSON arguments and the run in the
/// dispatch's scopes, as a rig driver calls them.
#[derive(Default)]
pub struct ToolSet {
    handlers: HashMap<String, ErasedHandler>,
}

impl ToolSet {
    /// Adds `tool` under its `NAME`.
    pub fn with<T: Tool + 'static>(mut self, tool: T) -> Self {
        self.handlers.insert(
            T::NAME.to_owned(),
            ErasedHandler::new(ToolAdapter::new(tool)),
        );
        self
    }

    /// Calls tool `name` with `args` (JSON text, as a model produces it) in `run`.
    pub async fn call(&self, run: Option<&Run>, name: &str, args: &str) -> ToolResult {
        let Some(handler) = self.handlers.get(name) else {
            return ToolResult::failed(ToolExecutionError::refused(format!("no tool `{name}`")));
        };
        let scopes: Vec<Arc<dyn Any + Send + Sync>> = match run {
            Some(run) => vec![Arc::new(run.clone())],
            None => Vec::new(),
        };
        let kind = EffectKind::ToolCall {
            name: name.to_owned(),
            args: args.to_owned(),
        };
        match serve_inline_with(handler, kind, scopes).await {
            Ok(Outcome::ToolResult { result }) => result,
            Ok(other) => ToolResult::failed(ToolExecutionError::refused(format!(
                "unexpected outcome {other:?}"
            ))),
            Err(report) => ToolResult::failed(ToolExecutionError::refused(report.to_string())),
        }
    }
}
