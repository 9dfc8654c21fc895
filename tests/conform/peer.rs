//! The other end of every connection: a forked process that runs commands
//! from the suite, one line each over a pipe, and answers one line each.
//!
//! ```text
//! connect            connect to the suite's listener        ok | err E
//! listen             listen on an ephemeral port            port N
//! accept             accept on it                           ok | err E
//! send N SEED        send N bytes of pattern SEED           ok | err E
//! sendafter MS N S   answer, wait MS ms, then send          ok
//! recv N             receive exactly N bytes                got LEN CRC END
//! drain              receive until EOF or an error          got LEN CRC END
//! shutdown HOW       shutdown(2)                            ok | err E
//! close              close the connection                   ok
//! reset              close with SO_LINGER {1, 0}: a reset    ok
//! exit               leave
//! ```
//! END is `eof`, `more` (all N arrived) or the error's name.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::FromRawFd;

use libc::{c_int, c_void};

use crate::{crc, data, ename, errno, loopback};

pub struct Peer {
    cmd: std::fs::File,
    rsp: BufReader<std::fs::File>,
    pid: libc::pid_t,
}

fn pipe() -> (c_int, c_int) {
    let mut p = [0 as c_int; 2];
    // SAFETY: pipe2(2) into our own array.
    let r = unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) };
    assert_eq!(r, 0, "pipe");
    (p[0], p[1])
}

impl Peer {
    /// Fork the peer; `port` is the suite's listener.
    pub fn start(port: u16) -> Peer {
        let (cmd_r, cmd_w) = pipe();
        let (rsp_r, rsp_w) = pipe();
        // SAFETY: fork(2); the child runs the command loop and leaves with
        // exit(3).
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork");
        if pid == 0 {
            crate::close(cmd_w);
            crate::close(rsp_r);
            // SAFETY: our own pipe ends, owned from here.
            let (cmd, rsp) = unsafe {
                (
                    std::fs::File::from_raw_fd(cmd_r),
                    std::fs::File::from_raw_fd(rsp_w),
                )
            };
            serve(port, BufReader::new(cmd), rsp);
            std::process::exit(0);
        }
        crate::close(cmd_r);
        crate::close(rsp_w);
        // SAFETY: our own pipe ends, owned from here.
        unsafe {
            Peer {
                cmd: std::fs::File::from_raw_fd(cmd_w),
                rsp: BufReader::new(std::fs::File::from_raw_fd(rsp_r)),
                pid,
            }
        }
    }

    /// Send a command without waiting for its answer.
    pub fn tell(&mut self, cmd: &str) {
        writeln!(self.cmd, "{cmd}").expect("peer command");
    }

    /// The next answer.
    pub fn answer(&mut self) -> String {
        let mut l = String::new();
        self.rsp.read_line(&mut l).expect("peer answer");
        l.trim_end().to_string()
    }

    /// A command and its answer.
    pub fn ask(&mut self, cmd: &str) -> String {
        self.tell(cmd);
        self.answer()
    }

    pub fn finish(mut self) {
        self.tell("exit");
        let mut status = 0;
        // SAFETY: waitpid on our own child.
        unsafe { libc::waitpid(self.pid, &mut status, 0) };
    }
}

fn answer(rsp: &mut std::fs::File, s: &str) {
    let _ = writeln!(rsp, "{s}");
}

/// "ok", or the call's errno by name.
fn outcome(ok: bool) -> String {
    if ok {
        "ok".into()
    } else {
        format!("err {}", ename(errno()))
    }
}

fn serve(port: u16, cmds: BufReader<std::fs::File>, mut rsp: std::fs::File) {
    let mut cur: c_int = -1;
    let mut lst: c_int = -1;
    for line in cmds.lines() {
        let Ok(line) = line else { break };
        let w: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| -> u64 { w.get(i).and_then(|x| x.parse().ok()).unwrap_or(0) };
        match w.first().copied() {
            Some("connect") => {
                // SAFETY: socket(2) and connect(2) to our own address.
                let r = unsafe {
                    cur = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
                    let a = loopback(port);
                    libc::connect(cur, (&raw const a).cast(), std::mem::size_of_val(&a) as u32)
                };
                answer(&mut rsp, &outcome(r == 0));
            }
            Some("listen") => {
                // SAFETY: a listener of ours on an ephemeral port.
                let p = unsafe {
                    lst = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
                    let a = loopback(0);
                    libc::bind(lst, (&raw const a).cast(), std::mem::size_of_val(&a) as u32);
                    libc::listen(lst, 4);
                    let mut b: libc::sockaddr_in = std::mem::zeroed();
                    let mut l = std::mem::size_of_val(&b) as u32;
                    libc::getsockname(lst, (&raw mut b).cast(), &mut l);
                    u16::from_be(b.sin_port)
                };
                answer(&mut rsp, &format!("port {p}"));
            }
            Some("accept") => {
                // SAFETY: accept(2) without an address.
                cur = unsafe { libc::accept(lst, std::ptr::null_mut(), std::ptr::null_mut()) };
                crate::close(lst);
                answer(&mut rsp, &outcome(cur >= 0));
            }
            Some("send") => {
                let r = send_all(cur, &data(num(1) as usize, num(2) as u32));
                answer(&mut rsp, &r);
            }
            Some("sendafter") => {
                answer(&mut rsp, "ok");
                crate::sleep_ms(num(1));
                let _ = send_all(cur, &data(num(2) as usize, num(3) as u32));
            }
            Some("recv") => {
                let r = receive(cur, Some(num(1) as usize));
                answer(&mut rsp, &r);
            }
            Some("drain") => {
                let r = receive(cur, None);
                answer(&mut rsp, &r);
            }
            Some("shutdown") => {
                // SAFETY: shutdown(2) of our socket.
                let r = unsafe { libc::shutdown(cur, num(1) as c_int) };
                answer(&mut rsp, &outcome(r == 0));
            }
            Some("close") => {
                crate::close(cur);
                answer(&mut rsp, "ok");
            }
            Some("reset") => {
                let lg = libc::linger {
                    l_onoff: 1,
                    l_linger: 0,
                };
                // SAFETY: SO_LINGER from our own struct, then close(2).
                unsafe {
                    libc::setsockopt(
                        cur,
                        libc::SOL_SOCKET,
                        libc::SO_LINGER,
                        (&raw const lg).cast(),
                        std::mem::size_of_val(&lg) as u32,
                    );
                }
                crate::close(cur);
                answer(&mut rsp, "ok");
            }
            _ => break,
        }
    }
}

fn send_all(fd: c_int, mut b: &[u8]) -> String {
    while !b.is_empty() {
        // SAFETY: send(2) from our own buffer; no SIGPIPE.
        let n = unsafe { libc::send(fd, b.as_ptr().cast::<c_void>(), b.len(), libc::MSG_NOSIGNAL) };
        if n <= 0 {
            return format!("err {}", ename(errno()));
        }
        b = &b[n as usize..];
    }
    "ok".into()
}

/// `want` bytes (or all until EOF): "got LEN CRC END".
fn receive(fd: c_int, want: Option<usize>) -> String {
    let mut got = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    let end = loop {
        if want.is_some_and(|w| got.len() >= w) {
            break "more".to_string();
        }
        let room = want.map_or(buf.len(), |w| (w - got.len()).min(buf.len()));
        // SAFETY: recv(2) into our own buffer.
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast::<c_void>(), room, 0) };
        if n == 0 {
            break "eof".into();
        }
        if n < 0 {
            break ename(errno());
        }
        got.extend_from_slice(&buf[..n as usize]);
    };
    format!("got {} {:08x} {end}", got.len(), crc(&got))
}
