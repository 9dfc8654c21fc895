//! Simulated process memory: sparse pages with the protection states the
//! real system uses, so the simulator sees every fault the kernel would raise
//! and every access the engine must never make.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ops::Range;
use std::rc::Rc;

use crate::conn::UserMemory;

/// Protection state of a simulated page.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Prot {
    #[default]
    None,
    /// Write-protected for an in-flight send: writes fault, reads do not.
    WriteProtected,
    /// Armed for an early-returning receive: every access faults.
    Armed,
}

/// An access the engine made that the real system would have faulted on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    pub what: String,
}

/// Both sides' memories, shared by the world, the fabric and the hosts.
pub type SharedMems = Rc<RefCell<[SimMemory; 2]>>;

/// One simulated address space.
#[derive(Debug)]
pub struct SimMemory {
    page: u64,
    pages: HashMap<u64, (Box<[u8]>, Prot)>,
    /// Pages a registration pins (whole pages, one entry per registration,
    /// kept ones too), which must never move.
    pins: Vec<Range<u64>>,
    /// Engine accesses to protected pages (engine bugs).
    pub violations: Vec<Violation>,
}

impl SimMemory {
    pub fn new(page: u64) -> Self {
        assert!(page.is_power_of_two());
        SimMemory {
            page,
            pages: HashMap::new(),
            pins: Vec::new(),
            violations: Vec::new(),
        }
    }

    fn pages_of(&self, r: &Range<u64>) -> Range<u64> {
        r.start - r.start % self.page..r.end.next_multiple_of(self.page)
    }

    /// A registration pins the pages of `r`.
    pub fn pin(&mut self, r: &Range<u64>) {
        let pages = self.pages_of(r);
        self.pins.push(pages);
    }

    /// A registration of `r` ends.
    pub fn unpin(&mut self, r: &Range<u64>) {
        let pages = self.pages_of(r);
        if let Some(i) = self.pins.iter().position(|p| *p == pages) {
            self.pins.swap_remove(i);
        }
    }

    /// Does a registration pin a page of `r`?
    pub fn pinned(&self, r: &Range<u64>) -> bool {
        let pages = self.pages_of(r);
        self.pins
            .iter()
            .any(|p| p.start < pages.end && pages.start < p.end)
    }

    pub fn page_size(&self) -> u64 {
        self.page
    }

    fn page_mut(&mut self, pno: u64) -> &mut (Box<[u8]>, Prot) {
        let size = self.page as usize;
        self.pages
            .entry(pno)
            .or_insert_with(|| (vec![0u8; size].into_boxed_slice(), Prot::None))
    }

    pub fn prot(&self, addr: u64) -> Prot {
        self.pages
            .get(&(addr / self.page))
            .map_or(Prot::None, |p| p.1)
    }

    /// Set the protection of whole pages. Returns the pages whose state was
    /// not `from` (the caller decides whether that is a bug).
    pub fn set_prot(&mut self, r: Range<u64>, from: Prot, to: Prot) -> Vec<u64> {
        let mut wrong = Vec::new();
        let page = self.page;
        let mut a = r.start;
        while a < r.end {
            let pno = a / page;
            let p = self.page_mut(pno);
            if p.1 != from {
                wrong.push(pno * page);
            }
            p.1 = to;
            a = (pno + 1) * page;
        }
        wrong
    }

    /// First page in `[addr, addr+len)` that an application access of kind
    /// `write` would fault on.
    pub fn first_fault(&self, addr: u64, len: u64, write: bool) -> Option<u64> {
        let mut a = addr;
        let end = addr + len;
        while a < end {
            let pno = a / self.page;
            match self.prot(a) {
                Prot::Armed => return Some(a),
                Prot::WriteProtected if write => return Some(a),
                _ => {}
            }
            a = (pno + 1) * self.page;
        }
        None
    }

    /// Pages in a protection state other than `None`.
    pub fn protected_pages(&self) -> Vec<(u64, Prot)> {
        let mut v: Vec<(u64, Prot)> = self
            .pages
            .iter()
            .filter(|(_, p)| p.1 != Prot::None)
            .map(|(pno, p)| (pno * self.page, p.1))
            .collect();
        v.sort_unstable_by_key(|x| x.0);
        v
    }

    /// Raw read, ignoring protection (the fabric's DMA, or checks).
    pub fn read_raw(&mut self, addr: u64, out: &mut [u8]) {
        let mut done = 0usize;
        while done < out.len() {
            let a = addr + done as u64;
            let (pno, off) = (a / self.page, (a % self.page) as usize);
            let k = (self.page as usize - off).min(out.len() - done);
            match self.pages.get(&pno) {
                Some(p) => out[done..done + k].copy_from_slice(&p.0[off..off + k]),
                None => out[done..done + k].fill(0),
            }
            done += k;
        }
    }

    /// Raw write, ignoring protection (the fabric's DMA, or the application
    /// after its fault was resolved).
    pub fn write_raw(&mut self, addr: u64, data: &[u8]) {
        let mut done = 0usize;
        while done < data.len() {
            let a = addr + done as u64;
            let (pno, off) = (a / self.page, (a % self.page) as usize);
            let k = (self.page as usize - off).min(data.len() - done);
            self.page_mut(pno).0[off..off + k].copy_from_slice(&data[done..done + k]);
            done += k;
        }
    }

    /// Drop pages wholly inside `r` (munmap / free of a private copy).
    pub fn discard(&mut self, r: Range<u64>) {
        let first = r.start.div_ceil(self.page);
        let last = r.end / self.page;
        for pno in first..last {
            self.pages.remove(&pno);
        }
    }

    fn check(&mut self, addr: u64, len: u64, write: bool, who: &str) {
        if let Some(p) = self.first_fault(addr, len, write) {
            self.violations.push(Violation {
                what: format!(
                    "engine {who} of [{addr:#x}, +{len}) touches {:?} page {p:#x}",
                    self.prot(p)
                ),
            });
        }
    }
}

impl UserMemory for SimMemory {
    fn read(&mut self, addr: u64, out: &mut [u8]) {
        self.check(addr, out.len() as u64, false, "read");
        self.read_raw(addr, out);
    }

    fn write(&mut self, addr: u64, data: &[u8]) {
        self.check(addr, data.len() as u64, true, "write");
        self.write_raw(addr, data);
    }
}

/// A flat byte array as application memory, for unit tests.
#[derive(Debug)]
pub struct FlatMemory {
    bytes: Vec<u8>,
}

impl FlatMemory {
    pub fn new(len: usize) -> Self {
        FlatMemory {
            bytes: vec![0; len],
        }
    }
    pub fn fill(&mut self, addr: u64, data: &[u8]) {
        self.bytes[addr as usize..addr as usize + data.len()].copy_from_slice(data);
    }
    pub fn get(&self, addr: u64, len: usize) -> &[u8] {
        &self.bytes[addr as usize..addr as usize + len]
    }
}

impl UserMemory for FlatMemory {
    fn read(&mut self, addr: u64, out: &mut [u8]) {
        out.copy_from_slice(&self.bytes[addr as usize..addr as usize + out.len()]);
    }
    fn write(&mut self, addr: u64, data: &[u8]) {
        self.bytes[addr as usize..addr as usize + data.len()].copy_from_slice(data);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protection_and_faults() {
        let mut m = SimMemory::new(4096);
        m.write_raw(4000, &[7u8; 200]);
        let mut b = [0u8; 200];
        m.read_raw(4000, &mut b);
        assert_eq!(b, [7u8; 200]);
        assert!(
            m.set_prot(4096..8192, Prot::None, Prot::WriteProtected)
                .is_empty()
        );
        assert_eq!(m.first_fault(4000, 200, true), Some(4096));
        assert_eq!(m.first_fault(4000, 200, false), None);
        m.write(4100, &[1]);
        assert_eq!(m.violations.len(), 1);
        assert_eq!(m.set_prot(4096..8192, Prot::None, Prot::None), vec![4096]);
    }
}
