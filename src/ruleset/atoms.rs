//! An element's key or value ([`Atoms`]): its atoms packed into 31 bytes held inline, so that
//! the desired ruleset's hundreds of thousands of elements need no allocation each, in an
//! encoding whose byte order is the atoms' order, so that comparing and sorting keys reads
//! bytes instead of decoding atoms.
//!
//! Why: at 10k Services × 10 endpoints the build holds 145k elements at once, next to the
//! model; with a `Vec<Atom>` key and value (20 bytes an atom, two heap blocks) an endpoint
//! element took ~208 bytes and the desired ruleset 30.1 MiB, the largest part of `--once`'s
//! peak (docs/performance.md). Packed, an IPv4 endpoint's key takes 15 of the 30 bytes and an
//! IPv6 one's 27; longer ones (IPv6 hairpin and source-range keys, a few per Service at most)
//! are held as a boxed slice instead.

use std::cmp::Ordering;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::ops::Deref;

use super::Atom;
use crate::model::Protocol;

/// Bytes of a packed sequence's atoms: each atom's kind (one byte, never zero) and then its
/// value, big-endian, one atom after the other, then zeros. The byte after them holds the count.
///
/// Byte order is atom order: the first byte that differs is either the kind of the first atom
/// that differs (kinds are numbered in `Atom`'s variant order, an address's family deciding
/// within `Addr` and `Net`, and a sequence that ended reads a zero, smaller than any kind), or
/// a byte of two values of one kind, which are compared big-endian as their types order them.
/// Equal bytes are equal sequences: the kind decides the width.
const CONTENT: usize = 30;

/// The most atoms a packed sequence holds (every key nodeproxy builds has at most five; more
/// go to the boxed form), which is also what [`Atoms::atoms`] decodes into on the stack.
const MAX_PACKED_ATOMS: usize = 8;

/// A short sequence of [`Atom`]s: an element's key or value.
///
/// Ordered, compared and hashed as the sequence of atoms it holds (as `Vec<Atom>` was).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Atoms(Repr);

#[derive(Clone, PartialEq, Eq, Hash)]
enum Repr {
    /// [`CONTENT`] bytes, then the count.
    Packed([u8; CONTENT + 1]),
    /// What does not fit packed, and nothing that does: the choice is the encoding's, so that
    /// equal sequences have equal representations.
    Boxed(Box<[Atom]>),
}

/// An atom's kind in the packed encoding (in `Atom`'s order), and the width of its value.
const V4: u8 = 1;
const V6: u8 = 2;
const PROTO: u8 = 3;
const PORT: u8 = 4;
const INT: u8 = 5;
const NET4: u8 = 6;
const NET6: u8 = 7;

fn width(kind: u8) -> usize {
    match kind {
        V4 => 4,
        V6 => 16,
        PROTO => 1,
        PORT => 2,
        INT => 4,
        NET4 => 5,
        _ => 17,
    }
}

/// In `Protocol`'s derived order.
fn proto_code(p: Protocol) -> u8 {
    match p {
        Protocol::Tcp => 0,
        Protocol::Udp => 1,
        Protocol::Sctp => 2,
    }
}

fn proto_of(code: u8) -> Protocol {
    match code {
        0 => Protocol::Tcp,
        1 => Protocol::Udp,
        _ => Protocol::Sctp,
    }
}

/// Writes `atom` (kind, then value) into `out` from `at`, as much of it as fits; returns where
/// it ends (past `out.len()` when it did not fit whole).
fn put(out: &mut [u8], at: usize, atom: Atom) -> usize {
    let mut value = [0u8; 18];
    let (kind, n) = match atom {
        Atom::Addr(IpAddr::V4(a)) => {
            value[..4].copy_from_slice(&a.octets());
            (V4, 4)
        }
        Atom::Addr(IpAddr::V6(a)) => {
            value[..16].copy_from_slice(&a.octets());
            (V6, 16)
        }
        Atom::Proto(p) => {
            value[0] = proto_code(p);
            (PROTO, 1)
        }
        Atom::Port(p) => {
            value[..2].copy_from_slice(&p.to_be_bytes());
            (PORT, 2)
        }
        Atom::Int(v) => {
            value[..4].copy_from_slice(&v.to_be_bytes());
            (INT, 4)
        }
        Atom::Net(ipnet::IpNet::V4(net)) => {
            value[..4].copy_from_slice(&net.addr().octets());
            value[4] = net.prefix_len();
            (NET4, 5)
        }
        Atom::Net(ipnet::IpNet::V6(net)) => {
            value[..16].copy_from_slice(&net.addr().octets());
            value[16] = net.prefix_len();
            (NET6, 17)
        }
    };
    let end = at + 1 + n;
    if let Some(slot) = out.get_mut(at) {
        *slot = kind;
        let room = out.len().min(end) - at - 1;
        out[at + 1..at + 1 + room].copy_from_slice(&value[..room]);
    }
    end
}

/// Packs `atoms`, or `None` when they do not fit.
fn pack(atoms: &[Atom]) -> Option<[u8; CONTENT + 1]> {
    if atoms.len() > MAX_PACKED_ATOMS {
        return None;
    }
    let mut out = [0u8; CONTENT + 1];
    let mut at = 0;
    for atom in atoms {
        at = put(&mut out[..CONTENT], at, *atom);
        if at > CONTENT {
            return None;
        }
    }
    out[CONTENT] = u8::try_from(atoms.len()).ok()?;
    Some(out)
}

fn array<const N: usize>(b: &[u8]) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&b[..N]);
    out
}

/// One packed atom: its kind and its value's bytes (big-endian).
fn unpack(kind: u8, b: &[u8]) -> Atom {
    match kind {
        V4 => Atom::Addr(IpAddr::V4(Ipv4Addr::from(array::<4>(b)))),
        V6 => Atom::Addr(IpAddr::V6(Ipv6Addr::from(array::<16>(b)))),
        PROTO => Atom::Proto(proto_of(b[0])),
        PORT => Atom::Port(u16::from_be_bytes(array(b))),
        INT => Atom::Int(u32::from_be_bytes(array(b))),
        _ => Atom::Net(net_of(kind, b)),
    }
}

/// A packed range (`NET4` or `NET6`). Its prefix length was an `IpNet`'s, valid.
fn net_of(kind: u8, b: &[u8]) -> ipnet::IpNet {
    if kind == NET4 {
        let addr = Ipv4Addr::from(array::<4>(b));
        ipnet::IpNet::V4(ipnet::Ipv4Net::new(addr, b[4]).unwrap_or_default())
    } else {
        let addr = Ipv6Addr::from(array::<16>(b));
        ipnet::IpNet::V6(ipnet::Ipv6Net::new(addr, b[16]).unwrap_or_default())
    }
}

/// The atoms of a packed sequence, in order.
struct Unpack<'a> {
    bytes: &'a [u8; CONTENT + 1],
    left: usize,
    at: usize,
}

impl Iterator for Unpack<'_> {
    type Item = Atom;

    fn next(&mut self) -> Option<Atom> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        let kind = self.bytes[self.at];
        let value = &self.bytes[self.at + 1..];
        self.at += 1 + width(kind);
        Some(unpack(kind, value))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

/// The atoms of an [`Atoms`], in order.
pub struct Iter<'a>(IterRepr<'a>);

enum IterRepr<'a> {
    Packed(Unpack<'a>),
    Boxed(std::slice::Iter<'a, Atom>),
}

impl Iterator for Iter<'_> {
    type Item = Atom;

    fn next(&mut self) -> Option<Atom> {
        match &mut self.0 {
            IterRepr::Packed(u) => u.next(),
            IterRepr::Boxed(s) => s.next().copied(),
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        match &self.0 {
            IterRepr::Packed(u) => u.size_hint(),
            IterRepr::Boxed(s) => s.size_hint(),
        }
    }
}

impl ExactSizeIterator for Iter<'_> {}

/// The atoms of an [`Atoms`] as a slice: decoded onto the stack when packed.
pub struct Slice<'a>(SliceRepr<'a>);

enum SliceRepr<'a> {
    Decoded([Atom; MAX_PACKED_ATOMS], usize),
    Borrowed(&'a [Atom]),
}

impl Deref for Slice<'_> {
    type Target = [Atom];

    fn deref(&self) -> &[Atom] {
        match &self.0 {
            SliceRepr::Decoded(atoms, n) => &atoms[..*n],
            SliceRepr::Borrowed(s) => s,
        }
    }
}

impl Atoms {
    pub fn new(atoms: &[Atom]) -> Atoms {
        match pack(atoms) {
            Some(bytes) => Atoms(Repr::Packed(bytes)),
            None => Atoms(Repr::Boxed(atoms.into())),
        }
    }

    /// This sequence followed by `last` (a pick key: the Service's key and a slot), appended
    /// to the bytes already packed: packing the whole key afresh for each slot was 96 of the
    /// build's 646 M instructions at 50k Services, 41 M this way.
    pub fn then(&self, last: Atom) -> Atoms {
        if let Repr::Packed(bytes) = &self.0 {
            let count = usize::from(bytes[CONTENT]);
            let used = (0..count).fold(0, |at, _| at + 1 + width(bytes[at]));
            let mut out = *bytes;
            if count < MAX_PACKED_ATOMS
                && put(&mut out[..CONTENT], used, last) <= CONTENT
                && let Ok(count) = u8::try_from(count + 1)
            {
                out[CONTENT] = count;
                return Atoms(Repr::Packed(out));
            }
        }
        let mut all = self.to_vec();
        all.push(last);
        Atoms::new(&all)
    }

    pub fn len(&self) -> usize {
        match &self.0 {
            Repr::Packed(b) => usize::from(b[CONTENT]),
            Repr::Boxed(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn iter(&self) -> Iter<'_> {
        Iter(match &self.0 {
            Repr::Packed(bytes) => IterRepr::Packed(Unpack {
                bytes,
                left: usize::from(bytes[CONTENT]),
                at: 0,
            }),
            Repr::Boxed(s) => IterRepr::Boxed(s.iter()),
        })
    }

    /// The atoms as a slice.
    pub fn atoms(&self) -> Slice<'_> {
        Slice(match &self.0 {
            Repr::Packed(_) => {
                let mut out = [Atom::Int(0); MAX_PACKED_ATOMS];
                let mut n = 0;
                for (slot, atom) in out.iter_mut().zip(self.iter()) {
                    *slot = atom;
                    n += 1;
                }
                SliceRepr::Decoded(out, n)
            }
            Repr::Boxed(s) => SliceRepr::Borrowed(s),
        })
    }

    pub fn to_vec(&self) -> Vec<Atom> {
        self.iter().collect()
    }

    /// The first 16 bytes of the encoding, whose order is the sequences' (equal prefixes say
    /// nothing): what the build's radix sort sorts by.
    pub fn order_prefix(&self) -> [u8; 16] {
        match &self.0 {
            Repr::Packed(bytes) => array(&bytes[..16]),
            Repr::Boxed(atoms) => {
                let mut out = [0u8; 16];
                let mut at = 0;
                for atom in atoms.iter() {
                    at = put(&mut out, at, *atom);
                    if at >= out.len() {
                        break;
                    }
                }
                out
            }
        }
    }
}

impl Default for Atoms {
    fn default() -> Atoms {
        Atoms::new(&[])
    }
}

impl From<Vec<Atom>> for Atoms {
    fn from(atoms: Vec<Atom>) -> Atoms {
        Atoms::new(&atoms)
    }
}

impl From<&[Atom]> for Atoms {
    fn from(atoms: &[Atom]) -> Atoms {
        Atoms::new(atoms)
    }
}

impl<const N: usize> From<[Atom; N]> for Atoms {
    fn from(atoms: [Atom; N]) -> Atoms {
        Atoms::new(&atoms)
    }
}

impl<'a> IntoIterator for &'a Atoms {
    type Item = Atom;
    type IntoIter = Iter<'a>;

    fn into_iter(self) -> Iter<'a> {
        self.iter()
    }
}

impl PartialEq<[Atom]> for Atoms {
    fn eq(&self, other: &[Atom]) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter().copied())
    }
}

impl PartialEq<&[Atom]> for Atoms {
    fn eq(&self, other: &&[Atom]) -> bool {
        *self == **other
    }
}

impl PartialEq<Vec<Atom>> for Atoms {
    fn eq(&self, other: &Vec<Atom>) -> bool {
        *self == other[..]
    }
}

impl Ord for Atoms {
    fn cmp(&self, other: &Atoms) -> Ordering {
        match (&self.0, &other.0) {
            (Repr::Packed(a), Repr::Packed(b)) => a[..CONTENT].cmp(&b[..CONTENT]),
            _ => self.iter().cmp(other.iter()),
        }
    }
}

impl PartialOrd for Atoms {
    fn partial_cmp(&self, other: &Atoms) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl fmt::Debug for Atoms {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> Atom {
        Atom::Addr(s.parse().unwrap())
    }

    fn net(s: &str) -> Atom {
        Atom::Net(s.parse().unwrap())
    }

    fn samples() -> Vec<Vec<Atom>> {
        let v6 = addr("2001:db8::1");
        let tcp = Atom::Proto(Protocol::Tcp);
        vec![
            vec![],
            vec![addr("192.0.2.1")],
            vec![addr("192.0.2.1"), tcp, Atom::Port(80)],
            vec![addr("192.0.2.1"), tcp, Atom::Port(443)],
            vec![
                addr("192.0.2.1"),
                Atom::Proto(Protocol::Udp),
                Atom::Port(80),
                Atom::Int(3),
            ],
            vec![
                addr("192.0.2.1"),
                Atom::Proto(Protocol::Sctp),
                Atom::Port(443),
                Atom::Int(0),
            ],
            vec![addr("192.0.2.1"), tcp, Atom::Port(80), Atom::Int(256)],
            vec![addr("192.0.2.1"), tcp, Atom::Port(80), Atom::Int(1)],
            vec![addr("192.0.2.200"), tcp, Atom::Port(80), Atom::Int(1)],
            vec![addr("198.51.100.7"), Atom::Port(8080)],
            vec![v6, tcp, Atom::Port(65535), Atom::Int(u32::MAX)],
            vec![addr("2001:db8::2"), tcp, Atom::Port(1), Atom::Int(0)],
            vec![v6, Atom::Port(8080)],
            vec![tcp, Atom::Port(30000), Atom::Int(1)],
            vec![Atom::Port(1)],
            vec![Atom::Port(256)],
            vec![Atom::Int(0)],
            vec![net("192.0.2.0/24")],
            vec![net("192.0.2.0/25")],
            // Too long to pack: held boxed.
            vec![v6, v6, tcp, Atom::Port(80)],
            vec![v6, addr("2001:db8::2"), tcp, Atom::Port(80)],
            vec![v6, tcp, Atom::Port(80), net("2001:db8:1::/48")],
            vec![
                addr("203.0.113.9"),
                tcp,
                Atom::Port(80),
                net("192.0.2.0/24"),
            ],
            vec![Atom::Int(1); 9],
            vec![net("10.0.0.0/8"), net("2001:db8::/32")],
            // As many atoms as a packed sequence holds, with room left in its bytes.
            vec![tcp; MAX_PACKED_ATOMS],
        ]
    }

    #[test]
    fn atoms_hold_what_they_were_given_packed_when_they_fit() {
        for atoms in samples() {
            let packed = Atoms::new(&atoms);
            assert_eq!(packed.to_vec(), atoms);
            assert_eq!(&*packed.atoms(), &atoms[..]);
            assert_eq!(packed.len(), atoms.len());
            assert_eq!(packed.iter().len(), atoms.len());
            assert_eq!(packed, atoms);
        }
        let (v6, tcp) = (addr("2001:db8::1"), Atom::Proto(Protocol::Tcp));
        let endpoint_v6 = [v6, tcp, Atom::Port(80), Atom::Int(9)];
        assert!(matches!(Atoms::new(&endpoint_v6).0, Repr::Packed(_)));
        let hairpin_v6 = [v6, v6, tcp, Atom::Port(80)];
        assert!(matches!(Atoms::new(&hairpin_v6).0, Repr::Boxed(_)));
    }

    #[test]
    fn atoms_order_and_equal_as_their_atoms_do_and_so_do_their_prefixes() {
        let all = samples();
        for a in &all {
            for b in &all {
                let (pa, pb) = (Atoms::new(a), Atoms::new(b));
                assert_eq!(pa.cmp(&pb), a.cmp(b), "{a:?} against {b:?}");
                assert_eq!(pa == pb, a == b, "{a:?} against {b:?}");
                if a < b {
                    assert!(
                        pa.order_prefix() <= pb.order_prefix(),
                        "{a:?} against {b:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn an_extended_key_is_its_prefix_and_the_last_atom() {
        for atoms in samples() {
            // Every kind of last atom, so that some fill the packed bytes exactly and some
            // overflow them into the boxed form.
            let net: ipnet::IpNet = "2001:db8::/64".parse().unwrap();
            let six: IpAddr = "2001:db8::1".parse().unwrap();
            for last in [
                Atom::Int(7),
                Atom::Proto(Protocol::Udp),
                Atom::Addr(six),
                Atom::Net(net),
            ] {
                let mut want = atoms.clone();
                want.push(last);
                let then = Atoms::new(&atoms).then(last);
                assert_eq!(then.to_vec(), want);
                assert_eq!(then, Atoms::new(&want), "{atoms:?} then {last:?}");
            }
        }
    }

    #[test]
    fn an_element_holds_its_key_and_value_inline() {
        assert_eq!(std::mem::size_of::<Atoms>(), 32);
        assert!(std::mem::size_of::<super::super::Element>() <= 96);
    }
}
