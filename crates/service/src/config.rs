//! Settings: `config/default.toml` (compiled in), then an optional file, then
//! `VACANCY_*` environment variables, each later layer winning.
//!
//! Every setting has its documented default in `config/default.toml`, so there
//! is one place to read what a knob does. Each section is defined and
//! validated beside the module it configures (`owner::OwnerSettings`,
//! `stream::StreamSettings`, ...); this module only layers the sources and
//! composes the sections, so no module depends on `config` in turn.
//! Validation names the field and the rule it broke, because a service that
//! starts with a wrong setting fails far from the cause.

use std::path::Path;
use std::time::Duration;

use figment::providers::{Env, Format, Serialized, Toml};
use figment::{Figment, Provider};
use serde::Deserialize;

use crate::checkpoint::CheckpointSettings;
use crate::fleet::{FleetSettings, Role};
use crate::http::{AdminSettings, HttpSettings};
use crate::logging::LogSettings;
use crate::model::ModelSettings;
use crate::owner::{EndpointError, OwnerSettings, OwnerSettingsError};
use crate::search::SearchSettings;
use crate::setting::InvalidSetting;
use crate::stale::StaleSettings;
use crate::stream::StreamSettings;

pub const DEFAULT_TOML: &str = include_str!("../../../config/default.toml");

const ENV_PREFIX: &str = "VACANCY_";

/// A variable's name, less the prefix, as a settings key: two documented
/// short forms; everything else nests with "__".
fn env_key(name: &str) -> String {
    match name.to_ascii_lowercase().as_str() {
        "owner_url" => "owner.url".into(),
        "listen" => "http.listen".into(),
        other => other.replace("__", "."),
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    pub owner: OwnerSettings,
    pub stream: StreamSettings,
    pub model: ModelSettings,
    pub search: SearchSettings,
    pub http: HttpSettings,
    pub log: LogSettings,
    pub stale: StaleSettings,
    pub admin: AdminSettings,
    pub checkpoint: CheckpointSettings,
    pub fleet: FleetSettings,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read settings: {0}")]
    Load(#[from] Box<figment::Error>),
    #[error(transparent)]
    Invalid(#[from] InvalidSetting),
    /// A rule of `owner.url` and the password settings (`owner::endpoint`
    /// parses them; its messages name the setting).
    #[error("invalid owner settings: {0}")]
    Owner(#[from] EndpointError),
}

impl From<OwnerSettingsError> for ConfigError {
    fn from(error: OwnerSettingsError) -> ConfigError {
        match error {
            OwnerSettingsError::Endpoint(endpoint) => ConfigError::Owner(endpoint),
            OwnerSettingsError::Invalid(invalid) => ConfigError::Invalid(invalid),
        }
    }
}

impl Settings {
    /// Loads the layers: defaults, `file` when given, then the environment.
    pub fn load(file: Option<&Path>) -> Result<Settings, ConfigError> {
        let env = Env::prefixed(ENV_PREFIX).map(|key| env_key(key.as_str()).into());
        Self::load_from(file, env)
    }

    /// As `load`, with `vars` (name, value) in place of the process
    /// environment: checks what a deploy would set without setting it
    /// (`tests/it/kubernetes.rs`). Names and values are read as `load` reads
    /// the environment's; names without the `VACANCY_` prefix are ignored.
    pub fn load_with_vars<'a>(
        file: Option<&Path>,
        vars: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Settings, ConfigError> {
        let mut layer = Figment::new();
        for (name, value) in vars {
            let name = name.trim();
            let Some(key) = name
                .get(..ENV_PREFIX.len())
                .filter(|prefix| prefix.eq_ignore_ascii_case(ENV_PREFIX))
                .map(|_| env_key(&name[ENV_PREFIX.len()..]))
            else {
                continue;
            };
            // As figment's `Env`: a key with an empty part is skipped.
            if key.split('.').any(str::is_empty) {
                continue;
            }
            let value: figment::value::Value = value.parse().expect("infallible");
            layer = layer.merge(Serialized::default(&key, value));
        }
        Self::load_from(file, layer)
    }

    fn load_from(file: Option<&Path>, env: impl Provider) -> Result<Settings, ConfigError> {
        let mut figment = Figment::from(Toml::string(DEFAULT_TOML));
        if let Some(path) = file {
            if !path.is_file() {
                return Err(InvalidSetting::new(
                    "--config",
                    format!("{} is not a readable file", path.display()),
                )
                .into());
            }
            figment = figment.merge(Toml::file(path));
        }
        let settings: Settings = figment.merge(env).extract().map_err(Box::new)?;
        settings.validate()?;
        Ok(settings)
    }

    /// The compiled-in defaults alone (no file, no environment): for tests
    /// and embedders that set fields directly.
    pub fn defaults() -> Settings {
        Figment::from(Toml::string(DEFAULT_TOML))
            .extract()
            .expect("config/default.toml matches Settings")
    }

    /// Checks each rule a running service depends on, section by section.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.owner.validate()?;
        self.stream.validate()?;
        self.model.validate()?;
        self.search.validate()?;
        self.http.validate()?;
        self.admin.validate()?;
        self.stale.validate()?;
        self.log.validate()?;
        self.checkpoint.validate()?;
        self.fleet.validate()?;
        self.validate_fleet()?;
        // A temporary slot is gone after every disconnect, and with it the
        // WAL after a checkpoint: a checkpoint could never be resumed from.
        if self.stream.temporary_slot && self.checkpoint.enabled() {
            return Err(InvalidSetting::new(
                "checkpoint.dir",
                "must be empty while stream.temporary_slot = true: a temporary slot does not survive a restart, so no checkpoint could be resumed from",
            )
            .into());
        }
        Ok(())
    }

    /// The rules that tie `[fleet]` to other sections.
    fn validate_fleet(&self) -> Result<(), InvalidSetting> {
        if !self.fleet.is_fleet() {
            return Ok(());
        }
        let role = self.fleet.role.label();
        // Every node signs and checks quotes, and takes reports: a quote
        // shown by one node must verify on the node its report reaches.
        if self.stale.quote_key.is_empty() && self.stale.quote_key_file.is_empty() {
            return Err(InvalidSetting::new(
                "stale.quote_key",
                format!(
                    "must be set (or stale.quote_key_file) for fleet role {role}: quotes must verify on every node"
                ),
            ));
        }
        if self.stale.booking_tokens.is_empty() && self.stale.booking_tokens_file.is_empty() {
            return Err(InvalidSetting::new(
                "stale.booking_tokens",
                format!("must be set (or stale.booking_tokens_file) for fleet role {role}"),
            ));
        }
        if self.fleet.role == Role::Projector {
            if !self.checkpoint.enabled() {
                return Err(InvalidSetting::new(
                    "checkpoint.dir",
                    "must be set for fleet role projector: checkpoints are written there, then uploaded for the replicas",
                ));
            }
            let covered = u64::from(self.fleet.checkpoints_kept) * self.checkpoint.interval_secs;
            if self.fleet.max_age_secs < covered {
                return Err(InvalidSetting::new(
                    "fleet.max_age_secs",
                    format!(
                        "must cover the kept checkpoints: at least fleet.checkpoints_kept x checkpoint.interval_secs = {covered}"
                    ),
                ));
            }
        }
        Ok(())
    }

    pub fn connect_timeout(&self) -> Duration {
        self.owner.connect_timeout()
    }

    pub fn query_timeout(&self) -> Duration {
        self.owner.query_timeout()
    }
}

#[cfg(test)]
// figment's Jail API returns its large error type; that is its signature, not ours.
#[allow(clippy::result_large_err)]
mod tests {
    use super::*;
    use figment::Jail;

    fn load_with_env(vars: &[(&str, &str)]) -> Result<Settings, String> {
        let mut out = Err("jail did not run".to_string());
        Jail::expect_with(|jail| {
            jail.clear_env();
            for (k, v) in vars {
                jail.set_env(k, v);
            }
            out = Settings::load(None).map_err(|e| e.to_string());
            Ok(())
        });
        out
    }

    #[test]
    fn defaults_load_and_validate() {
        let s = load_with_env(&[]).expect("defaults");
        assert_eq!(s.stream.publication, "vacancy");
        assert_eq!(s.http.listen, "127.0.0.1:8080");
    }

    #[test]
    fn short_env_forms_work_as_documented() {
        let s = load_with_env(&[
            ("VACANCY_OWNER_URL", "postgresql://u@db.example:6543/shop"),
            ("VACANCY_LISTEN", "0.0.0.0:9000"),
            ("VACANCY_STREAM__SLOT", "copy_two"),
        ])
        .expect("env");
        assert_eq!(s.owner.url, "postgresql://u@db.example:6543/shop");
        assert_eq!(s.http.listen, "0.0.0.0:9000");
        assert_eq!(s.stream.slot, "copy_two");
    }

    #[test]
    fn admission_budgets_default_on_turn_off_with_zero_and_refuse_absurd_bounds() {
        let s = load_with_env(&[]).expect("defaults");
        assert_eq!(s.http.max_guest_requests_in_flight, 8);
        assert_eq!(s.http.max_booking_requests_in_flight, 256);
        let s = load_with_env(&[
            ("VACANCY_HTTP__MAX_GUEST_REQUESTS_IN_FLIGHT", "0"),
            ("VACANCY_HTTP__MAX_BOOKING_REQUESTS_IN_FLIGHT", "0"),
        ])
        .expect("0 turns a budget off");
        assert_eq!(s.http.max_guest_requests_in_flight, 0);
        for field in [
            "max_guest_requests_in_flight",
            "max_booking_requests_in_flight",
        ] {
            let var = format!("VACANCY_HTTP__{}", field.to_uppercase());
            let e = load_with_env(&[(var.as_str(), "2000000")]).unwrap_err();
            assert!(e.contains(&format!("http.{field}")), "{e}");
        }
    }

    #[test]
    fn validation_names_field_and_rule() {
        let e = load_with_env(&[("VACANCY_STREAM__SLOT", "Bad-Slot")]).unwrap_err();
        assert!(e.contains("stream.slot"), "{e}");
        let e = load_with_env(&[("VACANCY_LISTEN", "nowhere")]).unwrap_err();
        assert!(e.contains("http.listen"), "{e}");
        let e = load_with_env(&[("VACANCY_OWNER_URL", "mysql://x")]).unwrap_err();
        assert!(e.contains("owner.url"), "{e}");
        let e = load_with_env(&[("VACANCY_MODEL__TTL_SECS", "0")]).unwrap_err();
        assert!(e.contains("model.ttl_secs"), "{e}");
        let e = load_with_env(&[("VACANCY_STALE__QUOTE_KEY", "too short")]).unwrap_err();
        assert!(e.contains("stale.quote_key"), "{e}");
        let e = load_with_env(&[("VACANCY_STALE__HOTEL_SHARE_BOUND", "1.5")]).unwrap_err();
        assert!(e.contains("stale.hotel_share_bound"), "{e}");
        let e = load_with_env(&[("VACANCY_STALE__WINDOW_BUCKETS", "0")]).unwrap_err();
        assert!(e.contains("stale.window_buckets"), "{e}");
        let e = load_with_env(&[("VACANCY_OWNER_URL", "postgresql://u@h/db?sslmode=allow")])
            .unwrap_err();
        assert!(
            e.contains("owner.url") && e.contains("sslmode=allow"),
            "{e}"
        );
        let e = load_with_env(&[(
            "VACANCY_OWNER_URL",
            "postgresql://u@h/db?sslmode=verify-full",
        )])
        .unwrap_err();
        assert!(e.contains("owner.url") && e.contains("sslrootcert"), "{e}");
        let e = load_with_env(&[
            ("VACANCY_OWNER__PASSWORD", "pw"),
            ("VACANCY_OWNER__PASSWORD_FILE", "/run/secrets/pw"),
        ])
        .unwrap_err();
        assert!(e.contains("owner.password_file"), "{e}");
        let e = load_with_env(&[
            ("VACANCY_OWNER_URL", "postgresql://u:inurl@h/db"),
            ("VACANCY_OWNER__PASSWORD", "pw"),
        ])
        .unwrap_err();
        assert!(
            e.contains("owner.url") && e.contains("owner.password"),
            "{e}"
        );
    }

    #[test]
    fn the_owner_password_comes_from_the_environment() {
        let s = load_with_env(&[("VACANCY_OWNER__PASSWORD", "from-env")]).expect("env");
        assert_eq!(s.owner.password, "from-env");
        let s =
            load_with_env(&[("VACANCY_OWNER__PASSWORD_FILE", "/run/secrets/owner")]).expect("env");
        assert_eq!(s.owner.password_file, "/run/secrets/owner");
        // Files are read when connecting, not when loading.
        assert!(s.owner.password.is_empty());
    }

    #[test]
    fn secrets_never_show_in_debug_output() {
        let s = load_with_env(&[
            (
                "VACANCY_STALE__QUOTE_KEY",
                "a-quote-key-of-thirty-two-bytes-or-more",
            ),
            (
                "VACANCY_STALE__BOOKING_TOKENS",
                "[\"booking-token-0123456789\"]",
            ),
        ])
        .expect("env");
        assert_eq!(s.stale.booking_tokens, vec!["booking-token-0123456789"]);
        let shown = format!("{s:?}");
        assert!(!shown.contains("a-quote-key"), "{shown}");
        assert!(!shown.contains("booking-token"), "{shown}");

        let s = load_with_env(&[("VACANCY_OWNER__PASSWORD", "owner-password-xyz")]).expect("env");
        let shown = format!("{s:?}");
        assert!(!shown.contains("owner-password-xyz"), "{shown}");
        assert!(
            shown.contains("127.0.0.1:5432"),
            "the URL still shows: {shown}"
        );
        let s = load_with_env(&[(
            "VACANCY_OWNER_URL",
            "postgresql://u:url-password-xyz@h/db?password=query-password-xyz",
        )])
        .expect("env");
        let shown = format!("{s:?}");
        assert!(!shown.contains("password-xyz"), "{shown}");
    }

    #[test]
    fn checkpoints_are_off_by_default_and_on_with_a_directory() {
        let s = load_with_env(&[]).expect("defaults");
        assert!(!s.checkpoint.enabled());
        assert_eq!(s.checkpoint.interval_secs, 300);
        let s = load_with_env(&[("VACANCY_CHECKPOINT__DIR", "/var/lib/vacancy")]).expect("env");
        assert_eq!(
            s.checkpoint.dir(),
            Some(Path::new("/var/lib/vacancy")),
            "VACANCY_CHECKPOINT__DIR turns them on"
        );
        let e = load_with_env(&[("VACANCY_CHECKPOINT__INTERVAL_SECS", "0")]).unwrap_err();
        assert!(e.contains("checkpoint.interval_secs"), "{e}");
        let e = load_with_env(&[
            ("VACANCY_CHECKPOINT__DIR", "/var/lib/vacancy"),
            ("VACANCY_STREAM__TEMPORARY_SLOT", "true"),
        ])
        .unwrap_err();
        assert!(
            e.contains("checkpoint.dir") && e.contains("stream.temporary_slot"),
            "{e}"
        );
    }

    #[test]
    fn a_fleet_role_needs_nats_a_quote_key_and_booking_tokens() {
        assert_eq!(
            load_with_env(&[]).expect("defaults").fleet.role,
            Role::Standalone
        );
        let e = load_with_env(&[("VACANCY_FLEET__ROLE", "replica")]).unwrap_err();
        assert!(e.contains("fleet.nats_url"), "{e}");
        let nats = ("VACANCY_FLEET__NATS_URL", "nats://127.0.0.1:4222");
        let e = load_with_env(&[("VACANCY_FLEET__ROLE", "replica"), nats]).unwrap_err();
        assert!(e.contains("stale.quote_key"), "{e}");
        let key = (
            "VACANCY_STALE__QUOTE_KEY",
            "0123456789abcdef0123456789abcdef",
        );
        let e = load_with_env(&[("VACANCY_FLEET__ROLE", "replica"), nats, key]).unwrap_err();
        assert!(e.contains("stale.booking_tokens"), "{e}");
        let tokens = ("VACANCY_STALE__BOOKING_TOKENS_FILE", "/run/secrets/tokens");
        let replica = load_with_env(&[("VACANCY_FLEET__ROLE", "replica"), nats, key, tokens])
            .expect("a replica with its secrets");
        assert_eq!(replica.fleet.role, Role::Replica);
        // A replica's confirmed reads read the owner's position, and write
        // nothing (`search::confirm`).
        let confirmed = ("VACANCY_SEARCH__FRESH_READS", "confirmed");
        load_with_env(&[
            ("VACANCY_FLEET__ROLE", "replica"),
            nats,
            key,
            tokens,
            confirmed,
        ])
        .expect("a replica with confirmed reads");
        // The projector stages its checkpoints on disk, and the stream must
        // keep what its kept checkpoints need.
        let projector = [("VACANCY_FLEET__ROLE", "projector"), nats, key, tokens];
        let e = load_with_env(&projector).unwrap_err();
        assert!(e.contains("checkpoint.dir"), "{e}");
        let mut with_dir = projector.to_vec();
        with_dir.push(("VACANCY_CHECKPOINT__DIR", "/var/lib/vacancy"));
        load_with_env(&with_dir).expect("a projector with its directory");
        with_dir.push(("VACANCY_FLEET__MAX_AGE_SECS", "599"));
        let e = load_with_env(&with_dir).unwrap_err();
        assert!(e.contains("fleet.max_age_secs"), "{e}");
        let e = load_with_env(&[("VACANCY_FLEET__ROLE", "leader")]).unwrap_err();
        assert!(e.contains("leader"), "{e}");
    }

    #[test]
    fn fleet_names_and_bounds_are_checked() {
        for (key, value, field) in [
            ("VACANCY_FLEET__STREAM", "a.b", "fleet.stream"),
            (
                "VACANCY_FLEET__CHECKPOINT_BUCKET",
                "",
                "fleet.checkpoint_bucket",
            ),
            ("VACANCY_FLEET__SUBJECT", "vacancy.>", "fleet.subject"),
            (
                "VACANCY_FLEET__OUTCOMES_STREAM",
                "a b",
                "fleet.outcomes_stream",
            ),
            (
                "VACANCY_FLEET__OUTCOMES_STREAM",
                "VACANCY_CHANGES",
                "fleet.outcomes_stream",
            ),
            (
                "VACANCY_FLEET__OUTCOMES_SUBJECT",
                "vacancy.*",
                "fleet.outcomes_subject",
            ),
            (
                "VACANCY_FLEET__OUTCOMES_SUBJECT",
                "vacancy.changes",
                "fleet.outcomes_stream",
            ),
            (
                "VACANCY_FLEET__MAX_CHUNK_BYTES",
                "2000000",
                "fleet.max_chunk_bytes",
            ),
            (
                "VACANCY_FLEET__MAX_PUBLISHES_IN_FLIGHT",
                "0",
                "fleet.max_publishes_in_flight",
            ),
            (
                "VACANCY_FLEET__DUPLICATE_WINDOW_SECS",
                "7200",
                "fleet.duplicate_window_secs",
            ),
        ] {
            let e = load_with_env(&[(key, value)]).unwrap_err();
            assert!(e.contains(field), "{key}={value}: {e}");
        }
    }

    #[test]
    fn given_variables_load_as_the_environment_does() {
        let cases: [&[(&str, &str)]; 4] = [
            &[
                ("VACANCY_OWNER_URL", "postgresql://u@db.example:6543/shop"),
                ("VACANCY_LISTEN", "0.0.0.0:9000"),
                ("VACANCY_FLEET__ROLE", "replica"),
                ("VACANCY_FLEET__NATS_URL", "nats://nats:4222"),
                ("VACANCY_STALE__QUOTE_KEY_FILE", "/run/secrets/quote-key"),
                (
                    "VACANCY_STALE__BOOKING_TOKENS",
                    "[\"booking-token-0123456789\"]",
                ),
                ("VACANCY_HTTP__SHUTDOWN_GRACE_MS", "20000"),
                ("OTHER", "ignored"),
            ],
            &[("VACANCY_STREAM__SLOTT", "x")],
            &[("VACANCY_SERVICE_HOST", "10.0.0.1")],
            &[("VACANCY_MODEL__TTL_SECS", "0")],
        ];
        for vars in cases {
            let from_env = load_with_env(vars).map(|s| format!("{s:?}"));
            let given = Settings::load_with_vars(None, vars.iter().copied())
                .map(|s| format!("{s:?}"))
                .map_err(|e| e.to_string());
            match (&from_env, &given) {
                (Ok(a), Ok(b)) => assert_eq!(a, b, "{vars:?}"),
                // The messages name the source (environment or given), so
                // compare what they refuse rather than the whole text.
                (Err(a), Err(b)) => {
                    let refused = |e: &str| e.split(" for ").next().unwrap_or(e).to_string();
                    assert_eq!(refused(a), refused(b), "{vars:?}");
                }
                _ => panic!("{vars:?}: the environment gave {from_env:?}, the variables {given:?}"),
            }
        }
    }

    #[test]
    fn unknown_keys_are_refused() {
        let e = load_with_env(&[("VACANCY_STREAM__SLOTT", "x")]).unwrap_err();
        assert!(e.contains("slott"), "{e}");
    }

    #[test]
    fn config_file_layer_overrides_defaults() {
        Jail::expect_with(|jail| {
            jail.clear_env();
            jail.create_file("extra.toml", "[stream]\nslot = \"from_file\"\n")?;
            let s = Settings::load(Some(Path::new("extra.toml"))).expect("file");
            assert_eq!(s.stream.slot, "from_file");
            jail.set_env("VACANCY_STREAM__SLOT", "from_env");
            let s = Settings::load(Some(Path::new("extra.toml"))).expect("file+env");
            assert_eq!(s.stream.slot, "from_env");
            Ok(())
        });
    }

    /// Every `section.key` of `config/default.toml`.
    fn known_keys() -> Vec<String> {
        let data =
            figment::Provider::data(&Toml::string(DEFAULT_TOML)).expect("default.toml parses");
        let mut keys = Vec::new();
        for dict in data.values() {
            for (section, value) in dict {
                if let Some(inner) = value.as_dict() {
                    keys.extend(inner.keys().map(|k| format!("{section}.{k}")));
                }
            }
        }
        keys.sort();
        keys
    }

    /// Defaults with one key set to `value`, extracted and validated.
    fn with_value(key: &str, value: &serde_json::Value) -> Result<Settings, ConfigError> {
        let settings: Settings = Figment::from(Toml::string(DEFAULT_TOML))
            .merge(figment::providers::Serialized::default(key, value))
            .extract()
            .map_err(Box::new)?;
        settings.validate()?;
        Ok(settings)
    }

    /// Values of every shape, at the edges of their types.
    fn any_value() -> impl proptest::strategy::Strategy<Value = serde_json::Value> {
        use proptest::prelude::*;
        use serde_json::Value;
        let scalar = prop_oneof![
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            prop_oneof![
                Just(0u64),
                Just(1),
                Just(u64::MAX),
                Just(u64::MAX / 1000 + 1)
            ]
            .prop_map(Value::from),
            any::<f64>()
                .prop_filter("JSON numbers are finite", |f| f.is_finite())
                .prop_map(Value::from),
            any::<bool>().prop_map(Value::from),
            "\\PC{0,40}".prop_map(Value::from),
            prop_oneof![
                Just("postgresql://u@h/db"),
                Just("0.0.0.0:80"),
                Just("https://shop.example"),
                Just("refuse"),
                Just("owner"),
                Just("json"),
                Just("info"),
            ]
            .prop_map(Value::from),
        ];
        scalar.prop_recursive(2, 8, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                proptest::collection::btree_map("[a-z_]{1,8}", inner, 0..3)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest::proptest! {
        /// Any value for any known key: the settings load, or the error is
        /// typed and names the key (as the field, or in the rule of the
        /// field it constrains); never a panic.
        #[test]
        fn any_value_for_a_known_key_loads_or_names_the_key(
            key in proptest::sample::select(known_keys()),
            value in any_value(),
        ) {
            match with_value(&key, &value) {
                Ok(_) => {}
                Err(e) => {
                    let message = e.to_string();
                    proptest::prop_assert!(message.contains(&key), "{} for {} = {}", message, key, value);
                }
            }
        }
    }

    /// The edges of every type, for every key: exhaustive, not sampled.
    #[test]
    fn edge_values_for_every_key_load_or_name_the_key() {
        use serde_json::json;
        let edges = [
            json!(0),
            json!(1),
            json!(-1),
            json!(i64::MIN),
            json!(u64::MAX),
            json!(u64::MAX / 1000 + 1),
            json!(u32::MAX),
            json!(1e300),
            json!(-0.5),
            json!(""),
            json!(" "),
            json!("x"),
            json!(true),
            json!([]),
            json!(["x"]),
            json!({}),
        ];
        for key in known_keys() {
            for value in &edges {
                let outcome = std::panic::catch_unwind(|| with_value(&key, value));
                match outcome {
                    Err(_) => panic!("{key} = {value} panicked"),
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => {
                        let message = e.to_string();
                        assert!(message.contains(&key), "{message} for {key} = {value}");
                    }
                }
            }
        }
    }

    #[test]
    fn the_key_list_covers_every_section() {
        let keys = known_keys();
        for section in [
            "owner.",
            "stream.",
            "model.",
            "search.",
            "http.",
            "log.",
            "stale.",
            "admin.",
            "checkpoint.",
        ] {
            assert!(keys.iter().any(|k| k.starts_with(section)), "{section}");
        }
        assert!(keys.contains(&"http.rate_limit_per_sec".to_string()));
    }
}
