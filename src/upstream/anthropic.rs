//! The Anthropic API at any base URL with any key: [`AnthropicLayer`] and [`Anthropic`].

use std::sync::Arc;
use std::task::{Context, Poll};

use http::{HeaderValue, StatusCode, Uri, header};
use tower_layer::Layer;
use tower_service::Service;

use super::answer::{MessagesError, UpstreamBody};
use super::future::AnthropicFuture;
use crate::error::{BoxError, ConfigError};

/// The `anthropic-version` sent when the caller sent none.
const DEFAULT_VERSION: &str = "2023-06-01";

/// Where calls go and with which key.
struct Config {
    /// Scheme and authority (`https://api.anthropic.com`).
    origin: String,
    /// The base URL's path, without a trailing `/`.
    prefix: String,
    key: HeaderValue,
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("origin", &self.origin)
            .field("prefix", &self.prefix)
            .field("key", &"<redacted>")
            .finish()
    }
}

/// Sends Messages API calls to the Anthropic API (or a compatible server) at a base URL,
/// with a key of its own; see the [module docs](super).
///
/// The caller's `x-api-key`, `authorization` and `host` stay behind; its path and query go
/// on after the base URL's path; `anthropic-version` is `2023-06-01` unless the caller sent
/// one; every other header, and the body, pass as they are. Answers pass as they are too,
/// as [`UpstreamBody`], the body [`Bedrock`](super::Bedrock) answers with: the two kinds
/// are one interface to what sits in front of them.
///
/// # Clone
///
/// Cloning shares the configuration.
#[derive(Debug, Clone)]
pub struct AnthropicLayer {
    config: Arc<Config>,
}

impl AnthropicLayer {
    /// Calls to `base_url` (`https://api.anthropic.com`) with `api_key`.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] when `base_url` is not an absolute `http` or `https` URL without a
    /// query, or the key cannot be a header value.
    pub fn new(base_url: &str, api_key: &str) -> Result<Self, ConfigError> {
        let bad = || {
            ConfigError::new(format!(
                "Anthropic base URL {base_url:?} is not an absolute http(s) URL"
            ))
        };
        let uri: Uri = base_url.parse().map_err(|_| bad())?;
        let (Some(scheme), Some(authority)) = (uri.scheme_str(), uri.authority()) else {
            return Err(bad());
        };
        if !matches!(scheme, "http" | "https") || uri.query().is_some() {
            return Err(bad());
        }
        let mut key = HeaderValue::from_str(api_key)
            .map_err(|_| ConfigError::new("the Anthropic API key is not a valid header value"))?;
        key.set_sensitive(true);
        let config = Config {
            origin: format!("{scheme}://{authority}"),
            prefix: uri.path().trim_end_matches('/').to_owned(),
            key,
        };
        Ok(AnthropicLayer {
            config: Arc::new(config),
        })
    }
}

impl<S> Layer<S> for AnthropicLayer {
    type Service = Anthropic<S>;

    fn layer(&self, inner: S) -> Anthropic<S> {
        Anthropic {
            inner,
            config: Arc::clone(&self.config),
        }
    }
}

/// A Messages API service over the Anthropic API at a base URL, with a key of its own.
#[derive(Debug, Clone)]
pub struct Anthropic<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> Anthropic<S> {
    /// The inner HTTP service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner HTTP service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The inner HTTP service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, B, RB> Service<http::Request<B>> for Anthropic<S>
where
    S: Service<http::Request<B>, Response = http::Response<RB>>,
    S::Error: Into<BoxError>,
{
    type Response = http::Response<UpstreamBody<RB>>;
    type Error = BoxError;
    type Future = AnthropicFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        match to_anthropic(&self.config, req) {
            Ok(req) => AnthropicFuture::calling(self.inner.call(req)),
            Err(error) => AnthropicFuture::answered(error),
        }
    }
}

/// The caller's request, sent to the base URL with the layer's key.
fn to_anthropic<B>(
    config: &Config,
    req: http::Request<B>,
) -> Result<http::Request<B>, MessagesError> {
    let (mut parts, body) = req.into_parts();
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    parts.uri = format!("{}{}{path}", config.origin, config.prefix)
        .parse()
        .map_err(|_| {
            MessagesError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "bad request path",
            )
        })?;
    let headers = &mut parts.headers;
    headers.remove(header::HOST);
    headers.remove(header::AUTHORIZATION);
    headers.insert("x-api-key", config.key.clone());
    if !headers.contains_key("anthropic-version") {
        headers.insert(
            "anthropic-version",
            HeaderValue::from_static(DEFAULT_VERSION),
        );
    }
    Ok(http::Request::from_parts(parts, body))
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use http_body_util::BodyExt;
    use tower::{ServiceBuilder, ServiceExt, service_fn};

    use super::*;

    #[tokio::test]
    async fn calls_go_to_the_base_url_with_the_layers_key_and_answers_pass() {
        let inner = service_fn(|req: http::Request<String>| async move {
            assert_eq!(
                req.uri(),
                "https://proxy.example/anthropic/v1/messages?beta=true"
            );
            let headers = req.headers();
            assert_eq!(headers["x-api-key"], "sk-ant-upstream");
            assert_eq!(headers["anthropic-version"], "2023-06-01");
            assert_eq!(headers["anthropic-beta"], "b-1");
            assert!(headers.get("authorization").is_none() && headers.get("host").is_none());
            assert_eq!(req.body(), "{}");
            Ok::<_, Infallible>(http::Response::new(format!(
                "answered {}",
                req.uri().path()
            )))
        });
        let layer =
            AnthropicLayer::new("https://proxy.example/anthropic/", "sk-ant-upstream").unwrap();
        let anthropic = ServiceBuilder::new().layer(layer).service(inner);
        let request = http::Request::post("http://gateway.local/v1/messages?beta=true")
            .header("host", "gateway.local")
            .header("x-api-key", "sk-ant-client")
            .header("authorization", "Bearer client")
            .header("anthropic-beta", "b-1")
            .body("{}".to_owned())
            .unwrap();
        let response = anthropic.oneshot(request).await.unwrap();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, "answered /anthropic/v1/messages");
    }

    #[test]
    fn a_bad_base_url_or_key_is_refused_when_built() {
        for url in ["api.anthropic.com", "ftp://x", "http://x/?q"] {
            assert!(AnthropicLayer::new(url, "k").is_err(), "{url}");
        }
        assert!(AnthropicLayer::new("https://api.anthropic.com", "bad\nkey").is_err());
        let shown = format!(
            "{:?}",
            AnthropicLayer::new("https://a.b", "sk-ant-secret").unwrap()
        );
        assert!(!shown.contains("sk-ant-secret"), "{shown}");
    }
}
