//! Arbitrary text as a configuration file: an error or a config, never a panic.
#![no_main]

use azsdp::config::Config;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = Config::parse(text, "fuzz.toml");
    }
});
