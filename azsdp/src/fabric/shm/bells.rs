//! Peers' bells, passed once per pair of processes (docs/protocol.md §10,
//! "Bells").
//!
//! Every endpoint rings its peer process's bell, a Unix datagram socket.
//! Passing a Unix socket in a message keeps it "in flight" until the
//! receiver takes it, and while any is in flight anywhere on the host, every
//! close of a Unix socket queues a run of the kernel's Unix garbage
//! collector (a kworker woken: 1.65 runs per connection in a burst of
//! pairs, when every offer and answer carried a bell). So a process keeps
//! a peer process's bell for as long as that process lives, and says so in
//! its next message to it (`BellNote::keeps`, with that bell's id); the
//! peer then only names its bell (`BellNote::held`). Each side states only
//! what it holds, so a bell is named only to a process that said it keeps
//! it. One named and not found (the process exec'd since, or lied) fails
//! that one pair (it stays TCP), and the next exchange passes it again.
//!
//! A pre-forked server's offers go to the registry of the process that
//! listens, and any of its workers answers: no one process of them can say
//! that it keeps a client's bell for the next offer. So a bell is named
//! with its descriptor number, and a receiver that does not hold it takes
//! it from the sender's process itself (`pidfd_getfd`, which the kernel
//! allows to a process that may read the other's memory), checking that
//! it is the bell named. A process that takes bells itself says so
//! ([`BellNote::fetches`]); a client then names its bell to every process
//! of that registry's family, and takes theirs itself, so that no bell is
//! in flight. A take that fails fails that one pair, and the next passes.
//!
//! A process keeps at most one bell per peer process (a new one replaces
//! the old: a peer that exec'd has a new reactor), at most
//! [`KEEP_MOST_OF_USER`] of one user's processes and [`KEEP_MOST`] in all,
//! so a flood of offers cannot make a server hold descriptors: past those,
//! it keeps nothing more and bells come with every pair, as before. The
//! stats thread lets go of the bells of processes that exited ([`prune`]).

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crate::identity::PeerId;
use crate::pairing::BellNote;
use crate::sync::Lock;

/// Peer processes whose bells this process keeps for as long as they live,
/// at most (each costs a descriptor, and its pidfd).
pub const KEEP_MOST: usize = 1024;
/// The same, of one user's processes.
pub const KEEP_MOST_OF_USER: usize = 64;

/// The id of the bell `fd` in pairing messages: its socket's inode number
/// (sockets' are 32-bit; never 0).
pub fn bell_id(fd: BorrowedFd<'_>) -> std::io::Result<u32> {
    let st = nix::sys::stat::fstat(fd).map_err(std::io::Error::from)?;
    Ok((st.st_ino as u32).max(1))
}

/// Why a bell could not be had.
#[derive(Debug, thiserror::Error)]
pub enum BellError {
    #[error("the message neither passes a bell nor names one we hold")]
    Missing,
    #[error(
        "the message names bell {0}, which we do not hold and could not take from its process: {1}"
    )]
    NotHeld(u32, std::io::Error),
    #[error("the message names bell {named}, and passes bell {passed}")]
    Mislabelled { named: u32, passed: u32 },
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

impl From<BellError> for std::io::Error {
    fn from(e: BellError) -> std::io::Error {
        match e {
            BellError::Io(e) => e,
            e => std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()),
        }
    }
}

/// A peer process's bell that we hold.
#[derive(Debug)]
struct Held {
    peer: PeerId,
    id: u32,
    bell: Weak<OwnedFd>,
    /// Held for good (while the peer lives): we said so.
    kept: Option<Arc<OwnedFd>>,
    /// We can take this process's bells from it ourselves.
    takes: bool,
}

/// A peer's bell as taken: the descriptor, whether we keep it for good,
/// and whether we can take that process's bells from it ourselves.
#[derive(Debug)]
pub struct Taken {
    pub bell: Arc<OwnedFd>,
    pub kept: bool,
    pub takes: bool,
}

/// What a client knows of the processes behind one registry (a listener
/// and the workers it forked, any of which may answer).
#[derive(Clone, Copy, Debug)]
struct Family {
    /// The registry's owner (its pid, as the kernel said).
    owner: u32,
    /// They take our bell from us themselves: offers only name it.
    take_ours: bool,
    /// We take theirs ourselves: offers say so.
    we_take: bool,
}

/// This process's bells, and the peer processes that said they keep its
/// own.
#[derive(Debug, Default)]
struct Bells {
    /// The process these are of: a forked child's bell is new, and no
    /// peer keeps it yet.
    pid: u32,
    held: Vec<Held>,
    keepers: Vec<PeerId>,
    families: Vec<Family>,
    /// When [`prune`] last looked.
    pruned: Option<Instant>,
}

static BELLS: Lock<Bells> = Lock::new(Bells {
    pid: 0,
    held: Vec::new(),
    keepers: Vec::new(),
    families: Vec::new(),
    pruned: None,
});

/// How often [`prune`] asks after the processes whose bells we keep.
const PRUNE_EVERY: Duration = Duration::from_secs(1);

/// This process's table (a forked child's keepers are dropped first).
fn bells() -> crate::sync::LockGuard<'static, Bells> {
    let mut b = BELLS.lock();
    let pid = crate::process::pid();
    if b.pid != pid {
        b.pid = pid;
        b.keepers.clear();
        b.families.clear();
    }
    b
}

/// The bell that `n` names, taken from `peer`'s process itself.
fn fetch(peer: &PeerId, n: BellNote) -> Result<OwnedFd, BellError> {
    let fd = crate::identity::pidfd_getfd(peer.pidfd(), n.fd)
        .map_err(|e| BellError::NotHeld(n.id, e))?;
    let got = bell_id(fd.as_fd())?;
    if got != n.id {
        let e = std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("its descriptor {} is not that bell", n.fd),
        );
        return Err(BellError::NotHeld(n.id, e));
    }
    Ok(fd)
}

impl Bells {
    fn kept_count(&self, uid: Option<u32>) -> usize {
        self.held
            .iter()
            .filter(|h| h.kept.is_some() && uid.is_none_or(|u| h.peer.uid() == u))
            .count()
    }

    /// Forget the bells and keepers of processes that have exited (one
    /// question to the kernel per process).
    fn prune(&mut self) {
        for h in &mut self.held {
            if h.kept.is_some() && !h.peer.alive() {
                h.kept = None;
            }
        }
        self.drop_unused();
        self.keepers.retain(PeerId::alive);
        self.families.retain(|f| {
            let pid = nix::unistd::Pid::from_raw(f.owner as i32);
            nix::sys::signal::kill(pid, None) != Err(nix::errno::Errno::ESRCH)
        });
    }

    /// What we know of the family behind the registry of `owner`.
    fn family(&self, owner: u32) -> Family {
        self.families
            .iter()
            .find(|f| f.owner == owner)
            .copied()
            .unwrap_or(Family {
                owner,
                take_ours: false,
                we_take: false,
            })
    }

    /// Change what we know of the family behind the registry of `owner`
    /// (a record that says nothing is dropped).
    fn update_family(&mut self, owner: u32, change: impl FnOnce(&mut Family)) {
        let mut f = self.family(owner);
        change(&mut f);
        self.families.retain(|g| g.owner != owner);
        if f.take_ours || f.we_take {
            if self.families.len() >= KEEP_MOST {
                self.families.remove(0);
            }
            self.families.push(f);
        }
    }

    /// Forget the bells neither kept nor used by a connection.
    fn drop_unused(&mut self) {
        self.held
            .retain(|h| h.kept.is_some() || h.bell.strong_count() > 0);
    }

    /// Is there room to keep one more bell of `uid`'s process? Bells of
    /// processes that have exited go first.
    fn room(&mut self, uid: u32) -> bool {
        let fits = |b: &Bells| {
            b.kept_count(None) < KEEP_MOST && b.kept_count(Some(uid)) < KEEP_MOST_OF_USER
        };
        if fits(self) {
            return true;
        }
        self.prune();
        fits(self)
    }

    /// The id of the bell we keep of the live process `pid` (0: none).
    fn kept_of(&self, pid: u32) -> u32 {
        self.held
            .iter()
            .find(|h| h.kept.is_some() && h.peer.pid() == pid && h.peer.alive())
            .map_or(0, |h| h.id)
    }

    fn add_keeper(&mut self, peer: &PeerId) {
        if self.keepers.iter().any(|k| k.same_process(peer)) {
            return;
        }
        if self.keepers.len() >= KEEP_MOST {
            self.keepers.retain(PeerId::alive);
        }
        if self.keepers.len() < KEEP_MOST {
            self.keepers.push(peer.clone());
        }
    }

    fn drop_keeper(&mut self, peer: &PeerId) {
        self.keepers.retain(|k| !k.same_process(peer));
    }

    /// The bell of `peer` that `note` names or `passed` is (or, named and
    /// not held, taken from its process), and whether we keep it for good
    /// (if `keep` and we have room).
    fn take(
        &mut self,
        peer: &PeerId,
        note: Option<BellNote>,
        passed: Option<OwnedFd>,
        keep: bool,
    ) -> Result<Taken, BellError> {
        self.drop_unused();
        let (fd, fetched) = match passed {
            Some(fd) => (fd, false),
            None => {
                let n = note.filter(|n| n.held).ok_or(BellError::Missing)?;
                let held = self
                    .held
                    .iter()
                    .filter(|h| h.peer.same_process(peer) && h.id == n.id)
                    .find_map(|h| {
                        h.bell.upgrade().map(|bell| Taken {
                            bell,
                            kept: h.kept.is_some(),
                            takes: h.takes,
                        })
                    });
                if let Some(t) = held {
                    return Ok(t);
                }
                (fetch(peer, n)?, true)
            }
        };
        let id = bell_id(fd.as_fd())?;
        if let Some(n) = note.filter(|n| n.id != id) {
            return Err(BellError::Mislabelled {
                named: n.id,
                passed: id,
            });
        }
        // Could we have taken it ourselves? One try, when a bell is passed
        // (once per pair of processes), tells later messages.
        let takes = fetched || note.is_some_and(|n| fetch(peer, n).is_ok());
        let already = self
            .held
            .iter()
            .any(|h| h.kept.is_some() && h.peer.same_process(peer) && h.id == id);
        let keep = keep && (already || self.room(peer.uid()));
        if keep {
            // One kept bell per process: the newest is its bell now.
            for h in &mut self.held {
                if h.peer.same_process(peer) && h.id != id {
                    h.kept = None;
                }
            }
        }
        if let Some(h) = self
            .held
            .iter_mut()
            .find(|h| h.peer.same_process(peer) && h.id == id)
            && let Some(b) = h.bell.upgrade()
        {
            if keep {
                h.kept = Some(Arc::clone(&b));
            }
            h.takes |= takes;
            return Ok(Taken {
                bell: b,
                kept: h.kept.is_some(),
                takes: h.takes,
            });
        }
        let b = Arc::new(fd);
        self.held.push(Held {
            peer: peer.clone(),
            id,
            bell: Arc::downgrade(&b),
            kept: keep.then(|| Arc::clone(&b)),
            takes,
        });
        Ok(Taken {
            bell: b,
            kept: keep,
            takes,
        })
    }
}

/// What our offer to the registry of process `to` (its pid, as the kernel
/// says) says of the bells: ours (`ours`, descriptor `fd`) held if that
/// process said it keeps it, or its family takes it from us; which of its
/// bells we keep; whether we take theirs ourselves.
pub fn offer_note(ours: u32, fd: u32, to: u32) -> BellNote {
    let b = bells();
    let family = b.family(to);
    BellNote {
        id: ours,
        held: family.take_ours || b.keepers.iter().any(|k| k.pid() == to && k.alive()),
        keeps: b.kept_of(to),
        fd,
        fetches: family.we_take,
    }
}

/// A pair whose offer said that the process `to` (or its family) holds
/// our bell did not come about: pass it next time.
pub fn not_kept_by(to: u32) {
    let mut b = bells();
    b.keepers.retain(|k| k.pid() != to);
    b.update_family(to, |f| f.take_ours = false);
}

/// The bell of `peer` (verified) that its message `note` names or passes
/// (`passed`), or that it names and we take from its process, and whether
/// we keep it for good (if `keep`, and we have room). A bell passed with
/// no note (a claim, an heir's, a peer that names none) is held only while
/// used.
pub fn take(
    peer: &PeerId,
    note: Option<BellNote>,
    passed: Option<OwnedFd>,
    keep: bool,
) -> Result<Taken, BellError> {
    bells().take(peer, note, passed, keep && note.is_some())
}

/// What our answer to an offer that said `offered` says of the bells: ours
/// (`ours`, descriptor `fd`) held if the offer said it keeps it or takes
/// it itself; theirs kept if `kept`; whether we took theirs (`takes`).
pub fn answer_note(
    ours: u32,
    fd: u32,
    offered: Option<BellNote>,
    kept: bool,
    takes: bool,
) -> BellNote {
    BellNote {
        id: ours,
        held: offered.is_some_and(|o| o.keeps == ours || o.fetches),
        keeps: if kept { offered.map_or(0, |o| o.id) } else { 0 },
        fd,
        fetches: takes,
    }
}

/// The answer of `peer` (verified; a process of the family behind the
/// registry of `to`) to our offer, which said `offered`, said `answer`:
/// whether that process keeps our bell now, and whether its family takes
/// it from us itself.
pub fn answer_came(peer: &PeerId, to: u32, offered: BellNote, answer: Option<BellNote>) {
    let mut b = bells();
    let keeps = answer.is_some_and(|a| a.keeps == offered.id);
    if keeps {
        b.add_keeper(peer);
    } else {
        b.drop_keeper(peer);
    }
    let takes = keeps && answer.is_some_and(|a| a.fetches);
    b.update_family(to, |f| f.take_ours = takes);
}

/// Whether we took (or could take) a bell of the family behind the
/// registry of `to` from its process ourselves: later offers say so.
pub fn we_take_from(to: u32, takes: bool) {
    bells().update_family(to, |f| f.we_take = takes);
}

/// Forget the bells of peer processes that have exited (the stats
/// thread calls it; it looks once a second at most): a process that
/// paired with a thousand short-lived clients holds nothing of them after.
pub fn prune() {
    let mut b = bells();
    let now = Instant::now();
    if b.pruned.is_some_and(|t| now < t + PRUNE_EVERY) {
        return;
    }
    b.pruned = Some(now);
    b.prune();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bell() -> (OwnedFd, u32) {
        use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
        let (_r, w) = socketpair(
            AddressFamily::Unix,
            SockType::Datagram,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .unwrap();
        let id = bell_id(w.as_fd()).unwrap();
        (w, id)
    }

    fn me() -> PeerId {
        let fd = crate::identity::pidfd_open(std::process::id()).unwrap();
        PeerId::resumed(
            std::process::id(),
            nix::unistd::geteuid().as_raw(),
            nix::unistd::getegid().as_raw(),
            fd,
        )
        .unwrap()
    }

    fn note(id: u32, held: bool) -> Option<BellNote> {
        Some(BellNote {
            id,
            held,
            keeps: 0,
            fd: 0,
            fetches: false,
        })
    }

    /// A bell passed once is found by name after, and only by its own
    /// process and id; one not kept only while used.
    #[test]
    fn a_kept_bell_is_found_by_its_name_and_an_unkept_one_is_not() {
        let mut t = Bells::default();
        let peer = me();
        let (w, id) = bell();
        let b = t.take(&peer, note(id, false), Some(w), true).unwrap();
        assert!(b.kept);
        assert_eq!(t.kept_of(std::process::id()), id);
        drop(b);
        let again = t.take(&peer, note(id, true), None, true).unwrap();
        assert!(again.kept, "kept while its process lives, used or not");
        let again = again.bell;
        assert!(matches!(
            t.take(&peer, note(id + 1, true), None, true),
            Err(BellError::NotHeld(..))
        ));
        assert!(matches!(
            t.take(&peer, None, None, true),
            Err(BellError::Missing)
        ));
        // The same bell passed again is the same descriptor.
        let dup = again.try_clone().unwrap();
        let same = t.take(&peer, note(id, false), Some(dup), true).unwrap();
        assert!(Arc::ptr_eq(&same.bell, &again));

        let mut t = Bells::default();
        let (w, id) = bell();
        let b = t.take(&peer, note(id, false), Some(w), false).unwrap();
        assert!(!b.kept);
        assert_eq!(t.kept_of(std::process::id()), 0);
        assert!(t.take(&peer, note(id, true), None, false).is_ok());
        drop(b);
        assert!(
            t.take(&peer, note(id, true), None, false).is_err(),
            "gone with its last use"
        );
    }

    /// A message that names one bell and passes another is refused, and
    /// a process's new bell replaces its old one as the one kept.
    #[test]
    fn a_mislabelled_bell_is_refused_and_a_new_one_replaces_the_old() {
        let mut t = Bells::default();
        let peer = me();
        let (w1, id1) = bell();
        let (w2, id2) = bell();
        assert!(matches!(
            t.take(&peer, note(id2, false), Some(w1.try_clone().unwrap()), true),
            Err(BellError::Mislabelled { .. })
        ));
        t.take(&peer, note(id1, false), Some(w1), true).unwrap();
        t.take(&peer, note(id2, false), Some(w2), true).unwrap();
        assert_eq!(t.kept_count(None), 1);
        assert!(t.take(&peer, note(id2, true), None, true).is_ok());
        assert!(t.take(&peer, note(id1, true), None, true).is_err());
    }

    /// One user's processes cannot make us keep more than their share,
    /// and the bell of a process that exited goes.
    #[test]
    fn one_users_bells_are_kept_up_to_their_share_and_while_they_live() {
        let mut t = Bells::default();
        // Peers that are distinct processes to the table (each pins its
        // own pidfd), without forking one for each.
        let mut kept = 0;
        let mut held = Vec::new();
        for _ in 0..KEEP_MOST_OF_USER + 3 {
            let peer = PeerId::this_process().unwrap();
            let (w, id) = bell();
            let b = t.take(&peer, note(id, false), Some(w), true).unwrap();
            kept += usize::from(b.kept);
            held.push(b.bell);
        }
        assert_eq!(kept, KEEP_MOST_OF_USER);
        assert!(!t.room(nix::unistd::geteuid().as_raw()));
        // A process that exits.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let fd = crate::identity::pidfd_open(child.id()).unwrap();
        let gone = PeerId::resumed(
            child.id(),
            nix::unistd::geteuid().as_raw(),
            nix::unistd::getegid().as_raw(),
            fd,
        )
        .unwrap();
        child.wait().unwrap();
        let mut t = Bells::default();
        let (w, id) = bell();
        t.held.push(Held {
            peer: gone.clone(),
            id,
            bell: Weak::new(),
            kept: Some(Arc::new(w)),
            takes: false,
        });
        t.add_keeper(&gone);
        t.prune();
        assert_eq!(t.kept_count(None), 0, "its bell goes");
        assert!(t.keepers.is_empty(), "and its word");
    }

    /// An answer names our bell only if the offer said it keeps it or
    /// takes it itself, and a client believes a listener keeps its bell
    /// only when it said so.
    #[test]
    fn a_bell_is_named_only_to_a_process_that_said_it_keeps_or_takes_it() {
        let offered = BellNote {
            id: 7,
            held: false,
            keeps: 0,
            fd: 3,
            fetches: false,
        };
        let a = answer_note(9, 4, Some(offered), true, false);
        assert!(!a.held && a.keeps == 7 && a.fd == 4 && !a.fetches);
        let a = answer_note(
            9,
            4,
            Some(BellNote {
                keeps: 9,
                ..offered
            }),
            false,
            true,
        );
        assert!(a.held && a.keeps == 0 && a.fetches);
        let keeps_other = BellNote {
            keeps: 8,
            ..offered
        };
        assert!(!answer_note(9, 4, Some(keeps_other), true, true).held);
        let takes = BellNote {
            fetches: true,
            ..keeps_other
        };
        assert!(answer_note(9, 4, Some(takes), true, true).held);
        assert!(!answer_note(9, 4, None, true, true).held);
        let mut t = Bells::default();
        let peer = me();
        t.add_keeper(&peer);
        t.add_keeper(&peer);
        assert_eq!(t.keepers.len(), 1);
        t.drop_keeper(&peer);
        assert!(t.keepers.is_empty());
    }

    /// A bell named and not held is taken from its process, and only if
    /// the descriptor named is that bell; a passed bell tells whether we
    /// could have taken it.
    #[test]
    fn a_named_bell_not_held_is_taken_from_its_process_if_it_is_that_bell() {
        use std::os::fd::AsRawFd;
        let mut t = Bells::default();
        let peer = me();
        let (w, id) = bell();
        let (other, _) = bell();
        let named = |fd: &OwnedFd| {
            Some(BellNote {
                fd: fd.as_raw_fd() as u32,
                ..note(id, true).unwrap()
            })
        };
        let r = t.take(&peer, named(&other), None, true);
        assert!(
            matches!(r, Err(BellError::NotHeld(i, _)) if i == id),
            "{r:?}"
        );
        let got = t.take(&peer, named(&w), None, true).unwrap();
        assert!(got.kept && got.takes);
        assert_ne!(got.bell.as_raw_fd(), w.as_raw_fd(), "a copy of its own");
        assert_eq!(bell_id(got.bell.as_fd()).unwrap(), id);

        let mut t = Bells::default();
        let (w2, id2) = bell();
        let passed = BellNote {
            held: false,
            fd: w2.as_raw_fd() as u32,
            ..note(id2, false).unwrap()
        };
        let dup = w2.try_clone().unwrap();
        assert!(t.take(&peer, Some(passed), Some(dup), true).unwrap().takes);
        let mut t = Bells::default();
        let unfetchable = Some(BellNote {
            fd: i32::MAX as u32,
            ..passed
        });
        assert!(!t.take(&peer, unfetchable, Some(w2), true).unwrap().takes);
    }

    /// A client names its bell to a registry's family once an answer from
    /// it said it keeps the bell and takes bells itself, says it takes
    /// theirs once it could, and passes it again after a failed pair.
    #[test]
    fn a_family_that_takes_our_bell_is_named_to_until_a_pair_fails() {
        // A pid no process has: its own entry in the process's table.
        let to = i32::MAX as u32 - 7;
        let ours = 5;
        let peer = me();
        let first = offer_note(ours, 9, to);
        assert!(!first.held && !first.fetches && first.fd == 9);
        let answer = |fetches| {
            Some(BellNote {
                id: 11,
                held: false,
                keeps: ours,
                fd: 4,
                fetches,
            })
        };
        answer_came(&peer, to, first, answer(false));
        assert!(!offer_note(ours, 9, to).held, "kept by one, not the family");
        answer_came(&peer, to, first, answer(true));
        assert!(offer_note(ours, 9, to).held);
        we_take_from(to, true);
        assert!(offer_note(ours, 9, to).fetches);
        not_kept_by(to);
        let after = offer_note(ours, 9, to);
        assert!(!after.held && after.fetches);
        we_take_from(to, false);
        assert!(!offer_note(ours, 9, to).fetches);
    }
}
