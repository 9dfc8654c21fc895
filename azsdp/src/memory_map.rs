//! What kind of memory a buffer is, from `/proc/self/maps`: may its pages
//! be protected, and which other mappings show the same pages (aliases)?
//!
//! Only private anonymous memory is protected: heap, `mmap(MAP_PRIVATE |
//! MAP_ANONYMOUS)`, thread stacks. Not the main thread's stack (the kernel
//! grows it on faults; edge pages hold live frames), not file mappings (no
//! write protection for page-cache pages of regular files), and not shared
//! memory: another process (or a child after fork) can write the same
//! pages through its own mapping, which no protection of ours sees. Such
//! buffers are sent synchronously (ZSDP), which is always correct.
//!
//! Aliases (paper §4.3): mappings of the same object (`dev`, `inode`) whose
//! file ranges overlap show the same pages at different addresses. They are
//! tracked here so that a send from one alias settles with the others (the
//! lifetime hooks settle by object, not by address).
//!
//! Each buffer is checked against the kernel's current view with the
//! `PROCMAP_QUERY` ioctl on `/proc/self/maps` (Linux 6.11+, well under a
//! microsecond a mapping): a cache could not be trusted, since glibc's
//! `free()` unmaps large chunks through an internal `munmap` that no
//! interposed symbol sees. Older kernels fall back to parsing the whole map,
//! cached and marked stale by the memory hooks and by failed protections.
//!
//! `unsafe` here: the `PROCMAP_QUERY` ioctl.

use crate::sync::Lock;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// What a mapping is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Private anonymous: heap, anonymous mmap, thread stacks.
    Private,
    /// The main thread's stack.
    MainStack,
    /// A private or shared mapping of a regular file.
    File,
    /// Shared memory: `MAP_SHARED | MAP_ANONYMOUS`, memfd, POSIX or SysV shm.
    Shared,
    /// vdso, vvar and the like.
    Special,
}

/// One line of `/proc/self/maps`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Vma {
    pub range: Range<u64>,
    pub readable: bool,
    pub writable: bool,
    pub executable: bool,
    pub shared: bool,
    /// Offset of `range.start` in the mapped object.
    pub offset: u64,
    pub dev: String,
    pub inode: u64,
    pub path: String,
    pub kind: Kind,
}

impl Vma {
    /// Parse one line; `None` if it is not a mapping line.
    pub fn parse(line: &str) -> Option<Vma> {
        let mut f = line.splitn(6, char::is_whitespace);
        let (lo, hi) = f.next()?.split_once('-')?;
        let range = u64::from_str_radix(lo, 16).ok()?..u64::from_str_radix(hi, 16).ok()?;
        let perms = f.next()?.as_bytes();
        if perms.len() < 4 || range.start >= range.end {
            return None;
        }
        let offset = u64::from_str_radix(f.next()?, 16).ok()?;
        let dev = f.next()?.to_string();
        let inode: u64 = f.next()?.parse().ok()?;
        let path = f.next().unwrap_or("").trim().to_string();
        let shared = perms[3] == b's';
        let kind = kind_of(shared, inode, &path);
        Some(Vma {
            range,
            readable: perms[0] == b'r',
            writable: perms[1] == b'w',
            executable: perms[2] == b'x',
            shared,
            offset,
            dev,
            inode,
            path,
            kind,
        })
    }

    /// Where `addr` lies in the mapped object.
    fn object_offset(&self, addr: u64) -> u64 {
        self.offset + (addr - self.range.start)
    }
}

/// What a mapping with these attributes is.
fn kind_of(shared: bool, inode: u64, path: &str) -> Kind {
    if path == "[stack]" {
        Kind::MainStack
    } else if path.starts_with('[') && !path.starts_with("[anon:") && path != "[heap]" {
        Kind::Special
    } else if shared
        && (inode == 0
            || path.starts_with("/dev/zero")
            || path.starts_with("/memfd:")
            || path.starts_with("/dev/shm/")
            || path.starts_with("/SYSV"))
    {
        Kind::Shared
    } else if inode == 0 || path == "[heap]" || path.starts_with("[anon:") {
        Kind::Private
    } else {
        Kind::File
    }
}

/// `struct procmap_query` (include/uapi/linux/fs.h).
#[repr(C)]
#[derive(Default)]
pub(crate) struct ProcmapQuery {
    pub(crate) size: u64,
    pub(crate) query_flags: u64,
    pub(crate) query_addr: u64,
    pub(crate) vma_start: u64,
    pub(crate) vma_end: u64,
    pub(crate) vma_flags: u64,
    pub(crate) vma_page_size: u64,
    pub(crate) vma_offset: u64,
    pub(crate) inode: u64,
    pub(crate) dev_major: u32,
    pub(crate) dev_minor: u32,
    pub(crate) vma_name_size: u32,
    pub(crate) build_id_size: u32,
    pub(crate) vma_name_addr: u64,
    pub(crate) build_id_addr: u64,
}

/// `_IOWR('f', 17, struct procmap_query)`.
pub(crate) const PROCMAP_QUERY: libc::c_ulong = 0xc068_6611;
const VMA_READABLE: u64 = 0x01;
pub(crate) const VMA_WRITABLE: u64 = 0x02;
const VMA_EXECUTABLE: u64 = 0x04;
const VMA_SHARED: u64 = 0x08;

/// `/proc/self/maps`, opened by this process (a child reopens it: the
/// descriptor names the process that opened it).
static QUERY_FD: Lock<Option<(u32, std::fs::File)>> = Lock::new(None);

/// This process's `/proc/self/maps` descriptor for `PROCMAP_QUERY`. The
/// lock is held only to find it: a replaced one (in a forked child) stays
/// open, so a thread still using it never reaches a reused number.
fn query_fd() -> Result<i32, ()> {
    use std::os::fd::AsRawFd;
    let mut fd = QUERY_FD.lock();
    let pid = crate::process::pid();
    if fd.as_ref().is_none_or(|(p, _)| *p != pid) {
        let new = std::fs::File::open("/proc/self/maps").map_err(|_| ())?;
        if let Some((_, old)) = fd.replace((pid, new)) {
            std::mem::forget(old);
        }
    }
    Ok(fd.as_ref().expect("opened").1.as_raw_fd())
}

/// The mapping holding `addr`, asked of the kernel. `Err` if the kernel
/// cannot answer such questions; `Ok(None)` if nothing is mapped there.
fn query(addr: u64) -> Result<Option<Vma>, ()> {
    let raw = query_fd()?;
    let mut name = [0u8; 64];
    let mut q = ProcmapQuery {
        size: std::mem::size_of::<ProcmapQuery>() as u64,
        query_addr: addr,
        vma_name_addr: name.as_mut_ptr() as u64,
        vma_name_size: name.len() as u32,
        ..ProcmapQuery::default()
    };
    // SAFETY: the ioctl reads `q` and writes `q` and at most
    // `vma_name_size` bytes of `name`, both live on this stack.
    let rc = unsafe { crate::own_ioctl::ioctl(raw, PROCMAP_QUERY, (&raw mut q) as usize) };
    if rc != 0 {
        return match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::ENOENT) => Ok(None),
            // Names longer than the buffer: classify without it (a long
            // name is a file path, never one of the bracketed names).
            Some(libc::ENAMETOOLONG) => {
                let mut q2 = ProcmapQuery {
                    size: std::mem::size_of::<ProcmapQuery>() as u64,
                    query_addr: addr,
                    ..ProcmapQuery::default()
                };
                // SAFETY: as above, without a name buffer.
                let rc =
                    unsafe { crate::own_ioctl::ioctl(raw, PROCMAP_QUERY, (&raw mut q2) as usize) };
                if rc != 0 {
                    return Err(());
                }
                Ok(Some(vma_of(&q2, "/(long name)")))
            }
            _ => Err(()),
        };
    }
    let len = (q.vma_name_size as usize).saturating_sub(1).min(name.len());
    let path = String::from_utf8_lossy(&name[..len]).into_owned();
    Ok(Some(vma_of(&q, &path)))
}

fn vma_of(q: &ProcmapQuery, path: &str) -> Vma {
    let shared = q.vma_flags & VMA_SHARED != 0;
    Vma {
        range: q.vma_start..q.vma_end,
        readable: q.vma_flags & VMA_READABLE != 0,
        writable: q.vma_flags & VMA_WRITABLE != 0,
        executable: q.vma_flags & VMA_EXECUTABLE != 0,
        shared,
        offset: q.vma_offset,
        dev: format!("{:02x}:{:02x}", q.dev_major, q.dev_minor),
        inode: q.inode,
        path: path.to_string(),
        kind: kind_of(shared, q.inode, path),
    }
}

/// Why a buffer's pages may not be protected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotProtectable {
    Unmapped,
    MainStack,
    File,
    Shared,
    ReadOnly,
    Special,
}

/// The process's mappings, sorted by address.
#[derive(Clone, Debug, Default)]
pub struct MemoryMap {
    vmas: Vec<Vma>,
}

/// Shared anonymous objects (device, inode) this process created and no
/// other process maps: they are protected with all their aliases. Filled by
/// the `mmap` hook; emptied before `fork()` (the child maps them too).
static PROCESS_PRIVATE: Lock<Vec<(String, u64)>> = Lock::new(Vec::new());

/// `MAP_SHARED | MAP_ANONYMOUS` memory was just mapped at `addr` by this
/// process: its object is the process's own until it forks.
pub fn note_process_private(addr: u64) {
    if let Some(v) = mapping_of(addr)
        && v.kind == Kind::Shared
        && v.path.starts_with("/dev/zero")
    {
        let mut l = PROCESS_PRIVATE.lock();
        let key = (v.dev, v.inode);
        if !l.contains(&key) {
            l.push(key);
        }
    }
}

/// The locks of this module, held by the fork handler across `fork()`.
pub(crate) fn fork_guards() -> Vec<Box<dyn std::any::Any>> {
    vec![
        Box::new(QUERY_FD.lock()),
        Box::new(CACHE.lock()),
        Box::new(PROCESS_PRIVATE.lock()),
    ]
}

/// The process is about to fork: its shared objects are shared from now on.
pub fn forget_process_private() {
    PROCESS_PRIVATE.lock().clear();
}

fn process_private(v: &Vma) -> bool {
    PROCESS_PRIVATE
        .lock()
        .iter()
        .any(|(d, i)| *d == v.dev && *i == v.inode)
}

/// What kind of protectable memory a buffer is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protectable {
    /// Private anonymous memory.
    Private,
    /// Shared memory only this process maps: protect its aliases too.
    Aliased,
}

/// The verdict for one mapping.
fn judge(v: &Vma) -> Result<Protectable, NotProtectable> {
    match v.kind {
        Kind::Private | Kind::Shared if !v.writable => Err(NotProtectable::ReadOnly),
        Kind::Private => Ok(Protectable::Private),
        Kind::Shared if process_private(v) => Ok(Protectable::Aliased),
        Kind::MainStack => Err(NotProtectable::MainStack),
        Kind::File => Err(NotProtectable::File),
        Kind::Shared => Err(NotProtectable::Shared),
        Kind::Special => Err(NotProtectable::Special),
    }
}

/// Combine the verdicts of the mappings a buffer spans.
fn worst(a: Protectable, b: Protectable) -> Protectable {
    if a == Protectable::Aliased || b == Protectable::Aliased {
        Protectable::Aliased
    } else {
        Protectable::Private
    }
}

impl MemoryMap {
    pub fn parse(text: &str) -> MemoryMap {
        let mut vmas: Vec<Vma> = text.lines().filter_map(Vma::parse).collect();
        vmas.sort_by_key(|v| v.range.start);
        MemoryMap { vmas }
    }

    pub fn read() -> std::io::Result<MemoryMap> {
        Ok(Self::parse(&std::fs::read_to_string("/proc/self/maps")?))
    }

    /// The mappings covering `range`, if it is mapped without holes.
    pub fn covering(&self, range: &Range<u64>) -> Option<&[Vma]> {
        let first = self.vmas.partition_point(|v| v.range.end <= range.start);
        let mut at = range.start;
        let mut last = first;
        while at < range.end {
            let v = self.vmas.get(last)?;
            if v.range.start > at {
                return None;
            }
            at = v.range.end;
            last += 1;
        }
        Some(&self.vmas[first..last])
    }

    /// May the pages of `range` be write-protected or armed?
    pub fn check(&self, range: &Range<u64>) -> Result<Protectable, NotProtectable> {
        let vmas = self.covering(range).ok_or(NotProtectable::Unmapped)?;
        vmas.iter()
            .try_fold(Protectable::Private, |acc, v| Ok(worst(acc, judge(v)?)))
    }

    /// Other mappings of the pages of `range` (same object, overlapping
    /// object offsets): each alias's address range and the address in
    /// `range` it shows. Empty for private memory.
    pub fn aliases(&self, range: &Range<u64>) -> Vec<(Range<u64>, u64)> {
        let Some(vmas) = self.covering(range) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for v in vmas.iter().filter(|v| v.shared && v.inode != 0) {
            let lo = range.start.max(v.range.start);
            let hi = range.end.min(v.range.end);
            let (olo, ohi) = (v.object_offset(lo), v.object_offset(hi));
            for w in &self.vmas {
                if w.range == v.range || w.dev != v.dev || w.inode != v.inode || !w.shared {
                    continue;
                }
                let (wlo, whi) = (w.offset, w.offset + (w.range.end - w.range.start));
                let (a, b) = (olo.max(wlo), ohi.min(whi));
                if a < b {
                    let alias = w.range.start + (a - wlo)..w.range.start + (b - wlo);
                    out.push((alias, lo + (a - olo)));
                }
            }
        }
        out
    }
}

static CACHE: Lock<Option<Arc<MemoryMap>>> = Lock::new(None);
static STALE: AtomicBool = AtomicBool::new(true);
static GENERATION: AtomicU64 = AtomicU64::new(0);

/// The range one change touched, by generation (see [`changed`]).
struct Change {
    /// Its generation; 0 while being written.
    generation: AtomicU64,
    start: AtomicU64,
    end: AtomicU64,
}

/// The ranges the last [`CHANGES`] changes touched: slot `g % CHANGES`
/// holds generation `g`'s. No lock: the memory hooks write here from any
/// thread, and a signal handler's `munmap` may come in the middle of a
/// read on the same thread. A slot is written as a sequence lock: claimed
/// (generation 0), filled, then stamped; a reader that finds another stamp
/// before or after its loads learns nothing from the slot.
static CHANGED: [Change; CHANGES] = [const {
    Change {
        generation: AtomicU64::new(0),
        start: AtomicU64::new(0),
        end: AtomicU64::new(0),
    }
}; CHANGES];
const CHANGES: usize = 64;

/// The mappings changed (or may have), anywhere: reread before the next
/// answer.
pub fn invalidate() {
    changed(0..u64::MAX);
}

/// The mappings of `range` changed (unmapped, moved, replaced, protected
/// anew): answers about it no longer hold; answers about other ranges do
/// ([`untouched_since`]).
pub fn changed(range: Range<u64>) {
    // The kernel works in whole pages: a length that ends mid-page takes
    // the rest of that page.
    let page = crate::pages::system_page_size().max(1);
    let range = range.start..range.end.checked_next_multiple_of(page).unwrap_or(u64::MAX);
    STALE.store(true, Ordering::Release);
    let g = GENERATION.fetch_add(1, Ordering::AcqRel) + 1;
    let slot = &CHANGED[(g % CHANGES as u64) as usize];
    // A writer of a newer turn of the ring, or one writing now, keeps the
    // slot: readers of `g` then find no stamp of theirs, and hold nothing.
    let old = slot.generation.load(Ordering::Acquire);
    if (old == 0 && g > CHANGES as u64) || old >= g {
        return;
    }
    if slot
        .generation
        .compare_exchange(old, 0, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        return;
    }
    slot.start.store(range.start, Ordering::Relaxed);
    slot.end.store(range.end, Ordering::Relaxed);
    slot.generation.store(g, Ordering::Release);
}

/// A mapping was made where none was (`mmap` without `MAP_FIXED`): every
/// accessible range stays so, but the parsed map is out of date.
pub fn added() {
    STALE.store(true, Ordering::Release);
}

/// Bumped by every change: an answer of [`accessible`] holds while this
/// stays the same (as far as the interposed memory calls can tell), or
/// while no change since touched its range ([`untouched_since`]).
pub fn generation() -> u64 {
    GENERATION.load(Ordering::Acquire)
}

/// Did no change since generation `seen` touch `range`? (A server that maps
/// and unmaps a file per request would otherwise ask the kernel about its
/// stack on every call.) False when too many came to tell.
pub fn untouched_since(range: &Range<u64>, seen: u64) -> bool {
    let now = generation();
    if now == seen {
        return true;
    }
    if now < seen || now - seen > CHANGES as u64 {
        return false;
    }
    (seen + 1..=now).all(|g| {
        let slot = &CHANGED[(g % CHANGES as u64) as usize];
        if slot.generation.load(Ordering::Acquire) != g {
            return false;
        }
        let (start, end) = (
            slot.start.load(Ordering::Relaxed),
            slot.end.load(Ordering::Relaxed),
        );
        std::sync::atomic::fence(Ordering::Acquire);
        slot.generation.load(Ordering::Relaxed) == g && (end <= range.start || range.end <= start)
    })
}

/// May the program read (and, with `write`, write) all of `range`, as the
/// kernel sees its mappings now? `None` if not: a system call would fail
/// with EFAULT there. `Some`: the run of adjoining mappings that holds it,
/// all as accessible (a buffer may span two: a binary's `.data` and
/// `.bss`). Asks the kernel (`PROCMAP_QUERY`, about 0.3 us a mapping);
/// without it, the parsed map (reread once if it does not know the range).
pub fn accessible(range: &Range<u64>, write: bool) -> Option<Range<u64>> {
    let ok = |v: &Vma| v.readable && (v.writable || !write);
    let mut at = range.start;
    let mut run: Option<Range<u64>> = None;
    while at < range.end {
        let v = match lean_query(at) {
            Ok(v) => v?,
            Err(()) => return accessible_cached(range, write),
        };
        if !ok(&v) || v.range.start > at {
            return None;
        }
        at = v.range.end;
        run = Some(run.map_or(v.range.clone(), |r| r.start..v.range.end));
    }
    run
}

/// [`query`] without the name (flags and bounds only).
fn lean_query(addr: u64) -> Result<Option<Vma>, ()> {
    let raw = query_fd()?;
    let mut q = ProcmapQuery {
        size: std::mem::size_of::<ProcmapQuery>() as u64,
        query_addr: addr,
        ..ProcmapQuery::default()
    };
    // SAFETY: the ioctl reads and writes `q`, on this stack; no name.
    let rc = unsafe { crate::own_ioctl::ioctl(raw, PROCMAP_QUERY, (&raw mut q) as usize) };
    if rc != 0 {
        return match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::ENOENT) => Ok(None),
            _ => Err(()),
        };
    }
    Ok(Some(Vma {
        range: q.vma_start..q.vma_end,
        readable: q.vma_flags & VMA_READABLE != 0,
        writable: q.vma_flags & VMA_WRITABLE != 0,
        executable: q.vma_flags & VMA_EXECUTABLE != 0,
        shared: false,
        offset: 0,
        dev: String::new(),
        inode: 0,
        path: String::new(),
        kind: Kind::Special,
    }))
}

fn accessible_cached(range: &Range<u64>, write: bool) -> Option<Range<u64>> {
    let answer = |m: &MemoryMap| -> Option<Range<u64>> {
        let vs = m.covering(range)?;
        if !vs.iter().all(|v| v.readable && (v.writable || !write)) {
            return None;
        }
        Some(vs.first()?.range.start..vs.last()?.range.end)
    };
    answer(&current()).or_else(|| {
        invalidate();
        answer(&current())
    })
}

/// The cached map, reread if stale.
pub fn current() -> Arc<MemoryMap> {
    let mut c = CACHE.lock();
    if STALE.swap(false, Ordering::AcqRel) || c.is_none() {
        *c = Some(Arc::new(MemoryMap::read().unwrap_or_default()));
    }
    Arc::clone(c.as_ref().expect("just filled"))
}

/// May the pages of `range` be protected, as the kernel sees them now?
pub fn check(range: &Range<u64>) -> Result<Protectable, NotProtectable> {
    let mut at = range.start;
    let mut verdict = Protectable::Private;
    while at < range.end {
        match query(at) {
            Ok(Some(v)) => {
                verdict = worst(verdict, judge(&v)?);
                at = v.range.end;
            }
            Ok(None) => return Err(NotProtectable::Unmapped),
            Err(()) => return check_cached(range),
        }
    }
    Ok(verdict)
}

/// The mapping holding `addr`, as the kernel sees it now (or as the
/// parsed map last did, on kernels without `PROCMAP_QUERY`).
pub fn mapping_of(addr: u64) -> Option<Vma> {
    match query(addr) {
        Ok(v) => v,
        Err(()) => {
            let m = current();
            m.covering(&(addr..addr + 1))
                .and_then(|v| v.first().cloned())
        }
    }
}

/// [`check`] from the parsed map (kernels without `PROCMAP_QUERY`);
/// rereads it once if it does not know the range.
fn check_cached(range: &Range<u64>) -> Result<Protectable, NotProtectable> {
    match current().check(range) {
        Err(NotProtectable::Unmapped) => {
            invalidate();
            current().check(range)
        }
        r => r,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
55c3574d6000-55c3574d8000 r--p 00000000 fe:00 247282 /usr/bin/head
55c378ff7000-55c379018000 rw-p 00000000 00:00 0 [heap]
7f0000000000-7f0000100000 rw-p 00000000 00:00 0
7f0000100000-7f0000200000 rw-p 00000000 00:00 0
7f0000300000-7f0000302000 rw-s 00000000 00:01 1429 /memfd:x (deleted)
7f0000400000-7f0000401000 rw-s 00001000 00:01 1429 /memfd:x (deleted)
7f0000500000-7f0000502000 rw-s 00000000 00:01 1430 /dev/zero (deleted)
7f0000600000-7f0000602000 rw-p 00000000 fe:00 99 /tmp/file
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0 [stack]
7ffd00100000-7ffd00102000 r-xp 00000000 00:00 0 [vdso]
";

    /// The two tests of change tracking, one at a time (the first changes
    /// the map from other threads as fast as it can).
    static CHANGING: Lock<()> = Lock::new(());

    #[test]
    fn a_change_is_never_missed_while_other_threads_change_the_map() {
        let _one = CHANGING.lock();
        let page = crate::pages::system_page_size();
        let a = 0x7200_0000_0000..0x7200_0000_0000 + page;
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let others: Vec<_> = (0..2)
            .map(|k| {
                let stop = std::sync::Arc::clone(&stop);
                std::thread::spawn(move || {
                    let b = 0x7300_0000_0000 + k * page;
                    while !stop.load(Ordering::Relaxed) {
                        changed(b..b + page);
                    }
                })
            })
            .collect();
        for _ in 0..20_000 {
            let seen = generation();
            changed(a.clone());
            assert!(!untouched_since(&a, seen));
        }
        stop.store(true, Ordering::Relaxed);
        others.into_iter().for_each(|t| t.join().unwrap());
    }

    #[test]
    fn an_answer_holds_until_a_change_touches_its_range() {
        let _one = CHANGING.lock();
        let page = crate::pages::system_page_size();
        let (a, b) = (
            0x7000_0000_0000..0x7000_0000_0000 + 4 * page,
            0x7100_0000_0000u64,
        );
        // (Other tests change the map meanwhile: one quiet round suffices.)
        let held = (0..1000).any(|_| {
            let seen = generation();
            // Another range changed (a length that ends mid-page takes the
            // page); then a new mapping, which changes nothing checked.
            changed(b..b + 1);
            added();
            untouched_since(&a, seen)
                && !untouched_since(&(b + page - 1..b + page), seen)
                && untouched_since(&(b + page..b + 2 * page), seen)
                && generation() == seen + 1
        });
        assert!(held);
        let seen = generation();
        // This range changed.
        changed(a.start + page..a.start + 2 * page);
        assert!(!untouched_since(&a, seen));
        // More changes than are kept: no answer holds.
        let seen = generation();
        for _ in 0..=CHANGES {
            changed(b..b + 1);
        }
        assert!(!untouched_since(&a, seen));
    }

    #[test]
    fn kinds_and_protectability() {
        let m = MemoryMap::parse(MAPS);
        assert_eq!(
            m.check(&(0x55c378ff8000..0x55c378ffa000)),
            Ok(Protectable::Private)
        );
        // Across two adjacent private mappings.
        assert_eq!(
            m.check(&(0x7f00000ff000..0x7f0000101000)),
            Ok(Protectable::Private)
        );
        assert_eq!(
            m.check(&(0x7ffd00001000..0x7ffd00002000)),
            Err(NotProtectable::MainStack)
        );
        assert_eq!(
            m.check(&(0x7f0000600000..0x7f0000601000)),
            Err(NotProtectable::File)
        );
        assert_eq!(
            m.check(&(0x7f0000300000..0x7f0000301000)),
            Err(NotProtectable::Shared)
        );
        assert_eq!(
            m.check(&(0x7f0000500000..0x7f0000501000)),
            Err(NotProtectable::Shared)
        );
        assert_eq!(
            m.check(&(0x7f0000200000..0x7f0000201000)),
            Err(NotProtectable::Unmapped)
        );
        assert_eq!(
            m.check(&(0x55c3574d6000..0x55c3574d7000)),
            Err(NotProtectable::File)
        );
    }

    #[test]
    fn aliases_are_mappings_of_the_same_pages() {
        let m = MemoryMap::parse(MAPS);
        // Page 1 of the memfd is also mapped at 0x7f0000400000.
        assert_eq!(
            m.aliases(&(0x7f0000300000..0x7f0000302000)),
            vec![(0x7f0000400000..0x7f0000401000, 0x7f0000301000)]
        );
        assert_eq!(
            m.aliases(&(0x7f0000400000..0x7f0000401000)),
            vec![(0x7f0000301000..0x7f0000302000, 0x7f0000400000)]
        );
        // Page 0 has no alias; private memory never has.
        assert!(m.aliases(&(0x7f0000300000..0x7f0000301000)).is_empty());
        assert!(m.aliases(&(0x7f0000000000..0x7f0000001000)).is_empty());
    }

    #[test]
    fn the_kernel_and_the_parsed_map_agree() {
        let map = MemoryMap::read().unwrap();
        let mut asked = 0;
        for v in map
            .vmas
            .iter()
            .filter(|v| v.range.start < 0xffff_0000_0000_0000)
        {
            // Other tests map and unmap meanwhile: compare what did not change.
            if let Ok(Some(k)) = query(v.range.start)
                && k.range == v.range
            {
                assert_eq!(
                    (k.kind, k.shared, k.inode),
                    (v.kind, v.shared, v.inode),
                    "{v:?}"
                );
                asked += 1;
            }
        }
        assert!(asked > 5, "{asked} mappings compared");
    }

    #[test]
    fn the_live_map_knows_heap_stack_and_shared_memory() {
        let heap = vec![0u8; 1 << 20];
        let p = heap.as_ptr() as u64;
        let inner = p.next_multiple_of(4096)..(p + (1 << 20)) & !4095;
        assert_eq!(check(&inner), Ok(Protectable::Private));
        let main_stack = current()
            .vmas
            .iter()
            .find(|v| v.kind == Kind::MainStack)
            .map(|v| v.range.clone());
        if let Some(s) = main_stack {
            assert_eq!(
                check(&(s.end - 4096..s.end)),
                Err(NotProtectable::MainStack)
            );
        }
        // SAFETY: a fresh shared anonymous mapping, unmapped below.
        let sh = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                8192,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(sh, libc::MAP_FAILED);
        let r = sh as u64..sh as u64 + 8192;
        assert_eq!(
            check(&r),
            Err(NotProtectable::Shared),
            "a new mapping is found"
        );
        // SAFETY: unmapping what we mapped.
        unsafe { libc::munmap(sh, 8192) };
        invalidate();
        drop(heap);
    }
}
