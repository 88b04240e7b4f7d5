//! [`RouteLabel`]: the route pattern a protected request is recorded under (the
//! `http.route` field of its span, the `route` label of its metrics), and
//! [`LastRouteLabel`], which spares a layer Actix's search for it, and the search for the
//! route's metrics, when a request comes to the path it saw last.

use std::cell::RefCell;
use std::rc::Rc;

use actix_web::dev::ServiceRequest;

use crate::instrument::UNMATCHED_ROUTE;
#[cfg(feature = "metrics")]
use crate::metric_handles::{RouteHandles, route_handles};

/// The route pattern of one request.
pub(crate) enum RouteLabel {
    /// A pattern without dynamic segments, equal to the request's path, kept by the
    /// layer's [`LastRouteLabel`].
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
    pattern: Box<str>,
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

/// The pattern a layer last found that is its request's path itself (a route without
/// dynamic segments, such as `/orders`).
///
/// Actix finds a request's pattern by walking the app's resource map and builds it into a
/// new `String` (about 350 instructions with the allocation and its release), and the
/// route's metrics are then found by that pattern. A layer sees the same few paths over and
/// over. Actix's pattern for a path depends on nothing else where a layer can ask for it:
/// before routing (an app layer) and in a layer on a scope, it is found by the path alone;
/// in a layer on a resource, it is that resource's. Besides, a request whose path is the
/// pattern found last, and that matched no dynamic segment, can only have been routed to
/// that pattern: a path is matched by one static pattern only, itself, and a request routed
/// to a pattern with dynamic segments carries at least one (`ServiceRequest::match_info`).
#[derive(Default)]
pub(crate) struct LastRouteLabel(RefCell<Option<Rc<KeptRoute>>>);

impl LastRouteLabel {
    /// The route label of `req`.
    pub(crate) fn of(&self, req: &ServiceRequest) -> RouteLabel {
        if let Some(last) = self.0.borrow().as_ref()
            && *last.pattern == *req.path()
            && req.match_info().segment_count() == 0
        {
            return RouteLabel::Path(Rc::clone(last));
        }
        match req.match_pattern() {
            None => RouteLabel::Unmatched,
            Some(pattern) if pattern == req.path() && req.match_info().segment_count() == 0 => {
                let kept = Rc::new(KeptRoute {
                    pattern: pattern.into_boxed_str(),
                    #[cfg(feature = "metrics")]
                    handles: RefCell::new(None),
                });
                self.0.replace(Some(Rc::clone(&kept)));
                RouteLabel::Path(kept)
            }
            Some(pattern) => RouteLabel::Pattern(pattern),
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
