//! Which Bedrock model id serves a Messages API model name.

use std::collections::HashMap;
use std::sync::Arc;

/// The Messages API's model names and the Bedrock ids of the same models: dated names and
/// their aliases.
const DEFAULTS: &[(&str, &str)] = &[
    (
        "claude-opus-4-5-20251101",
        "anthropic.claude-opus-4-5-20251101-v1:0",
    ),
    ("claude-opus-4-5", "anthropic.claude-opus-4-5-20251101-v1:0"),
    (
        "claude-sonnet-4-5-20250929",
        "anthropic.claude-sonnet-4-5-20250929-v1:0",
    ),
    (
        "claude-sonnet-4-5",
        "anthropic.claude-sonnet-4-5-20250929-v1:0",
    ),
    (
        "claude-haiku-4-5-20251001",
        "anthropic.claude-haiku-4-5-20251001-v1:0",
    ),
    (
        "claude-haiku-4-5",
        "anthropic.claude-haiku-4-5-20251001-v1:0",
    ),
    (
        "claude-opus-4-1-20250805",
        "anthropic.claude-opus-4-1-20250805-v1:0",
    ),
    ("claude-opus-4-1", "anthropic.claude-opus-4-1-20250805-v1:0"),
    (
        "claude-opus-4-20250514",
        "anthropic.claude-opus-4-20250514-v1:0",
    ),
    ("claude-opus-4-0", "anthropic.claude-opus-4-20250514-v1:0"),
    (
        "claude-sonnet-4-20250514",
        "anthropic.claude-sonnet-4-20250514-v1:0",
    ),
    (
        "claude-sonnet-4-0",
        "anthropic.claude-sonnet-4-20250514-v1:0",
    ),
    (
        "claude-3-7-sonnet-20250219",
        "anthropic.claude-3-7-sonnet-20250219-v1:0",
    ),
    (
        "claude-3-7-sonnet-latest",
        "anthropic.claude-3-7-sonnet-20250219-v1:0",
    ),
    (
        "claude-3-5-haiku-20241022",
        "anthropic.claude-3-5-haiku-20241022-v1:0",
    ),
    (
        "claude-3-5-haiku-latest",
        "anthropic.claude-3-5-haiku-20241022-v1:0",
    ),
    (
        "claude-3-5-sonnet-20241022",
        "anthropic.claude-3-5-sonnet-20241022-v2:0",
    ),
    (
        "claude-3-5-sonnet-20240620",
        "anthropic.claude-3-5-sonnet-20240620-v1:0",
    ),
    (
        "claude-3-haiku-20240307",
        "anthropic.claude-3-haiku-20240307-v1:0",
    ),
    (
        "claude-3-opus-20240229",
        "anthropic.claude-3-opus-20240229-v1:0",
    ),
];

/// Maps the Messages API's model names (`claude-sonnet-4-5`) to Bedrock model ids
/// (`anthropic.claude-sonnet-4-5-20250929-v1:0`).
///
/// The default map knows the current Claude models by their dated names and aliases.
/// [`model`](Self::model) adds or replaces an entry (a provisioned-throughput ARN, say);
/// [`inference_profile`](Self::inference_profile) puts a cross-region inference profile's
/// prefix (`us`, `eu`, `apac`, `global`) before the default ids, which the newer models need
/// for on-demand calls. A name that is already a Bedrock id (it contains a `.`, as
/// `anthropic.…` and `us.anthropic.…` do) or an ARN (`arn:…`) passes unchanged; any other
/// unknown name is refused with the Messages API's `404 not_found_error`.
///
/// # Clone
///
/// Cloning shares the map.
#[derive(Debug, Clone)]
pub struct ModelMap {
    overrides: Arc<HashMap<String, String>>,
    profile: Option<Arc<str>>,
    defaults: bool,
}

impl Default for ModelMap {
    fn default() -> Self {
        ModelMap {
            overrides: Arc::default(),
            profile: None,
            defaults: true,
        }
    }
}

impl ModelMap {
    /// A map with no entries, not even the defaults: only Bedrock ids, ARNs and what
    /// [`model`](Self::model) adds are served.
    pub fn empty() -> Self {
        ModelMap {
            defaults: false,
            ..ModelMap::default()
        }
    }

    /// Serves `name` with Bedrock model id (or ARN) `bedrock_id`, as given.
    pub fn model(mut self, name: impl Into<String>, bedrock_id: impl Into<String>) -> Self {
        Arc::make_mut(&mut self.overrides).insert(name.into(), bedrock_id.into());
        self
    }

    /// Puts `prefix.` before the default ids: `inference_profile("us")` maps
    /// `claude-sonnet-4-5` to `us.anthropic.claude-sonnet-4-5-20250929-v1:0`.
    pub fn inference_profile(mut self, prefix: impl Into<String>) -> Self {
        let prefix: String = prefix.into();
        self.profile = Some(prefix.trim_end_matches('.').into());
        self
    }

    /// The Bedrock id for `name`, or `None` when the map does not know it.
    pub fn resolve(&self, name: &str) -> Option<String> {
        if let Some(id) = self.overrides.get(name) {
            return Some(id.clone());
        }
        if name.starts_with("arn:") || name.contains('.') {
            return Some(name.to_owned());
        }
        let (_, id) = DEFAULTS
            .iter()
            .filter(|_| self.defaults)
            .find(|(n, _)| *n == name)?;
        Some(match &self.profile {
            Some(prefix) => format!("{prefix}.{id}"),
            None => (*id).to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_names_map_to_bedrock_ids_and_bedrock_ids_pass() {
        let map = ModelMap::default();
        assert_eq!(
            map.resolve("claude-sonnet-4-5").as_deref(),
            Some("anthropic.claude-sonnet-4-5-20250929-v1:0")
        );
        assert_eq!(
            map.resolve("claude-3-5-sonnet-20241022").as_deref(),
            Some("anthropic.claude-3-5-sonnet-20241022-v2:0")
        );
        for id in [
            "anthropic.claude-3-haiku-20240307-v1:0",
            "us.anthropic.claude-opus-4-5-20251101-v1:0",
            "arn:aws:bedrock:us-east-1:123456789012:provisioned-model/abc",
        ] {
            assert_eq!(map.resolve(id).as_deref(), Some(id));
        }
        assert_eq!(map.resolve("gpt-4o"), None);
    }

    #[test]
    fn overrides_and_profiles_apply_where_they_should() {
        let map = ModelMap::default()
            .inference_profile("eu")
            .model(
                "claude-haiku-4-5",
                "arn:aws:bedrock:eu-west-1:1:application-inference-profile/x",
            )
            .model("house-model", "anthropic.claude-3-haiku-20240307-v1:0");
        assert_eq!(
            map.resolve("claude-sonnet-4-5").as_deref(),
            Some("eu.anthropic.claude-sonnet-4-5-20250929-v1:0")
        );
        assert_eq!(
            map.resolve("claude-haiku-4-5").as_deref(),
            Some("arn:aws:bedrock:eu-west-1:1:application-inference-profile/x")
        );
        assert_eq!(
            map.resolve("house-model").as_deref(),
            Some("anthropic.claude-3-haiku-20240307-v1:0")
        );
        assert_eq!(ModelMap::empty().resolve("claude-sonnet-4-5"), None);
        assert_eq!(
            ModelMap::empty().resolve("anthropic.x-v1:0").as_deref(),
            Some("anthropic.x-v1:0")
        );
    }
}
