//! The Kubernetes manifest `packaging/kubernetes/nodeproxy.yaml`: every object round-trips
//! through its `k8s-openapi` type without losing a field, the DaemonSet is shaped as the
//! integration contract says (host network, only NET_ADMIN, the lock on the host's
//! /run/nodeproxy, probes on the health port, the API server's real address), its arguments
//! load as a configuration, and the ClusterRole allows every request the daemon makes against
//! the fake API server and grants nothing the daemon does not use.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
mod fakeapi;

use std::collections::BTreeSet;
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule};
use serde::Deserialize as _;
use serde_json::Value;

use common::daemon::{Daemon, PATIENCE, get};
use common::netns::in_netns;
use fakeapi::{FakeApi, Kind, node, service, slice};

const MANIFEST: &str = include_str!("../packaging/kubernetes/nodeproxy.yaml");

/// The manifest's documents as JSON values, in order.
fn documents() -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(MANIFEST)
        .map(|doc| Value::deserialize(doc).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

fn find<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    let found: Vec<&Value> = docs.iter().filter(|d| d["kind"] == kind).collect();
    assert_eq!(found.len(), 1, "exactly one {kind} in the manifest");
    found[0]
}

/// `value` deserialised as `T` and serialised again must be `value`: a misspelt or misplaced
/// field is dropped by the typed deserialiser and shows up here.
fn round_trip<T: serde::de::DeserializeOwned + serde::Serialize>(value: &Value) -> T {
    let typed: T = serde_json::from_value(value.clone()).unwrap_or_else(|e| {
        panic!("{} does not deserialise: {e}", value["kind"]);
    });
    let again = serde_json::to_value(&typed).unwrap();
    assert_eq!(
        &again, value,
        "{} lost or changed a field in the round trip through k8s-openapi",
        value["kind"]
    );
    typed
}

#[test]
fn every_object_round_trips_through_its_k8s_openapi_type() {
    let docs = documents();
    let kinds: Vec<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "ConfigMap",
            "DaemonSet"
        ]
    );
    round_trip::<ServiceAccount>(find(&docs, "ServiceAccount"));
    round_trip::<ClusterRole>(find(&docs, "ClusterRole"));
    round_trip::<ClusterRoleBinding>(find(&docs, "ClusterRoleBinding"));
    round_trip::<ConfigMap>(find(&docs, "ConfigMap"));
    round_trip::<DaemonSet>(find(&docs, "DaemonSet"));
}

#[test]
fn the_round_trip_check_catches_a_misspelt_field() {
    let docs = documents();
    let mut ds = find(&docs, "DaemonSet").clone();
    ds["spec"]["template"]["spec"]["hostNetwrok"] = Value::Bool(true);
    let caught = std::panic::catch_unwind(|| round_trip::<DaemonSet>(&ds));
    assert!(caught.is_err(), "a misspelt field passed the round trip");
}

#[test]
fn the_binding_names_the_role_and_the_daemonset_runs_as_its_account() {
    let docs = documents();
    let sa: ServiceAccount = round_trip(find(&docs, "ServiceAccount"));
    let role: ClusterRole = round_trip(find(&docs, "ClusterRole"));
    let binding: ClusterRoleBinding = round_trip(find(&docs, "ClusterRoleBinding"));
    let ds: DaemonSet = round_trip(find(&docs, "DaemonSet"));
    assert_eq!(binding.role_ref.kind, "ClusterRole");
    assert_eq!(Some(&binding.role_ref.name), role.metadata.name.as_ref());
    let subjects = binding.subjects.unwrap();
    assert_eq!(subjects.len(), 1);
    assert_eq!(subjects[0].kind, "ServiceAccount");
    assert_eq!(Some(&subjects[0].name), sa.metadata.name.as_ref());
    assert_eq!(subjects[0].namespace, sa.metadata.namespace);
    assert_eq!(ds.metadata.namespace, sa.metadata.namespace);
    let pod = ds.spec.unwrap().template.spec.unwrap();
    assert_eq!(pod.service_account_name, sa.metadata.name);
}

#[test]
fn the_daemonset_is_a_host_network_proxy_with_only_net_admin() {
    let docs = documents();
    let ds: DaemonSet = round_trip(find(&docs, "DaemonSet"));
    let spec = ds.spec.unwrap();
    assert_eq!(
        spec.update_strategy.and_then(|s| s.type_).as_deref(),
        Some("RollingUpdate")
    );
    let pod = spec.template.spec.unwrap();
    assert_eq!(pod.host_network, Some(true));
    assert_eq!(
        pod.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
    let tolerations = pod.tolerations.unwrap();
    assert!(
        tolerations
            .iter()
            .any(|t| t.operator.as_deref() == Some("Exists") && t.key.is_none()),
        "tolerates every taint, as kube-proxy's DaemonSet does"
    );
    assert_eq!(pod.containers.len(), 1);
    let c = &pod.containers[0];

    assert_eq!(
        c.image.as_deref(),
        Some(format!("nodeproxy:{}", env!("CARGO_PKG_VERSION")).as_str()),
        "the image tag follows Cargo.toml's version (scripts/dist.sh tags the image with it)"
    );
    let sc = c.security_context.clone().unwrap();
    assert_ne!(sc.privileged, Some(true));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    let caps = sc.capabilities.unwrap();
    assert_eq!(caps.drop.unwrap(), ["ALL"]);
    assert_eq!(caps.add.unwrap(), ["NET_ADMIN"]);

    // NODE_NAME from the pod's node, into --hostname-override.
    let env = c.env.clone().unwrap();
    let node_name = env.iter().find(|e| e.name == "NODE_NAME").unwrap();
    let field = node_name
        .value_from
        .as_ref()
        .and_then(|v| v.field_ref.as_ref())
        .unwrap();
    assert_eq!(field.field_path, "spec.nodeName");
    let args = c.args.clone().unwrap();
    assert!(args.contains(&"--hostname-override=$(NODE_NAME)".to_owned()));

    // The privileged part runs once, before, in an init container of the same image.
    let init = pod.init_containers.clone().unwrap();
    assert_eq!(init.len(), 1);
    assert_eq!(init[0].image, c.image);
    assert_eq!(init[0].args.clone().unwrap(), ["--init-only"]);
    assert_eq!(
        init[0].security_context.as_ref().and_then(|s| s.privileged),
        Some(true)
    );
    let argv = ["nodeproxy", "--init-only"].map(std::ffi::OsString::from);
    let loaded = nodeproxy::config::load(argv, &|_| None).unwrap();
    assert_eq!(loaded.mode, nodeproxy::config::Mode::InitOnly);

    // The API server's real address comes from the ConfigMap, not the kubernetes ClusterIP.
    let from = c.env_from.clone().unwrap();
    let map_name = from[0].config_map_ref.as_ref().unwrap().name.clone();
    let map: ConfigMap = round_trip(find(&docs, "ConfigMap"));
    assert_eq!(map.metadata.name.as_deref(), Some(map_name.as_str()));
    assert_eq!(map.metadata.namespace, ds.metadata.namespace);
    let data = map.data.unwrap();
    let host: std::net::IpAddr = data["KUBERNETES_SERVICE_HOST"].parse().unwrap();
    assert!(!host.is_loopback());
    let port: u16 = data["KUBERNETES_SERVICE_PORT"].parse().unwrap();
    assert!(port > 0);
}

/// The container's arguments, with `$(NODE_NAME)` expanded as the kubelet does.
fn container_args(ds: &DaemonSet) -> Vec<String> {
    let pod = ds.spec.clone().unwrap().template.spec.unwrap();
    pod.containers[0]
        .args
        .clone()
        .unwrap()
        .into_iter()
        .map(|a| a.replace("$(NODE_NAME)", "node-a"))
        .collect()
}

#[test]
fn the_arguments_load_and_the_lock_and_probes_match_the_mounts_and_ports() {
    let docs = documents();
    let ds: DaemonSet = round_trip(find(&docs, "DaemonSet"));
    let args = container_args(&ds);
    let argv = std::iter::once("nodeproxy".to_owned())
        .chain(args)
        .map(Into::into);
    // In the pod, KUBERNETES_SERVICE_HOST/PORT select the in-cluster configuration; nothing
    // else from the environment is read.
    let loaded = nodeproxy::config::load(argv, &|_| None).unwrap();
    let config = loaded.config;
    assert_eq!(config.hostname_override.as_deref(), Some("node-a"));
    assert_eq!(config.kubeconfig, None, "in-cluster configuration");

    let pod = ds.spec.unwrap().template.spec.unwrap();
    let c = &pod.containers[0];

    // The lock file is in the host's /run/nodeproxy, the directory the systemd unit uses.
    assert_eq!(
        config.lock_file,
        std::path::PathBuf::from(nodeproxy::config::DEFAULT_LOCK_FILE)
    );
    let lock_dir = config.lock_file.parent().unwrap().to_str().unwrap();
    let mount = c
        .volume_mounts
        .as_ref()
        .unwrap()
        .iter()
        .find(|m| m.mount_path == lock_dir)
        .expect("the lock file's directory is mounted");
    assert_ne!(mount.read_only, Some(true));
    let volume = pod
        .volumes
        .as_ref()
        .unwrap()
        .iter()
        .find(|v| v.name == mount.name)
        .unwrap();
    assert_eq!(volume.host_path.as_ref().unwrap().path, lock_dir);
    let unit = include_str!("../systemd/nodeproxy.service");
    assert!(
        unit.lines().any(|l| l == "RuntimeDirectory=nodeproxy") && lock_dir == "/run/nodeproxy",
        "the unit's RuntimeDirectory is the DaemonSet's hostPath"
    );

    // Probes: /livez and /healthz on the health server's port.
    let healthz = config.healthz_bind_address.unwrap();
    let probe_port = |p: &k8s_openapi::api::core::v1::Probe| {
        let get = p.http_get.as_ref().unwrap();
        let port = match &get.port {
            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(n) => *n,
            other => panic!("a named port on a host-network pod: {other:?}"),
        };
        (get.path.clone().unwrap(), port)
    };
    assert_eq!(
        probe_port(c.liveness_probe.as_ref().unwrap()),
        ("/livez".to_owned(), i32::from(healthz.port()))
    );
    assert_eq!(
        probe_port(c.readiness_probe.as_ref().unwrap()),
        ("/healthz".to_owned(), i32::from(healthz.port()))
    );
}

/// What one API request needs from RBAC: verb, API group, resource.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Need {
    verb: String,
    group: String,
    resource: String,
}

/// Maps a request line (`METHOD /path?query`) to the RBAC verb, group and resource the API
/// server's authorizer would check.
fn need(request: &str) -> Need {
    let (method, target) = request.split_once(' ').unwrap();
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, rest) = match parts.as_slice() {
        ["api", "v1", rest @ ..] => (String::new(), rest),
        ["apis", group, _version, rest @ ..] => ((*group).to_owned(), rest),
        _ => panic!("not a resource request: {request}"),
    };
    let rest = match rest {
        ["namespaces", _ns, rest @ ..] if !rest.is_empty() => rest,
        other => other,
    };
    let (resource, named) = match rest {
        [resource] => (*resource, false),
        [resource, _name] => (*resource, true),
        _ => panic!("an unexpected resource path: {request}"),
    };
    let watch = query
        .split('&')
        .any(|kv| kv == "watch=true" || kv == "watch=1");
    let verb = match (method, named, watch) {
        ("GET", _, true) => "watch",
        ("GET", false, false) => "list",
        ("GET", true, false) => "get",
        ("POST", _, _) => "create",
        ("PATCH", _, _) => "patch",
        ("PUT", _, _) => "update",
        ("DELETE", true, _) => "delete",
        ("DELETE", false, _) => "deletecollection",
        _ => panic!("an unexpected method: {request}"),
    };
    Need {
        verb: verb.to_owned(),
        group,
        resource: resource.to_owned(),
    }
}

fn allows(rule: &PolicyRule, need: &Need) -> bool {
    let has = |list: &Option<Vec<String>>, want: &str| {
        list.as_ref()
            .is_some_and(|l| l.iter().any(|x| x == want || x == "*"))
    };
    has(&Some(rule.verbs.clone()), &need.verb)
        && has(&rule.api_groups, &need.group)
        && has(&rule.resources, &need.resource)
        && rule.resource_names.is_none()
}

fn role_rules() -> Vec<PolicyRule> {
    let docs = documents();
    let role: ClusterRole = round_trip(find(&docs, "ClusterRole"));
    role.rules.unwrap()
}

#[test]
fn the_request_mapping_and_the_role_check_refuse_what_is_not_granted() {
    let rules = role_rules();
    let allowed = |r: &str| rules.iter().any(|rule| allows(rule, &need(r)));
    assert!(allowed("GET /api/v1/services?labelSelector=x"));
    assert!(allowed("GET /api/v1/services?watch=true&resourceVersion=1"));
    assert!(allowed("GET /api/v1/nodes/node-a"));
    assert!(allowed("POST /api/v1/namespaces/default/events"));
    assert!(allowed(
        "PATCH /apis/events.k8s.io/v1/namespaces/default/events/e1"
    ));
    assert!(!allowed("GET /api/v1/services/web"), "get on one Service");
    assert!(!allowed("GET /api/v1/secrets"));
    assert!(!allowed("GET /api/v1/endpoints"));
    assert!(!allowed("POST /api/v1/namespaces/ns/services"));
    assert!(!allowed("DELETE /api/v1/namespaces/default/events/e1"));
    assert!(!allowed("PATCH /api/v1/nodes/node-a"));
}

#[test]
fn the_cluster_role_allows_every_request_the_daemon_makes() {
    let requests = in_netns(|| {
        let out = Command::new("ip")
            .args(["link", "set", "lo", "up"])
            .output()
            .unwrap();
        assert!(out.status.success(), "ip link set lo up: {out:?}");
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let api = rt.block_on(FakeApi::start());
        let dir =
            std::env::temp_dir().join(format!("nodeproxy-manifest-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        api.apply(Kind::Node, node("node-a", "192.0.2.10"));
        api.apply(Kind::Service, service("ns", "web", "10.96.0.10", 80));
        api.apply(
            Kind::EndpointSlice,
            slice("ns", "web-1", "web", &["10.244.0.5"], 8080),
        );
        let mut d = Daemon::start(
            api.kubeconfig(),
            &dir,
            "daemon",
            &["--hostname-override", "node-a"],
        );
        let deadline = Instant::now() + PATIENCE;
        while !get(d.healthz, "/healthz")
            .is_some_and(|(c, b)| c == 200 && !b.contains("0001-01-01T00:00:00Z"))
        {
            assert!(Instant::now() < deadline, "no first sync:\n{}", d.log());
            std::thread::sleep(Duration::from_millis(50));
        }
        // Changes after the first sync, so that every watch has streamed something.
        api.apply(Kind::Service, service("ns", "web", "10.96.0.10", 81));
        api.apply(
            Kind::EndpointSlice,
            slice("ns", "web-1", "web", &["10.244.0.6"], 8080),
        );
        api.apply(Kind::Node, node("node-a", "192.0.2.11"));
        std::thread::sleep(Duration::from_secs(3));
        d.sigterm_and_wait();
        let requests = api.requests();
        drop(rt);
        let _ = std::fs::remove_dir_all(&dir);
        requests
    });

    let rules = role_rules();
    let needs: BTreeSet<Need> = requests.iter().map(|r| need(r)).collect();
    for r in &requests {
        let n = need(r);
        assert!(
            rules.iter().any(|rule| allows(rule, &n)),
            "the ClusterRole does not allow {n:?}, which the daemon requested: {r}"
        );
    }
    // The daemon's three watches were seen, so the check above covered them.
    for (group, resource) in [
        ("", "services"),
        ("discovery.k8s.io", "endpointslices"),
        ("", "nodes"),
    ] {
        for verb in ["list", "watch"] {
            assert!(
                needs.contains(&Need {
                    verb: verb.into(),
                    group: group.into(),
                    resource: resource.into()
                }),
                "no {verb} of {resource} among {requests:?}"
            );
        }
    }
    // The daemon records its Node's `Starting` Event at start-up, so creating Events was
    // checked above too.
    assert!(
        needs.contains(&Need {
            verb: "create".into(),
            group: "events.k8s.io".into(),
            resource: "events".into()
        }),
        "no Event created among {requests:?}"
    );
    // Nothing granted that the daemon does not use, except what kube-proxy's
    // system:node-proxier grants for Events (patching one, which the daemon does only when it
    // repeats; the core group's Events) and `get` on nodes, which kube-proxy's role grants for
    // reading its own Node.
    for rule in &rules {
        for verb in &rule.verbs {
            for group in rule.api_groups.as_deref().unwrap_or_default() {
                for resource in rule.resources.as_deref().unwrap_or_default() {
                    let granted = Need {
                        verb: verb.clone(),
                        group: group.clone(),
                        resource: resource.clone(),
                    };
                    let kube_proxy_parity = resource == "events"
                        && ["create", "patch"].contains(&verb.as_str())
                        || resource == "nodes" && verb == "get";
                    assert!(
                        needs.contains(&granted) || kube_proxy_parity,
                        "the ClusterRole grants {granted:?}, which the daemon never used"
                    );
                }
            }
        }
    }
}
