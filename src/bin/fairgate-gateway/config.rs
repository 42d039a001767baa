//! The keys file (`--keys`, TOML): the clients' keys, the optional `[limits]`,
//! `[[tiers]]` and `[cost]` (what a call is charged: the `cost` module), checked in full
//! before the gateway starts or takes a reload.
//!
//! Every refusal names the file and, where the file has one, the line; none shows a key
//! (a parse error's snippet of the file could, so only its message and line are kept, and
//! a key of the wrong type is refused by a message of our own, not serde's, which would
//! quote the value).

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::path::Path;
use std::time::Duration;

use fairgate::extract::KeyTable;
use fairgate::{DemotionPolicy, SlotPolicy, SlotPolicyBuilder, Tier};
use serde::{Deserialize, Deserializer};
use toml::Spanned;

use super::cost::{CostModel, CostTable};

/// The longest `retry_after_ms` and `max_wait_ms` taken: an hour. A client told to wait
/// longer has been told something wrong.
const MAX_WAIT_MS: u64 = 3_600_000;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct KeysFile {
    #[serde(default)]
    keys: Vec<Spanned<KeyEntry>>,
    #[serde(default)]
    limits: Limits,
    #[serde(default)]
    tiers: Vec<Spanned<TierEntry>>,
    #[serde(default)]
    cost: CostTable,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyEntry {
    key: Spanned<Secret>,
    tenant: String,
    tier: String,
}

/// A client key as read from the file: a string, or a refusal that never quotes it.
struct Secret(String);

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(SecretVisitor)
    }
}

struct SecretVisitor;

impl<'de> serde::de::Visitor<'de> for SecretVisitor {
    type Value = Secret;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string")
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Secret, E> {
        Ok(Secret(v.to_owned()))
    }

    fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Secret, E> {
        Ok(Secret(v))
    }

    // Every other type: refused without the value (serde's own message quotes it).
    fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<Secret, E> {
        Err(E::custom(NOT_A_STRING))
    }

    fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<Secret, E> {
        Err(E::custom(NOT_A_STRING))
    }

    fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<Secret, E> {
        Err(E::custom(NOT_A_STRING))
    }

    fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<Secret, E> {
        Err(E::custom(NOT_A_STRING))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, _: A) -> Result<Secret, A::Error> {
        Err(serde::de::Error::custom(NOT_A_STRING))
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, _: A) -> Result<Secret, A::Error> {
        Err(serde::de::Error::custom(NOT_A_STRING))
    }
}

const NOT_A_STRING: &str = "`key` must be a string in quotes";

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Limits {
    global_max: Option<Spanned<u32>>,
    window: Option<Spanned<usize>>,
    retry_after_ms: Option<Spanned<u64>>,
    lease_ttl_ms: Option<Spanned<u64>>,
    daily_token_budget: Option<Spanned<u64>>,
    demotion_ms: Option<Spanned<u64>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TierEntry {
    name: String,
    cap: u32,
    max_wait_ms: Spanned<u64>,
}

impl fmt::Debug for KeyEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the key itself.
        f.debug_struct("KeyEntry")
            .field("tenant", &self.tenant)
            .field("tier", &self.tier)
            .finish_non_exhaustive()
    }
}

/// What the gateway runs with, from the keys file.
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) keys: KeyTable,
    pub(crate) policy: SlotPolicy,
    pub(crate) window: usize,
    /// Every tenant the keys name, sorted (the demotion gauge's tick looks at each).
    pub(crate) tenants: Vec<String>,
    /// Each tenant's tier (of its first key): its weight on the live page.
    pub(crate) tenant_tiers: BTreeMap<String, String>,
    pub(crate) demotion: DemotionPolicy,
    /// What a call is charged (`[cost]`).
    pub(crate) cost: std::sync::Arc<CostModel>,
}

/// Reads and checks the keys file at `path`.
pub(crate) fn load(path: &Path) -> Result<Config, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read --keys {}: {e}", path.display()))?;
    parse(&text).map_err(|e| match e.line {
        Some(line) => format!("--keys {} line {line}: {}", path.display(), e.message),
        None => format!("--keys {}: {}", path.display(), e.message),
    })
}

/// A refusal: what is wrong and on which line (1-based), when known.
#[derive(Debug)]
pub(crate) struct Refusal {
    pub(crate) line: Option<usize>,
    pub(crate) message: String,
}

fn refuse(text: &str, span: Option<std::ops::Range<usize>>, message: String) -> Refusal {
    let line = span.map(|span| {
        1 + text.as_bytes()[..span.start.min(text.len())]
            .iter()
            .filter(|&&b| b == b'\n')
            .count()
    });
    Refusal { line, message }
}

/// Whether `key` can arrive in a header as it is written: visible ASCII only (a key with a
/// space, a control character or a non-ASCII letter in it could never authenticate).
fn key_is_sendable(key: &str) -> bool {
    !key.is_empty() && key.bytes().all(|b| b.is_ascii_graphic())
}

pub(crate) fn parse(text: &str) -> Result<Config, Refusal> {
    // The parse error's message and line only: its snippet of the file could show a key.
    let file: KeysFile =
        toml::from_str(text).map_err(|e| refuse(text, e.span(), e.message().to_owned()))?;
    if file.keys.is_empty() {
        return Err(refuse(
            text,
            None,
            "no [[keys]]: list at least one `key`, `tenant`, `tier`".into(),
        ));
    }
    let limits = &file.limits;
    let mut builder = slot_limits(text, limits)?;
    let mut tiers: Vec<String> = [Tier::PREMIUM, Tier::PRO, Tier::FREE, Tier::GUEST]
        .map(str::to_owned)
        .to_vec();
    let mut configured = HashSet::new();
    for entry in &file.tiers {
        let tier = check_tier(text, entry, &mut configured)?;
        let wait = Duration::from_millis(*tier.max_wait_ms.get_ref());
        builder = builder.tier(tier.name.as_str(), tier.cap, wait);
        if !tiers.contains(&tier.name) {
            tiers.push(tier.name.clone());
        }
    }
    let policy = builder
        .build()
        .map_err(|e| refuse(text, None, format!("bad [limits] or [[tiers]]: {e}")))?;
    let clients = clients(text, &file.keys, &tiers)?;
    let window = match &limits.window {
        Some(window) if *window.get_ref() == 0 => {
            return Err(refuse(
                text,
                Some(window.span()),
                "[limits] window = 0: give at least 1 (calls this gateway sends at once)".into(),
            ));
        }
        Some(window) => *window.get_ref(),
        None => policy.global_max() as usize,
    };
    let demotion = demotion(text, limits)?;
    let cost = CostModel::from_table(&file.cost).map_err(|e| refuse(text, None, e))?;
    Ok(Config {
        keys: clients.keys,
        policy,
        window,
        tenants: clients.tenants,
        tenant_tiers: clients.tenant_tiers,
        demotion,
        cost: std::sync::Arc::new(cost),
    })
}

/// The slot policy's `[limits]`: the global cap, the Retry-After, the lease TTL.
fn slot_limits(text: &str, limits: &Limits) -> Result<SlotPolicyBuilder, Refusal> {
    let mut builder = SlotPolicy::builder();
    if let Some(global) = &limits.global_max {
        if *global.get_ref() == 0 {
            return Err(refuse(
                text,
                Some(global.span()),
                "[limits] global_max = 0: give at least 1".into(),
            ));
        }
        builder = builder.global_max(*global.get_ref());
    }
    if let Some(ms) = &limits.retry_after_ms {
        let value = *ms.get_ref();
        if value == 0 || value > MAX_WAIT_MS {
            return Err(refuse(
                text,
                Some(ms.span()),
                format!(
                    "[limits] retry_after_ms = {value}: give 1 to {MAX_WAIT_MS} (at most an hour)"
                ),
            ));
        }
        builder = builder.retry_after(Duration::from_millis(value));
    }
    if let Some(ms) = &limits.lease_ttl_ms {
        builder = builder.lease_ttl(Duration::from_millis(*ms.get_ref()));
    }
    Ok(builder)
}

/// A `[[tiers]]` entry, refused unless its name is clean and new (`configured` holds those
/// seen), its cap at least 1 and its max wait at most an hour.
fn check_tier<'a>(
    text: &str,
    entry: &'a Spanned<TierEntry>,
    configured: &mut HashSet<String>,
) -> Result<&'a TierEntry, Refusal> {
    let span = entry.span();
    let tier = entry.get_ref();
    if tier.name.trim().is_empty() || tier.name.trim() != tier.name {
        return Err(refuse(
            text,
            Some(span),
            "a [[tiers]] entry has an empty name or spaces around it".into(),
        ));
    }
    if !configured.insert(tier.name.clone()) {
        return Err(refuse(
            text,
            Some(span),
            format!(
                "[[tiers]] `{}` is listed twice: give each tier once",
                tier.name
            ),
        ));
    }
    if tier.cap == 0 {
        return Err(refuse(
            text,
            Some(span),
            format!("[[tiers]] `{}`: cap = 0: give at least 1", tier.name),
        ));
    }
    let wait = *tier.max_wait_ms.get_ref();
    if wait > MAX_WAIT_MS {
        return Err(refuse(
            text,
            Some(tier.max_wait_ms.span()),
            format!(
                "[[tiers]] `{}`: max_wait_ms = {wait}: give at most {MAX_WAIT_MS} (an hour)",
                tier.name
            ),
        ));
    }
    Ok(tier)
}

/// The clients the `[[keys]]` name.
struct Clients {
    keys: KeyTable,
    /// Sorted.
    tenants: Vec<String>,
    tenant_tiers: BTreeMap<String, String>,
}

/// The `[[keys]]`, each checked against `tiers` (the known tier names) and the keys before
/// it.
fn clients(
    text: &str,
    entries: &[Spanned<KeyEntry>],
    tiers: &[String],
) -> Result<Clients, Refusal> {
    let mut keys = KeyTable::new();
    let mut tenants = HashSet::new();
    let mut tenant_tiers = BTreeMap::new();
    for (i, entry) in entries.iter().enumerate() {
        let entry = check_key(text, i + 1, entry, tiers, &keys)?;
        keys.insert(
            &entry.key.get_ref().0,
            entry.tenant.as_str(),
            entry.tier.as_str(),
        );
        tenants.insert(entry.tenant.clone());
        tenant_tiers
            .entry(entry.tenant.clone())
            .or_insert_with(|| entry.tier.clone());
    }
    let mut tenants: Vec<String> = tenants.into_iter().collect();
    tenants.sort();
    Ok(Clients {
        keys,
        tenants,
        tenant_tiers,
    })
}

/// Key #`n`, refused unless it can authenticate, names a tenant and a known tier, and is
/// not in `keys` already.
fn check_key<'a>(
    text: &str,
    n: usize,
    entry: &'a Spanned<KeyEntry>,
    tiers: &[String],
    keys: &KeyTable,
) -> Result<&'a KeyEntry, Refusal> {
    let span = Some(entry.span());
    let entry = entry.get_ref();
    let key = &entry.key.get_ref().0;
    let key_span = Some(entry.key.span());
    if !key_is_sendable(key) {
        return Err(refuse(
            text,
            key_span,
            format!(
                "key #{n} (tenant `{}`) is empty or has a character a header cannot carry \
                 (spaces, control characters, NUL or non-ASCII): it could never authenticate",
                entry.tenant
            ),
        ));
    }
    if entry.tenant.trim().is_empty() {
        return Err(refuse(text, span, format!("key #{n} has an empty tenant")));
    }
    if !tiers.contains(&entry.tier) {
        return Err(refuse(
            text,
            span,
            format!(
                "key #{n} (tenant `{}`): unknown tier `{}`; known: {} (add it under [[tiers]])",
                entry.tenant,
                entry.tier,
                tiers.join(", ")
            ),
        ));
    }
    if keys.get(key).is_some() {
        return Err(refuse(
            text,
            key_span,
            format!("key #{n} (tenant `{}`) is listed twice", entry.tenant),
        ));
    }
    Ok(entry)
}

/// The demotion policy's `[limits]`: the daily token budget and how long a demotion lasts.
fn demotion(text: &str, limits: &Limits) -> Result<DemotionPolicy, Refusal> {
    let mut demotion = DemotionPolicy::builder();
    if let Some(tokens) = &limits.daily_token_budget {
        demotion = demotion.default_daily_budget(*tokens.get_ref());
    }
    if let Some(ms) = &limits.demotion_ms {
        demotion = demotion.demote_for(Duration::from_millis(*ms.get_ref()));
    }
    let span = limits
        .daily_token_budget
        .as_ref()
        .map(Spanned::span)
        .or_else(|| limits.demotion_ms.as_ref().map(Spanned::span));
    demotion
        .build()
        .map_err(|e| refuse(text, span, format!("bad [limits] demotion: {e}")))
}
