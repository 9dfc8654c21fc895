//! Progress of `azsdp bench` and `azsdp tune`: which run, how many of how
//! many, and about how long is left. On a terminal, one line redrawn in
//! place; otherwise (a log, CI) a plain line per run.

use std::io::{IsTerminal as _, Write as _};
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct Progress {
    /// Counting the runs a schedule would make, without making them.
    counting: bool,
    total: usize,
    done: usize,
    start: Instant,
    tty: bool,
    /// "azsdp bench", "azsdp tune".
    who: &'static str,
}

/// `1m05s`, `42s`.
fn short(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 60 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{s}s")
    }
}

impl Progress {
    /// A dry pass: [`Progress::step`] counts and says no.
    pub fn counting(who: &'static str) -> Progress {
        Progress {
            counting: true,
            total: 0,
            done: 0,
            start: Instant::now(),
            tty: false,
            who,
        }
    }

    /// The real pass, of `total` runs (what a counting pass found).
    pub fn start(who: &'static str, total: usize) -> Progress {
        Progress {
            counting: false,
            total,
            done: 0,
            start: Instant::now(),
            tty: std::io::stderr().is_terminal(),
            who,
        }
    }

    pub fn is_counting(&self) -> bool {
        self.counting
    }

    /// How many runs were counted (or made).
    pub fn runs(&self) -> usize {
        if self.counting { self.total } else { self.done }
    }

    /// Before a run described by `label`: say so; false in a counting pass
    /// (the run is not to be made).
    pub fn step(&mut self, label: &str) -> bool {
        if self.counting {
            self.total += 1;
            return false;
        }
        self.done += 1;
        let n = self.done.min(self.total.max(1));
        let elapsed = self.start.elapsed();
        let left = if self.done > 1 {
            let per = elapsed / (self.done - 1) as u32;
            format!(", about {} left", short(per * (self.total - n + 1) as u32))
        } else {
            String::new()
        };
        let line = format!(
            "{}: [{n:>w$}/{}] {label} ({} in{left})",
            self.who,
            self.total,
            short(elapsed),
            w = self.total.to_string().len()
        );
        let mut err = std::io::stderr().lock();
        let _ = if self.tty {
            write!(err, "\r\x1b[K{line}")
        } else {
            writeln!(err, "{line}")
        };
        let _ = err.flush();
        true
    }

    /// A line of its own, not lost in the redrawn one.
    pub fn say(&self, msg: &str) {
        if self.counting {
            return;
        }
        if self.tty {
            eprintln!("\r\x1b[K{}: {msg}", self.who);
        } else {
            eprintln!("{}: {msg}", self.who);
        }
    }

    /// End the redrawn line.
    pub fn finish(&self) {
        if self.tty && !self.counting {
            eprintln!();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_counting_pass_makes_no_run_and_the_real_one_counts_to_it() {
        let mut p = Progress::counting("t");
        assert!(!p.step("a") && !p.step("b"));
        assert_eq!(p.runs(), 2);
        let mut r = Progress::start("t", p.runs());
        assert!(r.step("a") && r.step("b"));
        assert_eq!(r.runs(), 2);
        assert_eq!(short(Duration::from_secs(65)), "1m05s");
    }
}
