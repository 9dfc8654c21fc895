//! What is wrong with a configuration, as a compiler reports it: every
//! problem at once, in file order, each with file:line:column, the key,
//! and a "did you mean" where a known name is close.

use std::fmt;

/// One problem, and where it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// File path, or `env AZSDP_X` for an environment variable.
    pub origin: String,
    pub line: Option<usize>,
    pub column: Option<usize>,
    /// The key (`rule[2].port` inside a rule).
    pub key: Option<String>,
    pub message: String,
    /// What to do instead (`did you mean ...`, the names that exist).
    pub help: Option<String>,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.origin)?;
        if let Some(l) = self.line {
            write!(f, ":{l}")?;
            if let Some(c) = self.column {
                write!(f, ":{c}")?;
            }
        }
        if let Some(k) = &self.key {
            write!(f, ": key `{k}`")?;
        }
        write!(f, ": {}", self.message)?;
        if let Some(h) = &self.help {
            write!(f, " ({h})")?;
        }
        Ok(())
    }
}

/// Everything wrong with a configuration (never empty), in file order:
/// the file's problems by position, then the environment's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    pub problems: Vec<Problem>,
}

impl ConfigError {
    pub fn one(p: Problem) -> ConfigError {
        ConfigError { problems: vec![p] }
    }

    /// The first problem (file order).
    pub fn first(&self) -> &Problem {
        &self.problems[0]
    }
}

impl fmt::Display for ConfigError {
    /// One problem per line.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.problems.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{p}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigError {}

/// Line and column (1-based, in characters) of byte offset `pos`.
pub fn position(text: &str, pos: usize) -> (usize, usize) {
    let before = &text.as_bytes()[..pos.min(text.len())];
    let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
    let start = before
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(0, |i| i + 1);
    let column = String::from_utf8_lossy(&before[start..]).chars().count() + 1;
    (line, column)
}

/// The known name closest to `word`, if one is close enough to be what was
/// meant: the same but for case and `_`/`-`, or a few edits away.
pub fn did_you_mean<'a>(word: &str, known: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let norm = |s: &str| -> String {
        s.chars()
            .filter(|c| *c != '_' && *c != '-')
            .flat_map(char::to_lowercase)
            .collect()
    };
    let w = norm(word);
    let mut best: Option<(usize, &str)> = None;
    for k in known {
        let d = edit_distance(&w, &norm(k));
        if best.is_none_or(|(bd, _)| d < bd) {
            best = Some((d, k));
        }
    }
    let (d, k) = best?;
    // Up to one edit in four characters, at least one, at most three.
    (d <= (w.chars().count() / 4).clamp(1, 3)).then_some(k)
}

/// Optimal string alignment distance (insertions, deletions, substitutions
/// and transpositions of neighbours).
fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            d[i][j] = (d[i - 1][j] + 1)
                .min(d[i][j - 1] + 1)
                .min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                d[i][j] = d[i][j].min(d[i - 2][j - 2] + 1);
            }
        }
    }
    d[a.len()][b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn near_misses_find_their_name_and_strangers_find_none() {
        let keys = ["zcopy_threshold", "write_fault", "keepalive", "poll"];
        assert_eq!(
            did_you_mean("zcopy_treshold", keys),
            Some("zcopy_threshold")
        );
        assert_eq!(did_you_mean("writefault", keys), Some("write_fault"));
        assert_eq!(did_you_mean("WRITE-FAULT", keys), Some("write_fault"));
        assert_eq!(did_you_mean("keepalvie", keys), Some("keepalive"));
        assert_eq!(did_you_mean("pol", keys), Some("poll"));
        assert_eq!(did_you_mean("colour", keys), None);
        assert_eq!(did_you_mean("threshold", keys), None);
        let vars = ["AZSDP_LOG", "AZSDP_LOG_LEVEL", "AZSDP_STAT_DIR"];
        assert_eq!(
            did_you_mean("AZSDP_LOGLEVEL", vars),
            Some("AZSDP_LOG_LEVEL")
        );
        assert_eq!(did_you_mean("AZSDP_STATDIR", vars), Some("AZSDP_STAT_DIR"));
    }

    #[test]
    fn positions_count_lines_and_characters() {
        let t = "a = 1\nµs = \"x\"\n";
        assert_eq!(position(t, 0), (1, 1));
        assert_eq!(position(t, 6), (2, 1));
        let at = t.find('=').unwrap();
        assert_eq!(position(t, at), (1, 3));
        let second = t.rfind('=').unwrap();
        assert_eq!(position(t, second), (2, 4));
    }
}
