//! Files for unit tests.

use std::io::Write;

/// A read-write file in the temporary directory, already unlinked (gone
/// when dropped), holding `bytes`. `tag` and the thread keep parallel
/// tests apart.
pub fn unlinked_tempfile(tag: &str, bytes: &[u8]) -> std::fs::File {
    let path = std::env::temp_dir().join(format!(
        "azsdp-{tag}-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    f.write_all(bytes).unwrap();
    std::fs::remove_file(&path).unwrap();
    f
}
