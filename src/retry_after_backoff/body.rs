//! The response body [`RetryAfterBackoff`](super::RetryAfterBackoff) returns.

use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Buf;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::rate::Usage;

pin_project! {
    /// The body of a response from [`RetryAfterBackoff`](super::RetryAfterBackoff): the
    /// upstream's body, untouched, or — for a 429 whose body the layer read to look for the
    /// spend-limit error code — the same bytes replayed from a buffer, then the rest.
    ///
    /// Every byte the upstream sent reaches the caller, in order; a body error is replayed
    /// where it happened. A success's bytes may be scanned as they pass for its token
    /// `usage`, to correct learned pacing (see
    /// [`usage_correction`](super::BackoffPolicyBuilder::usage_correction)); the frames
    /// are not changed or held.
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
        // A success's body, its usage read as it passes.
        Scanned {
            #[pin]
            inner: B,
            usage: Usage,
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

/// How a read-ahead ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Filled {
    /// Enough was read to judge the body: the byte limit, its end or its error.
    Read,
    /// The frame limit came first: the body is in pieces too small to judge in time.
    FrameLimit,
}

/// Frames read in one poll at most, before the read-ahead yields (waking itself), so that a
/// body of millions of empty frames that are all ready cannot hold a thread in one poll.
pub(super) const FRAMES_PER_POLL: usize = 64;

impl<B: Body> Peeked<B> {
    pub(super) fn new(body: B) -> Self {
        Peeked {
            frames: VecDeque::new(),
            bytes: Vec::new(),
            error: None,
            rest: Some(Box::pin(body)),
        }
    }

    /// Reads frames until `limit` bytes are buffered, the body ends or fails ([`Filled::Read`]),
    /// or `frame_limit` frames are buffered ([`Filled::FrameLimit`]). Reads at most
    /// [`FRAMES_PER_POLL`] frames per call: past that it wakes its task and returns `Pending`.
    pub(super) fn poll_fill(
        &mut self,
        cx: &mut Context<'_>,
        limit: usize,
        frame_limit: usize,
    ) -> Poll<Filled> {
        let mut this_poll = 0;
        while self.bytes.len() < limit && self.error.is_none() {
            let Some(rest) = self.rest.as_mut() else {
                break;
            };
            if rest.is_end_stream() {
                self.rest = None;
                break;
            }
            if self.frames.len() >= frame_limit {
                return Poll::Ready(Filled::FrameLimit);
            }
            if this_poll == FRAMES_PER_POLL {
                // Ready frames could keep this loop going for as long as the body likes.
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            this_poll += 1;
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
        Poll::Ready(Filled::Read)
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

    /// This body, its usage read as it passes (a passthrough body only).
    pub(super) fn scanned(self, usage: Usage) -> Self {
        match self.kind {
            Kind::Passthrough { inner } => ResponseBody {
                kind: Kind::Scanned { inner, usage },
            },
            kind => ResponseBody { kind },
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
            KindProj::Scanned { inner, usage } => {
                let frame = ready!(inner.poll_frame(cx));
                match &frame {
                    Some(Ok(frame)) => {
                        if let Some(data) = frame.data_ref() {
                            usage.feed(data);
                        }
                    }
                    // What was seen is reported when the failed body is dropped.
                    Some(Err(_)) => {}
                    None => usage.finish(true),
                }
                Poll::Ready(frame)
            }
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
            Kind::Passthrough { inner } | Kind::Scanned { inner, .. } => inner.is_end_stream(),
            Kind::Replay { replay } => {
                replay.frames.is_empty()
                    && replay.error.is_none()
                    && replay.rest.as_ref().is_none_or(|rest| rest.is_end_stream())
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Passthrough { inner } | Kind::Scanned { inner, .. } => inner.size_hint(),
            Kind::Replay { .. } => SizeHint::default(),
        }
    }
}

impl<B: Body> fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            Kind::Passthrough { .. } => "passthrough",
            Kind::Scanned { .. } => "scanned",
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
        let filled = std::future::poll_fn(|cx| peeked.poll_fill(cx, limit, 1024)).await;
        assert_eq!(filled, Filled::Read);
        peeked
    }

    /// A body of `n` empty data frames, all ready, counting how many were polled.
    struct Empty {
        left: usize,
        polled: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    }

    impl Body for Empty {
        type Data = Bytes;
        type Error = &'static str;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, &'static str>>> {
            if self.left == 0 {
                return Poll::Ready(None);
            }
            self.left -= 1;
            self.polled
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Poll::Ready(Some(Ok(Frame::data(Bytes::new()))))
        }
    }

    #[test]
    fn one_poll_of_the_read_ahead_reads_a_bounded_number_of_frames_and_wakes_itself() {
        let polled = std::sync::Arc::default();
        let mut peeked = Peeked::new(Empty {
            left: 5_000_000,
            polled: std::sync::Arc::clone(&polled),
        });
        let woken = std::sync::Arc::new(Woken::default());
        let waker = std::task::Waker::from(woken.clone());
        let mut cx = Context::from_waker(&waker);
        let frames = || polled.load(std::sync::atomic::Ordering::Relaxed);
        assert!(peeked.poll_fill(&mut cx, 64 * 1024, 1024).is_pending());
        assert_eq!(
            frames(),
            FRAMES_PER_POLL,
            "one poll reads at most this many"
        );
        assert_eq!(woken.count(), 1, "pending only after waking itself");
        let mut polls = 1;
        let filled = loop {
            polls += 1;
            if let Poll::Ready(filled) = peeked.poll_fill(&mut cx, 64 * 1024, 1024) {
                break filled;
            }
        };
        assert_eq!(filled, Filled::FrameLimit);
        assert_eq!(frames(), 1024, "no frame past the frame limit is read");
        assert_eq!(polls, 1024 / FRAMES_PER_POLL);
    }

    #[derive(Default)]
    struct Woken(std::sync::atomic::AtomicUsize);

    impl Woken {
        fn count(&self) -> usize {
            self.0.load(std::sync::atomic::Ordering::Relaxed)
        }
    }

    impl std::task::Wake for Woken {
        fn wake(self: std::sync::Arc<Self>) {
            self.wake_by_ref();
        }

        fn wake_by_ref(self: &std::sync::Arc<Self>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
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
