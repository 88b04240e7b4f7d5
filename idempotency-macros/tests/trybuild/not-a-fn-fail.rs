use idempotency_actix::idempotent;

#[idempotent]
struct Orders;

fn main() {
    let _ = Orders;
}
