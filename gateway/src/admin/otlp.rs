//! `--otlp URL`: the span of every call through the admission stack (`fairgate.call`, see
//! `fairgate::trace`) exported over OTLP/HTTP in protobuf, in batches, to a collector
//! (an OpenTelemetry Collector, Jaeger, Tempo, ...).
//!
//! Without the flag no span is made: only the log layer listens, and it does not want the
//! call spans. With it, the batch processor's thread sends each batch through this
//! gateway's runtime (a hyper client, HTTP or HTTPS), and the gateway flushes what is left
//! when it stops.

use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, Uri};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_http::{HttpClient, HttpError};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::Subscriber;
use tracing_subscriber::Layer;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::registry::LookupSpan;

/// How long the gateway waits, when it stops, for the last batch to go.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

/// Reads `--otlp`: an http(s) URL; a URL with no path is the collector's base, and the
/// spans go to its `/v1/traces`.
pub(crate) fn endpoint(value: &str) -> Result<Uri, String> {
    let parsed: Uri = value.parse().map_err(|e| format!("not a URL ({e})"))?;
    match parsed.scheme_str() {
        Some("http" | "https") if parsed.authority().is_some() => {}
        _ => return Err("give an http:// or https:// URL with a host".into()),
    }
    if matches!(parsed.path(), "" | "/") && parsed.query().is_none() {
        let base = value.trim_end_matches('/');
        return format!("{base}/v1/traces")
            .parse()
            .map_err(|e| format!("not a URL ({e})"));
    }
    Ok(parsed)
}

/// The exporter, kept to flush it when the gateway stops.
#[derive(Debug)]
pub(crate) struct Otlp {
    provider: SdkTracerProvider,
}

/// Starts the export to `endpoint`, its requests sent on `runtime`: the exporter, and the
/// layer that hands it the call spans (and the wait events inside them), nothing else.
pub(crate) fn start<S>(
    endpoint: &Uri,
    runtime: &tokio::runtime::Handle,
) -> Result<(Otlp, impl Layer<S> + Send + Sync + use<S>), String>
where
    S: Subscriber + for<'a> LookupSpan<'a> + Send + Sync,
{
    let client = Sender::new(runtime.clone());
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(client)
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(endpoint.to_string())
        .build()
        .map_err(|e| format!("--otlp {endpoint}: {e}"))?;
    let resource = Resource::builder()
        .with_service_name("fairgate-gateway")
        .build();
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build();
    let tracer = provider.tracer("fairgate");
    let calls = Targets::new()
        .with_target(fairgate::trace::CALL_TARGET, tracing::Level::DEBUG)
        .with_target(fairgate::trace::WAIT_TARGET, tracing::Level::DEBUG);
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_filter(calls);
    Ok((Otlp { provider }, layer))
}

impl Otlp {
    /// Sends what is left and stops the export (at most [`FLUSH_TIMEOUT`]).
    pub(crate) async fn shutdown(self) {
        let provider = self.provider;
        // The processor's thread blocks until its last batch went, which it sends through
        // this runtime: wait for it off the runtime's threads.
        let flushed = tokio::task::spawn_blocking(move || provider.shutdown());
        match tokio::time::timeout(FLUSH_TIMEOUT, flushed).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(error))) => tracing::warn!(%error, "--otlp: the last spans were not sent"),
            Ok(Err(error)) => tracing::warn!(%error, "--otlp: the flush failed"),
            Err(_) => tracing::warn!("--otlp: the last spans were not sent in time"),
        }
    }
}

/// The exporter's HTTP client: each request goes on the gateway's runtime (the batch
/// processor calls from its own thread, outside any runtime).
#[derive(Debug)]
struct Sender {
    runtime: tokio::runtime::Handle,
    client: Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>,
}

impl Sender {
    fn new(runtime: tokio::runtime::Handle) -> Sender {
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_webpki_roots()
            .https_or_http()
            .enable_http1()
            .build();
        let client = Client::builder(TokioExecutor::new()).build(https);
        Sender { runtime, client }
    }
}

#[async_trait::async_trait]
impl HttpClient for Sender {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let client = self.client.clone();
        let sent = self.runtime.spawn(async move {
            let response = client.request(request.map(Full::new)).await?;
            let (head, body) = response.into_parts();
            let body = body.collect().await?.to_bytes();
            Ok::<_, HttpError>(Response::from_parts(head, body))
        });
        sent.await?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_collectors_base_url_gets_the_traces_path_and_a_full_one_is_kept() {
        assert_eq!(
            endpoint("http://127.0.0.1:4318").unwrap(),
            "http://127.0.0.1:4318/v1/traces"
        );
        assert_eq!(
            endpoint("https://otel.example.com/").unwrap(),
            "https://otel.example.com/v1/traces"
        );
        assert_eq!(
            endpoint("http://collector:4318/custom/traces").unwrap(),
            "http://collector:4318/custom/traces"
        );
        assert!(endpoint("collector:4318").is_err());
        assert!(endpoint("ftp://collector").is_err());
        assert!(endpoint("").is_err());
    }
}
