//! [`RouteLabel`]: the route pattern a protected request is recorded under (the
//! `http.route` field of its span, the `route` label of its metrics), and
//! [`RouteLabels`], which spares a layer Actix's search for it, and the search for the
//! route's metrics, when a request comes to a path the layer has seen.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use actix_web::dev::ServiceRequest;

use crate::instrument::UNMATCHED_ROUTE;
#[cfg(feature = "metrics")]
use crate::metric_handles::{RouteHandles, route_handles};

/// The route pattern of one request.
pub(crate) enum RouteLabel {
    /// A pattern equal to the request's path (in practice a route without dynamic segments,
    /// such as `/orders`), kept by the layer's [`RouteLabels`].
    Path(Rc<KeptRoute>),
    /// Any other pattern (`/orders/{id}`), found for this request.
    Pattern(String),
    /// No route pattern matches the request.
    Unmatched,
}

impl RouteLabel {
    /// The label's text: the pattern, or [`UNMATCHED_ROUTE`].
    pub(crate) fn as_str(&self) -> &str {
        match self {
            Self::Path(kept) => &kept.pattern,
            Self::Pattern(pattern) => pattern,
            Self::Unmatched => UNMATCHED_ROUTE,
        }
    }

    /// The route's request metrics, made by the recorder in place.
    #[cfg(feature = "metrics")]
    pub(crate) fn handles(&self) -> Rc<RouteHandles> {
        match self {
            Self::Path(kept) => kept.handles(),
            Self::Pattern(_) | Self::Unmatched => route_handles(self.as_str()),
        }
    }
}

/// A route pattern a layer keeps, and the route's metrics once a request has used them.
pub(crate) struct KeptRoute {
    pattern: String,
    #[cfg(feature = "metrics")]
    handles: RefCell<Option<Rc<RouteHandles>>>,
}

impl KeptRoute {
    #[cfg(feature = "metrics")]
    fn handles(&self) -> Rc<RouteHandles> {
        let mut kept = self.handles.borrow_mut();
        if let Some(handles) = kept.as_ref().filter(|handles| handles.are_current()) {
            return Rc::clone(handles);
        }
        let handles = route_handles(&self.pattern);
        *kept = Some(Rc::clone(&handles));
        handles
    }
}

/// How many patterns a layer keeps: a layer on a resource sees one path, an app layer that
/// claims requests before routing (`protect_methods`) the paths of all its routes.
const KEPT_ROUTES: usize = 8;

/// The patterns a layer found that were their requests' paths themselves (routes without
/// dynamic segments, such as `/orders`), up to [`KEPT_ROUTES`] of them.
///
/// Actix finds a request's pattern by walking the app's resource map and builds it into a
/// new `String` (about 350 instructions with the allocation and its release), and the
/// route's metrics are then found by that pattern; a layer sees the same few paths over
/// and over. Where a layer can ask for it, Actix's pattern depends on the path alone:
/// before routing (an app layer) and in a layer on a scope, it is the first pattern of the
/// app's resource map that matches the path (whichever resource the guards then pick); in
/// a layer on a resource, it is that resource's first pattern, whatever the path. So a
/// request whose path is a pattern a layer found for that path before gets that pattern
/// again.
#[derive(Default)]
pub(crate) struct RouteLabels {
    kept: RefCell<Vec<Rc<KeptRoute>>>,
    /// The kept pattern the next one found replaces once [`KEPT_ROUTES`] are kept.
    next_replaced: Cell<usize>,
}

impl RouteLabels {
    /// The route label of `req`.
    pub(crate) fn of(&self, req: &ServiceRequest) -> RouteLabel {
        let path = req.path();
        if let Some(kept) = self.kept.borrow().iter().find(|kept| kept.pattern == path) {
            return RouteLabel::Path(Rc::clone(kept));
        }
        match req.match_pattern() {
            None => RouteLabel::Unmatched,
            Some(pattern) if pattern == path => {
                let found = Rc::new(KeptRoute {
                    pattern,
                    #[cfg(feature = "metrics")]
                    handles: RefCell::new(None),
                });
                self.keep(Rc::clone(&found));
                RouteLabel::Path(found)
            }
            Some(pattern) => RouteLabel::Pattern(pattern),
        }
    }

    fn keep(&self, found: Rc<KeptRoute>) {
        let mut kept = self.kept.borrow_mut();
        if kept.len() < KEPT_ROUTES {
            kept.push(found);
        } else {
            let replaced = self.next_replaced.get();
            kept[replaced] = found;
            self.next_replaced.set((replaced + 1) % KEPT_ROUTES);
        }
    }
}

#[cfg(all(test, feature = "metrics"))]
mod tests {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

    use super::*;

    fn total(snapshotter: &Snapshotter) -> u64 {
        snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .map(|(_, _, _, value)| match value {
                DebugValue::Counter(value) => value,
                _ => 0,
            })
            .sum()
    }

    #[test]
    fn a_kept_route_counts_into_the_recorder_in_place() {
        let route = RouteLabel::Path(Rc::new(KeptRoute {
            pattern: "/kept".into(),
            handles: RefCell::new(None),
        }));
        let first = DebuggingRecorder::new();
        let first_snapshots = first.snapshotter();
        metrics::with_local_recorder(&first, || {
            route.handles().count_request("executed");
            route.handles().count_request("executed");
        });
        // The handles it kept are the first recorder's: another gets handles of its own.
        let second = DebuggingRecorder::new();
        let second_snapshots = second.snapshotter();
        metrics::with_local_recorder(&second, || {
            for _ in 0..5 {
                route.handles().count_request("executed");
            }
        });
        assert_eq!(total(&first_snapshots), 2);
        assert_eq!(total(&second_snapshots), 5);
    }
}
