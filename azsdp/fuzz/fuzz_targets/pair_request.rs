//! Arbitrary bytes from a would-be client on the pairing side channel: an
//! error or a request that emits back to the same bytes, never a panic.
#![no_main]

use azsdp::pairing::{PairRequest, REQUEST_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(r) = PairRequest::parse(data) {
        let mut b = [0u8; REQUEST_LEN];
        r.emit(&mut b);
        assert_eq!(&b[..], data);
    }
});
