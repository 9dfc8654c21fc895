//! Arbitrary bytes from a would-be peer on the pairing side channel: an
//! error or a message that emits back to the same bytes, never a panic.
#![no_main]

use azsdp::pairing::{INTRO_LEN, Intro};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(r) = Intro::parse(data) {
        let mut b = [0u8; INTRO_LEN];
        r.emit(&mut b);
        assert_eq!(&b[..], data);
    }
});
