//! Events where the Service's owner looks, end to end: the real daemon against the fake API
//! server (`tests/fakeapi`) in a network namespace of its own, the real kernel made to refuse
//! one Service's objects by the test-only switch `NODEPROXY_TEST_KERNEL_REJECT_PORT` (see
//! `src/nft/fault.rs`). Checks the Events the API server receives: the Node's `Starting`, the
//! Warning on a quarantined Service naming what the kernel refused, the Normal one once the
//! Service is fixed, and the rate limit under a Service that flaps. Root is required: without
//! it the test fails, it never skips.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
mod fakeapi;

use std::process::Command;
use std::time::Duration;

use common::daemon::{Daemon, get, wait_for};
use common::netns::{in_netns, nft};
use fakeapi::{FakeApi, Kind, node};
use serde_json::{Value, json};

/// The port name the kernel is made to refuse.
const REFUSED: &str = "kernel-rejects";
/// `PER_OBJECT_BURST` in src/daemon/events.rs: what one object gets before the rate limit's
/// slow refill (one per five minutes) applies.
const PER_OBJECT_BURST: usize = 5;

/// A ClusterIP Service (documentation addresses) with one TCP port named `port`.
fn service(name: &str, cluster_ip: &str, port: &str) -> Value {
    json!({"metadata": {"namespace": "shop", "name": name, "uid": format!("uid-{name}")},
           "spec": {"type": "ClusterIP", "clusterIP": cluster_ip, "clusterIPs": [cluster_ip],
                    "ports": [{"name": port, "protocol": "TCP", "port": 80,
                               "targetPort": 8080}]}})
}

/// The Event writes (POST or PATCH, with the Event after it) regarding `kind` `name`.
fn writes_about(api: &FakeApi, kind: &str, name: &str) -> Vec<(String, Value)> {
    api.event_writes()
        .into_iter()
        .filter(|(_, e)| e["regarding"]["kind"] == kind && e["regarding"]["name"] == name)
        .collect()
}

/// The first Event about `kind` `name` with `reason`, once the API server has one.
fn wait_event(api: &FakeApi, kind: &str, name: &str, reason: &str) -> Value {
    wait_for(&format!("an Event {reason} on {kind} {name}"), || {
        let writes = writes_about(api, kind, name);
        writes
            .iter()
            .find(|(_, e)| e["reason"] == reason)
            .map(|(_, e)| e.clone())
            .ok_or(writes)
    })
}

fn metric(d: &Daemon, series: &str) -> f64 {
    get(d.metrics, "/metrics")
        .and_then(|(_, text)| {
            text.lines()
                .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        })
        .unwrap_or(0.0)
}

fn table() -> String {
    nft(&["list", "table", "ip", "nodeproxy"])
}

#[test]
fn a_refused_service_gets_a_warning_and_a_normal_event_when_fixed_and_flapping_is_rate_limited() {
    in_netns(|| {
        let out = Command::new("ip")
            .args(["link", "set", "lo", "up"])
            .output()
            .unwrap();
        assert!(out.status.success(), "ip link set lo up: {out:?}");
        let dir = std::env::temp_dir().join(format!("nodeproxy-events-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let api = rt.block_on(FakeApi::start());
        api.apply(Kind::Node, node("node-a", "192.0.2.10"));
        api.apply(Kind::Service, service("bad", "203.0.113.10", REFUSED));
        api.apply(Kind::Service, service("flappy", "203.0.113.20", "http"));
        let d = Daemon::start_with_env(
            api.kubeconfig(),
            &dir,
            "daemon",
            &["--hostname-override", "node-a"],
            &[("NODEPROXY_TEST_KERNEL_REJECT_PORT", REFUSED.as_ref())],
        );
        wait_for("the daemon's first sync", || {
            d.last_sync().filter(|&t| t > 0.0).ok_or("no sync yet")
        });

        // The Node: Normal, Starting, as kube-proxy records it (in "default", uid = name).
        let start = wait_event(&api, "Node", "node-a", "Starting");
        assert_eq!(start["type"], "Normal", "{start}");
        assert_eq!(
            start["note"],
            format!("Starting nodeproxy {}.", env!("CARGO_PKG_VERSION"))
        );
        assert_eq!(start["metadata"]["namespace"], "default", "{start}");
        assert_eq!(start["regarding"]["uid"], "node-a", "{start}");
        assert_eq!(start["reportingController"], "nodeproxy", "{start}");
        assert_eq!(start["reportingInstance"], "node-a", "{start}");

        // The refused Service: a Warning on it, naming the object and the kernel's error.
        let warning = wait_event(&api, "Service", "bad", "KernelRejected");
        assert_eq!(warning["type"], "Warning", "{warning}");
        assert_eq!(
            warning["regarding"],
            json!({"apiVersion": "v1", "kind": "Service", "namespace": "shop", "name": "bad",
                   "uid": "uid-bad"})
        );
        assert_eq!(warning["metadata"]["namespace"], "shop", "{warning}");
        assert_eq!(warning["reportingController"], "nodeproxy", "{warning}");
        assert_eq!(warning["reportingInstance"], "node-a", "{warning}");
        let note = warning["note"].as_str().unwrap();
        for part in [
            "node node-a",
            "add element element 203.0.113.10 . tcp . 80 : goto nodeproxy-test-no-such-chain",
            "No such file or directory",
            "quarantined",
        ] {
            assert!(note.contains(part), "{part:?} not in the note {note:?}");
        }
        assert!(!table().contains("203.0.113.10"), "{}", table());
        assert!(table().contains("203.0.113.20"), "{}", table());

        // Fixed: programmed again, and a Normal Event says so.
        api.apply(Kind::Service, service("bad", "203.0.113.10", "http"));
        let fixed = wait_event(&api, "Service", "bad", "Programmed");
        assert_eq!(fixed["type"], "Normal", "{fixed}");
        assert_eq!(fixed["regarding"]["uid"], "uid-bad", "{fixed}");
        assert!(
            fixed["note"].as_str().unwrap().contains("node node-a"),
            "{fixed}"
        );
        wait_for("shop/bad is programmed", || {
            let t = table();
            if t.contains("203.0.113.10") {
                Ok(())
            } else {
                Err(t)
            }
        });
        assert_eq!(writes_about(&api, "Service", "bad").len(), 2);

        // Flapping: refused and fixed over and over, one sync each.
        let syncs = |d: &Daemon| d.last_sync().unwrap_or(0.0);
        for i in 0..20 {
            let port = if i % 2 == 0 { REFUSED } else { "http" };
            let before = syncs(&d);
            api.apply(Kind::Service, service("flappy", "203.0.113.20", port));
            wait_for("a sync after the change", || {
                if syncs(&d) > before {
                    Ok(())
                } else {
                    Err(before)
                }
            });
        }
        // What the publisher still had queued arrives; the limit holds the rest back.
        std::thread::sleep(Duration::from_secs(3));
        let flapping = writes_about(&api, "Service", "flappy");
        assert!(
            !flapping.is_empty() && flapping.len() <= PER_OBJECT_BURST,
            "{} Event writes about the flapping Service: {flapping:#?}",
            flapping.len()
        );
        assert!(
            flapping
                .iter()
                .any(|(_, e)| e["reason"] == "KernelRejected"),
            "{flapping:#?}"
        );
        let dropped = metric(
            &d,
            "nodeproxy_events_dropped_total{reason=\"rate_limited\"}",
        );
        assert!(dropped >= 1.0, "no Event counted as rate-limited");
        assert_eq!(
            metric(
                &d,
                "nodeproxy_events_dropped_total{reason=\"publish_failed\"}"
            ),
            0.0,
            "{}",
            d.log()
        );
        // The other objects kept their own budget.
        assert_eq!(writes_about(&api, "Service", "bad").len(), 2);
        assert_eq!(writes_about(&api, "Node", "node-a").len(), 1);

        drop(d);
        drop(api);
        drop(rt);
        let _ = std::fs::remove_dir_all(&dir);
    });
}
