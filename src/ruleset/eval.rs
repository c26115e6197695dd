//! Packet-path evaluation over the [`Ruleset`] IR (DESIGN §7 tier 3): for the first packet of a
//! new connection, which hooks and chains it goes through, which rules match, where it is DNATed
//! to, whether it is masqueraded, and whether it is accepted, dropped or rejected.
//!
//! This models nftables only as far as nodeproxy uses it, and refuses what it does not model:
//! a statement the evaluator cannot decide is an [`EvalError::Unsupported`] naming the
//! statement, never a silent pass, because a test that "passes" through an unmodelled match
//! proves nothing. Adding a `Stmt` variant means adding one arm to [`Run::stmt`] in
//! `eval/stmt.rs` (the match is exhaustive on purpose, so the compiler points there).
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
//!   [`DynamicSets`] ([`evaluate`] starts from none). `update` and `delete` change them (an
//!   `update` of a key that is there keeps its data, as the kernel does), and each [`Branch`]
//!   carries the sets as it left them: evaluating the same client's next connection with a
//!   branch's sets shows where that client is pinned.
//! - `ip daddr set …` rewrites the destination the later rules see; `ct original ip daddr` is
//!   the destination the packet arrived with. A `jhash` is a hash of the same fields, not the
//!   kernel's value: only the evaluator reads the keys it writes.

use crate::ruleset::Comment;
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use super::render;
use super::{
    AddrField, Atom, Chain, ChainType, ElemData, Element, Hook, KeyField, Rule, Ruleset, Set,
    SetData, SetKind, Stmt, Table, Verdict,
};
use crate::model::{IpFamily, Protocol};

mod stmt;
mod trace;

pub use trace::{
    Branch, Dnat, DynamicSets, EvalError, Fate, Masquerade, Origin, Packet, Route, RuleRef, Step,
    Trace,
};

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
    /// The destination the connection was opened to: `ct original … daddr`.
    original_dst: IpAddr,
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
            original_dst: pkt.dst,
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
