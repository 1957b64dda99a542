//! How a command ends (its exit code and message), and what it writes and asks.

use std::io::{BufRead, IsTerminal, Write};

use idem_core::{Error, StoreErrorKind};

/// How a command ended, as an exit code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// The reader of the output went away (`| head`): stop, quietly.
    Closed = 0,
    /// The store failed, or the output could not be written.
    Failed = 1,
    /// Bad usage: an unknown store, an invalid setting.
    Usage = 2,
    /// No such record, store or table.
    NotFound = 3,
    /// The record is not in a state the command applies to, or it was not confirmed.
    Refused = 4,
    /// Another process holds the store.
    Busy = 5,
}

/// A failure to report: its exit code and message.
pub struct Failure(pub Exit, pub String);

impl From<Error> for Failure {
    fn from(error: Error) -> Self {
        let kind = error.store_kind();
        let exit = match kind {
            Some(StoreErrorKind::Config) => Exit::Usage,
            Some(StoreErrorKind::HeldElsewhere) => Exit::Busy,
            Some(StoreErrorKind::TableMissing) => Exit::NotFound,
            _ => Exit::Failed,
        };
        let mut text = error.to_string();
        let mut source = std::error::Error::source(&error);
        while let Some(cause) = source {
            let cause_text = cause.to_string();
            if !text.contains(&cause_text) {
                text += &format!("\n  caused by: {cause_text}");
            }
            source = cause.source();
        }
        if kind == Some(StoreErrorKind::TableMissing) {
            text += "\n  The table does not exist in this database: check --table; workers \
                     create it (PostgresStore::connect runs migrate)";
        }
        Failure(exit, text)
    }
}

/// Writes `text` to stdout. A reader that went away ends the command quietly; any other
/// failure to write is one.
pub fn emit(text: &str) -> Result<(), Failure> {
    write_to(&mut std::io::stdout().lock(), text)
}

pub fn write_to(out: &mut impl Write, text: &str) -> Result<(), Failure> {
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
            Err(Failure(Exit::Closed, String::new()))
        }
        Err(e) => Err(Failure(
            Exit::Failed,
            format!("cannot write the output: {e}"),
        )),
    }
}

/// Asks `question` on the terminal unless `yes`; refuses without a terminal.
pub fn confirm(yes: bool, question: &str) -> Result<(), Failure> {
    if yes {
        return Ok(());
    }
    if !std::io::stdin().is_terminal() {
        return Err(Failure(
            Exit::Refused,
            format!("{question}\n  Not confirmed: stdin is not a terminal; pass --yes"),
        ));
    }
    eprint!("{question} [y/N] ");
    let _ = std::io::stderr().flush();
    let mut answer = String::new();
    let _ = std::io::stdin().lock().read_line(&mut answer);
    if matches!(answer.trim(), "y" | "Y" | "yes") {
        Ok(())
    } else {
        Err(Failure(
            Exit::Refused,
            "not confirmed; nothing changed".into(),
        ))
    }
}
