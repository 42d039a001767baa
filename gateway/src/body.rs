//! What every answer the gateway sends is made of: its body type, a body of bytes, and an
//! upstream's answer made the client's (hop-by-hop headers dropped).

use bytes::Bytes;
use fairgate::BoxError;
use http::Response;
use http::header::{self, HeaderMap, HeaderName};
use http_body_util::BodyExt;

/// The body of every response the gateway sends.
pub(crate) type Body = http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError>;

/// Headers that belong to one connection, never forwarded (RFC 9110 §7.6.1).
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "upgrade",
];

/// Removes the hop-by-hop headers of `headers`: those of [`HOP_BY_HOP`] and those its
/// `Connection` header names.
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Headers the `Connection` header names are hop-by-hop too.
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::try_from(name.trim()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
    headers.remove(header::TRANSFER_ENCODING);
}

/// The upstream's answer as the client's: hop-by-hop headers dropped, the body streamed.
pub(crate) fn downstream<B>(response: Response<B>) -> Response<Body>
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let (mut parts, body) = response.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    Response::from_parts(parts, body.map_err(Into::into).boxed_unsync())
}

/// A body of `bytes`.
pub(crate) fn full(bytes: impl Into<Bytes>) -> Body {
    http_body_util::Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}
