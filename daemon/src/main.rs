//! The `azsdp` command.

fn main() {}
