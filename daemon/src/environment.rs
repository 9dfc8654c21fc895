//! What a program under `azsdp run` will read, checked before it starts:
//! the configuration and every `AZSDP_*` variable, each problem once.

use std::path::Path;

use azsdp::config::Config;
use azsdp::config::logging::{LogTarget, log_level, log_target};

/// Every problem, one line each (empty: all is well).
pub fn check(config: Option<&Path>) -> Vec<String> {
    let mut problems: Vec<String> = match Config::from_environment(config, std::env::vars_os()) {
        Ok(_) => Vec::new(),
        Err(e) => e.problems.iter().map(ToString::to_string).collect(),
    };
    let var = |name: &str| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned());
    if let Err(e) = log_level(var("AZSDP_LOG_LEVEL").as_deref()) {
        problems.push(e);
    }
    if let LogTarget::File(path) = log_target(var("AZSDP_LOG").as_deref()) {
        // As the shim opens it: appended to, made if missing.
        if let Err(e) = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(&path)
        {
            problems.push(format!("AZSDP_LOG={}: cannot open it: {e}", path.display()));
        }
    }
    if let Some(dir) = std::env::var_os("AZSDP_STAT_DIR")
        && let Err(e) = azsdp::stats::open_dir(Path::new(&dir))
    {
        problems.push(format!("AZSDP_STAT_DIR: {e}"));
    }
    problems
}
