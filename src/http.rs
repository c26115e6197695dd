//! The HTTP server under `/healthz` + `/livez` ([`crate::health`]), `/metrics`
//! ([`crate::metrics`]) and the per-Service health-check node ports: a leaf that knows no routes.
//!
//! Every server here answers a handful of GET endpoints with bodies computed in memory, so a
//! handler is a plain function from request to response; hyper does the protocol work. Servers
//! stop on a shutdown future: they stop accepting at once, ask open connections to finish the
//! request in flight, and give them [`DRAIN_TIMEOUT`] before dropping them.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{CONTENT_TYPE, HeaderName, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::report;

/// How long open connections get to finish after shutdown is signalled.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// A client that opens a connection and sends nothing must not pin a task and a socket forever.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Pause after a failed `accept` (e.g. out of file descriptors) so the loop does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Response bodies are always complete in memory.
pub type Body = Full<Bytes>;

/// Computes a response from a request; shared by all connections of one server.
pub type Handler = Arc<dyn Fn(&Request<Incoming>) -> Response<Body> + Send + Sync>;

/// A server that could not start.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("cannot listen on {addr}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
}

/// A bound server, not yet serving. Binding is separate from serving so that callers (and tests
/// binding port 0) can learn the address and report a bind failure before spawning.
pub struct HttpServer {
    listener: TcpListener,
    handler: Handler,
}

impl HttpServer {
    /// Binds `addr` exactly as given: `0.0.0.0` is IPv4 only, `[::]` is dual-stack where the
    /// kernel allows it (`net.ipv6.bindv6only=0`).
    pub async fn bind(addr: SocketAddr, handler: Handler) -> Result<HttpServer, HttpError> {
        let std = listen(addr, false).map_err(|source| HttpError::Bind { addr, source })?;
        HttpServer::from_std(std, handler).map_err(|source| HttpError::Bind { addr, source })
    }

    /// Wraps a listener bound by [`listen`]; must run inside a tokio runtime context.
    pub(crate) fn from_std(
        listener: std::net::TcpListener,
        handler: Handler,
    ) -> io::Result<HttpServer> {
        Ok(HttpServer {
            listener: TcpListener::from_std(listener)?,
            handler,
        })
    }

    /// The address actually bound (the real port when bound to port 0).
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves until `shutdown` resolves, then drains open connections for at most
    /// [`DRAIN_TIMEOUT`].
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) {
        let HttpServer { listener, handler } = self;
        let addr = listener.local_addr().ok();
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut conns = JoinSet::new();
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => {
                        conns.spawn(serve_connection(stream, handler.clone(), stop_rx.clone()));
                    }
                    Err(e) => {
                        tracing::warn!(?addr, error = %e, "accepting an HTTP connection failed");
                        tokio::time::sleep(ACCEPT_BACKOFF).await;
                    }
                },
                // Reap finished connections so the set does not grow with every request.
                Some(_) = conns.join_next(), if !conns.is_empty() => {}
            }
        }
        // Closing the listener first frees the port for whoever binds it next.
        drop(listener);
        let _ = stop_tx.send(true);
        let drained = tokio::time::timeout(DRAIN_TIMEOUT, async {
            while conns.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tracing::debug!(
                ?addr,
                open = conns.len(),
                "dropping HTTP connections after drain timeout"
            );
        }
        // Dropping the set aborts whatever is left.
    }
}

async fn serve_connection(stream: TcpStream, handler: Handler, mut stop: watch::Receiver<bool>) {
    let service = service_fn(move |req: Request<Incoming>| {
        let resp = handler(&req);
        async move { Ok::<_, Infallible>(resp) }
    });
    let conn = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    tokio::select! {
        res = conn.as_mut() => {
            if let Err(e) = res {
                tracing::debug!(error = %report::chain(&e), "HTTP connection ended with an error");
            }
            return;
        }
        // `Err` means the server is gone: stop as well.
        _ = stop.wait_for(|stopping| *stopping) => conn.as_mut().graceful_shutdown(),
    }
    if let Err(e) = conn.await {
        tracing::debug!(error = %report::chain(&e), "HTTP connection ended with an error while draining");
    }
}

/// Opens a listening socket. With `dual_stack`, an IPv6 wildcard is made to accept IPv4 too
/// regardless of `net.ipv6.bindv6only`. `SO_REUSEADDR` lets a restarted nodeproxy rebind while old
/// connections sit in TIME_WAIT.
pub(crate) fn listen(addr: SocketAddr, dual_stack: bool) -> io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    if dual_stack && addr.is_ipv6() {
        socket.set_only_v6(false)?;
    }
    socket.set_reuse_address(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    Ok(socket.into())
}

/// Listens on every local address of both families: `[::]` dual-stack, or `0.0.0.0` when the
/// host has no IPv6. Returns the address bound.
pub(crate) fn listen_all(port: u16) -> io::Result<(SocketAddr, std::net::TcpListener)> {
    let v6 = SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port);
    match listen(v6, true) {
        Ok(l) => Ok((v6, l)),
        Err(e) if ipv6_unavailable(&e) => {
            let v4 = SocketAddr::from(([0, 0, 0, 0], port));
            listen(v4, false).map(|l| (v4, l))
        }
        Err(e) => Err(e),
    }
}

/// IPv6 disabled (module absent, or `ipv6.disable=1`): IPv4 is all there is.
fn ipv6_unavailable(e: &io::Error) -> bool {
    use nix::errno::Errno;
    matches!(
        e.raw_os_error().map(Errno::from_raw),
        Some(Errno::EAFNOSUPPORT | Errno::EADDRNOTAVAIL)
    )
}

/// A response with `status`, `content_type` and `body`.
pub fn respond(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<Body> {
    let mut resp = Response::new(Full::new(body.into()));
    *resp.status_mut() = status;
    let headers = resp.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    // Same as kube-proxy: browsers must not guess a type for these bodies.
    headers.insert(
        HeaderName::from_static("x-content-type-options"),
        HeaderValue::from_static("nosniff"),
    );
    resp
}

/// The answer to a path a server does not serve (the text Go's `net/http` sends).
pub fn not_found() -> Response<Body> {
    respond(
        StatusCode::NOT_FOUND,
        "text/plain; charset=utf-8",
        "404 page not found\n",
    )
}

#[cfg(test)]
pub(crate) mod test_client;
#[cfg(test)]
mod tests;
