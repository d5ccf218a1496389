//! The one HTTP client of the lab and the integration tests: `reqwest` over
//! loopback HTTP/1.1 (no TLS, no proxy, everything here talks to a
//! `vacancy` on this machine), each answer read whole into an
//! [`HttpResponse`], every exchange bounded in time and in size.
//!
//! Hold an [`HttpClient`] where requests repeat (the simulator's guests, the
//! search bench's load generator): it keeps one connection pool, so requests
//! reuse kept-alive connections. [`request_once`], [`http`] and [`get`]
//! build a client for one exchange, for callers that ask once or seldom
//! (the tests, mostly).
//!
//! A pool belongs to the tokio runtime that opened its connections (their
//! tasks run there), so a client is built on the runtime that uses it and is
//! not kept across runtimes.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use reqwest::header::{AUTHORIZATION, CONTENT_TYPE, HeaderMap};
use reqwest::{Method, RequestBuilder};
use serde_json::Value;

/// Largest answer read; a search page is far smaller.
pub const MAX_RESPONSE_BYTES: usize = 8 * 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// The connection failed (refused, reset, closed early): the kind is
    /// the one the socket reported, for callers that count failures by kind.
    #[error("i/o: {0}")]
    Io(std::io::Error),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("response larger than {MAX_RESPONSE_BYTES} bytes")]
    TooLarge,
    #[error("not an HTTP method: {0:?}")]
    Method(String),
    /// Anything else the client refused or could not parse.
    #[error("http: {0}")]
    Http(reqwest::Error),
}

impl From<reqwest::Error> for HttpError {
    fn from(error: reqwest::Error) -> HttpError {
        // reqwest wraps hyper's error, which wraps the socket's: the socket's
        // kind is what tells a refused connection from a reset one.
        let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&error);
        while let Some(cause) = source {
            if let Some(io) = cause.downcast_ref::<std::io::Error>() {
                return HttpError::Io(std::io::Error::new(io.kind(), io.to_string()));
            }
            source = cause.source();
        }
        HttpError::Http(error)
    }
}

/// An answer: status, headers (names are lowercase), the whole body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl HttpResponse {
    /// The first value of header `name`, if it is text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The body as JSON; `Null` when it is not JSON.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    /// The body as text, invalid UTF-8 replaced (for messages and scrapes).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// The builder every client here starts from: no proxy (a proxy from the
/// environment must not stand between a test and its loopback server), and
/// no Nagle delay on requests that are one small write each.
pub fn client_builder() -> reqwest::ClientBuilder {
    reqwest::Client::builder().no_proxy().tcp_nodelay(true)
}

/// A client for one `vacancy` at `addr`: one connection pool, one time
/// limit per exchange.
#[derive(Debug, Clone)]
pub struct HttpClient {
    client: reqwest::Client,
    base: String,
    timeout: Duration,
}

impl HttpClient {
    pub fn new(addr: SocketAddr, timeout: Duration) -> Result<HttpClient, HttpError> {
        Ok(HttpClient::with_client(
            client_builder().build()?,
            addr,
            timeout,
        ))
    }

    /// Around a client built elsewhere (with other pool settings).
    pub fn with_client(client: reqwest::Client, addr: SocketAddr, timeout: Duration) -> HttpClient {
        HttpClient {
            client,
            base: format!("http://{addr}"),
            timeout,
        }
    }

    /// The absolute URL of `path` (which starts with `/`).
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// A request to build on (headers, body), for [`HttpClient::send`], or
    /// sent by the caller to read the body as it comes (a stream of events).
    pub fn request(&self, method: Method, path: &str) -> RequestBuilder {
        self.client.request(method, self.url(path))
    }

    /// Sends `request` and reads the whole answer, within the time limit.
    pub async fn send(&self, request: RequestBuilder) -> Result<HttpResponse, HttpError> {
        let exchange = async {
            let response = request.send().await?;
            read_whole(response).await
        };
        tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| HttpError::Timeout(self.timeout))?
    }

    pub async fn get(&self, path: &str) -> Result<HttpResponse, HttpError> {
        self.send(self.request(Method::GET, path)).await
    }

    /// A POST of a JSON body, with a bearer token when given.
    pub async fn post_json(
        &self,
        path: &str,
        bearer: Option<&str>,
        body: impl Into<Bytes>,
    ) -> Result<HttpResponse, HttpError> {
        let mut request = self
            .request(Method::POST, path)
            .header(CONTENT_TYPE, "application/json")
            .body(body.into());
        if let Some(token) = bearer {
            request = request.header(AUTHORIZATION, format!("Bearer {token}"));
        }
        self.send(request).await
    }
}

/// The status, headers and whole body of `response`, refusing a body over
/// [`MAX_RESPONSE_BYTES`] before reading it when its length is announced,
/// and as soon as it passes the bound when it is not.
async fn read_whole(mut response: reqwest::Response) -> Result<HttpResponse, HttpError> {
    let status = response.status().as_u16();
    let headers = std::mem::take(response.headers_mut());
    let body = match response.content_length() {
        Some(length) if length > MAX_RESPONSE_BYTES as u64 => return Err(HttpError::TooLarge),
        // The common case (axum announces its bodies' length): one buffer,
        // no copy.
        Some(_) => response.bytes().await?,
        None => {
            let mut body = BytesMut::new();
            while let Some(chunk) = response.chunk().await? {
                if body.len() + chunk.len() > MAX_RESPONSE_BYTES {
                    return Err(HttpError::TooLarge);
                }
                body.extend_from_slice(&chunk);
            }
            body.freeze()
        }
    };
    Ok(HttpResponse {
        status,
        headers,
        body,
    })
}

/// One exchange on a client of its own, for callers that ask once: `method`
/// `path` at `addr` with `headers` and `body`. Its connection closes when it
/// returns (nothing is kept idle).
pub async fn request_once(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
    timeout: Duration,
) -> Result<HttpResponse, HttpError> {
    let parsed_method =
        Method::from_bytes(method.as_bytes()).map_err(|_| HttpError::Method(method.to_string()))?;
    let client = HttpClient::with_client(
        client_builder().pool_max_idle_per_host(0).build()?,
        addr,
        timeout,
    );
    let mut request = client.request(parsed_method, path);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    if let Some(bytes) = body {
        request = request.body(bytes.to_vec());
    }
    client.send(request).await
}

/// One exchange (see [`request_once`]) with a bearer token and a JSON body
/// when given.
pub async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    bearer: Option<&str>,
    body: Option<&[u8]>,
    timeout: Duration,
) -> Result<HttpResponse, HttpError> {
    let authorization = bearer.map(|token| format!("Bearer {token}"));
    let mut headers = Vec::new();
    if let Some(value) = &authorization {
        headers.push((AUTHORIZATION.as_str(), value.as_str()));
    }
    if body.is_some() {
        headers.push((CONTENT_TYPE.as_str(), "application/json"));
    }
    request_once(addr, method, path, &headers, body, timeout).await
}

/// A GET on a client of its own (see [`request_once`]).
pub async fn get(
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
) -> Result<HttpResponse, HttpError> {
    request_once(addr, "GET", path, &[], None, timeout).await
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};

    /// A server on loopback that answers each connection with `answer`
    /// after reading the request head.
    async fn serve(answer: &'static [u8]) -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut byte = [0u8; 1];
                    while !head.ends_with(b"\r\n\r\n") {
                        if stream.read(&mut byte).await.unwrap_or(0) == 0 {
                            return;
                        }
                        head.push(byte[0]);
                    }
                    let _ = stream.write_all(answer).await;
                    let _ = stream.shutdown().await;
                });
            }
        });
        addr
    }

    /// A kept-alive server on loopback that answers every request with the
    /// request itself (head and body), and counts the connections it accepted.
    async fn echo() -> (SocketAddr, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(AtomicUsize::new(0));
        let counted = connections.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut reader = tokio::io::BufReader::new(stream);
                    loop {
                        let mut request = String::new();
                        let mut length = 0;
                        loop {
                            let mut line = String::new();
                            if reader.read_line(&mut line).await.unwrap_or(0) == 0 {
                                return;
                            }
                            if let Some(v) =
                                line.to_ascii_lowercase().strip_prefix("content-length:")
                            {
                                length = v.trim().parse().unwrap();
                            }
                            request.push_str(&line);
                            if line == "\r\n" {
                                break;
                            }
                        }
                        let mut body = vec![0; length];
                        reader.read_exact(&mut body).await.unwrap();
                        request.push_str(std::str::from_utf8(&body).unwrap());
                        let answer = format!(
                            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{request}",
                            request.len()
                        );
                        if reader.get_mut().write_all(answer.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (addr, connections)
    }

    #[tokio::test]
    async fn sends_the_method_headers_and_body_asked_for() {
        let timeout = Duration::from_secs(10);
        let (addr, _) = echo().await;
        let r = http(
            addr,
            "POST",
            "/v1/take-outcomes",
            Some("t0k"),
            Some(b"{\"a\":1}"),
            timeout,
        )
        .await
        .unwrap();
        let echoed = r.text().to_ascii_lowercase();
        assert!(
            echoed.starts_with("post /v1/take-outcomes http/1.1\r\n"),
            "{echoed}"
        );
        assert!(
            echoed.contains("\r\nauthorization: bearer t0k\r\n"),
            "{echoed}"
        );
        assert!(
            echoed.contains("\r\ncontent-type: application/json\r\n"),
            "{echoed}"
        );
        assert!(echoed.ends_with("\r\n\r\n{\"a\":1}"), "{echoed}");
        let r = request_once(
            addr,
            "OPTIONS",
            "/x?q=1",
            &[("X-Forwarded-For", "203.0.113.7")],
            None,
            timeout,
        )
        .await
        .unwrap();
        let echoed = r.text().to_ascii_lowercase();
        assert!(
            echoed.starts_with("options /x?q=1 http/1.1\r\n"),
            "{echoed}"
        );
        assert!(
            echoed.contains("\r\nx-forwarded-for: 203.0.113.7\r\n"),
            "{echoed}"
        );
        assert!(matches!(
            request_once(addr, "NOT A METHOD", "/", &[], None, timeout).await,
            Err(HttpError::Method(_))
        ));
    }

    #[tokio::test]
    async fn one_client_keeps_its_connection_for_the_next_request() {
        let (addr, connections) = echo().await;
        let api = HttpClient::new(addr, Duration::from_secs(10)).unwrap();
        for n in 0..3 {
            let r = api
                .post_json("/report", None, format!("{{\"n\":{n}}}"))
                .await
                .unwrap();
            assert!(
                r.text().ends_with(&format!("{{\"n\":{n}}}")),
                "{}",
                r.text()
            );
        }
        assert_eq!(connections.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn reads_plain_and_chunked_bodies_whole() {
        let timeout = Duration::from_secs(10);
        let plain = serve(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}").await;
        let r = get(plain, "/", timeout).await.unwrap();
        assert_eq!((r.status, &r.body[..]), (200, &b"{}"[..]));
        assert_eq!(r.header("content-length"), Some("2"));
        assert_eq!(r.json(), serde_json::json!({}));
        // A CRLF inside a chunk is body, not framing.
        let chunked = serve(
            b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n4\r\na\r\nb\r\n2;x=y\r\nde\r\n0\r\n\r\n",
        )
        .await;
        let r = get(chunked, "/", timeout).await.unwrap();
        assert_eq!((r.status, r.text().as_str()), (201, "a\r\nbde"));
    }

    #[tokio::test]
    async fn malformed_and_missing_answers_are_errors() {
        let timeout = Duration::from_secs(10);
        let garbage = serve(b"garbage\r\n\r\n").await;
        assert!(get(garbage, "/", timeout).await.is_err());
        let bad_chunk = serve(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n").await;
        assert!(get(bad_chunk, "/", timeout).await.is_err());
        let cut_short =
            serve(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n9\r\nab").await;
        assert!(get(cut_short, "/", timeout).await.is_err());
        // Nobody listens there: the socket's own kind comes through.
        let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let nobody = closed.local_addr().unwrap();
        drop(closed);
        match get(nobody, "/", timeout).await {
            Err(HttpError::Io(e)) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused),
            other => panic!("expected a refused connection, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_silent_server_is_a_timeout_and_a_huge_body_is_refused() {
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = silent.local_addr().unwrap();
        let limit = Duration::from_millis(200);
        assert!(matches!(
            get(addr, "/", limit).await,
            Err(HttpError::Timeout(t)) if t == limit
        ));
        drop(silent);
        let huge = serve(b"HTTP/1.1 200 OK\r\ncontent-length: 9000000\r\n\r\n").await;
        assert!(matches!(
            get(huge, "/", Duration::from_secs(10)).await,
            Err(HttpError::TooLarge)
        ));
    }
}
