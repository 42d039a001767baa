//! The API port: canonical paths only, one admission path and an allow-list for the rest
//! (`routes`); the handlers: authenticate from the headers, then buffer within a budget
//! (`api`); answers relayed through a bounded buffer, the slot free at the upstream's end
//! (`answer`), a stream its upstream cuts ended with the API's error event (`cut_stream`);
//! the upstream client (`upstream`, over HTTP/2: `http2`) and the pool of upstreams
//! (`upstreams`); message batches, each answered only to the key that created it
//! (`batches`).

pub(crate) mod answer;
pub(crate) mod api;
pub(crate) mod batches;
pub(crate) mod cut_stream;
pub(crate) mod http2;
pub(crate) mod refusals;
pub(crate) mod routes;
pub(crate) mod upstream;
pub(crate) mod upstreams;
