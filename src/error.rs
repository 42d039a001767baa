//! Errors shared by every layer.
//!
//! The layers return [`BoxError`] in the tower way; callers find out what happened with
//! `err.is::<MissingJob>()` or `err.downcast_ref::<MissingJob>()`.

use std::fmt;

/// The boxed error every layer returns.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The request carried no [`Job`](crate::Job), so no layer can tell who it is for.
///
/// Put one in the request's extensions before it reaches the layers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MissingJob;

impl fmt::Display for MissingJob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("request carries no fairgate job")
    }
}

impl std::error::Error for MissingJob {}

/// A layer's response future was polled again after it had completed.
///
/// Like any future, a layer's response future is polled until it completes, then dropped;
/// polled again, it answers this error instead of panicking.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PolledAfterCompletion;

impl fmt::Display for PolledAfterCompletion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("fairgate response future polled after completion")
    }
}

impl std::error::Error for PolledAfterCompletion {}

/// A configuration value was refused when it was built.
///
/// The message names the field and the rule it broke, e.g. `"throttle limit must be at least 1"`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    message: String,
}

impl ConfigError {
    pub(crate) fn new(message: impl Into<String>) -> Self {
        ConfigError {
            message: message.into(),
        }
    }

    /// What was wrong.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid fairgate configuration: {}", self.message)
    }
}

impl std::error::Error for ConfigError {}

/// The check each layer's future passes: it answers once. Polled again after its response,
/// or after refusing a request without a job, it answers [`PolledAfterCompletion`].
#[cfg(test)]
pub(crate) async fn answers_once<L, B: std::fmt::Debug>(layer: L)
where
    L: tower::Layer<
            tower::util::BoxCloneService<
                http::Request<String>,
                http::Response<String>,
                std::convert::Infallible,
            >,
        >,
    L::Service:
        tower::Service<http::Request<String>, Response = http::Response<B>, Error = BoxError>,
{
    use std::future::{Future, poll_fn};
    use std::pin::pin;
    use tower::{Service, ServiceExt};

    let inner =
        tower::util::BoxCloneService::new(tower::service_fn(|_req: http::Request<String>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
        }));
    let mut svc = layer.layer(inner);
    let mut req = http::Request::new(String::new());
    req.extensions_mut()
        .insert(crate::Job::new("t", crate::Origin::UserAction));
    let mut fut = pin!(svc.ready().await.unwrap().call(req));
    // Held while polled again: a slot or permit it carries stays taken meanwhile.
    let response = fut.as_mut().await.unwrap();
    assert_eq!(response.status(), 200);
    let again = poll_fn(|cx| fut.as_mut().poll(cx)).await.unwrap_err();
    assert!(again.is::<PolledAfterCompletion>(), "{again}");
    drop(response);

    let mut fut = pin!(
        svc.ready()
            .await
            .unwrap()
            .call(http::Request::new(String::new()))
    );
    assert!(fut.as_mut().await.unwrap_err().is::<MissingJob>());
    let again = poll_fn(|cx| fut.as_mut().poll(cx)).await.unwrap_err();
    assert!(again.is::<PolledAfterCompletion>(), "{again}");
}
