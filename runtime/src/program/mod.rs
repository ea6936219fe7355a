//! The step program and its analyses: [`schedule`] turns a graph into launches on
//! streams with events (the ERASE order among them), [`memory`] places every tensor in
//! one arena, [`hb`] checks that every read happens after its write and before its
//! bytes are reused, [`occupancy`] models how launches share the device, and
//! [`simulate`] predicts the step's time from all of it.

pub mod hb;
pub mod memory;
pub mod occupancy;
pub mod schedule;
pub mod simulate;
