//! Unit tests of how watcher events are applied to the shared state (no network).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::discovery::v1 as discovery;
use kube::runtime::watcher::Event;
use serde_json::{Value, json};

use super::{Applier, Changes, LISTED_SERVICES, MIN_TRACKED_SERVICES, Shared};
use crate::model::{ClusterState, ServiceName};

fn service(name: &str, ip: &str, port: u16, rv: &str) -> core::Service {
    decode(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"namespace": "ns", "name": name, "resourceVersion": rv},
        "spec": {"clusterIP": ip, "clusterIPs": [ip], "ports": [{"port": port, "protocol": "TCP"}]}
    }))
}

fn slice(name: &str, addr: &str, trigger: Option<&str>) -> discovery::EndpointSlice {
    slice_of(name, "web", addr, trigger)
}

fn slice_of(
    name: &str,
    service: &str,
    addr: &str,
    trigger: Option<&str>,
) -> discovery::EndpointSlice {
    let mut annotations = serde_json::Map::new();
    if let Some(t) = trigger {
        annotations.insert(super::ANNOTATION_LAST_CHANGE_TRIGGER_TIME.into(), t.into());
    }
    decode(json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"namespace": "ns", "name": name, "resourceVersion": "1",
                     "labels": {"kubernetes.io/service-name": service}, "annotations": annotations},
        "addressType": "IPv4",
        "ports": [{"port": 8080, "protocol": "TCP"}],
        "endpoints": [{"addresses": [addr]}]
    }))
}

fn decode<T: serde::de::DeserializeOwned>(v: Value) -> T {
    serde_json::from_value(v).unwrap()
}

fn key(name: &str) -> ServiceName {
    ServiceName::new("ns", name)
}

fn services(shared: &Shared) -> Vec<String> {
    service_names(&shared.state.read().unwrap())
}

fn service_names(state: &ClusterState) -> Vec<String> {
    state.services.keys().map(|k| k.name().to_owned()).collect()
}

#[test]
fn a_relist_replaces_the_kind_only_when_it_is_complete() {
    let shared = Arc::new(Shared::new(SystemTime::now()));
    let mut a = Applier::<core::Service>::new(shared.clone(), None);
    a.apply(Event::Init);
    a.apply(Event::InitApply(service("a", "10.0.0.1", 80, "1")));
    a.apply(Event::InitApply(service("b", "10.0.0.2", 80, "1")));
    assert!(services(&shared).is_empty(), "nothing before InitDone");
    assert_eq!(*shared.listed.borrow() & LISTED_SERVICES, 0);
    a.apply(Event::InitDone);
    assert_eq!(services(&shared), ["a", "b"]);
    assert_ne!(*shared.listed.borrow() & LISTED_SERVICES, 0);
    assert_eq!(shared.changes.lock().unwrap().services, 2);

    // b was deleted while we were disconnected: the relist drops it, at InitDone only.
    a.apply(Event::Init);
    a.apply(Event::InitApply(service("a", "10.0.0.1", 80, "1")));
    assert_eq!(services(&shared), ["a", "b"]);
    a.apply(Event::InitDone);
    assert_eq!(services(&shared), ["a"]);
    assert_eq!(shared.changes.lock().unwrap().services, 3);
}

#[test]
fn an_event_that_does_not_change_the_model_does_not_wake_the_sync_loop() {
    let shared = Arc::new(Shared::new(SystemTime::now()));
    let rx = shared.generation.subscribe();
    let mut a = Applier::<core::Service>::new(shared.clone(), None);
    a.apply(Event::Apply(service("a", "10.0.0.1", 80, "1")));
    let g = *rx.borrow();
    // A new resourceVersion (e.g. a status change the proxy ignores) with the same model.
    a.apply(Event::Apply(service("a", "10.0.0.1", 80, "2")));
    assert_eq!(*rx.borrow(), g);
    a.apply(Event::Apply(service("a", "10.0.0.1", 81, "3")));
    assert_ne!(*rx.borrow(), g);
    assert_eq!(shared.changes.lock().unwrap().services, 2);
}

#[test]
fn an_invalid_object_is_absent_reported_and_remembered_per_resource_version() {
    let shared = Arc::new(Shared::new(SystemTime::now()));
    let mut a = Applier::<core::Service>::new(shared.clone(), None);
    a.apply(Event::Apply(service("a", "10.0.0.1", 80, "1")));
    a.apply(Event::Apply(service("a", "10.0.0.999", 80, "2")));
    assert!(
        services(&shared).is_empty(),
        "an invalid update removes the object"
    );
    let rejected = shared.rejected.lock().unwrap().clone();
    assert_eq!(rejected.len(), 1);
    let r = rejected.values().next().unwrap();
    assert_eq!(r.object, "Service ns/a");
    assert_eq!(a.warned.get(&key("a")).map(String::as_str), Some("2"));

    // A relist keeps it rejected; fixing it clears the report and the memory.
    a.apply(Event::Init);
    a.apply(Event::InitApply(service("a", "10.0.0.999", 80, "2")));
    a.apply(Event::InitDone);
    assert_eq!(shared.rejected.lock().unwrap().len(), 1);
    assert!(a.warned.contains_key(&key("a")));
    a.apply(Event::Apply(service("a", "10.0.0.1", 80, "3")));
    assert_eq!(services(&shared), ["a"]);
    assert!(shared.rejected.lock().unwrap().is_empty());
    assert!(a.warned.is_empty());
}

#[test]
fn trigger_times_are_kept_only_for_changed_slices_and_after_the_watch_started() {
    let started = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    let shared = Arc::new(Shared::new(started));
    let mut a = Applier::<discovery::EndpointSlice>::new(shared.clone(), None);
    // 2023-11-14T22:13:10Z is before `started` + 10 s: ignored; the later one is kept.
    a.apply(Event::Apply(slice(
        "web-1",
        "10.1.0.1",
        Some("2023-11-14T22:13:10Z"),
    )));
    a.apply(Event::Apply(slice(
        "web-2",
        "10.1.0.2",
        Some("2023-11-14T22:14:00Z"),
    )));
    // Unchanged model: no sample.
    a.apply(Event::Apply(slice(
        "web-2",
        "10.1.0.2",
        Some("2023-11-14T22:15:00Z"),
    )));
    let changes = std::mem::take(&mut *shared.changes.lock().unwrap());
    assert_eq!(changes.endpoint_slices, 2);
    let times = &changes.trigger_times[&key("web")];
    assert_eq!(
        times,
        &[SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_040)]
    );
}

#[test]
fn a_deleted_object_disappears() {
    let shared = Arc::new(Shared::new(SystemTime::now()));
    let mut a = Applier::<core::Service>::new(shared.clone(), None);
    a.apply(Event::Apply(service("a", "10.0.0.1", 80, "1")));
    a.apply(Event::Delete(service("a", "10.0.0.1", 80, "2")));
    assert!(services(&shared).is_empty());
}

fn take(shared: &Shared) -> Changes {
    std::mem::take(&mut *shared.changes.lock().unwrap())
}

fn names(list: &[&str]) -> BTreeSet<ServiceName> {
    list.iter().map(|n| key(n)).collect()
}

#[test]
fn the_services_whose_objects_changed_are_recorded_by_name() {
    let shared = Arc::new(Shared::new(SystemTime::now()));
    let mut services = Applier::<core::Service>::new(shared.clone(), None);
    let mut slices = Applier::<discovery::EndpointSlice>::new(shared.clone(), None);
    services.apply(Event::Apply(service("a", "10.0.0.1", 80, "1")));
    services.apply(Event::Apply(service("b", "10.0.0.2", 80, "1")));
    slices.apply(Event::Apply(slice_of("a-1", "a", "10.1.0.1", None)));
    let changes = take(&shared);
    assert_eq!(changes.services_changed, names(&["a", "b"]));
    assert!(!changes.full && !changes.needs_full());

    // A slice update: its Service. An update the model does not see: nothing.
    slices.apply(Event::Apply(slice_of("a-1", "a", "10.1.0.2", None)));
    services.apply(Event::Apply(service("b", "10.0.0.2", 80, "2")));
    assert_eq!(take(&shared).services_changed, names(&["a"]));

    // A slice moving to another Service: both; a deleted slice or Service: its Service.
    slices.apply(Event::Apply(slice_of("a-1", "c", "10.1.0.2", None)));
    assert_eq!(take(&shared).services_changed, names(&["a", "c"]));
    slices.apply(Event::Delete(slice_of("a-1", "c", "10.1.0.2", None)));
    services.apply(Event::Delete(service("b", "10.0.0.2", 80, "3")));
    let changes = take(&shared);
    assert_eq!(changes.services_changed, names(&["b", "c"]));
    assert_eq!((changes.services, changes.endpoint_slices), (1, 1));

    // An update that makes the object invalid removes it: a change of its Service.
    services.apply(Event::Apply(service("a", "10.0.0.999", 80, "4")));
    assert_eq!(take(&shared).services_changed, names(&["a"]));
}

#[test]
fn a_relist_records_exactly_the_services_it_changed() {
    let shared = Arc::new(Shared::new(SystemTime::now()));
    let mut slices = Applier::<discovery::EndpointSlice>::new(shared.clone(), None);
    slices.apply(Event::Init);
    for (name, svc) in [("a-1", "a"), ("b-1", "b"), ("c-1", "c")] {
        slices.apply(Event::InitApply(slice_of(name, svc, "10.1.0.1", None)));
    }
    slices.apply(Event::InitDone);
    assert_eq!(take(&shared).services_changed, names(&["a", "b", "c"]));

    // Relisted: a-1 unchanged, b-1 gone, c-1 moved to d, e-1 new.
    slices.apply(Event::Init);
    slices.apply(Event::InitApply(slice_of("a-1", "a", "10.1.0.1", None)));
    slices.apply(Event::InitApply(slice_of("c-1", "d", "10.1.0.1", None)));
    slices.apply(Event::InitApply(slice_of("e-1", "e", "10.1.0.1", None)));
    slices.apply(Event::InitDone);
    let changes = take(&shared);
    assert_eq!(changes.services_changed, names(&["b", "c", "d", "e"]));
    assert_eq!(changes.endpoint_slices, 3);
    assert!(!changes.full);
}

#[test]
fn too_many_changed_services_turn_into_a_full_sync_and_stop_growing() {
    let shared = Arc::new(Shared::new(SystemTime::now()));
    let mut services = Applier::<core::Service>::new(shared.clone(), None);
    let n = MIN_TRACKED_SERVICES + 1;
    for i in 0..n {
        let ip = format!("10.0.{}.{}", i / 250, 1 + i % 250);
        services.apply(Event::Apply(service(&format!("s{i}"), &ip, 80, "1")));
    }
    let changes = take(&shared);
    assert!(changes.full && changes.needs_full());
    assert!(changes.services_changed.is_empty());
    assert_eq!(changes.services, n as u64);

    // Taken: tracking by name starts again.
    services.apply(Event::Apply(service("s0", "10.0.0.1", 81, "2")));
    let changes = take(&shared);
    assert!(!changes.full);
    assert_eq!(changes.services_changed, names(&["s0"]));
}

#[test]
fn a_node_change_needs_a_full_sync() {
    let shared = Arc::new(Shared::new(SystemTime::now()));
    let mut nodes = Applier::<core::Node>::new(shared.clone(), Some("node-a".into()));
    nodes.apply(Event::Apply(decode(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": "node-a", "resourceVersion": "1"},
        "status": {"addresses": [{"type": "InternalIP", "address": "192.0.2.10"}]}
    }))));
    let changes = take(&shared);
    assert!(changes.needs_full());
    assert!(changes.services_changed.is_empty());
}

#[test]
fn merged_changes_keep_every_name_and_a_full_flag_wins() {
    let mut a = Changes {
        services: 1,
        services_changed: names(&["a"]),
        ..Changes::default()
    };
    a.merge(Changes {
        endpoint_slices: 2,
        services_changed: names(&["b"]),
        ..Changes::default()
    });
    assert_eq!(a.services_changed, names(&["a", "b"]));
    assert_eq!((a.services, a.endpoint_slices), (1, 2));
    a.merge(Changes {
        full: true,
        ..Changes::default()
    });
    assert!(a.full && a.services_changed.is_empty());
    a.merge(Changes {
        services_changed: names(&["c"]),
        ..Changes::default()
    });
    assert!(a.full && a.services_changed.is_empty());
}

#[test]
fn a_snapshot_is_shared_until_a_change_and_keeps_its_view_after_it() {
    let shared = Arc::new(Shared::new(SystemTime::now()));
    let mut a = Applier::<core::Service>::new(shared.clone(), None);
    let snapshot = || shared.snapshot();
    a.apply(Event::Apply(service("a", "10.0.0.1", 80, "1")));
    let held = snapshot();
    assert!(Arc::ptr_eq(&held, &snapshot()), "no copy without a write");
    // An event that changes nothing copies nothing.
    a.apply(Event::Apply(service("a", "10.0.0.1", 80, "2")));
    a.apply(Event::Delete(service("gone", "10.0.0.9", 80, "2")));
    assert!(Arc::ptr_eq(&held, &snapshot()));
    // A change while a sync holds the state: the sync's view stays as it was.
    a.apply(Event::Apply(service("b", "10.0.0.2", 80, "3")));
    assert!(!Arc::ptr_eq(&held, &snapshot()));
    assert_eq!(service_names(&held), ["a"]);
    assert_eq!(services(&shared), ["a", "b"]);
    // Once nothing else holds it, the state is written in place.
    drop(held);
    let before = Arc::as_ptr(&snapshot());
    a.apply(Event::Delete(service("a", "10.0.0.1", 80, "4")));
    assert_eq!(Arc::as_ptr(&snapshot()), before);
    assert_eq!(services(&shared), ["b"]);
    // A relist while a snapshot is held also leaves the snapshot alone.
    let held = snapshot();
    a.apply(Event::Init);
    a.apply(Event::InitApply(service("c", "10.0.0.3", 80, "5")));
    a.apply(Event::InitDone);
    assert_eq!(services(&shared), ["c"]);
    assert_eq!(service_names(&held), ["b"]);
}

#[test]
fn slices_share_the_localities_of_their_endpoints() {
    let on_node = |name: &str, service: &str, node: &str| -> discovery::EndpointSlice {
        decode(json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"namespace": "ns", "name": name, "resourceVersion": "1",
                         "labels": {"kubernetes.io/service-name": service}},
            "addressType": "IPv4",
            "ports": [{"port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": ["10.1.0.1"], "nodeName": node}]
        }))
    };
    let shared = Arc::new(Shared::new(SystemTime::now()));
    let mut a = Applier::<discovery::EndpointSlice>::new(shared.clone(), None);
    a.apply(Event::Apply(on_node("web-1", "web", "node-a")));
    a.apply(Event::Apply(on_node("db-1", "db", "node-a")));
    a.apply(Event::Apply(on_node("api-1", "api", "node-b")));
    let state = shared.snapshot();
    let node_of = |slice: &str| {
        let name = ServiceName::new("ns", slice);
        state.slices[&name].endpoints[0].locality.clone().unwrap()
    };
    assert_eq!(node_of("web-1").node_name.as_deref(), Some("node-a"));
    assert!(Arc::ptr_eq(&node_of("web-1"), &node_of("db-1")));
    assert_eq!(node_of("api-1").node_name.as_deref(), Some("node-b"));
}
