//! Redis key names.
//!
//! Every per-tenant key carries the tenant as a hash tag (`{t:...}`), so the keys one script
//! touches share a Redis Cluster slot while different tenants spread across shards. Names go
//! through [`escape`], so no tenant name can close the tag, add a `:` part or collide with
//! another name.

use std::fmt::Write;

use crate::TenantId;
use crate::error::ConfigError;

/// Builds key names under one prefix; the fixed ones are built once.
#[derive(Clone, Debug)]
pub(crate) struct Keys {
    prefix: String,
    /// `prefix:{slots}:global`: every lease.
    pub(crate) slots_global: String,
    /// `prefix:{slots}:workers`: the workers alive.
    pub(crate) slots_workers: String,
    /// `prefix:{slots}:waits`: the wait book, the caps, weights and virtual times of the
    /// tiers with a worker queued for a slot.
    pub(crate) slots_waits: String,
    /// `prefix:{slots}:promised`: the slots a release woke a worker for, until its acquire
    /// comes (or a second passes), scored by expiry: nobody else takes them meanwhile.
    pub(crate) slots_promised: String,
    /// `prefix:{slots}:cells`: the cells of the provider's request rate the fleet orders,
    /// call ids scored by the microsecond their cell frees.
    pub(crate) slots_cells: String,
    /// `prefix:{slots}:wake:`: the prefix of each worker's channel (its id follows), on
    /// which a release wakes it for a freed slot.
    pub(crate) slots_wake: String,
    /// `prefix:{slots}:epoch`: the epoch the lease sets count every call in flight for.
    pub(crate) slots_epoch: String,
    /// `prefix:{g}:cooldowns`: the reopen time of every gate.
    pub(crate) cooldowns: String,
    /// `prefix:cooldowns`: the channel gate moves are announced on.
    pub(crate) cooldowns_channel: String,
}

impl Keys {
    /// # Errors
    /// A prefix that is empty or holds anything but ASCII letters, digits, `_`, `-`, `.`
    /// and `:` (a brace would break the hash tags).
    pub(crate) fn new(prefix: &str) -> Result<Self, ConfigError> {
        let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':');
        if prefix.is_empty() || !prefix.chars().all(allowed) {
            return Err(ConfigError::new(
                "key prefix must be non-empty ASCII letters, digits, '_', '-', '.' or ':'",
            ));
        }
        let slots = |part: &str| format!("{prefix}:{{slots}}:{part}");
        Ok(Keys {
            prefix: prefix.to_owned(),
            slots_global: slots("global"),
            slots_workers: slots("workers"),
            slots_waits: slots("waits"),
            slots_promised: slots("promised"),
            slots_cells: slots("cells"),
            slots_wake: slots("wake:"),
            slots_epoch: slots("epoch"),
            cooldowns: format!("{prefix}:{{g}}:cooldowns"),
            cooldowns_channel: format!("{prefix}:cooldowns"),
        })
    }

    /// `prefix:{g}:part:<escaped name>` — global keys share one hash tag.
    pub(crate) fn global(&self, part: &str, name: &str) -> String {
        let mut key = String::with_capacity(self.prefix.len() + part.len() + name.len() + 6);
        key.push_str(&self.prefix);
        key.push_str(":{g}:");
        key.push_str(part);
        key.push(':');
        escape_into(&mut key, name);
        key
    }

    /// `prefix:{t:<escaped tenant>}:part`
    pub(crate) fn tenant(&self, tenant: &TenantId, part: &str) -> String {
        let name = tenant.as_str();
        let mut key = String::with_capacity(self.prefix.len() + name.len() + part.len() + 8);
        key.push_str(&self.prefix);
        key.push_str(":{t:");
        escape_into(&mut key, name);
        key.push_str("}:");
        key.push_str(part);
        key
    }
}

impl Keys {
    /// `prefix:{slots}:tier:<escaped tier>` — every slot key shares one hash tag, so the
    /// acquire script's global and tier sets live in one Cluster slot.
    pub(crate) fn slots_tier(&self, tier: &crate::Tier) -> String {
        let mut key = format!("{}:{{slots}}:tier:", self.prefix);
        escape_into(&mut key, tier.as_str());
        key
    }

    /// `<tier key>:waiting`: the workers queued for a slot of the tier (the release script
    /// builds the same name).
    pub(crate) fn tier_queue(tier_key: &str) -> String {
        format!("{tier_key}:waiting")
    }

    /// `<tier key>:promised`: the slots of the tier a release woke a worker for (the
    /// release script builds the same name).
    pub(crate) fn tier_promised(tier_key: &str) -> String {
        format!("{tier_key}:promised")
    }

    /// `prefix:{slots}:tenant:<escaped tier>:<escaped tenant>` — a tenant's lease set in a
    /// tier that caps tenants. Unlike the other per-tenant keys it carries the `{slots}`
    /// tag, not the tenant's: the acquire script checks it with the global and tier sets,
    /// so it must live in their Cluster slot. The escaped names hold no `:`, `{` or `}`, so
    /// the tag stays whole and two (tier, tenant) pairs never share a key.
    pub(crate) fn slots_tenant(&self, tier: &crate::Tier, tenant: &TenantId) -> String {
        let (tier, tenant) = (tier.as_str(), tenant.as_str());
        let mut key = String::with_capacity(self.prefix.len() + tier.len() + tenant.len() + 18);
        key.push_str(&self.prefix);
        key.push_str(":{slots}:tenant:");
        escape_into(&mut key, tier);
        key.push(':');
        escape_into(&mut key, tenant);
        key
    }
}

/// Percent-escapes every byte but ASCII letters, digits, `_`, `-` and `.`: injective, and the
/// result holds no `{`, `}`, `:`, `*`, space or control character.
pub(crate) fn escape_into(out: &mut String, name: &str) {
    for byte in name.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'_' | b'-' | b'.') {
            out.push(char::from(byte));
        } else {
            // Writing to a String cannot fail.
            let _ = write!(out, "%{byte:02X}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str) -> String {
        Keys::new("fg").unwrap().tenant(&TenantId::new(name), "x")
    }

    #[test]
    fn escaped_names_keep_one_hash_tag_and_three_parts() {
        for name in ["a", "{b}", "a:b", "*", "a b", "new\nline", "ünï", "%41", ""] {
            let key = key(name);
            assert_eq!(key.matches('{').count(), 1, "{key}");
            assert_eq!(key.matches('}').count(), 1, "{key}");
            assert!(key.starts_with("fg:{t:") && key.ends_with("}:x"), "{key}");
            assert!(!key.contains(' ') && !key.contains('\n') && !key.contains('*'));
        }
    }

    #[test]
    fn different_names_never_share_a_key() {
        let names = ["a", "A", "%41", "a:x", "a}:x", "a%3Ax", "", " "];
        let keys: std::collections::HashSet<_> = names.iter().map(|n| key(n)).collect();
        assert_eq!(keys.len(), names.len());
    }

    #[test]
    fn global_and_slot_keys_share_their_hash_tags() {
        let keys = Keys::new("fg").unwrap();
        assert_eq!(keys.slots_global, "fg:{slots}:global");
        assert_eq!(keys.slots_workers, "fg:{slots}:workers");
        assert_eq!(keys.slots_waits, "fg:{slots}:waits");
        assert_eq!(keys.slots_promised, "fg:{slots}:promised");
        assert_eq!(keys.slots_cells, "fg:{slots}:cells");
        assert_eq!(keys.slots_wake, "fg:{slots}:wake:");
        assert_eq!(keys.slots_epoch, "fg:{slots}:epoch");
        assert_eq!(
            keys.slots_tier(&crate::Tier::new("a b")),
            "fg:{slots}:tier:a%20b"
        );
        assert_eq!(keys.cooldowns, "fg:{g}:cooldowns");
        assert_eq!(keys.cooldowns_channel, "fg:cooldowns");
        assert_eq!(keys.global("pace", "api}:x"), "fg:{g}:pace:api%7D%3Ax");
    }

    #[test]
    fn tenant_lease_sets_keep_the_slots_tag_and_never_collide() {
        let keys = Keys::new("fg").unwrap();
        let names = [
            "a", "A", "%41", "a:b", "a}:x", "{slots}", "}", "a%3Ab", "", " ", "ü",
        ];
        let tiers = ["free", "free:a", "pro"];
        let mut seen = std::collections::HashSet::new();
        for tier in tiers {
            for name in names {
                let key = keys.slots_tenant(&crate::Tier::new(tier), &TenantId::new(name));
                assert!(key.starts_with("fg:{slots}:tenant:"), "{key}");
                assert_eq!(key.matches('{').count(), 1, "{key}");
                assert_eq!(key.matches('}').count(), 1, "{key}");
                assert_eq!(key.matches(':').count(), 4, "{key}");
                assert!(seen.insert(key));
            }
        }
        assert_eq!(
            keys.slots_tenant(&crate::Tier::new("free"), &TenantId::new("a}:b")),
            "fg:{slots}:tenant:free:a%7D%3Ab"
        );
    }

    #[test]
    fn prefix_with_a_brace_is_refused() {
        assert!(Keys::new("a{b").is_err());
        assert!(Keys::new("").is_err());
        assert!(Keys::new("app:fairgate").is_ok());
    }
}
