//! The `azsdp` command as users run it.

use std::process::Command;

fn azsdp() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_azsdp"));
    c.env_remove("AZSDP_CONFIG");
    c
}

fn example() -> String {
    format!("{}/../docs/azsdp.example.toml", env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn config_check_accepts_the_example() {
    let out = azsdp()
        .args(["config", "check", &example()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("ok, 3 rule(s)"), "{stdout}");
}

#[test]
fn config_check_rejects_bad_files_with_line_and_key() {
    let dir = std::env::temp_dir().join(format!("azsdp-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "async = true\n\n[[rule]]\nrole = \"spectator\"\n").unwrap();
    let out = azsdp()
        .args(["config", "check", bad.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("bad.toml:4: key `rule[1].role`"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn config_show_reports_the_deciding_rule_and_env_overrides() {
    let out = azsdp()
        .args(["config", "show", "--config", &example()])
        .args(["--program", "/usr/bin/redis-server", "--role", "server"])
        .args(["--addr", "10.1.1.1", "--port", "6379"])
        .env("AZSDP_ASYNC", "false")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("rule 1 matches"), "{stdout}");
    assert!(stdout.contains("zcopy_threshold  = 16384"), "{stdout}");
    assert!(stdout.contains("async            = false"), "{stdout}");
}
