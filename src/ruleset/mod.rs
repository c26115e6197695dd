//! The desired nftables state as an owned, comparable description: tables, chains, sets, maps,
//! elements and rules made of typed statements. No netlink and no Kubernetes types live here.
//!
//! `build` computes it from the cluster model, `render` prints it as nft text, and `nft::wire`
//! lowers it to kernel objects.

pub mod atoms;
pub mod build;
pub mod categorize;
pub mod eval;
pub mod names;
pub mod render;

use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use crate::model::{IpFamily, Protocol, ServicePortName};

pub use atoms::Atoms;
pub use build::{
    AddressKind, Claim, Claims, Clash, Contested, DetectLocal, NodePortAddresses, Settings,
    address_warnings, build, build_noting_contested, diagnostics,
};

/// Everything nodeproxy programs: one table per IP family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ruleset {
    pub tables: Vec<Table>,
}

impl Ruleset {
    pub fn table(&self, family: IpFamily) -> Option<&Table> {
        self.tables.iter().find(|t| t.family == family)
    }
}

/// A table of one family (`ip` or `ip6`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Table {
    pub family: IpFamily,
    pub name: String,
    pub comment: String,
    /// Owned by the process that programs it (`NFT_TABLE_F_OWNER | NFT_TABLE_F_PERSIST`, kernel
    /// 6.9+): other processes cannot change it while that process runs, and it stays, orphaned,
    /// when the process exits. A property of who programs the table, not of its contents, so
    /// `render` does not print it (see there).
    pub owned: bool,
    /// Sets and maps, in the order they are rendered and created.
    pub sets: Vec<Set>,
    /// Chains, in the order they are rendered and created.
    pub chains: Vec<Chain>,
}

impl Table {
    pub fn set(&self, name: &str) -> Option<&Set> {
        self.sets.iter().find(|s| s.name == name)
    }

    pub fn chain(&self, name: &str) -> Option<&Chain> {
        self.chains.iter().find(|c| c.name == name)
    }
}

/// A chain; a base chain when `base` is set (always with policy accept: nodeproxy never decides
/// for a host firewall).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chain {
    pub name: String,
    pub comment: String,
    pub base: Option<BaseChain>,
    pub rules: Vec<Rule>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BaseChain {
    pub kind: ChainType,
    pub hook: Hook,
    pub priority: i32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChainType {
    Filter,
    Nat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    Prerouting,
    Input,
    Forward,
    Output,
    Postrouting,
}

/// A rule: statements evaluated left to right, as in nft syntax.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub stmts: Vec<Stmt>,
}

impl Rule {
    pub fn new(stmts: Vec<Stmt>) -> Rule {
        Rule { stmts }
    }
}

/// Which address of the packet a match or key field reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum AddrField {
    Saddr,
    Daddr,
}

/// One field of a lookup key (or of a set's `typeof`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum KeyField {
    /// `ip saddr` / `ip6 saddr`
    Saddr,
    /// `ip daddr` / `ip6 daddr`
    Daddr,
    /// `meta l4proto`
    L4Proto,
    /// `th dport` (transport destination port, for TCP, UDP and SCTP alike)
    ThDport,
    /// `numgen random mod N`: a uniformly random slot in `0..N`.
    Numgen { modulus: u32 },
    /// `ct original ip daddr` / `ct original ip6 daddr`: the destination the connection was
    /// opened to, whatever rules have since rewritten in the packet (conntrack took it before
    /// the first rule ran).
    CtOrigDaddr,
    /// `jhash <fields> mod 4294967295 seed <seed>`: a 32-bit hash of the packet's values of
    /// `input`'s fields (ClientIP affinity's IPv6 pins, see [`HashInput`]).
    Jhash { input: HashInput, seed: u32 },
}

/// What a [`KeyField::Jhash`] hashes. nft 1.0.6 cannot write an element with data from the
/// packet path when the key is longer than 16 bytes (its register allocation puts the data in
/// register 2 whatever the key's length: `netlink_linearize.c` asserts), so the IPv6 pins of
/// session affinity are keyed by two hashes of the client and service instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum HashInput {
    /// `saddr . ct original daddr . meta l4proto . th dport`: a client of a service address.
    ClientServiceAddress,
    /// `saddr . meta l4proto . th dport`: a client of a NodePort.
    ClientNodePort,
}

impl HashInput {
    pub fn fields(self) -> &'static [KeyField] {
        match self {
            HashInput::ClientServiceAddress => &[
                KeyField::Saddr,
                KeyField::CtOrigDaddr,
                KeyField::L4Proto,
                KeyField::ThDport,
            ],
            HashInput::ClientNodePort => &[KeyField::Saddr, KeyField::L4Proto, KeyField::ThDport],
        }
    }
}

/// The modulus of every [`KeyField::Jhash`]: the whole 32-bit range but one value (nft's
/// modulus is a u32).
pub const JHASH_MODULUS: u32 = u32::MAX;

/// One statement of a rule: a match that may end evaluation of the rule, or an action.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stmt {
    /// `ct state new`
    CtStateNew,
    /// `ct status dnat`
    CtStatusDnat,
    /// `ip saddr 10.0.0.0/8`, or with `!=` when `negate`.
    AddrMatch {
        field: AddrField,
        negate: bool,
        net: ipnet::IpNet,
    },
    /// `<key> @set`: matches when the key is in the set.
    InSet {
        key: Vec<KeyField>,
        set: String,
    },
    /// `<key> vmap @map`: the verdict of the matching element, if any.
    Vmap {
        key: Vec<KeyField>,
        map: String,
    },
    /// `meta mark & <mask> != 0`
    MarkTest {
        mask: u32,
    },
    /// `meta mark set meta mark | <bits>`
    MarkOr(u32),
    /// `meta mark set meta mark ^ <bits>`
    MarkXor(u32),
    /// `dnat ip to <key> map @map`: the map yields `address . port`.
    DnatMap {
        key: Vec<KeyField>,
        map: String,
    },
    /// `masquerade fully-random` (or plain `masquerade`).
    Masquerade {
        fully_random: bool,
    },
    /// `reject`: ICMP port unreachable (ICMPv6 in `ip6`).
    Reject,
    /// `fib saddr type local` / `fib daddr type local`: the address is one of this host's
    /// (routing table `local`), whatever interface holds it.
    FibLocal {
        field: AddrField,
    },
    /// `iifname "eth0"`, `iifname "veth*"` (when `prefix`), or with `!=` when `negate`: the
    /// name of the interface the packet arrived on. Locally generated packets have none.
    Iifname {
        name: String,
        prefix: bool,
        negate: bool,
    },
    /// `<key> != @set`: matches when the key is *not* in the set.
    NotInSet {
        key: Vec<KeyField>,
        set: String,
    },
    /// `update @set { <key> timeout <secs>s }` (`… : <data>` for a map): adds the key to a
    /// dynamic set from the packet path, or refreshes its timeout if it is there. The kernel
    /// never changes the data of an element that is there (`nft_dynset_eval` only refreshes
    /// its expiration).
    UpdateSet {
        key: Vec<KeyField>,
        set: String,
        timeout_secs: u32,
        data: Option<KeyField>,
    },
    /// `delete @set { <key> }` (`… : <data>` for a map: the kernel wants a data register for
    /// every dynset of a map, `nft_dynset_init`): removes the key from a dynamic set from the
    /// packet path (a no-op when it is not there). Kernel >= 5.4 (`NFT_DYNSET_OP_DELETE`).
    DeleteFromSet {
        key: Vec<KeyField>,
        set: String,
        data: Option<KeyField>,
    },
    /// `ip daddr set <key> map @map`: rewrites the packet's destination address to the
    /// address the map gives for the key; a miss ends the rule. ClientIP affinity carries the
    /// endpoint it chose from one rule to the next in the destination address (nft has no
    /// other per-packet scratch value that others do not use: marks belong to everyone), and
    /// puts the service address back ([`Stmt::DaddrRestore`]) when no DNAT followed.
    DaddrFromMap {
        key: Vec<KeyField>,
        map: String,
    },
    /// `ip daddr set ct original ip daddr`.
    DaddrRestore,
    /// `numgen random mod <modulus> <value>`: matches with probability 1/modulus.
    RandomIs {
        modulus: u32,
        value: u32,
    },
    Verdict(Verdict),
}

/// A chain's name is shared, not owned: a verdict map's elements name a handful of chains
/// (`pick-<k>`, the traffic-policy chains, `reject-chain`), and as a `String` each of its tens of
/// thousands of elements carried a copy, 8 bytes more per `Element` besides.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Verdict {
    Accept,
    Drop,
    Jump(Arc<str>),
    Goto(Arc<str>),
    /// Back to the rule after the last `jump` (the base chain's policy when there is none).
    Return,
}

/// A named set, or a map when `data` is set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Set {
    pub name: String,
    pub comment: String,
    /// The key's fields, in order. Rendered as `type` (datatypes) unless `typeof_` is set.
    pub key: Vec<KeyField>,
    pub data: Option<SetData>,
    /// Declare key and data with `typeof` expressions. Needed when the key holds a field with
    /// no named datatype of fixed size (`numgen`).
    pub typeof_: bool,
    /// Elements, sorted by key.
    pub elements: Vec<Element>,
    pub kind: SetKind,
}

/// How the kernel stores a set, and who writes its elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SetKind {
    /// A hash of exact keys, written by nodeproxy.
    #[default]
    Hash,
    /// `flags interval`: key fields may be address ranges ([`Atom::Net`]); a concatenation of
    /// ranges is stored by the kernel's pipapo backend.
    Interval,
    /// `flags dynamic,timeout`: elements are written from the packet path (`update`) and
    /// expire; nodeproxy declares the set but never reads, writes or compares its elements.
    Dynamic,
}

/// Elements above which a hash set gets an explicit `size`.
///
/// The kernel then picks its fixed-size hash (a bucket array sized once) instead of the
/// rhashtable, which grows by doubling while elements are inserted: that halves the kernel time
/// of a cold load at 10k Services × 10 endpoints (docs/performance.md). A size costs a bucket
/// array that size per set, so small sets get none (`size 1048576` on every set was 4× slower).
pub const SIZED_SET_THRESHOLD: usize = 1000;

/// The `size` of a hash set ([`SetKind::Hash`]) of `elements`, given the size the kernel holds
/// it with (`held`; `None` for none, or on a fresh kernel).
///
/// The size is also the kernel's maximum (adding past it is ENFILE), so it is kept ahead of
/// growth: twice the elements, to the next power of two. A new size means a new set (the diff
/// recreates it with its elements), so the held size is kept while the set holds at most 3/4
/// and at least 1/8 of it, and a set hovering at a boundary is not recreated on each sync;
/// beyond that margin the size is chosen afresh, which at or below the threshold is none.
///
/// Pure arithmetic: the ruleset knows nothing of what the kernel holds. `nft::wire::size_sets`
/// passes the held size from the table read back or last applied (the full path), the change
/// sync keeps it and goes the full path when it would change (`sync/incremental.rs`), and
/// `render` passes none: the `size` printed is the one a fresh kernel gets.
pub fn hash_set_size(elements: usize, held: Option<u32>) -> Option<u32> {
    if let Some(held) = held {
        let held_n = held as usize;
        if elements.saturating_mul(4) <= held_n.saturating_mul(3)
            && elements.saturating_mul(8) >= held_n
        {
            return Some(held);
        }
    }
    if elements <= SIZED_SET_THRESHOLD {
        return None;
    }
    // Beyond 2^31 elements no size fits: the set goes without one (no maximum).
    u32::try_from(elements.checked_mul(2)?)
        .ok()?
        .checked_next_power_of_two()
}

impl Set {
    /// The `size` this set is declared with on a fresh kernel (see [`hash_set_size`]); dynamic
    /// sets get the kernel's default for them, interval sets none.
    pub fn fresh_size(&self) -> Option<u32> {
        match self.kind {
            SetKind::Hash => hash_set_size(self.elements.len(), None),
            SetKind::Interval => None,
            SetKind::Dynamic => Some(DYNAMIC_SET_SIZE),
        }
    }
}

/// The size the kernel gives a dynamic set created without one (`nft_dynset_init` sets 65535
/// when the first `update` rule binds it; nft 1.0.6 lists it), declared explicitly so that what
/// nodeproxy sends and what the kernel dumps back are the same.
pub const DYNAMIC_SET_SIZE: u32 = 65535;

/// What a map's elements map to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SetData {
    Verdict,
    /// A concatenation of values of these fields' types (e.g. `ip daddr . th dport`).
    Value(Vec<KeyField>),
}

/// One value of a key or data concatenation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Atom {
    Addr(IpAddr),
    Proto(Protocol),
    Port(u16),
    Int(u32),
    /// An address range (a CIDR), in sets with [`SetKind::Interval`].
    Net(ipnet::IpNet),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ElemData {
    Verdict(Verdict),
    Value(Atoms),
}

/// An element's comment, shared by all elements of one Service port. A thin pointer (8 bytes,
/// where `Arc<str>` is 16) as every desired element has room for one: 150k elements at 10k
/// Services x 10, all alive at the start-up sync's peak.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Comment(Arc<Box<str>>);

impl Comment {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether both are the same shared text, not only equal texts.
    pub fn same(&self, other: &Comment) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// The shared text's address, which identifies it while it lives.
    pub fn addr(&self) -> usize {
        Arc::as_ptr(&self.0) as usize
    }
}

impl std::ops::Deref for Comment {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Comment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for Comment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<&str> for Comment {
    fn from(text: &str) -> Comment {
        Comment(Arc::new(text.into()))
    }
}

impl From<String> for Comment {
    fn from(text: String) -> Comment {
        Comment(Arc::new(text.into_boxed_str()))
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Element {
    pub key: Atoms,
    pub data: Option<ElemData>,
    /// Rendered as the element's nft comment (the Service port it serves). Shared by all
    /// elements of one Service port: at 10k services there are hundreds of thousands.
    pub comment: Option<Comment>,
    /// The Service port this element was built for, for error reports. Not programmed.
    pub origin: Option<Arc<ServicePortName>>,
}

impl Element {
    /// Who the element is for, as `explain` shows it: its comment, or else (endpoints maps'
    /// elements carry none) the Service port it was built for.
    pub fn label(&self) -> Option<Comment> {
        self.comment.clone().or_else(|| {
            self.origin
                .as_ref()
                .map(|o| Comment::from(names::comment(&o.to_string())))
        })
    }
}
