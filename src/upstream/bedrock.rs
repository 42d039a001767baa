//! Claude on Amazon Bedrock behind the Messages API: [`BedrockLayer`] and [`Bedrock`].

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::Uri;
use tower_layer::Layer;
use tower_service::Service;

use super::answer::UpstreamBody;
use super::future::ResponseFuture;
use super::models::ModelMap;
use super::request::Config;
use super::sigv4::AwsCredentials;
use crate::error::BoxError;

/// What Bedrock needs and could not be found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum AwsConfigError {
    /// No credentials given, and `AWS_ACCESS_KEY_ID` or `AWS_SECRET_ACCESS_KEY` not set.
    MissingCredentials,
    /// No region given, and neither `AWS_REGION` nor `AWS_DEFAULT_REGION` set.
    MissingRegion,
    /// The base URL is not an absolute `http` or `https` URL.
    BaseUrl(String),
}

impl fmt::Display for AwsConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AwsConfigError::MissingCredentials => {
                f.write_str("no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
            }
            AwsConfigError::MissingRegion => {
                f.write_str("no AWS region: set AWS_REGION or AWS_DEFAULT_REGION")
            }
            AwsConfigError::BaseUrl(url) => write!(f, "bad Bedrock base URL {url:?}"),
        }
    }
}

impl std::error::Error for AwsConfigError {}

/// Builds a [`BedrockLayer`]; what is not given comes from the standard AWS environment.
#[derive(Debug, Default, Clone)]
pub struct BedrockBuilder {
    region: Option<String>,
    credentials: Option<AwsCredentials>,
    base_url: Option<String>,
    models: ModelMap,
}

impl BedrockBuilder {
    /// The AWS region (`us-east-1`); else `AWS_REGION`, else `AWS_DEFAULT_REGION`.
    pub fn region(mut self, region: impl Into<String>) -> Self {
        self.region = Some(region.into());
        self
    }

    /// The credentials to sign with; else [`AwsCredentials::from_env`].
    pub fn credentials(mut self, credentials: AwsCredentials) -> Self {
        self.credentials = Some(credentials);
        self
    }

    /// Sends calls to `url` instead of `https://bedrock-runtime.{region}.amazonaws.com`
    /// (a VPC endpoint, a proxy, a mock). Signed for its host.
    pub fn base_url(mut self, url: impl Into<String>) -> Self {
        self.base_url = Some(url.into());
        self
    }

    /// The model names served and their Bedrock ids; [`ModelMap::default`] if not given.
    pub fn models(mut self, models: ModelMap) -> Self {
        self.models = models;
        self
    }

    /// The layer.
    ///
    /// # Errors
    ///
    /// [`AwsConfigError`] when the credentials or the region are neither given nor in the
    /// environment, or the base URL is not an absolute URL.
    pub fn build(self) -> Result<BedrockLayer, AwsConfigError> {
        self.build_with(|name| std::env::var(name).ok())
    }

    /// [`build`](Self::build) with `env` for the environment.
    pub(crate) fn build_with(
        self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<BedrockLayer, AwsConfigError> {
        let credentials = match self.credentials {
            Some(credentials) => credentials,
            None => AwsCredentials::from_vars(&env).ok_or(AwsConfigError::MissingCredentials)?,
        };
        let env = |name: &str| env(name).filter(|v| !v.is_empty());
        let region = self
            .region
            .or_else(|| env("AWS_REGION"))
            .or_else(|| env("AWS_DEFAULT_REGION"))
            .ok_or(AwsConfigError::MissingRegion)?;
        let url = self
            .base_url
            .unwrap_or_else(|| format!("https://bedrock-runtime.{region}.amazonaws.com"));
        let bad = || AwsConfigError::BaseUrl(url.clone());
        let uri: Uri = url.parse().map_err(|_| bad())?;
        let (Some(scheme), Some(authority)) = (uri.scheme_str(), uri.authority()) else {
            return Err(bad());
        };
        if !matches!(scheme, "http" | "https") || uri.query().is_some() {
            return Err(bad());
        }
        let config = Config {
            origin: format!("{scheme}://{authority}"),
            host: authority.to_string(),
            prefix: uri.path().trim_end_matches('/').to_owned(),
            region,
            credentials,
            models: self.models,
        };
        Ok(BedrockLayer {
            config: Arc::new(config),
        })
    }
}

/// Turns Messages API calls into calls to Claude on Amazon Bedrock; see the
/// [module docs](super).
///
/// # Clone
///
/// Cloning shares the configuration (credentials, region, model map).
#[derive(Debug, Clone)]
pub struct BedrockLayer {
    config: Arc<Config>,
}

impl BedrockLayer {
    /// A builder; what it is not given comes from the standard AWS environment.
    pub fn builder() -> BedrockBuilder {
        BedrockBuilder::default()
    }

    /// Everything from the standard AWS environment: `AWS_ACCESS_KEY_ID`,
    /// `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION` or `AWS_DEFAULT_REGION`.
    ///
    /// # Errors
    ///
    /// [`AwsConfigError`] when the credentials or the region are missing.
    pub fn from_env() -> Result<Self, AwsConfigError> {
        BedrockBuilder::default().build()
    }
}

impl<S> Layer<S> for BedrockLayer {
    type Service = Bedrock<S>;

    fn layer(&self, inner: S) -> Bedrock<S> {
        Bedrock {
            inner,
            config: Arc::clone(&self.config),
        }
    }
}

/// A Messages API service over Claude on Amazon Bedrock: takes `POST /v1/messages` and
/// calls the inner HTTP service with Bedrock's signed `invoke` or
/// `invoke-with-response-stream`; answers in the Messages API's shape.
#[derive(Debug, Clone)]
pub struct Bedrock<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> Bedrock<S> {
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

impl<S, B, RB> Service<http::Request<B>> for Bedrock<S>
where
    S: Service<http::Request<String>, Response = http::Response<RB>> + Clone,
    S::Error: Into<BoxError>,
    B: http_body::Body,
    B::Error: Into<BoxError>,
    RB: http_body::Body,
{
    type Response = http::Response<UpstreamBody<RB>>;
    type Error = BoxError;
    type Future = ResponseFuture<S, B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        // The ready service goes with the call; this one is a fresh clone, not ready.
        let clone = self.inner.clone();
        let ready = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::new(req, ready, Arc::clone(&self.config))
    }
}

impl BedrockLayer {
    #[cfg(test)]
    pub(crate) fn config(&self) -> Arc<Config> {
        Arc::clone(&self.config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_credentials_or_region_are_typed_errors() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                vars.iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| (*v).to_owned())
            }
        };
        const KEYS: &[(&str, &str)] = &[
            ("AWS_ACCESS_KEY_ID", "AKID"),
            ("AWS_SECRET_ACCESS_KEY", "s"),
        ];
        let err = BedrockBuilder::default().build_with(env(&[])).unwrap_err();
        assert_eq!(err, AwsConfigError::MissingCredentials);
        let err = BedrockBuilder::default()
            .build_with(env(&KEYS[..1]))
            .unwrap_err();
        assert_eq!(err, AwsConfigError::MissingCredentials);
        let err = BedrockBuilder::default().build_with(env(KEYS)).unwrap_err();
        assert_eq!(err, AwsConfigError::MissingRegion);
        assert!(err.to_string().contains("AWS_REGION"));
        const ALL: &[(&str, &str)] = &[
            ("AWS_ACCESS_KEY_ID", "AKID"),
            ("AWS_SECRET_ACCESS_KEY", "s"),
            ("AWS_SESSION_TOKEN", "t"),
            ("AWS_DEFAULT_REGION", "eu-west-1"),
        ];
        let layer = BedrockBuilder::default().build_with(env(ALL)).unwrap();
        assert_eq!(layer.config.region, "eu-west-1");
        assert_eq!(layer.config.host, "bedrock-runtime.eu-west-1.amazonaws.com");
        assert_eq!(layer.config.credentials.token(), Some("t"));
        let layer = BedrockBuilder::default()
            .region("us-east-2")
            .build_with(env(ALL))
            .unwrap();
        assert_eq!(layer.config.region, "us-east-2");
        for bad in ["not a url", "ftp://x/", "/relative", "http://h/?q=1"] {
            let err = BedrockBuilder::default()
                .base_url(bad)
                .build_with(env(ALL))
                .unwrap_err();
            assert_eq!(err, AwsConfigError::BaseUrl(bad.to_owned()));
        }
    }
}
