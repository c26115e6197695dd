//! An element's key bytes and its data (a value's bytes or a verdict), stored inline when short.
//!
//! A table at 10k Services holds ~150k elements, each with a key and most with a value: as
//! boxed slices they were two small allocations per element, in the desired table and again in
//! the applied one. Every IPv4 key fits inline, and every IPv4 value and verdict.

use std::borrow::Borrow;
use std::cmp::Ordering;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::ops::Deref;
use std::sync::Arc;

/// Bytes held inline up to this length: with the length and the variant's tag the value is 24
/// bytes, the size of the boxed slice it replaces plus one word.
const INLINE: usize = 22;

/// Key or value bytes; compares, orders and hashes exactly as the byte slice it holds.
#[derive(Clone)]
pub struct ElemBytes(Repr);

#[derive(Clone)]
enum Repr {
    Inline { len: u8, bytes: [u8; INLINE] },
    Heap(Box<[u8]>),
}

/// `b` as `N` inline bytes (zero after its end) and its length, if it fits.
fn inline<const N: usize>(b: &[u8]) -> Option<(u8, [u8; N])> {
    let len = u8::try_from(b.len()).ok().filter(|_| b.len() <= N)?;
    let mut bytes = [0; N];
    bytes.get_mut(..b.len())?.copy_from_slice(b);
    Some((len, bytes))
}

/// The first `len` of inline `bytes`.
fn inline_slice<const N: usize>(len: u8, bytes: &[u8; N]) -> &[u8] {
    bytes.get(..usize::from(len)).unwrap_or(bytes)
}

impl ElemBytes {
    pub fn as_slice(&self) -> &[u8] {
        match &self.0 {
            Repr::Inline { len, bytes } => inline_slice(*len, bytes),
            Repr::Heap(b) => b,
        }
    }
}

impl From<&[u8]> for ElemBytes {
    fn from(b: &[u8]) -> ElemBytes {
        match inline::<INLINE>(b) {
            Some((len, bytes)) => ElemBytes(Repr::Inline { len, bytes }),
            None => ElemBytes(Repr::Heap(b.into())),
        }
    }
}

impl From<Vec<u8>> for ElemBytes {
    fn from(v: Vec<u8>) -> ElemBytes {
        if v.len() <= INLINE {
            ElemBytes::from(v.as_slice())
        } else {
            ElemBytes(Repr::Heap(v.into_boxed_slice()))
        }
    }
}

impl From<Box<[u8]>> for ElemBytes {
    fn from(b: Box<[u8]>) -> ElemBytes {
        if b.len() <= INLINE {
            ElemBytes::from(&b[..])
        } else {
            ElemBytes(Repr::Heap(b))
        }
    }
}

impl Deref for ElemBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl AsRef<[u8]> for ElemBytes {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl Borrow<[u8]> for ElemBytes {
    fn borrow(&self) -> &[u8] {
        self.as_slice()
    }
}

impl PartialEq for ElemBytes {
    fn eq(&self, o: &Self) -> bool {
        self.as_slice() == o.as_slice()
    }
}
impl Eq for ElemBytes {}

impl PartialOrd for ElemBytes {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}

impl Ord for ElemBytes {
    fn cmp(&self, o: &Self) -> Ordering {
        self.as_slice().cmp(o.as_slice())
    }
}

impl Hash for ElemBytes {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.as_slice().hash(h);
    }
}

impl fmt::Debug for ElemBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.as_slice().fmt(f)
    }
}

/// Value bytes held in [`WireData`] itself up to this length: an IPv4 endpoint (address and
/// port, 8 bytes), an IPv4 address or a port. An IPv6 endpoint (20 bytes) is boxed: in an IPv6
/// table's endpoint maps an element then takes ~90 bytes (its part of a 640-byte B-tree leaf,
/// and a 32-byte box) where it took ~82 (its part of an 896-byte leaf), while every IPv4
/// element and every verdict takes 58 instead of 82.
const SHORT: usize = 14;

/// A verdict's target chain: a name shared by every element that goes to it, behind a thin
/// pointer (an `Arc<str>` is two words, and would make [`WireData`] 24 bytes instead of 16).
pub type ChainName = Arc<String>;

/// An element's data (`NFTA_SET_ELEM_DATA`): a value's bytes or a verdict. Sixteen bytes, for
/// the size of a [`super::WireElem`] (one variant per representation: a value's enum nested in
/// this one did not share its tag, which made the data 24 bytes).
#[derive(Clone, PartialEq, Eq)]
pub struct WireData(Data);

/// Equality is the derived one: values are inline exactly when at most [`SHORT`] bytes long,
/// and the unused inline bytes are zero.
#[derive(Clone, PartialEq, Eq)]
enum Data {
    Short { len: u8, bytes: [u8; SHORT] },
    Long(Box<ElemBytes>),
    Verdict { code: i32, chain: Option<ChainName> },
}

/// A [`WireData`] read: a value's bytes, or a verdict's code and chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataRef<'a> {
    Value(&'a [u8]),
    Verdict { code: i32, chain: Option<&'a str> },
}

impl WireData {
    pub fn value(b: &[u8]) -> WireData {
        match inline::<SHORT>(b) {
            Some((len, bytes)) => WireData(Data::Short { len, bytes }),
            None => WireData(Data::Long(Box::new(ElemBytes::from(b)))),
        }
    }

    pub fn verdict(code: i32, chain: Option<ChainName>) -> WireData {
        WireData(Data::Verdict { code, chain })
    }

    pub fn get(&self) -> DataRef<'_> {
        match &self.0 {
            Data::Short { len, bytes } => DataRef::Value(inline_slice(*len, bytes)),
            Data::Long(b) => DataRef::Value(b.as_slice()),
            Data::Verdict { code, chain } => DataRef::Verdict {
                code: *code,
                chain: chain.as_deref().map(String::as_str),
            },
        }
    }

    /// The value's bytes; `None` for a verdict.
    pub fn as_value(&self) -> Option<&[u8]> {
        match self.get() {
            DataRef::Value(v) => Some(v),
            DataRef::Verdict { .. } => None,
        }
    }

    pub fn is_verdict(&self) -> bool {
        matches!(self.0, Data::Verdict { .. })
    }

    /// The chain a verdict jumps or goes to.
    pub fn chain(&self) -> Option<&str> {
        match &self.0 {
            Data::Verdict { chain: Some(c), .. } => Some(c),
            _ => None,
        }
    }
}

impl fmt::Debug for WireData {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.get() {
            DataRef::Value(v) => f.debug_tuple("Value").field(&v).finish(),
            DataRef::Verdict { code, chain } => f
                .debug_struct("Verdict")
                .field("code", &code)
                .field("chain", &chain)
                .finish(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inline_and_heap_bytes_compare_as_their_slices() {
        let all: Vec<Vec<u8>> = vec![
            vec![],
            vec![0],
            vec![1, 2, 3],
            vec![7; INLINE],
            vec![7; INLINE + 1],
            vec![6; 40],
            vec![255; 4],
        ];
        for a in &all {
            let x = ElemBytes::from(a.clone());
            assert_eq!(&x[..], &a[..]);
            assert_eq!(ElemBytes::from(&a[..]), x);
            assert_eq!(ElemBytes::from(a.clone().into_boxed_slice()), x);
            for b in &all {
                let y = ElemBytes::from(b.clone());
                assert_eq!(x.cmp(&y), a.cmp(b), "{a:?} {b:?}");
                assert_eq!(x == y, a == b);
            }
        }
        assert_eq!(size_of::<ElemBytes>(), 24);
    }

    /// What the element maps are sized for: see [`super::super::WireElem`].
    #[test]
    fn an_element_is_thirty_two_bytes_and_its_data_sixteen() {
        assert_eq!(size_of::<WireData>(), 16);
        assert_eq!(size_of::<Option<WireData>>(), 16);
        assert_eq!(size_of::<super::super::WireElem>(), 32);
    }

    #[test]
    fn data_reads_back_as_made_whether_inline_or_boxed() {
        let values: Vec<Vec<u8>> = (0..=40)
            .map(|n| (0..n).map(|b| b * 5 + 1).collect())
            .collect();
        for v in &values {
            let d = WireData::value(v);
            assert_eq!(d.get(), DataRef::Value(v), "{v:?}");
            assert_eq!(d.as_value(), Some(&v[..]));
            assert!(!d.is_verdict() && d.chain().is_none());
            for w in &values {
                assert_eq!(d == WireData::value(w), v == w, "{v:?} {w:?}");
            }
            assert_ne!(d, WireData::verdict(0, None));
        }
        let chain: ChainName = Arc::new("svc-x".into());
        let goto = WireData::verdict(-4, Some(chain.clone()));
        assert_eq!(
            goto.get(),
            DataRef::Verdict {
                code: -4,
                chain: Some("svc-x")
            }
        );
        assert_eq!((goto.chain(), goto.as_value()), (Some("svc-x"), None));
        // Equal by name, not by the shared allocation.
        assert_eq!(goto, WireData::verdict(-4, Some(Arc::new("svc-x".into()))));
        assert_ne!(goto, WireData::verdict(-3, Some(chain)));
        assert_ne!(goto, WireData::verdict(-4, None));
        assert_eq!(
            format!("{goto:?}"),
            r#"Verdict { code: -4, chain: Some("svc-x") }"#
        );
        assert_eq!(format!("{:?}", WireData::value(&[1, 2])), "Value([1, 2])");
    }
}
