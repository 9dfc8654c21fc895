//! azsdp-hostile: a hostile local user's toolkit against processes under
//! azsdp, built on the azsdp crate. The trust tests run it as another user
//! (`setpriv --reuid=65534`) against root servers and clients, and as the
//! same user, and check that every attack fails.
//!
//! ```text
//! azsdp-hostile squat PORT SECS        hold a listener's pairing name, answer and commit to everything
//! azsdp-hostile lie PORT COOKIE SECS   offer to pair someone else's connection (by its
//!                                       cookie)
//! azsdp-hostile flood PORT SECS IDLE    IDLE idle pairing connections, and bogus offers for SECS
//! azsdp-hostile junk PORT COUNT         COUNT malformed messages with descriptors: half to the
//!                                       pairing name, half to the bell of a pair made with it
//! azsdp-hostile client PORT ATTACK      pair, then attack (see `client`)
//! azsdp-hostile server PORT ATTACK SECS a listener that pairs with root clients, then attacks
//! ```
//!
//! Every mode prints one JSON line: what it got (`bytes`), whether any of
//! it was a victim's secret (`leak`), whether a pair was made (`paired`).

use std::io::{IoSlice, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use azsdp::conn::OpId;
use azsdp::fabric::shm::{
    ShmEndpoint, ShmJoin, ShmOffer, ShmParams, adversary, recv_intro, send_intro,
};
use azsdp::fabric::{Fabric, FabricEvent};
use azsdp::pairing::{
    Agreement, INTRO_LEN, Intro, IntroKind, PairTarget, registry_candidates, registry_name,
};
use azsdp::sock_diag;
use azsdp::wire::{self, Frame, Hello, Message, SrcAvail};

const SECRET: &[u8] = b"THE-PASSWORD-IS-hunter2 ";

#[derive(Default)]
struct Report {
    attack: String,
    paired: bool,
    answered: bool,
    bytes: usize,
    leak: bool,
    offers: usize,
    note: String,
}

impl Report {
    fn print(&self) {
        println!(
            "{{\"attack\":\"{}\",\"paired\":{},\"answered\":{},\"bytes\":{},\"leak\":{},\"offers\":{},\"note\":\"{}\"}}",
            self.attack,
            self.paired,
            self.answered,
            self.bytes,
            self.leak,
            self.offers,
            self.note.replace('"', "'")
        );
        let _ = std::io::stdout().flush();
    }

    fn saw(&mut self, b: &[u8]) {
        self.bytes += b.len();
        self.leak |= b.windows(SECRET.len()).any(|w| w == SECRET);
    }
}

fn die(msg: String) -> ! {
    eprintln!("azsdp-hostile: {msg}");
    std::process::exit(2);
}

fn arg<T: std::str::FromStr>(args: &[String], i: usize, what: &str) -> T {
    args.get(i)
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| die(format!("missing or bad {what}")))
}

fn page() -> u32 {
    azsdp::pages::system_page_size() as u32
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mut r = Report {
        attack: args[1..].join(" "),
        ..Report::default()
    };
    match args.get(1).map(String::as_str) {
        Some("squat") => squat(arg(&args, 2, "port"), arg(&args, 3, "secs"), &mut r),
        Some("lie") => lie(
            arg(&args, 2, "port"),
            arg(&args, 3, "cookie"),
            arg(&args, 4, "secs"),
            &mut r,
        ),
        Some("flood") => flood(
            arg(&args, 2, "port"),
            arg(&args, 3, "secs"),
            arg(&args, 4, "idle"),
            &mut r,
        ),
        Some("junk") => junk(arg(&args, 2, "port"), arg(&args, 3, "count"), &mut r),
        Some("client") => client(
            arg(&args, 2, "port"),
            &arg::<String>(&args, 3, "attack"),
            &mut r,
        ),
        Some("server") => server(
            arg(&args, 2, "port"),
            &arg::<String>(&args, 3, "attack"),
            arg(&args, 4, "secs"),
            &mut r,
        ),
        _ => die("usage: azsdp-hostile squat|lie|flood|junk|client|server ...".into()),
    }
    r.print();
}

// ----- sockets ---------------------------------------------------------------

fn seqpacket(nonblocking: bool) -> OwnedFd {
    let mut ty = libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC;
    if nonblocking {
        ty |= libc::SOCK_NONBLOCK;
    }
    // SAFETY: plain system call; the descriptor is ours from here on.
    unsafe {
        let fd = libc::socket(libc::AF_UNIX, ty, 0);
        if fd < 0 {
            die(format!("socket: {}", std::io::Error::last_os_error()));
        }
        OwnedFd::from_raw_fd(fd)
    }
}

fn abstract_addr(name: &str) -> (libc::sockaddr_un, libc::socklen_t) {
    // SAFETY: plain data; zero is valid.
    let mut a: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    a.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (i, c) in name.bytes().enumerate() {
        a.sun_path[i + 1] = c as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + 1 + name.len();
    (a, len as libc::socklen_t)
}

/// Connect to a listener's pairing name.
fn registry(port: u16) -> Option<OwnedFd> {
    let dst: SocketAddr = ([127, 0, 0, 1], port).into();
    registry_candidates(dst).into_iter().find_map(|name| {
        let s = seqpacket(false);
        let (a, len) = abstract_addr(&name);
        // A full queue (the listener takes in at its own pace) holds a
        // blocking connect: wait for room 200 ms at most, then go on.
        let t = libc::timeval {
            tv_sec: 0,
            tv_usec: 200_000,
        };
        // SAFETY: a send timeout on our own socket, then connect it to our
        // own address.
        let r = unsafe {
            libc::setsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_SNDTIMEO,
                (&raw const t).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            );
            libc::connect(s.as_raw_fd(), (&raw const a).cast(), len)
        };
        (r == 0).then_some(s)
    })
}

/// Bind a pairing name ourselves.
fn bind_registry(name: &str) -> Result<OwnedFd, String> {
    let s = seqpacket(true);
    let (a, len) = abstract_addr(name);
    // SAFETY: bind and listen on our own socket.
    let r = unsafe {
        if libc::bind(s.as_raw_fd(), (&raw const a).cast(), len) != 0 {
            -1
        } else {
            libc::listen(s.as_raw_fd(), 128)
        }
    };
    if r != 0 {
        return Err(format!("{name}: {}", std::io::Error::last_os_error()));
    }
    Ok(s)
}

fn accept_nb(fd: BorrowedFd<'_>) -> Option<OwnedFd> {
    // SAFETY: accept4 without an address; the new descriptor is ours.
    let n = unsafe {
        libc::accept4(
            fd.as_raw_fd(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
        )
    };
    // SAFETY: a new descriptor we own.
    (n >= 0).then(|| unsafe { OwnedFd::from_raw_fd(n) })
}

/// A TCP socket, not yet connected (as a client under azsdp leaves it
/// when it sends its offer: the kernel picks its port at `connect()`).
fn new_tcp() -> OwnedFd {
    // SAFETY: a plain socket call; the descriptor is ours.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            die("socket".into());
        }
        OwnedFd::from_raw_fd(fd)
    }
}

fn connect_tcp(fd: OwnedFd, port: u16) -> Result<TcpStream, String> {
    // SAFETY: connect a socket we own to our own sockaddr_in.
    let r = unsafe {
        let mut a: libc::sockaddr_in = std::mem::zeroed();
        a.sin_family = libc::AF_INET as libc::sa_family_t;
        a.sin_addr.s_addr = u32::from_be_bytes([127, 0, 0, 1]).to_be();
        a.sin_port = port.to_be();
        libc::connect(
            fd.as_raw_fd(),
            (&raw const a).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(format!("connect: {}", std::io::Error::last_os_error()));
    }
    Ok(TcpStream::from(fd))
}

fn wait_readable(fd: BorrowedFd<'_>, t: Duration) -> bool {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll of one pollfd of ours.
    unsafe { libc::poll(&mut p, 1, t.as_millis() as i32) > 0 }
}

/// Read what the plain TCP connection gives back within `t`.
fn drain_tcp(s: &TcpStream, t: Duration, r: &mut Report) {
    let _ = s.set_read_timeout(Some(t));
    let mut b = vec![0u8; 64 << 10];
    while let Ok(n) = (&*s).read(&mut b) {
        if n == 0 {
            break;
        }
        r.saw(&b[..n]);
    }
}

// ----- the engine protocol, by hand -------------------------------------------

fn post(ep: &mut ShmEndpoint, seq: &mut u32, msg: Message<'_>) -> Result<(), String> {
    let f = Frame {
        seq: *seq,
        credits: 0,
        msg,
    };
    let mut b = vec![0u8; f.wire_len()];
    wire::emit(&f, &mut b).map_err(|e| e.to_string())?;
    *seq += 1;
    ep.post_message(&b).map_err(|e| e.to_string())
}

fn hello(ep: &ShmEndpoint) -> Hello {
    let l = ep.lock_region();
    Hello {
        min_version: wire::VERSION,
        max_version: wire::VERSION,
        page_size: page(),
        features: wire::features::ALL,
        credits: 32,
        lock_slots: l.slots,
        slot_size: 16 << 10,
        lock_addr: l.addr,
        lock_key: l.key,
        max_avail: 8 << 20,
    }
}

/// Take in what the peer sends for `t`, or until its HELLO(_ACK) comes or
/// it leaves: every DATA payload goes into the report.
fn listen_to(ep: &mut ShmEndpoint, t: Duration, r: &mut Report) -> (Option<Hello>, bool) {
    let deadline = Instant::now() + t;
    let mut got = None;
    let mut gone = false;
    while Instant::now() < deadline && !gone && got.is_none() {
        let mut payloads: Vec<Vec<u8>> = Vec::new();
        ep.poll(&mut |ev| match ev {
            FabricEvent::Message(m) => {
                if let Ok(f) = wire::parse(m) {
                    match f.msg {
                        Message::Hello(h) | Message::HelloAck(h) => got = Some(h),
                        Message::Data(d) => payloads.push(d.to_vec()),
                        _ => {}
                    }
                }
            }
            FabricEvent::PeerGone { .. } => gone = true,
            FabricEvent::Done { .. } => {}
        });
        for p in payloads {
            r.saw(&p);
        }
        ep.wait(Duration::from_millis(20));
    }
    (got, gone)
}

/// This process's bell, which a well-formed offer or answer carries.
fn bell() -> std::sync::Arc<azsdp::driver::reactor::Reactor> {
    azsdp::driver::reactor::Reactor::get().unwrap_or_else(|e| die(e.to_string()))
}

/// Offer to pair a new TCP connection to `port` as an azsdp client would,
/// connect it, and take the listener's answer (its intro, identity, and
/// descriptors: the accepted socket, then its bell).
fn offer_and_answer(
    port: u16,
    r: &mut Report,
) -> Result<(TcpStream, ShmOffer, Intro, azsdp::identity::Received), String> {
    let reg = registry(port).ok_or("no pairing name for that port")?;
    let tcp = new_tcp();
    let cookie = sock_diag::cookie_of(tcp.as_fd()).map_err(|e| e.to_string())?;
    let offer = ShmOffer::new(ShmParams::default()).map_err(|e| e.to_string())?;
    let intro = offer_intro(port, cookie);
    let reactor = bell();
    send_intro(reg.as_fd(), &intro, &[offer.memfd(), reactor.bell()], false)
        .map_err(|e| e.to_string())?;
    let tcp = connect_tcp(tcp, port)?;
    if !wait_readable(reg.as_fd(), Duration::from_secs(5)) {
        return Err("no answer".into());
    }
    let (a, answer) =
        recv_intro(reg.as_fd(), IntroKind::Answer, false).map_err(|e| e.to_string())?;
    r.answered = true;
    Ok((tcp, offer, a, answer))
}

/// Pair with the listener on `port` as an azsdp client would. The TCP
/// connection and our end.
fn pair(port: u16, r: &mut Report) -> Result<(TcpStream, ShmEndpoint), String> {
    let (tcp, offer, a, answer) = offer_and_answer(port, r)?;
    let deadline = Instant::now() + Duration::from_secs(5);
    while offer.agreement().load(Ordering::Acquire) != Agreement::COMMITTED {
        if Instant::now() > deadline {
            return Err("no commit".into());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let their_bell = answer
        .fds
        .into_iter()
        .nth(1)
        .ok_or("the answer carries no bell")?;
    let ep = offer
        .into_endpoint(their_bell, answer.peer, a.page_size)
        .map_err(|e| e.to_string())?;
    r.paired = true;
    Ok((tcp, ep))
}

/// An offer for a connection to 127.0.0.1:`port`, claiming the socket
/// with `cookie`.
fn offer_intro(port: u16, cookie: u64) -> Intro {
    Intro {
        kind: IntroKind::Offer,
        page_size: page(),
        pair: Some(PairTarget {
            dst: ([127, 0, 0, 1], port).into(),
            cookie,
        }),
        // (The bell is passed: this client promises nothing.)
        bell: None,
    }
}

/// Answer an offer whose segment we mapped (`join`) as a listener does,
/// with `proof` as the socket we claim to hold, and commit.
fn answer_and_commit(
    s: OwnedFd,
    join: ShmJoin,
    offer: azsdp::identity::Received,
    page_size: u32,
    proof: BorrowedFd<'_>,
) -> Option<ShmEndpoint> {
    let answer = Intro::new(IntroKind::Answer, page());
    let reactor = bell();
    let _ = send_intro(s.as_fd(), &answer, &[proof, reactor.bell()], true);
    let their_bell = offer.fds.into_iter().nth(1)?;
    let _ = join.agreement().compare_exchange(
        Agreement::UNDECIDED,
        Agreement::COMMITTED,
        Ordering::AcqRel,
        Ordering::Acquire,
    );
    azsdp::futex::wake_all(join.agreement());
    drop(s);
    join.into_endpoint(their_bell, offer.peer, page_size).ok()
}

/// Take in the DATA the peers of `ends` sent, into the report.
fn take_data<'a>(ends: impl Iterator<Item = &'a mut ShmEndpoint>, r: &mut Report) {
    for ep in ends {
        let mut got = Vec::new();
        ep.poll(&mut |ev| {
            if let FabricEvent::Message(m) = ev
                && let Ok(f) = wire::parse(m)
                && let Message::Data(d) = f.msg
            {
                got.extend_from_slice(d);
            }
        });
        r.saw(&got);
    }
}

/// After a refused offer: the connection must still work as plain TCP,
/// and no answer may have come.
fn plain_after(reg: &OwnedFd, tcp: OwnedFd, port: u16, r: &mut Report) {
    match connect_tcp(tcp, port) {
        Ok(s) => {
            r.answered = wait_readable(reg.as_fd(), Duration::from_secs(1))
                && recv_intro(reg.as_fd(), IntroKind::Answer, true).is_ok();
            (&s).write_all(b"plain bytes").ok();
            drain_tcp(&s, Duration::from_millis(500), r);
        }
        Err(e) => r.note = e,
    }
}

/// Parse `ADDR` in hex (with or without 0x).
fn hex(s: &str) -> u64 {
    u64::from_str_radix(s.trim_start_matches("0x"), 16)
        .unwrap_or_else(|_| die(format!("bad address {s}")))
}

// ----- client attacks ------------------------------------------------------------

/// Pair with the victim on `port`, then:
/// - `honest`: send and read back a little (a control);
/// - `get-outside`: advertise memory outside our registration;
/// - `stale-key`: advertise a registration we withdrew;
/// - `owner-word:PID:ADDR`: claim in the segment to be process PID (say, a
///   third process holding a secret at ADDR) and advertise ADDR;
/// - `corrupt-ring`, `corrupt-header`: write nonsense into the segment;
/// - `forged-identity:PID`: offer with our credentials but PID's pidfd;
/// - `bad-segment:unsealed|junk`: offer a segment that is not one.
fn client(port: u16, attack: &str, r: &mut Report) {
    let mut parts = attack.split(':');
    let kind = parts.next().unwrap_or("");
    match kind {
        "forged-identity" => return forged_identity(port, hex_or_dec(parts.next()), r),
        "bad-segment" => return bad_segment(port, parts.next().unwrap_or("junk"), r),
        _ => {}
    }
    let (tcp, mut ep) = match pair(port, r) {
        Ok(p) => p,
        Err(e) => {
            r.note = e;
            return;
        }
    };
    let mut seq = 0u32;
    let h = hello(&ep);
    if let Err(e) = post(&mut ep, &mut seq, Message::Hello(h)) {
        r.note = e;
        return;
    }
    let (ack, _) = listen_to(&mut ep, Duration::from_secs(2), r);
    let Some(ack) = ack else {
        r.note = "no HELLO_ACK".into();
        return;
    };
    // The connection began on TCP: its stream moves onto the fabric by a
    // JOIN (nothing sent on TCP), before anything of the stream.
    if let Err(e) = post(&mut ep, &mut seq, Message::Join { tcp_sent: 0 }) {
        r.note = e;
        return;
    }
    let me = adversary::side(&ep);
    let buf = vec![0x42u8; 64 << 10];
    let advertise = |ep: &mut ShmEndpoint, seq: &mut u32, addr: u64, key: u32| {
        post(
            ep,
            seq,
            Message::SrcAvail(SrcAvail {
                id: 0,
                lock_slot: 0,
                lock_gen: 0,
                len: 16 << 10,
                stream_off: 0,
                addr,
                key,
            }),
        )
    };
    let sent = match kind {
        "honest" => post(&mut ep, &mut seq, Message::Data(b"hello, victim")),
        "get-outside" => {
            let key = ep.register(buf.as_ptr() as u64, 4096).unwrap_or(0);
            advertise(&mut ep, &mut seq, buf.as_ptr() as u64 + 8192, key)
        }
        "stale-key" => {
            let key = ep
                .register(buf.as_ptr() as u64, buf.len() as u64)
                .unwrap_or(0);
            ep.deregister(key);
            advertise(&mut ep, &mut seq, buf.as_ptr() as u64, key)
        }
        "owner-word" => {
            let pid: u32 = hex_or_dec(parts.next());
            let addr = parts.next().map_or(buf.as_ptr() as u64, hex);
            adversary::set_owner(&ep, me, pid);
            let key = adversary::key(7, 1);
            adversary::write_registration(&ep, me, 7, key, addr, 64 << 10);
            advertise(&mut ep, &mut seq, addr, key)
        }
        "corrupt-ring" => {
            adversary::corrupt_ring(&ep, 1 - me);
            adversary::corrupt_ring(&ep, me);
            Ok(())
        }
        "corrupt-header" => {
            adversary::corrupt_header(&ep);
            post(&mut ep, &mut seq, Message::Data(b"after the header"))
        }
        other => die(format!("unknown attack {other}")),
    };
    if let Err(e) = sent {
        r.note = e;
    }
    let (_, gone) = listen_to(&mut ep, Duration::from_secs(2), r);
    if gone {
        r.note = format!("{} peer-gone", r.note).trim().to_string();
    }
    let _ = ack;
    drain_tcp(&tcp, Duration::from_millis(200), r);
}

fn hex_or_dec(s: Option<&str>) -> u32 {
    s.and_then(|s| s.parse().ok())
        .unwrap_or_else(|| die("a pid is needed".into()))
}

/// An offer with our credentials but another process's pidfd: the
/// listener must refuse it; then use the connection as plain TCP.
fn forged_identity(port: u16, pid: u32, r: &mut Report) {
    use nix::sys::socket::{ControlMessage, MsgFlags, UnixCredentials, sendmsg};
    let Some(reg) = registry(port) else {
        r.note = "no pairing name".into();
        return;
    };
    let tcp = new_tcp();
    let cookie = sock_diag::cookie_of(tcp.as_fd()).unwrap_or(0);
    let offer = ShmOffer::new(ShmParams::default()).unwrap_or_else(|e| die(e.to_string()));
    let intro = offer_intro(port, cookie);
    let mut b = [0u8; INTRO_LEN];
    intro.emit(&mut b);
    let theirs = azsdp::identity::pidfd_open(pid).unwrap_or_else(|e| die(e.to_string()));
    let reactor = bell();
    let raw = [
        theirs.as_raw_fd(),
        offer.memfd().as_raw_fd(),
        reactor.bell().as_raw_fd(),
    ];
    let creds = UnixCredentials::new();
    let cmsgs = [
        ControlMessage::ScmCredentials(&creds),
        ControlMessage::ScmRights(&raw),
    ];
    let _ = sendmsg::<()>(
        reg.as_raw_fd(),
        &[IoSlice::new(&b)],
        &cmsgs,
        MsgFlags::empty(),
        None,
    );
    plain_after(&reg, tcp, port, r);
}

/// Offer a segment that is not a proper one.
fn bad_segment(port: u16, how: &str, r: &mut Report) {
    use nix::sys::memfd::{MFdFlags, memfd_create};
    let Some(reg) = registry(port) else {
        r.note = "no pairing name".into();
        return;
    };
    let tcp = new_tcp();
    let cookie = sock_diag::cookie_of(tcp.as_fd()).unwrap_or(0);
    let flags = if how == "unsealed" {
        MFdFlags::MFD_CLOEXEC
    } else {
        MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING
    };
    let memfd = memfd_create(c"azsdp-shm", flags).unwrap_or_else(|e| die(e.to_string()));
    let mut f = std::fs::File::from(memfd.try_clone().expect("dup"));
    f.set_len(4 << 20).expect("size");
    // Junk: the right magic, absurd sizes, unsealed or sealed.
    f.write_all(&0x617a_7364_7073_686du64.to_le_bytes())
        .expect("write");
    f.write_all(&[0xff; 4096]).expect("write");
    if how != "unsealed" {
        use nix::fcntl::{FcntlArg, SealFlag, fcntl};
        let _ = fcntl(
            &memfd,
            FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW),
        );
    }
    let intro = offer_intro(port, cookie);
    let reactor = bell();
    let _ = send_intro(reg.as_fd(), &intro, &[memfd.as_fd(), reactor.bell()], false);
    plain_after(&reg, tcp, port, r);
}

// ----- the registry ------------------------------------------------------------

/// Hold the pairing names of `port` (the exact loopback one and the
/// wildcard, before its real listener starts), and answer and commit to
/// every offer for `secs`.
fn squat(port: u16, secs: u64, r: &mut Report) {
    let regs: Vec<OwnedFd> = [[127, 0, 0, 1], [0, 0, 0, 0]]
        .into_iter()
        .filter_map(|ip| bind_registry(&registry_name((ip, port).into())).ok())
        .collect();
    if regs.is_empty() {
        die("no name to squat".into());
    }
    println!("ready");
    let _ = std::io::stdout().flush();
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut streams = Vec::new();
    let mut ends = Vec::new();
    while Instant::now() < deadline {
        for reg in &regs {
            while let Some(s) = accept_nb(reg.as_fd()) {
                streams.push(s);
            }
        }
        for s in std::mem::take(&mut streams) {
            match recv_intro(s.as_fd(), IntroKind::Offer, true) {
                Ok((intro, offer)) => {
                    r.offers += 1;
                    let Some(Ok(memfd)) = offer.fds.first().map(|f| f.try_clone()) else {
                        continue;
                    };
                    let Ok(join) = ShmJoin::open(memfd, Duration::ZERO, false) else {
                        continue;
                    };
                    // A fake proof: a TCP socket of our own.
                    let fake = new_tcp();
                    let proof = fake.as_fd();
                    if let Some(ep) = answer_and_commit(s, join, offer, intro.page_size, proof) {
                        r.paired = true;
                        ends.push(ep);
                    }
                }
                Err(e) if e.would_block() => streams.push(s),
                Err(_) => {}
            }
        }
        take_data(ends.iter_mut(), r);
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Offer to pair the connection whose client socket has `cookie` (someone
/// else's), and wait `secs` for an answer.
fn lie(port: u16, cookie: u64, secs: u64, r: &mut Report) {
    let Some(reg) = registry(port) else {
        r.note = "no pairing name".into();
        return;
    };
    let offer = ShmOffer::new(ShmParams::default()).unwrap_or_else(|e| die(e.to_string()));
    let intro = offer_intro(port, cookie);
    let reactor = bell();
    send_intro(reg.as_fd(), &intro, &[offer.memfd(), reactor.bell()], false)
        .unwrap_or_else(|e| die(e.to_string()));
    r.offers = 1;
    println!("ready");
    let _ = std::io::stdout().flush();
    if wait_readable(reg.as_fd(), Duration::from_secs(secs)) {
        r.answered = recv_intro(reg.as_fd(), IntroKind::Answer, true).is_ok();
    }
    r.paired = offer.agreement().load(Ordering::Acquire) == Agreement::COMMITTED;
}

/// `idle` pairing connections that never speak, and a stream of offers for
/// connections that never come, for `secs`.
fn flood(port: u16, secs: u64, idle: usize, r: &mut Report) {
    let mut held = Vec::new();
    for _ in 0..idle {
        match registry(port) {
            Some(s) => held.push(s),
            None => break,
        }
    }
    println!("ready {}", held.len());
    let _ = std::io::stdout().flush();
    let reactor = bell();
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut k = 0u64;
    while Instant::now() < deadline {
        let Some(reg) = registry(port) else {
            std::thread::sleep(Duration::from_millis(5));
            continue;
        };
        let Ok(offer) = ShmOffer::new(ShmParams {
            ring_capacity: 4096,
            ..ShmParams::default()
        }) else {
            continue;
        };
        k += 1;
        let intro = offer_intro(port, k);
        if send_intro(reg.as_fd(), &intro, &[offer.memfd(), reactor.bell()], false).is_ok() {
            r.offers += 1;
        }
        held.push(reg);
        if held.len() > 4000 {
            held.drain(idle..idle + 1000);
        }
    }
}

/// The shapes of [`junk`]'s messages: every way a message with descriptors
/// can be wrong.
const JUNK_SHAPES: usize = 9;

/// Send one malformed message of shape `k` (mod [`JUNK_SHAPES`]) carrying
/// descriptors on `sock`; `len` is the size the receiver expects. Waits
/// for room until `deadline`.
fn send_junk(
    sock: BorrowedFd<'_>,
    k: usize,
    len: usize,
    extra: BorrowedFd<'_>,
    deadline: Instant,
) -> bool {
    use nix::sys::socket::{ControlMessage, MsgFlags, UnixCredentials, sendmsg};
    let me = azsdp::identity::pidfd_open(std::process::id()).unwrap_or_else(|e| die(e.to_string()));
    let init = azsdp::identity::pidfd_open(1).ok();
    let creds = UnixCredentials::from(libc::ucred {
        // SAFETY: plain system calls.
        pid: unsafe { libc::getpid() },
        // SAFETY: as above.
        uid: unsafe { libc::geteuid() },
        // SAFETY: as above.
        gid: unsafe { libc::getegid() },
    });
    let mut body = vec![0xa5u8; len];
    let good = &mut [0u8; INTRO_LEN];
    offer_intro(1, 1).emit(good);
    body[..len.min(INTRO_LEN)].copy_from_slice(&good[..len.min(INTRO_LEN)]);
    let many = |n: usize| {
        let mut v = vec![me.as_raw_fd()];
        v.resize(n, extra.as_raw_fd());
        v
    };
    // (payload length, descriptors, with credentials)
    let (size, fds, with_creds): (usize, Vec<i32>, bool) = match k % JUNK_SHAPES {
        // One more descriptor than an identity message carries, then far more.
        0 => (len, many(5), true),
        1 => (len, many(64), true),
        2 => (len, many(253), true),
        // No credentials of our own (the kernel may add them).
        3 => (len, many(2), false),
        // Garbage in the payload.
        4 => {
            body.fill(0x5a);
            (len, many(3), true)
        }
        // Half a message, and a longer one (truncated).
        5 => (len / 2, many(3), true),
        6 => {
            body.resize(len + 100, 0x11);
            (len + 100, many(3), true)
        }
        // The first descriptor is no pidfd of ours: another process's, or
        // not a pidfd at all.
        7 => {
            let mut v = many(3);
            v[0] = init.as_ref().map_or(extra.as_raw_fd(), |f| f.as_raw_fd());
            (len, v, true)
        }
        _ => (len, vec![extra.as_raw_fd(); 3], true),
    };
    let mut cmsgs = vec![ControlMessage::ScmRights(&fds)];
    if with_creds {
        cmsgs.insert(0, ControlMessage::ScmCredentials(&creds));
    }
    let iov = [IoSlice::new(&body[..size])];
    loop {
        match sendmsg::<()>(
            sock.as_raw_fd(),
            &iov,
            &cmsgs,
            MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL,
            None,
        ) {
            Ok(_) => return true,
            // A full bell, or too many of our descriptors in flight (the
            // kernel's limit per sender): let the victim take them in.
            Err(nix::Error::EAGAIN | nix::Error::ETOOMANYREFS) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(2))
            }
            Err(_) => return false,
        }
    }
}

/// `count` malformed messages with descriptors, of every shape: half on
/// pairing connections of their own (one message each, as a client's
/// offer), half on the bell of a pair made honestly first.
fn junk(port: u16, count: usize, r: &mut Report) {
    let (extra, _keep) =
        std::os::unix::net::UnixDatagram::pair().unwrap_or_else(|e| die(e.to_string()));
    println!("ready");
    let _ = std::io::stdout().flush();
    let to_registry = count / 2;
    let mut held = std::collections::VecDeque::new();
    let deadline = Instant::now() + Duration::from_secs(50);
    for k in 0..to_registry {
        let reg = loop {
            match registry(port) {
                Some(reg) => break reg,
                None if Instant::now() < deadline => {
                    // The listener's queue is full: let it take in what
                    // is queued.
                    std::thread::sleep(Duration::from_millis(2));
                }
                None => {
                    r.note = format!("the pairing name refused us after {k} messages");
                    return;
                }
            }
        };
        // Every other round of shapes: an offer first, the junk as its
        // note (which the listener reads only after an offer).
        if (k / JUNK_SHAPES) % 2 == 1 {
            let _ = send_intro(
                reg.as_fd(),
                &offer_intro(port, k as u64 + 1),
                &[extra.as_fd()],
                true,
            );
        }
        if send_junk(reg.as_fd(), k, INTRO_LEN, extra.as_fd(), deadline) {
            r.offers += 1;
        }
        // Keep a few open (a listener reads a message before it sees the
        // close), the rest go.
        held.push_back(reg);
        if held.len() > 64 {
            held.pop_front();
        }
    }
    drop(held);
    // The bell: offer honestly, then ring the victim's bell (which its
    // answer carries) with junk.
    let (tcp, offer, _, answer) = loop {
        match offer_and_answer(port, r) {
            Ok(p) => break p,
            // Our junk's descriptors still in flight, or the victim still
            // taking in the junk (and refusing offers meanwhile): wait.
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
            Err(e) => {
                r.note = format!("no answer, so no bell: {e}");
                return;
            }
        }
    };
    let Some(their_bell) = answer.fds.get(1) else {
        r.note = "the answer carries no bell".into();
        return;
    };
    // A mail: a token, then an intro's bytes.
    let mail = 8 + INTRO_LEN;
    for k in 0..count - to_registry {
        if send_junk(their_bell.as_fd(), k, mail, extra.as_fd(), deadline) {
            r.offers += 1;
        }
    }
    drop(offer);
    drop(tcp);
}

// ----- a hostile listener ---------------------------------------------------------

/// A listener of our own on `port` that pairs with azsdp clients honestly,
/// answers their HELLO, then attacks: `corrupt-ring`, `corrupt-header`,
/// `owner-word:PID` (claim in the segment to be PID).
fn server(port: u16, attack: &str, secs: u64, r: &mut Report) {
    let l = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap_or_else(|e| die(e.to_string()));
    let reg =
        bind_registry(&registry_name(([127, 0, 0, 1], port).into())).unwrap_or_else(|e| die(e));
    l.set_nonblocking(true).expect("nonblocking");
    println!("ready");
    let _ = std::io::stdout().flush();
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut streams = Vec::new();
    let mut offers = Vec::new();
    let mut keep = Vec::new();
    while Instant::now() < deadline {
        while let Some(s) = accept_nb(reg.as_fd()) {
            streams.push(s);
        }
        for s in std::mem::take(&mut streams) {
            match recv_intro(s.as_fd(), IntroKind::Offer, true) {
                Ok((intro, offer)) => offers.push((s, intro, offer)),
                Err(e) if e.would_block() => streams.push(s),
                Err(_) => {}
            }
        }
        if let Ok((tcp, peer)) = l.accept() {
            let far = sock_diag::far_end(
                tcp.local_addr().expect("local"),
                peer,
                sock_diag::Netns::Here,
            )
            .ok()
            .flatten();
            let i = far.and_then(|f| {
                offers
                    .iter()
                    .position(|(_, i, _)| i.pair.is_some_and(|p| p.cookie == f.cookie))
            });
            if let Some(i) = i {
                let (s, intro, offer) = offers.swap_remove(i);
                r.offers += 1;
                let Some(Ok(memfd)) = offer.fds.first().map(|f| f.try_clone()) else {
                    continue;
                };
                let Ok(join) = ShmJoin::open(memfd, Duration::ZERO, false) else {
                    continue;
                };
                let proof = tcp.as_fd();
                if let Some(mut ep) = answer_and_commit(s, join, offer, intro.page_size, proof) {
                    r.paired = true;
                    let (h, _) = listen_to(&mut ep, Duration::from_secs(2), r);
                    let mut seq = 0;
                    if h.is_some() {
                        let ack = hello(&ep);
                        let _ = post(&mut ep, &mut seq, Message::HelloAck(ack));
                        let _ = post(&mut ep, &mut seq, Message::Join { tcp_sent: 0 });
                    }
                    let me = adversary::side(&ep);
                    match attack.split(':').next() {
                        Some("corrupt-ring") => {
                            adversary::corrupt_ring(&ep, me);
                            adversary::corrupt_ring(&ep, 1 - me);
                        }
                        Some("corrupt-header") => adversary::corrupt_header(&ep),
                        Some("owner-word") => {
                            let pid = attack
                                .split(':')
                                .nth(1)
                                .and_then(|p| p.parse().ok())
                                .unwrap_or(1);
                            adversary::set_owner(&ep, me, pid);
                            let _ = ep.post_cas(
                                OpId(1),
                                azsdp::conn::CasTarget::Local { slot: 0 },
                                0,
                                1,
                            );
                        }
                        _ => {}
                    }
                    keep.push((tcp, ep));
                }
            }
        }
        take_data(keep.iter_mut().map(|(_, ep)| ep), r);
        std::thread::sleep(Duration::from_millis(2));
    }
}
