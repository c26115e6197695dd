//! The bytes of an element's key or value, stored inline when short.
//!
//! A table at 10k Services holds ~150k elements, each with a key and most with a value: as
//! boxed slices they were two small allocations per element, in the desired table and again in
//! the applied one. Every IPv4 key and value, and IPv6 values, fit inline.

use std::borrow::Borrow;
use std::cmp::Ordering;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::ops::Deref;

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

impl ElemBytes {
    pub fn as_slice(&self) -> &[u8] {
        match &self.0 {
            Repr::Inline { len, bytes } => bytes.get(..usize::from(*len)).unwrap_or(bytes),
            Repr::Heap(b) => b,
        }
    }
}

impl From<&[u8]> for ElemBytes {
    fn from(b: &[u8]) -> ElemBytes {
        match u8::try_from(b.len()) {
            Ok(len) if b.len() <= INLINE => {
                let mut bytes = [0; INLINE];
                if let Some(to) = bytes.get_mut(..b.len()) {
                    to.copy_from_slice(b);
                }
                ElemBytes(Repr::Inline { len, bytes })
            }
            _ => ElemBytes(Repr::Heap(b.into())),
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
        // What the element maps are sized for: see `WireElem::key_end`.
        assert_eq!(size_of::<super::super::WireElem>(), 56);
    }
}
