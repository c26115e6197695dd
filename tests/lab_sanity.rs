//! Proves the namespace lab itself works, without nodeproxy: routing between pods and nodes,
//! the client on the LAN, error classification, and cleanup.

mod lab;

use lab::{Lab, Ns, Proto};

#[test]
fn pod_reaches_pod_on_the_other_node_over_tcp_and_sees_the_pod_source() {
    let mut lab = Lab::new();
    lab.spawn_server(Ns::PodB1, Proto::Tcp, 8080, "b1");
    for v6 in [false, true] {
        let got = lab.request(Ns::PodA1, Proto::Tcp, Ns::PodB1.addr(v6), 8080);
        assert_eq!(
            got,
            Ok(("b1".to_string(), Ns::PodA1.addr(v6).to_string())),
            "v6={v6}"
        );
    }
}

#[test]
fn pod_reaches_pod_on_the_other_node_over_udp_and_sees_the_pod_source() {
    let mut lab = Lab::new();
    lab.spawn_server(Ns::PodB1, Proto::Udp, 5353, "b1");
    for v6 in [false, true] {
        let got = lab.request(Ns::PodA1, Proto::Udp, Ns::PodB1.addr(v6), 5353);
        assert_eq!(
            got,
            Ok(("b1".to_string(), Ns::PodA1.addr(v6).to_string())),
            "v6={v6}"
        );
    }
}

#[test]
fn pods_on_the_same_node_reach_each_other() {
    let mut lab = Lab::new();
    lab.spawn_server(Ns::PodA2, Proto::Tcp, 8080, "a2");
    for v6 in [false, true] {
        let got = lab.request(Ns::PodA1, Proto::Tcp, Ns::PodA2.addr(v6), 8080);
        assert_eq!(
            got,
            Ok(("a2".to_string(), Ns::PodA1.addr(v6).to_string())),
            "v6={v6}"
        );
    }
}

#[test]
fn client_pings_node_a_on_its_lan_addresses() {
    let lab = Lab::new();
    for addr in [Ns::NodeA.v4().to_string(), Ns::NodeA.v6().to_string()] {
        lab.exec_ok(Ns::Client, &["ping", "-c", "1", "-W", "2", &addr]);
    }
}

#[test]
fn client_reaches_a_server_on_node_b_and_a_pod_is_reached_from_the_other_node() {
    let mut lab = Lab::new();
    lab.spawn_server(Ns::NodeB, Proto::Tcp, 9000, "node-b");
    lab.spawn_server(Ns::PodA1, Proto::Tcp, 8080, "a1");
    for v6 in [false, true] {
        let got = lab.request(Ns::Client, Proto::Tcp, Ns::NodeB.addr(v6), 9000);
        assert_eq!(
            got,
            Ok(("node-b".to_string(), Ns::Client.addr(v6).to_string())),
            "v6={v6}"
        );
        // node-b → pod-a1 crosses the LAN via node-a and uses node-b's LAN address as source.
        let got = lab.request(Ns::NodeB, Proto::Tcp, Ns::PodA1.addr(v6), 8080);
        assert_eq!(
            got,
            Ok(("a1".to_string(), Ns::NodeB.addr(v6).to_string())),
            "v6={v6}"
        );
    }
}

#[test]
fn a_closed_port_is_refused_and_an_unrouted_address_times_out() {
    let lab = Lab::new();
    for (proto, v6) in [
        (Proto::Tcp, false),
        (Proto::Tcp, true),
        (Proto::Udp, false),
        (Proto::Udp, true),
    ] {
        let started = std::time::Instant::now();
        let got = lab.request(Ns::PodA1, proto, Ns::PodB1.addr(v6), 7);
        assert_eq!(
            got,
            Err("connection refused".to_string()),
            "{proto:?} v6={v6}"
        );
        assert!(
            started.elapsed() < std::time::Duration::from_millis(1500),
            "refusal took {:?}",
            started.elapsed()
        );
    }
    // The client has no route to ClusterIPs: a request to one gets no answer at all.
    let got = lab.request(Ns::Client, Proto::Tcp, "203.0.113.10".parse().unwrap(), 80);
    assert!(
        got.is_err(),
        "client must not reach a ClusterIP without nodeproxy: {got:?}"
    );
    // A pod's ClusterIP packet goes to its node, which (without nodeproxy) forwards it to the
    // absent LAN router: no answer.
    let got = lab.request(Ns::PodA1, Proto::Tcp, "203.0.113.10".parse().unwrap(), 80);
    assert_eq!(got, Err("timeout".to_string()));
}

#[test]
fn dropping_the_lab_deletes_all_its_namespaces_and_processes() {
    let mut lab = Lab::new();
    lab.spawn_server(Ns::PodA1, Proto::Tcp, 8080, "a1");
    let names = lab.ns_names();
    assert_eq!(names.len(), Ns::ALL.len());
    let pids = String::from_utf8(
        std::process::Command::new("ip")
            .args(["netns", "pids", &lab.ns(Ns::PodA1)])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    let pids: Vec<String> = pids.split_whitespace().map(String::from).collect();
    assert!(!pids.is_empty(), "the server should run in pod-a1");
    drop(lab);
    let out = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()
        .unwrap();
    let listing = String::from_utf8_lossy(&out.stdout);
    for name in &names {
        assert!(
            !listing
                .lines()
                .any(|l| l.split_whitespace().next() == Some(name)),
            "{name} still exists after drop:\n{listing}"
        );
    }
    for pid in &pids {
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "process {pid} from the lab still runs"
        );
    }
}

#[test]
fn a_panicking_test_still_cleans_up_its_lab() {
    let names = std::sync::Mutex::new(Vec::new());
    let result = std::panic::catch_unwind(|| {
        let lab = Lab::new();
        *names.lock().unwrap() = lab.ns_names();
        panic!("deliberate");
    });
    assert!(result.is_err());
    let names = names.into_inner().unwrap();
    assert!(!names.is_empty());
    let out = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()
        .unwrap();
    let listing = String::from_utf8_lossy(&out.stdout);
    for name in &names {
        assert!(
            !listing.contains(name.as_str()),
            "{name} leaked after a panic"
        );
    }
}
