//! Pairing: the side that makes the segment offers it with its process's
//! bell; the other maps it, checks it and answers with its own bell. Both
//! messages carry the sender's kernel identity.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use super::bells;
use super::endpoint::{ShmEndpoint, page_size};
use super::segment::{Segment, ShmParams, bad};
use super::waiter::ShmWaiter;
use crate::driver::reactor::Reactor;
use crate::fabric::ring;
use crate::identity::{self, IdentityError, PeerId};
use crate::pairing::{BellNote, INTRO_LEN, Intro, IntroKind};
use crate::transport::{self, Transport};

/// Send a side-channel message of `kind` with this process's identity and
/// `fds`, whole or not at all.
pub fn send_intro(
    sock: BorrowedFd<'_>,
    intro: &Intro,
    fds: &[BorrowedFd<'_>],
    nonblocking: bool,
) -> std::io::Result<()> {
    let mut b = [0u8; INTRO_LEN];
    intro.emit(&mut b);
    if nonblocking {
        identity::send_nonblocking(sock, &b, fds)
    } else {
        identity::send(sock, &b, fds)
    }
}

/// Why a side-channel message was refused.
#[derive(Debug, thiserror::Error)]
pub enum IntroError {
    #[error("{0}")]
    Identity(#[from] IdentityError),
    #[error("{0}")]
    Format(#[from] crate::pairing::PairError),
    #[error("expected {want:?}, got {got:?}")]
    Kind { want: IntroKind, got: IntroKind },
    #[error("a note that carries descriptors, or more than a message")]
    NoteCarries,
}

impl IntroError {
    /// Nothing was queued (non-blocking receive).
    pub fn would_block(&self) -> bool {
        matches!(self, IntroError::Identity(IdentityError::Io(e)) if e.kind() == std::io::ErrorKind::WouldBlock)
    }

    /// The system call's error, if that is what it was.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            IntroError::Identity(IdentityError::Io(e)) => e.raw_os_error(),
            _ => None,
        }
    }
}

impl From<IntroError> for std::io::Error {
    fn from(e: IntroError) -> Self {
        match e {
            IntroError::Identity(IdentityError::Io(e)) => e,
            e => std::io::Error::other(e.to_string()),
        }
    }
}

/// Receive one side-channel message of kind `want`, with its sender's
/// verified identity and descriptors.
pub fn recv_intro(
    sock: BorrowedFd<'_>,
    want: IntroKind,
    nonblocking: bool,
) -> Result<(Intro, identity::Received), IntroError> {
    let mut b = [0u8; INTRO_LEN];
    let r = identity::recv(sock, &mut b, nonblocking)?;
    let intro = Intro::parse(&b)?;
    if intro.kind != want {
        return Err(IntroError::Kind {
            want,
            got: intro.kind,
        });
    }
    Ok((intro, r))
}

/// Send `intro` as a note: a message on a stream whose first message
/// carried the sender's identity, so it carries none, nor descriptors.
/// Never blocks (EAGAIN if the stream has no room).
pub fn send_note(sock: BorrowedFd<'_>, intro: &Intro) -> std::io::Result<()> {
    let mut b = [0u8; INTRO_LEN];
    intro.emit(&mut b);
    let flags = nix::sys::socket::MsgFlags::MSG_DONTWAIT | nix::sys::socket::MsgFlags::MSG_NOSIGNAL;
    let n = nix::sys::socket::send(sock.as_raw_fd(), &b, flags)?;
    if n != INTRO_LEN {
        return Err(std::io::Error::other("note sent short"));
    }
    Ok(())
}

/// Receive a note of kind `want` ([`send_note`]) without waiting;
/// `Ok(None)`: none queued. Descriptors that came with it are closed, and
/// a note that carries any is refused.
pub fn recv_note(sock: BorrowedFd<'_>, want: IntroKind) -> Result<Option<Intro>, IntroError> {
    let mut b = [0u8; INTRO_LEN];
    let r = match crate::scm::recv(sock.as_raw_fd(), &mut b, libc::MSG_DONTWAIT) {
        Ok(r) => r,
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(None),
        Err(e) => return Err(IntroError::Identity(IdentityError::Io(e))),
    };
    if r.bytes == 0 && !r.truncated {
        return Err(IntroError::Identity(IdentityError::Io(
            std::io::ErrorKind::UnexpectedEof.into(),
        )));
    }
    if !r.fds.is_empty() || r.truncated {
        return Err(IntroError::NoteCarries);
    }
    let intro = Intro::parse(&b[..r.bytes])?;
    if intro.kind != want {
        return Err(IntroError::Kind {
            want,
            got: intro.kind,
        });
    }
    Ok(Some(intro))
}

/// A segment this side made, before the peer has joined.
#[derive(Debug)]
pub struct ShmOffer {
    pub(super) seg: Segment,
    pub(super) memfd: OwnedFd,
    pub(super) params: ShmParams,
}

impl ShmOffer {
    pub fn new(params: ShmParams) -> std::io::Result<ShmOffer> {
        let (seg, memfd) = Segment::create(&params)?;
        Ok(ShmOffer { seg, memfd, params })
    }

    /// The segment's descriptor, to pass to the peer with the offer.
    pub fn memfd(&self) -> BorrowedFd<'_> {
        self.memfd.as_fd()
    }

    /// See [`ShmEndpoint::agreement`].
    pub fn agreement(&self) -> &AtomicU32 {
        &self.seg.hdr().agreement
    }

    /// Give up on a pair the peer may already have committed to: mark our
    /// side closed, so that the peer's engine sees us leave.
    pub fn abandon(self) {
        self.seg.hdr().closed[0].store(1, Ordering::Release);
        for dir in 0..2 {
            if let Ok(r) = self.seg.ring(dir) {
                crate::futex::wake_all(r.wait_words().0);
            }
        }
    }

    /// The peer joined (its answer named it, and passed its process's
    /// `bell`): run side 0.
    pub fn into_endpoint(
        self,
        bell: OwnedFd,
        peer: PeerId,
        peer_page_size: u32,
    ) -> std::io::Result<ShmEndpoint> {
        let bell = bells::take(&peer, None, Some(bell), false)?.bell;
        ShmEndpoint::new(self.seg, 0, bell, peer, peer_page_size, self.params)
    }

    /// [`Self::into_endpoint`] with the peer's bell in hand.
    fn into_endpoint_with(
        self,
        bell: Arc<OwnedFd>,
        peer: PeerId,
        peer_page_size: u32,
    ) -> std::io::Result<ShmEndpoint> {
        ShmEndpoint::new(self.seg, 0, bell, peer, peer_page_size, self.params)
    }
}

/// A segment the peer offered, mapped and checked.
#[derive(Debug)]
pub struct ShmJoin {
    pub(super) seg: Segment,
    pub(super) params: ShmParams,
}

impl ShmJoin {
    /// Map the offered `memfd`; `poll` is this side's busy-poll time,
    /// `keep_for_exec` as in [`ShmParams`].
    pub fn open(memfd: OwnedFd, poll: Duration, keep_for_exec: bool) -> std::io::Result<ShmJoin> {
        let seg = Segment::open(memfd, keep_for_exec)?;
        let params = ShmParams {
            ring_capacity: seg.layout.ring_len - ring::HEADER,
            lock_slots: seg.slots,
            poll,
            keep_for_exec,
        };
        Ok(ShmJoin { seg, params })
    }

    /// See [`ShmEndpoint::agreement`].
    pub fn agreement(&self) -> &AtomicU32 {
        &self.seg.hdr().agreement
    }

    /// Run side 1, with the offering `peer` and its process's `bell`.
    pub fn into_endpoint(
        self,
        bell: OwnedFd,
        peer: PeerId,
        peer_page_size: u32,
    ) -> std::io::Result<ShmEndpoint> {
        let bell = bells::take(&peer, None, Some(bell), false)?.bell;
        ShmEndpoint::new(self.seg, 1, bell, peer, peer_page_size, self.params)
    }

    /// [`Self::into_endpoint`] with the peer's bell in hand.
    fn into_endpoint_with(
        self,
        bell: Arc<OwnedFd>,
        peer: PeerId,
        peer_page_size: u32,
    ) -> std::io::Result<ShmEndpoint> {
        ShmEndpoint::new(self.seg, 1, bell, peer, peer_page_size, self.params)
    }
}

/// Our bell's descriptor number, for a peer that takes it from us itself.
fn bell_fd(reactor: &Reactor) -> u32 {
    reactor.bell().as_raw_fd() as u32
}

/// The shm fabric as a [`Transport`]: segments of `params`; each side's
/// half names its process's bell, and passes it unless the peer process
/// keeps it already ([`bells`]; an offer: the segment, then the bell; an
/// answer: the bell).
#[derive(Clone, Copy, Debug)]
pub struct ShmTransport {
    pub params: ShmParams,
}

/// [`ShmTransport`]'s offer: the segment made, and what it says of our
/// bell.
#[derive(Debug)]
pub struct ShmOffered {
    pub(super) offer: ShmOffer,
    pub(super) reactor: Arc<Reactor>,
    note: BellNote,
    held_by: HeldBy,
    /// The registry's owner the offer goes to.
    to: u32,
}

/// The process an offer said holds our bell: if the pair does not come
/// about (it may be a new image, or another process answered), the next
/// offer passes the bell again.
#[derive(Debug)]
struct HeldBy(Option<u32>);

impl Drop for HeldBy {
    fn drop(&mut self) {
        if let Some(pid) = self.0 {
            bells::not_kept_by(pid);
        }
    }
}

/// [`ShmTransport`]'s join: the offered segment mapped and checked, the
/// offerer's bell, and what our answer says of the bells.
#[derive(Debug)]
pub struct ShmJoined {
    pub(super) join: ShmJoin,
    pub(super) bell: Arc<OwnedFd>,
    pub(super) reactor: Arc<Reactor>,
    note: BellNote,
}

impl Transport for ShmTransport {
    type Endpoint = ShmEndpoint;
    type Offer = ShmOffered;
    type Join = ShmJoined;

    fn offer(&self, to: u32) -> std::io::Result<ShmOffered> {
        let reactor = Reactor::get()?;
        let note = bells::offer_note(reactor.bell_id(), bell_fd(&reactor), to);
        Ok(ShmOffered {
            offer: ShmOffer::new(self.params)?,
            reactor,
            note,
            held_by: HeldBy(note.held.then_some(to)),
            to,
        })
    }

    fn join(
        &self,
        offered: Option<BellNote>,
        peer: &PeerId,
        fds: Vec<OwnedFd>,
    ) -> std::io::Result<ShmJoined> {
        let mut fds = fds.into_iter();
        let Some(memfd) = fds.next() else {
            return Err(bad("an offer carries a segment and a bell, nothing else"));
        };
        let passed = fds.next();
        if fds.next().is_some() {
            return Err(bad("an offer carries a segment and a bell, nothing else"));
        }
        let join = ShmJoin::open(memfd, self.params.poll, self.params.keep_for_exec)?;
        let taken = bells::take(peer, offered, passed, true)?;
        let reactor = Reactor::get()?;
        let note = bells::answer_note(
            reactor.bell_id(),
            bell_fd(&reactor),
            offered,
            taken.kept,
            taken.takes,
        );
        Ok(ShmJoined {
            join,
            bell: taken.bell,
            reactor,
            note,
        })
    }
}

impl transport::Offer for ShmOffered {
    type Endpoint = ShmEndpoint;

    fn note(&self) -> Option<BellNote> {
        Some(self.note)
    }

    fn fds(&self) -> Vec<BorrowedFd<'_>> {
        let mut v = vec![self.offer.memfd()];
        if !self.note.held {
            v.push(self.reactor.bell());
        }
        v
    }

    fn agreement(&self) -> &AtomicU32 {
        self.offer.agreement()
    }

    fn abandon(self) {
        self.offer.abandon();
    }

    fn into_endpoint(
        self,
        answer: Option<BellNote>,
        fds: Vec<OwnedFd>,
        peer: PeerId,
        peer_page_size: u32,
    ) -> std::io::Result<ShmEndpoint> {
        let ShmOffered {
            offer,
            note,
            mut held_by,
            to,
            ..
        } = self;
        bells::answer_came(&peer, to, note, answer);
        let mut fds = fds.into_iter();
        let passed = fds.next();
        if fds.next().is_some() {
            return Err(bad("an answer carries a bell, nothing else"));
        }
        let taken = bells::take(&peer, answer, passed, true);
        bells::we_take_from(to, taken.as_ref().is_ok_and(|t| t.takes));
        let ep = offer.into_endpoint_with(taken?.bell, peer, peer_page_size)?;
        held_by.0 = None;
        Ok(ep)
    }
}

impl transport::Join for ShmJoined {
    type Endpoint = ShmEndpoint;

    fn note(&self) -> Option<BellNote> {
        Some(self.note)
    }

    fn fds(&self) -> Vec<BorrowedFd<'_>> {
        if self.note.held {
            Vec::new()
        } else {
            vec![self.reactor.bell()]
        }
    }

    fn agreement(&self) -> &AtomicU32 {
        self.join.agreement()
    }

    fn into_endpoint(self, peer: PeerId, peer_page_size: u32) -> std::io::Result<ShmEndpoint> {
        self.join
            .into_endpoint_with(self.bell, peer, peer_page_size)
    }
}

impl transport::Endpoint for ShmEndpoint {
    type Waiter = ShmWaiter;

    fn waiter(&self) -> ShmWaiter {
        ShmEndpoint::waiter(self)
    }

    fn peer_pid(&self) -> u32 {
        self.peer.pid()
    }

    fn get_refused(&self) -> Option<String> {
        self.no_get.as_ref().map(|n| format!("{n:?}"))
    }

    fn same_user(&self) -> bool {
        ShmEndpoint::same_user(self)
    }

    fn agreement(&self) -> &AtomicU32 {
        ShmEndpoint::agreement(self)
    }
}

impl ShmEndpoint {
    /// Bootstrap over a connected Unix socket as the side that makes the
    /// segment (side 0), as [`ShmTransport`] pairs: the offer carries the
    /// segment and this process's bell, the answer the peer's bell (or
    /// names it, if we keep it). `sock` stays the caller's.
    pub fn offer(sock: &impl AsFd, params: ShmParams) -> std::io::Result<ShmEndpoint> {
        use transport::Offer as _;
        // (Whom it goes to is not asked: our bell is passed.)
        let offer = ShmTransport { params }.offer(0)?;
        let fd = sock.as_fd();
        let intro = Intro {
            bell: offer.note(),
            ..Intro::new(IntroKind::Offer, page_size())
        };
        send_intro(fd, &intro, &offer.fds(), false)?;
        let (intro, answer) = recv_intro(fd, IntroKind::Answer, false)?;
        offer.into_endpoint(intro.bell, answer.fds, answer.peer, intro.page_size)
    }

    /// Bootstrap over a connected Unix socket as the side that maps the
    /// peer's segment (side 1).
    pub fn accept(sock: &impl AsFd, params: ShmParams) -> std::io::Result<ShmEndpoint> {
        use transport::Join as _;
        let fd = sock.as_fd();
        let (intro, offer) = recv_intro(fd, IntroKind::Offer, false)?;
        let join = ShmTransport { params }.join(intro.bell, &offer.peer, offer.fds)?;
        let answer = Intro {
            bell: join.note(),
            ..Intro::new(IntroKind::Answer, page_size())
        };
        send_intro(fd, &answer, &join.fds(), false)?;
        join.into_endpoint(offer.peer, intro.page_size)
    }
}
