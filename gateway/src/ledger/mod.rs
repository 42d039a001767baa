//! What the gateway saw, written by the proxy and read by the admin side: the tokens and
//! calls of each tenant per UTC day (`usage`, for `/usage`); the calls gone to the upstream
//! whose answer has not ended (`flights`, for the live page); `--record`'s JSON lines of
//! the admitted calls, for the simulator's replay (`record`).

pub(crate) mod flights;
pub(crate) mod record;
pub(crate) mod usage;
