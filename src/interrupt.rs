//! Ctrl-C and SIGTERM during training: while the training loop runs, the first ends the
//! run after the step under way, with a checkpoint where `--checkpoint` names one, so
//! nothing trained is lost; a second one, or one before the loop starts or after it
//! ends, ends the process at once (exit status 130).

use std::sync::atomic::{AtomicBool, Ordering};

/// What the handler and the training loop share.
#[derive(Debug)]
pub struct StopFlag {
    requested: AtomicBool,
    armed: AtomicBool,
}

impl StopFlag {
    /// Whether a signal asked the run to stop.
    pub fn requested(&self) -> bool {
        self.requested.load(Ordering::SeqCst)
    }

    /// While armed, the first signal only sets the flag (the loop stops at the next step's
    /// end); unarmed, a signal ends the process.
    pub fn arm(&self, on: bool) {
        self.armed.store(on, Ordering::SeqCst);
    }
}

static FLAG: StopFlag = StopFlag {
    requested: AtomicBool::new(false),
    armed: AtomicBool::new(false),
};

extern "C" fn on_signal(_: libc::c_int) {
    if !FLAG.armed.load(Ordering::SeqCst) || FLAG.requested.swap(true, Ordering::SeqCst) {
        // SAFETY: _exit is async-signal-safe; nothing is in flight that a stop could save.
        unsafe { libc::_exit(130) }
    }
}

/// The handlers of SIGINT and SIGTERM while training: dropping it puts back the ones
/// before.
pub struct Installed {
    before: [libc::sighandler_t; 2],
}

impl Installed {
    pub fn flag(&self) -> &'static StopFlag {
        &FLAG
    }
}

impl Drop for Installed {
    fn drop(&mut self) {
        FLAG.arm(false);
        // SAFETY: puts back the handlers that `install` replaced.
        unsafe {
            libc::signal(libc::SIGINT, self.before[0]);
            libc::signal(libc::SIGTERM, self.before[1]);
        }
    }
}

/// Catches SIGINT and SIGTERM until the returned guard is dropped, with no stop asked for
/// yet and the flag unarmed.
pub fn install() -> Installed {
    FLAG.requested.store(false, Ordering::SeqCst);
    FLAG.arm(false);
    // SAFETY: the handler only reads and swaps atomics and may call _exit, all
    // async-signal-safe.
    unsafe {
        let handler = on_signal as *const () as libc::sighandler_t;
        Installed {
            before: [
                libc::signal(libc::SIGINT, handler),
                libc::signal(libc::SIGTERM, handler),
            ],
        }
    }
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
