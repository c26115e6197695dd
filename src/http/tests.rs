//! Unit tests for the HTTP server: responses, start-up errors and graceful shutdown.
use super::test_client::{get, refused_within};
use super::*;
use std::net::Ipv4Addr;

const LOCALHOST: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// Answers `/hello`; everything else is not found.
fn hello() -> Handler {
    Arc::new(|req| match req.uri().path() {
        "/hello" => respond(StatusCode::OK, "text/plain; charset=utf-8", "hi"),
        _ => not_found(),
    })
}

async fn hello_server() -> (SocketAddr, watch::Sender<()>) {
    let server = HttpServer::bind(SocketAddr::from((LOCALHOST, 0)), hello())
        .await
        .unwrap();
    let addr = server.local_addr().unwrap();
    let (stop, mut stopped) = watch::channel(());
    tokio::spawn(server.run(async move { while stopped.changed().await.is_ok() {} }));
    (addr, stop)
}

#[tokio::test]
async fn a_server_answers_its_routes_with_nosniff_and_404_elsewhere() {
    let (addr, _stop) = hello_server().await;
    let reply = get(addr, "/hello").await.unwrap();
    assert_eq!((reply.status, reply.body.as_str()), (200, "hi"));
    assert_eq!(reply.header("x-content-type-options"), Some("nosniff"));
    let missing = get(addr, "/nope").await.unwrap();
    assert_eq!(
        (missing.status, missing.body.as_str()),
        (404, "404 page not found\n")
    );
}

#[tokio::test]
async fn a_bind_failure_names_the_address() {
    let blocker = std::net::TcpListener::bind((LOCALHOST, 0)).unwrap();
    let addr = blocker.local_addr().unwrap();
    let err = HttpServer::bind(addr, hello()).await.err().unwrap();
    // The message names the address; the cause (address in use) follows in the chain.
    assert_eq!(err.to_string(), format!("cannot listen on {addr}"));
    assert!(
        report::chain(&err)
            .to_string()
            .starts_with(&format!("cannot listen on {addr}: ")),
        "{err}"
    );
}

#[tokio::test]
async fn a_server_stops_and_frees_its_port_on_shutdown() {
    let (addr, stop) = hello_server().await;
    assert_eq!(get(addr, "/hello").await.unwrap().status, 200);
    drop(stop);
    assert!(refused_within(addr, Duration::from_secs(2)).await);
    // The port can be bound again at once.
    let again = HttpServer::bind(addr, hello()).await;
    assert!(again.is_ok());
}

#[tokio::test]
async fn serve_returns_after_shutdown_even_with_an_idle_connection_open() {
    let (tx, mut rx) = watch::channel(());
    let server = HttpServer::bind(SocketAddr::from((LOCALHOST, 0)), hello())
        .await
        .unwrap();
    let addr = server.local_addr().unwrap();
    let task = tokio::spawn(server.run(async move { while rx.changed().await.is_ok() {} }));
    // A keep-alive client that never sends a request must not hold shutdown up.
    let _idle = tokio::net::TcpStream::connect(addr).await.unwrap();
    tokio::task::yield_now().await;
    drop(tx);
    tokio::time::timeout(DRAIN_TIMEOUT + Duration::from_secs(1), task)
        .await
        .unwrap()
        .unwrap();
}
