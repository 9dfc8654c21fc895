//! The log's two variables, parsed once for the shim (which uses them)
//! and for `azsdp run` (which checks them before the program starts).

use std::path::PathBuf;

/// `AZSDP_LOG_LEVEL`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u8)]
pub enum LogLevel {
    Error = 1,
    Warn = 2,
    Info = 3,
    Debug = 4,
}

/// `AZSDP_LOG_LEVEL`'s value (unset or empty: warn).
pub fn log_level(value: Option<&str>) -> Result<LogLevel, String> {
    match value.map(str::trim) {
        None | Some("") => Ok(LogLevel::Warn),
        Some(v) => match v.to_ascii_lowercase().as_str() {
            "error" => Ok(LogLevel::Error),
            "warn" | "warning" => Ok(LogLevel::Warn),
            "info" => Ok(LogLevel::Info),
            "debug" => Ok(LogLevel::Debug),
            _ => Err(format!(
                "AZSDP_LOG_LEVEL={v}: not a level (error, warn, info, debug)"
            )),
        },
    }
}

/// Where `AZSDP_LOG` sends the log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LogTarget {
    Stderr,
    Off,
    /// Appended to (made if missing).
    File(PathBuf),
}

/// `AZSDP_LOG`'s value (unset or empty: stderr).
pub fn log_target(value: Option<&str>) -> LogTarget {
    match value {
        None | Some("") | Some("stderr") => LogTarget::Stderr,
        Some("off") | Some("none") => LogTarget::Off,
        Some(path) => LogTarget::File(PathBuf::from(path)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_and_targets_parse_and_typos_are_named() {
        assert_eq!(log_level(None), Ok(LogLevel::Warn));
        assert_eq!(log_level(Some("INFO")), Ok(LogLevel::Info));
        let e = log_level(Some("verbose")).unwrap_err();
        assert!(e.contains("verbose") && e.contains("debug"), "{e}");
        assert_eq!(log_target(Some("off")), LogTarget::Off);
        assert_eq!(
            log_target(Some("/tmp/x.log")),
            LogTarget::File("/tmp/x.log".into())
        );
    }
}
