//! Unit tests for reading cluster objects from files.
use super::*;
use crate::model::{IpFamily, ServiceName};
use std::net::IpAddr;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A scratch directory per test, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Scratch {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "nodeproxy-source-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    fn file(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn load_one(name: &str, text: &str) -> Result<Loaded, SourceError> {
    let dir = Scratch::new();
    let path = dir.file(name, text);
    load_files(&[path])
}

fn sn(ns: &str, name: &str) -> ServiceName {
    ServiceName::new(ns, name)
}

fn service_yaml(name: &str, ip: &str, port: &str) -> String {
    format!(
        "apiVersion: v1
kind: Service
metadata:
  name: {name}
  namespace: shop
spec:
  clusterIP: {ip}
  clusterIPs: [{ip}]
  ports:
  - name: http
    port: {port}
    protocol: TCP
"
    )
}

const SLICE: &str = "apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-x1
  namespace: shop
  labels:
    kubernetes.io/service-name: web
addressType: IPv4
ports:
- name: http
  port: 8080
endpoints:
- addresses: [10.244.1.5]
  nodeName: node-a
";

const NODE: &str = "apiVersion: v1
kind: Node
metadata:
  name: node-a
status:
  addresses:
  - type: InternalIP
    address: 192.0.2.11
";

fn indent(text: &str, by: &str) -> String {
    text.lines()
        .map(|l| format!("{by}{l}\n"))
        .collect::<String>()
}

/// Wraps objects in a `kind: List` the way kubectl prints it.
fn list(objects: &[&str]) -> String {
    let mut out =
        String::from("apiVersion: v1\nkind: List\nmetadata:\n  resourceVersion: \"\"\nitems:\n");
    for o in objects {
        let body = indent(o, "  ");
        out.push_str("- ");
        out.push_str(body.trim_start());
    }
    out
}

#[test]
fn a_kubectl_list_yields_its_services_slices_and_nodes() {
    let text = list(&[&service_yaml("web", "10.96.0.20", "80"), SLICE, NODE]);
    let loaded = load_one("cluster.yaml", &text).unwrap();
    assert!(loaded.rejected.is_empty(), "{:?}", loaded.rejected);
    assert!(loaded.ignored.is_empty(), "{:?}", loaded.ignored);
    assert_eq!(loaded.state.services.len(), 1);
    assert_eq!(loaded.state.slices.len(), 1);
    assert_eq!(loaded.state.nodes.len(), 1);
    let slice = &loaded.state.slices[&sn("shop", "web-x1")];
    assert_eq!(slice.service, sn("shop", "web"));
    assert_eq!(slice.family, IpFamily::V4);
}

#[test]
fn several_yaml_documents_are_read_and_each_may_be_a_list() {
    let text = format!(
        "---\n{}---\n{}---\n{}---\n",
        service_yaml("a", "10.96.0.1", "80"),
        list(&[&service_yaml("b", "10.96.0.2", "80"), SLICE]),
        NODE
    );
    let loaded = load_one("multi.yaml", &text).unwrap();
    assert!(loaded.rejected.is_empty(), "{:?}", loaded.rejected);
    assert_eq!(loaded.state.services.len(), 2);
    assert_eq!(loaded.state.slices.len(), 1);
    assert_eq!(loaded.state.nodes.len(), 1);
}

#[test]
fn a_single_object_file_is_read() {
    let loaded = load_one("node.yaml", NODE).unwrap();
    let node = &loaded.state.nodes["node-a"];
    assert_eq!(
        node.internal_ips,
        vec!["192.0.2.11".parse::<IpAddr>().unwrap()]
    );
}

#[test]
fn a_json_list_as_kubectl_prints_it_is_read() {
    let text = r#"{
    "apiVersion": "v1",
    "items": [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web", "namespace": "shop"},
            "spec": {"clusterIP": "10.96.0.20", "clusterIPs": ["10.96.0.20"],
                     "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}
        },
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": "node-a"}
        }
    ],
    "kind": "List",
    "metadata": {"resourceVersion": ""}
}"#;
    let loaded = load_one("cluster.json", text).unwrap();
    assert!(loaded.rejected.is_empty(), "{:?}", loaded.rejected);
    assert_eq!(loaded.state.services.len(), 1);
    assert_eq!(loaded.state.nodes.len(), 1);
}

#[test]
fn a_typed_list_such_as_service_list_is_unpacked() {
    let text = list(&[&service_yaml("web", "10.96.0.20", "80")])
        .replace("kind: List", "kind: ServiceList");
    let loaded = load_one("services.yaml", &text).unwrap();
    assert_eq!(loaded.state.services.len(), 1);
}

#[test]
fn a_yaml_syntax_error_names_the_file_line_and_column() {
    let text = "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\n  namespace: [shop\n";
    let err = load_one("broken.yaml", text).unwrap_err();
    let SourceError::Parse { ref path, line, .. } = err else {
        panic!("expected a parse error, got {err}");
    };
    assert!(path.ends_with("broken.yaml"));
    assert!(line >= 5, "line {line}");
    let shown = err.to_string();
    assert!(shown.contains("broken.yaml:"), "{shown}");
    assert!(shown.contains(&format!(":{line}:")), "{shown}");
    assert!(
        !shown.contains(&format!(" at line {line} column")),
        "position shown twice: {shown}"
    );
}

#[test]
fn a_json_syntax_error_names_the_file_line_and_column() {
    let text = "{\n  \"kind\": \"List\",\n  \"items\": [\n    {\"kind\": \"Node\",}\n  ]\n}\n";
    let err = load_one("broken.json", text).unwrap_err();
    let shown = err.to_string();
    assert!(
        matches!(
            err,
            SourceError::Parse {
                line: 4,
                format: "JSON",
                ..
            }
        ),
        "{shown}"
    );
    assert!(shown.contains("broken.json:4:"), "{shown}");
}

#[test]
fn a_missing_file_is_a_read_error_naming_the_path() {
    let dir = Scratch::new();
    let path = dir.0.join("absent.yaml");
    let err = load_files(&[path]).unwrap_err();
    assert!(matches!(err, SourceError::Read { .. }));
    assert!(err.to_string().contains("absent.yaml"), "{err}");
}

#[test]
fn a_file_mixing_one_invalid_service_with_valid_ones_yields_the_valid_ones_and_one_rejection() {
    let text = list(&[
        &service_yaml("a", "10.96.0.1", "80"),
        &service_yaml("bad", "10.96.0.2", "70000"),
        &service_yaml("c", "10.96.0.3", "443"),
    ]);
    let loaded = load_one("mixed.yaml", &text).unwrap();
    let names: Vec<_> = loaded
        .state
        .services
        .keys()
        .map(|n| n.to_string())
        .collect();
    assert_eq!(names, ["shop/a", "shop/c"]);
    assert_eq!(loaded.rejected.len(), 1);
    let r = &loaded.rejected[0];
    assert_eq!(r.object, "Service shop/bad");
    assert_eq!(r.field, "spec.ports[0].port");
    assert_eq!(r.value, "70000");
}

#[test]
fn a_schema_mismatch_is_rejected_with_the_field_not_fatal() {
    let text = list(&[
        &service_yaml("a", "10.96.0.1", "80"),
        &service_yaml("b", "10.96.0.2", "http"),
    ]);
    let loaded = load_one("schema.yaml", &text).unwrap();
    assert_eq!(loaded.state.services.len(), 1);
    assert_eq!(loaded.rejected.len(), 1);
    let r = &loaded.rejected[0];
    assert_eq!(r.object, "Service shop/b");
    assert_eq!(r.field, "spec.ports[0].port");
    assert_eq!(r.value, "http");
    assert!(r.reason.contains("invalid type"), "{r}");
}

#[test]
fn a_missing_required_field_reads_as_empty_and_is_rejected_by_validation() {
    // k8s-openapi defaults missing required fields instead of failing, so it is validation
    // that names them.
    let text = SLICE.replace("addressType: IPv4\n", "");
    let loaded = load_one("slice.yaml", &text).unwrap();
    assert_eq!(loaded.rejected.len(), 1, "{:?}", loaded.rejected);
    let r = &loaded.rejected[0];
    assert_eq!(r.object, "EndpointSlice shop/web-x1");
    assert_eq!(r.field, "addressType");
    assert!(r.reason.contains("valid: IPv4, IPv6, FQDN"), "{r}");

    let text = NODE.replace("    address: 192.0.2.11\n", "");
    let loaded = load_one("node.yaml", &text).unwrap();
    assert_eq!(loaded.rejected[0].field, "status.addresses[0].address");
}

#[test]
fn a_wrongly_typed_nested_field_is_traced_to_its_path() {
    let text = SLICE.replace(
        "  nodeName: node-a\n",
        "  nodeName: node-a\n  conditions: [ready]\n",
    );
    let loaded = load_one("slice.yaml", &text).unwrap();
    assert_eq!(loaded.rejected.len(), 1);
    assert_eq!(loaded.rejected[0].field, "endpoints[0].conditions");
    let text = SLICE.replace(
        "  nodeName: node-a\n",
        "  nodeName: node-a\n  conditions: {ready: \"yes\"}\n",
    );
    let loaded = load_one("slice.yaml", &text).unwrap();
    assert_eq!(loaded.rejected[0].field, "endpoints[0].conditions.ready");
    assert_eq!(loaded.rejected[0].value, "yes");
    let text = service_yaml("a", "10.96.0.1", "80")
        + "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 1h}}\n";
    let loaded = load_one("svc.yaml", &text).unwrap();
    assert_eq!(
        loaded.rejected[0].field,
        "spec.sessionAffinityConfig.clientIP.timeoutSeconds"
    );
    let text = NODE.replace("  name: node-a\n", "  name: node-a\n  labels: [a]\n");
    let loaded = load_one("node.yaml", &text).unwrap();
    assert_eq!(loaded.rejected[0].field, "metadata.labels");
    assert_eq!(loaded.rejected[0].object, "Node node-a");
}

#[test]
fn other_kinds_and_api_versions_are_ignored_with_a_reason() {
    let configmap = "apiVersion: v1
kind: ConfigMap
metadata:
  name: foo
  namespace: kube-system
data:
  a: b
";
    let old_slice = SLICE.replace("discovery.k8s.io/v1", "discovery.k8s.io/v1beta1");
    let text = list(&[configmap, &old_slice, NODE]);
    let loaded = load_one("mixed.yaml", &text).unwrap();
    assert_eq!(loaded.state.nodes.len(), 1);
    assert!(loaded.state.slices.is_empty());
    assert!(loaded.rejected.is_empty());
    assert_eq!(loaded.ignored.len(), 2, "{:?}", loaded.ignored);
    assert!(
        loaded.ignored[0].starts_with("ConfigMap kube-system/foo: kind not used by nodeproxy"),
        "{}",
        loaded.ignored[0]
    );
    assert!(
        loaded.ignored[1].starts_with("EndpointSlice shop/web-x1: apiVersion"),
        "{}",
        loaded.ignored[1]
    );
}

#[test]
fn items_that_are_not_objects_are_rejected_not_fatal() {
    let text = format!("{}---\n- just\n- a list\n---\nname: no-kind\n", NODE);
    let loaded = load_one("odd.yaml", &text).unwrap();
    assert_eq!(loaded.state.nodes.len(), 1);
    assert_eq!(loaded.rejected.len(), 2, "{:?}", loaded.rejected);
    assert_eq!(loaded.rejected[1].field, "kind");
    assert!(
        loaded.rejected[1].object.contains("odd.yaml, item 3"),
        "{}",
        loaded.rejected[1]
    );
}

#[test]
fn headless_and_external_name_services_are_noted_as_ignored() {
    let headless = service_yaml("db", "None", "5432");
    let external = "apiVersion: v1
kind: Service
metadata:
  name: mail
  namespace: shop
spec:
  type: ExternalName
  externalName: mail.example.com
";
    let loaded = load_one("svc.yaml", &list(&[&headless, external])).unwrap();
    assert!(loaded.state.services.is_empty());
    assert!(loaded.rejected.is_empty());
    assert_eq!(loaded.ignored.len(), 2);
    assert!(
        loaded.ignored[0].starts_with("Service shop/db: headless"),
        "{:?}",
        loaded.ignored
    );
    assert!(
        loaded.ignored[1].starts_with("Service shop/mail: type ExternalName"),
        "{:?}",
        loaded.ignored
    );
}

#[test]
fn a_duplicate_object_in_a_later_file_wins_and_is_noted() {
    let dir = Scratch::new();
    let first = dir.file("1.yaml", &service_yaml("web", "10.96.0.1", "80"));
    let second = dir.file("2.yaml", &service_yaml("web", "10.96.0.2", "80"));
    let loaded = load_files(&[first, second]).unwrap();
    let svc = &loaded.state.services[&sn("shop", "web")];
    assert_eq!(
        svc.cluster_ips,
        vec!["10.96.0.2".parse::<IpAddr>().unwrap()]
    );
    assert_eq!(loaded.replaced.len(), 1);
    assert!(
        loaded.replaced[0].contains("2.yaml"),
        "{}",
        loaded.replaced[0]
    );
    assert!(
        loaded.replaced[0].contains("1.yaml"),
        "{}",
        loaded.replaced[0]
    );
}

#[test]
fn each_definition_replaces_the_one_before_it_and_the_notes_follow_the_file() {
    let web_slice = SLICE.replace("name: web-x1", "name: web");
    let text = list(&[
        &service_yaml("web", "10.96.0.1", "80"),
        &service_yaml("api", "10.96.0.2", "80"),
        // Another kind with the same name: no replacement.
        &web_slice,
        &service_yaml("api", "10.96.0.3", "80"),
        &service_yaml("web", "10.96.0.4", "80"),
        &service_yaml("api", "10.96.0.5", "80"),
    ]);
    for name in ["defs.yaml", "defs.json"] {
        let text = if name.ends_with(".json") {
            let value: serde_json::Value = serde_yaml_ng::from_str(&text).unwrap();
            value.to_string()
        } else {
            text.clone()
        };
        let loaded = file::load_text(Path::new(name), &text).unwrap();
        let ip = |svc: &str| loaded.state.services[&sn("shop", svc)].cluster_ips.clone();
        assert_eq!(ip("web"), vec!["10.96.0.4".parse::<IpAddr>().unwrap()]);
        assert_eq!(ip("api"), vec!["10.96.0.5".parse::<IpAddr>().unwrap()]);
        assert_eq!(loaded.state.slices.len(), 1);
        let note = |svc: &str, later: usize, earlier: usize| {
            format!(
                "Service shop/{svc}: defined again in {name}, item {later}; the definition in \
                 {name}, item {earlier} is replaced"
            )
        };
        assert_eq!(
            loaded.replaced,
            // In the order of the later definitions, not by name or by the earlier ones.
            vec![note("api", 4, 2), note("web", 5, 1), note("api", 6, 4)],
            "{name}"
        );
    }
}

#[test]
fn a_later_invalid_duplicate_replaces_the_earlier_valid_one() {
    let dir = Scratch::new();
    let first = dir.file("1.yaml", &service_yaml("web", "10.96.0.1", "80"));
    let second = dir.file("2.yaml", &service_yaml("web", "10.96.0.2", "0"));
    let loaded = load_files(&[first, second]).unwrap();
    assert!(loaded.state.services.is_empty());
    assert_eq!(loaded.rejected.len(), 1);
}

#[test]
fn empty_files_and_empty_documents_yield_nothing() {
    let loaded = load_one("empty.yaml", "").unwrap();
    assert_eq!(loaded, Loaded::default());
    let loaded = load_one("dashes.yaml", "---\n---\n").unwrap();
    assert_eq!(loaded, Loaded::default());
    let loaded = load_one("empty.json", "").unwrap();
    assert_eq!(loaded, Loaded::default());
}

#[test]
fn odd_inputs_never_panic() {
    for text in [
        "kind: List\nitems: 5\n",
        "kind: List\nitems: [1, null, [], {kind: 7}]\n",
        "kind: Service\napiVersion: v1\n",
        "kind: Service\napiVersion: v1\nmetadata: 5\n",
        "kind: EndpointSlice\napiVersion: discovery.k8s.io/v1\nmetadata: {name: x}\n",
        "kind: Node\napiVersion: v1\nmetadata: {name: n}\nstatus: {addresses: 5}\n",
        "kind: Node\napiVersion: v1\nmetadata: {name: n}\nspec: {taints: [{}]}\n",
        "!!binary aGVsbG8=\n",
        "a: &a [*a]\n",
        "? [complex, key]\n: value\n",
        "\u{feff}kind: Node\napiVersion: v1\nmetadata: {name: bom}\n",
    ] {
        let _ = load_one("odd.yaml", text);
    }
    let loaded = load_one(
        "bom.yaml",
        "\u{feff}kind: Node\napiVersion: v1\nmetadata: {name: bom}\n",
    )
    .unwrap();
    assert_eq!(loaded.state.nodes.len(), 1);
}

#[test]
fn the_example_cluster_loads_with_the_expected_counts() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/cluster.yaml");
    let loaded = load_files(&[path]).unwrap();
    assert!(loaded.rejected.is_empty(), "{:?}", loaded.rejected);
    let services: Vec<_> = loaded
        .state
        .services
        .keys()
        .map(|n| n.to_string())
        .collect();
    assert_eq!(
        services,
        [
            "default/kubernetes",
            "kube-system/kube-dns",
            "shop/api",
            "shop/checkout",
            "shop/web"
        ]
    );
    assert_eq!(
        loaded.state.slices.len(),
        6,
        "{:?}",
        loaded.state.slices.keys()
    );
    let nodes: Vec<_> = loaded.state.nodes.keys().cloned().collect();
    assert_eq!(nodes, ["node-a", "node-b"]);
    // headless Service and its slice, ExternalName Service, ConfigMap
    assert_eq!(loaded.ignored.len(), 4, "{:#?}", loaded.ignored);
    assert!(loaded.ignored.iter().any(|i| i.starts_with("ConfigMap ")));

    let web = &loaded.state.services[&sn("shop", "web")];
    assert_eq!(web.cluster_ips.len(), 2);
    assert_eq!(web.ports[0].node_port, Some(30080));
    let index = loaded.state.slices_by_service();
    let eps = crate::model::endpoints_for(&index[&web.name], &web.ports[0]);
    // Three pods in the IPv4 slice; node-b has no IPv6 pod CIDR, so only two in the IPv6 one.
    assert_eq!(eps.len(), 5);
    assert_eq!(eps.iter().filter(|e| e.conditions.terminating).count(), 2);

    let node_a = &loaded.state.nodes["node-a"];
    assert_eq!(node_a.zone.as_deref(), Some("zone-a"));
    assert_eq!(node_a.pod_cidrs.len(), 2);
}

#[test]
fn a_nameless_object_is_reported_by_its_file_and_position() {
    let text = list(&[
        NODE,
        "apiVersion: v1\nkind: Service\nmetadata:\n  namespace: shop\nspec:\n  clusterIP: 10.96.0.1\n",
    ]);
    let loaded = load_one("nameless.yaml", &text).unwrap();
    assert_eq!(loaded.rejected.len(), 1);
    let r = &loaded.rejected[0];
    assert_eq!(r.field, "metadata.name");
    assert!(r.object.starts_with("Service ("), "{r}");
    assert!(r.object.ends_with("nameless.yaml, item 2)"), "{r}");
}

#[test]
fn a_node_is_keyed_by_name_even_if_a_namespace_is_written() {
    let with_ns = NODE.replace("  name: node-a\n", "  name: node-a\n  namespace: default\n");
    let loaded = load_one("nodes.yaml", &list(&[NODE, &with_ns])).unwrap();
    assert_eq!(loaded.state.nodes.len(), 1);
    assert_eq!(loaded.replaced.len(), 1, "{:?}", loaded.replaced);
    assert!(
        loaded.replaced[0].starts_with("Node node-a: defined again"),
        "{:?}",
        loaded.replaced
    );
}

#[test]
fn a_yaml_list_with_items_before_kind_is_read() {
    // kubectl prints keys in order: `items` comes before `kind: List`.
    let text = list(&[&service_yaml("web", "10.96.0.20", "80"), SLICE, NODE])
        .replace("kind: List\n", "")
        + "kind: List\n";
    let loaded = load_one("cluster.yaml", &text).unwrap();
    assert!(loaded.rejected.is_empty(), "{:?}", loaded.rejected);
    assert!(loaded.ignored.is_empty(), "{:?}", loaded.ignored);
    assert_eq!(loaded.state.services.len(), 1);
    assert_eq!(loaded.state.slices.len(), 1);
    assert_eq!(loaded.state.nodes.len(), 1);
}

#[test]
fn a_document_with_items_that_is_not_a_list_is_one_object() {
    // `kind` comes after `items`, so the items are read before it is known not to be a list.
    let node_json = r#"{"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"}}"#;
    let docs = [
        node_json.to_owned(),
        format!(
            "{{\"apiVersion\": \"v1\", \"items\": [{node_json}], \"kind\": \"Thing\", \
             \"metadata\": {{\"name\": \"t\"}}}}"
        ),
        format!("{{\"items\": [{node_json}]}}"),
        node_json.to_owned(),
    ];
    for (name, separator) in [("objects.json", "\n"), ("objects.yaml", "\n---\n")] {
        let loaded = load_one(name, &docs.join(separator)).unwrap();
        assert_eq!(loaded.state.nodes.len(), 1, "{name}");
        assert_eq!(loaded.rejected.len(), 1, "{name}: {:?}", loaded.rejected);
        let r = &loaded.rejected[0];
        assert_eq!(r.field, "kind", "{name}");
        assert!(r.object.ends_with(", item 3)"), "{name}: {r}");
        assert_eq!(loaded.ignored.len(), 1, "{name}: {:?}", loaded.ignored);
        assert_eq!(loaded.replaced.len(), 1, "{name}: {:?}", loaded.replaced);
        assert!(
            loaded.ignored[0].starts_with("Thing t: kind not used by nodeproxy"),
            "{name}: {:?}",
            loaded.ignored
        );
        assert!(
            loaded.ignored[0].ends_with(", item 2)"),
            "{name}: {:?}",
            loaded.ignored
        );
        assert!(
            loaded.replaced[0].contains("item 4") && loaded.replaced[0].contains("item 1"),
            "{name}: {:?}",
            loaded.replaced
        );
    }
}

#[test]
fn several_json_values_each_may_be_a_list() {
    let svc = r#"{"apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "web", "namespace": "shop"},
        "spec": {"clusterIP": "10.96.0.20", "ports": [{"port": 80}]}}"#;
    let node = r#"{"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"}}"#;
    let text = format!(
        "{{\"items\": [{svc}, null, 5], \"kind\": \"ServiceList\"}}\n{node}\n\
         {{\"items\": [], \"kind\": \"List\"}}{node}"
    );
    let loaded = load_one("stream.json", &text).unwrap();
    assert_eq!(loaded.state.services.len(), 1);
    assert_eq!(loaded.state.nodes.len(), 1);
    assert_eq!(loaded.rejected.len(), 1, "{:?}", loaded.rejected);
    assert!(
        loaded.rejected[0].object.ends_with("stream.json, item 2)"),
        "{}",
        loaded.rejected[0]
    );
    assert_eq!(loaded.replaced.len(), 1, "{:?}", loaded.replaced);
    assert!(
        loaded.replaced[0].starts_with("Node node-a: defined again in"),
        "{:?}",
        loaded.replaced
    );
}

#[test]
fn a_syntax_error_deep_in_the_items_names_its_line() {
    let mut text = String::from("{\"apiVersion\": \"v1\", \"items\": [\n");
    for i in 0..50 {
        text.push_str(&format!(
            "{{\"apiVersion\": \"v1\", \"kind\": \"Node\", \"metadata\": {{\"name\": \"n{i}\"}}}},\n"
        ));
    }
    text.push_str("{\"kind\": \"Node\" \"apiVersion\": \"v1\"}\n], \"kind\": \"List\"}\n");
    let err = load_one("big.json", &text).unwrap_err();
    assert!(matches!(err, SourceError::Parse { line: 52, .. }), "{err}");
    let err = load_one("big.yaml", &text).unwrap_err();
    assert!(matches!(err, SourceError::Parse { line: 52, .. }), "{err}");
}

#[test]
fn a_key_repeated_in_one_mapping_is_a_parse_error_naming_it() {
    let node =
        |name: &str| format!(r#"{{apiVersion: v1, kind: Node, metadata: {{name: {name}}}}}"#);
    let yaml = [
        format!(
            "kind: List\nitems:\n- {}\nitems:\n- {}\n",
            node("a"),
            node("b")
        ),
        "apiVersion: v1\nkind: Service\nmetadata: {namespace: a, name: b}\nspec:\n  \
         clusterIP: 10.96.0.1\n  clusterIP: 10.96.0.2\n"
            .to_string(),
        "kind: List\nitems:\n- {apiVersion: v1, kind: Node, kind: Node, metadata: {name: a}}\n"
            .to_string(),
    ];
    for text in &yaml {
        let err = load_one("dup.yaml", text).unwrap_err().to_string();
        assert!(err.contains("duplicate key"), "{text}: {err}");
    }
    let json = [
        r#"{"kind": "List",
        "items": [{"apiVersion": "v1", "kind": "Node", "metadata": {"name": "a"}}],
        "items": [{"apiVersion": "v1", "kind": "Node", "metadata": {"name": "b"}}]}"#,
        r#"{"kind": "List",
        "items": [{"apiVersion": "v1", "kind": "Node", "metadata": {"name": "a"}}],
        "items": 5}"#,
        r#"{"apiVersion": "v1", "kind": "Node", "metadata": {"name": "a", "name": "b"}}"#,
        r#"{"kind": "Node", "items": [], "apiVersion": "v1", "kind": "List"}"#,
    ];
    for text in json {
        let err = load_one("dup.json", text).unwrap_err().to_string();
        assert!(err.contains("duplicate key"), "{text}: {err}");
        assert!(err.contains("dup.json:"), "{text}: {err}");
    }
}
