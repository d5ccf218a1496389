//! A loopback TCP path to the owner that a test or a bench can make drop
//! every packet, as a network does when a firewall or NAT loses a
//! connection's state or a host vanishes without a reset.
//!
//! Nothing is refused or closed: while the path drops, every connection
//! stays open, nothing is read from either side and nothing is forwarded,
//! and new connections are accepted and then ignored. When the path heals,
//! connections opened from then on are forwarded again, but the ones that
//! went dark stay dark for good (the state that carried them is gone), so
//! a client that keeps using one never hears back. On loopback the kernel
//! still acknowledges every byte, so only a client's own timeouts (not
//! `TCP_USER_TIMEOUT` or keepalives) can notice: that is what this tests.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Which connections forward: those opened in the current `era`, while the
/// path is not dropping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PathState {
    /// Bumped at every heal: connections of an earlier era never forward again.
    era: u64,
    dropping: bool,
}

impl PathState {
    fn forwards(self, era: u64) -> bool {
        self.era == era && !self.dropping
    }
}

/// The path: listens on `addr` and forwards to the target while healthy.
/// Dropping it closes every connection it holds.
pub struct Blackhole {
    pub addr: SocketAddr,
    target: SocketAddr,
    state: watch::Sender<PathState>,
    closed: CancellationToken,
}

impl Blackhole {
    /// A healthy path to `target` on a free loopback port.
    pub async fn to(target: SocketAddr) -> std::io::Result<Blackhole> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (state, _) = watch::channel(PathState {
            era: 0,
            dropping: false,
        });
        let closed = CancellationToken::new();
        tokio::spawn(accept(listener, target, state.clone(), closed.clone()));
        Ok(Blackhole {
            addr,
            target,
            state,
            closed,
        })
    }

    /// `url` (a `postgresql://` URL naming the target's port) through this path.
    pub fn url_for(&self, url: &str) -> String {
        url.replacen(
            &format!(":{}/", self.target.port()),
            &format!(":{}/", self.addr.port()),
            1,
        )
    }

    /// From now on every packet is dropped, both ways, on every connection.
    pub fn drop_packets(&self) {
        self.state.send_modify(|s| s.dropping = true);
    }

    /// New connections are forwarded again; those that went dark stay dark.
    pub fn heal(&self) {
        self.state.send_modify(|s| {
            s.dropping = false;
            s.era += 1;
        });
    }
}

impl Drop for Blackhole {
    fn drop(&mut self) {
        self.closed.cancel();
    }
}

async fn accept(
    listener: TcpListener,
    target: SocketAddr,
    state: watch::Sender<PathState>,
    closed: CancellationToken,
) {
    loop {
        let inbound = tokio::select! {
            _ = closed.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((inbound, _)) => inbound,
                Err(_) => continue,
            },
        };
        let opened = *state.borrow();
        let path_closed = closed.clone();
        let watch = state.subscribe();
        tokio::spawn(async move {
            if opened.dropping {
                // Accepted into a dead path: held open, never answered.
                path_closed.cancelled().await;
                drop(inbound);
                return;
            }
            let Ok(outbound) = TcpStream::connect(target).await else {
                return;
            };
            let (client_read, client_write) = inbound.into_split();
            let (owner_read, owner_write) = outbound.into_split();
            tokio::select! {
                _ = path_closed.cancelled() => {}
                _ = async {
                    tokio::join!(
                        pump(client_read, owner_write, watch.clone(), opened.era),
                        pump(owner_read, client_write, watch, opened.era),
                    )
                } => {}
            }
        });
    }
}

/// Copies one direction while the path forwards this connection's era; once
/// it does not, stops reading and writing for good (the sockets stay open).
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut state: watch::Receiver<PathState>,
    era: u64,
) {
    let mut buffer = vec![0u8; 16 * 1024];
    loop {
        if state.wait_for(|s| s.forwards(era)).await.is_err() {
            return;
        }
        let read = tokio::select! {
            read = from.read(&mut buffer) => read,
            _ = state.wait_for(|s| !s.forwards(era)) => continue,
        };
        let n = match read {
            Ok(0) | Err(_) => {
                let _ = to.shutdown().await;
                return;
            }
            Ok(n) => n,
        };
        // Read just as the path went dark: lost with it.
        if !state.borrow().forwards(era) {
            continue;
        }
        if to.write_all(&buffer[..n]).await.is_err() {
            return;
        }
    }
}
