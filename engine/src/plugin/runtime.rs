//! The process-wide WebAssembly runtime: one wasmtime engine (created on first use,
//! so that a process without plugins never starts it), the epoch ticker thread, the
//! linker with the host's imports, and the cache of compiled, pre-instantiated
//! components keyed by their SHA-256.
//!
//! Invariants: a component is compiled at most once per content hash while any loaded
//! policy set uses it; a [`Store`] never outlives one call.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, SystemTime};

use wasmtime::component::types::ComponentItem;
use wasmtime::component::{Component, HasSelf, Linker, ResourceType};
use wasmtime::{
    Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig, ResourceLimiter, Store,
    StoreLimits, StoreLimitsBuilder, Trap,
};

use super::bindings::exports::probity::plugin::evaluator;
use super::bindings::probity::plugin::host;
use super::bindings::probity::plugin::types::{self, EntitiesResult};
use super::bindings::{Plugin, PluginPre};
use super::entities::PluginEntities;

/// How often the ticker advances the engine's epoch; deadlines are whole ticks.
pub(crate) const TICK: Duration = Duration::from_millis(5);

/// WASI interfaces that Rust's standard library for wasm32-wasip2 links in (panic
/// output, process exit, environment at start-up, clocks, random seeds for HashMap).
/// They are linked as functions that trap: a plugin that reaches one at run time
/// fails with a trap naming the import, so it gets no filesystem, network,
/// environment, clock or randomness; importing them merely is allowed. Any other
/// import the host does not provide is a link error at load.
const STUBBED_WASI: &[&str] = &[
    "wasi:cli/",
    "wasi:io/",
    "wasi:clocks/",
    "wasi:random/",
    "wasi:filesystem/",
];

/// Plugin calls that can run at once (pool slots). A call beyond this fails as a
/// trap ("pooling allocator ... concurrency limit"), which denies.
const POOL_INSTANCES: u32 = 256;
/// Largest linear memory any plugin may have (the manifest's `memory_mib` limit).
const MAX_MEMORY_BYTES: usize = 1024 * 1024 * 1024;
/// Guard pages after each memory slot.
const GUARD_BYTES: u64 = 32 * 1024 * 1024;
/// Memory reset with memset rather than madvise between calls: cheaper for the small
/// heaps plugins use.
const KEEP_RESIDENT_BYTES: usize = 1024 * 1024;

/// Most log lines a plugin may write in one call; the rest are dropped.
const MAX_LOG_LINES: u32 = 16;
/// Longest log line kept, in bytes.
const MAX_LOG_BYTES: usize = 1024;

pub(crate) struct Runtime {
    engine: Engine,
    linker: Linker<CallState>,
    cache: Mutex<HashMap<[u8; 32], Weak<Compiled>>>,
}

/// A compiled component, pre-instantiated against the host's linker.
pub(crate) struct Compiled {
    pre: PluginPre<CallState>,
    /// The WASI imports linked as traps (reported by `probity check`).
    pub stubbed: Vec<String>,
}

/// Per-call state: limits, the clock reading and the entities the host may show.
pub(crate) struct CallState {
    limiter: Limiter,
    now_ms: u64,
    entities: Option<Arc<PluginEntities>>,
    plugin: Arc<str>,
    log_lines: u32,
}

/// StoreLimits, plus a note of whether the memory cap was hit so that the failure
/// can be named "memory limit" rather than the trap the guest's allocator raises.
struct Limiter {
    limits: StoreLimits,
    memory_cap: usize,
    hit: bool,
}

impl ResourceLimiter for Limiter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.memory_cap {
            self.hit = true;
            return Ok(false);
        }
        self.limits.memory_growing(current, desired, maximum)
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        self.limits.table_growing(current, desired, maximum)
    }

    fn instances(&self) -> usize {
        self.limits.instances()
    }

    fn tables(&self) -> usize {
        self.limits.tables()
    }

    fn memories(&self) -> usize {
        self.limits.memories()
    }
}

/// Why one call failed; the text after "plugin <name>: ".
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum CallFailure {
    Timeout {
        ms: u64,
    },
    /// The caller's deadline passed before the plugin's turn.
    DeadlinePassed,
    MemoryLimit {
        mib: u64,
    },
    Trap(String),
    InvalidOutput(String),
}

impl std::fmt::Display for CallFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallFailure::Timeout { ms } => write!(f, "timeout after {ms} ms"),
            CallFailure::DeadlinePassed => f.write_str("not called: the caller's deadline passed"),
            CallFailure::MemoryLimit { mib } => write!(f, "memory limit of {mib} MiB exceeded"),
            CallFailure::Trap(m) => write!(f, "trap: {m}"),
            CallFailure::InvalidOutput(m) => write!(f, "invalid output: {m}"),
        }
    }
}

/// Limits of one call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CallLimits {
    pub timeout_ms: u64,
    pub memory_mib: u64,
}

static RUNTIME: OnceLock<Result<Runtime, String>> = OnceLock::new();

/// The runtime, created on first use.
pub(crate) fn runtime() -> Result<&'static Runtime, String> {
    RUNTIME
        .get_or_init(|| Runtime::new().map_err(|e| format!("{e:#}")))
        .as_ref()
        .map_err(Clone::clone)
}

impl Runtime {
    fn new() -> wasmtime::Result<Self> {
        let mut config = Config::new();
        config.wasm_component_model(true);
        config.epoch_interruption(true);
        if std::env::var_os("PROBITY_WASM_PERFMAP").is_some() {
            config.profiler(wasmtime::ProfilingStrategy::PerfMap);
        }
        // A fresh instance per call: the pooling allocator keeps memory slots mapped and
        // resets them, instead of mapping and unmapping memory on every call.
        let mut pool = PoolingAllocationConfig::new();
        pool.total_component_instances(POOL_INSTANCES)
            .total_core_instances(POOL_INSTANCES * 4)
            .total_memories(POOL_INSTANCES)
            .total_tables(POOL_INSTANCES * 2)
            .max_memories_per_component(4)
            .max_tables_per_component(4)
            .max_core_instances_per_component(16)
            .max_memory_size(MAX_MEMORY_BYTES)
            .linear_memory_keep_resident(KEEP_RESIDENT_BYTES)
            .table_keep_resident(KEEP_RESIDENT_BYTES);
        config.allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
        config.memory_reservation(MAX_MEMORY_BYTES as u64);
        config.memory_guard_size(GUARD_BYTES);
        let engine = Engine::new(&config)?;
        let mut linker = Linker::new(&engine);
        Plugin::add_to_linker::<CallState, HasSelf<CallState>>(&mut linker, |s| s)?;
        let ticker = engine.clone();
        std::thread::Builder::new()
            .name("probity-epoch".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(TICK);
                    ticker.increment_epoch();
                }
            })?;
        Ok(Self {
            engine,
            linker,
            cache: Mutex::new(HashMap::new()),
        })
    }

    /// Compiles and pre-instantiates `bytes`, or returns the cached result for the same
    /// content. Errors are the load error's text: "not a WebAssembly component: ..." or
    /// "link error: ...".
    pub fn load(&self, hash: [u8; 32], bytes: &[u8]) -> Result<Arc<Compiled>, String> {
        if let Some(hit) = self
            .cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&hash)
            .and_then(Weak::upgrade)
        {
            return Ok(hit);
        }
        let compiled = Arc::new(self.compile(bytes)?);
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        cache.retain(|_, w| w.strong_count() > 0);
        cache.insert(hash, Arc::downgrade(&compiled));
        Ok(compiled)
    }

    /// Compiles without the cache (benchmarks measure this).
    pub fn compile(&self, bytes: &[u8]) -> Result<Compiled, String> {
        let component = Component::new(&self.engine, bytes).map_err(|e| {
            format!(
                "load error: not a WebAssembly component: {}",
                root_cause(&e)
            )
        })?;
        let mut linker = self.linker.clone();
        let stubbed = stub_wasi(&mut linker, &self.engine, &component)
            .map_err(|e| format!("link error: {e:#}"))?;
        let pre = linker
            .instantiate_pre(&component)
            .map_err(|e| format!("link error: {}", root_cause(&e)))?;
        let pre = PluginPre::new(pre).map_err(|e| format!("link error: {}", root_cause(&e)))?;
        Ok(Compiled { pre, stubbed })
    }
}

fn root_cause(e: &wasmtime::Error) -> String {
    crate::diagnostic::join_chain(e.to_string(), e.source())
}

/// Links every import of `component` that belongs to an allowed WASI interface as a
/// trap. Returns the interfaces so linked.
fn stub_wasi(
    linker: &mut Linker<CallState>,
    engine: &Engine,
    component: &Component,
) -> wasmtime::Result<Vec<String>> {
    let mut stubbed = Vec::new();
    for (name, item) in component.component_type().imports(engine) {
        if !STUBBED_WASI.iter().any(|p| name.starts_with(p)) {
            continue;
        }
        let ComponentItem::ComponentInstance(instance) = item.ty else {
            continue;
        };
        let mut inst = linker.instance(name)?;
        for (export, item) in instance.exports(engine) {
            match item.ty {
                ComponentItem::ComponentFunc(_) => {
                    let what = format!("{name}#{export}");
                    inst.func_new(export, move |_, _, _, _| {
                        Err(wasmtime::Error::msg(format!(
                            "the plugin called {what}, which Probity does not provide"
                        )))
                    })?;
                }
                ComponentItem::Resource(_) => {
                    inst.resource(export, ResourceType::host::<()>(), |_, _| Ok(()))?;
                }
                _ => {}
            }
        }
        stubbed.push(name.to_owned());
    }
    Ok(stubbed)
}

impl Compiled {
    fn store(
        &self,
        plugin: &Arc<str>,
        limits: CallLimits,
        entities: Option<Arc<PluginEntities>>,
    ) -> Store<CallState> {
        let memory_cap =
            usize::try_from(limits.memory_mib.saturating_mul(1024 * 1024)).unwrap_or(usize::MAX);
        let now_ms = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let mut store = Store::new(
            self.pre.engine(),
            CallState {
                limiter: Limiter {
                    limits: StoreLimitsBuilder::new()
                        .memory_size(memory_cap)
                        .instances(64)
                        .tables(64)
                        .memories(8)
                        .build(),
                    memory_cap,
                    hit: false,
                },
                now_ms,
                entities,
                plugin: Arc::clone(plugin),
                log_lines: 0,
            },
        );
        store.limiter(|s| &mut s.limiter);
        store.epoch_deadline_trap();
        store.set_epoch_deadline(deadline_ticks(limits.timeout_ms));
        store
    }

    /// `describe`, in a fresh store.
    pub fn describe(
        &self,
        plugin: &Arc<str>,
        limits: CallLimits,
    ) -> Result<evaluator::Description, CallFailure> {
        let mut store = self.store(plugin, limits, None);
        let result = self
            .pre
            .instantiate(&mut store)
            .and_then(|p| p.probity_plugin_evaluator().call_describe(&mut store));
        result.map_err(|e| classify(&e, &store, limits))
    }

    /// `evaluate`, in a fresh store.
    pub fn evaluate(
        &self,
        plugin: &Arc<str>,
        limits: CallLimits,
        request: evaluator::Request<'_>,
        entities: Arc<PluginEntities>,
    ) -> Result<evaluator::Verdict, CallFailure> {
        let mut store = self.store(plugin, limits, Some(entities));
        let result = self.pre.instantiate(&mut store).and_then(|p| {
            p.probity_plugin_evaluator()
                .call_evaluate(&mut store, request)
        });
        result.map_err(|e| classify(&e, &store, limits))
    }
}

/// Ticks for a deadline of `ms`: rounded up, plus one for the tick already under way.
fn deadline_ticks(ms: u64) -> u64 {
    let tick = u64::try_from(TICK.as_millis()).unwrap_or(1).max(1);
    ms.div_ceil(tick) + 1
}

fn classify(e: &wasmtime::Error, store: &Store<CallState>, limits: CallLimits) -> CallFailure {
    if store.data().limiter.hit {
        return CallFailure::MemoryLimit {
            mib: limits.memory_mib,
        };
    }
    match e.downcast_ref::<Trap>() {
        Some(Trap::Interrupt) => CallFailure::Timeout {
            ms: limits.timeout_ms,
        },
        Some(trap) => CallFailure::Trap(trap.to_string()),
        // A host function's error (a trapping WASI stub): its own message, without the
        // wasm backtrace wrapped around it.
        None => CallFailure::Trap(e.root_cause().to_string()),
    }
}

impl types::Host for CallState {}

impl host::Host for CallState {
    fn log(&mut self, level: host::Level, message: String) {
        // Debug and info lines are dropped; warnings and errors go to stderr until the
        // engine has a log facade of its own.
        if self.log_lines >= MAX_LOG_LINES
            || matches!(level, host::Level::Debug | host::Level::Info)
        {
            return;
        }
        self.log_lines += 1;
        let mut end = message.len().min(MAX_LOG_BYTES);
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        let level = if matches!(level, host::Level::Error) {
            "error"
        } else {
            "warn"
        };
        eprintln!(
            "probity plugin {}: {level}: {}",
            self.plugin,
            message.get(..end).unwrap_or("")
        );
    }

    fn now(&mut self) -> u64 {
        self.now_ms
    }

    fn entities_of_type(&mut self, type_name: String) -> wasmtime::Result<EntitiesResult> {
        match &self.entities {
            Some(entities) => match entities.of_type(&type_name).as_ref() {
                Ok(batch) => Ok(batch.result()),
                Err(count) => Err(wasmtime::Error::msg(format!(
                    "entities-of-type({type_name}) would return {count} entities, over the bound of {}",
                    super::entities::MAX_ENTITIES_OF_TYPE
                ))),
            },
            None => Ok(EntitiesResult {
                text: String::new(),
                uids: Vec::new(),
                attrs: Vec::new(),
                parents: Vec::new(),
            }),
        }
    }
}
