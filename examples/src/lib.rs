//! Code shared by the examples: [`reference_app`], the reference server of DESIGN §11, which
//! the `reference_server` example runs as a process and the `demo` example runs in-process,
//! and [`StopSignals`], which the reference server and the load benchmark stop on.

pub mod reference_app;
mod stop_signals;

pub use stop_signals::StopSignals;
