//! The Redis book against the in-process one: over seeded random records (with and without
//! an upstream), forgets, owner checks and pages of three owners, the Redis book (its scripts as shipped, on a throwaway
//! `redis-server`) answers as the memory book does. Paging arithmetic changed on one side
//! only (`book::window` or the page script) fails here.

use super::book::{Cursor, MemoryBook, Owner};
use super::shared::RedisBook;

#[allow(dead_code, unreachable_pub)]
#[path = "../../../../tests/support/redis_server.rs"]
mod redis_server;

/// A small seeded generator (xorshift): the same steps on every run.
struct Steps(u64);

impl Steps {
    fn next(&mut self, below: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % below as u64) as usize
    }
}

#[tokio::test]
async fn the_redis_book_answers_as_the_memory_book_does() {
    let server = redis_server::RedisServer::start();
    let redis = RedisBook::new(&server.url()).expect("a book on the throwaway redis");
    let memory = MemoryBook::new(usize::MAX);
    let owners: Vec<Owner> = (0..3)
        .map(|i| Owner::of(&format!("sk-{i}"), "team"))
        .collect();
    let mut ids: Vec<String> = vec!["msgbatch_nobody".into()];
    let mut steps = Steps(0x9e37_79b9_7f4a_7c15);
    let mut pages = 0;
    for step in 0..800 {
        let owner = &owners[steps.next(owners.len())];
        let id = ids[steps.next(ids.len())].clone();
        match steps.next(10) {
            0..=3 => {
                let id = format!("msgbatch_{step:04}");
                // Some with an upstream, some as a book without upstreams recorded them.
                let upstream = ["first", "second"].get(steps.next(3)).copied();
                memory.record(owner, &id, upstream);
                redis.record(owner, &id, upstream).await.expect("record");
                ids.push(id);
            }
            4 => {
                memory.forget(owner, &id);
                redis.forget(owner, &id).await.expect("forget");
            }
            5 => assert_eq!(
                redis.owns(owner, &id).await.expect("owns"),
                memory.owns(owner, &id),
                "step {step}: owns {id}"
            ),
            _ => {
                let cursor = match steps.next(3) {
                    0 => Cursor::First,
                    1 => Cursor::After(id),
                    _ => Cursor::Before(id),
                };
                let limit = 1 + steps.next(6);
                let expected = memory.page(owner, &cursor, limit);
                let got = redis.page(owner, &cursor, limit).await.expect("page");
                assert_eq!(got, expected, "step {step}: {cursor:?} limit {limit}");
                pages += usize::from(expected.is_some_and(|p| !p.ids.is_empty()));
            }
        }
    }
    assert!(pages > 50, "only {pages} non-empty pages compared");
}
