//! Ctrl-C and SIGTERM during training: the first ends the run after the step under way,
//! with a checkpoint where `--checkpoint` names one, so nothing trained is lost; a second
//! one ends the process at once.

use std::sync::atomic::{AtomicBool, Ordering};

/// Set by the first signal.
static REQUESTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    if REQUESTED.swap(true, Ordering::SeqCst) {
        // SAFETY: _exit is async-signal-safe; a second signal means "now".
        unsafe { libc::_exit(130) }
    }
}

/// Catches SIGINT and SIGTERM from here on; returns the flag the first one sets.
pub fn install() -> &'static AtomicBool {
    // SAFETY: the handler only swaps an atomic and may call _exit, both
    // async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    &REQUESTED
}

/// The error of a run that a signal stopped: `erase-ctr` exits with status 130.
#[derive(Debug)]
pub struct Interrupted(pub String);

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Interrupted {}
