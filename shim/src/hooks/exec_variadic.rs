//! `execl`, `execlp` and `execle`, which are variadic in C and exec
//! through libc's internal `execve`, not the one we interpose. Stable Rust
//! cannot take a variadic argument list, and has no need to: each is a
//! naked trampoline that saves the argument registers, lets
//! [`before`] move the connections onto TCP (as before any exec), puts
//! the registers back and jumps to libc's own function, so the arguments,
//! on the stack too, reach it untouched. x86-64 only; elsewhere these
//! three pass through the shim unseen (docs/shim.md, known limits).
//!
//! `unsafe` here: the trampolines' assembly, which follows the System V
//! x86-64 calling convention (the stack 16-byte aligned at the call, `al`
//! kept for the variadic callee).

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::real;

/// libc's execl, execlp, execle, in that order, once looked up.
static NEXT: [AtomicUsize; 3] = [const { AtomicUsize::new(0) }; 3];
const NAMES: [&[u8]; 3] = [b"execl\0", b"execlp\0", b"execle\0"];

/// Called by a trampoline, before the exec: settle the connections and
/// return the address of libc's function number `which`.
extern "C" fn before(which: usize) -> usize {
    super::process::before_exec();
    let which = which.min(2);
    let mut a = NEXT[which].load(Ordering::Relaxed);
    if a == 0 {
        a = real::next_definition(NAMES[which]);
        NEXT[which].store(a, Ordering::Relaxed);
    }
    a
}

macro_rules! trampoline {
    ($name:ident, $which:literal) => {
        #[unsafe(naked)]
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name() {
            core::arch::naked_asm!(
                // Entry: rsp is 8 past a 16-byte boundary; seven pushes
                // align it for the call.
                "push rdi",
                "push rsi",
                "push rdx",
                "push rcx",
                "push r8",
                "push r9",
                "push rax",
                concat!("mov edi, ", $which),
                "call {before}",
                "mov r11, rax",
                "pop rax",
                "pop r9",
                "pop r8",
                "pop rcx",
                "pop rdx",
                "pop rsi",
                "pop rdi",
                "jmp r11",
                before = sym before,
            )
        }
    };
}

trampoline!(execl, "0");
trampoline!(execlp, "1");
trampoline!(execle, "2");
