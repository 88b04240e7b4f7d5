//! [`MetricHandles`]: the handles of this crate's metrics, kept per thread, so recording a
//! metric on the request path is a map lookup and an atomic add.
//!
//! A `counter!`/`gauge!`/`histogram!` call registers its key with the recorder each time:
//! the Prometheus exporter copies the key (an allocation per label set) and looks it up in
//! its shared registry. The handle it returns stays valid, so it is kept here by its labels
//! and used again. Handles belong to the recorder that made them: the cache is emptied when
//! another recorder is in place (one installed later, or a thread-local one in tests).
//!
//! A handle is used where it is kept (no clone of it per request: a clone and its drop are
//! two atomic reference counts). A route's handles are kept together ([`RouteHandles`]),
//! and the route label a layer keeps for its path holds them (`route_label`), so a request
//! to that path reaches them with no lookup (checked, at each use, against the recorder in
//! place).

use std::cell::{OnceCell, RefCell};
use std::rc::Rc;

/// Route patterns are the app's own, few and not chosen by clients, so they are hashed
/// with foldhash (Actix's own choice for its maps), a fraction of the default SipHash.
use foldhash::HashMap;

use metrics::{Counter, Gauge, Histogram, Recorder};

thread_local! {
    static HANDLES: RefCell<MetricHandles> = RefCell::new(MetricHandles::default());
}

/// The handles made by one recorder, by their labels.
#[derive(Default)]
struct MetricHandles {
    /// The recorder's address: handles of another recorder are never used.
    recorder: usize,
    /// The request metrics of each route.
    routes: HashMap<String, Rc<RouteHandles>>,
    /// `idempotency_store_operation_duration_seconds` by operation and result.
    store_durations: LabelledHandles<(&'static str, &'static str), Histogram>,
    /// `idempotency_evictions_total` by source.
    evictions: LabelledHandles<&'static str, Counter>,
}

/// Handles by a few static labels: found by comparing labels, with no hashing (there are at
/// most a dozen, and one is looked up for every store operation).
struct LabelledHandles<K, H>(Vec<(K, H)>);

impl<K, H> Default for LabelledHandles<K, H> {
    fn default() -> Self {
        Self(Vec::new())
    }
}

impl<K: PartialEq, H> LabelledHandles<K, H> {
    /// The handle of `labels`, registered with `register` the first time.
    fn get_or_register(&mut self, labels: K, register: impl FnOnce() -> H) -> &H {
        let at = match self.0.iter().position(|(known, _)| *known == labels) {
            Some(at) => at,
            None => {
                self.0.push((labels, register()));
                self.0.len() - 1
            }
        };
        &self.0[at].1
    }
}

/// The address of the recorder in place for this thread now.
fn current_recorder() -> usize {
    metrics::with_recorder(|recorder: &dyn Recorder| {
        std::ptr::from_ref(recorder).cast::<()>() as usize
    })
}

/// Runs `f` on this thread's handles of the current recorder.
fn with_handles<T>(f: impl FnOnce(&mut MetricHandles) -> T) -> T {
    let recorder = current_recorder();
    HANDLES.with_borrow_mut(|handles| {
        if handles.recorder != recorder {
            *handles = MetricHandles {
                recorder,
                ..MetricHandles::default()
            };
        }
        f(handles)
    })
}

/// One route's request metrics, made by one recorder: `idempotency_requests_total` by
/// outcome and `idempotency_requests_in_flight`, each registered when first used.
///
/// A route label that a layer keeps ([`crate::route_label`]) keeps these with it, so that
/// a request to that route reaches them without a lookup by its pattern.
pub(crate) struct RouteHandles {
    route: Box<str>,
    /// The address of the recorder that made them.
    recorder: usize,
    requests: RefCell<LabelledHandles<&'static str, Counter>>,
    in_flight: OnceCell<Gauge>,
}

impl RouteHandles {
    /// Whether the recorder that made these handles is still the one in place.
    pub(crate) fn are_current(&self) -> bool {
        self.recorder == current_recorder()
    }

    /// Adds one to `idempotency_requests_total` of this route and `outcome`, through the
    /// handle in place (no clone of it, so no two atomic reference counts per request).
    pub(crate) fn count_request(&self, outcome: &'static str) {
        self.requests
            .borrow_mut()
            .get_or_register(outcome, || {
                metrics::counter!(
                    crate::instrument::names::REQUESTS,
                    "route" => self.route.to_string(),
                    "outcome" => outcome,
                )
            })
            .increment(1);
    }

    /// This route's `idempotency_requests_in_flight` gauge.
    pub(crate) fn in_flight(&self) -> &Gauge {
        self.in_flight.get_or_init(|| {
            metrics::gauge!(crate::instrument::names::IN_FLIGHT, "route" => self.route.to_string())
        })
    }
}

/// The request metrics of `route`, made by the recorder in place.
pub(crate) fn route_handles(route: &str) -> Rc<RouteHandles> {
    with_handles(|handles| {
        if let Some(found) = handles.routes.get(route) {
            return Rc::clone(found);
        }
        let made = Rc::new(RouteHandles {
            route: route.into(),
            recorder: handles.recorder,
            requests: RefCell::default(),
            in_flight: OnceCell::new(),
        });
        handles.routes.insert(route.to_owned(), Rc::clone(&made));
        made
    })
}

/// Records `seconds` in the `idempotency_store_operation_duration_seconds` histogram of
/// `operation` and `result`.
pub(crate) fn record_store_duration(operation: &'static str, result: &'static str, seconds: f64) {
    with_handles(|handles| {
        handles
            .store_durations
            .get_or_register((operation, result), || {
                metrics::histogram!(
                    crate::instrument::names::STORE_DURATION,
                    "operation" => operation,
                    "result" => result,
                )
            })
            .record(seconds);
    });
}

/// Adds `count` to the `idempotency_evictions_total` counter of `source`.
pub(crate) fn count_evictions(source: &'static str, count: u64) {
    with_handles(|handles| {
        handles
            .evictions
            .get_or_register(
                source,
                || metrics::counter!(crate::instrument::names::EVICTIONS, "source" => source),
            )
            .increment(count);
    });
}

#[cfg(test)]
mod tests {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    use super::*;

    #[test]
    fn handles_follow_the_recorder_in_place() {
        let first = DebuggingRecorder::new();
        let first_snapshots = first.snapshotter();
        metrics::with_local_recorder(&first, || {
            route_handles("/a").count_request("executed");
            route_handles("/a").count_request("executed");
        });
        // Another recorder gets handles of its own, not the first one's.
        let second = DebuggingRecorder::new();
        let second_snapshots = second.snapshotter();
        metrics::with_local_recorder(&second, || {
            for _ in 0..5 {
                route_handles("/a").count_request("executed");
            }
        });
        let total = |snapshot: metrics_util::debugging::Snapshot| {
            snapshot
                .into_vec()
                .into_iter()
                .map(|(_, _, _, value)| match value {
                    DebugValue::Counter(value) => value,
                    _ => 0,
                })
                .sum::<u64>()
        };
        assert_eq!(total(first_snapshots.snapshot()), 2);
        assert_eq!(total(second_snapshots.snapshot()), 5);
    }
}
