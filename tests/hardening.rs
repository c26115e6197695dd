//! The careless-operator findings of the hardening review, each as the command that showed it:
//! an empty input must not wipe the node, `--once` and `--cleanup` take the node lock, input
//! files are read up to a bound, and error messages say each thing once and briefly.
//!
//! Kernel cases run `--once` in a network namespace the test creates (root required; they
//! fail, never skip, without it).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::netns::{in_netns, lock_file_for_this_netns, nft};
use common::scratch::{Scratch, nodeproxy};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn fixture(case: &str) -> String {
    root()
        .join(format!("tests/fixtures/golden/{case}.yaml"))
        .to_string_lossy()
        .into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn tables() -> String {
    nft(&["list", "tables"])
}

#[test]
fn an_input_without_services_is_refused_unless_allowed_and_leaves_the_rules_in_place() {
    let scratch = Scratch::new("hardening", "empty");
    let inputs = [
        scratch.file("empty.yaml", ""),
        scratch.file("separator.yaml", "---\n"),
        scratch.file("null.yaml", "null\n"),
        scratch.file("empty.json", ""),
        scratch.file(
            "nodes-only.yaml",
            "apiVersion: v1\nkind: Node\nmetadata: {name: node-a}\n",
        ),
    ];
    let lock = scratch.0.join("dry.lock");
    for input in &inputs {
        let out = nodeproxy(&["--dry-run", "--from-file", input], &lock);
        assert_eq!(out.status.code(), Some(2), "{input}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("found no usable Service")
                && stderr(&out).contains("--allow-empty"),
            "{input}: {}",
            stderr(&out)
        );
        let out = nodeproxy(&["--dry-run", "--allow-empty", "--from-file", input], &lock);
        assert_eq!(out.status.code(), Some(0), "{input}: {}", stderr(&out));
    }
    // Only rejected Services: still nothing to program, and the message counts the rejections.
    let bad = scratch.file(
        "rejected.yaml",
        "apiVersion: v1\nkind: Service\nmetadata: {namespace: a, name: b}\nspec:\n  \
         clusterIP: 10.96.0.1\n  ports: [{port: 70000}]\n",
    );
    let out = nodeproxy(&["--dry-run", "--from-file", &bad], &lock);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("1 object(s) rejected"),
        "{}",
        stderr(&out)
    );

    let empty = inputs[0].clone();
    let (after_refusal, after_allowed) = in_netns(move || {
        let lock = lock_file_for_this_netns();
        let out = nodeproxy(&["--once", "--from-file", &fixture("clusterip")], &lock);
        assert!(out.status.success(), "{}", stderr(&out));
        let before = nft(&["list", "table", "ip", "nodeproxy"]);
        assert!(before.contains("203.0.113.20"), "{before}");
        let out = nodeproxy(&["--once", "--from-file", &empty], &lock);
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        let after_refusal = nft(&["list", "table", "ip", "nodeproxy"]);
        let out = nodeproxy(&["--once", "--allow-empty", "--from-file", &empty], &lock);
        assert!(out.status.success(), "{}", stderr(&out));
        let after_allowed = nft(&["list", "table", "ip", "nodeproxy"]);
        let _ = std::fs::remove_file(&lock);
        (after_refusal, after_allowed)
    });
    assert!(
        after_refusal.contains("203.0.113.20"),
        "a refused empty input changed the rules:\n{after_refusal}"
    );
    assert!(
        !after_allowed.contains("203.0.113.20"),
        "--allow-empty did not program the empty input:\n{after_allowed}"
    );
}

#[test]
fn once_and_cleanup_take_the_node_lock_first() {
    let (once_out, cleanup_out, tables_after) = in_netns(|| {
        let lock = lock_file_for_this_netns();
        // Another nodeproxy: the lock held by this (test) process.
        let guard = nodeproxy::lock::acquire(&lock).expect("take the lock");
        let once_out = nodeproxy(&["--once", "--from-file", &fixture("clusterip")], &lock);
        let programmed = tables();
        drop(guard);
        // The same run without the competitor programs the table; --cleanup is then refused
        // while the lock is held again, and deletes nothing.
        let out = nodeproxy(&["--once", "--from-file", &fixture("clusterip")], &lock);
        assert!(out.status.success(), "{}", stderr(&out));
        let guard = nodeproxy::lock::acquire(&lock).expect("take the lock");
        let cleanup_out = nodeproxy(&["--cleanup"], &lock);
        let tables_after = tables();
        drop(guard);
        assert!(
            !programmed.contains("nodeproxy"),
            "--once programmed while another process held the lock:\n{programmed}"
        );
        let _ = std::fs::remove_file(&lock);
        (once_out, cleanup_out, tables_after)
    });
    let pid = format!("pid {}", std::process::id());
    assert_eq!(once_out.status.code(), Some(1), "{}", stderr(&once_out));
    assert!(
        stderr(&once_out).contains("another nodeproxy holds the lock")
            && stderr(&once_out).contains(&pid),
        "{}",
        stderr(&once_out)
    );
    assert_eq!(
        cleanup_out.status.code(),
        Some(1),
        "{}",
        stderr(&cleanup_out)
    );
    assert!(
        stderr(&cleanup_out).contains("another nodeproxy holds the lock")
            && stderr(&cleanup_out).contains("nothing was deleted"),
        "{}",
        stderr(&cleanup_out)
    );
    assert!(
        tables_after.contains("table ip nodeproxy"),
        "--cleanup deleted while the lock was held:\n{tables_after}"
    );
}

#[test]
fn input_files_are_read_up_to_a_bound() {
    let scratch = Scratch::new("hardening", "bound");
    let lock = scratch.0.join("np.lock");
    let example = root().join("examples/cluster.yaml");
    let size = std::fs::metadata(&example).unwrap().len();
    let example = example.to_string_lossy().into_owned();
    let below = (size - 1).to_string();
    let out = nodeproxy(
        &[
            "--dry-run",
            "--max-input-size",
            &below,
            "--from-file",
            &example,
        ],
        &lock,
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(&format!("larger than {below} bytes (--max-input-size)")),
        "{}",
        stderr(&out)
    );
    let exact = size.to_string();
    let out = nodeproxy(
        &[
            "--dry-run",
            "--max-input-size",
            &exact,
            "--from-file",
            &example,
        ],
        &lock,
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));

    // An endless input stops at the bound (this would otherwise run until memory is gone).
    let out = nodeproxy(
        &[
            "--dry-run",
            "--max-input-size",
            "4Mi",
            "--from-file",
            "/dev/zero",
        ],
        &lock,
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("larger than 4194304 bytes"),
        "{}",
        stderr(&out)
    );

    for bad in ["0", "1Ti", "-5", "1.5Gi", "Gi", "99999999999999999999"] {
        let flag = format!("--max-input-size={bad}");
        let out = nodeproxy(&["--dry-run", &flag], &lock);
        assert_eq!(out.status.code(), Some(2), "{bad}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("--max-input-size"),
            "{bad}: {}",
            stderr(&out)
        );
    }
}

#[test]
fn a_missing_file_names_its_cause_once() {
    let scratch = Scratch::new("hardening", "missing");
    let lock = scratch.0.join("np.lock");
    let absent = scratch.0.join("absent.yaml").to_string_lossy().into_owned();
    let out = nodeproxy(&["--dry-run", "--from-file", &absent], &lock);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let text = stderr(&out);
    assert_eq!(
        text.matches("No such file or directory").count(),
        1,
        "{text}"
    );
    assert!(text.contains("absent.yaml"), "{text}");
}

#[test]
fn a_huge_bad_value_is_shown_shortened() {
    let scratch = Scratch::new("hardening", "huge");
    let huge = "9".repeat(100_000);
    let out = Command::new(env!("CARGO_BIN_EXE_nodeproxy"))
        .env_remove("NODEPROXY_CONFIG")
        .env("NODEPROXY_MASQUERADE_BIT", &huge)
        .env("NODEPROXY_LOCK_FILE", scratch.0.join("np.lock"))
        .arg("--print-config")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let text = stderr(&out);
    assert!(text.len() < 1000, "{} bytes of error", text.len());
    assert!(text.contains("(100000 bytes in all)"), "{text}");
    assert!(text.contains("NODEPROXY_MASQUERADE_BIT"), "{text}");
}

#[test]
fn control_characters_in_object_text_are_rejected_and_never_printed_raw() {
    let scratch = Scratch::new("hardening", "controls");
    let lock = scratch.0.join("np.lock");
    // JSON escapes put the control characters into names, a port name, a zone, a hint and a
    // kind; one valid Service shows the rest is still used.
    let objects = r#"{"apiVersion": "v1", "kind": "List", "items": [
      {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"},
       "status": {"addresses": [{"type": "InternalIP", "address": "192.0.2.11"}]}},
      {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-b",
       "labels": {"topology.kubernetes.io/zone": "zone\u0000b"}}},
      {"apiVersion": "v1", "kind": "Service", "metadata": {"namespace": "shop", "name": "ok"},
       "spec": {"clusterIP": "203.0.113.20", "ports": [{"port": 80, "protocol": "TCP"}]}},
      {"apiVersion": "v1", "kind": "Service",
       "metadata": {"namespace": "shop", "name": "web\n2026-11-25T00:00:00Z  INFO forged line"},
       "spec": {"clusterIP": "203.0.113.21", "ports": [{"port": 80, "protocol": "TCP"}]}},
      {"apiVersion": "v1", "kind": "Service", "metadata": {"namespace": "sh\u001b[31mop", "name": "a"},
       "spec": {"clusterIP": "203.0.113.22", "ports": [{"port": 80, "protocol": "TCP"}]}},
      {"apiVersion": "v1", "kind": "Service", "metadata": {"namespace": "shop", "name": "b"},
       "spec": {"clusterIP": "203.0.113.23", "ports": [{"name": "h\rttp", "port": 80}]}},
      {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
       "metadata": {"namespace": "shop", "name": "ok-1",
                    "labels": {"kubernetes.io/service-name": "ok"}},
       "addressType": "IPv4", "ports": [{"port": 8080, "protocol": "TCP"}],
       "endpoints": [{"addresses": ["198.51.100.10"], "zone": "z\u001b]0;pwned\u0007",
                      "hints": {"forZones": [{"name": "z\n1"}]}}]},
      {"apiVersion": "v1", "kind": "Con\nfigMap", "metadata": {"namespace": "x", "name": "y"}}
    ]}"#;
    let input = scratch.file("objects.json", objects);
    let out = nodeproxy(
        &[
            "--dry-run",
            "-v",
            "--from-file",
            &input,
            "--cluster-cidr",
            "198.51.100.0/24",
        ],
        &lock,
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let (text, ruleset) = (
        stderr(&out),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    );
    for (what, printed) in [("stderr", &text), ("stdout", &ruleset)] {
        for c in ['\u{0}', '\u{1b}', '\r', '\u{7}'] {
            assert!(!printed.contains(c), "{what} holds {c:?}:\n{printed}");
        }
    }
    assert!(
        !text
            .lines()
            .any(|l| l.contains("INFO forged line") && !l.contains("skipped")),
        "a name forged a log line:\n{text}"
    );
    for escaped in [
        r"web\n2026-11-25T00:00:00Z",
        r"sh\u{1b}[31mop",
        r"h\rttp",
        r"zone\u{0}b",
        r"z\u{1b}]0;pwned\u{7}",
        r"Con\nfigMap",
    ] {
        assert!(
            text.contains(escaped),
            "{escaped} not reported escaped:\n{text}"
        );
    }
    // The valid Service is programmed; the rejected ones are not.
    assert!(ruleset.contains("203.0.113.20"), "{ruleset}");
    for ip in ["203.0.113.21", "203.0.113.22", "203.0.113.23"] {
        assert!(!ruleset.contains(ip), "{ip} programmed:\n{ruleset}");
    }
}

#[test]
fn messages_say_what_is_wrong_once_at_the_right_level() {
    let scratch = Scratch::new("hardening", "messages");
    let lock = scratch.0.join("np.lock");
    let example = root()
        .join("examples/cluster.yaml")
        .to_string_lossy()
        .into_owned();

    // No way to reach an API server: a configuration error (2), said once.
    let out = Command::new(env!("CARGO_BIN_EXE_nodeproxy"))
        .env_remove("NODEPROXY_CONFIG")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("KUBERNETES_SERVICE_PORT")
        .env("NODEPROXY_LOCK_FILE", &lock)
        .args(["--dry-run", "--hostname-override", "node-a"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let text = stderr(&out);
    assert_eq!(text.matches("no --kubeconfig").count(), 1, "{text}");
    assert_eq!(
        text.matches("environment variable not found").count(),
        1,
        "{text}"
    );

    // The same Service in two files: the replacement is a warning, not a debug note.
    let again = scratch.file(
        "again.yaml",
        "apiVersion: v1\nkind: Service\nmetadata: {namespace: default, name: kubernetes}\n\
         spec:\n  clusterIP: 10.96.0.1\n  ports: [{name: https, port: 443, protocol: TCP}]\n",
    );
    let out = nodeproxy(
        &["--dry-run", "--from-file", &example, "--from-file", &again],
        &lock,
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stderr(&out)
            .lines()
            .any(|l| l.contains("WARN") && l.contains("defined again")),
        "{}",
        stderr(&out)
    );

    // A key given twice is an error naming it.
    let twice = scratch.file(
        "twice.yaml",
        "apiVersion: v1\nkind: Service\nmetadata: {namespace: a, name: b}\nspec:\n  \
         clusterIP: 10.96.0.1\n  clusterIP: 10.96.0.2\n  ports: [{port: 80}]\n",
    );
    let out = nodeproxy(&["--dry-run", "--from-file", &twice], &lock);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("duplicate key `clusterIP`"),
        "{}",
        stderr(&out)
    );

    // explain names an out-of-range port as such.
    let out = nodeproxy(
        &[
            "explain",
            "--from-file",
            &example,
            "10.244.1.5",
            "10.96.0.10:99999/udp",
        ],
        &lock,
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("port 99999 is out of range"),
        "{}",
        stderr(&out)
    );

    // A misspelt NODEPROXY_* variable is a warning naming the right one.
    let out = Command::new(env!("CARGO_BIN_EXE_nodeproxy"))
        .env_remove("NODEPROXY_CONFIG")
        .env("NODEPROXY_LOCK_FILE", &lock)
        .env("NODEPROXY_CLUSTER_CIRD", "10.244.0.0/16")
        .args([
            "--dry-run",
            "--hostname-override",
            "node-a",
            "--from-file",
            &example,
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stderr(&out).lines().any(|l| l.contains("WARN")
            && l.contains("NODEPROXY_CLUSTER_CIRD")
            && l.contains("did you mean NODEPROXY_CLUSTER_CIDR?")),
        "{}",
        stderr(&out)
    );
}

#[test]
fn special_addresses_and_the_nodes_own_are_never_programmed_as_service_addresses() {
    let scratch = Scratch::new("hardening", "special");
    let lock = scratch.0.join("np.lock");
    let svc = |name: &str, cluster_ip: &str, extra: &str| {
        format!(
            "- apiVersion: v1\n  kind: Service\n  metadata: {{namespace: shop, name: {name}}}\n  \
             spec:\n    clusterIP: \"{cluster_ip}\"\n    ports: [{{name: http, port: 80, \
             protocol: TCP, targetPort: 8080}}]\n{extra}"
        )
    };
    let mut text = String::from(
        "apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Node\n  metadata: \
         {name: node-a}\n  status:\n    addresses: [{type: InternalIP, address: 192.0.2.11}, \
         {type: InternalIP, address: \"2001:db8::11\"}]\n",
    );
    for (name, ip) in [
        ("loopback", "127.0.0.1"),
        ("unspecified", "0.0.0.0"),
        ("broadcast", "255.255.255.255"),
        ("multicast", "224.0.0.251"),
        ("linklocal", "169.254.169.254"),
        ("loopback6", "::1"),
        ("linklocal6", "fe80::1"),
    ] {
        text.push_str(&svc(name, ip, ""));
    }
    text.push_str(&svc("nodeaddress", "192.0.2.11", ""));
    text.push_str(&svc(
        "mixed",
        "203.0.113.30",
        "    externalIPs: [169.254.169.254, 203.0.113.60]\n  status:\n    loadBalancer:\n      \
         ingress: [{ip: 0.0.0.0}, {ip: 203.0.113.61}]\n",
    ));
    text.push_str(
        "- apiVersion: discovery.k8s.io/v1\n  kind: EndpointSlice\n  metadata:\n    namespace: \
         shop\n    name: mixed-1\n    labels: {kubernetes.io/service-name: mixed}\n  \
         addressType: IPv4\n  ports: [{name: http, port: 8080, protocol: TCP}]\n  endpoints:\n  \
         - addresses: [127.0.0.1]\n  - addresses: [198.51.100.10]\n",
    );
    let input = scratch.file("special.yaml", &text);
    let out = nodeproxy(&["--dry-run", "--from-file", &input], &lock);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let (log, ruleset) = (
        stderr(&out),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    );
    for (name, class) in [
        ("loopback", "loopback"),
        ("unspecified", "unspecified"),
        ("broadcast", "broadcast"),
        ("multicast", "multicast"),
        ("linklocal", "link-local"),
        ("loopback6", "loopback"),
        ("linklocal6", "link-local"),
    ] {
        assert!(
            log.lines().any(|l| l.contains("WARN")
                && l.contains(&format!("Service shop/{name}: spec.clusterIP"))
                && l.contains(class)),
            "no warning for shop/{name}:\n{log}"
        );
    }
    for ip in [
        "127.0.0.1",
        "0.0.0.0",
        "255.255.255.255",
        "224.0.0.251",
        "169.254.169.254",
        "::1",
        "fe80::1",
    ] {
        assert!(
            !ruleset.contains(&format!(" {ip} ")) && !ruleset.contains(&format!(" {ip} .")),
            "{ip} programmed:\n{ruleset}"
        );
    }
    // The node's own address as a ClusterIP: left out, with a warning.
    assert!(
        log.contains("Service shop/nodeaddress: ClusterIP 192.0.2.11 is an address of this node"),
        "{log}"
    );
    assert!(!ruleset.contains("192.0.2.11 . tcp . 80"), "{ruleset}");
    // The rest of `mixed` is used: its ClusterIP, the good externalIP and LB IP, the good
    // endpoint; each special address is reported as left out.
    for kept in [
        "203.0.113.30",
        "203.0.113.60",
        "203.0.113.61",
        "198.51.100.10",
    ] {
        assert!(ruleset.contains(kept), "{kept} missing:\n{ruleset}");
    }
    for field in [
        "spec.externalIPs[0]",
        "status.loadBalancer.ingress[0].ip",
        "endpoints[0].addresses[0]",
    ] {
        assert!(
            log.lines().any(|l| l.contains("WARN")
                && l.contains(field)
                && l.contains("left out; the rest of the object is used")),
            "no warning for {field}:\n{log}"
        );
    }
}

#[test]
fn a_cluster_ip_outside_the_service_cidr_is_a_warning() {
    let scratch = Scratch::new("hardening", "servicecidr");
    let lock = scratch.0.join("np.lock");
    let example = root()
        .join("examples/cluster.yaml")
        .to_string_lossy()
        .into_owned();
    let out = nodeproxy(
        &[
            "--dry-run",
            "--from-file",
            &example,
            "--service-cidr",
            "10.96.0.0/16,fd00:10:96::/112",
        ],
        &lock,
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        !stderr(&out).contains("outside --service-cidr"),
        "{}",
        stderr(&out)
    );
    let out = nodeproxy(
        &[
            "--dry-run",
            "--from-file",
            &example,
            "--service-cidr",
            "10.97.0.0/16",
        ],
        &lock,
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stderr(&out)
            .lines()
            .any(|l| l.contains("WARN") && l.contains("is outside --service-cidr (10.97.0.0/16)")),
        "{}",
        stderr(&out)
    );
}

#[test]
fn table_ownership_off_makes_ordinary_tables_that_nft_can_save_and_restore() {
    let (fresh_flags, reloaded, warning_out) = in_netns(|| {
        let lock = lock_file_for_this_netns();
        let once = |extra: &[&str]| {
            let mut args = vec!["--once", "--from-file"];
            let input = fixture("clusterip");
            args.push(&input);
            args.extend_from_slice(extra);
            nodeproxy(&args, &lock)
        };
        let out = once(&["--table-ownership", "off"]);
        assert!(out.status.success(), "{}", stderr(&out));
        assert!(
            stderr(&out).contains("table ownership: off"),
            "{}",
            stderr(&out)
        );
        let mut kernel = nodeproxy::nft::NetlinkKernel::new().unwrap();
        let fresh_flags: Vec<u32> = nodeproxy::model::IpFamily::ALL
            .iter()
            .map(|&f| kernel.table_info(f, "nodeproxy").unwrap().unwrap().flags)
            .collect();
        // The host's usual backup and restore: whatever nft prints, nft loads back.
        let saved = nft(&["list", "ruleset"]);
        nft(&["flush", "ruleset"]);
        let path = std::env::temp_dir().join(format!("np-ruleset-{}.nft", std::process::id()));
        std::fs::write(&path, &saved).unwrap();
        let loaded = Command::new("nft").arg("-f").arg(&path).output().unwrap();
        let _ = std::fs::remove_file(&path);
        assert!(loaded.status.success(), "{}\n{saved}", stderr(&loaded));
        let reloaded = nft(&["list", "table", "ip", "nodeproxy"]);
        // Tables left persistent by a run with ownership: `off` cannot clear the flag in place
        // and says how to start over.
        nft(&["delete", "table", "ip", "nodeproxy"]);
        nft(&["delete", "table", "ip6", "nodeproxy"]);
        let out = once(&[]);
        assert!(out.status.success(), "{}", stderr(&out));
        let warning_out = once(&["--table-ownership", "off"]);
        let _ = std::fs::remove_file(&lock);
        (fresh_flags, reloaded, warning_out)
    });
    assert_eq!(
        fresh_flags,
        vec![0, 0],
        "tables made with ownership off carry flags"
    );
    assert!(reloaded.contains("203.0.113.20"), "{reloaded}");
    assert!(warning_out.status.success(), "{}", stderr(&warning_out));
    let text = stderr(&warning_out);
    assert!(
        text.lines().any(|l| l.contains("WARN")
            && l.contains("still carries the persist flag")
            && l.contains("nodeproxy --cleanup")),
        "{text}"
    );
}

/// `explain` on the hijack fixture: (stderr, stdout).
fn explain_hijack(src: &str, dst: &str, lock: &Path) -> (String, String) {
    let input = root()
        .join("tests/fixtures/hardening/hijack.yaml")
        .to_string_lossy()
        .into_owned();
    let out = nodeproxy(
        &[
            "explain",
            "--cluster-cidr",
            "198.51.100.0/24",
            "--from-file",
            &input,
            src,
            dst,
        ],
        lock,
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    (
        stderr(&out),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn no_service_can_take_another_services_cluster_ip_and_clashes_are_not_decided_by_name() {
    let scratch = Scratch::new("hardening", "hijack");
    let lock = scratch.0.join("np.lock");
    // From a pod, from the node and from outside: every connection to shop/web's ClusterIP goes
    // to shop/web's endpoint, is neither dropped by aaa/steal-lb's source ranges nor rejected
    // for aaa/steal-empty's missing endpoints.
    for src in ["198.51.100.99", "192.0.2.11", "192.0.2.99"] {
        let (log, out) = explain_hijack(src, "203.0.113.20:80", &lock);
        assert!(
            out.contains("DNAT candidates (1):\n  198.51.100.10:8080  (shop/web:http)"),
            "from {src}:\n{out}"
        );
        assert!(out.contains("verdict: accept"), "from {src}:\n{out}");
        for thief in ["aaa/steal-ext", "aaa/steal-lb", "aaa/steal-empty"] {
            assert!(
                !out.contains(thief),
                "from {src}, {thief} is on the path:\n{out}"
            );
            assert!(
                log.lines().any(|l| l.contains("WARN")
                    && l.contains(&format!("Service {thief} claims"))
                    && l.contains("shop/web keeps it")),
                "no warning naming {thief} and shop/web:\n{log}"
            );
        }
    }
    // Two LB Services on one IP and port: the older keeps it though its name sorts later.
    let (log, out) = explain_hijack("192.0.2.99", "203.0.113.70:80", &lock);
    assert!(
        out.contains("DNAT candidates (1):\n  198.51.100.20:8080  (shop/old-lb:http)"),
        "{out}"
    );
    assert!(
        log.contains("Service aaa/new-lb claims load-balancer IP 203.0.113.70:80/tcp")
            && log.contains("shop/old-lb keeps it (created first)"),
        "{log}"
    );
    // The losers keep what is theirs (their own ClusterIPs) and hold no element for the keys
    // they lost, in any set or map.
    let input = root().join("tests/fixtures/hardening/hijack.yaml");
    let out = nodeproxy(
        &[
            "--dry-run",
            "--cluster-cidr",
            "198.51.100.0/24",
            "--from-file",
            &input.to_string_lossy(),
        ],
        &lock,
    );
    let ruleset = String::from_utf8_lossy(&out.stdout).into_owned();
    // Element by element. Endpoints maps' elements carry no comment: their endpoint says whose
    // they are.
    for line in ruleset.split([',', '\n', '{', '}']) {
        for (key, owner, endpoint) in [
            (
                "203.0.113.20 . tcp . 80",
                "shop/web",
                "198.51.100.10 . 8080",
            ),
            (
                "203.0.113.70 . tcp . 80",
                "shop/old-lb",
                "198.51.100.20 . 8080",
            ),
        ] {
            if line.contains(key) {
                let ours = if line.contains("comment") {
                    line.contains(&format!("comment \"{owner}:"))
                } else {
                    line.contains(&format!(": {endpoint}"))
                };
                assert!(ours, "an element for {key} not of {owner}: {line}");
            }
        }
    }
    assert!(ruleset.contains("203.0.113.21 . tcp . 80"), "{ruleset}");
}
