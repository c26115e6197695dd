//! What the scale benches (`daemon`, `soak`) share: the generated cluster (N Services × M
//! endpoints), reading a process's CPU time and memory from `/proc`, scraping the daemon's
//! metrics, and killing child processes on every exit path.

#![allow(dead_code)]

use std::net::Ipv4Addr;
use std::process::Child;
use std::time::Duration;

use serde_json::{Value, json};

pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// `1s`, `500ms`, `30s`: the durations the benches pass to the daemon's flags.
pub fn duration_arg(text: &str) -> Duration {
    match text.strip_suffix("ms") {
        Some(ms) => Duration::from_secs_f64(ms.parse::<f64>().unwrap() / 1e3),
        None => Duration::from_secs_f64(text.trim_end_matches('s').parse::<f64>().unwrap()),
    }
}

/// Service `s` of the generated cluster (as `examples/gen_cluster.rs` writes it): ClusterIP
/// 10.96.0.0 + 1 + s, port 80 → 8080; every fourth is a NodePort (while the NodePort range
/// lasts).
pub fn service(s: usize) -> Value {
    let ip = Ipv4Addr::from(0x0A60_0000u32 + 1 + u32::try_from(s).unwrap()).to_string();
    let mut port = json!({"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080});
    // As long as the NodePort range lasts (examples/gen_cluster.rs says why).
    let kind = if s.is_multiple_of(4) && s / 4 < 2768 {
        port["nodePort"] = json!(30000 + s / 4);
        "NodePort"
    } else {
        "ClusterIP"
    };
    // A uid and a creation time, as the API server gives every object: the model keeps both.
    json!({"apiVersion": "v1", "kind": "Service",
           "metadata": {"namespace": format!("ns{}", s % 100), "name": format!("svc{s}"),
                        "uid": format!("{s:08x}-5e4f-4c1a-9d2b-{s:012x}"),
                        "creationTimestamp": "2026-01-01T00:00:00Z"},
           "spec": {"type": kind, "clusterIP": ip, "clusterIPs": [ip], "ports": [port]}})
}

/// The slice of service `s`, its first endpoint replaced by `first` if given.
pub fn slice(s: usize, endpoints: usize, first: Option<Ipv4Addr>) -> Value {
    let eps: Vec<Value> = (0..endpoints)
        .map(|e| {
            let slot = s * endpoints + e;
            let addr = match first {
                Some(a) if e == 0 => a,
                _ => Ipv4Addr::from(0x0A80_0000u32 + u32::try_from(slot).unwrap()),
            };
            let node = if slot.is_multiple_of(1000) {
                "node-a".to_owned()
            } else {
                format!("node-{}", slot % 1000)
            };
            json!({"addresses": [addr.to_string()], "conditions": {"ready": true}, "nodeName": node})
        })
        .collect();
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
           "metadata": {"namespace": format!("ns{}", s % 100), "name": format!("svc{s}-abcde"),
                        "labels": {"kubernetes.io/service-name": format!("svc{s}")}},
           "addressType": "IPv4",
           "ports": [{"name": "http", "protocol": "TCP", "port": 8080}],
           "endpoints": eps})
}

/// The Node the daemon runs as.
pub fn node_a() -> Value {
    json!({"apiVersion": "v1", "kind": "Node",
           "metadata": {"name": "node-a"}, "spec": {"podCIDRs": ["10.128.0.0/24"]},
           "status": {"addresses": [{"type": "InternalIP", "address": "192.0.2.11"}]}})
}

/// utime + stime of `pid`, in seconds.
pub fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    // USER_HZ is 100 on Linux.
    ticks as f64 / 100.0
}

pub fn status_field(pid: u32, field: &str) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(field))
        .map(|l| l[field.len()..].trim().to_owned())
        .unwrap_or_default()
}

/// A `/proc/<pid>/status` size field (`VmRSS:`, `VmHWM:`) in KiB.
pub fn status_kib(pid: u32, field: &str) -> u64 {
    status_field(pid, field)
        .trim_end_matches("kB")
        .trim()
        .parse()
        .unwrap_or(0)
}

/// The daemon's `/metrics` text, empty when it does not answer.
pub fn scrape(metrics: u16) -> String {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", metrics)) else {
        return String::new();
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    );
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    text
}

/// The sum over every line of metric `name` (all label sets) in a scrape.
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        // Not `sum()`: an empty f64 sum is -0.0, which prints as "-0".
        .fold(0.0, |a, b| a + b)
}

/// When the last successful sync ended (seconds since the epoch; 0 before the first).
pub fn last_sync(metrics: u16) -> f64 {
    scrape(metrics)
        .lines()
        .filter(|l| l.starts_with("kubeproxy_sync_proxy_rules_last_timestamp_seconds"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .fold(0.0, f64::max)
}

pub struct Killed(pub Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
