//! The elastic protocol: how survivors agree after a failure (`agreement.rs`, a state machine
//! without I/O that the model checker walks).

// The shrink's driver does not run it yet (docs/DESIGN.md): only the checker reaches it.
#[cfg_attr(not(feature = "unstable"), allow(dead_code))]
pub(crate) mod agreement;
