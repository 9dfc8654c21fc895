//! The copy-on-write lock word: one 64-bit word per sink slot, in the sink's memory.
//!
//! `word = generation << 2 | state`. The generation counts the uses of the
//! slot, so a compare-and-swap aimed at an old advertisement can never hit a
//! new one. Transitions (source = sender of SRC_AVAIL, sink = receiver):
//!
//! ```text
//!  OPEN(g) --sink takes before GET------> TAKEN(g) --sink, GETs done--> OPEN(g) or OPEN(g+1) when finished
//!  OPEN(g) --source wins on write fault--> COPIED(g) --sink, finished--> OPEN(g+1)
//! ```

pub const OPEN: u64 = 0;
pub const TAKEN: u64 = 1;
pub const COPIED: u64 = 2;

pub fn word(gen_: u32, state: u64) -> u64 {
    (u64::from(gen_) << 2) | state
}

pub fn open(gen_: u32) -> u64 {
    word(gen_, OPEN)
}

pub fn taken(gen_: u32) -> u64 {
    word(gen_, TAKEN)
}

pub fn copied(gen_: u32) -> u64 {
    word(gen_, COPIED)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generations_never_collide() {
        for g in [0u32, 1, 2, u32::MAX] {
            assert_ne!(open(g), taken(g));
            assert_ne!(open(g), copied(g));
            assert_ne!(open(g), open(g.wrapping_add(1)));
        }
    }
}
