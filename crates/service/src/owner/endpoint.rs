//! Where and how to reach the owner: the one place that turns `owner.url`,
//! the password settings and the URL's `sslmode`/`sslrootcert` into what
//! both kinds of connection use.
//!
//! Why one place: ordinary connections go through tokio-postgres (TLS by
//! rustls), the replication connection through libpq (pg_walstream). Each
//! reads connection settings its own way, and if both read them separately
//! the connection carrying every row ends up with a weaker TLS mode or
//! without the password. Here the URL is parsed once and both the
//! tokio-postgres `Config` and the libpq conninfo come from that parse.
//!
//! TLS mirrors libpq's `sslmode`, since libpq decides it for the
//! replication connection and the two must agree:
//!
//! | `sslmode` | encrypted | certificate checked |
//! | --- | --- | --- |
//! | `disable` | no | no |
//! | `prefer` (libpq's default) | if the server offers it | no |
//! | `require` | yes | no (see below) |
//! | `verify-ca` | yes | chain to `sslrootcert` |
//! | `verify-full` | yes | chain to `sslrootcert` and the host name |
//!
//! `require` encrypts without checking who answers, as in libpq; it guards
//! against reading on the wire, not against a server in the middle. As in
//! libpq, `prefer` and `require` with an `sslrootcert` check the chain
//! (libpq's compatibility rule). `sslmode` is always passed to libpq
//! explicitly, so `PGSSLMODE` cannot make the two connections differ. The
//! root certificates come only from `sslrootcert` (a PEM file); with none in
//! the URL, libpq alone may still find `PGSSLROOTCERT` or
//! `~/.postgresql/root.crt` and check the replication connection's
//! certificate against it. That can only make it stricter, never weaker,
//! and libpq offers no way to say "no root file", so it is documented, not
//! prevented. `allow`, `sslrootcert=system` and client certificates are
//! refused rather than half-supported.
//!
//! A path that drops packets instead of refusing them (a firewall or NAT
//! that lost the connection's state, a host gone without a reset) fails no
//! call: the kernel retransmits for about 15 minutes (`tcp_retries2`)
//! before it gives up. Every connection therefore gets the same
//! `Liveness`, from the `[owner]` settings: `TCP_USER_TIMEOUT` (data unacknowledged
//! that long closes the connection) and TCP keepalives that start after a
//! short idle time (an idle connection is probed, and closed when the probes
//! go unanswered). They are set here, never in `owner.url`: tokio-postgres
//! reads the URL's `tcp_user_timeout` in seconds and libpq in milliseconds,
//! and the two spell the keepalive count differently, so the URL may not
//! name them.
//!
//! The password comes from exactly one of: the URL, `owner.password`
//! (`VACANCY_OWNER__PASSWORD`), `owner.password_file`; or, when none of them
//! sets one, libpq's `PGPASSWORD`. It is read again on every connect, so a
//! rotated password file takes effect at the next reconnect. It never
//! reaches a log or a `Debug` output.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, percent_decode_str, utf8_percent_encode};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{ClientConfig, WebPkiServerVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::OwnerError;
use super::OwnerSettings;

/// libpq's `sslmode`, less `allow`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl SslMode {
    fn parse(value: &str) -> Result<SslMode, EndpointError> {
        Ok(match value {
            "disable" => SslMode::Disable,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            other => return Err(EndpointError::SslMode(other.to_string())),
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }

    /// What tokio-postgres itself knows: whether to ask for TLS and whether
    /// it may go on without. The checks of the verify modes are rustls's.
    fn for_tokio_postgres(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => "require",
        }
    }
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why the owner's connection settings cannot be used. Each message names
/// the setting: config validation reports the URL and password rules, the
/// files are read at connect time.
#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    #[error("owner.url is not a connection URL PostgreSQL accepts: {0}")]
    Url(String),
    #[error(
        "owner.url has sslmode={0}; vacancy takes disable, prefer, require, verify-ca or verify-full"
    )]
    SslMode(String),
    #[error("owner.url has sslmode={0}, which needs sslrootcert=<a PEM file of CA certificates>")]
    RootCertMissing(SslMode),
    #[error(
        "owner.url has sslrootcert=system, which this libpq does not know; name a PEM file of CA certificates"
    )]
    RootCertSystem,
    #[error(
        "owner.url holds a password, and owner.password or owner.password_file sets one too; keep one of them"
    )]
    PasswordTwice,
    #[error("owner.password and owner.password_file are both set; keep one of them")]
    PasswordSettingsTwice,
    #[error("cannot read owner.password_file {path}: {source}")]
    PasswordFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("owner.password_file {0} is empty")]
    PasswordFileEmpty(PathBuf),
    #[error("cannot read the root certificates {path} (sslrootcert of owner.url): {detail}")]
    RootCert { path: PathBuf, detail: String },
    #[error("{0} (sslrootcert of owner.url) holds no certificate")]
    RootCertEmpty(PathBuf),
    #[error("cannot set up TLS to the owner (owner.url): {0}")]
    Tls(#[source] rustls::Error),
    #[error(
        "owner.url sets {key}; set owner.{setting} instead (it applies to every connection alike)"
    )]
    LivenessInUrl { key: String, setting: &'static str },
}

/// How a connection notices that its path drops packets (module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Liveness {
    /// `TCP_USER_TIMEOUT`: sent data unacknowledged this long closes the
    /// connection. `None`: the system's default (retransmits for ~15 min).
    pub tcp_user_timeout: Option<Duration>,
    /// Idle time before the first keepalive probe, and the time between
    /// probes. With a user timeout, a connection whose probes go
    /// unanswered is closed at the first probe past it; without, after the
    /// system's probe count.
    pub keepalive_idle: Duration,
    pub keepalive_interval: Duration,
}

/// The URL keys `Liveness` owns, and the setting to use instead.
fn liveness_setting(key: &str) -> Option<&'static str> {
    match key {
        "tcp_user_timeout" => Some("tcp_user_timeout_ms"),
        "keepalives_idle" => Some("keepalive_idle_secs"),
        "keepalives_interval" => Some("keepalive_interval_secs"),
        "keepalives" | "keepalives_count" | "keepalives_retries" => {
            Some("keepalive_idle_secs and owner.keepalive_interval_secs")
        }
        _ => None,
    }
}

/// The owner as both connection kinds reach it.
pub struct Endpoint {
    /// For tokio-postgres: the URL less what only libpq knows, with the
    /// password set. (Its `Debug` redacts the password.)
    config: tokio_postgres::Config,
    /// For libpq: the URL as written, plus the password when it came from
    /// elsewhere, the `sslmode`, and `replication=database`.
    replication_conninfo: String,
    ssl_mode: SslMode,
    tls: MakeRustlsConnect,
}

impl fmt::Debug for Endpoint {
    // The conninfo may carry the password; the Config redacts its own.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Endpoint")
            .field("config", &self.config)
            .field("ssl_mode", &self.ssl_mode)
            .finish_non_exhaustive()
    }
}

/// What `owner.url` says, before any file is read.
#[derive(Debug)]
pub struct UrlParts {
    /// The URL for tokio-postgres: `sslrootcert` removed, `sslmode` reduced.
    tokio_postgres_url: String,
    pub ssl_mode: SslMode,
    pub root_cert: Option<PathBuf>,
    /// The URL sets a password (in the user info or as `password=`).
    pub has_password: bool,
    /// The URL's own `options` (server settings for the session), decoded.
    pub options: Option<String>,
}

/// Server settings the replication session always runs with, after the
/// URL's own `options`: pgoutput sends values as text in the session's
/// formats, and decode reads dates as ISO and floats at full precision. A
/// role or database with another `DateStyle` (`ALTER ROLE ... SET datestyle
/// = 'SQL, DMY'`) would otherwise stop the copy at its first night, and a
/// lower `extra_float_digits` round coordinates. PostgreSQL's own
/// subscriber sets the same (`libpqwalreceiver`).
const REPLICATION_SESSION_OPTIONS: &str = "-c datestyle=ISO -c extra_float_digits=3";

/// Characters a query value keeps as they are; libpq decodes `%XX` only.
const QUERY_VALUE: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

impl UrlParts {
    /// Parses `owner.url` without reading any file: config validation runs this.
    pub fn parse(url: &str) -> Result<UrlParts, EndpointError> {
        let (base, query) = match url.split_once('?') {
            Some((base, query)) => (base, query),
            None => (url, ""),
        };
        let mut ssl_mode = SslMode::Prefer;
        let mut root_cert = None;
        let mut options = None;
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let decoded = || {
                percent_decode_str(value)
                    .decode_utf8()
                    .map(|v| v.into_owned())
                    .map_err(|_| EndpointError::Url(format!("{key} is not UTF-8")))
            };
            if let Some(setting) = liveness_setting(key) {
                return Err(EndpointError::LivenessInUrl {
                    key: key.to_string(),
                    setting,
                });
            }
            match key {
                // Later wins, as in libpq.
                "sslmode" => ssl_mode = SslMode::parse(&decoded()?)?,
                "sslrootcert" => root_cert = Some(decoded()?),
                "options" => {
                    options = Some(decoded()?);
                    kept.push(pair);
                }
                "sslcert" | "sslkey" | "sslpassword" | "sslcrl" | "sslcrldir" => {
                    return Err(EndpointError::Url(format!(
                        "{key}: client certificates and revocation lists are not supported"
                    )));
                }
                _ => kept.push(pair),
            }
        }
        let root_cert = match root_cert.as_deref() {
            None | Some("") => None,
            Some("system") => return Err(EndpointError::RootCertSystem),
            Some(path) => Some(PathBuf::from(path)),
        };
        if root_cert.is_none() && matches!(ssl_mode, SslMode::VerifyCa | SslMode::VerifyFull) {
            return Err(EndpointError::RootCertMissing(ssl_mode));
        }
        kept.push("");
        let tokio_postgres_url = format!(
            "{base}?{}sslmode={}",
            kept.join("&"),
            ssl_mode.for_tokio_postgres()
        );
        let config: tokio_postgres::Config = tokio_postgres_url
            .parse()
            .map_err(|e: tokio_postgres::Error| EndpointError::Url(super::explain(&e)))?;
        Ok(UrlParts {
            tokio_postgres_url,
            ssl_mode,
            root_cert,
            has_password: config.get_password().is_some(),
            options,
        })
    }
}

/// Where the password comes from: settings first, then `PGPASSWORD`.
#[derive(Clone, Default)]
pub struct PasswordSources<'a> {
    pub password: &'a str,
    pub password_file: &'a str,
    /// `PGPASSWORD`, used only when nothing else sets a password.
    pub pgpassword: Option<String>,
}

impl PasswordSources<'_> {
    /// The password to add to the URL's settings, if any.
    fn resolve(&self, url_has_password: bool) -> Result<Option<String>, EndpointError> {
        let configured = !self.password.is_empty() || !self.password_file.is_empty();
        if !self.password.is_empty() && !self.password_file.is_empty() {
            return Err(EndpointError::PasswordSettingsTwice);
        }
        if configured && url_has_password {
            return Err(EndpointError::PasswordTwice);
        }
        if !self.password_file.is_empty() {
            return read_password_file(Path::new(self.password_file)).map(Some);
        }
        if !self.password.is_empty() {
            return Ok(Some(self.password.to_string()));
        }
        if url_has_password {
            return Ok(None);
        }
        Ok(self.pgpassword.clone().filter(|p| !p.is_empty()))
    }
}

/// A password file's contents less the line end an editor or `echo` adds.
fn read_password_file(path: &Path) -> Result<String, EndpointError> {
    let text = std::fs::read_to_string(path).map_err(|source| EndpointError::PasswordFile {
        path: path.to_path_buf(),
        source,
    })?;
    let password = text
        .strip_suffix('\n')
        .map(|t| t.strip_suffix('\r').unwrap_or(t))
        .unwrap_or(&text);
    if password.is_empty() {
        return Err(EndpointError::PasswordFileEmpty(path.to_path_buf()));
    }
    Ok(password.to_string())
}

impl Endpoint {
    /// The configured owner: `owner.url`, `owner.password` or
    /// `owner.password_file`, else `PGPASSWORD`, with the `[owner]`
    /// liveness settings. Reads the files now.
    pub fn from_settings(owner: &OwnerSettings) -> Result<Endpoint, EndpointError> {
        Self::resolve(
            &owner.url,
            &PasswordSources {
                password: &owner.password,
                password_file: &owner.password_file,
                pgpassword: std::env::var("PGPASSWORD").ok(),
            },
        )
        .map(|endpoint| endpoint.with_liveness(&owner.liveness()))
    }

    /// Both connection kinds with `liveness`: tokio-postgres's socket
    /// options, and libpq's conninfo keys (`tcp_user_timeout` in ms there).
    pub fn with_liveness(mut self, liveness: &Liveness) -> Endpoint {
        self.config
            .keepalives(true)
            .keepalives_idle(liveness.keepalive_idle)
            .keepalives_interval(liveness.keepalive_interval);
        let mut extra = vec![
            "keepalives=1".to_string(),
            format!("keepalives_idle={}", liveness.keepalive_idle.as_secs()),
            format!(
                "keepalives_interval={}",
                liveness.keepalive_interval.as_secs()
            ),
        ];
        if let Some(timeout) = liveness.tcp_user_timeout {
            self.config.tcp_user_timeout(timeout);
            extra.push(format!("tcp_user_timeout={}", timeout.as_millis()));
        }
        self.replication_conninfo = append_query(&self.replication_conninfo, &extra.join("&"));
        self
    }

    /// A URL alone (tools, tests): its own password, else `PGPASSWORD`.
    pub fn from_url(url: &str) -> Result<Endpoint, EndpointError> {
        Self::resolve(
            url,
            &PasswordSources {
                pgpassword: std::env::var("PGPASSWORD").ok(),
                ..PasswordSources::default()
            },
        )
    }

    pub fn resolve(url: &str, passwords: &PasswordSources<'_>) -> Result<Endpoint, EndpointError> {
        let parts = UrlParts::parse(url)?;
        let password = passwords.resolve(parts.has_password)?;
        let mut config: tokio_postgres::Config = parts
            .tokio_postgres_url
            .parse()
            .map_err(|e: tokio_postgres::Error| EndpointError::Url(super::explain(&e)))?;
        let mut extra = Vec::new();
        if let Some(password) = &password {
            config.password(password.as_bytes());
            extra.push(format!(
                "password={}",
                utf8_percent_encode(password, QUERY_VALUE)
            ));
        }
        // Explicit, so libpq's PGSSLMODE cannot differ from what rustls does.
        extra.push(format!("sslmode={}", parts.ssl_mode));
        extra.push("replication=database".to_string());
        // Last, so it is the `options` libpq takes (a later key wins).
        let options = match &parts.options {
            Some(own) => format!("{own} {REPLICATION_SESSION_OPTIONS}"),
            None => REPLICATION_SESSION_OPTIONS.to_string(),
        };
        extra.push(format!(
            "options={}",
            utf8_percent_encode(&options, QUERY_VALUE)
        ));
        let replication_conninfo = append_query(url, &extra.join("&"));
        let tls =
            MakeRustlsConnect::new(client_config(parts.ssl_mode, parts.root_cert.as_deref())?);
        Ok(Endpoint {
            config,
            replication_conninfo,
            ssl_mode: parts.ssl_mode,
            tls,
        })
    }

    pub fn ssl_mode(&self) -> SslMode {
        self.ssl_mode
    }

    /// The libpq conninfo of the replication connection. It may hold the
    /// password: hand it to libpq, never to a log.
    pub fn replication_conninfo(&self) -> &str {
        &self.replication_conninfo
    }

    /// Opens an ordinary (non-replication) connection and drives it on the runtime.
    pub async fn connect(&self, timeout: Duration) -> Result<tokio_postgres::Client, OwnerError> {
        let connecting = self.config.connect(self.tls.clone());
        let (client, connection) = tokio::time::timeout(timeout, connecting)
            .await
            .map_err(|_| OwnerError::ConnectTimeout(timeout))?
            .map_err(|e| match tls_failure(&e) {
                Some(source) => OwnerError::Tls {
                    mode: self.ssl_mode,
                    source,
                },
                None => OwnerError::Connect(e),
            })?;
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%error, "owner connection closed");
            }
        });
        Ok(client)
    }
}

/// `url` with `params` added to its query string.
fn append_query(url: &str, params: &str) -> String {
    match url.find('?') {
        Some(_) if url.ends_with('?') || url.ends_with('&') => format!("{url}{params}"),
        Some(_) => format!("{url}&{params}"),
        None => format!("{url}?{params}"),
    }
}

/// The rustls error under a failed connect, if the handshake is what failed.
fn tls_failure(error: &tokio_postgres::Error) -> Option<rustls::Error> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(current) = source {
        if let Some(tls) = current.downcast_ref::<rustls::Error>() {
            return Some(tls.clone());
        }
        // tokio-rustls wraps the rustls error in an io::Error, whose
        // `source` skips it.
        if let Some(tls) = current
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        {
            return Some(tls.clone());
        }
        source = current.source();
    }
    None
}

fn client_config(mode: SslMode, root_cert: Option<&Path>) -> Result<ClientConfig, EndpointError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(EndpointError::Tls)?;
    let verifier: Arc<dyn ServerCertVerifier> = match (mode, root_cert) {
        (SslMode::Disable | SslMode::Prefer | SslMode::Require, None) => {
            Arc::new(EncryptOnly(provider.signature_verification_algorithms))
        }
        (SslMode::VerifyFull, Some(path)) => webpki_verifier(path, provider)?,
        // verify-ca, and libpq's rule for prefer/require with a root file.
        (_, Some(path)) => Arc::new(ChainOnly(webpki_verifier(path, provider)?)),
        (SslMode::VerifyCa | SslMode::VerifyFull, None) => {
            return Err(EndpointError::RootCertMissing(mode));
        }
    };
    Ok(builder
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth())
}

fn webpki_verifier(
    path: &Path,
    provider: Arc<CryptoProvider>,
) -> Result<Arc<WebPkiServerVerifier>, EndpointError> {
    let failed = |detail: String| EndpointError::RootCert {
        path: path.to_path_buf(),
        detail,
    };
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(path).map_err(|e| failed(e.to_string()))? {
        let cert = cert.map_err(|e| failed(e.to_string()))?;
        roots.add(cert).map_err(|e| failed(e.to_string()))?;
    }
    if roots.is_empty() {
        return Err(EndpointError::RootCertEmpty(path.to_path_buf()));
    }
    WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
        .build()
        .map_err(|e| failed(e.to_string()))
}

/// `prefer`/`require` without a root file: encrypt, believe any certificate
/// (libpq's meaning). The handshake signature is still checked, so the
/// session key is bound to the certificate the server sent.
#[derive(Debug)]
struct EncryptOnly(WebPkiSupportedAlgorithms);

impl ServerCertVerifier for EncryptOnly {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_schemes()
    }
}

/// `verify-ca`: the chain must end at a root of `sslrootcert`; the name in
/// the certificate may differ from the host. webpki checks the chain before
/// the name, so a name error means the chain was good.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// `url` with any password (user info or `password=`) replaced, for logs
/// and `Debug` output.
pub fn redacted_url(url: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let base = match base.split_once("://") {
        Some((scheme, rest)) => {
            let authority_end = rest.find('/').unwrap_or(rest.len());
            let (authority, path) = rest.split_at(authority_end);
            match authority.rsplit_once('@') {
                Some((user_info, hosts)) => {
                    let user = user_info.split_once(':').map_or(user_info, |(u, _)| u);
                    let hidden = if user_info.contains(':') {
                        ":<redacted>"
                    } else {
                        ""
                    };
                    format!("{scheme}://{user}{hidden}@{hosts}{path}")
                }
                None => base.to_string(),
            }
        }
        None => base.to_string(),
    };
    match query {
        None => base,
        Some(query) => {
            let pairs: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some(("password", _)) => "password=<redacted>".to_string(),
                    _ => pair.to_string(),
                })
                .collect();
            format!("{base}?{}", pairs.join("&"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sources<'a>(password: &'a str, file: &'a str, pg: Option<&str>) -> PasswordSources<'a> {
        PasswordSources {
            password,
            password_file: file,
            pgpassword: pg.map(str::to_string),
        }
    }

    #[test]
    fn sslmode_defaults_to_prefer_and_reaches_libpq_explicitly() {
        let e = Endpoint::resolve("postgresql://u@h:5/db", &sources("", "", None)).unwrap();
        assert_eq!(e.ssl_mode(), SslMode::Prefer);
        assert_eq!(
            e.replication_conninfo(),
            "postgresql://u@h:5/db?sslmode=prefer&replication=database\
             &options=-c%20datestyle%3DISO%20-c%20extra_float_digits%3D3"
        );
        // The URL's own options are kept, ours after them (later wins).
        let own = Endpoint::resolve(
            "postgresql://u@h:5/db?options=-c%20search_path%3Dbooking",
            &sources("", "", None),
        )
        .unwrap();
        assert!(
            own.replication_conninfo().ends_with(
                "&options=-c%20search_path%3Dbooking%20-c%20datestyle%3DISO%20-c%20extra_float_digits%3D3"
            ),
            "{}",
            own.replication_conninfo()
        );
    }

    #[test]
    fn libpq_only_parameters_stay_for_libpq() {
        let url = "postgresql://u@h/db?application_name=v&sslmode=verify-full&sslrootcert=%2Ftmp%2Fca.pem";
        let parts = UrlParts::parse(url).unwrap();
        assert_eq!(parts.ssl_mode, SslMode::VerifyFull);
        assert_eq!(parts.root_cert.as_deref(), Some(Path::new("/tmp/ca.pem")));
        assert_eq!(
            parts.tokio_postgres_url,
            "postgresql://u@h/db?application_name=v&sslmode=require"
        );
    }

    #[test]
    fn verify_modes_need_a_root_file_and_unknown_modes_are_refused() {
        for mode in ["verify-ca", "verify-full"] {
            let e = UrlParts::parse(&format!("postgresql://u@h/db?sslmode={mode}")).unwrap_err();
            assert!(matches!(e, EndpointError::RootCertMissing(_)), "{e}");
            assert!(e.to_string().contains("sslrootcert"), "{e}");
        }
        for mode in ["allow", "on", ""] {
            let e = UrlParts::parse(&format!("postgresql://u@h/db?sslmode={mode}")).unwrap_err();
            assert!(matches!(e, EndpointError::SslMode(_)), "{mode}: {e}");
        }
        let e = UrlParts::parse("postgresql://u@h/db?sslmode=verify-ca&sslrootcert=system")
            .unwrap_err();
        assert!(matches!(e, EndpointError::RootCertSystem), "{e}");
        let e = UrlParts::parse("postgresql://u@h/db?sslcert=/c.pem").unwrap_err();
        assert!(e.to_string().contains("sslcert"), "{e}");
    }

    #[test]
    fn a_root_file_that_is_missing_or_empty_is_a_typed_error() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.pem");
        let url = format!(
            "postgresql://u@h/db?sslmode=verify-full&sslrootcert={}",
            missing.display()
        );
        let e = Endpoint::resolve(&url, &sources("", "", None)).unwrap_err();
        assert!(matches!(e, EndpointError::RootCert { .. }), "{e}");
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let url = format!(
            "postgresql://u@h/db?sslmode=verify-full&sslrootcert={}",
            empty.display()
        );
        let e = Endpoint::resolve(&url, &sources("", "", None)).unwrap_err();
        assert!(matches!(e, EndpointError::RootCertEmpty(_)), "{e}");
    }

    #[test]
    fn the_password_comes_from_one_place() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("pw");
        std::fs::write(&file, "s3cr&t pw\n").unwrap();
        let file = file.to_str().unwrap();

        let e = Endpoint::resolve("postgresql://u@h/db", &sources("", file, Some("pg"))).unwrap();
        assert_eq!(e.config.get_password(), Some(&b"s3cr&t pw"[..]));
        // Percent-encoded for libpq, which decodes %XX in URL values.
        assert!(
            e.replication_conninfo()
                .contains("password=s3cr%26t%20pw&sslmode=prefer&replication=database"),
            "{}",
            e.replication_conninfo()
        );

        let e =
            Endpoint::resolve("postgresql://u@h/db", &sources("direct", "", Some("pg"))).unwrap();
        assert_eq!(e.config.get_password(), Some(&b"direct"[..]));

        // PGPASSWORD only when nothing else sets one; the URL's own wins over it.
        let e = Endpoint::resolve("postgresql://u@h/db", &sources("", "", Some("pg"))).unwrap();
        assert_eq!(e.config.get_password(), Some(&b"pg"[..]));
        let e =
            Endpoint::resolve("postgresql://u:inurl@h/db", &sources("", "", Some("pg"))).unwrap();
        assert_eq!(e.config.get_password(), Some(&b"inurl"[..]));
        assert!(!e.replication_conninfo().contains("password="));

        let e =
            Endpoint::resolve("postgresql://u:inurl@h/db", &sources("x", "", None)).unwrap_err();
        assert!(matches!(e, EndpointError::PasswordTwice), "{e}");
        let e = Endpoint::resolve("postgresql://u@h/db", &sources("x", file, None)).unwrap_err();
        assert!(matches!(e, EndpointError::PasswordSettingsTwice), "{e}");
    }

    #[test]
    fn a_password_file_loses_only_its_line_end() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("pw");
        for (written, read) in [
            ("pw\n", "pw"),
            ("pw\r\n", "pw"),
            ("pw", "pw"),
            (" pw \n\n", " pw \n"),
        ] {
            std::fs::write(&file, written).unwrap();
            assert_eq!(read_password_file(&file).unwrap(), read, "{written:?}");
        }
        std::fs::write(&file, "\n").unwrap();
        assert!(matches!(
            read_password_file(&file),
            Err(EndpointError::PasswordFileEmpty(_))
        ));
        let e = read_password_file(&dir.path().join("missing")).unwrap_err();
        assert!(e.to_string().contains("owner.password_file"), "{e}");
    }

    #[test]
    fn liveness_reaches_both_connections_in_their_units() {
        let liveness = Liveness {
            tcp_user_timeout: Some(Duration::from_millis(10_500)),
            keepalive_idle: Duration::from_secs(15),
            keepalive_interval: Duration::from_secs(5),
        };
        let e = Endpoint::resolve("postgresql://u@h/db", &sources("", "", None))
            .unwrap()
            .with_liveness(&liveness);
        // libpq: milliseconds for the user timeout, seconds for keepalives.
        assert!(
            e.replication_conninfo().ends_with(
                "keepalives=1&keepalives_idle=15&keepalives_interval=5&tcp_user_timeout=10500"
            ),
            "{}",
            e.replication_conninfo()
        );
        assert_eq!(
            e.config.get_tcp_user_timeout(),
            Some(&Duration::from_millis(10_500))
        );
        assert!(e.config.get_keepalives());
        assert_eq!(e.config.get_keepalives_idle(), Duration::from_secs(15));
        assert_eq!(
            e.config.get_keepalives_interval(),
            Some(Duration::from_secs(5))
        );

        // No user timeout: the system's default, and libpq is not told one.
        let e = Endpoint::resolve("postgresql://u@h/db", &sources("", "", None))
            .unwrap()
            .with_liveness(&Liveness {
                tcp_user_timeout: None,
                ..liveness
            });
        assert!(!e.replication_conninfo().contains("tcp_user_timeout"));
        assert_eq!(e.config.get_tcp_user_timeout(), None);
    }

    #[test]
    fn the_url_may_not_name_what_the_liveness_settings_own() {
        for key in [
            "tcp_user_timeout",
            "keepalives",
            "keepalives_idle",
            "keepalives_interval",
            "keepalives_count",
            "keepalives_retries",
        ] {
            let e = UrlParts::parse(&format!("postgresql://u@h/db?{key}=1")).unwrap_err();
            assert!(
                matches!(e, EndpointError::LivenessInUrl { .. }),
                "{key}: {e}"
            );
            assert!(e.to_string().contains("owner."), "{e}");
        }
    }

    #[test]
    fn debug_output_never_shows_the_password() {
        let e =
            Endpoint::resolve("postgresql://u@h/db", &sources("hunter2-secret", "", None)).unwrap();
        let shown = format!("{e:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("Prefer"), "{shown}");
    }

    #[test]
    fn redacted_urls_keep_everything_but_the_password() {
        assert_eq!(
            redacted_url("postgresql://u:pw@h:5/db?sslmode=require&password=x"),
            "postgresql://u:<redacted>@h:5/db?sslmode=require&password=<redacted>"
        );
        assert_eq!(redacted_url("postgresql://u@h/db"), "postgresql://u@h/db");
        assert_eq!(redacted_url("postgresql://h/db"), "postgresql://h/db");
        assert_eq!(redacted_url("nonsense"), "nonsense");
    }
}
