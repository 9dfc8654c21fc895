//! Wire-format costs: parsing and emitting the messages on the hot path.
//! Run with `cargo bench -p azsdp-benches --bench wire`.

use criterion::{Criterion, criterion_group, criterion_main};
use std::hint::black_box;

use azsdp::wire::{self, Frame, GetComplete, Message, SrcAvail};

fn frames() -> Vec<(&'static str, Vec<u8>)> {
    let payload = vec![0x5au8; 4096];
    let msgs: Vec<(&'static str, Message<'_>)> = vec![
        ("DATA 4 KiB", Message::Data(&payload)),
        (
            "SRC_AVAIL",
            Message::SrcAvail(SrcAvail {
                id: 7,
                lock_slot: 3,
                lock_gen: 11,
                len: 1 << 20,
                stream_off: 1 << 30,
                addr: 0x7f00_0000_0000,
                key: 42,
            }),
        ),
        (
            "GET_COMPLETE",
            Message::GetComplete(GetComplete {
                id: 7,
                consumed: 1 << 20,
                final_: true,
            }),
        ),
    ];
    msgs.into_iter()
        .map(|(name, msg)| {
            let f = Frame {
                seq: 9,
                credits: 2,
                msg,
            };
            let mut buf = vec![0u8; f.wire_len()];
            wire::emit(&f, &mut buf).expect("room");
            (name, buf)
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    for (name, bytes) in frames() {
        c.bench_function(&format!("parse {name}"), |b| {
            b.iter(|| wire::parse(black_box(&bytes)).expect("valid"))
        });
        let frame = wire::parse(&bytes).expect("valid");
        let mut out = vec![0u8; bytes.len()];
        c.bench_function(&format!("emit {name}"), |b| {
            b.iter(|| wire::emit(black_box(&frame), &mut out).expect("room"))
        });
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
