//! placeholder
#![cfg(feature = "gateway")]
