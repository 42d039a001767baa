//! The keys file's `[[upstreams]]`: each entry checked (names, kinds, URLs, regions,
//! weights) and kept as an [`UpstreamSpec`]; the keys and AWS credentials are read from the
//! environment when the gateway starts (`proxy::upstreams`).

use http::Uri;
use serde::Deserialize;
use toml::Spanned;

use crate::config::{Refusal, refuse};

/// Most upstreams a pool holds (the library's bound).
const MAX_UPSTREAMS: usize = 64;

/// A `[[upstreams]]` entry as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct UpstreamEntry {
    name: String,
    kind: Option<Spanned<String>>,
    url: Option<Spanned<String>>,
    key_env: Option<Spanned<String>>,
    region: Option<Spanned<String>>,
    weight: Option<Spanned<u32>>,
    #[serde(default)]
    priority: u32,
    models: Option<Spanned<Vec<String>>>,
    max_in_flight: Option<Spanned<usize>>,
    http2: Option<Spanned<bool>>,
}

/// Kinds of upstream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Anthropic,
    Bedrock,
}

impl Kind {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Kind::Anthropic => "anthropic",
            Kind::Bedrock => "bedrock",
        }
    }
}

/// A checked `[[upstreams]]` entry (its keys not read yet).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct UpstreamSpec {
    pub(crate) name: String,
    pub(crate) kind: Kind,
    /// The base URL (for Bedrock: an endpoint instead of the region's).
    pub(crate) url: Option<String>,
    /// The environment variable holding an Anthropic upstream's key.
    pub(crate) key_env: Option<String>,
    pub(crate) region: Option<String>,
    pub(crate) weight: u32,
    pub(crate) priority: u32,
    pub(crate) models: Option<Vec<String>>,
    pub(crate) max_in_flight: Option<usize>,
    /// Called over HTTP/2 (the `http2` module).
    pub(crate) http2: bool,
    /// Its line in the keys file.
    pub(crate) line: usize,
}

impl UpstreamSpec {
    /// The same upstream, wherever it is written in the file.
    fn same(&self, other: &UpstreamSpec) -> bool {
        UpstreamSpec {
            line: other.line,
            ..self.clone()
        } == *other
    }
}

/// Whether two lists of upstreams are the same pool (a reload may not change it).
pub(crate) fn same_pool(a: &[UpstreamSpec], b: &[UpstreamSpec]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(a, b)| a.same(b))
}

/// Whether `url` is an absolute `http` or `https` URL with a host and no query.
pub(crate) fn base_url(url: &str) -> Option<Uri> {
    let uri: Uri = url.parse().ok()?;
    let web = matches!(uri.scheme_str(), Some("http" | "https"));
    (web && uri.authority().is_some() && uri.query().is_none() && !url.contains('#')).then_some(uri)
}

/// Whether `name` can be an environment variable's name.
fn env_name(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// The `[[upstreams]]` of the file at `text`, each checked: a clean name given once, a
/// known kind, and what that kind needs (Anthropic: `url` and `key_env`; Bedrock:
/// `region`, no `key_env`), `weight` and `max_in_flight` of at least 1, a `models` list
/// that names some.
pub(crate) fn check(
    text: &str,
    entries: &[Spanned<UpstreamEntry>],
) -> Result<Vec<UpstreamSpec>, Refusal> {
    if entries.len() > MAX_UPSTREAMS {
        let span = entries[MAX_UPSTREAMS].span();
        let message = format!("more than {MAX_UPSTREAMS} [[upstreams]]: give at most that many");
        return Err(refuse(text, Some(span), message));
    }
    let mut specs: Vec<UpstreamSpec> = Vec::with_capacity(entries.len());
    for spanned in entries {
        let spec = check_one(text, spanned)?;
        if specs.iter().any(|s| s.name == spec.name) {
            let message = format!(
                "[[upstreams]] `{}` is listed twice: give each upstream its own name",
                spec.name
            );
            return Err(refuse(text, Some(spanned.span()), message));
        }
        specs.push(spec);
    }
    Ok(specs)
}

type Span = std::ops::Range<usize>;

/// Refusals of one entry: its name in each message, on a field's line or else the entry's.
struct Refuser<'a> {
    text: &'a str,
    entry: Span,
    name: &'a str,
}

impl Refuser<'_> {
    fn fail(&self, span: Option<Span>, what: impl Into<String>) -> Refusal {
        let span = span.unwrap_or_else(|| self.entry.clone());
        let message = format!("[[upstreams]] `{}`: {}", self.name, what.into());
        refuse(self.text, Some(span), message)
    }
}

fn check_one(text: &str, spanned: &Spanned<UpstreamEntry>) -> Result<UpstreamSpec, Refusal> {
    let entry = spanned.get_ref();
    let name = &entry.name;
    let clean = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if !clean {
        let message = format!(
            "[[upstreams]] name `{name}`: give 1 to 64 letters, digits, `-`, `_` or `.` (it \
             labels metrics)"
        );
        return Err(refuse(text, Some(spanned.span()), message));
    }
    let refuser = Refuser {
        text,
        entry: spanned.span(),
        name,
    };
    let kind = match entry
        .kind
        .as_ref()
        .map(|k| (k.get_ref().as_str(), k.span()))
    {
        None | Some(("anthropic", _)) => Kind::Anthropic,
        Some(("bedrock", _)) => Kind::Bedrock,
        Some((other, span)) => {
            let what = format!("unknown kind `{other}`; known: anthropic, bedrock");
            return Err(refuser.fail(Some(span), what));
        }
    };
    if let Some(url) = &entry.url
        && base_url(url.get_ref()).is_none()
    {
        let what = format!(
            "url `{}` is not an http:// or https:// base URL with a host (no query)",
            url.get_ref()
        );
        return Err(refuser.fail(Some(url.span()), what));
    }
    match kind {
        Kind::Anthropic => check_anthropic(&refuser, entry)?,
        Kind::Bedrock => check_bedrock(&refuser, entry)?,
    }
    let Shares {
        weight,
        max_in_flight,
        models,
    } = check_shares(&refuser, entry)?;
    Ok(UpstreamSpec {
        name: name.clone(),
        kind,
        url: entry.url.as_ref().map(|url| url.get_ref().clone()),
        key_env: entry.key_env.as_ref().map(|var| var.get_ref().clone()),
        region: entry.region.as_ref().map(|region| region.get_ref().clone()),
        weight,
        priority: entry.priority,
        models,
        max_in_flight,
        http2: entry.http2.as_ref().is_some_and(|h| *h.get_ref()),
        line: refuse(text, Some(spanned.span()), String::new())
            .line
            .unwrap_or(0),
    })
}

/// An Anthropic upstream needs a `url` and a `key_env`, and takes no `region`.
fn check_anthropic(refuser: &Refuser<'_>, entry: &UpstreamEntry) -> Result<(), Refusal> {
    if entry.url.is_none() {
        let what = "no url: give the API's base URL, e.g. https://api.anthropic.com";
        return Err(refuser.fail(None, what));
    }
    match &entry.key_env {
        None => {
            let what = "no key_env: name the environment variable holding its key, e.g. \
                        ANTHROPIC_API_KEY";
            return Err(refuser.fail(None, what));
        }
        Some(var) if !env_name(var.get_ref()) => {
            let what = format!(
                "key_env `{}` is not an environment variable's name",
                var.get_ref()
            );
            return Err(refuser.fail(Some(var.span()), what));
        }
        Some(_) => {}
    }
    if let Some(region) = &entry.region {
        return Err(refuser.fail(Some(region.span()), "region is for kind = \"bedrock\""));
    }
    Ok(())
}

/// A Bedrock upstream needs a `region`, and takes no `key_env` (it signs with the AWS
/// environment's credentials).
fn check_bedrock(refuser: &Refuser<'_>, entry: &UpstreamEntry) -> Result<(), Refusal> {
    if let Some(http2) = &entry.http2 {
        let what = "http2 is for kind = \"anthropic\": Bedrock is called over HTTP/1.1";
        return Err(refuser.fail(Some(http2.span()), what));
    }
    if let Some(var) = &entry.key_env {
        let what = "key_env is for kind = \"anthropic\": Bedrock signs with the AWS \
                    credentials of the environment (AWS_ACCESS_KEY_ID, ...)";
        return Err(refuser.fail(Some(var.span()), what));
    }
    let Some(region) = &entry.region else {
        let what = "no region: give the AWS region, e.g. region = \"us-east-1\"";
        return Err(refuser.fail(None, what));
    };
    let name = region.get_ref();
    if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
        let what = format!("region `{name}` is no AWS region");
        return Err(refuser.fail(Some(region.span()), what));
    }
    Ok(())
}

/// How an upstream's share of the calls is set.
struct Shares {
    weight: u32,
    max_in_flight: Option<usize>,
    models: Option<Vec<String>>,
}

/// The entry's `weight` (default 1), `max_in_flight` and `models`: none of them 0 or empty.
fn check_shares(refuser: &Refuser<'_>, entry: &UpstreamEntry) -> Result<Shares, Refusal> {
    let weight = match &entry.weight {
        Some(w) if *w.get_ref() == 0 => {
            return Err(refuser.fail(Some(w.span()), "weight = 0: give at least 1"));
        }
        Some(w) => *w.get_ref(),
        None => 1,
    };
    let max_in_flight = match &entry.max_in_flight {
        Some(m) if *m.get_ref() == 0 => {
            let what = "max_in_flight = 0: give at least 1 (or leave it out)";
            return Err(refuser.fail(Some(m.span()), what));
        }
        Some(m) => Some(*m.get_ref()),
        None => None,
    };
    let models = match &entry.models {
        Some(m) if m.get_ref().is_empty() || m.get_ref().iter().any(String::is_empty) => {
            let what = "models = []: name the models it serves (or leave it out: every model)";
            return Err(refuser.fail(Some(m.span()), what));
        }
        Some(m) => Some(m.get_ref().clone()),
        None => None,
    };
    Ok(Shares {
        weight,
        max_in_flight,
        models,
    })
}

/// The `[[upstreams]]` of `text` alone, checked (for tests).
#[cfg(test)]
pub(crate) fn parse_specs(text: &str) -> Result<Vec<UpstreamSpec>, Refusal> {
    #[derive(Deserialize)]
    struct File {
        upstreams: Vec<Spanned<UpstreamEntry>>,
    }
    let file: File = toml::from_str(text).map_err(|e| Refusal {
        line: None,
        message: e.to_string(),
    })?;
    check(text, &file.upstreams)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Two upstreams of each kind (the proxy's tests build them).
    pub(crate) const TWO: &str = r#"
[[upstreams]]
name = "primary"
url = "https://api.anthropic.com"
key_env = "ANTHROPIC_API_KEY"
http2 = true

[[upstreams]]
name = "bedrock-east"
kind = "bedrock"
region = "us-east-1"
weight = 2
priority = 1
models = ["claude-sonnet-4-5"]
max_in_flight = 8
"#;

    #[test]
    fn the_issues_upstreams_are_taken_with_their_lines() {
        let specs = parse_specs(TWO).unwrap();
        assert_eq!(specs.len(), 2);
        assert_eq!((specs[0].kind, specs[0].line), (Kind::Anthropic, 2));
        assert!(specs[0].http2 && !specs[1].http2);
        assert_eq!(specs[1].kind, Kind::Bedrock);
        assert_eq!(specs[1].line, 8);
        assert_eq!((specs[1].weight, specs[1].priority), (2, 1));
        assert_eq!(specs[1].max_in_flight, Some(8));
        // The same pool written elsewhere in the file.
        let moved = format!("\n\n{TWO}");
        assert!(same_pool(&specs, &parse_specs(&moved).unwrap()));
        assert!(!same_pool(&specs, &specs[..1]));
    }

    #[test]
    fn each_mistake_is_refused_on_its_line_with_what_to_do() {
        let base = "[[upstreams]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\nkey_env = \"K\"\n";
        let cases: [(String, usize, &str); 10] = [
            (format!("{base}{base}"), 5, "listed twice"),
            (format!("{base}weight = 0\n"), 5, "weight = 0"),
            (format!("{base}max_in_flight = 0\n"), 5, "max_in_flight = 0"),
            (
                format!("{base}kind = \"vertex\"\n"),
                5,
                "unknown kind `vertex`",
            ),
            (
                format!("{base}region = \"us-east-1\"\n"),
                5,
                "region is for",
            ),
            (format!("{base}models = []\n"), 5, "models = []"),
            (
                "[[upstreams]]\nname = \"a\"\nurl = \"ftp://x\"\nkey_env = \"K\"\n".into(),
                3,
                "not an http",
            ),
            (
                "[[upstreams]]\nname = \"a\"\nurl = \"http://x\"\n".into(),
                1,
                "no key_env",
            ),
            (
                "[[upstreams]]\nname = \"b\"\nkind = \"bedrock\"\n".into(),
                1,
                "no region",
            ),
            ("[[upstreams]]\nname = \"a b\"\n".into(), 1, "name `a b`"),
        ];
        for (text, line, says) in cases {
            let refusal = parse_specs(&text).expect_err(&text);
            assert!(
                refusal.message.contains(says),
                "{text}: {}",
                refusal.message
            );
            assert_eq!(refusal.line, Some(line), "{text}: {}", refusal.message);
        }
        let key_env =
            "[[upstreams]]\nname = \"b\"\nkind = \"bedrock\"\nregion = \"r\"\nkey_env = \"K\"\n";
        assert!(
            parse_specs(key_env)
                .unwrap_err()
                .message
                .contains("AWS credentials")
        );
        let http2 =
            "[[upstreams]]\nname = \"b\"\nkind = \"bedrock\"\nregion = \"r\"\nhttp2 = true\n";
        let refusal = parse_specs(http2).unwrap_err();
        assert!(
            refusal.message.contains("http2 is for kind"),
            "{}",
            refusal.message
        );
        assert_eq!(refusal.line, Some(5));
    }
}
