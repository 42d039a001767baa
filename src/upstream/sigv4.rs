//! AWS Signature Version 4 for one request, as a plain function of plain data: the
//! canonical request, the string to sign, the signing key and the `Authorization` header
//! ("Create a signed AWS API request" in the IAM user guide). The caller chooses the headers
//! to sign and supplies the time, so the signature is a pure function tested against AWS's
//! published test suite.

use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};

use super::codec::{hex, hmac_sha256, sha256_hex, uri_encode};

/// The algorithm name that opens the string to sign and the `Authorization` header.
const ALGORITHM: &str = "AWS4-HMAC-SHA256";

/// AWS credentials: an access key id, its secret and, for temporary credentials, a
/// session token.
///
/// `Debug` shows the access key id only, never the secret or the token.
#[derive(Clone, PartialEq, Eq)]
pub struct AwsCredentials {
    access_key_id: String,
    secret_access_key: String,
    session_token: Option<String>,
}

impl AwsCredentials {
    /// Long-term credentials (no session token).
    pub fn new(access_key_id: impl Into<String>, secret_access_key: impl Into<String>) -> Self {
        AwsCredentials {
            access_key_id: access_key_id.into(),
            secret_access_key: secret_access_key.into(),
            session_token: None,
        }
    }

    /// With the session token of temporary credentials (sent as `x-amz-security-token`).
    pub fn session_token(mut self, token: impl Into<String>) -> Self {
        self.session_token = Some(token.into());
        self
    }

    /// The standard AWS environment: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` and, when
    /// set, `AWS_SESSION_TOKEN`; `None` when either of the first two is missing or empty.
    pub fn from_env() -> Option<Self> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// [`from_env`](Self::from_env) with `env` for the environment.
    pub(crate) fn from_vars(env: impl Fn(&str) -> Option<String>) -> Option<Self> {
        let var = |name: &str| env(name).filter(|v| !v.is_empty());
        let mut credentials =
            AwsCredentials::new(var("AWS_ACCESS_KEY_ID")?, var("AWS_SECRET_ACCESS_KEY")?);
        credentials.session_token = var("AWS_SESSION_TOKEN");
        Some(credentials)
    }

    /// The access key id.
    pub fn access_key_id(&self) -> &str {
        &self.access_key_id
    }

    pub(crate) fn token(&self) -> Option<&str> {
        self.session_token.as_deref()
    }
}

impl fmt::Debug for AwsCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AwsCredentials")
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"<redacted>")
            .field(
                "session_token",
                &self.session_token.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}

/// One request to sign. `path` is the path as it goes on the wire (already percent-encoded
/// where the caller encoded it: the signature encodes it once more, as AWS does for every
/// service but S3); `query` is the raw query string, without `?`; `headers` are the
/// headers to sign (`host` among them), names in any case.
#[derive(Debug)]
pub(crate) struct SignRequest<'a> {
    pub(crate) method: &'a str,
    pub(crate) path: &'a str,
    pub(crate) query: &'a str,
    pub(crate) headers: &'a [(&'a str, &'a str)],
    pub(crate) payload_sha256: &'a str,
}

/// Where and when a request is signed: the region, the service (`bedrock` for Bedrock
/// runtime) and the time as `YYYYMMDDTHHMMSSZ`, the value of `x-amz-date`.
#[derive(Debug)]
pub(crate) struct SignScope<'a> {
    pub(crate) region: &'a str,
    pub(crate) service: &'a str,
    pub(crate) amz_date: &'a str,
}

impl SignScope<'_> {
    /// `YYYYMMDD/region/service/aws4_request`.
    fn credential_scope(&self) -> String {
        let date = self.amz_date.get(..8).unwrap_or(self.amz_date);
        format!("{date}/{}/{}/aws4_request", self.region, self.service)
    }
}

/// The canonical request and the list of signed header names (`a;b;c`).
pub(crate) fn canonical_request(req: &SignRequest<'_>) -> (String, String) {
    let mut headers: Vec<(String, String)> = req
        .headers
        .iter()
        .map(|(name, value)| {
            let value = value.split_whitespace().collect::<Vec<_>>().join(" ");
            (name.to_ascii_lowercase(), value)
        })
        .collect();
    headers.sort();
    let mut canonical_headers = String::new();
    for (name, value) in &headers {
        canonical_headers.push_str(&format!("{name}:{value}\n"));
    }
    let signed: Vec<&str> = headers.iter().map(|(name, _)| name.as_str()).collect();
    let signed = signed.join(";");
    let mut query: Vec<(&str, &str)> = req
        .query
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| pair.split_once('=').unwrap_or((pair, "")))
        .collect();
    query.sort_unstable();
    let query: Vec<String> = query.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let path = if req.path.is_empty() { "/" } else { req.path };
    let canonical = format!(
        "{}\n{}\n{}\n{canonical_headers}\n{signed}\n{}",
        req.method,
        uri_encode(path, true),
        query.join("&"),
        req.payload_sha256
    );
    (canonical, signed)
}

/// The string to sign for a canonical request.
pub(crate) fn string_to_sign(scope: &SignScope<'_>, canonical_request: &str) -> String {
    format!(
        "{ALGORITHM}\n{}\n{}\n{}",
        scope.amz_date,
        scope.credential_scope(),
        sha256_hex(canonical_request.as_bytes())
    )
}

/// The `Authorization` header value for `req`, signed with `credentials` in `scope`.
pub(crate) fn authorization(
    credentials: &AwsCredentials,
    scope: &SignScope<'_>,
    req: &SignRequest<'_>,
) -> String {
    let (canonical, signed_headers) = canonical_request(req);
    let to_sign = string_to_sign(scope, &canonical);
    let date = scope.amz_date.get(..8).unwrap_or(scope.amz_date);
    let secret = format!("AWS4{}", credentials.secret_access_key);
    let mut key = hmac_sha256(secret.as_bytes(), date.as_bytes());
    for part in [scope.region, scope.service, "aws4_request"] {
        key = hmac_sha256(&key, part.as_bytes());
    }
    let signature = hex(&hmac_sha256(&key, to_sign.as_bytes()));
    format!(
        "{ALGORITHM} Credential={}/{}, SignedHeaders={signed_headers}, Signature={signature}",
        credentials.access_key_id,
        scope.credential_scope()
    )
}

/// `time` as `x-amz-date` writes it: `YYYYMMDDTHHMMSSZ`, UTC.
pub(crate) fn amz_date(time: SystemTime) -> String {
    let secs = time.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (year, month, day) = civil_from_days(days);
    format!(
        "{year:04}{month:02}{day:02}T{:02}{:02}{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// The proleptic Gregorian date of a count of days since 1970-01-01 (Howard Hinnant's
/// `civil_from_days`, for days on or after the epoch).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// The credentials, region, service and time of AWS's SigV4 test suite.
    fn suite_credentials() -> AwsCredentials {
        AwsCredentials::new("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY")
    }

    const SUITE_SCOPE: SignScope<'static> = SignScope {
        region: "us-east-1",
        service: "service",
        amz_date: "20150830T123600Z",
    };

    const EMPTY_SHA256: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

    fn suite(method: &str, path: &str, query: &str, extra: &[(&str, &str)]) -> String {
        let mut headers = vec![
            ("Host", "example.amazonaws.com"),
            ("X-Amz-Date", "20150830T123600Z"),
        ];
        headers.extend_from_slice(extra);
        let req = SignRequest {
            method,
            path,
            query,
            headers: &headers,
            payload_sha256: EMPTY_SHA256,
        };
        authorization(&suite_credentials(), &SUITE_SCOPE, &req)
    }

    fn signature(authorization: &str) -> &str {
        authorization.rsplit("Signature=").next().unwrap()
    }

    /// `get-vanilla`: the canonical request, the string to sign and the header, in full.
    #[test]
    fn get_vanilla_signs_as_the_aws_test_suite() {
        let headers = [
            ("Host", "example.amazonaws.com"),
            ("X-Amz-Date", "20150830T123600Z"),
        ];
        let req = SignRequest {
            method: "GET",
            path: "/",
            query: "",
            headers: &headers,
            payload_sha256: EMPTY_SHA256,
        };
        let (canonical, signed) = canonical_request(&req);
        assert_eq!(
            canonical,
            "GET\n/\n\nhost:example.amazonaws.com\nx-amz-date:20150830T123600Z\n\n\
             host;x-amz-date\n\
             e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(signed, "host;x-amz-date");
        assert_eq!(
            string_to_sign(&SUITE_SCOPE, &canonical),
            "AWS4-HMAC-SHA256\n20150830T123600Z\n20150830/us-east-1/service/aws4_request\n\
             bb579772317eb040ac9ed261061d46c1f17a8133879d6129b6e1c25292927e63"
        );
        assert_eq!(
            authorization(&suite_credentials(), &SUITE_SCOPE, &req),
            "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, \
             SignedHeaders=host;x-amz-date, \
             Signature=5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31"
        );
    }

    /// `post-vanilla`, the query-order, UTF-8 and header-value cases of the suite.
    #[test]
    fn the_other_test_suite_requests_sign_as_published() {
        let cases = [
            (
                suite("POST", "/", "", &[]),
                "5da7c1a2acd57cee7505fc6676e4e544621c30862966e37dddb68e92efbe5d6b",
            ),
            (
                suite("GET", "/", "Param2=value2&Param1=value1", &[]),
                "b97d918cfa904a5beff61c982a1b6f458b799221646efd99d3219ec94cdf2500",
            ),
            (
                suite("GET", "/", "Param1=value1", &[]),
                "a67d582fa61cc504c4bae71f336f98b97f1ea3c7a6bfe1b6e45aec72011b9aeb",
            ),
            (
                suite("GET", "/ሴ", "", &[]),
                "8318018e0b0f223aa2bbf98705b62bb787dc9c0e678f255a891fd03141be5d85",
            ),
            (
                suite("POST", "/", "Param1=value1", &[]),
                "28038455d6de14eafc1f9222cf5aa6f1a96197d7deb8263271d420d138af7f11",
            ),
        ];
        for (authorization, expected) in &cases {
            assert_eq!(signature(authorization), *expected, "{authorization}");
        }
    }

    /// `post-sts-header-before`: temporary credentials, their token signed as
    /// `x-amz-security-token`.
    #[test]
    fn a_session_token_is_signed_as_the_test_suite_signs_it() {
        const TOKEN: &str = "AQoDYXdzEPT//////////wEXAMPLEtc764bNrC9SAPBSM22wDOk4x4HIZ8j4FZTwdQWLWsKWHGB\
            uFqwAeMicRXmxfpSPfIeoIYRqTflfKD8YUuwthAx7mSEI/qkPpKPi/kMcGdQrmGdeehM4IC1NtBmUpp2wUE8p\
            hUZampKsburEDy0KPkyQDYwT7WZ0wq5VSXDvp75YU9HFvlRd8Tx6q6fE8YQcHNVXAkiY9q6d+xo0rKwT38xV\
            qr7ZD0u0iPPkUL64lIZbqBAz+scqKmlzm8FDrypNC9Yjc8fPOLn9FX9KSYvKTr4rvx3iSIlTJabIQwj2ICCR/\
            oLxBA==";
        let authorization = suite("POST", "/", "", &[("X-Amz-Security-Token", TOKEN)]);
        assert_eq!(
            authorization,
            "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, \
             SignedHeaders=host;x-amz-date;x-amz-security-token, \
             Signature=85d96828115b5dc0cfc3bd16ad9e210dd772bbebba041836c64533a82be05ead"
        );
    }

    #[test]
    fn header_values_are_trimmed_and_their_spaces_collapsed() {
        let req = SignRequest {
            method: "GET",
            path: "/",
            query: "",
            headers: &[("My-Header1", "  value1  with   spaces "), ("HOST", "h")],
            payload_sha256: EMPTY_SHA256,
        };
        let (canonical, signed) = canonical_request(&req);
        assert!(canonical.contains("\nhost:h\nmy-header1:value1 with spaces\n"));
        assert_eq!(signed, "host;my-header1");
    }

    #[test]
    fn amz_date_is_utc_in_the_basic_format() {
        let at = |secs| amz_date(UNIX_EPOCH + Duration::from_secs(secs));
        assert_eq!(at(1_440_938_160), "20150830T123600Z");
        assert_eq!(at(0), "19700101T000000Z");
        assert_eq!(at(951_782_400), "20000229T000000Z");
        assert_eq!(at(4_102_444_799), "20991231T235959Z");
    }

    #[test]
    fn debug_hides_the_secret_and_the_token() {
        let shown = format!("{:?}", suite_credentials().session_token("tok-secret"));
        assert!(shown.contains("AKIDEXAMPLE"), "{shown}");
        assert!(
            !shown.contains("EXAMPLEKEY") && !shown.contains("tok-secret"),
            "{shown}"
        );
    }
}
