//! N requests, one after another, through `FairgateLayer` on the memory store (or, with
//! `baseline`, through tower's `ConcurrencyLimit(32)` + `Retry` with an equivalent retry
//! policy): a steady loop to count the instructions one request costs, free of the timing
//! noise of a shared machine. Run each twice under valgrind and take the difference:
//!
//! ```sh
//! cargo build --release --example stack_loop
//! for mode in fairgate baseline; do for n in 2000 22000; do
//!   valgrind --tool=cachegrind --cache-sim=no --cachegrind-out-file=/dev/null \
//!     target/release/examples/stack_loop $n $mode 2>&1 | grep 'I *refs'
//! done; done   # instructions per request = (second - first) / 20000
//! ```

use std::time::Duration;

use fairgate::{FairgateLayer, Job, Origin, Store};
use tower::retry::{Policy, RetryLayer};
use tower::{Layer, Service, ServiceBuilder, ServiceExt, service_fn};

type Request = http::Request<String>;
type Response = http::Response<String>;

fn main() {
    let mut args = std::env::args().skip(1);
    let n: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(200_000);
    let baseline = args.next().is_some_and(|mode| mode == "baseline");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let upstream = service_fn(|_req: Request| async {
        Ok::<_, std::convert::Infallible>(Response::new(String::new()))
    });
    runtime.block_on(async {
        if baseline {
            let service = ServiceBuilder::new()
                .concurrency_limit(32)
                .layer(RetryLayer::new(Equivalent::default()))
                .service(upstream);
            run(service, n).await;
        } else {
            run(FairgateLayer::new(Store::memory()).layer(upstream), n).await;
        }
    });
}

async fn run<S, B>(mut service: S, n: u64)
where
    S: Service<Request, Response = http::Response<B>>,
    S::Error: std::fmt::Debug,
{
    for i in 0..n {
        let tenant = if i % 2 == 0 { "a" } else { "b" };
        let mut req = Request::new(String::new());
        req.extensions_mut().insert(
            Job::new(tenant, Origin::UserAction)
                .with_tier("pro")
                .with_cost(100),
        );
        let ready = service.ready().await.expect("always ready");
        drop(ready.call(req).await.expect("served"));
    }
}

/// Retries a 429 or 529 up to four times under a retry budget, as the retry layer does.
#[derive(Clone)]
struct Equivalent {
    budget: std::sync::Arc<tower::retry::budget::TpsBudget>,
    retries: u32,
}

impl Default for Equivalent {
    fn default() -> Self {
        let budget = tower::retry::budget::TpsBudget::new(Duration::from_secs(10), 10, 0.2);
        Equivalent {
            budget: std::sync::Arc::new(budget),
            retries: 0,
        }
    }
}

impl<E> Policy<Request, Response, E> for Equivalent {
    type Future = tokio::time::Sleep;

    fn retry(
        &mut self,
        _req: &mut Request,
        result: &mut Result<Response, E>,
    ) -> Option<Self::Future> {
        use tower::retry::budget::Budget;
        match result {
            Ok(res) if matches!(res.status().as_u16(), 429 | 529) => {
                if self.retries >= 4 || !self.budget.withdraw() {
                    return None;
                }
                self.retries += 1;
                Some(tokio::time::sleep(
                    Duration::from_millis(500) * self.retries,
                ))
            }
            _ => {
                self.budget.deposit();
                None
            }
        }
    }

    fn clone_request(&mut self, req: &Request) -> Option<Request> {
        Some(req.clone())
    }
}
