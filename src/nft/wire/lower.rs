//! Lowering the ruleset IR to the wire form: statements to expressions, sets with their
//! elements, rules, chains and the table.

use super::*;

/// The bytes nft compares for a prefix match, and the mask when the prefix is not byte-aligned:
/// nft loads only the prefix bytes for /8, /16, …, and the whole address plus a bitwise mask
/// otherwise (verified with `nft --debug=netlink`, nft 1.0.6).
pub(super) fn prefix_match(
    family: IpFamily,
    field: AddrField,
    negate: bool,
    net: &ipnet::IpNet,
) -> Vec<WireExpr> {
    let addr: Vec<u8> = match net.network() {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    };
    let plen = net.prefix_len() as usize;
    let op = if negate { NFT_CMP_NEQ } else { NFT_CMP_EQ };
    let off = addr_offset(family, field);
    if plen.is_multiple_of(8) && plen > 0 {
        let n = plen / 8;
        vec![
            payload(1, NFT_PAYLOAD_NETWORK_HEADER, off, len_u32(n)),
            cmp(op, &addr[..n]),
        ]
    } else {
        let mask: Vec<u8> = match net.netmask() {
            IpAddr::V4(m) => m.octets().to_vec(),
            IpAddr::V6(m) => m.octets().to_vec(),
        };
        let zero = vec![0u8; addr.len()];
        vec![
            payload(1, NFT_PAYLOAD_NETWORK_HEADER, off, len_u32(addr.len())),
            bitwise(&mask, &zero),
            cmp(op, &addr),
        ]
    }
}

pub(super) fn lower_stmt(
    family: IpFamily,
    table: &Table,
    stmt: &Stmt,
    out: &mut Vec<WireExpr>,
) -> Result<(), String> {
    let z = 0u32.to_ne_bytes();
    match stmt {
        Stmt::CtStateNew | Stmt::CtStatusDnat => {
            let (key, bit) = if matches!(stmt, Stmt::CtStateNew) {
                (NFT_CT_STATE, CT_STATE_NEW)
            } else {
                (NFT_CT_STATUS, IPS_DST_NAT)
            };
            out.push(ct_load(key));
            out.push(bitwise(&bit.to_ne_bytes(), &z));
            out.push(cmp(NFT_CMP_NEQ, &z));
        }
        Stmt::AddrMatch { field, negate, net } => {
            if IpFamily::of(&net.addr()) != family {
                return Err(format!("address match {net} in a table of family {family}"));
            }
            out.extend(prefix_match(family, *field, *negate, net));
        }
        Stmt::InSet { key, set } | Stmt::Vmap { key, map: set } => {
            check_set_key(family, table, set, key)?;
            let interval = table.set(set).is_some_and(|s| s.kind == SetKind::Interval);
            load_key_for(family, key, interval, out);
            let dreg = matches!(stmt, Stmt::Vmap { .. }).then_some(0);
            out.push(lookup(set, dreg));
        }
        Stmt::NotInSet { key, set } => {
            check_set_key(family, table, set, key)?;
            let interval = table.set(set).is_some_and(|s| s.kind == SetKind::Interval);
            load_key_for(family, key, interval, out);
            out.push(lookup_flags(set, None, NFT_LOOKUP_F_INV));
        }
        Stmt::UpdateSet {
            key,
            set,
            timeout_secs,
        } => {
            check_set_key(family, table, set, key)?;
            if table.set(set).is_none_or(|s| s.kind != SetKind::Dynamic) {
                return Err(format!("update of @{set}, which is not a dynamic set"));
            }
            load_key(family, key, out);
            // The kernel dumps the timeout in milliseconds as a 64-bit value, and the flags.
            let ms = u64::from(*timeout_secs) * 1000;
            out.push(WireExpr::new(
                "dynset",
                vec![
                    (DYNSET_SET_NAME, cstring(set)),
                    (DYNSET_OP, be(NFT_DYNSET_OP_UPDATE)),
                    (DYNSET_SREG_KEY, be(1)),
                    (DYNSET_TIMEOUT, ms.to_be_bytes().to_vec()),
                    (DYNSET_FLAGS, be(0)),
                ],
            ));
        }
        Stmt::DeleteFromSet { key, set } => {
            check_set_key(family, table, set, key)?;
            if table.set(set).is_none_or(|s| s.kind != SetKind::Dynamic) {
                return Err(format!("delete from @{set}, which is not a dynamic set"));
            }
            load_key(family, key, out);
            // The kernel dumps a timeout (0) and flags for every dynset, whatever its operation.
            out.push(WireExpr::new(
                "dynset",
                vec![
                    (DYNSET_SET_NAME, cstring(set)),
                    (DYNSET_OP, be(NFT_DYNSET_OP_DELETE)),
                    (DYNSET_SREG_KEY, be(1)),
                    (DYNSET_TIMEOUT, 0u64.to_be_bytes().to_vec()),
                    (DYNSET_FLAGS, be(0)),
                ],
            ));
        }
        Stmt::RandomIs { modulus, value } => {
            out.push(WireExpr::new(
                "numgen",
                vec![
                    (NG_DREG, be(1)),
                    (NG_MODULUS, be(*modulus)),
                    (NG_TYPE, be(NFT_NG_RANDOM)),
                    (NG_OFFSET, be(0)),
                ],
            ));
            // numgen writes a host-endian u32.
            out.push(cmp(NFT_CMP_EQ, &value.to_ne_bytes()));
        }
        Stmt::MarkTest { mask } => {
            out.push(meta_load(NFT_META_MARK, 1));
            out.push(bitwise(&mask.to_ne_bytes(), &z));
            out.push(cmp(NFT_CMP_NEQ, &z));
        }
        Stmt::MarkOr(bits) | Stmt::MarkXor(bits) => {
            // nft expresses `mark | b` as `(mark & ~b) ^ b` and `mark ^ b` as `(mark & ~0) ^ b`.
            let mask = if matches!(stmt, Stmt::MarkOr(_)) {
                !bits
            } else {
                u32::MAX
            };
            out.push(meta_load(NFT_META_MARK, 1));
            out.push(bitwise(&mask.to_ne_bytes(), &bits.to_ne_bytes()));
            out.push(WireExpr::new(
                "meta",
                vec![(META_KEY, be(NFT_META_MARK)), (META_SREG, be(1))],
            ));
        }
        Stmt::DnatMap { key, map } => {
            check_set_key(family, table, map, key)?;
            let data = match table.set(map).and_then(|s| s.data.as_ref()) {
                Some(SetData::Value(fields)) => fields.clone(),
                _ => return Err(format!("dnat map @{map} is not a map to address (. port)")),
            };
            load_key(family, key, out);
            out.push(lookup(map, Some(1)));
            let addr_words = pad4(field_info(family, KeyField::Daddr).len) / 4;
            let mut attrs = vec![
                (NAT_TYPE, be(NFT_NAT_DNAT)),
                (NAT_FAMILY, be(u32::from(nfproto(family)))),
                (NAT_REG_ADDR_MIN, be(1)),
                (NAT_REG_ADDR_MAX, be(1)),
            ];
            let mut flags = NF_NAT_RANGE_MAP_IPS;
            if data.contains(&KeyField::ThDport) {
                attrs.push((NAT_REG_PROTO_MIN, be(reg(addr_words))));
                attrs.push((NAT_REG_PROTO_MAX, be(reg(addr_words))));
                flags |= NF_NAT_RANGE_PROTO_SPECIFIED;
            }
            attrs.push((NAT_FLAGS, be(flags)));
            out.push(WireExpr::new("nat", attrs));
        }
        Stmt::Masquerade { fully_random } => {
            let attrs = if *fully_random {
                vec![(MASQ_FLAGS, be(NF_NAT_RANGE_PROTO_RANDOM_FULLY))]
            } else {
                Vec::new()
            };
            out.push(WireExpr::new("masq", attrs));
        }
        Stmt::Reject => {
            let code = match family {
                IpFamily::V4 => ICMP_PORT_UNREACH,
                IpFamily::V6 => ICMPV6_PORT_UNREACH,
            };
            out.push(WireExpr::new(
                "reject",
                vec![
                    (REJECT_TYPE, be(NFT_REJECT_ICMP_UNREACH)),
                    (REJECT_ICMP_CODE, vec![code]),
                ],
            ));
        }
        Stmt::FibLocal { field } => {
            let flag = match field {
                AddrField::Saddr => NFTA_FIB_F_SADDR,
                AddrField::Daddr => NFTA_FIB_F_DADDR,
            };
            out.push(WireExpr::new(
                "fib",
                vec![
                    (FIB_DREG, be(1)),
                    (FIB_RESULT, be(NFT_FIB_RESULT_ADDRTYPE)),
                    (FIB_FLAGS, be(flag)),
                ],
            ));
            out.push(cmp(NFT_CMP_EQ, &RTN_LOCAL.to_ne_bytes()));
        }
        Stmt::Iifname {
            name,
            prefix,
            negate,
        } => {
            // nft compares a wildcard name by its prefix bytes only, and an exact name as the
            // whole NUL-padded IFNAMSIZ buffer (so "eth0" does not match "eth01").
            let bytes = name.as_bytes();
            if bytes.len() >= IFNAMSIZ || (bytes.is_empty() && *prefix) {
                return Err(format!("interface name {name:?} is not 1 to 15 bytes"));
            }
            let mut data = bytes.to_vec();
            if !*prefix {
                data.resize(IFNAMSIZ, 0);
            }
            let op = if *negate { NFT_CMP_NEQ } else { NFT_CMP_EQ };
            out.push(meta_load(NFT_META_IIFNAME, 1));
            out.push(cmp(op, &data));
        }
        Stmt::Verdict(v) => {
            let (code, chain) = verdict_code(v);
            out.push(WireExpr::new(
                "immediate",
                vec![
                    (IMMEDIATE_DREG, be(0)),
                    (IMMEDIATE_DATA, data_verdict(code, chain)),
                ],
            ));
        }
    }
    Ok(())
}

pub(super) fn check_set_key(
    family: IpFamily,
    table: &Table,
    set: &str,
    key: &[KeyField],
) -> Result<(), String> {
    let Some(s) = table.set(set) else {
        return Err(format!("references missing set @{set}"));
    };
    if concat_type(family, &s.key) != concat_type(family, key) {
        return Err(format!("key does not match the type of @{set}"));
    }
    Ok(())
}

pub(super) fn hook_of(b: &BaseChain) -> WireHook {
    let hooknum = match b.hook {
        Hook::Prerouting => 0,
        Hook::Input => 1,
        Hook::Forward => 2,
        Hook::Output => 3,
        Hook::Postrouting => 4,
    };
    let kind = match b.kind {
        ChainType::Filter => "filter",
        ChainType::Nat => "nat",
    };
    WireHook {
        hooknum,
        priority: b.priority,
        kind: kind.to_owned(),
        policy: NF_ACCEPT as u32,
    }
}

/// Lowers a set's definition and `elements` (the set's own, borrowed or moved out of it: when
/// moved, each IR element is freed as soon as it is encoded, which keeps the peak memory of a
/// 10k-service sync at one copy of the elements instead of two).
pub(super) fn lower_set<E: Borrow<Element>>(
    family: IpFamily,
    table_desc: &str,
    set: &Set,
    elements: impl IntoIterator<Item = E>,
    chains: &mut HashMap<String, Arc<str>>,
) -> Result<WireSet, NftError> {
    let obj = || {
        format!(
            "{} {} of {table_desc}",
            if set.data.is_some() { "map" } else { "set" },
            set.name
        )
    };
    let (key_type, key_len) = concat_type(family, &set.key);
    let interval = set.kind == SetKind::Interval;
    // The kernel keeps single-field intervals as pairs of elements (start, end flag); only
    // concatenations of ranges (one element with KEY_END) are supported here.
    if interval && set.key.len() < 2 {
        return Err(NftError::Invalid {
            object: obj(),
            reason: "interval sets must have a concatenated key".into(),
            origin: None,
        });
    }
    let kind_flags = match set.kind {
        SetKind::Hash => 0,
        SetKind::Interval => SET_F_INTERVAL | SET_F_CONCAT,
        SetKind::Dynamic => SET_F_TIMEOUT | SET_F_EVAL,
    };
    let concat = if interval {
        set.key.iter().map(|f| field_info(family, *f).len).collect()
    } else {
        Vec::new()
    };
    let (flags, data_type, data_len) = match &set.data {
        None => (0, None, None),
        Some(SetData::Verdict) => (SET_F_MAP, Some(DATA_TYPE_VERDICT), Some(VERDICT_DATA_LEN)),
        Some(SetData::Value(fields)) => {
            let (t, l) = concat_type(family, fields);
            (SET_F_MAP, Some(t), Some(l))
        }
    };
    let mut wire_elements = BTreeMap::new();
    let mut comments: HashMap<Arc<str>, Arc<[u8]>> = HashMap::new();
    for e in elements {
        let e = e.borrow();
        let bad = |reason: String| NftError::Invalid {
            object: format!("element {:?} in {}", e.key, obj()),
            reason,
            origin: e.origin.as_deref().cloned().map(Box::new),
        };
        let key = encode_atoms(family, &set.key, &e.key).map_err(bad)?;
        let key_end = if interval {
            Some(encode_atoms_at(family, &set.key, &e.key, true).map_err(bad)?)
        } else {
            None
        };
        let data = match (&set.data, &e.data) {
            (None, None) => None,
            (Some(SetData::Verdict), Some(ElemData::Verdict(v))) => {
                let (code, chain) = verdict_code(v);
                let chain = chain.map(|c| {
                    chains
                        .entry(c.to_owned())
                        .or_insert_with(|| Arc::from(c))
                        .clone()
                });
                Some(WireData::Verdict { code, chain })
            }
            (Some(SetData::Value(fields)), Some(ElemData::Value(atoms))) => Some(WireData::Value(
                encode_atoms(family, fields, atoms).map_err(bad)?,
            )),
            _ => return Err(bad("element data does not match the set's data type".into())),
        };
        let userdata = e.comment.as_ref().filter(|c| !c.is_empty()).map(|c| {
            comments
                .entry(c.clone())
                .or_insert_with(|| Arc::from(udata::comment(c)))
                .clone()
        });
        let elem = WireElem {
            key_end,
            data,
            userdata,
            origin: e.origin.clone(),
        };
        if wire_elements.insert(key, elem).is_some() {
            return Err(bad("duplicate key".into()));
        }
    }
    Ok(WireSet {
        flags: flags | kind_flags,
        key_type,
        key_len,
        data_type,
        data_len,
        userdata: udata::set_udata(family, set),
        concat,
        elements: wire_elements,
    })
}

pub(super) fn lower_rule(family: IpFamily, table: &Table, rule: &Rule) -> Result<WireRule, String> {
    let mut exprs = Vec::new();
    for s in &rule.stmts {
        lower_stmt(family, table, s, &mut exprs)?;
    }
    Ok(WireRule { exprs })
}

/// Lowers one table of the IR to its wire form. Pure; fails only on an IR that cannot be
/// expressed (a key that does not match its set, a reference to a missing set).
pub fn lower(table: &Table) -> Result<WireTable, NftError> {
    let mut next = 0;
    lower_impl(table, |_| {
        next += 1;
        table
            .sets
            .get(next - 1)
            .into_iter()
            .flat_map(|s| s.elements.iter())
    })
}

/// Like [`lower`], but consumes the table and frees its elements as they are encoded.
pub fn lower_owned(mut table: Table) -> Result<WireTable, NftError> {
    let mut element_lists: Vec<Vec<Element>> = table
        .sets
        .iter_mut()
        .map(|s| std::mem::take(&mut s.elements))
        .collect();
    element_lists.reverse();
    lower_impl(&table, |_| element_lists.pop().unwrap_or_default())
}

pub(super) fn lower_impl<E: Borrow<Element>, I: IntoIterator<Item = E>>(
    table: &Table,
    mut elements_of: impl FnMut(&Set) -> I,
) -> Result<WireTable, NftError> {
    let family = table.family;
    let mut w = WireTable::new(family, &table.name);
    let desc = w.describe();
    w.userdata = udata::comment(&table.comment);
    if table.owned {
        w.flags = TABLE_F_OWNED;
    }
    let mut chain_names: HashMap<String, Arc<str>> = HashMap::new();
    for set in &table.sets {
        let ws = lower_set(family, &desc, set, elements_of(set), &mut chain_names)?;
        w.add_set(&set.name, ws);
    }
    for c in &table.chains {
        let mut rules = Vec::with_capacity(c.rules.len());
        for (i, r) in c.rules.iter().enumerate() {
            rules.push(
                lower_rule(family, table, r).map_err(|reason| NftError::Invalid {
                    object: format!("rule {} of chain {} in {desc}", i + 1, c.name),
                    reason,
                    origin: None,
                })?,
            );
        }
        let chain = WireChain {
            hook: c.base.as_ref().map(hook_of),
            userdata: udata::comment(&c.comment),
            rules,
        };
        w.add_chain(&c.name, chain);
    }
    Ok(w)
}
