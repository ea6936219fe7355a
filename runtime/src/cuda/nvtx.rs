//! NVTX ranges, marks and names for Nsight Systems and Nsight Compute, without NVIDIA's
//! C library or the `nvtx` crate.
//!
//! # How an NVTX3 tool attaches
//! NVTX3 has no library of its own: every program that uses it carries a small loader and
//! a table of function pointers, and a profiler plugs its functions into that table. The
//! profiler (`nsys`, `ncu`) starts the program with `NVTX_INJECTION64_PATH` naming its
//! injection library. On the first NVTX call the program loads that library, finds the
//! C function `InitializeInjectionNvtx2` in it, and calls it with a pointer to the
//! program's own `GetExportTable(id)`; a non-zero return means the tool attached.
//!
//! During that call the tool asks `GetExportTable` for tables by number: 1 is the
//! callbacks table (its size in bytes, then a `GetModuleFunctionTable` function), 3 the
//! version table (its size, the NVTX API version, 3, a reserved word, and a function
//! through which the tool may report its own version). `GetModuleFunctionTable(module,
//! &table, &size)` answers, for one API module (1 core, 2 CUDA driver, 3 OpenCL, 4 CUDA
//! runtime, 5 core2 with domains, 6 sync), an array of pointers to the program's
//! function-pointer slots, indexed by the callback id of each function (in the core
//! module, 2 is `MarkA`, 9 `RangePushA`, 11 `RangePop`, 14 `NameOsThreadA`; in the CUDA
//! module 5 is `NameCuStreamA`). Entry 0 is unused and null, `size` counts the entries
//! up to (not including) a final null that guards against reading past the end. The tool
//! writes its own functions into the slots it implements and leaves the others alone.
//!
//! Only the first caller runs this: a state word goes from fresh to started by
//! compare-and-swap; every other thread that arrives meanwhile yields until the state
//! says finished (attached or off). After that, each call reads the state with one
//! atomic load and, with a tool attached, calls the slot's function if the tool filled
//! it. Without the variable (the normal case) every call is that load and a return.
//! A library that fails to load, lacks the entry point or refuses to attach leaves NVTX
//! off, with one warning on stderr.
//!
//! Thread ranges are per OS thread: [`range_push`] and [`range_pop`] must pair on the
//! same thread, which the [`Range`] guard (not `Send`) makes sure of.

use std::ffi::{c_char, c_int, c_uint, c_void, CString, OsStr};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicPtr, AtomicU8, Ordering};

use cudarc::driver::sys::CUstream;

/// The variable a profiler sets to the path of its injection library.
const INJECTION_VAR: &str = if cfg!(target_pointer_width = "32") {
    "NVTX_INJECTION32_PATH"
} else {
    "NVTX_INJECTION64_PATH"
};
/// The entry point an injection library exports.
const INIT_SYMBOL: &[u8] = b"InitializeInjectionNvtx2\0";
/// The NVTX API version this loader implements.
const NVTX_VERSION: u32 = 3;

/// Export table ids.
const TABLE_CALLBACKS: u32 = 1;
const TABLE_VERSION_INFO: u32 = 3;

/// Callback modules, numbered as the protocol numbers them (module `m` is `modules[m - 1]`),
/// with the number of callback ids of each (id 0 included, unused).
const MODULE_CORE: u32 = 1;
const MODULE_CUDA: u32 = 2;
const MODULE_IDS: [u32; 6] = [
    16, // core: MarkEx .. NameOsThreadW
    9,  // CUDA driver: NameCuDeviceA .. NameCuEventW
    15, // OpenCL
    7,  // CUDA runtime
    16, // core2: domains
    7,  // sync
];
/// The most ids of any module.
const MAX_IDS: usize = 16;

/// Callback ids used here.
const CORE_MARK_A: usize = 2;
const CORE_RANGE_PUSH_A: usize = 9;
const CORE_RANGE_POP: usize = 11;
const CORE_NAME_OS_THREAD_A: usize = 14;
const CUDA_NAME_CU_STREAM_A: usize = 5;

/// The states of an [`Instance`].
const FRESH: u8 = 0;
const STARTED: u8 = 1;
const OFF: u8 = 2;
const ON: u8 = 3;

type GetExportTableFn = unsafe extern "C" fn(u32) -> *const c_void;
type InitInjectionFn = unsafe extern "C" fn(GetExportTableFn) -> c_int;
/// A slot holds a function pointer of the tool (null: not implemented).
type Slot = AtomicPtr<c_void>;
type GetModuleFunctionTableFn =
    unsafe extern "C" fn(u32, *mut *const AtomicPtr<*mut c_void>, *mut c_uint) -> c_int;

type MarkAFn = unsafe extern "C" fn(*const c_char);
type RangePushAFn = unsafe extern "C" fn(*const c_char) -> c_int;
type RangePopFn = unsafe extern "C" fn() -> c_int;
type NameOsThreadAFn = unsafe extern "C" fn(u32, *const c_char);
type NameCuStreamAFn = unsafe extern "C" fn(CUstream, *const c_char);

/// Export table 1.
#[repr(C)]
struct CallbacksTable {
    struct_size: usize,
    get_module_function_table: GetModuleFunctionTableFn,
}

/// Export table 3.
#[repr(C)]
struct VersionInfoTable {
    struct_size: usize,
    version: u32,
    reserved0: u32,
    set_injection_nvtx_version: extern "C" fn(u32),
}

/// One module's slots and the table of their addresses the tool receives.
struct Module {
    ids: u32,
    slots: [Slot; MAX_IDS],
    /// `refs[i]` points at `slots[i]` for `0 < i < ids` once the tool asked; `refs[0]`
    /// and `refs[ids]` stay null.
    refs: [AtomicPtr<*mut c_void>; MAX_IDS + 1],
}

impl Module {
    const fn new(ids: u32) -> Module {
        Module {
            ids,
            slots: [const { AtomicPtr::new(std::ptr::null_mut()) }; MAX_IDS],
            refs: [const { AtomicPtr::new(std::ptr::null_mut()) }; MAX_IDS + 1],
        }
    }
}

/// Names the static [`Instance`] that an exported C function serves (the protocol's
/// functions take no context pointer, so each instance gets its own copies).
trait Home {
    fn instance() -> &'static Instance;
}

/// One NVTX loader: the state, the slots and the export tables. The program has one
/// ([`GLOBAL`]); tests make their own so that they can play the tool.
struct Instance {
    state: AtomicU8,
    modules: [Module; 6],
    callbacks: CallbacksTable,
    version_info: VersionInfoTable,
    get_export_table: GetExportTableFn,
}

struct Global;
impl Home for Global {
    fn instance() -> &'static Instance {
        &GLOBAL
    }
}

static GLOBAL: Instance = Instance::new::<Global>();

/// `GetExportTable` of the instance `H` names.
unsafe extern "C" fn get_export_table<H: Home>(id: u32) -> *const c_void {
    H::instance().export_table(id)
}

/// `GetModuleFunctionTable` of the instance `H` names.
///
/// # Safety
/// `out_table` and `out_size` are null or valid for a write, as the protocol requires.
unsafe extern "C" fn get_module_function_table<H: Home>(
    module: u32,
    out_table: *mut *const AtomicPtr<*mut c_void>,
    out_size: *mut c_uint,
) -> c_int {
    let Some((table, size)) = H::instance().module_table(module) else {
        return 0;
    };
    if !out_size.is_null() {
        // SAFETY: non-null, and the caller passes a writable `unsigned int`.
        unsafe { out_size.write(size) };
    }
    if !out_table.is_null() {
        // SAFETY: non-null, and the caller passes a writable table pointer.
        unsafe { out_table.write(table) };
    }
    1
}

/// The protocol lets a tool report its version here; nothing uses it.
extern "C" fn set_injection_nvtx_version(_version: u32) {}

impl Instance {
    const fn new<H: Home>() -> Instance {
        Instance {
            state: AtomicU8::new(FRESH),
            modules: [
                Module::new(MODULE_IDS[0]),
                Module::new(MODULE_IDS[1]),
                Module::new(MODULE_IDS[2]),
                Module::new(MODULE_IDS[3]),
                Module::new(MODULE_IDS[4]),
                Module::new(MODULE_IDS[5]),
            ],
            callbacks: CallbacksTable {
                struct_size: std::mem::size_of::<CallbacksTable>(),
                get_module_function_table: get_module_function_table::<H>,
            },
            version_info: VersionInfoTable {
                struct_size: std::mem::size_of::<VersionInfoTable>(),
                version: NVTX_VERSION,
                reserved0: 0,
                set_injection_nvtx_version,
            },
            get_export_table: get_export_table::<H>,
        }
    }

    fn export_table(&self, id: u32) -> *const c_void {
        match id {
            TABLE_CALLBACKS => (&self.callbacks as *const CallbacksTable).cast(),
            TABLE_VERSION_INFO => (&self.version_info as *const VersionInfoTable).cast(),
            _ => std::ptr::null(),
        }
    }

    /// Module `module`'s table of slot addresses and its number of ids.
    fn module_table(&self, module: u32) -> Option<(*const AtomicPtr<*mut c_void>, c_uint)> {
        let m = self.modules.get((module as usize).checked_sub(1)?)?;
        for i in 1..m.ids as usize {
            m.refs[i].store(m.slots[i].as_ptr(), Ordering::Relaxed);
        }
        Some((m.refs.as_ptr(), m.ids))
    }

    /// Whether a tool is attached; the first call decides (from the environment).
    #[inline]
    fn ready(&self) -> bool {
        match self.state.load(Ordering::Acquire) {
            ON => true,
            OFF => false,
            _ => self.init_slow(),
        }
    }

    #[cold]
    fn init_slow(&self) -> bool {
        self.init_once(|inst| inst.attach_from(std::env::var_os(INJECTION_VAR).as_deref()))
    }

    /// Runs `attach` if this is the first initialisation, else waits for the one running;
    /// returns whether a tool is attached.
    fn init_once(&self, attach: impl FnOnce(&Self) -> bool) -> bool {
        if self
            .state
            .compare_exchange(FRESH, STARTED, Ordering::Acquire, Ordering::Acquire)
            .is_ok()
        {
            let on = attach(self);
            if !on {
                self.clear_slots();
            }
            // Release: the slots the tool wrote are visible to whoever reads ON.
            self.state
                .store(if on { ON } else { OFF }, Ordering::Release);
            return on;
        }
        loop {
            match self.state.load(Ordering::Acquire) {
                ON => return true,
                OFF => return false,
                _ => std::thread::yield_now(),
            }
        }
    }

    /// Loads the injection library at `path` (none: NVTX stays off) and attaches it.
    fn attach_from(&self, path: Option<&OsStr>) -> bool {
        let Some(path) = path.filter(|p| !p.is_empty()) else {
            return false;
        };
        match self.load(path) {
            Ok(()) => true,
            Err(why) => {
                eprintln!("warning: NVTX is off: {why}");
                false
            }
        }
    }

    fn load(&self, path: &OsStr) -> Result<(), String> {
        let shown = std::path::Path::new(path).display();
        // SAFETY: loading runs the library's initialisers. The library is the injection
        // library a profiler named in NVTX_INJECTION64_PATH for exactly this use.
        let lib = unsafe { libloading::Library::new(path) }
            .map_err(|e| format!("cannot load the tool {INJECTION_VAR} names: {e}"))?;
        // SAFETY: the protocol fixes this symbol's C signature: it takes the program's
        // GetExportTable function and returns an int.
        let init: InitInjectionFn = unsafe { lib.get::<InitInjectionFn>(INIT_SYMBOL) }
            .map(|f| *f)
            .map_err(|e| format!("{shown} has no InitializeInjectionNvtx2: {e}"))?;
        if !self.attach(init) {
            return Err(format!(
                "{shown}: InitializeInjectionNvtx2 refused to attach"
            ));
        }
        // The tool's functions now live in our slots: the library stays loaded for the
        // rest of the process.
        std::mem::forget(lib);
        Ok(())
    }

    /// Hands this instance's export tables to a tool's entry point.
    fn attach(&self, init: InitInjectionFn) -> bool {
        // SAFETY: `init` is an `InitializeInjectionNvtx2`; it receives a function that
        // serves this instance's tables, which live as long as the program ('static).
        unsafe { init(self.get_export_table) != 0 }
    }

    /// Forgets what a tool that did not attach may have written.
    fn clear_slots(&self) {
        for m in &self.modules {
            for s in &m.slots {
                s.store(std::ptr::null_mut(), Ordering::Relaxed);
            }
        }
    }

    /// The tool's function in slot `id` of `module`, if attached and filled.
    #[inline]
    fn slot(&self, module: u32, id: usize) -> Option<*mut c_void> {
        if !self.ready() {
            return None;
        }
        let p = self.modules[module as usize - 1].slots[id].load(Ordering::Relaxed);
        (!p.is_null()).then_some(p)
    }

    fn range_push(&self, name: &str) -> bool {
        let Some(f) = self.slot(MODULE_CORE, CORE_RANGE_PUSH_A) else {
            return false;
        };
        let name = c_string(name);
        // SAFETY: the tool put a RangePushA (`int(const char*)`) in this slot; `name` is
        // a NUL-terminated string alive for the call (tools copy it).
        unsafe { std::mem::transmute::<*mut c_void, RangePushAFn>(f)(name.as_ptr()) };
        true
    }

    fn range_pop(&self) {
        if let Some(f) = self.slot(MODULE_CORE, CORE_RANGE_POP) {
            // SAFETY: the tool put a RangePop (`int(void)`) in this slot.
            unsafe { std::mem::transmute::<*mut c_void, RangePopFn>(f)() };
        }
    }

    fn mark(&self, name: &str) {
        if let Some(f) = self.slot(MODULE_CORE, CORE_MARK_A) {
            let name = c_string(name);
            // SAFETY: the tool put a MarkA (`void(const char*)`) in this slot; `name` is
            // NUL-terminated and alive for the call.
            unsafe { std::mem::transmute::<*mut c_void, MarkAFn>(f)(name.as_ptr()) };
        }
    }

    fn name_os_thread(&self, name: &str) {
        if let Some(f) = self.slot(MODULE_CORE, CORE_NAME_OS_THREAD_A) {
            let name = c_string(name);
            // SAFETY: the tool put a NameOsThreadA (`void(uint32_t, const char*)`) in
            // this slot; `name` is NUL-terminated and alive for the call.
            unsafe {
                std::mem::transmute::<*mut c_void, NameOsThreadAFn>(f)(
                    os_thread_id(),
                    name.as_ptr(),
                )
            };
        }
    }

    fn name_stream(&self, stream: CUstream, name: &str) {
        if let Some(f) = self.slot(MODULE_CUDA, CUDA_NAME_CU_STREAM_A) {
            let name = c_string(name);
            // SAFETY: the tool put a NameCuStreamA (`void(CUstream, const char*)`) in
            // this slot; the tool only records the handle; `name` is NUL-terminated and
            // alive for the call.
            unsafe {
                std::mem::transmute::<*mut c_void, NameCuStreamAFn>(f)(stream, name.as_ptr())
            };
        }
    }

    fn range(&'static self, name: &str) -> Range {
        Range {
            owner: self.range_push(name).then_some(self),
            _same_thread: PhantomData,
        }
    }
}

/// `s` as a C string; an interior NUL (never in our names) becomes a space.
fn c_string(s: &str) -> CString {
    CString::new(s)
        .or_else(|_| CString::new(s.replace('\0', " ")))
        .unwrap_or_default()
}

/// The calling thread's id as the OS knows it (what profilers show), 0 where unknown.
fn os_thread_id() -> u32 {
    #[cfg(all(
        target_os = "linux",
        any(target_arch = "x86_64", target_arch = "aarch64")
    ))]
    {
        extern "C" {
            fn syscall(number: std::ffi::c_long, ...) -> std::ffi::c_long;
        }
        #[cfg(target_arch = "x86_64")]
        const SYS_GETTID: std::ffi::c_long = 186;
        #[cfg(target_arch = "aarch64")]
        const SYS_GETTID: std::ffi::c_long = 178;
        // SAFETY: gettid takes no arguments, cannot fail and touches no memory.
        let tid = unsafe { syscall(SYS_GETTID) };
        u32::try_from(tid).unwrap_or(0)
    }
    #[cfg(not(all(
        target_os = "linux",
        any(target_arch = "x86_64", target_arch = "aarch64")
    )))]
    {
        0
    }
}

/// Whether a tool is attached (decided on the first NVTX call of the process). Lets a
/// caller skip building names nobody will see.
pub fn enabled() -> bool {
    GLOBAL.ready()
}

/// Opens a range named `name` on the calling thread's stack; [`range_pop`] closes it.
pub fn range_push(name: &str) {
    GLOBAL.range_push(name);
}

/// Closes the calling thread's innermost range.
pub fn range_pop() {
    GLOBAL.range_pop();
}

/// Opens a range named `name` on the calling thread until the guard drops.
pub fn range(name: &str) -> Range {
    GLOBAL.range(name)
}

/// A point in time named `name`.
pub fn mark(name: &str) {
    GLOBAL.mark(name);
}

/// Names the calling OS thread in the profiler's timeline.
pub fn name_os_thread(name: &str) {
    GLOBAL.name_os_thread(name);
}

/// Names a CUDA stream in the profiler's timeline.
pub fn name_stream(stream: CUstream, name: &str) {
    GLOBAL.name_stream(stream, name);
}

/// An open range; dropping it closes the range. Stays on the thread that opened it.
#[must_use = "the range closes when this guard drops"]
pub struct Range {
    /// The instance that opened the range (None: nothing was opened).
    owner: Option<&'static Instance>,
    _same_thread: PhantomData<*const ()>,
}

impl Drop for Range {
    fn drop(&mut self) {
        if let Some(inst) = self.owner {
            inst.range_pop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Mutex;

    /// An entry of a module's function table as a C tool sees it: a slot's address.
    type SlotRef = *mut *mut c_void;

    /// What the fake tool received, in order.
    static GOT: Mutex<Vec<String>> = Mutex::new(Vec::new());

    fn got(s: String) {
        GOT.lock().unwrap_or_else(|e| e.into_inner()).push(s);
    }

    /// # Safety
    /// `p` is a NUL-terminated string.
    unsafe fn text(p: *const c_char) -> String {
        // SAFETY: as the caller promises.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    unsafe extern "C" fn fake_push(name: *const c_char) -> c_int {
        // SAFETY: the loader passes a C string.
        got(format!("push {}", unsafe { text(name) }));
        0
    }
    unsafe extern "C" fn fake_pop() -> c_int {
        got("pop".into());
        0
    }
    unsafe extern "C" fn fake_mark(name: *const c_char) {
        // SAFETY: the loader passes a C string.
        got(format!("mark {}", unsafe { text(name) }));
    }
    unsafe extern "C" fn fake_name_thread(tid: u32, name: *const c_char) {
        // SAFETY: the loader passes a C string.
        got(format!("thread {tid} {}", unsafe { text(name) }));
    }
    unsafe extern "C" fn fake_name_stream(stream: CUstream, name: *const c_char) {
        // SAFETY: the loader passes a C string.
        got(format!("stream {:#x} {}", stream as usize, unsafe {
            text(name)
        }));
    }

    /// Asks `get` for `module`'s table as a tool does; checks its shape.
    ///
    /// # Safety
    /// `get` is a loader's GetExportTable.
    unsafe fn function_table(get: GetExportTableFn, module: u32) -> (*const SlotRef, u32) {
        // SAFETY: a loader's GetExportTable accepts any id.
        let cb = unsafe { get(TABLE_CALLBACKS) }.cast::<CallbacksTable>();
        assert!(!cb.is_null());
        // SAFETY: non-null table 1 is a CallbacksTable, alive for the program.
        let cb = unsafe { &*cb };
        assert_eq!(cb.struct_size, 2 * std::mem::size_of::<usize>());
        let mut table: *const AtomicPtr<*mut c_void> = std::ptr::null();
        let mut size: c_uint = 0;
        // SAFETY: both out-pointers are valid for writes.
        let ok = unsafe { (cb.get_module_function_table)(module, &mut table, &mut size) };
        assert_eq!(ok, 1, "module {module}");
        let table = table.cast::<SlotRef>();
        // SAFETY: the table holds `size + 1` entries.
        unsafe {
            assert!((*table).is_null(), "entry 0 is unused");
            assert!(
                (*table.add(size as usize)).is_null(),
                "the table ends with null"
            );
            for i in 1..size as usize {
                assert!(!(*table.add(i)).is_null(), "entry {i} of module {module}");
            }
        }
        (table, size)
    }

    /// Plays an injection library: fills RangePushA, RangePop, MarkA, NameOsThreadA and
    /// NameCuStreamA with the fakes above.
    unsafe extern "C" fn fake_tool(get: GetExportTableFn) -> c_int {
        // SAFETY: `get` is the loader's GetExportTable, as the protocol promises.
        unsafe {
            let (core, size) = function_table(get, MODULE_CORE);
            assert_eq!(size, 16);
            *(*core.add(CORE_RANGE_PUSH_A)) = fake_push as *mut c_void;
            *(*core.add(CORE_RANGE_POP)) = fake_pop as *mut c_void;
            *(*core.add(CORE_MARK_A)) = fake_mark as *mut c_void;
            *(*core.add(CORE_NAME_OS_THREAD_A)) = fake_name_thread as *mut c_void;
            let (cuda, size) = function_table(get, MODULE_CUDA);
            assert_eq!(size, 9);
            *(*cuda.add(CUDA_NAME_CU_STREAM_A)) = fake_name_stream as *mut c_void;
            for module in 3..=6 {
                function_table(get, module);
            }
            let v = get(TABLE_VERSION_INFO).cast::<VersionInfoTable>();
            assert!(!v.is_null());
            assert_eq!((*v).struct_size, 24);
            assert_eq!((*v).version, 3);
            ((*v).set_injection_nvtx_version)(3);
            assert!(get(2).is_null() && get(0).is_null() && get(4).is_null());
        }
        1
    }

    /// The only test that touches the program's instance: it attaches the fake tool
    /// there, then calls the public functions.
    #[test]
    fn a_tool_receives_ranges_marks_and_names_in_order() {
        assert!(
            GLOBAL.init_once(|inst| inst.attach(fake_tool)),
            "the NVTX instance was initialised before the fake tool attached"
        );
        assert!(enabled());
        range_push("step 0");
        {
            let _r = range("fwd:cross");
            mark("half way");
        }
        range_pop();
        name_os_thread("erase-main");
        name_stream(0x1234 as CUstream, "side1");
        let tid = os_thread_id();
        let got = GOT.lock().unwrap_or_else(|e| e.into_inner()).clone();
        assert_eq!(
            got,
            [
                "push step 0".to_string(),
                "push fwd:cross".into(),
                "mark half way".into(),
                "pop".into(),
                "pop".into(),
                format!("thread {tid} erase-main"),
                "stream 0x1234 side1".into(),
            ]
        );
        #[cfg(all(
            target_os = "linux",
            any(target_arch = "x86_64", target_arch = "aarch64")
        ))]
        assert_ne!(tid, 0, "the OS thread id");
    }

    #[test]
    fn without_a_tool_every_call_does_nothing() {
        struct Home0;
        impl Home for Home0 {
            fn instance() -> &'static Instance {
                &NONE
            }
        }
        static NONE: Instance = Instance::new::<Home0>();
        assert!(!NONE.init_once(|inst| inst.attach_from(None)));
        assert!(!NONE.ready());
        assert!(!NONE.range_push("x"));
        NONE.range_pop();
        NONE.mark("x");
        NONE.name_os_thread("x");
        NONE.name_stream(std::ptr::null_mut(), "x");
        let r = NONE.range("x");
        assert!(r.owner.is_none());
        drop(r);
        assert_eq!(NONE.state.load(Ordering::Relaxed), OFF);
    }

    #[test]
    fn a_library_that_does_not_load_leaves_nvtx_off() {
        struct Home1;
        impl Home for Home1 {
            fn instance() -> &'static Instance {
                &BAD
            }
        }
        static BAD: Instance = Instance::new::<Home1>();
        let path = OsStr::new("/nonexistent/libNoSuchNvtxTool.so");
        assert!(!BAD.init_once(|inst| inst.attach_from(Some(path))));
        assert!(!BAD.ready());
        assert!(!BAD.range_push("x"));
    }

    #[test]
    fn a_tool_that_refuses_leaves_nvtx_off_and_its_slots_cleared() {
        struct Home2;
        impl Home for Home2 {
            fn instance() -> &'static Instance {
                &REFUSED
            }
        }
        static REFUSED: Instance = Instance::new::<Home2>();
        unsafe extern "C" fn refuse(get: GetExportTableFn) -> c_int {
            // SAFETY: `get` is the loader's GetExportTable.
            unsafe {
                let (core, _) = function_table(get, MODULE_CORE);
                *(*core.add(CORE_RANGE_PUSH_A)) = fake_push as *mut c_void;
            }
            0
        }
        assert!(!REFUSED.init_once(|inst| inst.attach(refuse)));
        assert!(REFUSED.modules[0].slots[CORE_RANGE_PUSH_A]
            .load(Ordering::Relaxed)
            .is_null());
        assert!(!REFUSED.range_push("x"));
    }

    #[test]
    fn racing_first_calls_initialise_once() {
        struct Home3;
        impl Home for Home3 {
            fn instance() -> &'static Instance {
                &RACE
            }
        }
        static RACE: Instance = Instance::new::<Home3>();
        static CALLS: AtomicUsize = AtomicUsize::new(0);
        unsafe extern "C" fn slow_tool(_get: GetExportTableFn) -> c_int {
            CALLS.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(std::time::Duration::from_millis(50));
            1
        }
        let on: Vec<bool> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..8)
                .map(|_| s.spawn(|| RACE.init_once(|inst| inst.attach(slow_tool))))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap_or(false)).collect()
        });
        assert_eq!(on, vec![true; 8]);
        assert_eq!(CALLS.load(Ordering::SeqCst), 1);
        // attached, but the tool filled no slot: calls still do nothing
        assert!(!RACE.range_push("x"));
    }
}
