//! What an evaluation reports: the packet asked about, and per possible path (numgen value)
//! the steps, the DNAT, the masquerade and the fate.

use super::*;

/// Where a packet comes from, which decides the hooks it traverses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Origin {
    /// From a pod on this node: arrives at prerouting with a pod source.
    Pod,
    /// From a process of this node: the output path.
    Host,
    /// From outside the node: arrives at prerouting.
    External,
}

impl Origin {
    pub fn keyword(self) -> &'static str {
        match self {
            Origin::Pod => "pod",
            Origin::Host => "host",
            Origin::External => "external",
        }
    }
}

/// The first packet of a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packet {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub proto: Protocol,
    pub dport: u16,
    pub origin: Origin,
    /// The interface the packet arrived on, for `iifname` matches (`--detect-local-mode
    /// BridgeInterface` / `InterfaceNamePrefix`). Locally generated packets have none.
    pub iif: Option<String>,
}

/// The routing decision taken after the first hook (and so after DNAT).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Route {
    /// Addressed to this node: input.
    Input,
    /// Routed on to a pod or another host: forward, then postrouting.
    Forward,
    /// Sent by this node elsewhere: postrouting.
    Output,
    /// Sent by this node to one of its own addresses: postrouting, then input over loopback.
    OutputLocal,
}

/// What finally happens to the packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Fate {
    Accept,
    Drop,
    /// Dropped with an ICMP(v6) port unreachable.
    Reject,
}

/// A rule, by chain and nft text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleRef {
    pub chain: String,
    pub rule: String,
}

impl std::fmt::Display for RuleRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "`{}` in {}", self.rule, self.chain)
    }
}

/// A destination NAT that happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dnat {
    pub target: SocketAddr,
    /// The Service port the map element that chose the target serves
    /// ([`crate::ruleset::Element::label`]).
    pub comment: Option<Comment>,
    pub by: RuleRef,
}

/// A masquerade that happened, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Masquerade {
    pub by: RuleRef,
    /// The rule that set the mark bit the masquerading rule tested, if it tested one.
    pub marked_by: Option<RuleRef>,
    /// The set element the masquerading rule matched, rendered (e.g. a hairpin element).
    pub element: Option<String>,
}

/// One event of a path, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// A base chain entered from its hook.
    Hook {
        hook: Hook,
        chain: String,
        kind: ChainType,
        priority: i32,
    },
    /// A `nat` base chain not run because this hook already NATed the packet.
    NatSkipped {
        hook: Hook,
        chain: String,
    },
    Jump {
        from: String,
        to: String,
    },
    Goto {
        from: String,
        to: String,
    },
    /// Back to the caller, by `return` or by falling off the end of `from`.
    Return {
        from: String,
        to: String,
    },
    /// A rule whose matches all held. `notes` say which set elements matched and to what.
    Rule {
        chain: String,
        text: String,
        notes: Vec<String>,
    },
    Dnat(Dnat),
    /// A base chain ended with accept (`by_policy`: it fell off the end).
    Accepted {
        chain: String,
        by_policy: bool,
    },
    Routing {
        dst: IpAddr,
        route: Route,
    },
}

/// The elements of dynamic sets, by set name (of the packet's family's table): keys written
/// from the packet path by earlier connections, each with its data (empty in a set that is not
/// a map).
pub type DynamicSets = BTreeMap<String, BTreeMap<Vec<Atom>, Vec<Atom>>>;

/// One possible path of the packet: one per combination of `numgen` values met on the way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Branch {
    /// The `numgen` value taken at each `numgen` met, in order.
    pub choices: Vec<u32>,
    pub steps: Vec<Step>,
    /// `None` when the packet ended before the routing decision.
    pub route: Option<Route>,
    pub fate: Fate,
    /// The rule that dropped or rejected the packet.
    pub decided_by: Option<RuleRef>,
    pub dnat: Option<Dnat>,
    pub masquerade: Option<Masquerade>,
    /// The dynamic sets after this packet (its `update`s and `delete`s applied).
    pub dynamic: DynamicSets,
}

/// Every possible path of one packet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trace {
    pub packet: Packet,
    pub family: IpFamily,
    /// Sorted by `choices`; at least one.
    pub branches: Vec<Branch>,
}

impl Trace {
    /// The distinct DNAT targets, sorted; empty when the packet is never DNATed.
    pub fn dnat_targets(&self) -> Vec<SocketAddr> {
        let mut out: Vec<SocketAddr> = self
            .branches
            .iter()
            .filter_map(|b| b.dnat.as_ref().map(|d| d.target))
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// The fate when every branch agrees on it.
    pub fn fate(&self) -> Option<Fate> {
        let first = self.branches.first()?.fate;
        self.branches
            .iter()
            .all(|b| b.fate == first)
            .then_some(first)
    }

    /// Whether the packet is masqueraded, when every branch agrees.
    pub fn masqueraded(&self) -> Option<bool> {
        let first = self.branches.first()?.masquerade.is_some();
        self.branches
            .iter()
            .all(|b| b.masquerade.is_some() == first)
            .then_some(first)
    }

    /// The branch that DNATed to `target`.
    pub fn branch_to(&self, target: SocketAddr) -> Option<&Branch> {
        self.branches
            .iter()
            .find(|b| b.dnat.as_ref().is_some_and(|d| d.target == target))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EvalError {
    #[error("the evaluator does not model `{stmt}` (chain {chain}): {why}")]
    Unsupported {
        stmt: String,
        chain: String,
        why: String,
    },
    #[error("source {src} and destination {dst} are of different address families")]
    MixedFamilies { src: IpAddr, dst: IpAddr },
    #[error("chain {chain} jumps to {target}, which {why}")]
    BadTarget {
        chain: String,
        target: String,
        why: &'static str,
    },
    #[error("chain {chain} looks up set {set}, which {why}")]
    BadSet {
        chain: String,
        set: String,
        why: String,
    },
    #[error("jumps nested deeper than {MAX_JUMP_DEPTH} at chain {chain} (the kernel's limit)")]
    TooDeep { chain: String },
    #[error("more than {MAX_RULES} rules evaluated for one packet: the chain graph loops")]
    Loop,
    #[error("more than {MAX_BRANCHES} possible paths (numgen values) for one packet")]
    TooManyBranches,
}
