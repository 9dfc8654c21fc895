//! Configuration (in progress).
