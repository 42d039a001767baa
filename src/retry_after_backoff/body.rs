//! The response body [`RetryAfterBackoff`](super::RetryAfterBackoff) returns.

use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Buf;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

pin_project! {
    /// The body of a response from [`RetryAfterBackoff`](super::RetryAfterBackoff): the
    /// upstream's body, untouched, or — for a 429 whose body the layer read to look for the
    /// spend-limit error code — the same bytes replayed from a buffer, then the rest.
    ///
    /// Every byte the upstream sent reaches the caller, in order; a body error is replayed
    /// where it happened.
    pub struct ResponseBody<B>
    where
        B: Body,
    {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B>
    where
        B: Body,
    {
        Passthrough {
            #[pin]
            inner: B,
        },
        Replay {
            replay: Peeked<B>,
        },
    }
}

/// A body read ahead: the frames read, then the error or end that stopped the reading, then
/// the rest of the body.
pub(super) struct Peeked<B: Body> {
    frames: VecDeque<Frame<B::Data>>,
    /// Copies of the data frames' bytes, up to the limit.
    bytes: Vec<u8>,
    error: Option<B::Error>,
    /// `None` once it ended.
    rest: Option<Pin<Box<B>>>,
}

impl<B: Body> Peeked<B> {
    pub(super) fn new(body: B) -> Self {
        Peeked {
            frames: VecDeque::new(),
            bytes: Vec::new(),
            error: None,
            rest: Some(Box::pin(body)),
        }
    }

    /// Reads frames until `limit` bytes are buffered, the body ends or fails.
    pub(super) fn poll_fill(&mut self, cx: &mut Context<'_>, limit: usize) -> Poll<()> {
        while self.bytes.len() < limit && self.error.is_none() {
            let Some(rest) = self.rest.as_mut() else {
                break;
            };
            if rest.is_end_stream() {
                self.rest = None;
                break;
            }
            match ready!(rest.as_mut().poll_frame(cx)) {
                Some(Ok(frame)) => {
                    if let Some(data) = frame.data_ref() {
                        copy_into(data, &mut self.bytes, limit);
                    }
                    self.frames.push_back(frame);
                }
                Some(Err(e)) => {
                    self.error = Some(e);
                    self.rest = None;
                }
                None => self.rest = None,
            }
        }
        Poll::Ready(())
    }

    /// The bytes read so far (at most the limit).
    pub(super) fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

/// Appends `data`'s bytes to `out`, up to `limit` bytes in all.
fn copy_into(data: &impl Buf, out: &mut Vec<u8>, limit: usize) {
    let mut slices = [std::io::IoSlice::new(&[]); 16];
    let n = data.chunks_vectored(&mut slices);
    for slice in &slices[..n] {
        let room = limit.saturating_sub(out.len());
        out.extend_from_slice(&slice[..slice.len().min(room)]);
    }
}

impl<B: Body> ResponseBody<B> {
    pub(super) fn passthrough(inner: B) -> Self {
        ResponseBody {
            kind: Kind::Passthrough { inner },
        }
    }

    pub(super) fn replay(replay: Peeked<B>) -> Self {
        ResponseBody {
            kind: Kind::Replay { replay },
        }
    }

    /// Whether the layer read part of this body ahead (a 429 checked for the spend limit).
    pub fn was_peeked(&self) -> bool {
        matches!(self.kind, Kind::Replay { .. })
    }
}

impl<B: Body> Body for ResponseBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        match self.project().kind.project() {
            KindProj::Passthrough { inner } => inner.poll_frame(cx),
            KindProj::Replay { replay } => {
                if let Some(frame) = replay.frames.pop_front() {
                    return Poll::Ready(Some(Ok(frame)));
                }
                if let Some(e) = replay.error.take() {
                    return Poll::Ready(Some(Err(e)));
                }
                match replay.rest.as_mut() {
                    Some(rest) => {
                        let frame = ready!(rest.as_mut().poll_frame(cx));
                        if frame.is_none() {
                            replay.rest = None;
                        }
                        Poll::Ready(frame)
                    }
                    None => Poll::Ready(None),
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Passthrough { inner } => inner.is_end_stream(),
            Kind::Replay { replay } => {
                replay.frames.is_empty()
                    && replay.error.is_none()
                    && replay.rest.as_ref().is_none_or(|rest| rest.is_end_stream())
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Passthrough { inner } => inner.size_hint(),
            Kind::Replay { .. } => SizeHint::default(),
        }
    }
}

impl<B: Body> fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            Kind::Passthrough { .. } => "passthrough",
            Kind::Replay { .. } => "replay",
        };
        f.debug_struct("ResponseBody").field("kind", &kind).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    /// A body that yields prepared frames (and maybe an error), one per poll.
    struct Frames(VecDeque<Result<Frame<Bytes>, &'static str>>);

    impl Body for Frames {
        type Data = Bytes;
        type Error = &'static str;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, &'static str>>> {
            Poll::Ready(self.0.pop_front())
        }
    }

    fn frames(items: &[Result<&'static str, &'static str>]) -> Frames {
        Frames(
            items
                .iter()
                .map(|item| item.map(|data| Frame::data(Bytes::from_static(data.as_bytes()))))
                .collect(),
        )
    }

    /// Everything the body yields: data as text, errors as `!error`.
    async fn drain<B: Body<Data = Bytes, Error = &'static str>>(body: B) -> Vec<String> {
        let mut body = std::pin::pin!(body);
        let mut out = Vec::new();
        while let Some(frame) = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
            match frame {
                Ok(frame) => out.push(String::from_utf8_lossy(&frame.into_data().unwrap()).into()),
                Err(e) => out.push(format!("!{e}")),
            }
        }
        out
    }

    async fn peek(body: Frames, limit: usize) -> Peeked<Frames> {
        let mut peeked = Peeked::new(body);
        std::future::poll_fn(|cx| peeked.poll_fill(cx, limit)).await;
        peeked
    }

    #[tokio::test]
    async fn a_peeked_body_replays_every_byte_then_the_rest() {
        let body = frames(&[Ok("0123456789"), Ok("abcdefghij"), Ok("tail")]);
        let peeked = peek(body, 15).await;
        assert_eq!(
            peeked.bytes(),
            b"0123456789abcde",
            "only up to the limit is copied"
        );
        let replay = ResponseBody::replay(peeked);
        assert!(replay.was_peeked());
        assert_eq!(drain(replay).await, ["0123456789", "abcdefghij", "tail"]);
    }

    #[tokio::test]
    async fn an_error_while_peeking_is_replayed_where_it_happened() {
        let peeked = peek(frames(&[Ok("head"), Err("reset"), Ok("never")]), 1024).await;
        assert_eq!(peeked.bytes(), b"head");
        assert_eq!(
            drain(ResponseBody::replay(peeked)).await,
            ["head", "!reset"]
        );
    }

    #[tokio::test]
    async fn passthrough_is_the_body_itself() {
        let body = ResponseBody::passthrough(frames(&[Ok("a"), Ok("b")]));
        assert!(!body.was_peeked());
        assert_eq!(drain(body).await, ["a", "b"]);
    }
}
