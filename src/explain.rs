//! `nodeproxy explain`: where one packet goes through the ruleset `--dry-run` would print, in
//! words an operator can check against `nft list table`: hooks and chains, matching rules,
//! DNAT candidates with the Service port they serve, masquerade and verdict.
//!
//! The command line is parsed here (not in clap) so that a bad address reads like every other
//! configuration error; the packet walk itself is [`crate::ruleset::eval`].

use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;

use crate::model::{ClusterState, Protocol};
use crate::ruleset::eval::{self, Branch, EvalError, Fate, Origin, Packet, Route, Step, Trace};
use crate::ruleset::{ChainType, Comment, Hook, Ruleset};

/// What `explain` was asked about. `from: None` means "infer it from the source address".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Query {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub dport: u16,
    pub proto: Protocol,
    pub from: Option<Origin>,
}

/// Parses `ADDR:PORT/PROTO` (`[v6]:PORT/PROTO` for IPv6); `/PROTO` defaults to tcp.
pub fn parse_destination(text: &str) -> Result<(IpAddr, u16, Protocol), String> {
    let (addr, proto) = match text.rsplit_once('/') {
        Some((addr, proto)) => (addr, parse_protocol(proto)?),
        None => (text, Protocol::Tcp),
    };
    let usage = || {
        format!("`{addr}` is not ADDRESS:PORT; write e.g. 10.96.0.10:53/udp or [fd00::10]:53/udp")
    };
    if let Ok(sock) = addr.parse::<SocketAddr>() {
        if sock.port() == 0 {
            return Err("port 0 is not a port a connection can be made to; valid: 1-65535".into());
        }
        return Ok((sock.ip(), sock.port(), proto));
    }
    // Say what is wrong when only the port is: `10.96.0.10:99999` is out of range, not
    // malformed.
    let (host, port) = addr.rsplit_once(':').ok_or_else(usage)?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.parse::<IpAddr>().is_ok()
        && !port.is_empty()
        && port.bytes().all(|b| b.is_ascii_digit())
    {
        return Err(format!("port {port} is out of range; valid: 1-65535"));
    }
    Err(usage())
}

fn parse_protocol(text: &str) -> Result<Protocol, String> {
    match text.to_ascii_lowercase().as_str() {
        "tcp" => Ok(Protocol::Tcp),
        "udp" => Ok(Protocol::Udp),
        "sctp" => Ok(Protocol::Sctp),
        _ => Err(format!("`{text}` is not a protocol; use tcp, udp or sctp")),
    }
}

/// Parses `--from`.
pub fn parse_origin(text: &str) -> Result<Origin, String> {
    match text.to_ascii_lowercase().as_str() {
        "pod" => Ok(Origin::Pod),
        "host" => Ok(Origin::Host),
        "external" => Ok(Origin::External),
        _ => Err(format!("`{text}` must be pod, host or external")),
    }
}

/// The addresses the node owns according to its Node object (InternalIPs and ExternalIPs):
/// what the routing decision treats as local.
pub fn node_addresses(state: &ClusterState, node_name: &str) -> Vec<IpAddr> {
    state
        .nodes
        .get(node_name)
        .map(|n| {
            n.internal_ips
                .iter()
                .chain(&n.external_ips)
                .copied()
                .collect()
        })
        .unwrap_or_default()
}

/// `--from` when not given: the node's own address means its processes, a pod-network address
/// a pod, anything else an outside client. Returns the reason for the report.
pub fn infer_origin(
    src: IpAddr,
    node_addrs: &[IpAddr],
    cluster_cidrs: &[IpNet],
) -> (Origin, String) {
    if src.is_loopback() || node_addrs.contains(&src) {
        (
            Origin::Host,
            format!("{src} is one of this node's addresses"),
        )
    } else if let Some(net) = cluster_cidrs.iter().find(|net| net.contains(&src)) {
        (Origin::Pod, format!("{src} is inside --cluster-cidr {net}"))
    } else {
        (
            Origin::External,
            format!("{src} is neither a node address nor inside --cluster-cidr"),
        )
    }
}

/// Evaluates the query and renders the report.
pub fn report(
    ruleset: &Ruleset,
    query: &Query,
    node_name: &str,
    node_addrs: &[IpAddr],
    cluster_cidrs: &[IpNet],
) -> Result<String, EvalError> {
    let (origin, why_origin) = match query.from {
        Some(origin) => (origin, "--from".to_string()),
        None => {
            let (origin, why) = infer_origin(query.src, node_addrs, cluster_cidrs);
            (origin, format!("inferred: {why}; override with --from"))
        }
    };
    let packet = Packet {
        src: query.src,
        dst: query.dst,
        proto: query.proto,
        dport: query.dport,
        origin,
        iif: None,
    };
    let trace = eval::evaluate(ruleset, node_addrs, packet)?;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "packet: {} -> {}/{}, new connection from {} ({why_origin})",
        query.src,
        SocketAddr::new(query.dst, query.dport),
        query.proto,
        origin_words(origin),
    );
    let addrs: Vec<String> = node_addrs.iter().map(IpAddr::to_string).collect();
    let _ = writeln!(
        out,
        "node: {node_name} (addresses: {})",
        if addrs.is_empty() {
            "none known".to_string()
        } else {
            addrs.join(", ")
        }
    );
    out.push('\n');
    render_paths(&mut out, &trace);
    out.push('\n');
    render_summary(&mut out, &trace);
    Ok(out)
}

fn origin_words(origin: Origin) -> &'static str {
    match origin {
        Origin::Pod => "a pod on this node, entering at prerouting",
        Origin::Host => "this node's own processes, entering at output",
        Origin::External => "outside the node, entering at prerouting",
    }
}

fn hook_name(hook: Hook) -> &'static str {
    match hook {
        Hook::Prerouting => "prerouting",
        Hook::Input => "input",
        Hook::Forward => "forward",
        Hook::Output => "output",
        Hook::Postrouting => "postrouting",
    }
}

/// Marks the line of a DNAT, where branches start to differ for good.
const DNAT_MARK: &str = "  DNAT to ";

/// `natted`: a DNAT happened before this step; the routing line then names no address, so
/// branches to different endpoints with the same fate print as one.
fn step_lines(step: &Step, natted: bool, lines: &mut Vec<String>) {
    match step {
        Step::Hook {
            hook,
            chain,
            kind,
            priority,
        } => {
            let kind = match kind {
                ChainType::Filter => "filter",
                ChainType::Nat => "nat",
            };
            lines.push(format!(
                "{}: {chain} (type {kind}, priority {priority})",
                hook_name(*hook)
            ));
        }
        Step::NatSkipped { hook, chain } => lines.push(format!(
            "{}: {chain} skipped (the packet was already NATed at this hook)",
            hook_name(*hook)
        )),
        Step::Jump { to, .. } => lines.push(format!("  -> jump {to}")),
        Step::Goto { to, .. } => lines.push(format!("  -> goto {to}")),
        Step::Return { from, to } => lines.push(format!("  <- back to {to} (end of {from})")),
        Step::Rule { chain, text, notes } => {
            lines.push(format!("  [{chain}] {text}"));
            lines.extend(notes.iter().map(|n| format!("        {n}")));
        }
        Step::Dnat(d) => lines.push(format!("{DNAT_MARK}{}{}", d.target, comment(&d.comment))),
        Step::Accepted { chain, by_policy } => lines.push(if *by_policy {
            format!("  {chain}: end of chain, policy accept")
        } else {
            format!("  {chain}: accept")
        }),
        Step::Routing { dst, route } => {
            let dst = if natted {
                "the DNAT target".to_string()
            } else {
                dst.to_string()
            };
            lines.push(match route {
                Route::Input => format!("routing: {dst} is this node's address -> input"),
                Route::Forward => format!("routing: {dst} is not this node's address -> forward"),
                Route::Output => format!("routing: {dst} is not this node's address -> out"),
                Route::OutputLocal => {
                    format!("routing: {dst} is this node's address -> loopback, then input")
                }
            })
        }
    }
}

fn comment(c: &Option<Comment>) -> String {
    c.as_ref().map(|c| format!("  ({c})")).unwrap_or_default()
}

fn branch_lines(branch: &Branch) -> Vec<String> {
    let mut lines = Vec::new();
    let mut natted = false;
    for step in &branch.steps {
        natted |= matches!(step, Step::Dnat(_));
        step_lines(step, natted, &mut lines);
    }
    lines
}

/// The path, printing what all branches share once, then each group of branches that differ
/// only in their DNAT target together.
fn render_paths(out: &mut String, trace: &Trace) {
    let all: Vec<Vec<String>> = trace.branches.iter().map(branch_lines).collect();
    let Some(first) = all.first() else {
        return;
    };
    let common = (0..first.len())
        .take_while(|&i| all.iter().all(|l| l.get(i) == Some(&first[i])))
        .count();
    for line in &first[..common] {
        let _ = writeln!(out, "{line}");
    }
    if all.len() == 1 {
        return;
    }
    let _ = writeln!(
        out,
        "  numgen picks one of {} paths at random per connection:",
        all.len()
    );
    // Group by what follows the DNAT, so N endpoints with the same fate print once.
    let mut groups: Vec<(Vec<String>, Vec<Vec<String>>)> = Vec::new();
    for lines in &all {
        let suffix = &lines[common..];
        let split = suffix
            .iter()
            .position(|l| l.starts_with(DNAT_MARK))
            .map_or(0, |i| i + 1);
        let (head, tail) = suffix.split_at(split);
        match groups.iter_mut().find(|(t, _)| t.as_slice() == tail) {
            Some((_, heads)) => heads.push(head.to_vec()),
            None => groups.push((tail.to_vec(), vec![head.to_vec()])),
        }
    }
    for (tail, heads) in groups {
        for head in heads {
            for line in head {
                let _ = writeln!(out, "  | {line}");
            }
        }
        let _ = writeln!(out, "  then:");
        for line in tail {
            let _ = writeln!(out, "  | {line}");
        }
    }
}

fn render_summary(out: &mut String, trace: &Trace) {
    let targets = trace.dnat_targets();
    if targets.is_empty() {
        let _ = writeln!(out, "DNAT: none (the destination is not translated)");
    } else {
        let _ = writeln!(out, "DNAT candidates ({}):", targets.len());
        for target in &targets {
            let c = trace
                .branch_to(*target)
                .and_then(|b| b.dnat.as_ref())
                .map(|d| comment(&d.comment))
                .unwrap_or_default();
            let _ = writeln!(out, "  {target}{c}");
        }
    }
    // One line per distinct outcome; with several targets, say which it is for.
    let mut seen: Vec<String> = Vec::new();
    for branch in &trace.branches {
        let line = format!(
            "verdict: {}\nmasquerade: {}",
            fate_words(branch),
            masquerade_words(branch)
        );
        if !seen.contains(&line) {
            seen.push(line);
        }
    }
    if seen.len() == 1 {
        for line in &seen {
            let _ = writeln!(out, "{line}");
        }
        return;
    }
    for branch in &trace.branches {
        let to = branch
            .dnat
            .as_ref()
            .map_or("not translated".to_string(), |d| d.target.to_string());
        let _ = writeln!(out, "to {to}:");
        let _ = writeln!(out, "  verdict: {}", fate_words(branch));
        let _ = writeln!(out, "  masquerade: {}", masquerade_words(branch));
    }
}

fn fate_words(branch: &Branch) -> String {
    let by = branch
        .decided_by
        .as_ref()
        .map(|r| format!(" by {r}"))
        .unwrap_or_default();
    match branch.fate {
        Fate::Accept => "accept".to_string(),
        Fate::Drop => format!("drop{by}"),
        Fate::Reject => format!("reject (ICMP port unreachable){by}"),
    }
}

fn masquerade_words(branch: &Branch) -> String {
    match &branch.masquerade {
        Some(m) => match (&m.marked_by, &m.element) {
            (Some(marked), _) => format!("yes: marked by {marked}, masqueraded by {}", m.by),
            (None, Some(elem)) => format!("yes: {} matched {elem}", m.by),
            (None, None) => format!("yes: {}", m.by),
        },
        None => match (branch.fate, branch.route) {
            (Fate::Drop | Fate::Reject, _) => "no (the packet does not get through)".to_string(),
            (_, Some(Route::Input)) => {
                "no (delivered to this node: the input path has no postrouting)".to_string()
            }
            _ => "no (no masquerade rule matched in postrouting)".to_string(),
        },
    }
}
