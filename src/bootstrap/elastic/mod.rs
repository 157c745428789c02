//! The elastic protocol: how survivors agree after a failure. The agreement as a state machine
//! without I/O (`agreement/`, which the model checker walks), its messages on the wire
//! (`codec.rs`), their sending (`outbox.rs`) and the loop that runs the machine over a rank's
//! control port (`driver.rs`); ended agreements answering at old ports (`retired.rs`); where
//! newcomers join a growing group (`lobby.rs`).

pub(crate) mod agreement;
pub(crate) mod codec;
pub(crate) mod driver;
pub(crate) mod lobby;
pub(crate) mod outbox;
pub(crate) mod retired;

#[cfg(test)]
mod tests;
