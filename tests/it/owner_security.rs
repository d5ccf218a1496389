//! Least privilege at the owner: `vacancy serve` over TLS (the owner's
//! `pg_hba.conf` accepting TLS connections only), with `sslmode` from
//! `require` to `verify-full`, and as a role that may only log in with a
//! password, replicate and read the three tables.
//!
//! Certificates are made here (rcgen): a CA that signed the server's
//! certificate (for 127.0.0.1 only), and an unrelated CA as the wrong root.

use std::path::Path;
use std::time::Duration;

use serde_json::Value;
use tokio_postgres::Client;
use vacancy_lab::cluster::{ClusterOptions, ServerTls};
use vacancy_service::slot;
use vacancy_service::{OwnerError, SslMode};

use crate::api::get;
use crate::process::Serve;
use crate::support::{TestOwner, least_privilege_role, wait_for};

/// The server's certificate and key, its CA, and a CA that signed nothing here.
struct Certs {
    server: ServerTls,
    ca_pem: String,
    other_ca_pem: String,
}

fn make_ca(name: &str) -> (rcgen::Issuer<'static, rcgen::KeyPair>, String) {
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("ca params");
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
    ];
    let key = rcgen::KeyPair::generate().expect("ca key");
    let cert = params.self_signed(&key).expect("self-signed ca");
    (rcgen::Issuer::new(params, key), cert.pem())
}

fn make_certs() -> Certs {
    let (ca, ca_pem) = make_ca("vacancy test CA");
    let (_, other_ca_pem) = make_ca("some other CA");
    // For the address only: a client that asks for `localhost` gets a
    // certificate that does not name it.
    let mut params =
        rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).expect("server params");
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "vacancy test owner");
    let key = rcgen::KeyPair::generate().expect("server key");
    let cert = params.signed_by(&key, &ca).expect("server certificate");
    Certs {
        server: ServerTls {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        },
        ca_pem,
        other_ca_pem,
    }
}

/// An owner that accepts TLS connections only (ordinary and replication),
/// the role `vac` with a SCRAM password (as README.md advises), others trusted.
async fn tls_only_owner(certs: &Certs) -> TestOwner {
    TestOwner::start_with(ClusterOptions {
        tls: Some(certs.server.clone()),
        hba: Some(vec![
            "local all all trust".into(),
            "hostssl all vac 127.0.0.1/32 scram-sha-256".into(),
            "hostssl replication vac 127.0.0.1/32 scram-sha-256".into(),
            "hostssl all all 127.0.0.1/32 trust".into(),
            "hostssl replication all 127.0.0.1/32 trust".into(),
        ]),
        ..ClusterOptions::default()
    })
    .await
}

fn with_params(url: &str, params: &str) -> String {
    format!("{url}?{params}")
}

/// One hotel in Lisbon with one room type of `total` units for ten nights.
async fn one_hotel(client: &Client, total: i32) {
    client
        .batch_execute(&format!(
            "INSERT INTO hotels (id, name, city) VALUES (1, 'One', 'Lisbon');
             INSERT INTO room_types VALUES (1, 1, 'Double', 2);
             INSERT INTO inventory (hotel_id, room_type_id, night, total, price_cents)
               SELECT 1, 1, DATE '{}' + n, {total}, 10000 FROM generate_series(0, 9) n;",
            tomorrow()
        ))
        .await
        .expect("one hotel");
}

fn tomorrow() -> chrono::NaiveDate {
    chrono::Utc::now().date_naive() + chrono::Days::new(1)
}

/// Free units the copy holds for tomorrow (`/v1/hotels/1/calendar`: the
/// copy's own counts, never the owner's).
async fn copy_free_tomorrow(serve: &Serve) -> Option<i64> {
    let day = tomorrow();
    let (code, _, body) = get(
        serve.addr,
        &format!(
            "/v1/hotels/1/calendar?from={day}&to={}",
            day + chrono::Days::new(1)
        ),
    )
    .await;
    if code != 200 {
        return None;
    }
    let v: Value = serde_json::from_str(&body).ok()?;
    let night = &v["room_types"][0]["nights"][0];
    Some(night["total"].as_i64()? - night["taken"].as_i64()?)
}

/// Takes `units` of tomorrow on the owner (which had `free_before` free),
/// waits until `serve` applied it, and checks the copy and a search show it.
async fn a_change_reaches_search(serve: &Serve, client: &Client, free_before: i64, units: i64) {
    client
        .execute(
            "UPDATE inventory SET taken = taken + $1 WHERE hotel_id = 1 AND night = $2",
            &[&(units as i32), &tomorrow()],
        )
        .await
        .expect("take units on the owner");
    let target = slot::current_wal_lsn(client).await.expect("owner lsn");
    serve.caught_up(target, Duration::from_secs(60)).await;
    assert_eq!(copy_free_tomorrow(serve).await, Some(free_before - units));
    let query = format!(
        "/v1/search?city=lisbon&check_in={}&check_out={}&room=2",
        tomorrow(),
        tomorrow() + chrono::Days::new(1)
    );
    // The index follows the copy in batches: wait for the hotel to be found.
    let v: Value = wait_for("the hotel in search", Duration::from_secs(30), || async {
        let (code, _, body) = get(serve.addr, &query).await;
        let v: Value = serde_json::from_str(&body).ok()?;
        (code == 200 && v["results"][0]["room_types"][0]["free_units"].is_number()).then_some(v)
    })
    .await;
    assert_eq!(
        v["results"][0]["room_types"][0]["free_units"],
        free_before - units,
        "{v}"
    );
}

/// `vacancy serve` as operators run it, TLS from the URL.
fn serve(url: &str, dir: &Path, name: &str, env: &[(&str, &str)]) -> Serve {
    let slot = format!("VACANCY_STREAM__SLOT={name}");
    let (key, value) = slot.split_once('=').expect("slot env");
    let mut env = env.to_vec();
    env.push((key, value));
    Serve::start_with(url, dir, name, &env)
}

/// The owner accepts TLS only; `vacancy serve` with `sslmode=require` loads
/// the snapshot and follows the stream, and the walsender's connection is
/// encrypted (libpq got the mode). With `verify-full` and the CA that signed
/// the server's certificate it works too, as the least-privilege role with
/// its password from `VACANCY_OWNER__PASSWORD` (SCRAM over TLS, on both
/// connections).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_replicates_over_tls_with_require_and_verify_full() {
    let certs = make_certs();
    let owner = tls_only_owner(&certs).await;
    let client = owner.client().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, &certs.ca_pem).expect("ca file");

    // The owner really refuses a connection without TLS.
    let plain = vacancy_service::connect(
        &with_params(&owner.url, "sslmode=disable"),
        Duration::from_secs(10),
    )
    .await
    .expect_err("a plain connection is refused");
    assert!(matches!(plain, OwnerError::Connect(_)), "{plain}");
    assert!(plain.to_string().contains("no encryption"), "{plain}");

    one_hotel(&client, 9).await;
    let require = serve(
        &with_params(&owner.url, "sslmode=require"),
        dir.path(),
        "require",
        &[],
    );
    let target = slot::current_wal_lsn(&client).await.expect("owner lsn");
    require.caught_up(target, Duration::from_secs(60)).await;
    a_change_reaches_search(&require, &client, 9, 2).await;
    let walsenders: Vec<(String, bool)> = client
        .query(
            "SELECT r.application_name, s.ssl FROM pg_stat_replication r
               JOIN pg_stat_ssl s ON s.pid = r.pid",
            &[],
        )
        .await
        .expect("pg_stat_replication")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert!(
        !walsenders.is_empty() && walsenders.iter().all(|(_, ssl)| *ssl),
        "the replication connection is encrypted: {walsenders:?}"
    );

    let password = "tls-and-scram";
    let vac = least_privilege_role(&client, &owner.url, Some(password)).await;
    let full = serve(
        &with_params(
            &vac,
            &format!("sslmode=verify-full&sslrootcert={}", ca.display()),
        ),
        dir.path(),
        "verify_full",
        &[("VACANCY_OWNER__PASSWORD", password)],
    );
    let target = slot::current_wal_lsn(&client).await.expect("owner lsn");
    full.caught_up(target, Duration::from_secs(60)).await;
    a_change_reaches_search(&full, &client, 7, 1).await;
    let vac_walsender: Vec<bool> = client
        .query(
            "SELECT s.ssl FROM pg_stat_replication r JOIN pg_stat_ssl s ON s.pid = r.pid
              WHERE r.usename = 'vac'",
            &[],
        )
        .await
        .expect("pg_stat_replication")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(vac_walsender, vec![true]);
    let log = std::fs::read_to_string(&full.log).unwrap_or_default();
    assert!(log.contains("\"owner_sslmode\":\"verify-full\""), "{log}");
    assert!(!log.contains(password), "the password leaked into the log");
}

/// A certificate that does not chain to `sslrootcert` is refused with a
/// typed error naming the mode, never a panic: `vacancy serve` keeps running,
/// not ready, and says why in `/v1/status`. `verify-full` also checks the
/// name (the certificate names 127.0.0.1, not localhost); `verify-ca` does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_root_or_name_is_a_typed_tls_error() {
    let certs = make_certs();
    let owner = tls_only_owner(&certs).await;
    let client = owner.client().await;
    one_hotel(&client, 9).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let (ca, other) = (dir.path().join("ca.pem"), dir.path().join("other.pem"));
    std::fs::write(&ca, &certs.ca_pem).expect("ca file");
    std::fs::write(&other, &certs.other_ca_pem).expect("other ca file");
    let connect =
        |url: String| async move { vacancy_service::connect(&url, Duration::from_secs(10)).await };
    let verify = |mode: &str, root: &Path| format!("sslmode={mode}&sslrootcert={}", root.display());

    let wrong_root = connect(with_params(&owner.url, &verify("verify-full", &other)))
        .await
        .expect_err("a certificate from another CA");
    match &wrong_root {
        OwnerError::Tls { mode, source } => {
            assert_eq!(*mode, SslMode::VerifyFull);
            assert!(
                matches!(
                    source,
                    rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer)
                ),
                "{source:?}"
            );
        }
        other => panic!("expected a TLS error, got {other:?}"),
    }
    assert!(
        wrong_root.to_string().contains("sslmode=verify-full"),
        "{wrong_root}"
    );

    let by_name = owner.url.replacen("127.0.0.1", "localhost", 1);
    let wrong_name = connect(with_params(&by_name, &verify("verify-full", &ca)))
        .await
        .expect_err("a certificate for another name");
    assert!(
        matches!(
            &wrong_name,
            OwnerError::Tls {
                source: rustls::Error::InvalidCertificate(
                    rustls::CertificateError::NotValidForName
                        | rustls::CertificateError::NotValidForNameContext { .. }
                ),
                ..
            }
        ),
        "{wrong_name:?}"
    );
    connect(with_params(&by_name, &verify("verify-ca", &ca)))
        .await
        .expect("verify-ca checks the chain, not the name");
    // libpq's compatibility rule: require with a root file checks the chain.
    let require_other = connect(with_params(&owner.url, &verify("require", &other)))
        .await
        .expect_err("require with a root file checks the chain");
    assert!(
        matches!(require_other, OwnerError::Tls { .. }),
        "{require_other:?}"
    );

    let mut wrong = serve(
        &with_params(&owner.url, &verify("verify-full", &other)),
        dir.path(),
        "wrong_root",
        &[],
    );
    let error = wait_for(
        "the TLS error in /v1/status",
        Duration::from_secs(30),
        || async {
            let status = wrong.status().await?;
            let error = status["last_error"].as_str()?.to_string();
            error.contains("TLS").then_some(error)
        },
    )
    .await;
    assert!(
        error.contains("TLS with the owner database failed (sslmode=verify-full)")
            && error.contains("UnknownIssuer"),
        "{error}"
    );
    assert_eq!(get(wrong.addr, "/readyz").await.0, 503);
    assert!(
        wrong.child.try_wait().expect("child state").is_none(),
        "vacancy serve keeps running and retrying; log:\n{}",
        wrong.log_tail()
    );
    let log = std::fs::read_to_string(&wrong.log).unwrap_or_default();
    assert!(!log.contains("panicked"), "{log}");
}

/// `vacancy serve` as a role that may log in (with a password, from a file),
/// replicate and read the three tables, and nothing else: it cannot create
/// the publication, so it says what a DBA must run; once the DBA ran exactly
/// that, the snapshot loads and changes on the owner reach search. The
/// password never shows in its output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_runs_as_a_least_privilege_role_with_a_password_file() {
    let owner = TestOwner::start_with(ClusterOptions {
        hba: Some(vec![
            "local all all trust".into(),
            "host all vac 127.0.0.1/32 scram-sha-256".into(),
            "host replication vac 127.0.0.1/32 scram-sha-256".into(),
            "host all all 127.0.0.1/32 trust".into(),
            "host replication all 127.0.0.1/32 trust".into(),
        ]),
        ..ClusterOptions::default()
    })
    .await;
    let client = owner.client().await;
    one_hotel(&client, 9).await;
    // Characters a URL or a conninfo would need quoted.
    let password = "c0rrect horse&battery?staple=%";
    let url = least_privilege_role(&client, &owner.url, Some(password)).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let password_file = dir.path().join("owner-password");
    std::fs::write(&password_file, format!("{password}\n")).expect("password file");

    // The role needs its password: without one the owner refuses it.
    let refused = vacancy_service::connect(&url, Duration::from_secs(10))
        .await
        .expect_err("no password");
    assert!(refused.to_string().contains("password"), "{refused}");

    // What the heartbeat and the TTL re-reads' watermarks need of the role.
    let as_vac = vacancy_service::Endpoint::resolve(
        &url,
        &vacancy_service::PasswordSources {
            password,
            ..Default::default()
        },
    )
    .expect("endpoint")
    .connect(Duration::from_secs(10))
    .await
    .expect("the role logs in with its password");
    as_vac
        .execute(
            "SELECT pg_logical_emit_message(true, 'vacancy.heartbeat', 'x')",
            &[],
        )
        .await
        .expect("the role may write logical messages");

    let serve = Serve::start_with(
        &url,
        dir.path(),
        "least",
        &[(
            "VACANCY_OWNER__PASSWORD_FILE",
            password_file.to_str().expect("utf-8 path"),
        )],
    );
    let error = wait_for(
        "the SQL for a DBA in /v1/status",
        Duration::from_secs(30),
        || async {
            let status = serve.status().await?;
            let error = status["last_error"].as_str()?.to_string();
            error.contains("ask a DBA").then_some(error)
        },
    )
    .await;
    let sql = error
        .split_once("ask a DBA to run:")
        .map(|(_, sql)| sql.trim().to_string())
        .expect("the SQL follows");
    assert_eq!(
        sql,
        "CREATE PUBLICATION vacancy FOR TABLE public.hotels, public.room_types, public.inventory;"
    );
    let status = serve.status().await.expect("status");
    assert_ne!(status["snapshot"]["phase"], "loaded", "{status}");
    let log = std::fs::read_to_string(&serve.log).unwrap_or_default();
    assert!(
        log.contains("CREATE PUBLICATION vacancy FOR TABLE"),
        "{log}"
    );

    // The DBA runs what it printed.
    client
        .batch_execute(&sql)
        .await
        .expect("the DBA's SQL runs");
    let target = slot::current_wal_lsn(&client).await.expect("owner lsn");
    serve.caught_up(target, Duration::from_secs(60)).await;
    a_change_reaches_search(&serve, &client, 9, 3).await;
    let walsender: Vec<String> = client
        .query("SELECT usename::text FROM pg_stat_replication", &[])
        .await
        .expect("pg_stat_replication")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(walsender, vec!["vac".to_string()]);
    let superuser: bool = client
        .query_one("SELECT rolsuper FROM pg_roles WHERE rolname = 'vac'", &[])
        .await
        .expect("pg_roles")
        .get(0);
    assert!(!superuser);

    let log = std::fs::read_to_string(&serve.log).unwrap_or_default();
    assert!(!log.contains("c0rrect"), "the password leaked into the log");
}
