//! Fuzz target: kernel replies (netlink framing, error acks, nf_tables attributes, set elements,
//! rule expressions) decoded from arbitrary bytes. Nothing may panic.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = nodeproxy::nft::netlink::decode_any(data);
});
