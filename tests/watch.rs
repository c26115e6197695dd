//! The API source against a fake API server: readiness, incremental updates, relists, outages,
//! a missing Node, invalid objects and silently dead connections.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod fakeapi;

use std::collections::BTreeSet;
use std::time::Duration;

use fakeapi::{FakeApi, Kind, node, service, service_cidr, slice};
use nodeproxy::model::{ClusterState, ServiceName};
use nodeproxy::source::watch::{self, ClusterWatch, Timeouts, WatchError, WatchOptions};
use tokio::time::{Instant, timeout};

/// Short timeouts so the failure paths run in seconds: the fake ends each healthy watch after
/// 2 s (`timeoutSeconds`), and a connection silent for 3 s is abandoned.
const TIMEOUTS: Timeouts = Timeouts {
    watch: Duration::from_secs(2),
    read: Duration::from_secs(3),
};
const NODE: &str = "node-a";
/// Every wait in these tests is bounded by this.
const PATIENCE: Duration = Duration::from_secs(20);

fn logs() {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter("nodeproxy=debug,kube_runtime=debug")
        .try_init();
}

async fn start(api: &FakeApi) -> ClusterWatch {
    logs();
    let config = watch::config(Some(api.kubeconfig()), None, &TIMEOUTS)
        .await
        .unwrap();
    let client = watch::client_from(config).unwrap();
    watch::spawn_with(
        client,
        NODE.to_owned(),
        WatchOptions {
            watch_timeout: TIMEOUTS.watch,
            retry_delay: Some(Duration::from_millis(200)),
        },
    )
}

async fn ready(w: &ClusterWatch) {
    timeout(PATIENCE, w.ready())
        .await
        .expect("the watches did not all list in time");
}

/// Waits until `cond` holds for the state, or fails naming `what`.
async fn eventually(w: &mut ClusterWatch, what: &str, cond: impl Fn(&ClusterState) -> bool) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        if w.with_state(&cond) {
            return;
        }
        if tokio::time::timeout_at(deadline, w.changed())
            .await
            .is_err()
        {
            panic!("timed out waiting until {what}; state: {:#?}", w.snapshot());
        }
    }
}

fn svc_key(name: &str) -> ServiceName {
    ServiceName::new("ns", name)
}

fn service_names(s: &ClusterState) -> Vec<String> {
    s.services.keys().map(|k| k.name().to_owned()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_resolves_only_after_services_slices_and_the_node_have_been_listed() {
    let api = FakeApi::start().await;
    api.apply(Kind::Service, service("ns", "web", "10.96.0.10", 80));
    api.apply(
        Kind::EndpointSlice,
        slice("ns", "web-1", "web", &["10.244.0.5"], 8080),
    );
    api.apply(Kind::Node, node(NODE, "192.0.2.10"));
    api.hold(Kind::Node);
    let w = start(&api).await;

    let deadline = Instant::now() + PATIENCE;
    while api.count(Kind::Service, true) == 0 || api.count(Kind::EndpointSlice, true) == 0 {
        assert!(
            Instant::now() < deadline,
            "services and slices were never watched"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Services and slices are listed and watched; the Node list is still unanswered.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!w.is_ready());
    assert!(
        timeout(Duration::from_millis(100), w.ready())
            .await
            .is_err()
    );

    api.release(Kind::Node);
    ready(&w).await;
    let state = w.snapshot();
    assert_eq!(service_names(&state), ["web"]);
    assert_eq!(state.slices.len(), 1);
    assert_eq!(
        state.nodes[NODE].internal_ips,
        ["192.0.2.10".parse::<std::net::IpAddr>().unwrap()]
    );

    // kube-proxy's selectors reach the server.
    let requests = api.requests();
    let selector = "labelSelector=%21service.kubernetes.io%2Fservice-proxy-name%2C%21service.kubernetes.io%2Fheadless";
    assert!(
        requests
            .iter()
            .any(|r| r.starts_with("GET /api/v1/services?") && r.contains(selector)),
        "{requests:#?}"
    );
    assert!(
        requests.iter().any(|r| r.starts_with("GET /api/v1/nodes?")
            && r.contains("fieldSelector=metadata.name%3Dnode-a")),
        "{requests:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn services_slices_and_the_node_are_added_modified_and_deleted_incrementally() {
    let api = FakeApi::start().await;
    api.apply(Kind::Node, node(NODE, "192.0.2.10"));
    let mut w = start(&api).await;
    ready(&w).await;
    assert!(w.snapshot().services.is_empty());
    w.take_changes();

    api.apply(Kind::Service, service("ns", "web", "10.96.0.10", 80));
    eventually(&mut w, "the Service is added", |s| {
        s.services.contains_key(&svc_key("web"))
    })
    .await;
    api.apply(Kind::Service, service("ns", "web", "10.96.0.10", 81));
    eventually(&mut w, "the Service port changes", |s| {
        s.services
            .get(&svc_key("web"))
            .is_some_and(|v| v.ports[0].port == 81)
    })
    .await;
    api.delete(Kind::Service, "ns", "web");
    eventually(&mut w, "the Service is deleted", |s| s.services.is_empty()).await;

    let mut with_trigger = slice("ns", "web-1", "web", &["10.244.0.5"], 8080);
    let now = k8s_openapi::jiff::Timestamp::now() + k8s_openapi::jiff::SignedDuration::from_secs(1);
    with_trigger["metadata"]["annotations"] =
        serde_json::json!({"endpoints.kubernetes.io/last-change-trigger-time": now.to_string()});
    api.apply(Kind::EndpointSlice, with_trigger);
    eventually(&mut w, "the slice is added", |s| {
        s.slices.contains_key(&svc_key("web-1"))
    })
    .await;
    api.apply(
        Kind::EndpointSlice,
        slice("ns", "web-1", "web", &["10.244.0.5", "10.244.0.6"], 8080),
    );
    eventually(&mut w, "the slice gets a second endpoint", |s| {
        s.slices
            .get(&svc_key("web-1"))
            .is_some_and(|v| v.endpoints.len() == 2)
    })
    .await;
    api.delete(Kind::EndpointSlice, "ns", "web-1");
    eventually(&mut w, "the slice is deleted", |s| s.slices.is_empty()).await;

    api.apply(Kind::Node, node(NODE, "192.0.2.11"));
    eventually(&mut w, "the Node address changes", |s| {
        s.nodes
            .get(NODE)
            .is_some_and(|n| n.internal_ips == ["192.0.2.11".parse::<std::net::IpAddr>().unwrap()])
    })
    .await;
    // Another node is not ours: the field selector keeps it away.
    api.apply(Kind::Node, node("node-b", "192.0.2.12"));
    api.delete(Kind::Node, "", NODE);
    eventually(&mut w, "the Node is deleted", |s| s.nodes.is_empty()).await;

    let changes = w.take_changes();
    assert_eq!(changes.services, 3);
    assert_eq!(changes.endpoint_slices, 3);
    assert_eq!(changes.nodes, 2);
    assert_eq!(changes.trigger_times[&svc_key("web")].len(), 1);
    // The Service and its slice changed; the Node changed too, which every Service depends on.
    assert_eq!(changes.services_changed, BTreeSet::from([svc_key("web")]));
    assert!(!changes.full);
    assert!(changes.needs_full());
    assert_eq!(w.take_changes(), watch::Changes::default());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slice_update_records_its_service_and_a_relist_exactly_the_services_it_changed() {
    let api = FakeApi::start().await;
    api.apply(Kind::Node, node(NODE, "192.0.2.10"));
    for (name, ip) in [("a", "10.96.0.1"), ("b", "10.96.0.2"), ("c", "10.96.0.3")] {
        api.apply(Kind::Service, service("ns", name, ip, 80));
        api.apply(
            Kind::EndpointSlice,
            slice("ns", &format!("{name}-1"), name, &["10.244.0.5"], 8080),
        );
    }
    let mut w = start(&api).await;
    ready(&w).await;
    let initial = w.take_changes();
    assert_eq!(
        initial.services_changed,
        BTreeSet::from([svc_key("a"), svc_key("b"), svc_key("c")])
    );

    api.apply(
        Kind::EndpointSlice,
        slice("ns", "b-1", "b", &["10.244.0.6"], 8080),
    );
    eventually(&mut w, "b's slice changes", |s| {
        s.slices[&svc_key("b-1")].endpoints[0].addr.to_string() == "10.244.0.6"
    })
    .await;
    let changes = w.take_changes();
    assert_eq!(changes.services_changed, BTreeSet::from([svc_key("b")]));
    assert_eq!(changes.endpoint_slices, 1);
    assert!(!changes.needs_full());

    // Cut off while a's Service and c's slice change and the history is compacted: the relists
    // (410) replace every kind, and record only the Services whose objects differ.
    let lists = (
        api.count(Kind::Service, false),
        api.count(Kind::EndpointSlice, false),
    );
    api.go_down();
    api.apply(Kind::Service, service("ns", "a", "10.96.0.1", 81));
    api.delete(Kind::EndpointSlice, "ns", "c-1");
    api.compact();
    api.come_back().await;
    eventually(
        &mut w,
        "the relisted state has a's new port and no c-1",
        |s| {
            s.services[&svc_key("a")].ports[0].port == 81 && !s.slices.contains_key(&svc_key("c-1"))
        },
    )
    .await;
    assert!(
        api.count(Kind::Service, false) > lists.0
            && api.count(Kind::EndpointSlice, false) > lists.1,
        "both kinds were relisted"
    );
    let changes = w.take_changes();
    assert_eq!(
        changes.services_changed,
        BTreeSet::from([svc_key("a"), svc_key("c")])
    );
    assert!(
        !changes.needs_full(),
        "the Node did not change: {changes:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relist_after_410_replaces_the_state_and_drops_objects_deleted_in_the_gap() {
    let api = FakeApi::start().await;
    api.apply(Kind::Node, node(NODE, "192.0.2.10"));
    api.apply(Kind::Service, service("ns", "a", "10.96.0.1", 80));
    api.apply(Kind::Service, service("ns", "b", "10.96.0.2", 80));
    let mut w = start(&api).await;
    ready(&w).await;
    assert_eq!(service_names(&w.snapshot()), ["a", "b"]);

    // While the client is cut off, b is deleted and c added, and the history is compacted:
    // resuming the watch is impossible (410), only a relist can tell that b is gone.
    api.go_down();
    api.delete(Kind::Service, "ns", "b");
    api.apply(Kind::Service, service("ns", "c", "10.96.0.3", 80));
    api.compact();
    api.come_back().await;
    eventually(&mut w, "the relisted state is a and c", |s| {
        service_names(s) == ["a", "c"]
    })
    .await;
    assert!(api.count(Kind::Service, false) >= 2, "a relist happened");

    // A 410 on open watches also relists, and leaves an unchanged state unchanged.
    let lists = api.count(Kind::Service, false);
    api.expire_watches();
    let deadline = Instant::now() + PATIENCE;
    while api.count(Kind::Service, false) == lists {
        assert!(Instant::now() < deadline, "no relist after 410");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    api.apply(Kind::Service, service("ns", "d", "10.96.0.4", 80));
    eventually(&mut w, "updates flow after the relist", |s| {
        service_names(s) == ["a", "c", "d"]
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_comes_in_pages_of_500_from_one_snapshot_and_the_watch_resumes_after_it() {
    let api = FakeApi::start().await;
    api.apply(Kind::Node, node(NODE, "192.0.2.10"));
    let name = |i: usize| format!("s-{i:04}");
    for i in 0..1203 {
        let ip = format!("10.96.{}.{}", i / 250, i % 250 + 1);
        api.apply(Kind::Service, service("ns", &name(i), &ip, 80));
    }
    api.hold_pages(Kind::Service);
    let mut w = start(&api).await;
    let deadline = Instant::now() + PATIENCE;
    while api.count(Kind::Service, false) == 0 {
        assert!(Instant::now() < deadline, "services were never listed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Between the first page and the rest: one Service of the first page and one of the last
    // deleted, one added. The list still shows the snapshot; the watch from the list's
    // resourceVersion brings the changes.
    api.delete(Kind::Service, "ns", &name(3));
    api.delete(Kind::Service, "ns", &name(1202));
    api.apply(Kind::Service, service("ns", "t-new", "10.96.9.1", 80));
    api.release_pages(Kind::Service);
    ready(&w).await;

    let lists: Vec<String> = api
        .requests()
        .into_iter()
        .filter(|r| r.starts_with("GET /api/v1/services?") && !r.contains("watch=true"))
        .collect();
    assert_eq!(lists.len(), 3, "1203 Services in pages of 500: {lists:#?}");
    assert!(lists.iter().all(|r| r.contains("limit=500")), "{lists:#?}");
    assert_eq!(
        lists.iter().filter(|r| r.contains("continue=")).count(),
        2,
        "{lists:#?}"
    );
    eventually(
        &mut w,
        "the changes made while paging arrive by the watch",
        |s| {
            let names = service_names(s);
            names.len() == 1202
                && !names.contains(&name(3))
                && !names.contains(&name(1202))
                && names.contains(&name(1201))
                && names.last().map(String::as_str) == Some("t-new")
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_outage_keeps_the_state_and_updates_resume_when_the_api_is_back() {
    let api = FakeApi::start().await;
    api.apply(Kind::Node, node(NODE, "192.0.2.10"));
    api.apply(Kind::Service, service("ns", "a", "10.96.0.1", 80));
    api.apply(
        Kind::EndpointSlice,
        slice("ns", "a-1", "a", &["10.244.0.5"], 8080),
    );
    let mut w = start(&api).await;
    ready(&w).await;
    let before = w.snapshot();

    api.go_down();
    // Several failed attempts (connection refused) later, nothing was removed.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(w.snapshot(), before);

    api.come_back().await;
    api.apply(Kind::Service, service("ns", "b", "10.96.0.2", 80));
    eventually(&mut w, "the update after the outage arrives", |s| {
        service_names(s) == ["a", "b"]
    })
    .await;
    assert_eq!(w.snapshot().slices, before.slices);
    assert_eq!(w.snapshot().nodes, before.nodes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_node_does_not_block_readiness_and_is_picked_up_when_it_appears() {
    let api = FakeApi::start().await;
    api.apply(Kind::Node, node("someone-else", "192.0.2.99"));
    api.apply(Kind::Service, service("ns", "a", "10.96.0.1", 80));
    let mut w = start(&api).await;
    ready(&w).await;
    assert!(w.snapshot().nodes.is_empty(), "no address is invented");
    assert_eq!(service_names(&w.snapshot()), ["a"]);

    api.apply(Kind::Node, node(NODE, "192.0.2.10"));
    eventually(&mut w, "the Node appears", |s| s.nodes.contains_key(NODE)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_object_is_skipped_and_reported_while_the_others_are_used() {
    let api = FakeApi::start().await;
    api.apply(Kind::Node, node(NODE, "192.0.2.10"));
    api.apply(Kind::Service, service("ns", "good", "10.96.0.1", 80));
    api.apply(Kind::Service, service("ns", "bad", "10.96.0.999", 80));
    let mut w = start(&api).await;
    ready(&w).await;
    assert_eq!(service_names(&w.snapshot()), ["good"]);
    let rejected = w.rejected();
    assert_eq!(rejected.len(), 1, "{rejected:?}");
    assert_eq!(rejected[0].object, "Service ns/bad");
    assert_eq!(rejected[0].value, "10.96.0.999");

    api.apply(Kind::Service, service("ns", "other", "10.96.0.3", 80));
    eventually(&mut w, "later objects still arrive", |s| {
        service_names(s) == ["good", "other"]
    })
    .await;
    api.apply(Kind::Service, service("ns", "bad", "10.96.0.2", 80));
    eventually(&mut w, "the fixed object is used", |s| {
        s.services.len() == 3
    })
    .await;
    assert!(w.rejected().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silently_dead_watch_is_replaced_within_the_read_timeout() {
    let api = FakeApi::start().await;
    api.apply(Kind::Node, node(NODE, "192.0.2.10"));
    let mut w = start(&api).await;
    ready(&w).await;
    // Let the watches be established, then make their connections half-open: the server keeps
    // them but never sends again (not even the end of the watch at timeoutSeconds).
    // A watch between two requests is not hit: repeat until an open one is.
    let deadline = Instant::now() + PATIENCE;
    while api
        .silence_watches()
        .get(&Kind::Service)
        .copied()
        .unwrap_or(0)
        == 0
    {
        assert!(Instant::now() < deadline, "no Service watch was ever open");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let silenced = Instant::now();
    let watches = api.count(Kind::Service, true);
    api.apply(Kind::Service, service("ns", "late", "10.96.0.7", 80));
    eventually(
        &mut w,
        "the change made behind the dead watch arrives",
        |s| s.services.contains_key(&svc_key("late")),
    )
    .await;
    assert!(
        api.count(Kind::Service, true) > watches,
        "a new watch was opened"
    );
    // The read timeout (3 s) plus the retry delay bounds it; allow scheduling slack.
    assert!(
        silenced.elapsed() < TIMEOUTS.read + Duration::from_secs(5),
        "took {:?}",
        silenced.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bookmarks_let_a_watch_resume_after_compaction_without_a_relist() {
    let api = FakeApi::start().await;
    api.apply(Kind::Node, node(NODE, "192.0.2.10"));
    api.apply(Kind::Service, service("ns", "a", "10.96.0.1", 80));
    let mut w = start(&api).await;
    ready(&w).await;
    // Changes elsewhere move the resourceVersion past what the Service watch has seen.
    api.apply(Kind::Node, node("node-b", "192.0.2.11"));
    api.apply(Kind::Node, node("node-c", "192.0.2.12"));
    // A watch between two requests misses a bookmark: send until one is delivered.
    let deadline = Instant::now() + PATIENCE;
    while api.bookmarks_sent(Kind::Service) == 0 {
        assert!(
            Instant::now() < deadline,
            "no bookmark reached the Service watch"
        );
        api.bookmark();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let lists = api.count(Kind::Service, false);
    api.compact();
    api.drop_connections();
    api.apply(Kind::Service, service("ns", "b", "10.96.0.2", 80));
    eventually(&mut w, "the watch resumed", |s| {
        service_names(s) == ["a", "b"]
    })
    .await;
    assert_eq!(
        api.count(Kind::Service, false),
        lists,
        "resumed from the bookmark, no relist"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_cidrs_are_watched_and_a_change_asks_for_a_full_sync() {
    let api = FakeApi::start().await;
    api.apply(Kind::Node, node(NODE, "192.0.2.10"));
    api.apply(
        Kind::ServiceCidr,
        service_cidr("kubernetes", &["10.96.0.0/16", "fd00:10:96::/108"]),
    );
    // Wider than any service range: refused, not turned into a drop of half the world.
    api.apply(Kind::ServiceCidr, service_cidr("evil", &["0.0.0.0/1"]));
    let mut w = start(&api).await;
    ready(&w).await;
    let state = w.snapshot();
    assert_eq!(
        state.service_cidrs.keys().collect::<Vec<_>>(),
        ["kubernetes"],
        "{:?}",
        w.rejected()
    );
    assert!(
        w.rejected()
            .iter()
            .any(|r| r.object == "ServiceCIDR evil" && r.field == "spec.cidrs[0]")
    );
    w.take_changes();

    api.apply(Kind::ServiceCidr, service_cidr("extra", &["10.97.0.0/16"]));
    eventually(&mut w, "the new ServiceCIDR is seen", |s| {
        s.service_cidrs.contains_key("extra")
    })
    .await;
    let changes = w.take_changes();
    assert_eq!(changes.service_cidrs, 1);
    assert!(
        changes.needs_full(),
        "the drop of unallocated addresses is global"
    );
    api.delete(Kind::ServiceCidr, "", "extra");
    eventually(&mut w, "the ServiceCIDR is gone", |s| {
        !s.service_cidrs.contains_key("extra")
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_server_without_service_cidrs_does_not_hold_readiness_back() {
    let api = FakeApi::start().await;
    api.remove_resource(Kind::ServiceCidr);
    api.apply(Kind::Service, service("ns", "web", "10.96.0.10", 80));
    api.apply(Kind::Node, node(NODE, "192.0.2.10"));
    let w = start(&api).await;
    ready(&w).await;
    assert_eq!(service_names(&w.snapshot()), ["web"]);
    assert!(w.snapshot().service_cidrs.is_empty());
    // Probed once, never watched: no retry loop against a resource that does not exist.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(api.count(Kind::ServiceCidr, true), 0);
    assert_eq!(api.count(Kind::ServiceCidr, false), 1);
}

#[tokio::test]
async fn master_overrides_the_server_of_the_kubeconfig_and_works_alone() {
    let api = FakeApi::start().await;
    let config = watch::config(
        Some(api.kubeconfig()),
        Some("http://127.0.0.1:1"),
        &Timeouts::default(),
    )
    .await
    .unwrap();
    assert_eq!(config.cluster_url.to_string(), "http://127.0.0.1:1/");
    assert_eq!(config.read_timeout, Some(Timeouts::default().read));
    let config = watch::config(None, Some(&api.url()), &Timeouts::default())
        .await
        .unwrap();
    assert_eq!(config.cluster_url.to_string(), format!("{}/", api.url()));

    let err = watch::config(None, Some("http://exa mple"), &Timeouts::default())
        .await
        .unwrap_err();
    assert!(matches!(err, WatchError::Master { .. }), "{err}");
    let missing = std::path::Path::new("/nonexistent/kubeconfig");
    let err = watch::config(Some(missing), None, &Timeouts::default())
        .await
        .unwrap_err();
    // The message names the file; kube's reason (it cannot be read) follows in the chain.
    let text = nodeproxy::report::chain(&err).to_string();
    assert!(
        text.starts_with("kubeconfig /nonexistent/kubeconfig: "),
        "{text}"
    );
}

#[test]
fn the_default_read_timeout_outlasts_a_quiet_healthy_watch() {
    // kube-runtime abandons a watch silent for timeoutSeconds + 5 s; the read timeout must not
    // fire first on a healthy one, and the whole bound stays near five minutes.
    let t = Timeouts::default();
    assert!(t.read > t.watch + Duration::from_secs(5));
    assert!(t.read <= Duration::from_secs(300));
}
