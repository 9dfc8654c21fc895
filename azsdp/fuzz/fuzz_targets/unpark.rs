//! Bytes taken up as a parked engine (what a new image reads from the
//! record its previous image left): whatever they are, unpark answers an
//! engine or an error, never panics; an engine it answers runs.
#![no_main]

use std::cell::RefCell;
use std::rc::Rc;

use azsdp_proto::driver::{Driver, parked_header};
use azsdp_proto::fabric::sim::{SimEndpoint, SimFabric, SimFabricParams};
use azsdp_proto::sim::host::{SharedTcp, SimClock, SimHost, SimProtector, Trace};
use azsdp_proto::sim::memory::{SharedMems, SimMemory};
use azsdp_proto::sim::rng::Rng;
use azsdp_proto::sim::scenario::Injection;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let clock = SimClock::default();
    let mems: SharedMems = Rc::new(RefCell::new([SimMemory::new(4096), SimMemory::new(4096)]));
    let fabric = SimFabric::new(
        1,
        SimFabricParams::default(),
        Rc::clone(&mems),
        Trace::new(false, clock.clone()),
        Injection::None,
    )
    .shared();
    let prot = SimProtector::new(0, Rc::clone(&mems), Rng::new(1), 0.0);
    let host = SimHost::new(0, Rc::clone(&mems), clock, SharedTcp::default());
    // Half the inputs get a valid header, so the fuzzer reaches the body.
    let bytes = match data.split_first() {
        Some((0, rest)) => [parked_header(), rest.to_vec()].concat(),
        _ => data.to_vec(),
    };
    if let Ok(mut d) = Driver::unpark(&bytes, SimEndpoint::new(fabric, 0), prot, host) {
        d.turn();
        d.run_timers();
    }
});
