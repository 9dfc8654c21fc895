//! Arbitrary bytes into `wire::parse`: never panics, and whatever parses
//! re-emits to exactly the same bytes (the encoding is canonical).
#![no_main]

use azsdp::wire;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(frame) = wire::parse(data) {
        let mut out = vec![0u8; frame.wire_len()];
        let n = wire::emit(&frame, &mut out).expect("room for the frame");
        assert_eq!(&out[..n], data);
    }
});
