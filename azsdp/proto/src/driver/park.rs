//! Parking a driver: the engine and the driver's own numbering as bytes,
//! taken up again (by the next image of the process, after `exec`) on an
//! endpoint of the same fabric connection. See the connection's `park`
//! module for what a parkable connection holds.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::{Driver, Host};
use crate::conn::{Connection, Unparkable};
use crate::fabric::Fabric;
use crate::id_map::IdMap;
use crate::protect::Protector;

const MAGIC: &[u8; 8] = b"AZSDPARK";

/// Which build parked it: bytes from another build are refused (the
/// encoding follows the engine's fields, which builds may change).
fn build() -> String {
    format!(
        "{}/{}/{}",
        env!("CARGO_PKG_VERSION"),
        std::mem::size_of::<Connection>(),
        std::mem::size_of::<crate::conn::Counters>()
    )
}

/// The start every parked engine of this build has (magic and build), for
/// fuzzing what follows it.
pub fn parked_header() -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    out.extend(postcard::to_stdvec(&build()).unwrap_or_default());
    out
}

#[derive(Serialize)]
struct Parking<'a> {
    build: String,
    conn: &'a Connection,
    next_call: u64,
    next_ticket: u64,
    next_op: u64,
    refused: &'a Option<Vec<u8>>,
    peer_left: bool,
    max_wait: Duration,
}

#[derive(Deserialize)]
struct Parked {
    build: String,
    conn: Connection,
    next_call: u64,
    next_ticket: u64,
    next_op: u64,
    refused: Option<Vec<u8>>,
    peer_left: bool,
    max_wait: Duration,
}

/// Why parked bytes cannot be taken up.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum UnparkError {
    #[error("not a parked connection")]
    NotParked,
    #[error("parked by another build of azsdp ({0}, this is {1})")]
    OtherBuild(String, String),
    #[error("malformed parked connection: {0}")]
    Malformed(String),
    #[error("inconsistent parked connection: {0}")]
    Inconsistent(&'static str),
}

impl<F: Fabric, P: Protector, H: Host> Driver<F, P, H> {
    /// What keeps this connection from parking now (`None`: it may).
    pub fn park_blocker(&self) -> Option<Unparkable> {
        if let Some(b) = self.conn.park_blocker() {
            return Some(b);
        }
        if !self.steps.is_empty()
            || !self.completed.is_empty()
            || self.resend.is_some()
            || self.fabric.completions_pending()
        {
            return Some(Unparkable::InFlight);
        }
        if !self.fault_pages.is_empty() || !self.resumed.is_empty() {
            return Some(Unparkable::Faults);
        }
        None
    }

    /// The connection as bytes for [`Driver::unpark`], if it may park now.
    /// Nothing changes here: the caller stops driving this copy (it
    /// `exec`s), or goes on with it if that fails.
    pub fn park(&self) -> Result<Vec<u8>, Unparkable> {
        if let Some(b) = self.park_blocker() {
            return Err(b);
        }
        let p = Parking {
            build: build(),
            conn: &self.conn,
            next_call: self.next_call,
            next_ticket: self.next_ticket,
            next_op: self.next_op,
            refused: &self.refused,
            peer_left: self.peer_left,
            max_wait: self.max_wait,
        };
        let mut out = MAGIC.to_vec();
        // Serializing plain data into a Vec cannot fail.
        out.extend(postcard::to_stdvec(&p).unwrap_or_default());
        Ok(out)
    }

    /// Take up a parked connection on `fabric` (an endpoint of the same
    /// fabric connection), with a fresh `protector` and `host`.
    pub fn unpark(bytes: &[u8], fabric: F, protector: P, host: H) -> Result<Self, UnparkError> {
        let body = bytes.strip_prefix(MAGIC).ok_or(UnparkError::NotParked)?;
        // The build comes first: checked before the rest is decoded.
        let (their, _) = postcard::take_from_bytes::<String>(body)
            .map_err(|e| UnparkError::Malformed(e.to_string()))?;
        let ours = build();
        if their != ours {
            return Err(UnparkError::OtherBuild(their, ours));
        }
        let p: Parked =
            postcard::from_bytes(body).map_err(|e| UnparkError::Malformed(e.to_string()))?;
        debug_assert_eq!(p.build, ours);
        let mut conn = p.conn;
        conn.check_unparked().map_err(UnparkError::Inconsistent)?;
        if conn.config().lock_region != fabric.lock_region() {
            return Err(UnparkError::Inconsistent(
                "lock region of another connection",
            ));
        }
        conn.rebase_clock(host.now());
        let mut d = Driver {
            conn,
            fabric,
            protector,
            host,
            next_call: p.next_call,
            done: IdMap::default(),
            resumed: Vec::new(),
            fault_pages: IdMap::default(),
            next_ticket: p.next_ticket,
            steps: IdMap::default(),
            next_op: p.next_op,
            refused: p.refused,
            resend: None,
            arms_paused: false,
            buf: Vec::new(),
            completed: Vec::new(),
            peer_left: p.peer_left,
            max_wait: p.max_wait,
        };
        d.drive();
        Ok(d)
    }

    /// The fabric endpoint, the rest dropped (a parked driver's endpoint
    /// goes on in the driver [`Driver::unpark`] makes).
    pub fn into_fabric(self) -> F {
        self.fabric
    }
}
