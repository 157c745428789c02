//! The elastic protocol: how survivors agree after a failure. The agreement as a state machine
//! without I/O (`agreement/`, which the model checker walks), its messages on the wire
//! (`codec.rs`), their sending (`outbox.rs`) and the loop that runs the machine over a rank's
//! control port (`driver.rs`).

pub(crate) mod agreement;
pub(crate) mod codec;
pub(crate) mod driver;
pub(crate) mod outbox;

#[cfg(test)]
mod tests;
