//! A Messages API request as Bedrock's: the path, the body, the signed headers.

use std::time::SystemTime;

use bytes::Bytes;
use http::{HeaderValue, Method, StatusCode, header};
use serde_json::{Map, Value};

use super::answer::{MessagesError, Operation};
use super::codec::{base64_encode, sha256_hex, uri_encode};
use super::models::ModelMap;
use super::sigv4::{self, AwsCredentials, SignRequest, SignScope};

/// The `anthropic_version` Bedrock's Messages API takes in the body.
pub const BEDROCK_ANTHROPIC_VERSION: &str = "bedrock-2023-05-31";

/// The largest request body read (Bedrock refuses larger ones anyway).
pub(crate) const MAX_REQUEST_BODY: usize = 32 * 1024 * 1024;

/// Where and as whom calls go.
#[derive(Debug)]
pub(crate) struct Config {
    pub(crate) region: String,
    pub(crate) credentials: AwsCredentials,
    /// Scheme and authority (`https://bedrock-runtime.us-east-1.amazonaws.com`).
    pub(crate) origin: String,
    /// The `host` header, the base URL's authority.
    pub(crate) host: String,
    /// The base URL's path, without a trailing `/`.
    pub(crate) prefix: String,
    pub(crate) models: ModelMap,
}

/// The Messages API request (head and whole body) as Bedrock's, signed at `now`, and what
/// it is; or the answer the Messages API would give to a request that cannot be sent.
pub(crate) fn to_bedrock(
    config: &Config,
    parts: http::request::Parts,
    body: &[u8],
    now: SystemTime,
) -> Result<(http::Request<String>, Operation), MessagesError> {
    let count = match (&parts.method, parts.uri.path()) {
        (&Method::POST, "/v1/messages") => false,
        (&Method::POST, "/v1/messages/count_tokens") => true,
        (method, path) => {
            return Err(MessagesError::new(
                StatusCode::NOT_FOUND,
                "not_found_error",
                format!(
                    "{method} {path}: Bedrock serves POST /v1/messages and its count_tokens only"
                ),
            ));
        }
    };
    let (model, stream, mut fields) = read_body(body)?;
    let Some(model_id) = config.models.resolve(&model) else {
        return Err(MessagesError::new(
            StatusCode::NOT_FOUND,
            "not_found_error",
            format!("model: {model}"),
        ));
    };
    fields
        .entry("anthropic_version")
        .or_insert_with(|| BEDROCK_ANTHROPIC_VERSION.into());
    add_betas(&parts.headers, &mut fields);
    let (operation, action, body, model_id) = if count {
        // An invoke body counts as it would be sent (it needs a `max_tokens`), and counting
        // takes a model id, not an inference profile's.
        fields.entry("max_tokens").or_insert(1.into());
        let invoke = Value::Object(fields).to_string();
        let body = serde_json::json!({"input": {"invokeModel": {"body": base64_encode(invoke.as_bytes())}}});
        let model_id = match model_id.find("anthropic.") {
            Some(at) if !model_id.starts_with("arn:") => model_id[at..].to_owned(),
            _ => model_id,
        };
        (
            Operation::CountTokens,
            "count-tokens",
            body.to_string(),
            model_id,
        )
    } else if stream {
        let body = Value::Object(fields).to_string();
        (
            Operation::Stream,
            "invoke-with-response-stream",
            body,
            model_id,
        )
    } else {
        (
            Operation::Invoke,
            "invoke",
            Value::Object(fields).to_string(),
            model_id,
        )
    };
    let path = format!(
        "{}/model/{}/{action}",
        config.prefix,
        uri_encode(&model_id, false)
    );
    let request = signed(config, parts, path, body, operation, now).map_err(|e| {
        MessagesError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "api_error",
            e.to_string(),
        )
    })?;
    Ok((request, operation))
}

/// The body's `model`, its `stream` flag, and the rest of its fields.
fn read_body(body: &[u8]) -> Result<(String, bool, Map<String, Value>), MessagesError> {
    let invalid =
        |text: &str| MessagesError::new(StatusCode::BAD_REQUEST, "invalid_request_error", text);
    let Ok(Value::Object(mut fields)) = serde_json::from_slice::<Value>(body) else {
        return Err(invalid("the body is not a JSON object"));
    };
    let Some(Value::String(model)) = fields.remove("model") else {
        return Err(invalid("model: Field required"));
    };
    let stream = match fields.remove("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(stream)) => stream,
        Some(_) => return Err(invalid("stream: Input should be a valid boolean")),
    };
    Ok((model, stream, fields))
}

/// The `anthropic-beta` header's values as the body's `anthropic_beta` list, unless the body
/// has one.
fn add_betas(headers: &http::HeaderMap, fields: &mut Map<String, Value>) {
    let betas: Vec<Value> = headers
        .get_all("anthropic-beta")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(Value::from)
        .collect();
    if !betas.is_empty() {
        fields
            .entry("anthropic_beta")
            .or_insert(Value::Array(betas));
    }
}

/// The request to `path` with `body`, its headers signed with SigV4 (service `bedrock`).
/// The caller's headers (its `x-api-key`, `anthropic-version`, ...) stay behind; its
/// extensions go along.
fn signed(
    config: &Config,
    parts: http::request::Parts,
    path: String,
    body: String,
    operation: Operation,
    now: SystemTime,
) -> Result<http::Request<String>, http::Error> {
    let amz_date = sigv4::amz_date(now);
    let payload_sha256 = sha256_hex(body.as_bytes());
    let accept = if operation == Operation::Stream {
        "application/vnd.amazon.eventstream"
    } else {
        "application/json"
    };
    let mut headers: Vec<(&str, &str)> = vec![
        ("host", &config.host),
        ("content-type", "application/json"),
        ("accept", accept),
        ("x-amz-date", &amz_date),
        ("x-amz-content-sha256", &payload_sha256),
    ];
    if let Some(token) = config.credentials.token() {
        headers.push(("x-amz-security-token", token));
    }
    let scope = SignScope {
        region: &config.region,
        service: "bedrock",
        amz_date: &amz_date,
    };
    let to_sign = SignRequest {
        method: "POST",
        path: &path,
        query: "",
        headers: &headers,
        payload_sha256: &payload_sha256,
    };
    let authorization = sigv4::authorization(&config.credentials, &scope, &to_sign);
    let mut builder = http::Request::post(format!("{}{path}", config.origin));
    for (name, value) in &headers {
        builder = builder.header(*name, HeaderValue::from_str(value)?);
    }
    let mut request = builder
        .header(header::AUTHORIZATION, authorization)
        .header(header::CONTENT_LENGTH, body.len())
        .body(body)?;
    *request.extensions_mut() = parts.extensions;
    Ok(request)
}

/// The answer to a request body over [`MAX_REQUEST_BODY`].
pub(crate) fn too_large() -> MessagesError {
    MessagesError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "request_too_large",
        format!("the request body is over {MAX_REQUEST_BODY} bytes"),
    )
}

/// A request read whole, as Bedrock's, signed now.
pub(crate) fn prepare(
    config: &Config,
    parts: http::request::Parts,
    body: Bytes,
) -> Result<(http::Request<String>, Operation), MessagesError> {
    to_bedrock(config, parts, &body, SystemTime::now())
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use super::*;
    use crate::upstream::BedrockLayer;

    fn config() -> std::sync::Arc<Config> {
        BedrockLayer::builder()
            .region("us-west-2")
            .credentials(AwsCredentials::new("AKID", "secret").session_token("tok"))
            .base_url("http://127.0.0.1:9/prefix/")
            .build()
            .unwrap()
            .config()
    }

    fn call(body: &str, headers: &[(&str, &str)]) -> Result<http::Request<String>, MessagesError> {
        call_to("/v1/messages?beta=true", body, headers).map(|(req, _)| req)
    }

    fn call_to(
        path: &str,
        body: &str,
        headers: &[(&str, &str)],
    ) -> Result<(http::Request<String>, Operation), MessagesError> {
        let mut builder = http::Request::post(format!("http://gateway{path}"));
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        let (parts, ()) = builder.body(()).unwrap().into_parts();
        let now = UNIX_EPOCH + Duration::from_secs(1_440_938_160);
        to_bedrock(&config(), parts, body.as_bytes(), now)
    }

    #[test]
    fn a_messages_call_becomes_a_signed_bedrock_invoke() {
        let req = call(
            r#"{"model":"claude-haiku-4-5","stream":true,"max_tokens":9,"messages":[]}"#,
            &[
                ("x-api-key", "sk-ant-x"),
                ("anthropic-version", "2023-06-01"),
                ("anthropic-beta", "a-1, b-2"),
            ],
        )
        .unwrap();
        assert_eq!(
            req.uri(),
            "http://127.0.0.1:9/prefix/model/anthropic.claude-haiku-4-5-20251001-v1%3A0\
             /invoke-with-response-stream"
        );
        let body: Value = serde_json::from_str(req.body()).unwrap();
        assert_eq!(
            body,
            serde_json::json!({
                "max_tokens": 9, "messages": [],
                "anthropic_version": "bedrock-2023-05-31",
                "anthropic_beta": ["a-1", "b-2"],
            })
        );
        let headers = req.headers();
        assert!(headers.get("x-api-key").is_none() && headers.get("anthropic-version").is_none());
        assert_eq!(headers["host"], "127.0.0.1:9");
        assert_eq!(headers["x-amz-date"], "20150830T123600Z");
        assert_eq!(headers["x-amz-security-token"], "tok");
        assert_eq!(headers["accept"], "application/vnd.amazon.eventstream");
        assert_eq!(
            headers["x-amz-content-sha256"],
            sha256_hex(req.body().as_bytes())
        );
        let auth = headers["authorization"].to_str().unwrap();
        assert!(
            auth.starts_with(
                "AWS4-HMAC-SHA256 Credential=AKID/20150830/us-west-2/bedrock/aws4_request, \
                 SignedHeaders=accept;content-type;host;x-amz-content-sha256;x-amz-date;\
                 x-amz-security-token, Signature="
            ),
            "{auth}"
        );
    }

    #[test]
    fn requests_bedrock_cannot_serve_are_answered_without_a_call() {
        let refused = |body: &str| call(body, &[]).unwrap_err();
        let unknown = refused(r#"{"model":"gpt-4o","messages":[]}"#);
        assert_eq!(
            (unknown.status.as_u16(), unknown.kind),
            (404, "not_found_error")
        );
        assert_eq!(unknown.message, "model: gpt-4o");
        for bad in [
            "[]",
            "{",
            r#"{"messages":[]}"#,
            r#"{"model":"claude-haiku-4-5","stream":"yes"}"#,
        ] {
            assert_eq!(refused(bad).kind, "invalid_request_error", "{bad}");
        }
        let (parts, ()) = http::Request::get("http://gateway/v1/models")
            .body(())
            .unwrap()
            .into_parts();
        let error = to_bedrock(&config(), parts, b"", SystemTime::now()).unwrap_err();
        assert_eq!(
            (error.status.as_u16(), error.kind),
            (404, "not_found_error")
        );
    }

    #[test]
    fn counting_tokens_sends_the_invoke_body_to_count_tokens() {
        let (req, operation) = call_to(
            "/v1/messages/count_tokens",
            r#"{"model":"us.anthropic.claude-haiku-4-5-20251001-v1:0","messages":[]}"#,
            &[],
        )
        .unwrap();
        assert_eq!(operation, Operation::CountTokens);
        assert_eq!(
            req.uri().path(),
            "/prefix/model/anthropic.claude-haiku-4-5-20251001-v1%3A0/count-tokens"
        );
        let body: Value = serde_json::from_str(req.body()).unwrap();
        let invoke = body["input"]["invokeModel"]["body"].as_str().unwrap();
        let invoke: Value =
            serde_json::from_slice(&crate::upstream::codec::base64_decode(invoke).unwrap())
                .unwrap();
        assert_eq!(
            invoke,
            serde_json::json!({
                "messages": [], "max_tokens": 1, "anthropic_version": "bedrock-2023-05-31",
            })
        );
    }

    #[test]
    fn an_arn_is_encoded_whole_in_the_path() {
        let req = call(
            r#"{"model":"arn:aws:bedrock:us-west-2:1:inference-profile/us.x","messages":[]}"#,
            &[],
        )
        .unwrap();
        assert_eq!(
            req.uri().path(),
            "/prefix/model/arn%3Aaws%3Abedrock%3Aus-west-2%3A1%3Ainference-profile%2Fus.x/invoke"
        );
        assert_eq!(req.headers()["accept"], "application/json");
    }
}
