//! Unit tests for the metrics registry: names, types, labels and buckets as kube-proxy exports them.
use super::*;
use crate::http::test_client::get;
use crate::model::IpFamily::{V4, V6};

/// Records one observation of every metric, so every series appears in the output.
fn record_everything(m: &Metrics) {
    m.observe_sync(&[V4, V6], SyncKind::Full, Duration::from_millis(3));
    m.observe_sync(&[V4], SyncKind::Partial, Duration::from_millis(1));
    m.observe_network_programming(V4, Duration::from_millis(700));
    m.set_last_sync_timestamp(&[V4], UNIX_EPOCH + Duration::from_secs(1_700_000_000));
    m.set_last_queued_timestamp(&[V4], UNIX_EPOCH + Duration::from_secs(1_700_000_001));
    m.add_endpoint_changes(V4, 2);
    m.add_service_changes(V6, 1);
    m.set_no_local_endpoints(V4, PolicyKind::External, 3);
    m.inc_sync_failures(V4);
    m.inc_healthz(200);
    m.inc_livez(503);
    m.add_conntrack_deleted(V6, 4);
    m.set_quarantined_services(2);
    m.inc_drift_repairs(V4);
    m.inc_kernel_rejections("busy");
    m.inc_events_dropped("rate_limited");
    m.observe_transaction(12, 4096);
}

#[test]
fn the_text_output_names_every_metric_after_one_recording_each() {
    let m = Metrics::new();
    record_everything(&m);
    let text = m.encode().unwrap();
    for name in [
        "kubeproxy_sync_proxy_rules_duration_seconds_bucket",
        "kubeproxy_sync_full_proxy_rules_duration_seconds_bucket",
        "kubeproxy_sync_partial_proxy_rules_duration_seconds_bucket",
        "kubeproxy_network_programming_duration_seconds_bucket",
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds{",
        "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds{",
        "kubeproxy_sync_proxy_rules_endpoint_changes_total{",
        "kubeproxy_sync_proxy_rules_service_changes_total{",
        "kubeproxy_sync_proxy_rules_no_local_endpoints_total{",
        "kubeproxy_sync_proxy_rules_nftables_sync_failures_total{",
        "kubeproxy_proxy_healthz_total{",
        "kubeproxy_proxy_livez_total{",
        "kubeproxy_conntrack_reconciler_deleted_entries_total{",
        "nodeproxy_quarantined_services ",
        "nodeproxy_drift_repairs_total{",
        "nodeproxy_kernel_rejections_total{kind=\"busy\"} 1",
        "nodeproxy_events_dropped_total{reason=\"rate_limited\"} 1",
        "nodeproxy_transaction_bytes_bucket",
        "nodeproxy_transaction_messages_bucket",
    ] {
        assert!(text.contains(name), "{name} missing from:\n{text}");
    }
}

#[test]
fn metric_types_match_kube_proxy() {
    let m = Metrics::new();
    record_everything(&m);
    let text = m.encode().unwrap();
    for line in [
        "# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram",
        "# TYPE kubeproxy_network_programming_duration_seconds histogram",
        "# TYPE kubeproxy_sync_proxy_rules_last_timestamp_seconds gauge",
        "# TYPE kubeproxy_sync_proxy_rules_endpoint_changes counter",
        // A gauge in kube-proxy despite its name.
        "# TYPE kubeproxy_sync_proxy_rules_no_local_endpoints_total gauge",
        "# TYPE kubeproxy_proxy_healthz counter",
        "# TYPE nodeproxy_quarantined_services gauge",
    ] {
        assert!(text.contains(line), "{line} missing from:\n{text}");
    }
}

#[test]
fn labels_use_kube_proxy_values() {
    let m = Metrics::new();
    record_everything(&m);
    let text = m.encode().unwrap();
    for sample in [
        r#"kubeproxy_proxy_healthz_total{code="200"} 1"#,
        r#"kubeproxy_proxy_livez_total{code="503"} 1"#,
        r#"kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family="IPv4",traffic_policy="external"} 3"#,
        r#"kubeproxy_sync_proxy_rules_endpoint_changes_total{ip_family="IPv4"} 2"#,
        r#"kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family="IPv4"} 1700000000"#,
        r#"kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family="IPv6"} 1"#,
        r#"kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family="IPv4"} 2"#,
        "nodeproxy_quarantined_services 2",
    ] {
        assert!(text.contains(sample), "{sample} missing from:\n{text}");
    }
}

#[test]
fn sync_duration_buckets_run_from_one_millisecond_to_16_seconds() {
    let m = Metrics::new();
    m.observe_sync(&[V4], SyncKind::Full, Duration::from_millis(1));
    let text = m.encode().unwrap();
    let buckets: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("kubeproxy_sync_proxy_rules_duration_seconds_bucket"))
        .collect();
    // 15 finite buckets plus +Inf.
    assert_eq!(buckets.len(), 16, "{buckets:#?}");
    assert!(buckets[0].contains(r#"le="0.001""#), "{}", buckets[0]);
    assert!(buckets[14].contains(r#"le="16.384""#), "{}", buckets[14]);
}

#[test]
fn network_programming_buckets_run_from_a_quarter_second_to_five_minutes() {
    let m = Metrics::new();
    m.observe_network_programming(V4, Duration::from_secs(1));
    let text = m.encode().unwrap();
    let les: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("kubeproxy_network_programming_duration_seconds_bucket"))
        .filter_map(|l| l.split("le=\"").nth(1)?.split('"').next())
        .collect();
    // Upstream: 0 (from its merge helper), 0.25, 0.5, 1…59, 60…115 by 5, 120…300 by 30, +Inf.
    assert_eq!(les.len(), 1 + 2 + 59 + 12 + 7 + 1, "{les:?}");
    assert_eq!(&les[..4], &["0.0", "0.25", "0.5", "1.0"]);
    assert_eq!(les[les.len() - 2], "300.0");
    assert_eq!(les[les.len() - 1], "+Inf");
}

async fn metrics_server(
    metrics: &Metrics,
) -> (std::net::SocketAddr, tokio::sync::watch::Sender<()>) {
    let localhost = std::net::Ipv4Addr::LOCALHOST;
    let server = http::HttpServer::bind((localhost, 0).into(), handler(metrics.clone()))
        .await
        .unwrap();
    let addr = server.local_addr().unwrap();
    let (stop, mut stopped) = tokio::sync::watch::channel(());
    tokio::spawn(server.run(async move { while stopped.changed().await.is_ok() {} }));
    (addr, stop)
}

#[tokio::test]
async fn the_metrics_server_serves_prometheus_text() {
    let m = Metrics::new();
    m.inc_sync_failures(V4);
    let (addr, _stop) = metrics_server(&m).await;
    let reply = get(addr, "/metrics").await.unwrap();
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("content-type"), Some(CONTENT_TYPE));
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
