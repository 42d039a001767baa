//! The owner book: which key created which batch through which upstream, and each owner's
//! batches in the order they were created. The paging arithmetic ([`window`]) is a plain
//! function, shared by the in-process book here and mirrored by the Redis book's script.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::time::Instant;

/// How long the upstream keeps a batch (Anthropic: 29 days after creation); the book keeps
/// an owner as long.
pub(crate) const RETENTION: Duration = Duration::from_secs(29 * 24 * 3600);

/// Who created a batch: a key, as the tenant it stood for. Only a hash of both is kept:
/// SHA-256 over the tenant's name and the key's own SHA-256, never the key in clear.
#[derive(Clone, PartialEq, Eq, Hash)]
pub(crate) struct Owner(Arc<str>);

impl Owner {
    pub(crate) fn of(key: &str, tenant: &str) -> Owner {
        let key_sha256 = Sha256::digest(key.as_bytes());
        let mut hasher = Sha256::new();
        hasher.update((tenant.len() as u64).to_be_bytes());
        hasher.update(tenant.as_bytes());
        hasher.update(key_sha256);
        let mut hex = String::with_capacity(64);
        for byte in hasher.finalize() {
            hex.push_str(&format!("{byte:02x}"));
        }
        Owner(hex.into())
    }

    /// The hash, in hex (64 characters).
    pub(crate) fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Owner({}…)", &self.0[..12.min(self.0.len())])
    }
}

/// Where a page of the list starts, as the Messages Batches API names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Cursor {
    /// The newest batches.
    First,
    /// The batches created just before this one (older: the next page).
    After(String),
    /// The batches created just after this one (newer: the previous page).
    Before(String),
}

/// The upstream a batch was created through, by name; `None` for a batch recorded before
/// the book kept upstreams (it is the first Anthropic upstream's).
pub(crate) type Holder = Option<String>;

/// One page of an owner's batch ids, newest first, each with its holder.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PageIds {
    pub(crate) ids: Vec<(String, Holder)>,
    /// Whether there are more in the page's direction.
    pub(crate) has_more: bool,
}

/// The ranks (0 = newest) a page takes of an owner's `len` batches, and whether more lie
/// beyond it in its direction. `cursor_rank` is the rank of the cursor's batch (ignored for
/// [`Cursor::First`]).
pub(crate) fn window(
    len: usize,
    cursor: &Cursor,
    cursor_rank: usize,
    limit: usize,
) -> (Range<usize>, bool) {
    match cursor {
        Cursor::First => {
            let end = limit.min(len);
            (0..end, len > end)
        }
        Cursor::After(_) => {
            let start = (cursor_rank + 1).min(len);
            let end = start.saturating_add(limit).min(len);
            (start..end, len > end)
        }
        Cursor::Before(_) => {
            let end = cursor_rank.min(len);
            let start = end.saturating_sub(limit);
            (start..end, start > 0)
        }
    }
}

/// Batch ids kept in process at most; past it the oldest batch of the owner with the most is
/// forgotten, so one key creating batches without end pushes out its own first.
pub(crate) const MEMORY_CAPACITY: usize = 100_000;

/// One owner's batches, oldest first.
#[derive(Default)]
struct Shelf {
    /// (sequence number, id, when it was recorded), in sequence order.
    batches: Vec<(u64, Arc<str>, Instant)>,
    /// Each id's upstream, when recorded with one.
    holders: HashMap<Arc<str>, Arc<str>>,
    /// Each id's sequence number.
    seq_of: HashMap<Arc<str>, u64>,
}

impl Shelf {
    fn index_of(&self, id: &str) -> Option<usize> {
        let seq = *self.seq_of.get(id)?;
        self.batches.binary_search_by_key(&seq, |(s, _, _)| *s).ok()
    }

    fn remove_at(&mut self, index: usize) {
        let (_, id, _) = self.batches.remove(index);
        self.seq_of.remove(&id);
        self.holders.remove(&id);
    }

    fn holder(&self, id: &str) -> Holder {
        self.holders.get(id).map(|name| name.to_string())
    }

    /// Forgets what is past the retention.
    fn prune(&mut self, now: Instant) -> usize {
        let expired = self
            .batches
            .iter()
            .take_while(|(_, _, at)| now.saturating_duration_since(*at) >= RETENTION)
            .count();
        for (_, id, _) in self.batches.drain(..expired) {
            self.seq_of.remove(&id);
            self.holders.remove(&id);
        }
        expired
    }
}

#[derive(Default)]
struct Shelves {
    by_owner: HashMap<Owner, Shelf>,
    total: usize,
    next_seq: u64,
}

/// The in-process book (without `--redis`): bounded to [`MEMORY_CAPACITY`] ids; a restart
/// forgets every owner, and the batches created before it answer `404` to everyone
/// (they stay upstream until they expire).
#[derive(Default)]
pub(crate) struct MemoryBook {
    shelves: Mutex<Shelves>,
    capacity: usize,
}

impl MemoryBook {
    pub(crate) fn new(capacity: usize) -> MemoryBook {
        MemoryBook {
            shelves: Mutex::default(),
            capacity: capacity.max(1),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shelves> {
        self.shelves.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records `id` as `owner`'s, created through `upstream` (`None`: as a book without
    /// upstreams recorded it).
    pub(crate) fn record(&self, owner: &Owner, id: &str, upstream: Option<&str>) {
        let now = Instant::now();
        let mut shelves = self.lock();
        let shelves = &mut *shelves;
        let shelf = shelves.by_owner.entry(owner.clone()).or_default();
        shelves.total -= shelf.prune(now);
        if shelf.seq_of.contains_key(id) {
            return;
        }
        let seq = shelves.next_seq;
        shelves.next_seq += 1;
        let id: Arc<str> = id.into();
        if let Some(upstream) = upstream {
            shelf.holders.insert(id.clone(), upstream.into());
        }
        shelf.seq_of.insert(id.clone(), seq);
        shelf.batches.push((seq, id, now));
        shelves.total += 1;
        while shelves.total > self.capacity {
            let Some(fullest) = shelves
                .by_owner
                .values_mut()
                .max_by_key(|shelf| shelf.batches.len())
            else {
                break;
            };
            fullest.remove_at(0);
            shelves.total -= 1;
        }
        shelves
            .by_owner
            .retain(|_, shelf| !shelf.batches.is_empty());
    }

    /// The upstream holding `id` when `owner` owns it (within the retention), else `None`.
    pub(crate) fn owns(&self, owner: &Owner, id: &str) -> Option<Holder> {
        let now = Instant::now();
        let shelves = self.lock();
        let shelf = shelves.by_owner.get(owner)?;
        let index = shelf.index_of(id)?;
        (now.saturating_duration_since(shelf.batches[index].2) < RETENTION)
            .then(|| shelf.holder(id))
    }

    pub(crate) fn forget(&self, owner: &Owner, id: &str) {
        let mut shelves = self.lock();
        let Some(shelf) = shelves.by_owner.get_mut(owner) else {
            return;
        };
        if let Some(index) = shelf.index_of(id) {
            shelf.remove_at(index);
            let empty = shelf.batches.is_empty();
            shelves.total -= 1;
            if empty {
                shelves.by_owner.remove(owner);
            }
        }
    }

    /// A page of `owner`'s batches; `None` when the cursor is not one of them.
    pub(crate) fn page(&self, owner: &Owner, cursor: &Cursor, limit: usize) -> Option<PageIds> {
        let now = Instant::now();
        let mut shelves = self.lock();
        let shelves = &mut *shelves;
        let Some(shelf) = shelves.by_owner.get_mut(owner) else {
            return matches!(cursor, Cursor::First).then(|| PageIds {
                ids: Vec::new(),
                has_more: false,
            });
        };
        shelves.total -= shelf.prune(now);
        let len = shelf.batches.len();
        let cursor_rank = match cursor {
            Cursor::First => 0,
            Cursor::After(id) | Cursor::Before(id) => len - 1 - shelf.index_of(id)?,
        };
        let (ranks, has_more) = window(len, cursor, cursor_rank, limit);
        let ids = ranks
            .map(|rank| {
                let id = &shelf.batches[len - 1 - rank].1;
                (id.to_string(), shelf.holder(id))
            })
            .collect();
        Some(PageIds { ids, has_more })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("msgbatch_{i:03}")).collect()
    }

    fn names(page: &PageIds) -> Vec<&str> {
        page.ids.iter().map(|(id, _)| id.as_str()).collect()
    }

    fn owns(book: &MemoryBook, owner: &Owner, id: &str) -> bool {
        book.owns(owner, id).is_some()
    }

    #[tokio::test(start_paused = true)]
    async fn each_batch_keeps_the_upstream_it_was_created_through() {
        let book = MemoryBook::new(10);
        let a = Owner::of("sk-a", "a");
        book.record(&a, "msgbatch_old", None);
        book.record(&a, "msgbatch_new", Some("second"));
        assert_eq!(book.owns(&a, "msgbatch_old"), Some(None));
        assert_eq!(book.owns(&a, "msgbatch_new"), Some(Some("second".into())));
        let page = book.page(&a, &Cursor::First, 10).unwrap();
        assert_eq!(
            page.ids,
            [
                ("msgbatch_new".into(), Some("second".into())),
                ("msgbatch_old".into(), None)
            ]
        );
        book.forget(&a, "msgbatch_new");
        book.record(&a, "msgbatch_new", None);
        assert_eq!(
            book.owns(&a, "msgbatch_new"),
            Some(None),
            "forgotten with its id"
        );
    }

    #[test]
    fn the_owner_hash_keeps_neither_key_nor_tenant_and_tells_both_apart() {
        let a = Owner::of("sk-1", "team-a");
        assert_eq!(a, Owner::of("sk-1", "team-a"));
        assert_ne!(a, Owner::of("sk-2", "team-a"));
        assert_ne!(a, Owner::of("sk-1", "team-b"));
        // The length prefix: ("ab", "c...") and ("a", "bc...") are not one owner.
        assert_ne!(Owner::of("k", "ab"), Owner::of("k", "a"));
        assert_eq!(a.as_str().len(), 64);
        assert!(!a.as_str().contains("sk-1") && !a.as_str().contains("team-a"));
    }

    #[test]
    fn pages_walk_every_batch_once_each_way() {
        let (len, limit) = (7, 3);
        let mut seen = Vec::new();
        let (mut ranks, mut more) = window(len, &Cursor::First, 0, limit);
        loop {
            seen.extend(ranks.clone());
            if !more {
                break;
            }
            let last = ranks.end - 1;
            (ranks, more) = window(len, &Cursor::After(String::new()), last, limit);
        }
        assert_eq!(seen, (0..7).collect::<Vec<_>>());
        // Back from the oldest.
        let (ranks, more) = window(len, &Cursor::Before(String::new()), 6, limit);
        assert_eq!((ranks, more), (3..6, true));
        let (ranks, more) = window(len, &Cursor::Before(String::new()), 3, limit);
        assert_eq!((ranks, more), (0..3, false));
        let (ranks, more) = window(len, &Cursor::Before(String::new()), 0, limit);
        assert_eq!((ranks, more), (0..0, false));
        let (ranks, more) = window(len, &Cursor::After(String::new()), 6, limit);
        assert_eq!((ranks, more), (7..7, false));
        assert_eq!(window(0, &Cursor::First, 0, 20), (0..0, false));
        assert_eq!(window(3, &Cursor::First, 0, 3), (0..3, false));
    }

    #[tokio::test(start_paused = true)]
    async fn an_owner_pages_its_own_batches_newest_first_and_no_one_elses() {
        let book = MemoryBook::new(1_000);
        let (a, b) = (Owner::of("sk-a", "a"), Owner::of("sk-b", "b"));
        for (i, id) in ids(10).iter().enumerate() {
            book.record(if i % 2 == 0 { &a } else { &b }, id, None);
        }
        let first = book.page(&a, &Cursor::First, 2).unwrap();
        assert_eq!(names(&first), ["msgbatch_008", "msgbatch_006"]);
        assert!(first.has_more);
        let next = book
            .page(&a, &Cursor::After("msgbatch_006".into()), 2)
            .unwrap();
        assert_eq!(names(&next), ["msgbatch_004", "msgbatch_002"]);
        assert!(next.has_more);
        let last = book
            .page(&a, &Cursor::After("msgbatch_002".into()), 2)
            .unwrap();
        assert_eq!((names(&last), last.has_more), (vec!["msgbatch_000"], false));
        let back = book
            .page(&a, &Cursor::Before("msgbatch_004".into()), 5)
            .unwrap();
        assert_eq!((back.ids.len(), back.has_more), (2, false));
        // Another owner's id is no cursor of a's, and a does not own it.
        assert_eq!(
            book.page(&a, &Cursor::After("msgbatch_001".into()), 2),
            None
        );
        assert!(owns(&book, &a, "msgbatch_000") && !owns(&book, &a, "msgbatch_001"));
        assert!(owns(&book, &b, "msgbatch_001") && !owns(&book, &b, "msgbatch_000"));
        book.forget(&a, "msgbatch_000");
        assert!(!owns(&book, &a, "msgbatch_000"));
        assert_eq!(book.page(&a, &Cursor::First, 100).unwrap().ids.len(), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn owners_are_forgotten_after_the_retention_and_the_fullest_owner_pays_for_the_bound() {
        let book = MemoryBook::new(4);
        let (a, hog) = (Owner::of("sk-a", "a"), Owner::of("sk-hog", "hog"));
        book.record(&a, "msgbatch_a", None);
        for id in ids(5) {
            book.record(&hog, &id, None);
        }
        assert!(
            owns(&book, &a, "msgbatch_a"),
            "the hog's own oldest go first"
        );
        assert!(!owns(&book, &hog, "msgbatch_000") && !owns(&book, &hog, "msgbatch_001"));
        assert!(owns(&book, &hog, "msgbatch_004"));
        tokio::time::advance(RETENTION).await;
        assert!(!owns(&book, &a, "msgbatch_a"));
        assert_eq!(book.page(&hog, &Cursor::First, 10).unwrap().ids.len(), 0);
    }
}
