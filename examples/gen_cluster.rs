//! Generates a synthetic cluster (`kubectl get services,endpointslices,nodes -A -o json` shape)
//! with N services × M endpoints, for benchmarks.
//!
//! Usage: `cargo run --release --example gen_cluster -- N M [--change-endpoint]
//! [--add-service] > cluster.json`. `--change-endpoint` replaces the first endpoint of service 0;
//! `--add-service` adds service N. Every fourth service also gets a NodePort, as long as the
//! NodePort range lasts (the first 11072 services). Services carry a uid and a creation time,
//! as an API server's do (the model keeps both). No traffic is ever sent to these addresses:
//! they only size the ruleset.
//!
//! Endpoints are spread over 1000 nodes: kubelet runs at most 110 pods per node by default, so
//! 100k endpoints need at least 910 nodes. The proxy's own node (`node-a`) therefore hosts about
//! 0.1% of them, which is what sizes its hairpin set.

use std::io::Write;

/// An index as an address offset: the address ranges hold 2^32 addresses at most.
fn offset(n: usize) -> std::io::Result<u32> {
    u32::try_from(n).map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "the cluster is too large for the generator's address ranges",
        )
    })
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let num = |i: usize| -> std::io::Result<usize> {
        args.get(i).and_then(|s| s.parse().ok()).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "usage: gen_cluster N M [--change-endpoint] [--add-service]",
            )
        })
    };
    let services = num(0)?;
    let endpoints = num(1)?;
    let change_endpoint = args.iter().any(|a| a == "--change-endpoint");
    let add_service = args.iter().any(|a| a == "--add-service");
    let total = services + usize::from(add_service);

    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    writeln!(out, "{{\"apiVersion\":\"v1\",\"kind\":\"List\",\"items\":[")?;
    writeln!(
        out,
        "{{\"apiVersion\":\"v1\",\"kind\":\"Node\",\"metadata\":{{\"name\":\"node-a\"}},\
         \"spec\":{{\"podCIDRs\":[\"10.128.0.0/24\"]}},\
         \"status\":{{\"addresses\":[{{\"type\":\"InternalIP\",\"address\":\"192.0.2.11\"}}]}}}}"
    )?;
    for s in 0..total {
        // ClusterIPs from 10.96.0.0/12 and pod IPs from 10.128.0.0/9: large enough for 50k
        // services and millions of endpoints without collisions.
        let ip = 0x0A60_0000u32 + 1 + offset(s)?;
        let cluster_ip = std::net::Ipv4Addr::from(ip);
        // The NodePort range (30000-32767) holds 2768 ports per protocol and the API server
        // never gives one twice, so past 11072 Services there are no more NodePorts (a reused
        // one would be a contested key, which no real cluster has).
        let has_node_port = s % 4 == 0 && s / 4 < 2768;
        let node_port = if has_node_port {
            format!(",\"nodePort\":{}", 30000 + s / 4)
        } else {
            String::new()
        };
        let svc_type = if has_node_port {
            "NodePort"
        } else {
            "ClusterIP"
        };
        writeln!(
            out,
            ",{{\"apiVersion\":\"v1\",\"kind\":\"Service\",\"metadata\":{{\"namespace\":\"ns{}\",\"name\":\"svc{s}\",\
             \"uid\":\"{s:08x}-5e4f-4c1a-9d2b-{s:012x}\",\"creationTimestamp\":\"2026-01-01T00:00:00Z\"}},\
             \"spec\":{{\"type\":\"{svc_type}\",\"clusterIP\":\"{cluster_ip}\",\"clusterIPs\":[\"{cluster_ip}\"],\
             \"ports\":[{{\"name\":\"http\",\"protocol\":\"TCP\",\"port\":80,\"targetPort\":8080{node_port}}}]}}}}",
            s % 100
        )?;
        let mut eps = Vec::with_capacity(endpoints);
        for e in 0..endpoints {
            let mut n = 0x0A80_0000u32 + offset(s * endpoints + e)?;
            if change_endpoint && s == 0 && e == 0 {
                n = 0x0AFF_FFFE;
            }
            let slot = s * endpoints + e;
            let node = if slot % 1000 == 0 {
                "node-a".to_string()
            } else {
                format!("node-{}", slot % 1000)
            };
            eps.push(format!(
                "{{\"addresses\":[\"{}\"],\"conditions\":{{\"ready\":true}},\"nodeName\":\"{node}\"}}",
                std::net::Ipv4Addr::from(n)
            ));
        }
        writeln!(
            out,
            ",{{\"apiVersion\":\"discovery.k8s.io/v1\",\"kind\":\"EndpointSlice\",\"metadata\":{{\"namespace\":\"ns{}\",\
             \"name\":\"svc{s}-abcde\",\"labels\":{{\"kubernetes.io/service-name\":\"svc{s}\"}}}},\
             \"addressType\":\"IPv4\",\"ports\":[{{\"name\":\"http\",\"protocol\":\"TCP\",\"port\":8080}}],\
             \"endpoints\":[{}]}}",
            s % 100,
            eps.join(",")
        )?;
    }
    writeln!(out, "]}}")?;
    Ok(())
}
