//! Code shared by the examples: [`reference_app`], the reference server of DESIGN §11, which
//! the `reference_server` example runs as a process and the `demo` example runs in-process.

pub mod reference_app;
