//! [`WorkLimits`]: how much keyed work one worker takes on, and the accounting behind it.
//!
//! A keyed request holds a slot from the moment its body has arrived until its handler
//! finished and its response was committed or released, whether or not its client is still
//! there. A request still sending its body holds none, so clients that stall their uploads
//! cannot keep a worker from taking keyed work.
//! Its slot counts as *detached* once the client is gone (Actix dropped the response) while
//! the work goes on. Beyond either cap new keyed requests are refused with 503 at once;
//! nothing already running is cancelled.

use std::cell::Cell;
use std::rc::Rc;

use crate::work_in_progress::InProgress;

/// The default cap on keyed requests one worker processes at once, per
/// [`Idempotency`](crate::Idempotency): 1024.
///
/// # Examples
///
/// ```
/// use idempotency_actix::DEFAULT_MAX_IN_FLIGHT;
///
/// assert_eq!(DEFAULT_MAX_IN_FLIGHT, 1024);
/// ```
pub const DEFAULT_MAX_IN_FLIGHT: usize = 1024;

/// The default cap on keyed requests one worker keeps running after their client went away,
/// per [`Idempotency`](crate::Idempotency): 256.
///
/// # Examples
///
/// ```
/// use idempotency_actix::{DEFAULT_MAX_DETACHED, DEFAULT_MAX_IN_FLIGHT};
///
/// assert_eq!(DEFAULT_MAX_DETACHED, 256);
/// assert!(DEFAULT_MAX_DETACHED < DEFAULT_MAX_IN_FLIGHT);
/// ```
pub const DEFAULT_MAX_DETACHED: usize = 256;

/// The caps of one worker's keyed work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WorkLimits {
    pub(crate) max_in_flight: usize,
    pub(crate) max_detached: usize,
}

impl Default for WorkLimits {
    fn default() -> Self {
        Self {
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            max_detached: DEFAULT_MAX_DETACHED,
        }
    }
}

/// The keyed work one worker is doing now, against its [`WorkLimits`].
#[derive(Debug)]
pub(crate) struct Workload {
    limits: WorkLimits,
    in_flight: Cell<usize>,
    detached: Cell<usize>,
}

impl Workload {
    pub(crate) fn new(limits: WorkLimits) -> Rc<Self> {
        Rc::new(Self {
            limits,
            in_flight: Cell::new(0),
            detached: Cell::new(0),
        })
    }

    /// A slot for one more keyed request, or `None` when a cap is reached.
    pub(crate) fn admit(self: &Rc<Self>) -> Option<Rc<WorkSlot>> {
        if self.in_flight.get() >= self.limits.max_in_flight
            || self.detached.get() >= self.limits.max_detached
        {
            return None;
        }
        self.in_flight.set(self.in_flight.get() + 1);
        Some(Rc::new(WorkSlot {
            workload: Rc::clone(self),
            detached: Cell::new(false),
            _in_progress: InProgress::start(),
        }))
    }
}

/// One keyed request's share of the workload; freed when the last holder drops it.
#[derive(Debug)]
pub(crate) struct WorkSlot {
    workload: Rc<Workload>,
    detached: Cell<bool>,
    /// Counted for the whole process too, for a graceful shutdown to wait for.
    _in_progress: InProgress,
}

impl WorkSlot {
    /// The client is gone while the work goes on.
    pub(crate) fn detach(&self) {
        if !self.detached.replace(true) {
            let detached = &self.workload.detached;
            detached.set(detached.get() + 1);
        }
    }
}

impl Drop for WorkSlot {
    fn drop(&mut self) {
        let workload = &self.workload;
        workload.in_flight.set(workload.in_flight.get() - 1);
        if self.detached.get() {
            workload.detached.set(workload.detached.get() - 1);
        }
    }
}

/// Held by whatever serves the client (the response future, then the response body): if it
/// is dropped before [`ClientAttached::finish`], the client went away and the work it leaves
/// behind counts as detached.
pub(crate) struct ClientAttached(Cell<Option<Rc<WorkSlot>>>);

impl ClientAttached {
    pub(crate) fn new(slot: Option<Rc<WorkSlot>>) -> Self {
        Self(Cell::new(slot))
    }

    /// The client's work took `slot` (once its request's body had arrived).
    pub(crate) fn attach(&self, slot: &Rc<WorkSlot>) {
        self.0.set(Some(Rc::clone(slot)));
    }

    /// The client got what it waited for.
    pub(crate) fn finish(self) {
        self.0.set(None);
    }
}

impl Drop for ClientAttached {
    fn drop(&mut self) {
        if let Some(slot) = self.0.take() {
            slot.detach();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workload(max_in_flight: usize, max_detached: usize) -> Rc<Workload> {
        Workload::new(WorkLimits {
            max_in_flight,
            max_detached,
        })
    }

    #[test]
    fn slots_are_refused_at_the_in_flight_cap_and_freed_on_drop() {
        let workload = workload(2, 2);
        let first = workload.admit().unwrap();
        let _second = workload.admit().unwrap();
        assert!(workload.admit().is_none());
        drop(first);
        assert!(workload.admit().is_some());
    }

    #[test]
    fn detached_slots_have_a_cap_of_their_own() {
        let workload = workload(10, 1);
        let slot = workload.admit().unwrap();
        ClientAttached::new(Some(Rc::clone(&slot))); // dropped unfinished: client gone
        assert!(workload.admit().is_none());
        drop(slot);
        let slot = workload.admit().unwrap();
        ClientAttached::new(Some(Rc::clone(&slot))).finish();
        assert!(workload.admit().is_some());
    }

    #[test]
    fn a_slot_attached_later_is_detached_when_its_client_goes() {
        let workload = workload(10, 1);
        let client = ClientAttached::new(None);
        let slot = workload.admit().unwrap();
        client.attach(&slot);
        drop(client);
        assert!(workload.admit().is_none());
    }
}
