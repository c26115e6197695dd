//! Unit tests for the conversion of API objects to the model: one test per validation rule and
//! default.
use super::*;
use crate::model::Locality;
use serde_json::{Value, json};

fn svc(v: Value) -> core::Service {
    serde_json::from_value(v).unwrap()
}

fn slice(v: Value) -> discovery::EndpointSlice {
    serde_json::from_value(v).unwrap()
}

fn node_obj(v: Value) -> core::Node {
    serde_json::from_value(v).unwrap()
}

/// A minimal valid ClusterIP Service; `patch` is merged into `spec`.
fn basic_service(patch: Value) -> Value {
    let mut spec = json!({
        "clusterIP": "10.96.0.50",
        "clusterIPs": ["10.96.0.50"],
        "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}],
    });
    merge(&mut spec, patch);
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web", "namespace": "shop"},
        "spec": spec,
    })
}

fn merge(base: &mut Value, patch: Value) {
    match (base, patch) {
        (Value::Object(b), Value::Object(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    b.remove(&k);
                } else {
                    merge(b.entry(k).or_insert(Value::Null), v);
                }
            }
        }
        (b, p) => *b = p,
    }
}

fn convert_ok(patch: Value) -> Service {
    service(&svc(basic_service(patch))).unwrap().unwrap()
}

fn convert_err(patch: Value) -> Rejected {
    service(&svc(basic_service(patch))).unwrap_err()
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

// ---- Service: what is ignored ----

#[test]
fn a_headless_service_with_cluster_ip_none_is_ignored() {
    let s = svc(basic_service(
        json!({"clusterIP": "None", "clusterIPs": ["None"]}),
    ));
    assert_eq!(service(&s), Ok(None));
}

#[test]
fn a_service_without_any_cluster_ip_is_ignored_as_headless() {
    let s = svc(basic_service(json!({"clusterIP": "", "clusterIPs": null})));
    assert_eq!(service(&s), Ok(None));
    let s = svc(basic_service(
        json!({"clusterIP": null, "clusterIPs": null}),
    ));
    assert_eq!(service(&s), Ok(None));
}

#[test]
fn an_external_name_service_is_ignored_even_with_invalid_ports() {
    let s = svc(basic_service(json!({
        "type": "ExternalName",
        "externalName": "db.example.com",
        "clusterIP": null, "clusterIPs": null,
        "ports": [{"port": 0}],
    })));
    assert_eq!(service(&s), Ok(None));
}

#[test]
fn a_service_labelled_with_a_service_proxy_name_is_ignored() {
    let mut v = basic_service(json!({}));
    v["metadata"]["labels"] = json!({"service.kubernetes.io/service-proxy-name": "other"});
    assert_eq!(service(&svc(v)), Ok(None));
}

// ---- Service: names ----

#[test]
fn a_service_without_a_name_is_rejected_naming_metadata_name() {
    let mut v = basic_service(json!({}));
    v["metadata"] = json!({"namespace": "shop"});
    let r = service(&svc(v)).unwrap_err();
    assert_eq!(r.field, "metadata.name");
}

#[test]
fn a_service_without_a_namespace_is_rejected_naming_metadata_namespace() {
    let mut v = basic_service(json!({}));
    v["metadata"] = json!({"name": "web"});
    let r = service(&svc(v)).unwrap_err();
    assert_eq!(r.field, "metadata.namespace");
    assert_eq!(r.object, "Service /web");
}

#[test]
fn a_valid_service_converts_with_all_defaults() {
    let s = convert_ok(json!({"ports": [{"port": 80}]}));
    assert_eq!(
        s,
        Service {
            name: ServiceName::new("shop", "web"),
            cluster_ips: vec![ip("10.96.0.50")],
            ports: vec![ServicePort {
                name: String::new(),
                protocol: Protocol::Tcp,
                port: 80,
                node_port: None,
            }],
            external_ips: crate::model::Rare::default(),
            load_balancer_ips: crate::model::Rare::default(),
            load_balancer_source_ranges: crate::model::Rare::default(),
            external_traffic_policy: TrafficPolicy::Cluster,
            internal_traffic_policy: TrafficPolicy::Cluster,
            health_check_node_port: None,
            session_affinity_timeout: None,
            created: None,
            uid: None,
        }
    );
}

#[test]
fn the_creation_time_is_kept_in_seconds() {
    let mut raw = basic_service(json!({"ports": [{"port": 80}]}));
    raw["metadata"]["creationTimestamp"] = json!("2024-05-01T10:00:00Z");
    let s = service(&svc(raw)).unwrap().unwrap();
    assert_eq!(s.created, Some(1_714_557_600));
}

#[test]
fn the_uid_is_kept_for_events_and_one_with_a_control_character_is_dropped() {
    let mut raw = basic_service(json!({"ports": [{"port": 80}]}));
    raw["metadata"]["uid"] = json!("6f1c2f1e-1d2b-4c5a-9e0f-0a1b2c3d4e5f");
    let s = service(&svc(raw.clone())).unwrap().unwrap();
    assert_eq!(
        s.uid.as_ref().map(ToString::to_string).as_deref(),
        Some("6f1c2f1e-1d2b-4c5a-9e0f-0a1b2c3d4e5f")
    );
    assert!(matches!(s.uid, Some(Uid::Uuid(_))), "held as its bytes");
    raw["metadata"]["uid"] = json!("bad\nuid");
    let s = service(&svc(raw)).unwrap().unwrap();
    assert_eq!(s.uid, None, "the Service is kept, without the uid");
}

// ---- Service: cluster IPs ----

#[test]
fn a_non_canonical_ipv6_cluster_ip_is_accepted_and_stored_canonical() {
    let s = convert_ok(json!({
        "clusterIP": "fd00::10.0.0.3",
        "clusterIPs": ["fd00::10.0.0.3"],
        "ipFamilies": ["IPv6"],
    }));
    assert_eq!(s.cluster_ips, vec![ip("fd00::a00:3")]);
}

#[test]
fn an_ipv4_cluster_ip_with_leading_zeros_is_read_as_decimal() {
    let s = convert_ok(json!({"clusterIP": "010.096.000.010", "clusterIPs": ["010.096.000.010"]}));
    assert_eq!(s.cluster_ips, vec![ip("10.96.0.10")]);
}

#[test]
fn an_ipv4_mapped_ipv6_address_counts_as_ipv4() {
    let s = convert_ok(json!({
        "clusterIP": "::ffff:10.96.0.7",
        "clusterIPs": ["::ffff:10.96.0.7"],
        "ipFamilies": ["IPv4"],
    }));
    assert_eq!(s.cluster_ips, vec![ip("10.96.0.7")]);
}

#[test]
fn the_single_cluster_ip_field_is_used_when_cluster_ips_is_absent() {
    let s = convert_ok(json!({"clusterIP": "10.96.0.9", "clusterIPs": null}));
    assert_eq!(s.cluster_ips, vec![ip("10.96.0.9")]);
}

#[test]
fn a_dual_stack_service_keeps_both_cluster_ips_in_spec_order() {
    let s = convert_ok(json!({
        "clusterIP": "fd00:10:96::20",
        "clusterIPs": ["fd00:10:96::20", "10.96.10.20"],
        "ipFamilies": ["IPv6", "IPv4"],
    }));
    assert_eq!(s.cluster_ips, vec![ip("fd00:10:96::20"), ip("10.96.10.20")]);
    assert_eq!(s.cluster_ip(IpFamily::V4), Some(ip("10.96.10.20")));
}

#[test]
fn an_unparseable_cluster_ip_is_rejected_naming_its_index() {
    let r = convert_err(json!({"clusterIP": "10.96.0.1", "clusterIPs": ["10.96.0.1", "fd00::zz"]}));
    assert_eq!(r.object, "Service shop/web");
    assert_eq!(r.field, "spec.clusterIPs[1]");
    assert_eq!(r.value, "fd00::zz");
    assert!(r.reason.contains("not an IP address"), "{r}");
}

#[test]
fn two_cluster_ips_of_one_family_are_rejected() {
    let r =
        convert_err(json!({"clusterIP": "10.96.0.1", "clusterIPs": ["10.96.0.1", "10.96.0.2"]}));
    assert_eq!(r.field, "spec.clusterIPs[1]");
    assert!(r.reason.contains("at most one ClusterIP per family"), "{r}");
}

#[test]
fn ip_families_that_do_not_match_the_cluster_ips_are_rejected() {
    let r = convert_err(json!({
        "clusterIP": "10.96.0.1",
        "clusterIPs": ["10.96.0.1", "fd00::1"],
        "ipFamilies": ["IPv6", "IPv4"],
    }));
    assert_eq!(r.field, "spec.ipFamilies[0]");
    assert_eq!(r.value, "IPv6");
    assert!(r.reason.contains("spec.clusterIPs[0]"), "{r}");
}

#[test]
fn an_unknown_ip_family_is_rejected() {
    let r = convert_err(json!({"ipFamilies": ["IPv5"]}));
    assert_eq!(r.field, "spec.ipFamilies[0]");
    assert!(r.reason.contains("valid: IPv4, IPv6"), "{r}");
}

#[test]
fn a_cluster_ip_that_differs_from_the_first_cluster_ips_entry_is_rejected() {
    let r = convert_err(json!({"clusterIP": "10.96.0.2", "clusterIPs": ["10.96.0.1"]}));
    assert_eq!(r.field, "spec.clusterIP");
}

// ---- Service: ports ----

#[test]
fn port_zero_is_rejected_with_the_valid_range() {
    let r = convert_err(json!({"ports": [{"name": "a", "port": 80}, {"name": "b", "port": 0}]}));
    assert_eq!(r.field, "spec.ports[1].port");
    assert_eq!(r.value, "0");
    assert!(r.reason.contains("1..=65535"), "{r}");
}

#[test]
fn a_port_above_65535_is_rejected() {
    let r = convert_err(json!({"ports": [{"port": 65536}]}));
    assert_eq!(r.field, "spec.ports[0].port");
}

#[test]
fn a_negative_node_port_is_rejected() {
    let r = convert_err(json!({"type": "NodePort", "ports": [{"port": 80, "nodePort": -1}]}));
    assert_eq!(r.field, "spec.ports[0].nodePort");
    assert_eq!(r.value, "-1");
}

#[test]
fn a_node_port_is_kept_and_node_port_zero_means_none() {
    let s = convert_ok(json!({
        "type": "NodePort",
        "ports": [{"name": "a", "port": 80, "nodePort": 30080}, {"name": "b", "port": 81, "nodePort": 0}],
    }));
    assert_eq!(s.ports[0].node_port, Some(30080));
    assert_eq!(s.ports[1].node_port, None);
}

#[test]
fn protocol_defaults_to_tcp_and_udp_and_sctp_are_accepted() {
    let s = convert_ok(json!({"ports": [
        {"name": "a", "port": 53},
        {"name": "b", "port": 53, "protocol": "UDP"},
        {"name": "c", "port": 9, "protocol": "SCTP"},
    ]}));
    let protos: Vec<_> = s.ports.iter().map(|p| p.protocol).collect();
    assert_eq!(protos, vec![Protocol::Tcp, Protocol::Udp, Protocol::Sctp]);
}

#[test]
fn an_unknown_protocol_is_rejected_listing_the_valid_ones() {
    let r = convert_err(json!({"ports": [{"port": 80, "protocol": "tcp"}]}));
    assert_eq!(r.field, "spec.ports[0].protocol");
    assert_eq!(r.value, "tcp");
    assert!(r.reason.contains("valid: TCP, UDP, SCTP"), "{r}");
}

#[test]
fn duplicate_port_names_are_rejected() {
    let r = convert_err(json!({"ports": [{"name": "a", "port": 80}, {"name": "a", "port": 81}]}));
    assert_eq!(r.field, "spec.ports[1].name");
}

#[test]
fn an_unknown_service_type_is_rejected() {
    let r = convert_err(json!({"type": "Nodeport"}));
    assert_eq!(r.field, "spec.type");
}

// ---- Service: external and load-balancer addresses ----

#[test]
fn external_ips_are_parsed_and_an_invalid_one_is_rejected() {
    let s = convert_ok(json!({"externalIPs": ["203.0.113.5", "2001:db8::5"]}));
    assert_eq!(s.external_ips, vec![ip("203.0.113.5"), ip("2001:db8::5")]);
    let r = convert_err(json!({"externalIPs": ["203.0.113.5", "203.0.113"]}));
    assert_eq!(r.field, "spec.externalIPs[1]");
}

#[test]
fn lb_ingress_skips_proxy_mode_and_hostname_only_entries() {
    let mut v = basic_service(json!({"type": "LoadBalancer"}));
    v["status"] = json!({"loadBalancer": {"ingress": [
        {"ip": "203.0.113.10"},
        {"ip": "203.0.113.11", "ipMode": "VIP"},
        {"ip": "203.0.113.12", "ipMode": "Proxy"},
        {"hostname": "lb.example.com"},
    ]}});
    let s = service(&svc(v)).unwrap().unwrap();
    assert_eq!(
        s.load_balancer_ips,
        vec![ip("203.0.113.10"), ip("203.0.113.11")]
    );
}

#[test]
fn an_invalid_lb_ingress_ip_is_rejected_naming_its_index() {
    let mut v = basic_service(json!({"type": "LoadBalancer"}));
    v["status"] = json!({"loadBalancer": {"ingress": [{"hostname": "x"}, {"ip": "lb"}]}});
    let r = service(&svc(v)).unwrap_err();
    assert_eq!(r.field, "status.loadBalancer.ingress[1].ip");
}

#[test]
fn source_ranges_are_trimmed_and_parsed_as_cidrs() {
    let s = convert_ok(
        json!({"loadBalancerSourceRanges": [" 198.51.100.0/24 ", "2001:db8::/32", "203.0.113.7/24"]}),
    );
    let nets: Vec<String> = s
        .load_balancer_source_ranges
        .iter()
        .map(|n| n.to_string())
        .collect();
    assert_eq!(nets, ["198.51.100.0/24", "2001:db8::/32", "203.0.113.0/24"]);
}

#[test]
fn a_source_range_that_is_not_a_cidr_is_rejected() {
    for bad in ["198.51.100.0", "198.51.100.0/33", "x/8", "198.51.100.0/+8"] {
        let r = convert_err(json!({"loadBalancerSourceRanges": [bad]}));
        assert_eq!(r.field, "spec.loadBalancerSourceRanges[0]", "{bad}");
    }
}

// ---- Service: policies and affinity ----

#[test]
fn traffic_policies_default_to_cluster_and_accept_local() {
    let s = convert_ok(json!({"externalTrafficPolicy": "Local", "internalTrafficPolicy": "Local"}));
    assert_eq!(s.external_traffic_policy, TrafficPolicy::Local);
    assert_eq!(s.internal_traffic_policy, TrafficPolicy::Local);
    let s = convert_ok(json!({"externalTrafficPolicy": "Cluster"}));
    assert_eq!(s.external_traffic_policy, TrafficPolicy::Cluster);
    assert_eq!(s.internal_traffic_policy, TrafficPolicy::Cluster);
}

#[test]
fn a_traffic_policy_other_than_cluster_or_local_is_rejected() {
    let r = convert_err(json!({"externalTrafficPolicy": "Global"}));
    assert_eq!(r.field, "spec.externalTrafficPolicy");
    assert!(r.reason.contains("valid: Cluster, Local"), "{r}");
    let r = convert_err(json!({"internalTrafficPolicy": "local"}));
    assert_eq!(r.field, "spec.internalTrafficPolicy");
}

#[test]
fn the_health_check_node_port_is_kept_and_validated() {
    let s = convert_ok(json!({"externalTrafficPolicy": "Local", "healthCheckNodePort": 32000}));
    assert_eq!(s.health_check_node_port, Some(32000));
    let r = convert_err(json!({"healthCheckNodePort": 70000}));
    assert_eq!(r.field, "spec.healthCheckNodePort");
}

#[test]
fn client_ip_affinity_defaults_to_three_hours() {
    let s = convert_ok(json!({"sessionAffinity": "ClientIP"}));
    assert_eq!(s.session_affinity_timeout, Some(10800));
    let s = convert_ok(json!({"sessionAffinity": "None"}));
    assert_eq!(s.session_affinity_timeout, None);
}

#[test]
fn client_ip_affinity_uses_the_configured_timeout() {
    let s = convert_ok(json!({
        "sessionAffinity": "ClientIP",
        "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 60}},
    }));
    assert_eq!(s.session_affinity_timeout, Some(60));
}

#[test]
fn an_affinity_timeout_outside_one_second_to_one_day_is_rejected() {
    for bad in [0, -5, 86401] {
        let r = convert_err(json!({
            "sessionAffinity": "ClientIP",
            "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": bad}},
        }));
        assert_eq!(
            r.field,
            "spec.sessionAffinityConfig.clientIP.timeoutSeconds"
        );
        assert!(r.reason.contains("1..=86400"), "{r}");
    }
}

#[test]
fn an_unknown_session_affinity_is_rejected() {
    let r = convert_err(json!({"sessionAffinity": "Cookie"}));
    assert_eq!(r.field, "spec.sessionAffinity");
}

// ---- EndpointSlice ----

fn basic_slice(patch: Value) -> Value {
    let mut v = json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "web-abc12",
            "namespace": "shop",
            "labels": {"kubernetes.io/service-name": "web"},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": [{
            "addresses": ["10.244.1.5"],
            "conditions": {"ready": true, "serving": true, "terminating": false},
            "nodeName": "node-a",
            "zone": "zone-a",
        }],
    });
    merge(&mut v, patch);
    v
}

fn slice_ok(patch: Value) -> EndpointSlice {
    endpoint_slice(&slice(basic_slice(patch))).unwrap().unwrap()
}

fn slice_err(patch: Value) -> Rejected {
    endpoint_slice(&slice(basic_slice(patch))).unwrap_err()
}

#[test]
fn a_valid_slice_converts() {
    let s = slice_ok(json!({}));
    assert_eq!(s.name.to_string(), "shop/web-abc12");
    assert_eq!(s.service.to_string(), "shop/web");
    assert_eq!(s.family, IpFamily::V4);
    assert_eq!(
        s.ports,
        vec![SlicePort {
            name: "http".into(),
            protocol: Protocol::Tcp,
            port: 8080
        }]
        .into()
    );
    assert_eq!(
        s.endpoints,
        vec![SliceEndpoint {
            addr: ip("10.244.1.5"),
            conditions: Conditions {
                ready: true,
                serving: true,
                terminating: false
            },
            locality: Locality::of(Some("node-a".into()), Some("zone-a".into())),
        }]
        .into()
    );
}

#[test]
fn a_slice_labelled_headless_is_ignored() {
    let v = basic_slice(json!({"metadata": {"labels": {"service.kubernetes.io/headless": ""}}}));
    assert_eq!(endpoint_slice(&slice(v)), Ok(None));
}

#[test]
fn a_slice_labelled_with_a_service_proxy_name_is_ignored() {
    let v = basic_slice(
        json!({"metadata": {"labels": {"service.kubernetes.io/service-proxy-name": "x"}}}),
    );
    assert_eq!(endpoint_slice(&slice(v)), Ok(None));
}

#[test]
fn an_fqdn_slice_is_ignored() {
    let v = basic_slice(
        json!({"addressType": "FQDN", "endpoints": [{"addresses": ["db.example.com"]}]}),
    );
    assert_eq!(endpoint_slice(&slice(v)), Ok(None));
}

#[test]
fn an_unknown_address_type_is_rejected() {
    let r = slice_err(json!({"addressType": "IPv5"}));
    assert_eq!(r.field, "addressType");
    assert!(r.reason.contains("valid: IPv4, IPv6, FQDN"), "{r}");
}

#[test]
fn a_slice_without_the_service_name_label_is_rejected() {
    let mut v = basic_slice(json!({}));
    v["metadata"]["labels"] = json!({});
    let r = endpoint_slice(&slice(v)).unwrap_err();
    assert_eq!(r.object, "EndpointSlice shop/web-abc12");
    assert_eq!(r.field, "metadata.labels[\"kubernetes.io/service-name\"]");
}

#[test]
fn slice_port_name_defaults_to_empty_and_protocol_to_tcp() {
    let s = slice_ok(json!({"ports": [{"port": 8080}]}));
    assert_eq!(
        s.ports,
        vec![SlicePort {
            name: String::new(),
            protocol: Protocol::Tcp,
            port: 8080
        }]
        .into()
    );
}

#[test]
fn converted_port_vectors_hold_no_spare_capacity() {
    // The model keeps them for the object's lifetime: one port must not hold room for four (a
    // slice's ports are a boxed slice, which cannot).
    let v = service(&svc(basic_service(json!({})))).unwrap().unwrap();
    assert_eq!((v.ports.len(), v.ports.capacity()), (1, 1));
}

#[test]
fn a_slice_port_without_a_number_is_skipped_and_the_others_kept() {
    let s = slice_ok(json!({"ports": [{"name": "a"}, {"name": "c", "port": 9}]}));
    let names: Vec<_> = s.ports.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["c"]);
}

#[test]
fn a_slice_port_of_zero_is_rejected_like_one_too_large() {
    let r = slice_err(json!({"ports": [{"name": "c", "port": 9}, {"name": "b", "port": 0}]}));
    assert_eq!(r.field, "ports[1].port");
    assert!(r.reason.contains("valid: 1..=65535"), "{r}");
}

#[test]
fn a_slice_port_out_of_range_is_rejected() {
    let r = slice_err(json!({"ports": [{"name": "a", "port": 99999}]}));
    assert_eq!(r.field, "ports[0].port");
}

#[test]
fn a_slice_port_with_an_unknown_protocol_is_rejected() {
    let r = slice_err(json!({"ports": [{"port": 53, "protocol": "ICMP"}]}));
    assert_eq!(r.field, "ports[0].protocol");
    assert!(r.reason.contains("valid: TCP, UDP, SCTP"), "{r}");
}

#[test]
fn only_the_first_address_of_an_endpoint_is_used() {
    let s = slice_ok(json!({"endpoints": [{"addresses": ["10.244.1.5", "not-an-ip"]}]}));
    assert_eq!(s.endpoints.len(), 1);
    assert_eq!(s.endpoints[0].addr, ip("10.244.1.5"));
}

#[test]
fn an_endpoint_without_addresses_is_skipped() {
    let s = slice_ok(json!({"endpoints": [{"addresses": []}, {"addresses": ["10.244.2.5"]}]}));
    assert_eq!(s.endpoints.len(), 1);
}

#[test]
fn an_unparseable_endpoint_address_rejects_the_whole_slice() {
    let r = slice_err(
        json!({"endpoints": [{"addresses": ["10.244.1.5"]}, {"addresses": ["10.244.1"]}]}),
    );
    assert_eq!(r.field, "endpoints[1].addresses[0]");
    assert_eq!(r.value, "10.244.1");
}

#[test]
fn an_endpoint_address_of_the_wrong_family_rejects_the_whole_slice() {
    let r = slice_err(json!({"endpoints": [{"addresses": ["2001:db8::5"]}]}));
    assert_eq!(r.field, "endpoints[0].addresses[0]");
    assert!(r.reason.contains("IPv4"), "{r}");
    let r = slice_err(json!({"addressType": "IPv6"}));
    assert_eq!(r.field, "endpoints[0].addresses[0]");
}

#[test]
fn missing_conditions_mean_ready_serving_and_not_terminating() {
    let s = slice_ok(json!({"endpoints": [{"addresses": ["10.244.1.5"]}]}));
    assert_eq!(
        s.endpoints[0].conditions,
        Conditions {
            ready: true,
            serving: true,
            terminating: false
        }
    );
    let s = slice_ok(
        json!({"endpoints": [{"addresses": ["10.244.1.5"], "conditions": {"ready": false}}]}),
    );
    assert_eq!(
        s.endpoints[0].conditions,
        Conditions {
            ready: false,
            serving: true,
            terminating: false
        }
    );
}

#[test]
fn terminating_conditions_are_kept() {
    let s = slice_ok(json!({"endpoints": [{
        "addresses": ["10.244.1.5"],
        "conditions": {"ready": false, "serving": true, "terminating": true},
    }]}));
    assert_eq!(
        s.endpoints[0].conditions,
        Conditions {
            ready: false,
            serving: true,
            terminating: true
        }
    );
}

#[test]
fn zone_and_node_hints_are_kept() {
    let s = slice_ok(json!({"endpoints": [{
        "addresses": ["10.244.1.5"],
        "hints": {"forZones": [{"name": "zone-a"}, {"name": "zone-b"}], "forNodes": [{"name": "node-a"}]},
    }]}));
    assert_eq!(s.endpoints[0].zone_hints(), ["zone-a", "zone-b"]);
    assert_eq!(s.endpoints[0].node_hints(), ["node-a"]);
    assert_eq!(s.endpoints[0].node_name(), None);
}

#[test]
fn an_ipv6_slice_converts() {
    let s = slice_ok(
        json!({"addressType": "IPv6", "endpoints": [{"addresses": ["fd00:10:244:1::5"]}]}),
    );
    assert_eq!(s.family, IpFamily::V6);
    assert_eq!(s.endpoints[0].addr, ip("fd00:10:244:1::5"));
}

// ---- Node ----

fn basic_node(patch: Value) -> Value {
    let mut v = json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": "node-a", "labels": {"topology.kubernetes.io/zone": "zone-a"}},
        "spec": {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24", "fd00:10:244:1::/64"]},
        "status": {"addresses": [
            {"type": "InternalIP", "address": "192.0.2.11"},
            {"type": "InternalIP", "address": "2001:db8::11"},
            {"type": "ExternalIP", "address": "203.0.113.11"},
            {"type": "Hostname", "address": "node-a"},
        ]},
    });
    merge(&mut v, patch);
    v
}

#[test]
fn a_node_converts_with_addresses_pod_cidrs_and_zone() {
    let n = node(&node_obj(basic_node(json!({})))).unwrap();
    assert_eq!(n.name, "node-a");
    assert_eq!(n.internal_ips, vec![ip("192.0.2.11"), ip("2001:db8::11")]);
    assert_eq!(n.external_ips, vec![ip("203.0.113.11")]);
    let cidrs: Vec<String> = n.pod_cidrs.iter().map(|c| c.to_string()).collect();
    assert_eq!(cidrs, ["10.244.1.0/24", "fd00:10:244:1::/64"]);
    assert_eq!(n.zone.as_deref(), Some("zone-a"));
    assert!(!n.deleting);
    assert!(!n.to_be_deleted);
    assert_eq!(n.primary_ip(IpFamily::V6), Some(ip("2001:db8::11")));
}

#[test]
fn a_node_falls_back_to_the_single_pod_cidr() {
    let n = node(&node_obj(basic_node(json!({"spec": {"podCIDRs": null}})))).unwrap();
    let cidrs: Vec<String> = n.pod_cidrs.iter().map(|c| c.to_string()).collect();
    assert_eq!(cidrs, ["10.244.1.0/24"]);
}

#[test]
fn a_node_with_an_invalid_internal_ip_is_rejected() {
    let r = node(&node_obj(basic_node(json!({"status": {"addresses": [
        {"type": "Hostname", "address": "node-a"},
        {"type": "InternalIP", "address": "192.0.2.300"},
    ]}}))))
    .unwrap_err();
    assert_eq!(r.object, "Node node-a");
    assert_eq!(r.field, "status.addresses[1].address");
    assert_eq!(r.value, "192.0.2.300");
}

#[test]
fn a_node_with_an_invalid_pod_cidr_is_rejected() {
    let r = node(&node_obj(basic_node(
        json!({"spec": {"podCIDRs": ["10.244.1.0/24", "fd00::/129"]}}),
    )))
    .unwrap_err();
    assert_eq!(r.field, "spec.podCIDRs[1]");
}

#[test]
fn a_node_being_deleted_or_tainted_by_the_autoscaler_says_so() {
    let n = node(&node_obj(basic_node(json!({
        "metadata": {"deletionTimestamp": "2025-01-01T00:00:00Z"},
        "spec": {"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "value": "1700000000", "effect": "NoSchedule"}]},
    }))))
    .unwrap();
    assert!(n.deleting);
    assert!(n.to_be_deleted);
}

#[test]
fn a_node_without_a_name_is_rejected() {
    let mut v = basic_node(json!({}));
    v["metadata"] = json!({});
    let r = node(&node_obj(v)).unwrap_err();
    assert_eq!(r.field, "metadata.name");
}

#[test]
fn a_node_without_labels_has_no_zone() {
    let n = node(&node_obj(basic_node(json!({"metadata": {"labels": null}})))).unwrap();
    assert_eq!(n.zone, None);
}

// ---- address parsing ----

#[test]
fn sloppy_ip_parsing_accepts_legacy_forms_and_refuses_garbage() {
    assert_eq!(parse_ip("192.000.002.001"), Some(ip("192.0.2.1")));
    assert_eq!(
        parse_ip("2001:db8::192.000.002.001"),
        Some(ip("2001:db8::c000:201"))
    );
    assert_eq!(parse_ip("::ffff:192.0.2.1"), Some(ip("192.0.2.1")));
    for bad in [
        "",
        " 192.0.2.1",
        "192.0.2",
        "192.0.2.1.5",
        "192.0.2.256",
        "+1.2.3.4",
        "1..2.3",
        "::g",
    ] {
        assert_eq!(parse_ip(bad), None, "{bad:?}");
    }
}

#[test]
fn cidr_parsing_clears_host_bits_and_reads_leading_zeros() {
    assert_eq!(
        parse_cidr("192.000.002.077/24").map(|n| n.to_string()),
        Some("192.0.2.0/24".into())
    );
    assert_eq!(parse_cidr("192.0.2.0/"), None);
    assert_eq!(parse_cidr("192.0.2.0"), None);
}

fn service_cidr_obj(cidrs: &[&str]) -> k8s_openapi::api::networking::v1::ServiceCIDR {
    k8s_openapi::api::networking::v1::ServiceCIDR {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some("kubernetes".into()),
            ..Default::default()
        },
        spec: Some(k8s_openapi::api::networking::v1::ServiceCIDRSpec {
            cidrs: Some(cidrs.iter().map(|c| c.to_string()).collect()),
        }),
        status: None,
    }
}

#[test]
fn a_service_cidr_takes_one_range_per_family_and_refuses_ranges_no_service_network_has() {
    let (name, cidrs) =
        service_cidr(&service_cidr_obj(&["10.96.0.0/12", "fd00:10:96::/108"])).unwrap();
    assert_eq!(name, "kubernetes");
    assert_eq!(
        cidrs,
        [
            "10.96.0.0/12".parse::<ipnet::IpNet>().unwrap(),
            "fd00:10:96::/108".parse().unwrap()
        ]
    );
    for (bad, why) in [
        ("0.0.0.0/0", "wider than /8"),
        ("10.0.0.0/7", "wider than /8"),
        ("fd00::/48", "wider than /64"),
        ("127.0.0.0/8", "loopback"),
        ("224.0.0.0/8", "loopback, multicast"),
        ("fe80::/64", "link-local"),
        ("ten/8", "not a CIDR"),
    ] {
        let r = service_cidr(&service_cidr_obj(&[bad])).unwrap_err();
        assert_eq!(r.object, "ServiceCIDR kubernetes", "{bad}");
        assert_eq!(r.field, "spec.cidrs[0]", "{bad}");
        assert!(r.reason.contains(why), "{bad}: {}", r.reason);
    }
    let r = service_cidr(&service_cidr_obj(&["10.96.0.0/16", "10.97.0.0/16"])).unwrap_err();
    assert_eq!(r.field, "spec.cidrs[1]");
    assert!(r.reason.contains("same family"), "{}", r.reason);
}
