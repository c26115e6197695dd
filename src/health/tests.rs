//! Unit tests for proxy health, `/healthz` / `/livez`, and the health-check node ports.
use super::*;
use crate::http::test_client::{free_port, get, get_on, refused_within};
use crate::model::IpFamily::{V4, V6};
use std::net::Ipv4Addr;
use std::time::UNIX_EPOCH;

const TIMEOUT: Duration = Duration::from_secs(60);
const LOCALHOST: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// 2024-01-02T03:04:05Z.
fn t0() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_704_164_645)
}

fn manual() -> (ProxyHealth, ManualClock) {
    let clock = ManualClock::new(t0());
    (
        ProxyHealth::with_clock(TIMEOUT, Arc::new(clock.clone())),
        clock,
    )
}

/// A healthz server on 127.0.0.1:0; returns its address and a guard that stops it on drop.
async fn healthz_server(
    health: &ProxyHealth,
    metrics: &Metrics,
) -> (SocketAddr, watch::Sender<()>) {
    let handler = healthz_handler(health.clone(), metrics.clone());
    let server = HttpServer::bind(SocketAddr::from((LOCALHOST, 0)), handler)
        .await
        .unwrap();
    let addr = server.local_addr().unwrap();
    let (stop, mut stopped) = watch::channel(());
    tokio::spawn(server.run(async move { while stopped.changed().await.is_ok() {} }));
    (addr, stop)
}

#[test]
fn a_proxy_with_nothing_pending_is_healthy() {
    let (h, _) = manual();
    assert!(h.is_healthy());
    h.updated(V4);
    assert!(h.is_healthy());
}

#[test]
fn a_queued_update_is_tolerated_until_the_timeout() {
    let (h, clock) = manual();
    h.queued_update(V4);
    clock.advance(TIMEOUT - Duration::from_millis(1));
    assert!(h.is_healthy());
    clock.advance(Duration::from_millis(1));
    assert!(!h.is_healthy());
    assert!(h.healthy(t0()), "healthy(now) judges at the time given");
}

#[test]
fn only_the_oldest_pending_change_counts() {
    let (h, clock) = manual();
    h.queued_update(V4);
    clock.advance(TIMEOUT / 2);
    // A later change must not reset the clock on the first one.
    h.queued_update(V4);
    clock.advance(TIMEOUT / 2);
    assert!(!h.is_healthy());
}

#[test]
fn a_successful_sync_clears_the_pending_change() {
    let (h, clock) = manual();
    h.queued_update(V4);
    clock.advance(TIMEOUT * 2);
    assert!(!h.is_healthy());
    h.updated(V4);
    assert!(h.is_healthy());
}

#[test]
fn each_family_is_judged_on_its_own() {
    let (h, clock) = manual();
    h.queued_update(V4);
    h.queued_update(V6);
    clock.advance(TIMEOUT);
    h.updated(V4);
    let snap = h.snapshot();
    assert!(!snap.healthy);
    assert!(snap.families[&V4].healthy);
    assert!(!snap.families[&V6].healthy);
    assert_eq!(snap.families[&V6].last_updated, None);
}

#[test]
fn timestamps_are_formatted_like_go_time_json() {
    assert_eq!(go_time(Some(t0())), "2024-01-02T03:04:05Z");
    assert_eq!(
        go_time(Some(t0() + Duration::from_millis(250))),
        "2024-01-02T03:04:05.25Z"
    );
    assert_eq!(go_time(None), "0001-01-01T00:00:00Z");
}

#[test]
fn quarantined_services_are_sorted_and_deduplicated() {
    let (h, _) = manual();
    h.set_quarantined(vec![
        "ns/b:http".into(),
        "ns/a:dns".into(),
        "ns/b:http".into(),
    ]);
    assert_eq!(h.quarantined(), ["ns/a:dns", "ns/b:http"]);
}

#[tokio::test]
async fn healthz_is_200_initially_503_when_a_change_is_late_and_200_after_a_sync() {
    let (h, clock) = manual();
    let metrics = Metrics::new();
    let (addr, _stop) = healthz_server(&h, &metrics).await;

    assert_eq!(get(addr, "/healthz").await.unwrap().status, 200);

    h.queued_update(V4);
    clock.advance(TIMEOUT - Duration::from_secs(1));
    assert_eq!(get(addr, "/healthz").await.unwrap().status, 200);
    clock.advance(Duration::from_secs(1));
    assert_eq!(get(addr, "/healthz").await.unwrap().status, 503);
    assert_eq!(get(addr, "/livez").await.unwrap().status, 503);

    h.updated(V4);
    assert_eq!(get(addr, "/healthz").await.unwrap().status, 200);
    assert_eq!(get(addr, "/livez").await.unwrap().status, 200);

    let text = metrics.encode().unwrap();
    assert!(
        text.contains(r#"kubeproxy_proxy_healthz_total{code="200"} 3"#),
        "{text}"
    );
    assert!(
        text.contains(r#"kubeproxy_proxy_healthz_total{code="503"} 1"#),
        "{text}"
    );
    assert!(
        text.contains(r#"kubeproxy_proxy_livez_total{code="200"} 1"#),
        "{text}"
    );
    assert!(
        text.contains(r#"kubeproxy_proxy_livez_total{code="503"} 1"#),
        "{text}"
    );
}

#[tokio::test]
async fn a_deleting_node_fails_healthz_but_not_livez() {
    let (h, _) = manual();
    let (addr, _stop) = healthz_server(&h, &Metrics::new()).await;
    h.set_node(true, false);
    let healthz = get(addr, "/healthz").await.unwrap();
    assert_eq!(healthz.status, 503);
    assert_eq!(healthz.json()["nodeEligible"], false);
    // The proxier itself is fine.
    assert_eq!(healthz.json()["healthy"], true);
    assert_eq!(get(addr, "/livez").await.unwrap().status, 200);
}

#[tokio::test]
async fn an_autoscaler_tainted_node_fails_healthz_but_not_livez_until_untainted() {
    let (h, _) = manual();
    let (addr, _stop) = healthz_server(&h, &Metrics::new()).await;
    h.set_node(false, true);
    assert_eq!(get(addr, "/healthz").await.unwrap().status, 503);
    assert_eq!(get(addr, "/livez").await.unwrap().status, 200);
    h.set_node(false, false);
    assert_eq!(get(addr, "/healthz").await.unwrap().status, 200);
}

#[tokio::test]
async fn healthz_json_has_kube_proxys_shape_plus_quarantined_services() {
    let (h, clock) = manual();
    let (addr, _stop) = healthz_server(&h, &Metrics::new()).await;
    h.updated(V4);
    h.set_quarantined(vec!["default/web:http".into()]);
    clock.advance(Duration::from_millis(1500));

    let reply = get(addr, "/healthz").await.unwrap();
    assert_eq!(reply.header("content-type"), Some("application/json"));
    assert_eq!(reply.header("x-content-type-options"), Some("nosniff"));
    // Field order as kube-proxy's struct marshals it; healthy reports lastUpdated as now.
    assert_eq!(
        reply.body,
        concat!(
            r#"{"lastUpdated":"2024-01-02T03:04:06.5Z","currentTime":"2024-01-02T03:04:06.5Z","#,
            r#""nodeEligible":true,"healthy":true,"#,
            r#""status":{"IPv4":{"lastUpdated":"2024-01-02T03:04:05Z","healthy":true}},"#,
            r#""quarantinedServices":["default/web:http"]}"#
        )
    );
}

#[tokio::test]
async fn an_unhealthy_answer_reports_the_last_real_sync() {
    let (h, clock) = manual();
    let (addr, _stop) = healthz_server(&h, &Metrics::new()).await;
    h.updated(V4);
    h.queued_update(V4);
    clock.advance(TIMEOUT);
    let json = get(addr, "/healthz").await.unwrap().json();
    assert_eq!(json["healthy"], false);
    assert_eq!(json["lastUpdated"], "2024-01-02T03:04:05Z");
    assert_eq!(json["currentTime"], "2024-01-02T03:05:05Z");
    assert_eq!(json["status"]["IPv4"]["healthy"], false);
}

#[tokio::test]
async fn livez_json_has_no_node_or_quarantine_fields() {
    let (h, _) = manual();
    let (addr, _stop) = healthz_server(&h, &Metrics::new()).await;
    h.set_quarantined(vec!["default/web:http".into()]);
    let reply = get(addr, "/livez").await.unwrap();
    assert_eq!(
        reply.body,
        r#"{"lastUpdated":"2024-01-02T03:04:05Z","currentTime":"2024-01-02T03:04:05Z","healthy":true}"#
    );
}

#[tokio::test]
async fn other_paths_on_the_healthz_server_are_404() {
    let (h, _) = manual();
    let (addr, _stop) = healthz_server(&h, &Metrics::new()).await;
    assert_eq!(get(addr, "/metrics").await.unwrap().status, 404);
}

fn svc(name: &str, port: u16, local_endpoints: usize) -> HealthCheckService {
    HealthCheckService {
        namespace: "default".into(),
        name: name.into(),
        port,
        local_endpoints,
    }
}

fn hc_servers(health: &ProxyHealth) -> HealthCheckServers {
    HealthCheckServers::new(vec![LOCALHOST], health.clone(), Handle::current())
}

#[tokio::test]
async fn a_health_check_port_is_200_with_local_endpoints() {
    let (h, _) = manual();
    let mut hcs = hc_servers(&h);
    let port = free_port();
    hcs.sync(vec![svc("web", port, 2)]);
    assert_eq!(hcs.ports(), [port]);

    // Any path answers.
    let reply = get(SocketAddr::from((LOCALHOST, port)), "/any/path")
        .await
        .unwrap();
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("x-load-balancing-endpoint-weight"), Some("2"));
    assert_eq!(reply.header("content-type"), Some("application/json"));
    assert_eq!(
        reply.body,
        r#"{"service":{"namespace":"default","name":"web"},"localEndpoints":2,"serviceProxyHealthy":true}"#
    );
}

#[tokio::test]
async fn a_health_check_port_is_503_without_local_endpoints() {
    let (h, _) = manual();
    let mut hcs = hc_servers(&h);
    let port = free_port();
    hcs.sync(vec![svc("web", port, 0)]);
    let reply = get(SocketAddr::from((LOCALHOST, port)), "/").await.unwrap();
    assert_eq!(reply.status, 503);
    assert_eq!(reply.header("x-load-balancing-endpoint-weight"), Some("0"));
    assert_eq!(reply.json()["localEndpoints"], 0);
    assert_eq!(reply.json()["serviceProxyHealthy"], true);
}

#[tokio::test]
async fn a_health_check_port_is_503_when_the_proxy_is_unhealthy() {
    let (h, clock) = manual();
    let mut hcs = hc_servers(&h);
    let port = free_port();
    hcs.sync(vec![svc("web", port, 3)]);
    h.queued_update(V4);
    clock.advance(TIMEOUT);
    let reply = get(SocketAddr::from((LOCALHOST, port)), "/").await.unwrap();
    assert_eq!(reply.status, 503);
    assert_eq!(reply.header("x-load-balancing-endpoint-weight"), Some("3"));
    assert_eq!(reply.json()["serviceProxyHealthy"], false);
}

#[tokio::test]
async fn a_health_check_port_ignores_node_eligibility() {
    let (h, _) = manual();
    let mut hcs = hc_servers(&h);
    let port = free_port();
    hcs.sync(vec![svc("web", port, 1)]);
    h.set_node(true, true);
    let reply = get(SocketAddr::from((LOCALHOST, port)), "/").await.unwrap();
    assert_eq!(reply.status, 200);
}

#[tokio::test]
async fn a_sync_that_drops_the_service_closes_its_listener() {
    let (h, _) = manual();
    let mut hcs = hc_servers(&h);
    let (kept, dropped) = (free_port(), free_port());
    hcs.sync(vec![svc("kept", kept, 1), svc("dropped", dropped, 1)]);
    let dropped_addr = SocketAddr::from((LOCALHOST, dropped));
    assert_eq!(get(dropped_addr, "/").await.unwrap().status, 200);

    hcs.sync(vec![svc("kept", kept, 1)]);
    assert_eq!(hcs.ports(), [kept]);
    assert!(refused_within(dropped_addr, Duration::from_secs(2)).await);
    assert_eq!(
        get(SocketAddr::from((LOCALHOST, kept)), "/")
            .await
            .unwrap()
            .status,
        200
    );
}

#[tokio::test]
async fn a_sync_updates_the_count_in_place_without_reopening() {
    let (h, _) = manual();
    let mut hcs = hc_servers(&h);
    let port = free_port();
    let addr = SocketAddr::from((LOCALHOST, port));
    hcs.sync(vec![svc("web", port, 2)]);
    let before = hcs.local_addrs(port);

    // A connection accepted before the sync survives it only if the listener was kept: a
    // reopened server would have shut its old connections down.
    let early = tokio::net::TcpStream::connect(addr).await.unwrap();
    tokio::task::yield_now().await;
    hcs.sync(vec![svc("web", port, 0)]);
    assert_eq!(hcs.local_addrs(port), before);

    let reply = get_on(early, "/").await.unwrap();
    assert_eq!(reply.status, 503);
    assert_eq!(reply.header("x-load-balancing-endpoint-weight"), Some("0"));
    assert_eq!(reply.json()["localEndpoints"], 0);
}

#[tokio::test]
async fn a_port_that_cannot_be_bound_is_retried_and_does_not_block_the_others() {
    let (h, _) = manual();
    let mut hcs = hc_servers(&h);
    let blocker = std::net::TcpListener::bind((LOCALHOST, 0)).unwrap();
    let busy = blocker.local_addr().unwrap().port();
    let free = free_port();

    hcs.sync(vec![svc("busy", busy, 1), svc("free", free, 1)]);
    assert_eq!(hcs.ports(), [free]);
    assert_eq!(
        get(SocketAddr::from((LOCALHOST, free)), "/")
            .await
            .unwrap()
            .status,
        200
    );

    drop(blocker);
    hcs.sync(vec![svc("busy", busy, 1), svc("free", free, 1)]);
    let mut ports = hcs.ports();
    ports.sort();
    let mut want = vec![busy, free];
    want.sort();
    assert_eq!(ports, want);
    let reply = get(SocketAddr::from((LOCALHOST, busy)), "/").await.unwrap();
    assert_eq!(reply.json()["service"]["name"], "busy");
}

#[tokio::test]
async fn two_services_claiming_one_port_leave_it_to_the_first() {
    let (h, _) = manual();
    let mut hcs = hc_servers(&h);
    let port = free_port();
    hcs.sync(vec![svc("first", port, 1), svc("second", port, 5)]);
    let reply = get(SocketAddr::from((LOCALHOST, port)), "/").await.unwrap();
    assert_eq!(reply.json()["service"]["name"], "first");
}

#[tokio::test]
async fn health_check_ports_listen_on_every_address_when_none_are_given() {
    let (h, _) = manual();
    let mut hcs = HealthCheckServers::new(Vec::new(), h.clone(), Handle::current());
    let port = free_port();
    hcs.sync(vec![svc("web", port, 1)]);
    assert_eq!(hcs.ports(), [port]);
    assert!(hcs.local_addrs(port)[0].ip().is_unspecified());
    // Reachable over IPv4 loopback whether the wildcard is `[::]` (dual-stack) or `0.0.0.0`.
    let reply = get(SocketAddr::from((LOCALHOST, port)), "/").await.unwrap();
    assert_eq!(reply.status, 200);
}
