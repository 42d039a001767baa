//! The pacing scripts against the memory store: over seeded random asks, each script, run on
//! a throwaway `redis-server` with its clock set by the test, answers as the memory store
//! does at the same moment. Arithmetic changed on one side only fails here.
//!
//! The scripts run as shipped but for their one clock read (`TIME`), replaced by a key the
//! test sets before each call; arguments and replies go through the store's own encoding.

use std::cell::RefCell;

use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestRunner};
use redis::{Connection, Script};

use super::pacing::{LEARNED_PACE_SOURCE, PACE_SOURCE, learned_args, learned_grant, pace_args};
use crate::store::pacing::{DIMS, MAX_LIMIT, PaceAsk, PaceLimit, Pacers};

#[allow(dead_code, unreachable_pub)]
#[path = "../../../tests/support/redis_server.rs"]
pub(super) mod redis_server;

/// The scripts' clock read, and what replaces it here.
const CLOCK: &str =
    "local t = redis.call('TIME')\nlocal now = tonumber(t[1]) * 1000000 + tonumber(t[2])\n";
const TEST_CLOCK: &str = "local now = tonumber(redis.call('GET', KEYS[2]))\n";

/// The script's clock starts near where Redis's `TIME` is (µs), so its doubles carry
/// today's magnitudes; the memory store's starts at 0, as it does in a process.
const EPOCH: i64 = 1_764_547_200_000_000;

fn on_test_clock(source: &str) -> Script {
    with_clock(source, CLOCK, TEST_CLOCK)
}

/// `source` as shipped but for its one clock read `read`, replaced by `test_clock` (the
/// differential tests' way to run a script at a time of their choosing).
pub(super) fn with_clock(source: &str, read: &str, test_clock: &str) -> Script {
    assert_eq!(source.matches(read).count(), 1, "one clock read to replace");
    Script::new(&source.replacen(read, test_clock, 1))
}

/// A throwaway server, a connection to it, and a fresh key prefix per case.
struct Redis {
    _server: redis_server::RedisServer,
    conn: RefCell<Connection>,
    case: RefCell<u64>,
}

impl Redis {
    fn start() -> Redis {
        let server = redis_server::RedisServer::start();
        let client = redis::Client::open(server.url()).expect("client");
        let conn = client
            .get_connection()
            .expect("connect to the throwaway redis");
        Redis {
            _server: server,
            conn: RefCell::new(conn),
            case: RefCell::new(0),
        }
    }

    fn next_case(&self) -> u64 {
        let mut case = self.case.borrow_mut();
        *case += 1;
        *case
    }

    /// Runs `script` on `key` with the server's clock at `now` (µs after [`EPOCH`]).
    fn run<T: redis::FromRedisValue>(
        &self,
        script: &Script,
        key: &str,
        now: i64,
        args: &[i64],
    ) -> T {
        let mut conn = self.conn.borrow_mut();
        let clock = format!("{key}:clock");
        redis::cmd("SET")
            .arg(&clock)
            .arg(EPOCH + now)
            .exec(&mut *conn)
            .expect("set the clock");
        script
            .key(key)
            .key(clock)
            .arg(args)
            .invoke(&mut *conn)
            .expect("run the script")
    }
}

fn seeded(cases: u32, seed: u64) -> TestRunner {
    TestRunner::new(Config {
        cases,
        rng_seed: RngSeed::Fixed(seed),
        failure_persistence: None,
        ..Config::default()
    })
}

/// Time between calls (µs): back to back, within a few seconds, or up to two minutes.
fn advance() -> impl Strategy<Value = i64> {
    prop_oneof![0i64..10, 0i64..3_000_000, 0i64..120_000_000]
}

// ---------------------------------------------------------------------------------------
// Configured pacing: `Store::pace`
// ---------------------------------------------------------------------------------------

/// One `Store::pace` call: the key, how many of its dimensions, their cells, the time since
/// the previous call.
type PaceCall = (usize, usize, [u32; 3], i64);

/// Per key up to three dimensions (per minute, burst), then the calls.
fn pace_case() -> impl Strategy<Value = (Vec<Vec<(u32, u32)>>, Vec<PaceCall>)> {
    let per_minute = prop_oneof![1u32..120, 1u32..100_000];
    let burst = prop_oneof![Just(1u32), 1u32..50, 1u32..100_000];
    let key = prop::collection::vec((per_minute, burst), 1..=3);
    let cells = prop_oneof![1u32..5, 1u32..200_000];
    let call = (
        0usize..3,
        1usize..=3,
        [cells.clone(), cells.clone(), cells],
        advance(),
    );
    (
        prop::collection::vec(key, 3),
        prop::collection::vec(call, 1..60),
    )
}

#[test]
fn pace_script_answers_as_the_memory_store() {
    let redis = Redis::start();
    let script = on_test_clock(PACE_SOURCE);
    let result = seeded(64, 0x7061_6365).run(&pace_case(), |(keys, calls)| {
        let case = redis.next_case();
        let memory = Pacers::default();
        let mut now = 0;
        for (i, (key, dims, cells, advance)) in calls.into_iter().enumerate() {
            now += advance;
            let rates = &keys[key];
            let limits: Vec<PaceLimit> = rates[..dims.min(rates.len())]
                .iter()
                .zip(cells)
                .map(|(&(per_minute, burst), cells)| PaceLimit {
                    per_minute,
                    burst,
                    cells,
                })
                .collect();
            let name = format!("k{key}");
            let expected = memory.reserve_at(&name, &limits, now);
            let redis_key = format!("case{case}:pace:{name}");
            let wait: i64 = redis.run(&script, &redis_key, now, &pace_args(&limits));
            prop_assert_eq!(wait, expected, "call {} at {}: {:?}", i, now, limits);
        }
        Ok(())
    });
    if let Err(failure) = result {
        panic!("{failure}");
    }
}

// ---------------------------------------------------------------------------------------
// Learned pacing: `Store::pace_learned`
// ---------------------------------------------------------------------------------------

/// One dimension of an ask: which of the key's two limits an answer reported (0: none),
/// the remaining it reported, a charge, the cells to take.
type LearnedDim = (usize, u32, i64, u32);

/// One `Store::pace_learned` call: the key, answered, queued, the dimensions, the probe
/// lease, the recovery, the poll, the time since the previous call.
type LearnedCall = (usize, u8, bool, [LearnedDim; DIMS], [i64; 3], i64);

fn learned_dim() -> impl Strategy<Value = LearnedDim> {
    (
        0usize..3,
        prop_oneof![0u32..10, 0u32..300_000],
        prop_oneof![3 => Just(0i64), 1 => -3_000i64..3_000],
        prop_oneof![Just(0u32), 1u32..5, 1u32..300_000],
    )
}

/// The headroom, per key and dimension two limits an answer may report, then the calls.
fn learned_case() -> impl Strategy<Value = (u32, Vec<[[u32; 2]; DIMS]>, Vec<LearnedCall>)> {
    let limit = prop_oneof![1u32..100, 1u32..200_000, 1u32..=MAX_LIMIT + 1];
    let key = [
        [limit.clone(), limit.clone()],
        [limit.clone(), limit.clone()],
        [limit.clone(), limit.clone()],
        [limit.clone(), limit],
    ];
    let times = [0i64..5_000_000, 0i64..60_000_000, 0i64..2_000_000];
    let call = (
        0usize..2,
        0u8..=2,
        any::<bool>(),
        [learned_dim(), learned_dim(), learned_dim(), learned_dim()],
        times,
        advance(),
    );
    (
        100u32..=1000,
        prop::collection::vec(key, 2),
        prop::collection::vec(call, 1..60),
    )
}

fn learned_ask(headroom: u32, limits: &[[u32; 2]; DIMS], call: &LearnedCall) -> PaceAsk {
    let (_, answered, queued, dims, [lease, recover, poll], _) = *call;
    let mut ask = PaceAsk {
        headroom_permille: headroom,
        answered,
        queued,
        probe_lease_us: lease,
        recover_us: recover,
        poll_us: poll,
        ..PaceAsk::default()
    };
    for (d, (which, remaining, charge, take)) in dims.into_iter().enumerate() {
        // An absurd limit (over MAX_LIMIT) is sent too: both sides must ignore it.
        let limit = if which == 0 { 0 } else { limits[d][which - 1] };
        ask.learn[d] = (limit, remaining);
        ask.charge[d] = charge;
        ask.take[d] = take;
    }
    ask
}

#[test]
fn learned_pace_script_answers_as_the_memory_store() {
    let redis = Redis::start();
    let script = on_test_clock(LEARNED_PACE_SOURCE);
    let result = seeded(64, 0x6c65_6172).run(&learned_case(), |(headroom, keys, calls)| {
        let case = redis.next_case();
        let memory = Pacers::default();
        let mut now = 0;
        for (i, call) in calls.iter().enumerate() {
            now += call.5;
            let ask = learned_ask(headroom, &keys[call.0], call);
            let name = format!("k{}", call.0);
            let expected = memory.learned_at(&name, &ask, now);
            let redis_key = format!("case{case}:learn:{name}");
            let reply: Vec<i64> = redis.run(&script, &redis_key, now, &learned_args(&ask));
            prop_assert_eq!(
                learned_grant(&reply),
                expected,
                "call {} at {}: {:?}",
                i,
                now,
                ask
            );
        }
        Ok(())
    });
    if let Err(failure) = result {
        panic!("{failure}");
    }
}

// ---------------------------------------------------------------------------------------
// The fleet's input-token rate in the slot scripts (`slot_queue.lua`)
// ---------------------------------------------------------------------------------------

/// Runs one call of the slot scripts' token rate, as a release or an acquire does: when its
/// cost conforms (`tokens_conform`), then the tokens taken dated from then (`tokens_take`);
/// answers that time and the TAT the wait book keeps.
const TOKENS_DRIVER: &str = "
local rate = {tonumber(ARGV[1]), tonumber(ARGV[2])}
local now, cost = tonumber(ARGV[3]), tonumber(ARGV[4])
local at = tokens_conform(KEYS[1], rate, now, cost)
tokens_take(KEYS[1], rate, at, cost)
local taken = redis.call('HGET', KEYS[1], 'tokens_tat')
tokens_correct(KEYS[1], rate, now, tonumber(ARGV[5]))
return {string.format('%.0f', at), taken, redis.call('HGET', KEYS[1], 'tokens_tat')}
";

/// One call: the time since the previous one (µs), its cost in tokens, and the tokens
/// it used beyond its cost (negative: fewer), corrected at once.
type TokenCall = (i64, i64, i64);

/// A rate (µs a token, tokens at once), then the calls.
fn tokens_case() -> impl Strategy<Value = ((i64, i64), Vec<TokenCall>)> {
    let interval = prop_oneof![1i64..2_000, 1i64..60_000_000];
    let capacity = prop_oneof![1i64..40, 1i64..1_000_000];
    let cost = prop_oneof![1i64..60, 1i64..200_000];
    (
        (interval, capacity),
        prop::collection::vec((advance(), cost, -200_000i64..200_000), 1..60),
    )
}

#[test]
fn slot_scripts_token_rate_answers_as_the_gcra_core() {
    use crate::gcra::Gcra;
    let redis = Redis::start();
    let source = format!(
        "{}{}{TOKENS_DRIVER}",
        include_str!("../scripts/gcra.lua"),
        include_str!("../scripts/slot_queue.lua")
    );
    let script = Script::new(&source);
    let result = seeded(64, 0x746f_6b6e).run(&tokens_case(), |((interval, capacity), calls)| {
        let case = redis.next_case();
        let book = format!("case{case}:waits");
        let rate = Gcra::new(interval, capacity);
        let (mut tat, mut now) = (0i64, 0i64);
        for (i, (advance, cost, beyond)) in calls.into_iter().enumerate() {
            now += advance;
            let at = rate.conforms_at(tat, now, cost);
            tat = rate.charge(tat, at, cost);
            let taken = tat;
            // Never below what was taken back: a call uses at least nothing. The script
            // takes at most a minute of the rate either way.
            let beyond = beyond.max(-cost);
            let minute = 60_000_000 / interval;
            tat = rate.charge(tat, now, beyond.clamp(-minute, minute));
            let reply: Vec<String> = script
                .key(&book)
                .arg(interval)
                .arg(capacity)
                .arg(EPOCH + now)
                .arg(cost)
                .arg(beyond)
                .invoke(&mut *redis.conn.borrow_mut())
                .expect("run the script");
            let got: Vec<i64> = reply
                .iter()
                .map(|n| n.parse::<i64>().expect("a number") - EPOCH)
                .collect();
            prop_assert_eq!(
                got,
                vec![at, taken, tat],
                "call {} at {} of {} tokens, {} beyond",
                i,
                now,
                cost,
                beyond
            );
        }
        Ok(())
    });
    if let Err(failure) = result {
        panic!("{failure}");
    }
}
