//! The seal: what a process leaves in the kernel (the comment of `table ip nodeproxy-seal`) so
//! that the next one can adopt our tables without reading their elements back.
//!
//! Reading a large table back is the cost of a restart (0.3 s at 145k elements, 2.3 s at 345k:
//! the kernel restarts its set walk for every 32 KiB dump message). The seal says: "in the boot
//! `boot`, at ruleset generation `generation`, the elements of our tables hashed to these
//! digests". The kernel's generation (`NFT_MSG_GETGEN`) moves with every committed transaction
//! in the network namespace, by anyone and on any table, and never goes back; so when it still
//! equals the seal's, nothing has changed since the seal was written, and when the new process's
//! desired elements hash to the sealed digest, they are exactly what the kernel holds. Only
//! then are the elements taken from the desired tables; chains, rules and set definitions are
//! read back as always. Anything else (another generation, another boot, another digest, an
//! unreadable seal) reads everything back, as without a seal.
//!
//! The seal lives in the namespace it describes, so it cannot describe another one, and the boot
//! id keeps a ruleset saved with `nft list ruleset` and restored after a reboot from passing as
//! sealed. The digest is SipHash (std's `DefaultHasher`) over a random salt and every element:
//! the salt is written in the seal, which only a process with CAP_NET_ADMIN in the namespace can
//! read, so the objects a cluster user controls cannot be chosen to collide with it. A digest
//! computed by another build of nodeproxy may differ (std does not promise `DefaultHasher`'s
//! algorithm across releases): the tables are then read back, never trusted wrongly.

use std::collections::BTreeMap;
use std::hash::{BuildHasher, DefaultHasher, Hash, Hasher, RandomState};

use crate::model::IpFamily;
use crate::nft::wire::ElemBytes;
use crate::nft::{DataRef, WireData, WireElem, WireTable};

/// The first word of every seal: a seal of another format is not ours to trust.
const MAGIC: &str = "seal-v1";

/// The last word of every seal, so that a truncated one never parses.
const END: &str = "end";

/// nft's longest comment, NUL included (`NFTNL_UDATA_COMMENT_MAXLEN`): the longest seal is 127
/// characters.
const COMMENT_MAX: usize = 128;

/// Where the running kernel's boot id is.
const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seal {
    /// The kernel's boot id when the seal was written, without its dashes (32 hex digits), so
    /// that the seal fits a comment.
    pub boot: String,
    /// The ruleset generation right after the seal's own transaction.
    pub generation: u32,
    /// Hashed first into every digest.
    pub salt: u64,
    /// Per family, the digest of our table's elements ([`digest`]).
    pub digests: Vec<(IpFamily, u64)>,
}

impl Seal {
    /// `seal-v1 boot=<32 hex> gen=<n> salt=<16 hex> ip=<16 hex> ip6=<16 hex> end`; `None` if
    /// it would not fit a comment.
    pub fn render(&self) -> Option<String> {
        let mut s = format!(
            "{MAGIC} boot={} gen={} salt={:016x}",
            self.boot, self.generation, self.salt
        );
        for (family, d) in &self.digests {
            s.push_str(&format!(" {}={d:016x}", family_word(*family)));
        }
        s.push(' ');
        s.push_str(END);
        (s.len() < COMMENT_MAX).then_some(s)
    }

    /// Reads what [`Seal::render`] wrote; `None` for anything else (someone else's comment, a
    /// seal of another version, a damaged one).
    pub fn parse(text: &str) -> Option<Seal> {
        let mut words = text.split(' ');
        if words.next() != Some(MAGIC) {
            return None;
        }
        let mut field = |name: &str| {
            words
                .next()
                .and_then(|w| w.strip_prefix(name))
                .and_then(|w| w.strip_prefix('='))
        };
        let boot = field("boot").filter(|b| valid_boot_id(b))?.to_owned();
        let generation = field("gen")?.parse().ok()?;
        let salt = hex64(field("salt")?)?;
        let mut digests = Vec::new();
        let mut ended = false;
        for w in words {
            if ended {
                return None;
            }
            if w == END {
                ended = true;
                continue;
            }
            let (family, hex) = w.split_once('=')?;
            let family = match family {
                "ip" => IpFamily::V4,
                "ip6" => IpFamily::V6,
                _ => return None,
            };
            if digests.iter().any(|(f, _)| *f == family) {
                return None;
            }
            digests.push((family, hex64(hex)?));
        }
        if !ended {
            return None;
        }
        Some(Seal {
            boot,
            generation,
            salt,
            digests,
        })
    }

    /// The sealed digest of `family`'s table, if the seal has one.
    pub fn digest(&self, family: IpFamily) -> Option<u64> {
        self.digests
            .iter()
            .find(|(f, _)| *f == family)
            .map(|(_, d)| *d)
    }
}

fn family_word(f: IpFamily) -> &'static str {
    match f {
        IpFamily::V4 => "ip",
        IpFamily::V6 => "ip6",
    }
}

/// Exactly 16 lowercase hex digits: what `render` writes, so that a truncated seal never
/// parses.
fn hex64(s: &str) -> Option<u64> {
    (s.len() == 16 && s.bytes().all(is_lower_hex))
        .then(|| u64::from_str_radix(s, 16).ok())
        .flatten()
}

fn is_lower_hex(b: u8) -> bool {
    b.is_ascii_digit() || (b'a'..=b'f').contains(&b)
}

/// A boot id without its dashes: 32 lowercase hex digits.
fn valid_boot_id(s: &str) -> bool {
    s.len() == 32 && s.bytes().all(is_lower_hex)
}

/// The running kernel's boot id without its dashes; `None` when it cannot be read (no seal is
/// then written or trusted).
pub fn boot_id() -> Option<String> {
    let text = std::fs::read_to_string(BOOT_ID).ok()?;
    let id: String = text.trim().chars().filter(|&c| c != '-').collect();
    valid_boot_id(&id).then_some(id)
}

/// A fresh random salt: std seeds each `RandomState` from the operating system's randomness.
pub fn fresh_salt() -> u64 {
    RandomState::new().build_hasher().finish()
}

/// The digest of `table`'s elements: every set's name and elements (key, key end, data and
/// comment: what the diff compares), in the table's order, which is the key order of each set
/// whoever built it. Dynamic sets are left out: the packet path writes them, and neither the
/// read-back nor the diff looks at their elements.
pub fn digest(table: &WireTable, salt: u64) -> u64 {
    let mut h = DefaultHasher::new();
    salt.hash(&mut h);
    for (name, set) in &table.sets {
        if set.is_dynamic() {
            continue;
        }
        name.hash(&mut h);
        set.elements.len().hash(&mut h);
        // Each element's fields go into one buffer, hashed with one call: SipHash's cost per
        // call dominated with eight short writes per element (the digest took ~10 ms of a
        // re-apply at 10k × 10, and a clean exit pays it again).
        let mut buf = Vec::with_capacity(256);
        for (key, e) in &set.elements {
            buf.clear();
            put(&mut buf, Some(key.as_slice()));
            put(&mut buf, e.key_end().map(ElemBytes::as_slice));
            match e.data().map(WireData::get) {
                None => buf.push(0),
                Some(DataRef::Value(v)) => {
                    buf.push(1);
                    put(&mut buf, Some(v));
                }
                Some(DataRef::Verdict { code, chain }) => {
                    buf.push(2);
                    buf.extend_from_slice(&code.to_be_bytes());
                    put(&mut buf, chain.map(str::as_bytes));
                }
            }
            put(&mut buf, e.userdata.as_deref().map(Vec::as_slice));
            h.write(&buf);
        }
    }
    h.finish()
}

/// Appends `bytes` so that no two sequences of fields append the same: absent, or present with
/// its length first.
fn put(buf: &mut Vec<u8>, bytes: Option<&[u8]>) {
    match bytes {
        None => buf.push(0),
        Some(b) => {
            buf.push(1);
            buf.extend_from_slice(&u32::try_from(b.len()).unwrap_or(u32::MAX).to_be_bytes());
            buf.extend_from_slice(b);
        }
    }
}

/// Whether `have` (our table read back without elements) has the sets with elements that
/// `want`, whose digest matched the seal, has. A matching digest covers the set names, so when
/// it does not, the seal does not describe this table after all.
pub fn same_sets(have: &WireTable, want: &WireTable) -> bool {
    let ours = |t: &WireTable| -> Vec<String> {
        t.sets
            .iter()
            .filter(|(_, s)| !s.is_dynamic())
            .map(|(n, _)| n.clone())
            .collect()
    };
    ours(have) == ours(want)
}

/// A set's elements.
pub type Elements = BTreeMap<ElemBytes, WireElem>;

/// The elements of `want`'s sets that a seal covers (all but the dynamic sets'), taken out.
pub fn take_elements(want: &mut WireTable) -> Vec<(String, Elements)> {
    want.sets
        .iter_mut()
        .filter(|(_, s)| !s.is_dynamic())
        .map(|(n, s)| (n.clone(), std::mem::take(&mut s.elements)))
        .collect()
}

/// Puts back what [`take_elements`] took.
pub fn put_elements(want: &mut WireTable, elements: Vec<(String, Elements)>) {
    for (name, taken) in elements {
        if let Some(set) = want.sets.get_mut(&name) {
            set.elements = taken;
        }
    }
}

/// Gives `have` (our table read back without elements) the elements of `want`, whose digest
/// matched the seal. `false`, leaving `have` unusable, when their sets are not the same ones
/// ([`same_sets`]).
pub fn fill(have: &mut WireTable, want: &WireTable) -> bool {
    if !same_sets(have, want) {
        return false;
    }
    for (name, set) in have.sets.iter_mut() {
        if set.is_dynamic() {
            continue;
        }
        match want.sets.get(name) {
            Some(w) => set.elements = w.elements.clone(),
            None => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests;
