//! The fairgate simulator as a library: the five published scenarios (`engine`), their
//! picture (`svg`) and the replay of a recorded run under a policy of one's choosing
//! (`replay`), each in tokio's paused time. The `fairgate-simulate` program prints them;
//! the gateway's tuner can replay through [`replay::replay`].
//!
//! ```sh
//! cargo run --release -p fairgate-simulator -- [scenario] [--seed N] [--svg out.svg] [--small]
//! cargo run --release -p fairgate-simulator -- --replay FILE [--policy policy.toml]
//! ```

pub mod engine;
pub mod replay;
pub mod scenarios;
pub mod svg;
