//! Who may call and at what cost: the key check, failures slowed per (address, key) and
//! per address on distinct keys (`auth`); end users and origins a service key names
//! (`identity`); what each key holder may hold at once: requests, body and answer bytes
//! (`holders`); what a call is estimated to cost and what it settles at (`cost`).

pub(crate) mod auth;
pub(crate) mod cost;
pub(crate) mod holders;
pub(crate) mod identity;
