//! Packet-path evaluation over the [`Ruleset`] IR (DESIGN §7 tier 3): for the first packet of a
//! new connection, which hooks and chains it goes through, which rules match, where it is DNATed
//! to, whether it is masqueraded, and whether it is accepted, dropped or rejected.
//!
//! This models nftables only as far as nodeproxy uses it, and refuses what it does not model:
//! a statement the evaluator cannot decide is an [`EvalError::Unsupported`] naming the
//! statement, never a silent pass, because a test that "passes" through an unmodelled match
//! proves nothing. Adding a `Stmt` variant means adding one arm to [`Run::stmt`] (the match is
//! exhaustive on purpose, so the compiler points there).
//!
//! Modelled semantics:
//! - Hook order as kube-proxy relies on (reference §2): traffic arriving at the node runs the
//!   prerouting base chains by priority, is routed (input when the destination, after DNAT, is
//!   one of the node's addresses, else forward), then input, or forward and postrouting. Traffic
//!   from the node's own processes runs output, then postrouting, then input when it is
//!   addressed to the node itself (loopback).
//! - `accept` ends the base chain, not the hook: later base chains still run. `drop` and
//!   `reject` end the packet's path. Base chains end with policy accept.
//! - `jump` returns to the next rule of the caller; `goto` replaces the current chain, so falling
//!   off (or `return` from) a chain entered by `goto` resumes after the last `jump`.
//! - Every packet is the first of a new connection (`ct state new` holds); `ct status dnat`
//!   holds once a DNAT happened. NAT statements end evaluation of their base chain (the kernel
//!   turns them into an accept), and once a hook has NATed a packet, later `nat` base chains of
//!   that hook are skipped, as in the kernel's NAT core.
//! - `numgen random mod k` is not sampled: evaluation forks into one [`Branch`] per value, so a
//!   trace holds every possible DNAT target and what happens to the packet after each.
//! - Dynamic sets (`flags dynamic`: affinity pins) hold what earlier connections wrote, given as
//!   [`DynamicSets`] ([`evaluate`] starts from none). `update` and `delete` change them, and
//!   each [`Branch`] carries the sets as it left them: evaluating the same client's next
//!   connection with a branch's sets shows where that client is pinned.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use super::render;
use super::{
    AddrField, Atom, Chain, ChainType, ElemData, Element, Hook, KeyField, Rule, Ruleset, Set,
    SetData, SetKind, Stmt, Table, Verdict,
};
use crate::model::{IpFamily, Protocol};

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
    /// The comment of the map element that chose the target (the Service port it serves).
    pub comment: Option<Arc<str>>,
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
/// from the packet path by earlier connections.
pub type DynamicSets = BTreeMap<String, BTreeSet<Vec<Atom>>>;

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

/// The kernel's jump stack size (NFT_JUMP_STACK_SIZE).
const MAX_JUMP_DEPTH: usize = 16;
/// A bound on work per path: the IR is not validated against loops the way the kernel's chain
/// graph is, and a loop must be an error, not a hang.
const MAX_RULES: usize = 100_000;
/// A bound on forks; a service has at most a few thousand endpoints.
const MAX_BRANCHES: usize = 65_536;

/// Evaluates `packet` against `ruleset` on a node owning `local_addrs` (loopback addresses are
/// always local), with empty dynamic sets. Only the tables of the packet's family apply.
pub fn evaluate(
    ruleset: &Ruleset,
    local_addrs: &[IpAddr],
    packet: Packet,
) -> Result<Trace, EvalError> {
    evaluate_with(ruleset, local_addrs, packet, &DynamicSets::new())
}

/// Like [`evaluate`], with the dynamic sets holding `dynamic` (e.g. a [`Branch::dynamic`] of
/// an earlier connection).
pub fn evaluate_with(
    ruleset: &Ruleset,
    local_addrs: &[IpAddr],
    packet: Packet,
    dynamic: &DynamicSets,
) -> Result<Trace, EvalError> {
    let family = IpFamily::of(&packet.src);
    if IpFamily::of(&packet.dst) != family {
        return Err(EvalError::MixedFamilies {
            src: packet.src,
            dst: packet.dst,
        });
    }
    let tables: Vec<&Table> = ruleset
        .tables
        .iter()
        .filter(|t| t.family == family)
        .collect();

    // Depth-first over numgen choices: each run follows the forced prefix, then takes 0 at
    // every further numgen and reports its modulus, and every other value there is queued.
    // Each complete sequence of choices is therefore run exactly once.
    let mut pending: Vec<Vec<u32>> = vec![Vec::new()];
    let mut branches = Vec::new();
    while let Some(forced) = pending.pop() {
        let mut run = Run::new(
            &tables,
            family,
            local_addrs,
            packet.clone(),
            forced.clone(),
            dynamic.clone(),
        );
        run.path()?;
        let fresh = run.moduli.iter().enumerate().skip(forced.len());
        for (pos, &modulus) in fresh {
            for value in 1..modulus {
                let mut next = forced.clone();
                next.resize(pos, 0);
                next.push(value);
                pending.push(next);
            }
        }
        branches.push(run.finish());
        if branches.len() + pending.len() > MAX_BRANCHES {
            return Err(EvalError::TooManyBranches);
        }
    }
    branches.sort_by(|a, b| a.choices.cmp(&b.choices));
    Ok(Trace {
        packet,
        family,
        branches,
    })
}

/// How a base chain ended.
enum ChainEnd {
    Accept,
    Drop(RuleRef),
    Reject(RuleRef),
}

/// How one statement or rule ended.
enum Flow {
    /// The statement held (or acted): go on with the next statement.
    Next,
    /// A match failed: the rule ends, evaluation goes on with the next rule.
    Break,
    Verdict(Terminal),
}

enum Terminal {
    Accept,
    Drop,
    Reject,
    Jump(String),
    Goto(String),
    Return,
}

/// State of one path through the hooks.
struct Run<'a> {
    tables: &'a [&'a Table],
    family: IpFamily,
    local_addrs: &'a [IpAddr],
    pkt: Packet,
    mark: u32,
    /// Which rule last set which mark bits, to explain a mark-driven masquerade.
    mark_setters: Vec<(u32, RuleRef)>,
    dnat: Option<Dnat>,
    masquerade: Option<Masquerade>,
    /// Hooks at which a NAT already happened.
    natted: Vec<Hook>,
    steps: Vec<Step>,
    route: Option<Route>,
    fate: Fate,
    decided_by: Option<RuleRef>,
    forced: Vec<u32>,
    choices: Vec<u32>,
    moduli: Vec<u32>,
    rules_run: usize,
    dynamic: DynamicSets,
}

/// Per-rule context: the base chain's hook and type, and what the rule has matched so far.
struct RuleCtx<'a> {
    table: &'a Table,
    hook: Hook,
    kind: ChainType,
    chain: &'a str,
    text: String,
    notes: Vec<String>,
    /// The mask of the `meta mark & mask != 0` this rule matched.
    mark_tested: Option<u32>,
    /// The set element this rule's last set lookup matched.
    element: Option<String>,
    effects: Vec<Step>,
}

impl<'a> Run<'a> {
    fn new(
        tables: &'a [&'a Table],
        family: IpFamily,
        local_addrs: &'a [IpAddr],
        pkt: Packet,
        forced: Vec<u32>,
        dynamic: DynamicSets,
    ) -> Run<'a> {
        Run {
            tables,
            family,
            local_addrs,
            pkt,
            mark: 0,
            mark_setters: Vec::new(),
            dnat: None,
            masquerade: None,
            natted: Vec::new(),
            steps: Vec::new(),
            route: None,
            fate: Fate::Accept,
            decided_by: None,
            forced,
            choices: Vec::new(),
            moduli: Vec::new(),
            rules_run: 0,
            dynamic,
        }
    }

    fn finish(self) -> Branch {
        Branch {
            choices: self.choices,
            steps: self.steps,
            route: self.route,
            fate: self.fate,
            decided_by: self.decided_by,
            dnat: self.dnat,
            masquerade: self.masquerade,
            dynamic: self.dynamic,
        }
    }

    fn is_local(&self, addr: IpAddr) -> bool {
        addr.is_loopback() || self.local_addrs.contains(&addr)
    }

    /// The whole path: first hook, routing, the hooks after it. Stops at drop or reject.
    fn path(&mut self) -> Result<(), EvalError> {
        let first = match self.pkt.origin {
            Origin::Pod | Origin::External => Hook::Prerouting,
            Origin::Host => Hook::Output,
        };
        if !self.hook(first)? {
            return Ok(());
        }
        let local = self.is_local(self.pkt.dst);
        let route = match (self.pkt.origin, local) {
            (Origin::Pod | Origin::External, true) => Route::Input,
            (Origin::Pod | Origin::External, false) => Route::Forward,
            (Origin::Host, false) => Route::Output,
            (Origin::Host, true) => Route::OutputLocal,
        };
        self.route = Some(route);
        self.steps.push(Step::Routing {
            dst: self.pkt.dst,
            route,
        });
        let rest: &[Hook] = match route {
            Route::Input => &[Hook::Input],
            Route::Forward => &[Hook::Forward, Hook::Postrouting],
            Route::Output => &[Hook::Postrouting],
            Route::OutputLocal => &[Hook::Postrouting, Hook::Input],
        };
        for &hook in rest {
            if !self.hook(hook)? {
                return Ok(());
            }
        }
        Ok(())
    }

    /// Runs every base chain of `hook` by priority; false when the packet was dropped.
    fn hook(&mut self, hook: Hook) -> Result<bool, EvalError> {
        let mut bases: Vec<(&'a Table, &'a Chain, ChainType, i32)> = self
            .tables
            .iter()
            .flat_map(|t| t.chains.iter().map(move |c| (*t, c)))
            .filter_map(|(t, c)| {
                c.base
                    .filter(|b| b.hook == hook)
                    .map(|b| (t, c, b.kind, b.priority))
            })
            .collect();
        // Stable: chains of equal priority run in table order, as they were registered.
        bases.sort_by_key(|&(_, _, _, priority)| priority);
        for (table, chain, kind, priority) in bases {
            if kind == ChainType::Nat && self.natted.contains(&hook) {
                self.steps.push(Step::NatSkipped {
                    hook,
                    chain: chain.name.clone(),
                });
                continue;
            }
            self.steps.push(Step::Hook {
                hook,
                chain: chain.name.clone(),
                kind,
                priority,
            });
            match self.base_chain(table, chain, hook, kind)? {
                ChainEnd::Accept => {}
                ChainEnd::Drop(by) => {
                    self.fate = Fate::Drop;
                    self.decided_by = Some(by);
                    return Ok(false);
                }
                ChainEnd::Reject(by) => {
                    self.fate = Fate::Reject;
                    self.decided_by = Some(by);
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }

    fn base_chain(
        &mut self,
        table: &'a Table,
        base: &'a Chain,
        hook: Hook,
        kind: ChainType,
    ) -> Result<ChainEnd, EvalError> {
        // Return points of the jumps taken: (chain, index of the next rule).
        let mut stack: Vec<(&'a Chain, usize)> = Vec::new();
        let mut chain = base;
        let mut next = 0;
        loop {
            let Some(rule) = chain.rules.get(next) else {
                match stack.pop() {
                    Some((caller, resume)) => {
                        self.steps.push(Step::Return {
                            from: chain.name.clone(),
                            to: caller.name.clone(),
                        });
                        chain = caller;
                        next = resume;
                        continue;
                    }
                    None => {
                        self.steps.push(Step::Accepted {
                            chain: base.name.clone(),
                            by_policy: true,
                        });
                        return Ok(ChainEnd::Accept);
                    }
                }
            };
            next += 1;
            self.rules_run += 1;
            if self.rules_run > MAX_RULES {
                return Err(EvalError::Loop);
            }
            let Some(terminal) = self.rule(table, hook, kind, chain, rule)? else {
                continue;
            };
            let family = self.family;
            let here = || RuleRef {
                chain: chain.name.clone(),
                rule: render::rule(family, rule),
            };
            match terminal {
                Terminal::Accept => {
                    self.steps.push(Step::Accepted {
                        chain: base.name.clone(),
                        by_policy: false,
                    });
                    return Ok(ChainEnd::Accept);
                }
                Terminal::Drop => return Ok(ChainEnd::Drop(here())),
                Terminal::Reject => return Ok(ChainEnd::Reject(here())),
                Terminal::Jump(target) => {
                    let to = regular_chain(table, &chain.name, &target)?;
                    if stack.len() >= MAX_JUMP_DEPTH {
                        return Err(EvalError::TooDeep {
                            chain: chain.name.clone(),
                        });
                    }
                    self.steps.push(Step::Jump {
                        from: chain.name.clone(),
                        to: to.name.clone(),
                    });
                    stack.push((chain, next));
                    chain = to;
                    next = 0;
                }
                Terminal::Goto(target) => {
                    let to = regular_chain(table, &chain.name, &target)?;
                    self.steps.push(Step::Goto {
                        from: chain.name.clone(),
                        to: to.name.clone(),
                    });
                    chain = to;
                    next = 0;
                }
                Terminal::Return => match stack.pop() {
                    Some((caller, resume)) => {
                        self.steps.push(Step::Return {
                            from: chain.name.clone(),
                            to: caller.name.clone(),
                        });
                        chain = caller;
                        next = resume;
                    }
                    // `return` with no caller ends the base chain with its policy.
                    None => {
                        self.steps.push(Step::Accepted {
                            chain: base.name.clone(),
                            by_policy: true,
                        });
                        return Ok(ChainEnd::Accept);
                    }
                },
            }
        }
    }

    /// Evaluates one rule; `Some` when it ended with a verdict.
    fn rule(
        &mut self,
        table: &'a Table,
        hook: Hook,
        kind: ChainType,
        chain: &'a Chain,
        rule: &Rule,
    ) -> Result<Option<Terminal>, EvalError> {
        let mut ctx = RuleCtx {
            table,
            hook,
            kind,
            chain: &chain.name,
            text: render::rule(self.family, rule),
            notes: Vec::new(),
            mark_tested: None,
            element: None,
            effects: Vec::new(),
        };
        let mut end = None;
        let mut matched = true;
        for stmt in &rule.stmts {
            match self.stmt(&mut ctx, stmt)? {
                Flow::Next => {}
                Flow::Break => {
                    matched = false;
                    break;
                }
                Flow::Verdict(t) => {
                    end = Some(t);
                    break;
                }
            }
        }
        // A rule that did something before a later match failed is still shown: its effects
        // (a mark, say) stay, as in the kernel.
        if matched || !ctx.effects.is_empty() {
            if !matched {
                ctx.notes
                    .push("a later match failed; the effects above stay".to_string());
            }
            self.steps.push(Step::Rule {
                chain: chain.name.clone(),
                text: ctx.text,
                notes: ctx.notes,
            });
            self.steps.append(&mut ctx.effects);
        }
        Ok(end)
    }

    /// The next `numgen random mod modulus` value of this branch.
    fn numgen(&mut self, modulus: u32) -> u32 {
        let pos = self.choices.len();
        let value = self.forced.get(pos).copied().unwrap_or(0);
        self.choices.push(value);
        self.moduli.push(modulus);
        value
    }

    /// The packet's value of each key field, in order.
    fn key(
        &mut self,
        ctx: &RuleCtx<'_>,
        stmt: &Stmt,
        fields: &[KeyField],
    ) -> Result<Vec<Atom>, EvalError> {
        fields
            .iter()
            .map(|field| {
                Ok(match *field {
                    KeyField::Saddr => Atom::Addr(self.pkt.src),
                    KeyField::Daddr => Atom::Addr(self.pkt.dst),
                    KeyField::L4Proto => Atom::Proto(self.pkt.proto),
                    KeyField::ThDport => Atom::Port(self.pkt.dport),
                    KeyField::Numgen { modulus: 0 } => {
                        return Err(self.unsupported(ctx, stmt, "numgen modulus 0"));
                    }
                    KeyField::Numgen { modulus } => Atom::Int(self.numgen(modulus)),
                })
            })
            .collect()
    }

    fn unsupported(&self, ctx: &RuleCtx<'_>, stmt: &Stmt, why: &str) -> EvalError {
        EvalError::Unsupported {
            stmt: render::stmt(self.family, stmt),
            chain: ctx.chain.to_string(),
            why: why.to_string(),
        }
    }

    /// The set `name` of the table `ctx.chain` belongs to, with a key of the lookup's shape.
    fn set(&self, ctx: &RuleCtx<'a>, name: &str, key: &[KeyField]) -> Result<&'a Set, EvalError> {
        let bad = |why: String| EvalError::BadSet {
            chain: ctx.chain.to_string(),
            set: name.to_string(),
            why,
        };
        let set = ctx
            .table
            .set(name)
            .ok_or_else(|| bad("does not exist".to_string()))?;
        let types = |fields: &[KeyField]| {
            fields
                .iter()
                .map(|f| render::datatype(self.family, *f))
                .collect::<Vec<_>>()
        };
        if types(&set.key) != types(key) {
            return Err(bad(format!(
                "has key type {} but is looked up with {}",
                types(&set.key).join(" . "),
                types(key).join(" . ")
            )));
        }
        Ok(set)
    }

    /// Looks `key` up in `set`; records the matched element on the rule.
    fn lookup(&self, ctx: &mut RuleCtx<'_>, set: &'a Set, key: &[Atom]) -> Option<&'a Element> {
        // Exact match, except that a range atom (interval sets) matches the addresses in it.
        let matches = |e: &Element| {
            e.key.len() == key.len()
                && e.key
                    .iter()
                    .zip(key)
                    .all(|(have, want)| match (have, want) {
                        (Atom::Net(net), Atom::Addr(addr)) => net.contains(addr),
                        _ => have == want,
                    })
        };
        let elem = set.elements.iter().find(|e| matches(e))?;
        let mut note = format!("@{}: {}", set.name, render::atoms(&elem.key));
        match &elem.data {
            None => {}
            Some(ElemData::Verdict(v)) => {
                note.push_str(&format!(" : {}", render::verdict(v)));
            }
            Some(ElemData::Value(values)) => {
                note.push_str(&format!(" : {}", render::atoms(values)));
            }
        }
        if let Some(comment) = &elem.comment {
            note.push_str(&format!("  ({comment})"));
        }
        ctx.element = Some(note.clone());
        ctx.notes.push(note);
        Some(elem)
    }

    /// Whether a dynamic set holds `key`; records a hit on the rule.
    fn dynamic_lookup(&self, ctx: &mut RuleCtx<'_>, set: &Set, key: &[Atom]) -> bool {
        let hit = self
            .dynamic
            .get(&set.name)
            .is_some_and(|keys| keys.contains(key));
        if hit {
            let note = format!(
                "@{}: {} (written by an earlier connection)",
                set.name,
                render::atoms(key)
            );
            ctx.element = Some(note.clone());
            ctx.notes.push(note);
        }
        hit
    }

    fn rule_ref(&self, ctx: &RuleCtx<'_>) -> RuleRef {
        RuleRef {
            chain: ctx.chain.to_string(),
            rule: ctx.text.clone(),
        }
    }

    /// One statement. Every variant has its own arm (no wildcard) so that a new statement
    /// cannot be evaluated by accident: it does not compile until someone decides here.
    fn stmt(&mut self, ctx: &mut RuleCtx<'_>, stmt: &Stmt) -> Result<Flow, EvalError> {
        let holds = |ok: bool| if ok { Flow::Next } else { Flow::Break };
        Ok(match stmt {
            // Every evaluated packet is the first of its connection.
            Stmt::CtStateNew => Flow::Next,
            Stmt::FibLocal { field } => holds(self.is_local(match field {
                AddrField::Saddr => self.pkt.src,
                AddrField::Daddr => self.pkt.dst,
            })),
            Stmt::Iifname {
                name,
                prefix,
                negate,
            } => {
                let iif = match (&self.pkt.iif, self.pkt.origin) {
                    (Some(iif), _) => iif.as_str(),
                    // Locally generated packets have no input interface: nft compares an empty
                    // name.
                    (None, Origin::Host) => "",
                    (None, _) => {
                        return Err(self.unsupported(
                            ctx,
                            stmt,
                            "needs the interface the packet arrived on (explain --iif)",
                        ));
                    }
                };
                let matches = if *prefix {
                    iif.starts_with(name.as_str())
                } else {
                    iif == name
                };
                holds(matches != *negate)
            }
            Stmt::CtStatusDnat => holds(self.dnat.is_some()),
            Stmt::AddrMatch { field, negate, net } => {
                let addr = match field {
                    AddrField::Saddr => self.pkt.src,
                    AddrField::Daddr => self.pkt.dst,
                };
                if IpFamily::of(&net.addr()) != self.family {
                    return Err(self.unsupported(ctx, stmt, "address of the other family"));
                }
                holds(net.contains(&addr) != *negate)
            }
            Stmt::InSet { key, set } => {
                let set = self.set(ctx, set, key)?;
                let key = self.key(ctx, stmt, key)?;
                if set.kind == SetKind::Dynamic {
                    holds(self.dynamic_lookup(ctx, set, &key))
                } else {
                    holds(self.lookup(ctx, set, &key).is_some())
                }
            }
            Stmt::Vmap { key, map } => {
                let set = self.set(ctx, map, key)?;
                if set.data != Some(SetData::Verdict) {
                    return Err(EvalError::BadSet {
                        chain: ctx.chain.to_string(),
                        set: map.clone(),
                        why: "is not a verdict map".to_string(),
                    });
                }
                let key = self.key(ctx, stmt, key)?;
                match self.lookup(ctx, set, &key).map(|e| &e.data) {
                    // A miss ends the rule, like a failed match.
                    None => Flow::Break,
                    Some(Some(ElemData::Verdict(v))) => Flow::Verdict(terminal(v)),
                    Some(_) => {
                        return Err(EvalError::BadSet {
                            chain: ctx.chain.to_string(),
                            set: map.clone(),
                            why: "has an element without a verdict".to_string(),
                        });
                    }
                }
            }
            Stmt::MarkTest { mask } => {
                ctx.mark_tested = Some(*mask);
                holds(self.mark & mask != 0)
            }
            Stmt::MarkOr(bits) => {
                self.mark |= bits;
                self.mark_setters.push((*bits, self.rule_ref(ctx)));
                Flow::Next
            }
            Stmt::MarkXor(bits) => {
                self.mark ^= bits;
                Flow::Next
            }
            Stmt::DnatMap { key, map } => {
                if ctx.kind != ChainType::Nat
                    || !matches!(ctx.hook, Hook::Prerouting | Hook::Output)
                {
                    return Err(self.unsupported(
                        ctx,
                        stmt,
                        "dnat outside a nat chain at prerouting or output (the kernel refuses it)",
                    ));
                }
                let set = self.set(ctx, map, key)?;
                let key = self.key(ctx, stmt, key)?;
                let Some(elem) = self.lookup(ctx, set, &key) else {
                    // A map miss breaks the rule: no NAT, next rule.
                    return Ok(Flow::Break);
                };
                let target = match &elem.data {
                    Some(ElemData::Value(v)) => match v.as_slice() {
                        [Atom::Addr(addr), Atom::Port(port)] => SocketAddr::new(*addr, *port),
                        _ => {
                            return Err(self.unsupported(
                                ctx,
                                stmt,
                                "map data other than address . port",
                            ));
                        }
                    },
                    _ => {
                        return Err(self.unsupported(ctx, stmt, "map element without data"));
                    }
                };
                let dnat = Dnat {
                    target,
                    comment: elem.comment.clone(),
                    by: self.rule_ref(ctx),
                };
                self.pkt.dst = target.ip();
                self.pkt.dport = target.port();
                self.natted.push(ctx.hook);
                ctx.effects.push(Step::Dnat(dnat.clone()));
                self.dnat = Some(dnat);
                // NAT statements end the chain with accept.
                Flow::Verdict(Terminal::Accept)
            }
            Stmt::Masquerade { .. } => {
                if ctx.kind != ChainType::Nat || ctx.hook != Hook::Postrouting {
                    return Err(self.unsupported(
                        ctx,
                        stmt,
                        "masquerade outside a nat chain at postrouting",
                    ));
                }
                let marked_by = ctx.mark_tested.and_then(|mask| {
                    self.mark_setters
                        .iter()
                        .rev()
                        .find(|(bits, _)| bits & mask != 0)
                        .map(|(_, by)| by.clone())
                });
                self.masquerade = Some(Masquerade {
                    by: self.rule_ref(ctx),
                    marked_by,
                    element: ctx.element.clone(),
                });
                self.natted.push(ctx.hook);
                Flow::Verdict(Terminal::Accept)
            }
            Stmt::Reject => Flow::Verdict(Terminal::Reject),
            Stmt::NotInSet { key, set } => {
                let set = self.set(ctx, set, key)?;
                let key = self.key(ctx, stmt, key)?;
                if set.kind == SetKind::Dynamic {
                    holds(!self.dynamic_lookup(ctx, set, &key))
                } else {
                    holds(self.lookup(ctx, set, &key).is_none())
                }
            }
            // Writes from the packet path: effects on this branch's dynamic sets, without a
            // condition (a full set would still let the rule go on, which nodeproxy's rules do
            // not rely on: the DNAT is in a rule of its own).
            Stmt::UpdateSet { key, set, .. } | Stmt::DeleteFromSet { key, set } => {
                let declared = self.set(ctx, set, key)?;
                if declared.kind != SetKind::Dynamic {
                    return Err(self.unsupported(
                        ctx,
                        stmt,
                        "update or delete of a set that is not dynamic",
                    ));
                }
                let key = self.key(ctx, stmt, key)?;
                let name = declared.name.clone();
                let note = format!("@{name}: {}", render::atoms(&key));
                if matches!(stmt, Stmt::UpdateSet { .. }) {
                    ctx.notes.push(format!("{note} written"));
                    self.dynamic.entry(name).or_default().insert(key);
                } else if self.dynamic.get_mut(&name).is_some_and(|s| s.remove(&key)) {
                    ctx.notes.push(format!("{note} deleted"));
                }
                Flow::Next
            }
            Stmt::RandomIs { modulus: 0, .. } => {
                return Err(self.unsupported(ctx, stmt, "numgen modulus 0"));
            }
            // Forks like a numgen key: one branch per value.
            Stmt::RandomIs { modulus, value } => holds(self.numgen(*modulus) == *value),
            Stmt::Verdict(v) => Flow::Verdict(terminal(v)),
        })
    }
}

fn terminal(v: &Verdict) -> Terminal {
    match v {
        Verdict::Accept => Terminal::Accept,
        Verdict::Drop => Terminal::Drop,
        Verdict::Jump(c) => Terminal::Jump(c.clone()),
        Verdict::Goto(c) => Terminal::Goto(c.clone()),
        Verdict::Return => Terminal::Return,
    }
}

/// The chain a `jump`/`goto` names; the kernel refuses missing targets and base chains.
fn regular_chain<'t>(table: &'t Table, from: &str, target: &str) -> Result<&'t Chain, EvalError> {
    let bad = |why| EvalError::BadTarget {
        chain: from.to_string(),
        target: target.to_string(),
        why,
    };
    let chain = table
        .chain(target)
        .ok_or_else(|| bad("does not exist in the table"))?;
    if chain.base.is_some() {
        return Err(bad("is a base chain"));
    }
    Ok(chain)
}

#[cfg(test)]
mod tests;
