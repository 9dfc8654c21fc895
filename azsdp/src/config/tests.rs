use super::*;

fn conn<'a>(program: &'a str, role: Role, addr: &str, port: u16) -> RuleInput<'a> {
    RuleInput {
        program,
        role,
        addr: addr.parse().unwrap(),
        port,
    }
}

/// The first problem of `text`.
fn parse_err(text: &str) -> Problem {
    Config::parse(text, "test.toml")
        .unwrap_err()
        .first()
        .clone()
}

#[test]
fn example_file_parses_and_rules_match_first() {
    let text = include_str!("../../../docs/azsdp.example.toml");
    let c = Config::parse(text, "azsdp.example.toml").unwrap();
    assert_eq!(c.rules.len(), 3);
    assert_eq!(c.global.zcopy_threshold, 64 << 10);
    let d = c.decide(&conn(
        "/usr/bin/redis-server",
        Role::Server,
        "10.0.0.5",
        6379,
    ));
    assert_eq!(d.rule, Some(1));
    assert_eq!(d.settings.use_, Use::Azsdp);
    assert_eq!(d.settings.zcopy_threshold, 16 << 10);
    // Unset per-rule keys inherit the globals.
    assert_eq!(d.settings.max_outstanding, 16);
    // Same program as a client: rule 1 needs role server.
    let d = c.decide(&conn("redis-server", Role::Client, "192.168.100.7", 6379));
    assert_eq!(d.rule, Some(2));
    assert_eq!(d.settings.use_, Use::Tcp);
    let d = c.decide(&conn("/usr/sbin/sshd", Role::Server, "10.0.0.1", 22));
    assert_eq!(d.rule, Some(3));
    assert_eq!(d.settings.use_, Use::Tcp);
    let d = c.decide(&conn("curl", Role::Client, "10.0.0.1", 80));
    assert_eq!(d.rule, None);
    assert_eq!(d.settings, c.global);
}

#[test]
fn empty_file_is_the_defaults() {
    let c = Config::parse("", "empty.toml").unwrap();
    assert_eq!(c.global, Settings::default());
    let e = c.global.engine_config(
        Role::Client,
        Capabilities::ALL,
        LockRegion {
            addr: 0,
            key: 0,
            slots: 4,
        },
    );
    assert_eq!(e.zcopy_threshold, Settings::default().zcopy_threshold);
}

#[test]
fn errors_name_file_line_and_key() {
    let e = parse_err("zcopy_threshold = \"64KiB\"\nwrite_fault = \"sometimes\"\n");
    assert_eq!(e.line, Some(2));
    assert_eq!(e.key.as_deref(), Some("write_fault"));
    let s = e.to_string();
    assert!(s.starts_with("test.toml:2:15: key `write_fault`:"), "{s}");
    assert!(s.contains("copy, block"), "{s}");

    let e = parse_err("[[rule]]\nprogram = \"x\"\n\n[[rule]]\nport = \"70000\"\n");
    assert_eq!(e.line, Some(5));
    assert_eq!(e.key.as_deref(), Some("rule[2].port"));

    let e = parse_err("zcopy_treshold = 5\n");
    assert_eq!(e.key.as_deref(), Some("zcopy_treshold"));
    assert!(e.message.contains("unknown key"));
    assert_eq!(e.help.as_deref(), Some("did you mean `zcopy_threshold`?"));

    let e = parse_err("[[rule]]\naddress = \"10.0.0.0/99\"\n");
    assert_eq!(
        (e.line, e.key.as_deref()),
        (Some(2), Some("rule[1].address"))
    );

    let e = parse_err("linger = 30\n");
    assert!(e.message.contains("unit"), "{}", e.message);

    let e = parse_err("max_outstanding = 0\n");
    assert!(e.message.contains("from 1 to 1024"), "{}", e.message);

    let e = parse_err("bsdp_buffer = \"1KiB\"\n");
    assert_eq!(e.key.as_deref(), Some("bsdp_buffer"));

    let e = parse_err("bsdp_buffer = \"4KiB\"\nbsdp_slot = \"16KiB\"\n");
    assert_eq!(e.key.as_deref(), Some("bsdp_slot"));

    let e = parse_err("rule = 3\n");
    assert_eq!(e.key.as_deref(), Some("rule"));

    // Malformed TOML still gets a line.
    let e = parse_err("a = 1\nb = [\n");
    assert!(e.line.is_some());
}

#[test]
fn env_overrides_single_keys_and_reports_bad_ones() {
    let vars = |v: &[(&str, &str)]| {
        v.iter()
            .map(|(a, b)| (a.into(), b.into()))
            .collect::<Vec<(std::ffi::OsString, std::ffi::OsString)>>()
    };
    let dir = std::env::temp_dir().join(format!("azsdp-config-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("a.toml");
    std::fs::write(&file, "write_fault = \"copy\"\nmax_outstanding = 4\n").unwrap();
    let c = Config::from_environment(
        None,
        vars(&[
            ("AZSDP_CONFIG", file.to_str().unwrap()),
            ("AZSDP_WRITE_FAULT", "block"),
            ("AZSDP_LOG", "stderr"),
            ("PATH", "/bin"),
        ]),
    )
    .unwrap();
    assert_eq!(c.global.write_fault, FaultPolicy::Block);
    assert_eq!(c.global.max_outstanding, 4);
    assert_eq!(c.source.as_deref(), Some(file.as_path()));

    let e = Config::from_environment(Some(&file), vars(&[("AZSDP_ZCOPY_THRESHOLD", "lots")]))
        .unwrap_err()
        .first()
        .clone();
    assert_eq!(e.origin, "env AZSDP_ZCOPY_THRESHOLD");
    assert_eq!(e.key.as_deref(), Some("zcopy_threshold"));

    let e = Config::from_environment(Some(&file), vars(&[("AZSDP_ZCOPY_TRESHOLD", "1")]))
        .unwrap_err()
        .first()
        .clone();
    assert!(e.message.contains("unknown variable"), "{e}");
    assert_eq!(
        e.help.as_deref(),
        Some("did you mean AZSDP_ZCOPY_THRESHOLD?")
    );
    let e = Config::from_environment(Some(&file), vars(&[("AZSDP_LOGLEVEL", "info")]))
        .unwrap_err()
        .first()
        .clone();
    assert_eq!(e.origin, "env AZSDP_LOGLEVEL");
    assert_eq!(e.help.as_deref(), Some("did you mean AZSDP_LOG_LEVEL?"));

    let missing = dir.join("missing.toml");
    let e = Config::from_environment(None, vars(&[("AZSDP_CONFIG", missing.to_str().unwrap())]))
        .unwrap_err()
        .first()
        .clone();
    assert!(e.message.contains("cannot read"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn program_globs_match_the_name_or_the_path() {
    let c = Config::parse(
        "[[rule]]\nprogram = \"/opt/*/bin/server\"\nuse = \"tcp\"\n[[rule]]\nprogram = \"py*\"\nuse = \"azsdp\"\n",
        "t",
    )
    .unwrap();
    assert_eq!(
        c.decide(&conn("/opt/x/bin/server", Role::Server, "::1", 1))
            .rule,
        Some(1)
    );
    assert_eq!(
        c.decide(&conn("/usr/bin/python3", Role::Server, "::1", 1))
            .rule,
        Some(2)
    );
    assert_eq!(c.decide(&conn("server", Role::Server, "::1", 1)).rule, None);
}

#[test]
fn protection_modes_parse_and_bad_ones_are_named() {
    use crate::protect::ProtectionMode;
    let c = Config::parse("protection = \"mprotect\"\n", "t.toml").unwrap();
    assert_eq!(c.global.protection, ProtectionMode::Mprotect);
    let e = parse_err("protection = \"sometimes\"\n");
    let msg = e.to_string();
    assert!(
        msg.contains("protection") && msg.contains("mprotect"),
        "{msg}"
    );
}

#[test]
fn the_environment_may_hold_any_bytes_but_ours_must_be_text() {
    use std::ffi::OsString;
    use std::os::unix::ffi::OsStringExt;
    let junk = OsString::from_vec(vec![0xff, 0xfe, b'x']);
    let c = Config::from_environment(
        None,
        vec![
            (junk.clone(), junk.clone()),
            (OsString::from("LANG"), junk.clone()),
            (OsString::from("AZSDP_POLL"), OsString::from("5us")),
        ],
    )
    .unwrap();
    assert_eq!(c.global.poll, Duration::from_micros(5));
    let e = Config::from_environment(None, vec![(OsString::from("AZSDP_POLL"), junk)])
        .unwrap_err()
        .first()
        .clone();
    assert_eq!(e.origin, "env AZSDP_POLL");
    assert!(e.message.contains("UTF-8"), "{e}");
}

#[test]
fn only_bounded_regular_files_are_read() {
    for special in ["/dev/zero", "/dev/null", "/"] {
        let e = Config::load(std::path::Path::new(special))
            .unwrap_err()
            .first()
            .clone();
        assert!(e.message.contains("not a regular file"), "{special}: {e}");
    }
    let dir = std::env::temp_dir().join(format!("azsdp-config-files-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // A FIFO nobody writes: refused at once, never waited on.
    let fifo = dir.join("fifo");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
    let t0 = std::time::Instant::now();
    let e = Config::load(&fifo).unwrap_err().first().clone();
    assert!(e.message.contains("not a regular file"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(1));
    let big = dir.join("big.toml");
    std::fs::write(&big, vec![b'#'; (MAX_FILE_BYTES + 1) as usize]).unwrap();
    let e = Config::load(&big).unwrap_err().first().clone();
    assert!(e.message.contains("more than"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_rdma_read_piece_is_zero_or_at_least_a_page() {
    assert_eq!(
        Settings::default().rdma_read_piece,
        128 << 10,
        "the documented default"
    );
    for (ok, n) in [("0", 0), ("\"4KiB\"", 4096), ("\"1MiB\"", 1 << 20)] {
        let c = Config::parse(&format!("rdma_read_piece = {ok}\n"), "t.toml").unwrap();
        assert_eq!(c.global.rdma_read_piece, n, "{ok}");
    }
    for bad in ["100", "\"2GiB\"", "-1", "\"much\""] {
        let e = parse_err(&format!("rdma_read_piece = {bad}\n"));
        assert_eq!(e.key.as_deref(), Some("rdma_read_piece"), "{bad}: {e}");
    }
}

#[test]
fn read_ahead_is_a_size_or_auto() {
    let c = Config::parse("read_ahead = \"auto\"\n", "t.toml").unwrap();
    assert!(c.global.read_ahead_auto);
    assert_eq!(c.global.read_ahead, AUTO_READ_AHEAD);
    let e = c
        .global
        .engine_config(Role::Server, Capabilities::ALL, LockRegion::UNSET);
    assert!(e.read_ahead_auto && e.read_ahead == AUTO_READ_AHEAD);
    // A rule's size undoes the global "auto", and prints back as it reads.
    let c = Config::parse(
        "read_ahead = \"auto\"\n[[rule]]\nport = 9\nread_ahead = \"2MiB\"\n",
        "t.toml",
    )
    .unwrap();
    let r = c.global.overlay(&c.rules[0].tunables);
    assert!(!r.read_ahead_auto);
    assert_eq!(r.read_ahead, 2 << 20);
    let printed = c.global.entries();
    assert!(
        printed.contains(&("read_ahead", "\"auto\"".to_string())),
        "{printed:?}"
    );
    let back = Config::parse(&r.to_toml(), "printed").unwrap();
    assert_eq!(back.global, r);
    for bad in ["\"soon\"", "true", "-1"] {
        let e = parse_err(&format!("read_ahead = {bad}\n"));
        assert_eq!(e.key.as_deref(), Some("read_ahead"), "{bad}: {e}");
    }
}

#[test]
fn the_rdma_lock_is_auto_device_or_message_and_odp_auto_or_off() {
    assert_eq!(Settings::default().rdma_lock, RdmaLock::Auto);
    assert_eq!(Settings::default().rdma_odp, RdmaOdp::Auto);
    for (ok, v) in [
        ("auto", RdmaLock::Auto),
        ("device", RdmaLock::Device),
        ("Message", RdmaLock::Message),
    ] {
        let c = Config::parse(&format!("rdma_lock = \"{ok}\"\n"), "t.toml").unwrap();
        assert_eq!(c.global.rdma_lock, v, "{ok}");
    }
    for (ok, v) in [("auto", RdmaOdp::Auto), ("OFF", RdmaOdp::Off)] {
        let c = Config::parse(&format!("rdma_odp = \"{ok}\"\n"), "t.toml").unwrap();
        assert_eq!(c.global.rdma_odp, v, "{ok}");
    }
    for (key, bad) in [
        ("rdma_lock", "\"nic\""),
        ("rdma_lock", "1"),
        ("rdma_lock", "true"),
        ("rdma_odp", "\"on\""),
        ("rdma_odp", "false"),
    ] {
        let e = parse_err(&format!("{key} = {bad}\n"));
        assert_eq!(e.key.as_deref(), Some(key), "{bad}: {e}");
    }
}

#[test]
fn durations_have_sane_ranges_and_zero_means_never_where_documented() {
    for (key, bad) in [
        ("poll", "10m"),
        ("poll", "11ms"),
        ("peer_timeout", "1ms"),
        ("peer_timeout", "1441m"),
        ("keepalive", "0"),
        ("pair_timeout", "0"),
        ("pair_timeout", "2m"),
        ("block_escalate", "1m"),
    ] {
        let e = parse_err(&format!("{key} = \"{bad}\"\n"));
        assert_eq!(e.key.as_deref(), Some(key), "{key} = {bad}: {e}");
        assert!(e.message.contains("must be"), "{e}");
    }
    let c = Config::parse("peer_timeout = \"0\"\nlinger = \"0\"\npoll = 0\n", "t").unwrap();
    assert_eq!(c.global.peer_timeout, Duration::ZERO);
    let e = c
        .global
        .engine_config(Role::Client, Capabilities::ALL, LockRegion::UNSET);
    assert_eq!(e.peer_timeout, Duration::ZERO, "never");
}

#[test]
fn every_problem_is_reported_at_once_in_file_order() {
    let text = "\
zcopy_treshold = 5
write_fault = \"sometimes\"
keepalive = \"40s\"
peer_timeout = \"30s\"

[[rule]]
programme = \"redis\"
port = 70000
";
    let e = Config::parse(text, "t.toml").unwrap_err();
    let got: Vec<(Option<usize>, Option<&str>)> = e
        .problems
        .iter()
        .map(|p| (p.line, p.key.as_deref()))
        .collect();
    assert_eq!(
        got,
        vec![
            (Some(1), Some("zcopy_treshold")),
            (Some(2), Some("write_fault")),
            // The cross-key problem points at the key to blame.
            (Some(3), Some("keepalive")),
            (Some(7), Some("rule[1].programme")),
            (Some(8), Some("rule[1].port")),
        ],
        "{e}"
    );
    // The rule's unknown key is offered the rule's keys, not garbled.
    assert_eq!(
        e.problems[3].help.as_deref(),
        Some("did you mean `program`?")
    );
    assert_eq!(e.to_string().lines().count(), 5);
    // A rule that sets one of two conflicting keys is blamed at its line.
    let e = Config::parse("[[rule]]\nport = 1\nkeepalive = \"1m\"\n", "t").unwrap_err();
    assert_eq!(e.problems.len(), 1, "{e}");
    assert_eq!(e.first().line, Some(3));
    assert_eq!(e.first().key.as_deref(), Some("rule[1].keepalive"));
    // A stranger gets the list of keys.
    let e = parse_err("colour = 3\n");
    let help = e.help.unwrap_or_default();
    assert!(
        help.contains("zcopy_threshold") && help.contains("rule"),
        "{help}"
    );
}

#[test]
fn the_file_and_the_environment_are_reported_together() {
    let dir = std::env::temp_dir().join(format!("azsdp-config-both-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("c.toml");
    std::fs::write(&file, "poll = \"1h\"\n").unwrap();
    let e = Config::from_environment(
        Some(&file),
        vec![
            ("AZSDP_KEEPALIVE".into(), "50m".into()),
            ("AZSDP_PEER_TIMEOUT".into(), "10s".into()),
            ("AZSDP_STATDIR".into(), "/x".into()),
        ],
    )
    .unwrap_err();
    let origins: Vec<&str> = e.problems.iter().map(|p| p.origin.as_str()).collect();
    let file_origin = file.display().to_string();
    assert_eq!(
        origins,
        vec![
            file_origin.as_str(),
            "env AZSDP_STATDIR",
            "env AZSDP_KEEPALIVE"
        ],
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn settings_print_as_a_configuration_that_reads_back_the_same() {
    let d = Settings::default();
    let back = Config::parse(&d.to_toml(), "printed").unwrap();
    assert_eq!(back.global, d);
    let text = "write_fault = \"block\"\nzcopy_threshold = \"1MiB\"\npoll = \"5us\"\n\
                protection = \"mprotect\"\nasync = false\nbsdp_slot = 4096\nlinger = \"0\"\n";
    let c = Config::parse(text, "t").unwrap();
    let printed = c.global.to_toml();
    assert_eq!(Config::parse(&printed, "printed").unwrap().global, c.global);
    assert!(
        printed.contains("write_fault      = \"block\""),
        "{printed}"
    );
    assert!(printed.contains("zcopy_threshold  = \"1MiB\""), "{printed}");
    assert!(printed.contains("bsdp_slot        = \"4KiB\""), "{printed}");
    assert_eq!(printed.lines().count(), TUNABLE_KEYS.len());
}
