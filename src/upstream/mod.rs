//! Kinds of upstream: where a Messages API call can be served.
//!
//! Each kind is a tower layer over an HTTP client that takes calls as a client sends them to
//! the Anthropic API (its paths, JSON bodies and headers) and answers
//! `http::Response<`[`UpstreamBody`]`>` in the Messages API's shape, with [`BoxError`](crate::BoxError)
//! for errors: one interface, whatever sits behind it, for what sits in front.
//!
//! - **The Anthropic API** (or a compatible server), at any base URL with any key:
//!   [`AnthropicLayer`] sends the call on to the base URL with its own `x-api-key` (the
//!   caller's stays behind) and passes the answer as it is.
//! - **Claude on Amazon Bedrock**: [`BedrockLayer`] wraps an HTTP client and turns each
//!   `POST /v1/messages` into Bedrock's `POST /model/{modelId}/invoke`, or
//!   `/invoke-with-response-stream` when the body says `"stream": true`. The body goes
//!   without `model` and `stream`, with `"anthropic_version": "bedrock-2023-05-31"` (and an
//!   `anthropic-beta` header as its `anthropic_beta` list); the model id comes from a
//!   [`ModelMap`] (the Messages API's names to Bedrock's ids, the current Claude models by
//!   default; `inference_profile("us")` for the cross-region inference profiles the newer
//!   models need; an id or ARN passes as it is);
//!   the request is signed with AWS Signature Version 4 (service `bedrock`), and the
//!   caller's Anthropic headers (`x-api-key`, `anthropic-version`) stay behind. The answers
//!   come back in the Messages API's shape: a message as Bedrock sends it (it is already
//!   that shape), a stream decoded from AWS's binary event stream into the server-sent
//!   events the Messages API streams, and Bedrock's errors as Anthropic's
//!   (`ThrottlingException` is `429 rate_limit_error`, `ServiceUnavailableException`
//!   `529 overloaded_error`, `ValidationException` `400 invalid_request_error`, an exception
//!   inside a stream an `error` event), so the crate's other layers, and the Anthropic SDKs,
//!   read them as they read Anthropic's.
//!
//! Credentials and region come from the builder or the standard AWS environment
//! (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION` or
//! `AWS_DEFAULT_REGION`); missing ones are an [`AwsConfigError`] when the layer is built.
//! Both kinds answer in the same body type, so one [pool](crate::pool) can hold both
//! (boxed).
//!
//! `POST /v1/messages/count_tokens` goes to Bedrock's `count-tokens` (the invoke body,
//! base64 in `{"input":{"invokeModel":{"body":…}}}`, under the model id without an inference
//! profile's prefix, which counting refuses) and its `{"inputTokens":n}` comes back as
//! `{"input_tokens":n}`. Bedrock has no Message Batches, Files or Models routes: anything
//! else is answered `404 not_found_error` without a call.
//!
//! **Google Vertex AI** would take the same shape of work: `POST
//! /v1/projects/{project}/locations/{region}/publishers/anthropic/models/{model}:rawPredict`
//! (`:streamRawPredict` for a stream) on `https://{region}-aiplatform.googleapis.com`, the
//! body without `model` and with `"anthropic_version": "vertex-2023-10-16"`, and an OAuth 2
//! bearer token from Google credentials (a service account's signed JWT exchanged for an
//! access token, refreshed before it expires) in place of the signature. Its stream is
//! already server-sent events, so no decoder is needed.
//!
//! # Example
//!
//! ```
//! use fairgate::upstream::{AwsCredentials, BedrockLayer, ModelMap};
//! use tower::{ServiceBuilder, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), fairgate::BoxError> {
//! // Any HTTP client as a tower Service taking http::Request<String>: hyper's, reqwest's...
//! // This one stands for Bedrock and shows what it is sent.
//! let http_client = service_fn(|req: http::Request<String>| async move {
//!     assert_eq!(
//!         req.uri(),
//!         "https://bedrock-runtime.us-east-1.amazonaws.com\
//!          /model/us.anthropic.claude-sonnet-4-5-20250929-v1%3A0/invoke"
//!     );
//!     assert!(req.headers()["authorization"].to_str()?.starts_with("AWS4-HMAC-SHA256 "));
//!     assert!(req.headers().get("x-api-key").is_none());
//!     assert!(req.body().contains(r#""anthropic_version":"bedrock-2023-05-31""#));
//!     let message = r#"{"type":"message","role":"assistant","content":[]}"#;
//!     Ok::<_, fairgate::BoxError>(http::Response::new(message.to_owned()))
//! });
//!
//! let bedrock = BedrockLayer::builder() // else from AWS_ACCESS_KEY_ID, AWS_REGION, ...
//!     .region("us-east-1")
//!     .credentials(AwsCredentials::new("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"))
//!     .models(ModelMap::default().inference_profile("us"))
//!     .build()?;
//! let claude = ServiceBuilder::new().layer(bedrock).service(http_client);
//!
//! let request = http::Request::post("http://localhost/v1/messages")
//!     .header("x-api-key", "sk-ant-not-sent")
//!     .body(r#"{"model":"claude-sonnet-4-5","max_tokens":64,"messages":[]}"#.to_owned())?;
//! let response = claude.oneshot(request).await?;
//! assert_eq!(response.status(), 200);
//! # Ok(())
//! # }
//! ```
//!
//! In front of it, [`FairgateLayer`](crate::FairgateLayer) orders and paces the calls as it
//! does the Anthropic API's: Bedrock's throttling arrives as the `429` the retry layer knows.
//!
//! # Limits
//!
//! The request body is read whole before the call (Bedrock's body is a rewrite of it, and
//! its SHA-256 is signed), up to 32 MiB; a larger one is answered `413 request_too_large`
//! without a call. An event stream message is at most the format's 16 MiB payload and 128
//! KiB of headers; the decoder holds at most one. The credentials are fixed when the layer
//! is built: temporary credentials that expire need a new layer (no refresh from an
//! instance profile or SSO yet).
//!
//! # Cancel safety
//!
//! Dropping the response future while it reads the request body sends nothing; dropping it
//! while Bedrock answers drops the inner service's future, as that service does (hyper's
//! closes the connection). Dropping the response body mid-stream drops Bedrock's, which
//! ends the stream upstream; a response kept unread holds the inner service's connection.

mod answer;
mod anthropic;
mod bedrock;
mod codec;
mod eventstream;
pub mod future;
mod models;
mod request;
mod sigv4;
#[cfg(test)]
mod tests;

pub use self::answer::UpstreamBody;
pub use self::anthropic::{Anthropic, AnthropicLayer};
pub use self::bedrock::{AwsConfigError, Bedrock, BedrockBuilder, BedrockLayer};
pub use self::models::ModelMap;
pub use self::request::BEDROCK_ANTHROPIC_VERSION;
pub use self::sigv4::AwsCredentials;
