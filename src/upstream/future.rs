//! The response future of [`Bedrock`](super::Bedrock).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::{Buf, BytesMut};
use http_body::Body;
use pin_project_lite::pin_project;
use tower_service::Service;

use super::answer::{MessagesError, Operation, UpstreamBody, answer};
use super::request::{Config, MAX_REQUEST_BODY, prepare, too_large};
use crate::error::{BoxError, PolledAfterCompletion};

pin_project! {
    /// The response future of [`Bedrock`](super::Bedrock): reads the request body whole
    /// (Bedrock's body is a rewrite of it, and its hash is signed), then calls the inner
    /// service, ready since `poll_ready`, and answers in the Messages API's shape.
    ///
    /// # Cancel safety
    ///
    /// Dropped while it reads the body, it drops the body and the ready inner service (no
    /// call was sent); dropped while it waits for Bedrock, it drops the inner service's
    /// future, as that service does.
    pub struct ResponseFuture<S, B>
    where
        S: Service<http::Request<String>>,
    {
        #[pin]
        state: State<S, B>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, B>
    where
        S: Service<http::Request<String>>,
    {
        Reading {
            #[pin]
            body: B,
            parts: Option<http::request::Parts>,
            read: BytesMut,
            inner: Option<S>,
            config: Arc<Config>,
        },
        Calling { #[pin] call: S::Future, operation: Operation },
        Answered { error: Option<MessagesError> },
    }
}

impl<S, B> std::fmt::Debug for ResponseFuture<S, B>
where
    S: Service<http::Request<String>>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let phase = match &self.state {
            State::Reading { .. } => "reading the request",
            State::Calling { .. } => "calling Bedrock",
            State::Answered { .. } => "answered",
        };
        f.debug_struct("ResponseFuture")
            .field("phase", &phase)
            .finish()
    }
}

impl<S, B> ResponseFuture<S, B>
where
    S: Service<http::Request<String>>,
{
    pub(crate) fn new(req: http::Request<B>, ready: S, config: Arc<Config>) -> Self {
        let (parts, body) = req.into_parts();
        ResponseFuture {
            state: State::Reading {
                body,
                parts: Some(parts),
                read: BytesMut::new(),
                inner: Some(ready),
                config,
            },
        }
    }
}

impl<S, B, RB> Future for ResponseFuture<S, B>
where
    S: Service<http::Request<String>, Response = http::Response<RB>>,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
{
    type Output = Result<http::Response<UpstreamBody<RB>>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = self.project().state;
        loop {
            let next = match state.as_mut().project() {
                StateProj::Reading {
                    body,
                    parts,
                    read,
                    inner,
                    config,
                } => match ready!(poll_read(body, read, cx)) {
                    Err(e) => return Poll::Ready(Err(e)),
                    Ok(false) => State::Answered {
                        error: Some(too_large()),
                    },
                    Ok(true) => {
                        let (Some(parts), Some(mut inner)) = (parts.take(), inner.take()) else {
                            return Poll::Ready(Err(PolledAfterCompletion.into()));
                        };
                        match prepare(config, parts, std::mem::take(read).freeze()) {
                            Ok((request, operation)) => State::Calling {
                                call: inner.call(request),
                                operation,
                            },
                            Err(error) => State::Answered { error: Some(error) },
                        }
                    }
                },
                StateProj::Calling { call, operation } => {
                    let response = ready!(call.poll(cx)).map_err(Into::into)?;
                    return Poll::Ready(Ok(answer(response, *operation)));
                }
                StateProj::Answered { error } => {
                    return Poll::Ready(match error.take() {
                        Some(error) => Ok(error.response()),
                        None => Err(PolledAfterCompletion.into()),
                    });
                }
            };
            state.set(next);
        }
    }
}

/// Reads `body` to its end into `read`: `Ok(true)` when whole, `Ok(false)` when it is over
/// [`MAX_REQUEST_BODY`].
fn poll_read<B>(
    mut body: Pin<&mut B>,
    read: &mut BytesMut,
    cx: &mut Context<'_>,
) -> Poll<Result<bool, BoxError>>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    loop {
        match ready!(body.as_mut().poll_frame(cx)) {
            Some(Ok(frame)) => {
                if let Ok(mut data) = frame.into_data() {
                    if read.len() + data.remaining() > MAX_REQUEST_BODY {
                        return Poll::Ready(Ok(false));
                    }
                    while data.has_remaining() {
                        let chunk = data.chunk();
                        let n = chunk.len();
                        read.extend_from_slice(chunk);
                        data.advance(n);
                    }
                }
            }
            Some(Err(e)) => return Poll::Ready(Err(e.into())),
            None => return Poll::Ready(Ok(true)),
        }
    }
}

pin_project! {
    /// The response future of [`Anthropic`](super::Anthropic): the inner service's, its
    /// answer's body as an [`UpstreamBody`].
    ///
    /// # Cancel safety
    ///
    /// Dropping it drops the inner service's future, as that service does.
    pub struct AnthropicFuture<F> {
        #[pin]
        state: Passing<F>,
    }
}

pin_project! {
    #[project = PassingProj]
    enum Passing<F> {
        Calling { #[pin] call: F },
        Answered { error: Option<MessagesError> },
    }
}

impl<F> std::fmt::Debug for AnthropicFuture<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AnthropicFuture").finish_non_exhaustive()
    }
}

impl<F> AnthropicFuture<F> {
    pub(crate) fn calling(call: F) -> Self {
        AnthropicFuture {
            state: Passing::Calling { call },
        }
    }

    pub(crate) fn answered(error: MessagesError) -> Self {
        AnthropicFuture {
            state: Passing::Answered { error: Some(error) },
        }
    }
}

impl<F, RB, E> Future for AnthropicFuture<F>
where
    F: Future<Output = Result<http::Response<RB>, E>>,
    E: Into<BoxError>,
{
    type Output = Result<http::Response<UpstreamBody<RB>>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            PassingProj::Calling { call } => {
                let response = ready!(call.poll(cx)).map_err(Into::into)?;
                Poll::Ready(Ok(response.map(UpstreamBody::pass)))
            }
            PassingProj::Answered { error } => Poll::Ready(match error.take() {
                Some(error) => Ok(error.response()),
                None => Err(PolledAfterCompletion.into()),
            }),
        }
    }
}
