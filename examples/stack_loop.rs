//! N requests, one after another, through `FairgateLayer` on the memory store: a steady
//! loop to count the instructions one request costs, free of the timing noise of a shared
//! machine. Run it twice under valgrind and take the difference:
//!
//! ```sh
//! cargo build --release --example stack_loop
//! for n in 2000 22000; do
//!   valgrind --tool=cachegrind --cache-sim=no --cachegrind-out-file=/dev/null \
//!     target/release/examples/stack_loop $n 2>&1 | grep 'I *refs'
//! done   # instructions per request = (second - first) / 20000
//! ```

use fairgate::{FairgateLayer, Job, Origin, Store};
use tower::{Layer, Service, ServiceExt, service_fn};

fn main() {
    let n: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(200_000);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let mut claude = FairgateLayer::new(Store::memory()).layer(service_fn(
            |_req: http::Request<String>| async {
                Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
            },
        ));
        for i in 0..n {
            let tenant = if i % 2 == 0 { "a" } else { "b" };
            let mut req = http::Request::new(String::new());
            req.extensions_mut()
                .insert(Job::new(tenant, Origin::UserAction).tier("pro").cost(100));
            let ready = claude.ready().await.expect("always ready");
            drop(ready.call(req).await.expect("served"));
        }
    });
}
