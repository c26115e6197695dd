//! Unit tests for the metrics server, server start-up errors and graceful shutdown.
use super::test_client::{get, refused_within};
use super::*;
use crate::model::IpFamily;
use std::net::Ipv4Addr;

const LOCALHOST: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

async fn metrics_server(metrics: &Metrics) -> (SocketAddr, watch::Sender<()>) {
    let server = HttpServer::bind(
        SocketAddr::from((LOCALHOST, 0)),
        metrics_handler(metrics.clone()),
    )
    .await
    .unwrap();
    let addr = server.local_addr().unwrap();
    let (stop, mut stopped) = watch::channel(());
    tokio::spawn(server.run(async move { while stopped.changed().await.is_ok() {} }));
    (addr, stop)
}

#[tokio::test]
async fn the_metrics_server_serves_prometheus_text() {
    let m = Metrics::new();
    m.inc_sync_failures(IpFamily::V4);
    let (addr, _stop) = metrics_server(&m).await;
    let reply = get(addr, "/metrics").await.unwrap();
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("content-type"), Some(metrics::CONTENT_TYPE));
    assert!(
        reply.body.contains(
            r#"kubeproxy_sync_proxy_rules_nftables_sync_failures_total{ip_family="IPv4"} 1"#
        ),
        "{}",
        reply.body
    );
    assert!(reply.body.ends_with("# EOF\n"), "{}", reply.body);
}

#[tokio::test]
async fn the_metrics_server_answers_healthz_and_proxy_mode_like_kube_proxy() {
    let (addr, _stop) = metrics_server(&Metrics::new()).await;
    let healthz = get(addr, "/healthz").await.unwrap();
    assert_eq!((healthz.status, healthz.body.as_str()), (200, "ok"));
    let mode = get(addr, "/proxyMode").await.unwrap();
    assert_eq!((mode.status, mode.body.as_str()), (200, "nftables"));
    assert_eq!(get(addr, "/nope").await.unwrap().status, 404);
}

#[tokio::test]
async fn a_bind_failure_names_the_address() {
    let blocker = std::net::TcpListener::bind((LOCALHOST, 0)).unwrap();
    let addr = blocker.local_addr().unwrap();
    let err = serve_metrics(addr, Metrics::new(), std::future::pending())
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .starts_with(&format!("cannot listen on {addr}: ")),
        "{err}"
    );
    let err = serve_healthz(
        addr,
        ProxyHealth::new(Duration::from_secs(60)),
        Metrics::new(),
        std::future::pending(),
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains(&addr.to_string()), "{err}");
}

#[tokio::test]
async fn a_server_stops_and_frees_its_port_on_shutdown() {
    let m = Metrics::new();
    let (addr, stop) = metrics_server(&m).await;
    assert_eq!(get(addr, "/healthz").await.unwrap().status, 200);
    drop(stop);
    assert!(refused_within(addr, Duration::from_secs(2)).await);
    // The port can be bound again at once.
    let again = HttpServer::bind(addr, metrics_handler(m)).await;
    assert!(again.is_ok());
}

#[tokio::test]
async fn serve_returns_after_shutdown_even_with_an_idle_connection_open() {
    let (tx, mut rx) = watch::channel(());
    let server = HttpServer::bind(
        SocketAddr::from((LOCALHOST, 0)),
        metrics_handler(Metrics::new()),
    )
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
