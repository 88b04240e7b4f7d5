//! [`LibraryProbe`] for a cluster's connection: every primary is asked.
//!
//! A key may live on any primary, and a cluster's connection sends a command without a key
//! to one node at random. A primary added to the cluster (or restarted) without the
//! functions would then pass a probe that happened to reach another node, and for a user who
//! may not load them, the keys that primary holds would run their handlers with nothing to
//! fence their commits or renew their leases: each ran again for a retry after its lease.

use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};

use super::protocol::{self, Library, LibraryProbe, LibraryProbeStep};

/// Asks each primary the cluster names (`CLUSTER NODES`) in turn, until one lacks the
/// functions or may not call them; where the cluster does not say (`CLUSTER NODES` refused
/// to the connection's user), one node, as a single server is asked. A primary that does
/// not answer counts as callable: the probe cannot tell, and the steps find out.
///
/// Each primary is reached as the primary of the first slot it serves, through the
/// connection's own map of the slots, not by the address `CLUSTER NODES` gives: that is
/// always an IP, while the connection knows the nodes by the endpoints `CLUSTER SLOTS`
/// announces, hostnames on a cluster set to (`cluster-preferred-endpoint-type hostname`).
/// Asked by IP there, no primary answered, every one counted as callable, and a user who
/// may not load the functions ran handlers with nothing to fence their commits or renew
/// their leases (each ran again for a retry after its lease; cluster review).
impl LibraryProbe for ClusterConnection {
    async fn probe_library(&mut self) -> Library {
        let nodes: redis::RedisResult<String> =
            redis::cmd("CLUSTER").arg("NODES").query_async(self).await;
        let Ok(nodes) = nodes else {
            return protocol::probe_library(self).await;
        };
        for slot in first_slots_of_primaries(&nodes) {
            let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(Route::new(
                slot,
                SlotAddr::Master,
            )));
            for step in [LibraryProbeStep::ReadOnly, LibraryProbeStep::Call] {
                // An error the node answered comes back as a value: made an error again.
                let answer = self
                    .route_command(step.command(), routing.clone())
                    .await
                    .and_then(redis::Value::extract_error);
                if let Some(found) = step.decides(answer) {
                    return found;
                }
            }
        }
        Library::Callable
    }
}

/// The first slot each primary in `nodes` serves, a `CLUSTER NODES` reply (a line per node:
/// `<id> <ip:port@cport[,hostname]> <flags> <primary> <ping> <pong> <epoch> <link> <slots>…`):
/// of the nodes flagged `master` that serve slots, but those failing or without an address.
/// A primary with no slots holds no keys: one just added to the cluster, not yet given
/// slots, does not refuse every key of the others for want of the functions.
fn first_slots_of_primaries(nodes: &str) -> Vec<u16> {
    nodes
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (_id, _address, flags) = (fields.next()?, fields.next()?, fields.next()?);
            let mut flags = flags.split(',');
            let primary = flags.clone().any(|flag| flag == "master");
            let unusable =
                flags.any(|flag| matches!(flag, "fail" | "fail?" | "noaddr" | "handshake"));
            if !primary || unusable {
                return None;
            }
            // Slots or ranges (`0-5460`, `16000`); one being imported or migrated is
            // `[slot-<-id]` or `[slot->-id]`, and not yet (or no longer) the node's own.
            fields
                .skip(5)
                .find(|slots| slots.starts_with(|first: char| first.is_ascii_digit()))?
                .split('-')
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_primaries_are_the_masters_that_serve_slots_and_can_be_reached() {
        let nodes = "\
07c3 127.0.0.1:30001@40001 myself,master - 0 0 1 connected 0-5460
67ed 127.0.0.1:30002@40002 master - 0 1426238316232 2 connected 5461-10922
292f 127.0.0.1:30003@40003,node-3.example master - 0 1426238318243 3 connected 10923-16383
6ec2 127.0.0.1:30004@40004 slave 07c3 0 1426238316232 1 connected
824f 127.0.0.1:30005@40005 master,fail - 1426238316232 0 5 disconnected
e7d1 :0@0 master,noaddr - 1426238316232 0 6 disconnected
a1b2 ::1:30006@40006 master - 0 0 7 connected 16000
f00d 127.0.0.1:30007@40007 master - 0 0 8 connected
beef 127.0.0.1:30008@40008 master - 0 0 9 connected [93-<-292f]
cafe node-9.example:30009@40009 master - 0 0 10 connected [5-<-07c3] 12000-12010
";
        assert_eq!(
            first_slots_of_primaries(nodes),
            vec![0, 5461, 10923, 16000, 12000]
        );
    }
}
