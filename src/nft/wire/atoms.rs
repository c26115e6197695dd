//! Key fields and atoms in the kernel's byte layout: field sizes and offsets, concatenation
//! types and padding, encoding and decoding atoms, and formatting keys for error messages.

use super::*;

// ---- key fields ----

pub(super) struct FieldInfo {
    /// nft datatype id.
    pub(super) type_id: u32,
    /// Length in bytes before padding.
    pub(super) len: u32,
}

pub(super) fn field_info(family: IpFamily, f: KeyField) -> FieldInfo {
    match f {
        KeyField::Saddr | KeyField::Daddr | KeyField::CtOrigDaddr => match family {
            IpFamily::V4 => FieldInfo { type_id: 7, len: 4 },
            IpFamily::V6 => FieldInfo {
                type_id: 8,
                len: 16,
            },
        },
        KeyField::L4Proto => FieldInfo {
            type_id: 12,
            len: 1,
        },
        KeyField::ThDport => FieldInfo {
            type_id: 13,
            len: 2,
        },
        // numgen and jhash are `integer`s of 32 bits, host byte order.
        KeyField::Numgen { .. } | KeyField::Jhash { .. } => FieldInfo { type_id: 4, len: 4 },
    }
}

pub(super) fn pad4(n: u32) -> u32 {
    (n + 3) & !3
}

/// [`pad4`] of a byte length.
pub(super) fn pad4_len(n: usize) -> usize {
    (n + 3) & !3
}

/// (type id, length) of a key or data concatenation: sub-type ids shifted by 6 bits each, the
/// first field most significant; each field padded to 4 bytes unless it is the only one.
pub(crate) fn concat_type(family: IpFamily, fields: &[KeyField]) -> (u32, u32) {
    let mut ty = 0u32;
    let mut len = 0u32;
    for f in fields {
        let i = field_info(family, *f);
        ty = (ty << 6) | i.type_id;
        len += if fields.len() == 1 {
            i.len
        } else {
            pad4(i.len)
        };
    }
    (ty, len)
}

pub(crate) fn addr_offset(family: IpFamily, field: AddrField) -> u32 {
    match (family, field) {
        (IpFamily::V4, AddrField::Saddr) => 12,
        (IpFamily::V4, AddrField::Daddr) => 16,
        (IpFamily::V6, AddrField::Saddr) => 8,
        (IpFamily::V6, AddrField::Daddr) => 24,
    }
}

/// Encodes one key or data atom list (padded to 4 bytes per field when concatenated), in
/// `scratch`, a buffer the caller reuses: most keys and values are held inline
/// ([`ElemBytes`]), and a vector per encoding was an allocation and a free per key and value
/// (encoding took 81 instead of 65 M instructions of a cold `--once` at 10k × 10).
pub(super) fn encode_atoms(
    scratch: &mut Vec<u8>,
    family: IpFamily,
    fields: &[KeyField],
    atoms: &Atoms,
) -> Result<ElemBytes, String> {
    encode_atoms_at(scratch, family, fields, atoms, false)
}

/// Encodes the first (`end` false) or last (`end` true) key of a range element: ranges
/// ([`Atom::Net`]) contribute their first or last address, other atoms themselves.
pub(super) fn encode_atoms_at(
    scratch: &mut Vec<u8>,
    family: IpFamily,
    fields: &[KeyField],
    atoms: &Atoms,
    end: bool,
) -> Result<ElemBytes, String> {
    if fields.len() != atoms.len() {
        return Err(format!(
            "has {} fields, its set has {}",
            atoms.len(),
            fields.len()
        ));
    }
    let concat = fields.len() > 1;
    let out = scratch;
    out.clear();
    for (f, a) in fields.iter().zip(atoms) {
        let start = out.len();
        match (f, a, family) {
            (
                KeyField::Saddr | KeyField::Daddr | KeyField::CtOrigDaddr,
                Atom::Addr(IpAddr::V4(ip)),
                IpFamily::V4,
            ) => out.extend_from_slice(&ip.octets()),
            (
                KeyField::Saddr | KeyField::Daddr | KeyField::CtOrigDaddr,
                Atom::Addr(IpAddr::V6(ip)),
                IpFamily::V6,
            ) => out.extend_from_slice(&ip.octets()),
            (KeyField::L4Proto, Atom::Proto(p), _) => out.push(p.number()),
            (KeyField::ThDport, Atom::Port(p), _) => out.extend_from_slice(&p.to_be_bytes()),
            (KeyField::Numgen { .. } | KeyField::Jhash { .. }, Atom::Int(i), _) => {
                out.extend_from_slice(&i.to_ne_bytes())
            }
            (KeyField::Saddr | KeyField::Daddr, Atom::Net(net), _)
                if IpFamily::of(&net.addr()) == family =>
            {
                let addr = if end { net.broadcast() } else { net.network() };
                match addr {
                    IpAddr::V4(ip) => out.extend_from_slice(&ip.octets()),
                    IpAddr::V6(ip) => out.extend_from_slice(&ip.octets()),
                }
            }
            _ => return Err(format!("value {a:?} does not fit field {f:?}")),
        }
        if concat {
            let l = out.len() - start;
            out.resize(start + pad4_len(l), 0);
        }
    }
    Ok(ElemBytes::from(out.as_slice()))
}

/// The inverse of [`encode_atoms`] for exact values (no ranges): the atoms `bytes` hold for
/// `fields`, or `None` when they do not have that shape (wrong length, a protocol no Service
/// uses). Reads back what nodeproxy wrote.
pub fn decode_atoms(family: IpFamily, fields: &[KeyField], bytes: &[u8]) -> Option<Vec<Atom>> {
    let concat = fields.len() > 1;
    let mut pos = 0usize;
    let mut out = Vec::with_capacity(fields.len());
    for f in fields {
        let len = field_info(family, *f).len as usize;
        let b = bytes.get(pos..pos + len)?;
        out.push(match f {
            KeyField::Saddr | KeyField::Daddr | KeyField::CtOrigDaddr => match family {
                IpFamily::V4 => {
                    Atom::Addr(IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(b).ok()?)))
                }
                IpFamily::V6 => {
                    Atom::Addr(IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(b).ok()?)))
                }
            },
            KeyField::L4Proto => Atom::Proto(Protocol::from_number(*b.first()?)?),
            KeyField::ThDport => Atom::Port(u16::from_be_bytes(b.try_into().ok()?)),
            KeyField::Numgen { .. } | KeyField::Jhash { .. } => {
                Atom::Int(u32::from_ne_bytes(b.try_into().ok()?))
            }
        });
        pos += if concat { pad4_len(len) } else { len };
    }
    (pos == bytes.len()).then_some(out)
}

// ---- formatting keys for error messages ----

pub(super) fn proto_name(p: u8) -> String {
    match p {
        6 => "tcp".into(),
        17 => "udp".into(),
        132 => "sctp".into(),
        n => n.to_string(),
    }
}

/// Formats concatenated key or data bytes given the set's (concat) type id.
pub fn format_concat(type_id: u32, bytes: &[u8]) -> String {
    let mut ids = Vec::new();
    let mut t = type_id;
    while t != 0 && ids.len() < 8 {
        ids.push(t & 0x3f);
        t >>= 6;
    }
    ids.reverse();
    let concat = ids.len() > 1;
    let mut out = String::new();
    let mut pos = 0usize;
    for (i, id) in ids.iter().enumerate() {
        if i > 0 {
            out.push_str(" . ");
        }
        let len = match id {
            7 => 4,
            8 => 16,
            12 => 1,
            13 => 2,
            _ => 4,
        };
        let Some(b) = bytes.get(pos..pos + len) else {
            let _ = write!(out, "0x{}", hex(&bytes[pos.min(bytes.len())..]));
            return out;
        };
        match id {
            7 => {
                let _ = write!(out, "{}", Ipv4Addr::new(b[0], b[1], b[2], b[3]));
            }
            8 => {
                let mut a = [0u8; 16];
                a.copy_from_slice(b);
                let _ = write!(out, "{}", Ipv6Addr::from(a));
            }
            12 => out.push_str(&proto_name(b[0])),
            13 => {
                let _ = write!(out, "{}", u16::from_be_bytes([b[0], b[1]]));
            }
            _ => {
                let _ = write!(out, "{}", u32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
            }
        }
        pos += if concat { len.div_ceil(4) * 4 } else { len };
    }
    if ids.is_empty() {
        out = format!("0x{}", hex(bytes));
    }
    out
}

pub fn hex(b: &[u8]) -> String {
    b.iter()
        .fold(String::with_capacity(b.len() * 2), |mut s, x| {
            let _ = write!(s, "{x:02x}");
            s
        })
}
