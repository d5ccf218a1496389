//! The `[owner]` settings: where the owner is and how long to wait for it.

use std::time::Duration;

use serde::Deserialize;

use super::endpoint::{self, EndpointError, Liveness, UrlParts};
use crate::setting::InvalidSetting;

/// Linux takes up to `u32::MAX` ms, libpq an `int`; past an hour the
/// setting no longer detects anything an operator would wait for.
const MAX_TCP_USER_TIMEOUT_MS: u64 = 3_600_000;
/// Linux's bound on `TCP_KEEPIDLE` and `TCP_KEEPINTVL` (`MAX_TCP_KEEPIDLE`).
const MAX_KEEPALIVE_SECS: u64 = 32_767;

#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OwnerSettings {
    pub url: String,
    /// The role's password, when neither the URL nor `password_file` holds
    /// it (`crate::owner::Endpoint` says which wins).
    pub password: String,
    pub password_file: String,
    pub connect_timeout_ms: u64,
    pub query_timeout_ms: u64,
    /// `TCP_USER_TIMEOUT` of every connection, in milliseconds (0: the
    /// system's default): see `endpoint::Liveness`.
    pub tcp_user_timeout_ms: u64,
    /// TCP keepalives of every connection: the first probe after this many
    /// idle seconds, then one every `keepalive_interval_secs`.
    pub keepalive_idle_secs: u64,
    pub keepalive_interval_secs: u64,
    /// Not a setting: the owner the replication stream is on, shared by
    /// every clone of these settings in one service, so each ordinary
    /// connection can be checked against it (`super::identity`).
    #[serde(skip)]
    pub pin: std::sync::Arc<super::identity::OwnerPin>,
}

/// A rule of the `[owner]` section broken: the URL and the password
/// settings are parsed by `endpoint`, whose messages name the setting.
#[derive(Debug, thiserror::Error)]
pub enum OwnerSettingsError {
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    #[error(transparent)]
    Invalid(#[from] InvalidSetting),
}

impl std::fmt::Debug for OwnerSettings {
    // Settings are logged at startup; the password, wherever it is, must not be.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnerSettings")
            .field("url", &endpoint::redacted_url(&self.url))
            .field(
                "password",
                &if self.password.is_empty() {
                    ""
                } else {
                    "<redacted>"
                },
            )
            .field("password_file", &self.password_file)
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .field("query_timeout_ms", &self.query_timeout_ms)
            .field("tcp_user_timeout_ms", &self.tcp_user_timeout_ms)
            .field("keepalive_idle_secs", &self.keepalive_idle_secs)
            .field("keepalive_interval_secs", &self.keepalive_interval_secs)
            .finish()
    }
}

impl OwnerSettings {
    pub fn validate(&self) -> Result<(), OwnerSettingsError> {
        if !(self.url.starts_with("postgres://") || self.url.starts_with("postgresql://")) {
            return Err(InvalidSetting::new("owner.url", "must be a postgresql:// URL").into());
        }
        // The same parse connecting uses; files are read only when connecting.
        let url = UrlParts::parse(&self.url)?;
        if !self.password.is_empty() && !self.password_file.is_empty() {
            return Err(EndpointError::PasswordSettingsTwice.into());
        }
        if url.has_password && !(self.password.is_empty() && self.password_file.is_empty()) {
            return Err(EndpointError::PasswordTwice.into());
        }
        if self.connect_timeout_ms == 0 {
            return Err(InvalidSetting::new("owner.connect_timeout_ms", "must be above 0").into());
        }
        if self.query_timeout_ms == 0 {
            return Err(InvalidSetting::new("owner.query_timeout_ms", "must be above 0").into());
        }
        if self.tcp_user_timeout_ms > MAX_TCP_USER_TIMEOUT_MS {
            return Err(InvalidSetting::new(
                "owner.tcp_user_timeout_ms",
                format!("must be at most {MAX_TCP_USER_TIMEOUT_MS} (an hour); 0 keeps the system's default"),
            )
            .into());
        }
        for (field, secs) in [
            ("owner.keepalive_idle_secs", self.keepalive_idle_secs),
            (
                "owner.keepalive_interval_secs",
                self.keepalive_interval_secs,
            ),
        ] {
            if !(1..=MAX_KEEPALIVE_SECS).contains(&secs) {
                return Err(InvalidSetting::new(
                    field,
                    format!("must be 1 to {MAX_KEEPALIVE_SECS} (the kernel's limit)"),
                )
                .into());
            }
        }
        Ok(())
    }

    /// How every connection notices a path that drops its packets.
    pub fn liveness(&self) -> Liveness {
        Liveness {
            tcp_user_timeout: (self.tcp_user_timeout_ms > 0)
                .then(|| Duration::from_millis(self.tcp_user_timeout_ms)),
            keepalive_idle: Duration::from_secs(self.keepalive_idle_secs),
            keepalive_interval: Duration::from_secs(self.keepalive_interval_secs),
        }
    }

    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }

    pub fn query_timeout(&self) -> Duration {
        Duration::from_millis(self.query_timeout_ms)
    }
}
