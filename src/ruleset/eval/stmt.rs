//! How each statement decides on a packet: matches, set and map lookups (dynamic sets
//! included), `numgen` forks, NAT and verdicts. The match on [`Stmt`] is exhaustive on purpose:
//! a new statement kind gets its arm here or the build fails.

use super::*;

impl<'a> Run<'a> {
    /// The next `numgen random mod modulus` value of this branch.
    pub(super) fn numgen(&mut self, modulus: u32) -> u32 {
        let pos = self.choices.len();
        let value = self.forced.get(pos).copied().unwrap_or(0);
        self.choices.push(value);
        self.moduli.push(modulus);
        value
    }

    /// The packet's value of each key field, in order.
    pub(super) fn key(
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
                    KeyField::CtOrigDaddr => Atom::Addr(self.original_dst),
                    KeyField::Jhash { input, seed } => {
                        let values = self.key(ctx, stmt, input.fields())?;
                        let mut h = std::hash::DefaultHasher::new();
                        std::hash::Hash::hash(&(values, seed), &mut h);
                        // The kernel's value is 32 bits, below the modulus.
                        let h =
                            std::hash::Hasher::finish(&h) % u64::from(super::super::JHASH_MODULUS);
                        Atom::Int(u32::try_from(h).unwrap_or(0))
                    }
                })
            })
            .collect()
    }

    pub(super) fn unsupported(&self, ctx: &RuleCtx<'_>, stmt: &Stmt, why: &str) -> EvalError {
        EvalError::Unsupported {
            stmt: render::stmt(self.family, stmt),
            chain: ctx.chain.to_string(),
            why: why.to_string(),
        }
    }

    /// The set `name` of the table `ctx.chain` belongs to, with a key of the lookup's shape.
    pub(super) fn set(
        &self,
        ctx: &RuleCtx<'a>,
        name: &str,
        key: &[KeyField],
    ) -> Result<&'a Set, EvalError> {
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
    pub(super) fn lookup(
        &self,
        ctx: &mut RuleCtx<'_>,
        set: &'a Set,
        key: &[Atom],
    ) -> Option<&'a Element> {
        // Exact match, except that a range atom (interval sets) matches the addresses in it.
        let matches = |e: &Element| {
            e.key.len() == key.len()
                && e.key
                    .iter()
                    .zip(key)
                    .all(|(have, want)| match (have, want) {
                        (Atom::Net(net), Atom::Addr(addr)) => net.contains(addr),
                        _ => have == *want,
                    })
        };
        let elem = set.elements.iter().find(|e| matches(e))?;
        let mut note = format!("@{}: {}", set.name, render::atoms(&elem.key.atoms()));
        match &elem.data {
            None => {}
            Some(ElemData::Verdict(v)) => {
                note.push_str(&format!(" : {}", render::verdict(v)));
            }
            Some(ElemData::Value(values)) => {
                note.push_str(&format!(" : {}", render::atoms(&values.atoms())));
            }
        }
        if let Some(label) = elem.label() {
            note.push_str(&format!("  ({label})"));
        }
        ctx.element = Some(note.clone());
        ctx.notes.push(note);
        Some(elem)
    }

    /// The data of `key` in a dynamic set (empty in a set), if it holds the key; records a hit
    /// on the rule.
    pub(super) fn dynamic_lookup(
        &self,
        ctx: &mut RuleCtx<'_>,
        set: &Set,
        key: &[Atom],
    ) -> Option<Vec<Atom>> {
        let data = self.dynamic.get(&set.name)?.get(key)?.clone();
        let mut note = format!("@{}: {}", set.name, render::atoms(key));
        if !data.is_empty() {
            note.push_str(&format!(" : {}", render::atoms(&data)));
        }
        note.push_str(" (written by an earlier connection)");
        ctx.element = Some(note.clone());
        ctx.notes.push(note);
        Some(data)
    }

    pub(super) fn rule_ref(&self, ctx: &RuleCtx<'_>) -> RuleRef {
        RuleRef {
            chain: ctx.chain.to_string(),
            rule: ctx.text.clone(),
        }
    }

    /// One statement. Every variant has its own arm (no wildcard) so that a new statement
    /// cannot be evaluated by accident: it does not compile until someone decides here.
    pub(super) fn stmt(&mut self, ctx: &mut RuleCtx<'_>, stmt: &Stmt) -> Result<Flow, EvalError> {
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
                    holds(self.dynamic_lookup(ctx, set, &key).is_some())
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
                    Some(ElemData::Value(v)) => match *v.atoms() {
                        [Atom::Addr(addr), Atom::Port(port)] => SocketAddr::new(addr, port),
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
                    comment: elem.label(),
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
                    holds(self.dynamic_lookup(ctx, set, &key).is_none())
                } else {
                    holds(self.lookup(ctx, set, &key).is_none())
                }
            }
            // Writes from the packet path: effects on this branch's dynamic sets, without a
            // condition (a full set would still let the rule go on, which nodeproxy's rules do
            // not rely on: the DNAT is in a rule of its own).
            Stmt::UpdateSet { key, set, data, .. } | Stmt::DeleteFromSet { key, set, data } => {
                let declared = self.set(ctx, set, key)?;
                if declared.kind != SetKind::Dynamic {
                    return Err(self.unsupported(
                        ctx,
                        stmt,
                        "update or delete of a set that is not dynamic",
                    ));
                }
                if declared.data.is_some() != data.is_some() {
                    return Err(self.unsupported(ctx, stmt, "data that does not fit the set"));
                }
                let key = self.key(ctx, stmt, key)?;
                let data = match data {
                    Some(field) => self.key(ctx, stmt, &[*field])?,
                    None => Vec::new(),
                };
                let name = declared.name.clone();
                let note = format!("@{name}: {}", render::atoms(&key));
                if matches!(stmt, Stmt::UpdateSet { .. }) {
                    let elements = self.dynamic.entry(name).or_default();
                    // An update never changes the data of a key that is there
                    // (`nft_dynset_eval` only refreshes its expiration).
                    match elements.entry(key) {
                        std::collections::btree_map::Entry::Occupied(_) => {
                            ctx.notes.push(format!("{note} refreshed"));
                        }
                        std::collections::btree_map::Entry::Vacant(slot) => {
                            let shown = if data.is_empty() {
                                String::new()
                            } else {
                                format!(" : {}", render::atoms(&data))
                            };
                            ctx.notes.push(format!("{note}{shown} written"));
                            slot.insert(data);
                        }
                    }
                } else if self
                    .dynamic
                    .get_mut(&name)
                    .is_some_and(|s| s.remove(&key).is_some())
                {
                    ctx.notes.push(format!("{note} deleted"));
                }
                Flow::Next
            }
            Stmt::DaddrFromMap { key, map } => {
                let set = self.set(ctx, map, key)?;
                let key = self.key(ctx, stmt, key)?;
                let data = if set.kind == SetKind::Dynamic {
                    self.dynamic_lookup(ctx, set, &key)
                } else {
                    match self.lookup(ctx, set, &key).map(|e| &e.data) {
                        Some(Some(ElemData::Value(v))) => Some(v.to_vec()),
                        Some(_) => {
                            return Err(self.unsupported(ctx, stmt, "map element without data"));
                        }
                        None => None,
                    }
                };
                match data.as_deref() {
                    // A miss ends the rule, like a failed match.
                    None => Flow::Break,
                    Some([Atom::Addr(addr)]) if IpFamily::of(addr) == self.family => {
                        self.pkt.dst = *addr;
                        Flow::Next
                    }
                    Some(_) => {
                        return Err(self.unsupported(ctx, stmt, "map data other than an address"));
                    }
                }
            }
            Stmt::DaddrRestore => {
                self.pkt.dst = self.original_dst;
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
        Verdict::Jump(c) => Terminal::Jump(c.to_string()),
        Verdict::Goto(c) => Terminal::Goto(c.to_string()),
        Verdict::Return => Terminal::Return,
    }
}
