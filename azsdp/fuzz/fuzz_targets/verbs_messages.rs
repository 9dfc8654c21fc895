//! Arbitrary bytes from a would-be peer over verbs: rdma_cm's private data
//! (request, reply), a SEND's header, a lock request or answer, a pairing
//! message. Each is an error
//! or a value that emits back to bytes it parses to again, never a panic.
#![no_main]

use azsdp::fabric::verbs::hello::{Reply, Request};
use azsdp::fabric::verbs::pairing::PairMsg;
use azsdp::fabric::verbs::wire::{CasAnswer, CasRequest, HEADER_LEN, Header};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(r) = Request::parse(data) {
        assert_eq!(Request::parse(&r.emit()), Ok(r));
    }
    if let Ok(r) = Reply::parse(data) {
        assert_eq!(Reply::parse(&r.emit()), Ok(r));
    }
    if let Ok(m) = PairMsg::parse(data) {
        assert_eq!(&m.emit()[..], data);
    }
    if let Ok(r) = CasRequest::parse(data) {
        assert_eq!(&r.emit()[..], data);
    }
    if let Ok(a) = CasAnswer::parse(data) {
        assert_eq!(&a.emit()[..], data);
    }
    if let Ok((h, payload)) = Header::parse(data) {
        let mut b = [0u8; HEADER_LEN];
        h.emit(&mut b);
        assert_eq!(&b[..], &data[..HEADER_LEN]);
        assert_eq!(payload, &data[HEADER_LEN..]);
    }
});
