//! The [`Key`] type: an idempotency key's text. Below everything else, so that errors
//! can name the key they are about; how a key is derived is in [`crate::key`].

use std::fmt;
use std::sync::Arc;

/// An idempotency key: `<tool label>.<64 hex digits>`, printable ASCII.
///
/// Cheap to clone. Its text can be forwarded downstream (an `Idempotency-Key` header,
/// an email provider's dedup id): see [`current_key`](crate::current_key).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key(Arc<str>);

impl Key {
    /// Wraps a key read back from a store or chosen by hand.
    pub fn from_text(text: impl Into<Arc<str>>) -> Key {
        Key(text.into())
    }

    /// The key's text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The tool label: the text before the last `.` (the tool's name, shortened to its
    /// last 64 characters, with characters other than ASCII letters, digits, `_` and
    /// `-` replaced by `_`); `None` for a text with no `.`.
    pub fn label(&self) -> Option<&str> {
        self.0.rsplit_once('.').map(|(label, _)| label)
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({})", self.0)
    }
}

impl AsRef<str> for Key {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl PartialEq<str> for Key {
    fn eq(&self, other: &str) -> bool {
        &*self.0 == other
    }
}

impl PartialEq<&str> for Key {
    fn eq(&self, other: &&str) -> bool {
        &*self.0 == *other
    }
}
