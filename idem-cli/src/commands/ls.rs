//! `idem ls`: the records a filter matches, a page at a time.

use idem_core::store::Filter;
use idem_core::Store;

use crate::failure::{write_to, Failure};
use crate::output::{self, Output};

/// Streams the listing, a page at a time.
pub async fn run(
    store: &dyn Store,
    filter: &Filter,
    limit: Option<u64>,
    out: &Output,
) -> Result<(), Failure> {
    let (mut after, mut shown) = (None, 0u64);
    let mut stdout = std::io::stdout().lock();
    let mut header = Some(out.list_header());
    loop {
        let page = store.list(filter, after.as_ref(), 1_000).await?;
        for unreadable in &page.unreadable {
            let key = output::clean(unreadable.key.as_str());
            eprintln!(
                "warning: `{key}` holds a value this build cannot read ({}); \
                 `idem evict {key} --yes` removes it",
                output::clean(&unreadable.error.to_string())
            );
        }
        // The header once the store answered, so a failure is not preceded by it.
        let mut text = header.take().unwrap_or_default();
        for listed in &page.records {
            if limit.is_some_and(|limit| shown >= limit) {
                break;
            }
            text += &out.list_row(&listed.key, &listed.record, page.now);
            shown += 1;
        }
        write_to(&mut stdout, &text)?;
        match page.next {
            Some(next) if limit.is_none_or(|limit| shown < limit) => after = Some(next),
            _ => return Ok(()),
        }
    }
}
