//! The gateway's upstreams: `--upstream URL` (with `ANTHROPIC_API_KEY`), a pool of one; or
//! the keys file's `[[upstreams]]`, a [`Pool`] of them.
//!
//! ```toml
//! [[upstreams]]
//! name = "primary"                  # in metrics, logs and on the live page
//! url = "https://api.anthropic.com"
//! key_env = "ANTHROPIC_API_KEY"     # the environment variable holding its key
//! [[upstreams]]
//! name = "bedrock-east"
//! kind = "bedrock"                  # "anthropic" (the default) or "bedrock"
//! region = "us-east-1"              # credentials: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
//!                                   # AWS_SESSION_TOKEN; `url` optional (an endpoint, a mock)
//! weight = 2                        # optional: share among its priority (default 1)
//! priority = 1                      # optional: lower first (default 0)
//! models = ["claude-sonnet-4-5"]    # optional: the models it serves (default every one)
//! max_in_flight = 64                # optional: most calls at once there
//! http2 = true                      # optional, anthropic: many calls a connection
//! ```
//!
//! - `POST /v1/messages` goes through the pool: the body's `model` is the call's
//!   [`Model`], an upstream set aside by its breaker takes no call until its probe, and a
//!   call goes elsewhere only where its upstream provably did not run it (the library's
//!   `pool` module). The HTTP/1.1 upstreams share one HTTP client; one of `http2 = true`
//!   has connections of its own (the `http2` module).
//! - Message Batches go to Anthropic upstreams only (Bedrock has none): a create to the
//!   first of the lowest `priority` not set aside, every later call of a batch to the
//!   upstream that created it (the `batches` module records it with the owner).
//! - Other forwarded paths (`count_tokens`, `models`, ...) go to that same first Anthropic
//!   upstream; with none, to the first Bedrock one (which answers `count_tokens` and `404`
//!   for the rest).
//!
//! The keys file's `[[upstreams]]` is checked with the rest of the file (names, kinds,
//! URLs, regions, weights); the keys and AWS credentials are read from the environment
//! when the gateway starts. A reload (`SIGHUP`) keeps the pool it started with: a keys file
//! whose `[[upstreams]]` differ is refused (the previous file stays in force) until a
//! restart.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fairgate::BoxError;
use fairgate::pool::{Model, Pool, UpstreamState};
use fairgate::upstream::{AwsConfigError, AwsCredentials, BedrockLayer};
use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use http::{Request, Response, Uri};
use http_body_util::{BodyExt, Full};
use serde::Deserialize;
use tower::util::BoxCloneSyncService;
use tower::{ServiceBuilder, ServiceExt, service_fn};

use crate::body::Body;
use crate::body::{downstream, full};
use crate::config::upstreams::{Kind, UpstreamSpec, base_url};
use crate::proxy::upstream::{HttpClient, Upstream, client};

/// An upstream of the pool: a Messages API call in, the client's answer out.
pub(crate) type Member = BoxCloneSyncService<Request<Full<Bytes>>, Response<Body>, BoxError>;

/// A service over streamed bodies (the forwarded paths, on a Bedrock-only pool).
type Streamed = BoxCloneSyncService<Request<Body>, Response<Body>, BoxError>;

/// An Anthropic upstream, which also takes batches and the forwarded paths.
pub(crate) struct Api {
    pub(crate) name: Arc<str>,
    /// Its place in the pool.
    index: usize,
    priority: u32,
    pub(crate) upstream: Upstream,
}

/// The gateway's upstreams: the pool the messages go through, and the Anthropic upstreams
/// by name for the rest. Built once, at start.
pub(crate) struct Upstreams {
    pool: Pool<Member>,
    /// The Anthropic upstreams, in the file's order.
    apis: Vec<Api>,
    /// Each upstream's kind, in the pool's order.
    kinds: Vec<Kind>,
    /// The first Bedrock upstream over streamed bodies, for the forwarded paths when no
    /// Anthropic upstream is configured.
    bedrock: Option<Streamed>,
    /// What the keys file said (empty with `--upstream`): a reload must say the same.
    specs: Vec<UpstreamSpec>,
    /// Whether an upstream serves only some models (else a call's model is not read).
    by_model: bool,
}

impl Upstreams {
    /// `--upstream URL` with `key`, over HTTP/2 when `http2`: a pool of one, named `default`.
    pub(crate) fn single(url: &Uri, key: &str, http2: bool) -> Result<Upstreams, String> {
        let mut upstream = Upstream::new(client(), url, key)
            .map_err(|e| e.replace("the upstream key", "ANTHROPIC_API_KEY"))?;
        if http2 {
            upstream = upstream.http2();
        }
        let pool = Pool::builder()
            .upstream(fairgate::pool::Upstream::new(
                "default",
                anthropic_member(&upstream),
            ))
            .build()
            .map_err(|e| format!("the upstream pool: {e}"))?;
        Ok(Upstreams {
            pool,
            apis: vec![Api {
                name: "default".into(),
                index: 0,
                priority: 0,
                upstream,
            }],
            kinds: vec![Kind::Anthropic],
            bedrock: None,
            specs: Vec::new(),
            by_model: false,
        })
    }

    /// The keys file's (at `path`) `specs`, their keys read with `env`; refused, naming the
    /// line, when a key or the AWS credentials are missing.
    pub(crate) fn from_specs(
        path: &Path,
        (specs, spill_after): (&[UpstreamSpec], Duration),
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Upstreams, String> {
        let client = client();
        let mut builder = Pool::builder().spill_after(spill_after);
        let (mut apis, mut kinds, mut bedrock) = (Vec::new(), Vec::new(), None);
        for (index, spec) in specs.iter().enumerate() {
            let refused = |what: String| {
                format!(
                    "--keys {} line {}: [[upstreams]] `{}`: {what}",
                    path.display(),
                    spec.line,
                    spec.name
                )
            };
            let service = match spec.kind {
                Kind::Anthropic => {
                    let upstream = anthropic_upstream(spec, &client, &env).map_err(refused)?;
                    let member = anthropic_member(&upstream);
                    apis.push(Api {
                        name: spec.name.as_str().into(),
                        index,
                        priority: spec.priority,
                        upstream,
                    });
                    member
                }
                Kind::Bedrock => {
                    let credentials = aws_credentials(&env)
                        .ok_or_else(|| refused(AwsConfigError::MissingCredentials.to_string()))?;
                    let mut layer = BedrockLayer::builder()
                        .region(spec.region.clone().unwrap_or_default())
                        .credentials(credentials);
                    if let Some(url) = &spec.url {
                        layer = layer.base_url(url.clone());
                    }
                    let layer = layer.build().map_err(|e| refused(e.to_string()))?;
                    let (member, streamed) = bedrock_member(&client, &layer);
                    bedrock.get_or_insert(streamed);
                    member
                }
            };
            let mut upstream = fairgate::pool::Upstream::new(spec.name.as_str(), service)
                .weight(spec.weight)
                .priority(spec.priority);
            if let Some(models) = &spec.models {
                upstream = upstream.models(models.iter().cloned());
            }
            if let Some(max) = spec.max_in_flight {
                upstream = upstream.max_in_flight(max);
            }
            builder = builder.upstream(upstream);
            kinds.push(spec.kind);
        }
        let pool = builder
            .build()
            .map_err(|e| format!("--keys {}: [[upstreams]]: {e}", path.display()))?;
        Ok(Upstreams {
            pool,
            apis,
            kinds,
            bedrock,
            specs: specs.to_vec(),
            by_model: specs.iter().any(|spec| spec.models.is_some()),
        })
    }

    /// The pool `POST /v1/messages` goes through.
    pub(crate) fn pool(&self) -> &Pool<Member> {
        &self.pool
    }

    /// What the keys file said of the upstreams (empty with `--upstream`).
    pub(crate) fn specs(&self) -> &[UpstreamSpec] {
        &self.specs
    }

    /// Where a new batch (or a forwarded path) goes: the first Anthropic upstream of the
    /// lowest priority that is not set aside; else the first of them all. `None` without
    /// an Anthropic upstream.
    pub(crate) fn api(&self) -> Option<&Api> {
        let states = self.pool.upstreams();
        let mut apis: Vec<&Api> = self.apis.iter().collect();
        apis.sort_by_key(|api| api.priority); // stable: the file's order within a priority
        let taking = apis
            .iter()
            .copied()
            .find(|api| states.get(api.index).is_none_or(|s| !s.set_aside));
        taking.or(apis.first().copied())
    }

    /// The Anthropic upstream named `name`; with no name (an owner recorded before upstreams
    /// were), the first one. `None` when no such upstream is configured.
    pub(crate) fn api_named(&self, name: Option<&str>) -> Option<&Api> {
        match name {
            None => self.apis.first(),
            Some(name) => self.apis.iter().find(|api| &*api.name == name),
        }
    }

    /// Sends a forwarded path's request (its body streamed) to [`api`](Self::api), else to
    /// the first Bedrock upstream. (Boxed here, not an `async fn`: the boxed services'
    /// futures inside another future's state trip the compiler's `Send` check.)
    pub(crate) fn forward(
        &self,
        req: Request<Body>,
    ) -> BoxFuture<'static, Result<Response<Body>, BoxError>> {
        match (self.api(), &self.bedrock) {
            (Some(api), _) => {
                let upstream = api.upstream.clone();
                async move { upstream.send(req).await }.boxed()
            }
            (None, Some(bedrock)) => bedrock.clone().oneshot(req).boxed(),
            (None, None) => std::future::ready(Err("no upstream".into())).boxed(),
        }
    }

    /// Each upstream as it stands now, with its kind.
    pub(crate) fn states(&self) -> Vec<(UpstreamState, Kind)> {
        self.pool
            .upstreams()
            .into_iter()
            .zip(self.kinds.iter().copied())
            .collect()
    }

    /// Publishes each upstream's calls in flight, whether it is set aside, the calls it
    /// served, those moved away from it (by why) and those spilled to it past an earlier
    /// priority (read at scrape time).
    pub(crate) fn publish(&self) {
        for state in self.pool.upstreams() {
            let name = state.name.to_string();
            metrics::gauge!("gateway_upstream_in_flight", "upstream" => name.clone())
                .set(state.in_flight as f64);
            metrics::gauge!("gateway_upstream_set_aside", "upstream" => name.clone())
                .set(if state.set_aside { 1.0 } else { 0.0 });
            metrics::counter!("gateway_upstream_served_total", "upstream" => name.clone())
                .absolute(state.served);
            metrics::counter!("gateway_upstream_spilled_total", "upstream" => name.clone())
                .absolute(state.spilled);
            let refused = state.moved_away - state.moved_away_overloaded;
            for (reason, n) in [
                ("refused", refused),
                ("overloaded", state.moved_away_overloaded),
            ] {
                metrics::counter!("gateway_upstream_moved_away_total", "upstream" => name.clone(), "reason" => reason)
                    .absolute(n);
            }
        }
    }

    /// The upstreams as a JSON array, for `/status` and the live page.
    pub(crate) fn json(&self) -> String {
        let upstreams: Vec<serde_json::Value> = self
            .states()
            .into_iter()
            .map(|(state, kind)| {
                serde_json::json!({
                    "name": &*state.name,
                    "kind": kind.as_str(),
                    "in_flight": state.in_flight,
                    "set_aside": state.set_aside,
                    "served": state.served,
                    "moved_away": state.moved_away,
                    "moved_away_overloaded": state.moved_away_overloaded,
                    "spilled": state.spilled,
                })
            })
            .collect();
        serde_json::Value::Array(upstreams).to_string()
    }
}

impl Upstreams {
    /// The model `body` names, as the call's [`Model`], when an upstream serves only some
    /// (a compressed body names none: it goes to any upstream).
    pub(crate) fn model(&self, body: &[u8]) -> Option<Model> {
        self.by_model.then(|| model_of(body)).flatten()
    }
}

/// The AWS credentials of the standard environment (`AWS_ACCESS_KEY_ID`,
/// `AWS_SECRET_ACCESS_KEY`, and `AWS_SESSION_TOKEN` for temporary ones), as the library's
/// `AwsCredentials::from_env` reads them, from `env`.
fn aws_credentials(env: impl Fn(&str) -> Option<String>) -> Option<AwsCredentials> {
    let var = |name: &str| env(name).filter(|value| !value.is_empty());
    let credentials = AwsCredentials::new(var("AWS_ACCESS_KEY_ID")?, var("AWS_SECRET_ACCESS_KEY")?);
    Some(match var("AWS_SESSION_TOKEN") {
        Some(token) => credentials.session_token(token),
        None => credentials,
    })
}

/// The model the body of a Messages API call names.
fn model_of(body: &[u8]) -> Option<Model> {
    #[derive(Deserialize)]
    struct Named {
        model: Option<String>,
    }
    let named: Named = serde_json::from_slice(body).ok()?;
    named.model.map(Model)
}

/// An Anthropic upstream as a member of the pool.
fn anthropic_member(upstream: &Upstream) -> Member {
    let upstream = upstream.clone();
    BoxCloneSyncService::new(service_fn(move |req: Request<Full<Bytes>>| {
        let upstream = upstream.clone();
        async move {
            let req = req.map(|body| body.map_err(|never| match never {}).boxed_unsync());
            upstream.send(req).await
        }
    }))
}

/// The Anthropic upstream of `spec`, its key read with `env`, over `client` (or HTTP/2).
fn anthropic_upstream(
    spec: &UpstreamSpec,
    client: &HttpClient,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Upstream, String> {
    let var = spec.key_env.as_deref().unwrap_or_default();
    let key = env(var)
        .filter(|key| !key.trim().is_empty())
        .ok_or_else(|| format!("key_env {var} is not set in the environment"))?;
    let url = spec
        .url
        .as_deref()
        .and_then(base_url)
        .ok_or_else(|| "no url".to_owned())?;
    let upstream = Upstream::new(client.clone(), &url, key.trim())
        .map_err(|e| e.replace("the upstream key", var))?;
    Ok(if spec.http2 {
        upstream.http2()
    } else {
        upstream
    })
}

/// A Bedrock upstream as a member of the pool, and over streamed bodies.
fn bedrock_member(client: &HttpClient, layer: &BedrockLayer) -> (Member, Streamed) {
    let client = client.clone();
    let http = service_fn(move |req: Request<String>| {
        let client = client.clone();
        async move {
            let response = client.request(req.map(full)).await?;
            Ok::<_, BoxError>(downstream(response))
        }
    });
    let boxed = |response: Response<fairgate::upstream::UpstreamBody<Body>>| {
        response.map(BodyExt::boxed_unsync)
    };
    let member = ServiceBuilder::new()
        .map_response(boxed)
        .layer(layer.clone())
        .service(http.clone());
    let streamed = ServiceBuilder::new()
        .map_response(boxed)
        .layer(layer.clone())
        .service(http);
    (
        BoxCloneSyncService::new(member),
        BoxCloneSyncService::new(streamed),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::upstreams::parse_specs;
    use crate::config::upstreams::tests::TWO;

    const SPILL: Duration = Duration::from_secs(1);

    #[test]
    fn a_missing_key_or_aws_credentials_name_the_upstream_and_its_line() {
        let path = Path::new("keys.toml");
        let specs = parse_specs(TWO).unwrap();
        let err = Upstreams::from_specs(path, (&specs, SPILL), |_| None)
            .err()
            .unwrap();
        assert_eq!(
            err,
            "--keys keys.toml line 2: [[upstreams]] `primary`: key_env ANTHROPIC_API_KEY is \
             not set in the environment"
        );
        let only_key = |var: &str| (var == "ANTHROPIC_API_KEY").then(|| "sk-ant-1".to_owned());
        let err = Upstreams::from_specs(path, (&specs, SPILL), only_key)
            .err()
            .unwrap();
        assert!(
            err.starts_with(
                "--keys keys.toml line 8: [[upstreams]] `bedrock-east`: no AWS credentials"
            ),
            "{err}"
        );
        let pool = Upstreams::from_specs(path, (&specs[..1], SPILL), only_key).unwrap();
        assert_eq!(pool.api().map(|api| &*api.name), Some("primary"));
        assert!(pool.api_named(Some("bedrock-east")).is_none());
        assert_eq!(pool.api_named(None).map(|api| &*api.name), Some("primary"));
    }

    /// A Bedrock upstream of the keys file, at a local server standing for Bedrock: the
    /// call goes to `/model/{id}/invoke`, signed with the environment's credentials, and
    /// its answer comes back through the pool.
    #[tokio::test]
    async fn a_bedrock_upstream_is_signed_with_the_environments_credentials() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut head = Vec::new();
            let mut buf = [0u8; 4096];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = conn.read(&mut buf).await.unwrap();
                head.extend_from_slice(&buf[..n]);
            }
            let message = r#"{"type":"message","role":"assistant","content":[]}"#;
            let answer = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
                 connection: close\r\n\r\n{message}",
                message.len()
            );
            conn.write_all(answer.as_bytes()).await.unwrap();
            String::from_utf8_lossy(&head).into_owned()
        });
        let text = format!(
            "[[upstreams]]\nname = \"b\"\nkind = \"bedrock\"\nregion = \"us-east-1\"\n\
             url = \"http://{addr}\"\nmodels = [\"claude-sonnet-4-5\"]\n"
        );
        let specs = parse_specs(&text).unwrap();
        let env = |name: &str| match name {
            "AWS_ACCESS_KEY_ID" => Some("AKIDGATEWAYTEST".to_owned()),
            "AWS_SECRET_ACCESS_KEY" => Some("secret".to_owned()),
            _ => None,
        };
        let upstreams = Upstreams::from_specs(Path::new("k.toml"), (&specs, SPILL), env).unwrap();
        assert!(upstreams.api().is_none(), "Bedrock takes no batches");
        let body = r#"{"model":"claude-sonnet-4-5","max_tokens":8,"messages":[]}"#;
        let mut req = Request::post("http://gateway/v1/messages")
            .header("x-api-key", "sk-gw-client")
            .body(Full::new(Bytes::from(body)))
            .unwrap();
        let model = upstreams.model(body.as_bytes());
        assert_eq!(model, Some(Model("claude-sonnet-4-5".into())));
        req.extensions_mut().insert(model.unwrap());
        let response = upstreams.pool().clone().oneshot(req).await.unwrap();
        assert_eq!(response.status(), 200);
        let answer = response.into_body().collect().await.unwrap().to_bytes();
        assert!(answer.starts_with(br#"{"type":"message""#));
        let head = server.await.unwrap();
        assert!(head.starts_with("POST /model/"), "{head}");
        assert!(head.contains("/invoke HTTP/1.1"), "{head}");
        assert!(
            head.contains("AWS4-HMAC-SHA256 Credential=AKIDGATEWAYTEST/"),
            "{head}"
        );
        assert!(!head.contains("sk-gw-client"), "{head}");
    }

    #[test]
    fn the_model_is_read_from_the_body() {
        let body = br#"{"max_tokens":1,"model":"claude-x","messages":[]}"#;
        assert_eq!(model_of(body), Some(Model("claude-x".into())));
        assert_eq!(model_of(b"{}"), None);
        assert_eq!(model_of(b"not json"), None);
    }
}
