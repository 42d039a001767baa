//! The Anthropic API (or a mock): where calls go and with which key, over the one hyper
//! client every upstream of the gateway shares ([`client`]).

use std::time::Duration;

use fairgate::BoxError;
use http::header::{self, HeaderName, HeaderValue};
use http::{Response, Uri};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::body::{Body, downstream, strip_hop_by_hop};
use crate::proxy::http2::Http2;

/// The gateway's HTTP client: one for every upstream (its idle connections kept per host).
pub(crate) type HttpClient = Client<HttpsConnector<HttpConnector>, Body>;

/// The upstream API: a pooled client, the base URL and the team's key.
#[derive(Clone)]
pub(crate) struct Upstream {
    transport: Transport,
    scheme: http::uri::Scheme,
    authority: http::uri::Authority,
    /// A path prefix of the upstream URL, without the trailing `/` (usually empty).
    base_path: String,
    api_key: HeaderValue,
}

/// How calls reach the upstream.
#[derive(Clone)]
enum Transport {
    /// HTTP/1.1, a connection a call (kept idle for reuse after).
    Http1(Box<HttpClient>),
    /// HTTP/2, many calls a connection.
    Http2(Http2),
}

/// Idle upstream connections kept for reuse at most.
const MAX_IDLE_CONNECTIONS: usize = 64;

/// Request headers never forwarded upstream, on any route: the one list. The upstream is
/// called under the team's key, so a header that names another credential, account or
/// workspace, or another client, would let a caller act as someone it is not:
/// - the client's own credentials (`x-api-key`, `authorization`), replaced by the team's key;
/// - `anthropic-workspace-id`, which picks the workspace a multi-workspace credential acts
///   on, and `anthropic-organization-id` (a response header of Anthropic's; refused in a
///   request should it ever be read);
/// - `cookie`, a session credential of its own;
/// - `forwarded`, `x-forwarded-*`, `x-real-ip`: who the client is, as a proxy would tell
///   it; the gateway does not vouch for what a client says of itself.
pub(crate) const NOT_FORWARDED: [&str; 10] = [
    "x-api-key",
    "authorization",
    "anthropic-workspace-id",
    "anthropic-organization-id",
    "cookie",
    "forwarded",
    "x-forwarded-for",
    "x-forwarded-host",
    "x-forwarded-proto",
    "x-real-ip",
];

/// The HTTP client the gateway's upstreams share (`http://` and `https://`, HTTP/1.1).
pub(crate) fn client() -> HttpClient {
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_webpki_roots()
        .https_or_http()
        .enable_http1()
        .wrap_connector(tcp());
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(60))
        // After a burst of thousands of calls, a few idle connections are kept, not
        // the burst's: each is a file and a few KiB.
        .pool_max_idle_per_host(MAX_IDLE_CONNECTIONS)
        .build(https)
}

/// The TCP side of the gateway's upstream connections.
fn tcp() -> HttpConnector {
    let mut http = HttpConnector::new();
    http.enforce_http(false); // https:// goes through rustls
    http.set_nodelay(true); // a request's head and body go out at once
    http.set_connect_timeout(Some(Duration::from_secs(10)));
    http
}

impl Upstream {
    /// The API at `url` called with `api_key`, over `client` (shared: clones of one client
    /// share its connections).
    pub(crate) fn new(client: HttpClient, url: &Uri, api_key: &str) -> Result<Upstream, String> {
        let mut api_key = HeaderValue::from_str(api_key)
            .map_err(|_| "the upstream key is not a valid header value".to_owned())?;
        api_key.set_sensitive(true);
        Ok(Upstream {
            transport: Transport::Http1(Box::new(client)),
            scheme: url.scheme().cloned().unwrap_or(http::uri::Scheme::HTTPS),
            authority: url.authority().cloned().ok_or("no host")?,
            base_path: url.path().trim_end_matches('/').to_owned(),
            api_key,
        })
    }

    /// The same upstream called over HTTP/2 (connections of its own).
    pub(crate) fn http2(self) -> Upstream {
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_webpki_roots()
            .https_or_http()
            .enable_http2()
            .wrap_connector(tcp());
        let target = Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query("/")
            .build()
            .expect("a scheme and an authority make a URI");
        Upstream {
            transport: Transport::Http2(Http2::new(https, target)),
            ..self
        }
    }

    /// `req` readdressed to the upstream at `path` (canonical, checked by the caller), with
    /// the upstream key instead of the client's and none of [`NOT_FORWARDED`].
    fn prepare<B>(&self, req: http::Request<B>) -> Result<http::Request<B>, BoxError> {
        let (mut parts, body) = req.into_parts();
        let path_and_query = parts
            .uri
            .path_and_query()
            .map(|p| p.as_str())
            .unwrap_or("/");
        parts.uri = Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(format!("{}{path_and_query}", self.base_path))
            .build()?;
        let headers = &mut parts.headers;
        strip_hop_by_hop(headers);
        headers.remove(header::HOST);
        headers.remove(header::CONTENT_LENGTH);
        headers.remove(header::EXPECT);
        for name in NOT_FORWARDED {
            headers.remove(name);
        }
        headers.insert("x-api-key", self.api_key.clone());
        // The gateway's own claims are for the gateway alone (collects nothing, so
        // allocates nothing, when there are none).
        let ours: Vec<HeaderName> = headers
            .keys()
            .filter(|name| name.as_str().starts_with("x-fairgate-"))
            .cloned()
            .collect();
        for name in ours {
            headers.remove(name);
        }
        parts.version = match self.transport {
            Transport::Http1(_) => http::Version::HTTP_11,
            Transport::Http2(_) => http::Version::HTTP_2,
        };
        Ok(http::Request::from_parts(parts, body))
    }

    pub(crate) async fn send(&self, req: http::Request<Body>) -> Result<Response<Body>, BoxError> {
        let req = self.prepare(req)?;
        match &self.transport {
            Transport::Http1(client) => Ok(downstream(client.request(req).await?)),
            Transport::Http2(connections) => connections.send(req).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_credential_account_or_client_identity_of_the_caller_goes_upstream() {
        let url = "http://127.0.0.1:9/base".parse().unwrap();
        let upstream = Upstream::new(client(), &url, "sk-team").expect("an upstream");
        let mut req = http::Request::builder()
            .uri("/v1/messages?beta=true")
            .header("x-api-key", "sk-client")
            .header("authorization", "Bearer sk-client")
            .header("anthropic-version", "2023-06-01")
            .header("anthropic-beta", "output-128k-2025-02-19");
        for name in NOT_FORWARDED {
            req = req.header(name, "someone-else");
        }
        let prepared = upstream.prepare(req.body(()).unwrap()).unwrap();
        let headers = prepared.headers();
        assert_eq!(headers.get_all("x-api-key").iter().count(), 1);
        assert_eq!(headers["x-api-key"], "sk-team");
        for name in NOT_FORWARDED.iter().filter(|n| **n != "x-api-key") {
            assert!(headers.get(*name).is_none(), "{name} forwarded");
        }
        assert_eq!(headers["anthropic-version"], "2023-06-01");
        assert_eq!(headers["anthropic-beta"], "output-128k-2025-02-19");
        assert_eq!(
            prepared.uri().to_string(),
            "http://127.0.0.1:9/base/v1/messages?beta=true"
        );
    }
}
