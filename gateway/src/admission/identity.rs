//! Who a `POST /v1/messages` call is for and what it may claim: the gateway's job
//! extractor.
//!
//! A key stands for a tenant (a team, or a service). A key with `users = true` acts for the
//! end users of its service: each call names its user, in the body's `metadata.user_id`
//! (the Messages API's own field, which the SDKs send) or else in `x-fairgate-user`, and
//! the user is a tenant inside the service's namespace: `service/` and 32 hex digits of an
//! HMAC-SHA-256 of the service's tenant name and the user id. Two services never share a
//! user, and logs, metrics and recordings never hold a user id in clear.
//!
//! The HMAC key is the keys file's `user_secret` (a fleet shares its keys file, so every
//! gateway names a user alike; without one the key is empty and a user's name can be
//! recomputed by whoever knows the id). The message starts with the service's tenant name,
//! so one user id under two services gives two names no reader of `/usage` can link, and
//! rotating a service's key renames no one (its budgets and usage rows go on).
//!
//! A call may claim a tier (`x-fairgate-tier`), an origin (`x-fairgate-origin`: `user`,
//! `scheduled`, `batch`) and an SLA (`x-fairgate-sla`, seconds) only within what its key
//! lists (`tiers`, `origins`; an SLA needs `scheduled` among the origins and is refused on
//! a batch call, which stays batch). A claim beyond them is a `403 permission_error` naming
//! the header, never silently lowered: a client that could name any tier could name itself
//! premium. The priority stays the classifier's alone.
//!
//! Each key's calls are one group of the fair queue ([`Job::with_group`]): inside a tier the
//! order goes across keys first, each one share, then across a service's end users, so a
//! service cannot crowd out the others with many (or invented) users.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use fairgate::{Job, Origin, TenantId, Tier};
use hmac::{Hmac, Mac};
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::{Response, StatusCode};
use sha2::Sha256;

use crate::body::Body;
use crate::body::full;

/// The claim headers (every `x-fairgate-*` header is dropped before the upstream).
pub(crate) static USER: HeaderName = HeaderName::from_static("x-fairgate-user");
pub(crate) static TIER: HeaderName = HeaderName::from_static("x-fairgate-tier");
pub(crate) static ORIGIN: HeaderName = HeaderName::from_static("x-fairgate-origin");
pub(crate) static SLA: HeaderName = HeaderName::from_static("x-fairgate-sla");

/// The longest end-user id taken, in bytes.
const MAX_USER: usize = 256;

/// An origin by its name in the keys file and the claim header.
pub(crate) fn parse_origin(name: &str) -> Option<Origin> {
    match name {
        "user" => Some(Origin::UserAction),
        "scheduled" => Some(Origin::Scheduled),
        "batch" => Some(Origin::BatchJob),
        _ => None,
    }
}

pub(crate) fn origin_name(origin: Origin) -> &'static str {
    match origin {
        Origin::UserAction => "user",
        Origin::Scheduled => "scheduled",
        Origin::BatchJob => "batch",
    }
}

/// A key's claims as the keys file gives them (checked there).
pub(crate) struct Claims {
    pub(crate) origin: Origin,
    pub(crate) origins: Vec<Origin>,
    pub(crate) tiers: Vec<String>,
}

/// Every key's policy, by the key's SHA-256 (hashed once per request, with the look-up
/// of its holder).
#[derive(Clone, Default)]
pub(crate) struct Identities {
    by_hash: HashMap<[u8; 32], Arc<KeyPolicy>>,
}

impl Identities {
    pub(crate) fn insert(&mut self, sha256: [u8; 32], policy: KeyPolicy) {
        self.by_hash.insert(sha256, Arc::new(policy));
    }

    pub(crate) fn get_sha256(&self, sha256: &[u8; 32]) -> Option<&Arc<KeyPolicy>> {
        self.by_hash.get(sha256)
    }
}

/// What one key stands for and may claim.
pub(crate) struct KeyPolicy {
    tenant: TenantId,
    /// `tenant/`: the namespace of its end users.
    prefix: Box<str>,
    tier: Tier,
    origin: Origin,
    tiers: Box<[Tier]>,
    origins: Box<[Origin]>,
    /// Set for a key that acts for end users: how their ids are hashed.
    users: Option<UserHash>,
}

impl KeyPolicy {
    /// The policy of a key for `tenant` on `tier`; when it acts for end users (`users`),
    /// their ids are hashed with `secret` (the keys file's `user_secret`).
    pub(crate) fn new(
        tenant: &str,
        tier: &str,
        claims: Claims,
        (users, secret): (bool, Option<&[u8]>),
    ) -> Self {
        KeyPolicy {
            tenant: TenantId::new(tenant),
            prefix: format!("{tenant}/").into(),
            tier: Tier::new(tier),
            origin: claims.origin,
            tiers: claims.tiers.iter().map(Tier::new).collect(),
            origins: claims.origins.into(),
            users: users.then(|| UserHash::new(secret.unwrap_or_default(), tenant)),
        }
    }

    /// The job of a call with these headers, whose body's `metadata.user_id` is
    /// `body_user` (read from the decoded body with its cost), or why it is refused.
    pub(crate) fn identify(
        &self,
        headers: &HeaderMap,
        body_user: Option<&str>,
    ) -> Result<Job, Refused> {
        let tenant = match &self.users {
            Some(hash) => {
                let user = user_of(headers, body_user)?;
                TenantId::from(hash.tenant(&self.prefix, user.as_bytes()))
            }
            None if headers.contains_key(&USER) => {
                return Err(Refused::forbidden(
                    &USER,
                    "this key does not act for end users (`users = true` in the keys file)",
                ));
            }
            None => self.tenant.clone(),
        };
        let origin = match header(headers, &ORIGIN)? {
            None => self.origin,
            Some(name) => {
                let origin = parse_origin(name).ok_or_else(|| {
                    Refused::invalid(&ORIGIN, "must be `user`, `scheduled` or `batch`")
                })?;
                if !self.origins.contains(&origin) {
                    return Err(Refused::forbidden(
                        &ORIGIN,
                        "the key may not claim this origin (its `origins` in the keys file)",
                    ));
                }
                origin
            }
        };
        let tier = match header(headers, &TIER)? {
            None => self.tier.clone(),
            Some(name) => self
                .tiers
                .iter()
                .find(|tier| tier.as_str() == name)
                .cloned()
                .ok_or_else(|| {
                    Refused::forbidden(
                        &TIER,
                        "the key may not claim this tier (its `tiers` in the keys file)",
                    )
                })?,
        };
        // Every key is a group of its own inside its tier: the fair order goes across keys
        // first (each one share of its tier), then across a service's end users.
        let mut job = Job::new(tenant, origin)
            .with_tier(tier)
            .with_group(self.tenant.clone());
        if let Some(secs) = header(headers, &SLA)? {
            let sla = secs
                .parse::<f64>()
                .ok()
                .filter(|s| *s > 0.0)
                .and_then(|s| Duration::try_from_secs_f64(s).ok())
                .ok_or_else(|| Refused::invalid(&SLA, "must be a positive number of seconds"))?;
            if !self.origins.contains(&Origin::Scheduled) {
                return Err(Refused::forbidden(
                    &SLA,
                    "the key may not claim an SLA (`scheduled` is not among its `origins`)",
                ));
            }
            if origin == Origin::BatchJob {
                // A batch call stays batch: an SLA would make it standard.
                return Err(Refused::forbidden(&SLA, "a batch call has no SLA"));
            }
            job = job.with_sla(sla);
        }
        Ok(job)
    }
}

/// A header's value, trimmed; `None` when absent or empty.
fn header<'a>(
    headers: &'a HeaderMap,
    name: &'static HeaderName,
) -> Result<Option<&'a str>, Refused> {
    match headers.get(name) {
        None => Ok(None),
        Some(value) => value
            .to_str()
            .map(|v| Some(v.trim()).filter(|v| !v.is_empty()))
            .map_err(|_| Refused::invalid(name, "must be visible ASCII")),
    }
}

/// The end user a call names: the body's `metadata.user_id`, else `x-fairgate-user`.
fn user_of<'a>(headers: &'a HeaderMap, body_user: Option<&'a str>) -> Result<&'a str, Refused> {
    if let Some(user) = body_user.filter(|user| !user.is_empty()) {
        if user.len() > MAX_USER {
            return Err(Refused::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "metadata.user_id",
                format!("metadata.user_id: longer than {MAX_USER} bytes"),
            ));
        }
        return Ok(user);
    }
    match header(headers, &USER)? {
        Some(user) if user.len() > MAX_USER => {
            Err(Refused::invalid(&USER, "longer than 256 bytes"))
        }
        Some(user) => Ok(user),
        None => Err(Refused::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "metadata.user_id",
            "metadata.user_id: this key acts for end users, and the call names none \
             (give `metadata.user_id` in the body, or the x-fairgate-user header)"
                .into(),
        )),
    }
}

/// HMAC-SHA-256 keyed by the `user_secret`, its key and the service's tenant name absorbed
/// once: a user id then costs two short hashes.
struct UserHash {
    service: Hmac<Sha256>,
}

impl UserHash {
    fn new(secret: &[u8], tenant: &str) -> Self {
        // Any key length is taken (a long one is hashed first, RFC 2104).
        let mut service = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes any key");
        // The name's length first: no tenant name and user id run into another pair.
        service.update(&(tenant.len() as u64).to_be_bytes());
        service.update(tenant.as_bytes());
        UserHash { service }
    }

    fn mac(&self, user: &[u8]) -> [u8; 32] {
        self.service
            .clone()
            .chain_update(user)
            .finalize()
            .into_bytes()
            .into()
    }

    /// `prefix` and the first 16 bytes of the user's MAC in hex.
    fn tenant(&self, prefix: &str, user: &[u8]) -> String {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mac = self.mac(user);
        let mut name = String::with_capacity(prefix.len() + 32);
        name.push_str(prefix);
        for byte in &mac[..16] {
            name.push(char::from(HEX[usize::from(byte >> 4)]));
            name.push(char::from(HEX[usize::from(byte & 15)]));
        }
        name
    }
}

/// A call refused before the stack: Anthropic's error shape, the header or field named.
#[derive(Debug)]
pub(crate) struct Refused {
    status: StatusCode,
    kind: &'static str,
    /// The header or field refused: the metric's label (a fixed name, never a value).
    what: &'static str,
    message: String,
}

impl Refused {
    fn new(status: StatusCode, kind: &'static str, what: &'static str, message: String) -> Self {
        Refused {
            status,
            kind,
            what,
            message,
        }
    }

    fn invalid(header: &'static HeaderName, why: &str) -> Self {
        Refused::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            header.as_str(),
            format!("{header}: {why}"),
        )
    }

    fn forbidden(header: &'static HeaderName, why: &str) -> Self {
        Refused::new(
            StatusCode::FORBIDDEN,
            "permission_error",
            header.as_str(),
            format!("{header}: {why}"),
        )
    }

    /// Counted in `gateway_claim_refusals_total{what, status}`.
    pub(crate) fn response(&self) -> Response<Body> {
        metrics::counter!(
            "gateway_claim_refusals_total",
            "what" => self.what,
            "status" => self.status.as_str().to_owned()
        )
        .increment(1);
        let body = serde_json::json!({
            "type": "error",
            "error": { "type": self.kind, "message": self.message },
        });
        let mut response = Response::new(full(body.to_string()));
        *response.status_mut() = self.status;
        response.headers_mut().insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        crate::own_answer::mark(response)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(users: bool, tiers: &[&str], origins: &[Origin]) -> KeyPolicy {
        let claims = Claims {
            origin: Origin::UserAction,
            origins: origins.to_vec(),
            tiers: tiers.iter().map(|t| (*t).to_owned()).collect(),
        };
        KeyPolicy::new("svc", "free", claims, (users, Some(b"secret-secret-16")))
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_str(value).unwrap(),
            );
        }
        map
    }

    fn refused(result: Result<Job, Refused>) -> Refused {
        result.expect_err("accepted")
    }

    #[test]
    fn a_users_name_is_the_hmac_of_the_services_name_and_the_id() {
        let hash = UserHash::new(b"secret-secret-16", "svc");
        let mut mac = Hmac::<Sha256>::new_from_slice(b"secret-secret-16").unwrap();
        mac.update(&3u64.to_be_bytes());
        mac.update(b"svcalice");
        assert_eq!(
            hash.mac(b"alice"),
            <[u8; 32]>::from(mac.finalize().into_bytes())
        );
        // The same id under another service, with the same secret or none: another name.
        assert_ne!(
            hash.mac(b"alice"),
            UserHash::new(b"secret-secret-16", "svc2").mac(b"alice")
        );
        assert_ne!(
            UserHash::new(b"", "a").mac(b"x"),
            UserHash::new(b"", "b").mac(b"x")
        );
        // The name's length keeps ("sv", "calice") apart from ("svc", "alice").
        assert_ne!(
            UserHash::new(b"", "sv").mac(b"calice"),
            UserHash::new(b"", "svc").mac(b"alice")
        );
    }

    #[test]
    fn the_body_names_the_user_before_the_header_and_never_in_clear() {
        let policy = policy(true, &[], &[Origin::UserAction]);
        let from_body = policy.identify(&headers(&[("x-fairgate-user", "bob")]), Some("alice"));
        let tenant = from_body.unwrap().tenant().clone();
        assert!(tenant.as_str().starts_with("svc/"), "{tenant}");
        assert_eq!(tenant.as_str().len(), 4 + 32);
        assert!(!tenant.as_str().contains("alice"));
        let alice = policy.identify(&headers(&[("x-fairgate-user", "alice")]), None);
        assert_eq!(alice.unwrap().tenant(), &tenant);
        let bob = policy.identify(&headers(&[("x-fairgate-user", "bob")]), Some(""));
        assert_ne!(bob.unwrap().tenant(), &tenant);
        // Another service names the same user as another tenant, with the same secret.
        let other = KeyPolicy::new(
            "other",
            "free",
            Claims {
                origin: Origin::UserAction,
                origins: vec![],
                tiers: vec![],
            },
            (true, Some(b"secret-secret-16")),
        );
        let elsewhere = other.identify(&HeaderMap::new(), Some("alice")).unwrap();
        assert_ne!(&elsewhere.tenant().as_str()[6..], &tenant.as_str()[4..]);
    }

    #[test]
    fn a_users_call_naming_no_user_or_a_long_one_is_a_400_naming_the_field() {
        let policy = policy(true, &[], &[]);
        let none = refused(policy.identify(&HeaderMap::new(), None));
        assert_eq!(none.status, StatusCode::BAD_REQUEST);
        assert!(
            none.message.starts_with("metadata.user_id"),
            "{}",
            none.message
        );
        let long = "u".repeat(257);
        let too_long = refused(policy.identify(&HeaderMap::new(), Some(&long)));
        assert_eq!(too_long.status, StatusCode::BAD_REQUEST);
        assert!(too_long.message.starts_with("metadata.user_id"));
        let in_header = refused(policy.identify(&headers(&[("x-fairgate-user", &long)]), None));
        assert!(in_header.message.starts_with("x-fairgate-user"));
        // 256 bytes is taken.
        let ok = "u".repeat(256);
        assert!(
            policy
                .identify(&headers(&[("x-fairgate-user", &ok)]), None)
                .is_ok()
        );
    }

    #[test]
    fn claims_beyond_the_key_are_a_403_naming_the_header() {
        let free_only = policy(false, &["free"], &[Origin::BatchJob]);
        for (pairs, header) in [
            (&[("x-fairgate-tier", "premium")][..], "x-fairgate-tier"),
            (&[("x-fairgate-origin", "user")][..], "x-fairgate-origin"),
            (&[("x-fairgate-user", "alice")][..], "x-fairgate-user"),
            (&[("x-fairgate-sla", "30")][..], "x-fairgate-sla"),
        ] {
            let refusal = refused(free_only.identify(&headers(pairs), None));
            assert_eq!(refusal.status, StatusCode::FORBIDDEN, "{pairs:?}");
            assert_eq!(refusal.kind, "permission_error");
            assert!(refusal.message.starts_with(header), "{}", refusal.message);
        }
        // A key with no `tiers` may claim none, not even its own.
        let bare = policy(false, &[], &[]);
        let own = refused(bare.identify(&headers(&[("x-fairgate-tier", "free")]), None));
        assert_eq!(own.status, StatusCode::FORBIDDEN);
        // A malformed claim is a 400.
        let bad = refused(free_only.identify(&headers(&[("x-fairgate-origin", "now")]), None));
        assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    }

    #[test]
    fn claims_within_the_key_shape_the_job() {
        let policy = policy(
            true,
            &["free", "premium"],
            &[Origin::UserAction, Origin::Scheduled, Origin::BatchJob],
        );
        let user = [("x-fairgate-user", "u1")];
        let plain = policy.identify(&headers(&user), None).unwrap();
        assert_eq!(plain.tier().unwrap().as_str(), "free");
        assert_eq!(plain.origin(), Origin::UserAction);
        let job = policy
            .identify(
                &headers(&[
                    ("x-fairgate-user", "u1"),
                    ("x-fairgate-tier", "premium"),
                    ("x-fairgate-origin", "scheduled"),
                    ("x-fairgate-sla", "1.5"),
                ]),
                None,
            )
            .unwrap();
        assert_eq!(job.tier().unwrap().as_str(), "premium");
        assert_eq!(job.origin(), Origin::Scheduled);
        assert_eq!(job.sla(), Some(Duration::from_millis(1500)));
        // A batch call stays batch.
        let batch_sla = [
            ("x-fairgate-user", "u1"),
            ("x-fairgate-origin", "batch"),
            ("x-fairgate-sla", "5"),
        ];
        assert_eq!(
            refused(policy.identify(&headers(&batch_sla), None)).status,
            StatusCode::FORBIDDEN
        );
    }

    #[tokio::test]
    async fn a_refusal_is_anthropic_json_even_with_quotes() {
        use http_body_util::BodyExt;
        let refusal = Refused::new(
            StatusCode::FORBIDDEN,
            "permission_error",
            "x-fairgate-tier",
            "a \"b\"".into(),
        );
        let response = refusal.response();
        assert_eq!(response.status(), StatusCode::FORBIDDEN);
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let answer: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(answer["type"], "error");
        assert_eq!(answer["error"]["type"], "permission_error");
        assert_eq!(answer["error"]["message"], "a \"b\"");
    }
}
