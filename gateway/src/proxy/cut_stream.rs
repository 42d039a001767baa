//! An SSE answer whose upstream fails mid-stream (its connection cut) ends as the API ends a
//! stream it cannot finish: the events whole so far, an `error` event (`api_error`), then
//! the end of the body, so the official SDKs raise an API error rather than a transport
//! error. The gateway asks the upstream for streams uncompressed (`api.rs`) so the event
//! can be added as text.
//!
//! The client only ever gets whole events: bytes of an event not yet ended (`\n\n`) are held
//! until its end arrives — no event waits, since none is usable before its end — so an error
//! event never lands inside a half-sent one. A frame that ends an event (as the API's
//! frames do) passes as it is, uncopied. Past [`HELD_MAX`] bytes of one unfinished event
//! (no API event is that large) the bytes pass as they come, and a cut ends in a broken body
//! as it would without this.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use fairgate::BoxError;
use http_body::{Frame, SizeHint};
use http_body_util::BodyExt;
use tracing::debug;

use crate::body::Body;

/// The event a stream cut by its upstream ends with.
const CUT_EVENT: &str = "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"api_error\",\
                         \"message\":\"the upstream's stream was cut before its end\"}}\n\n";

/// Most bytes of one unfinished event held back.
pub(crate) const HELD_MAX: usize = 1 << 20;

/// `upstream`, an uncompressed SSE answer, ending with an error event if it is cut.
pub(crate) fn ended_as_the_api_ends(upstream: Body) -> Body {
    CutStream {
        inner: upstream,
        held: BytesMut::new(),
        passing: false,
        ended: false,
    }
    .boxed_unsync()
}

struct CutStream {
    inner: Body,
    /// Bytes of the event not yet ended.
    held: BytesMut,
    /// An event grew past `HELD_MAX`: bytes pass as they come.
    passing: bool,
    ended: bool,
}

/// Where the last whole event in `bytes` ends (after its `\n\n`, or `\r\n\r\n`).
fn last_event_end(bytes: &[u8]) -> Option<usize> {
    (1..bytes.len())
        .rev()
        .find_map(|i| match (bytes[i - 1], bytes[i]) {
            (b'\n', b'\n') => Some(i + 1),
            (b'\n', b'\r')
                if bytes.get(i + 1) == Some(&b'\n') && i >= 2 && bytes[i - 2] == b'\r' =>
            {
                Some(i + 2)
            }
            _ => None,
        })
}

impl CutStream {
    /// The whole events `data` completes, if any; the rest is held.
    fn whole_events(&mut self, data: Bytes) -> Option<Bytes> {
        if self.passing {
            return Some(data);
        }
        if self.held.is_empty() && last_event_end(&data) == Some(data.len()) {
            return Some(data);
        }
        self.held.extend_from_slice(&data);
        if let Some(end) = last_event_end(&self.held) {
            return Some(self.held.split_to(end).freeze());
        }
        if self.held.len() > HELD_MAX {
            self.passing = true;
            return Some(self.held.split().freeze());
        }
        None
    }
}

impl http_body::Body for CutStream {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        loop {
            if self.ended {
                return Poll::Ready(None);
            }
            let frame = match Pin::new(&mut self.inner).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(frame) => frame,
            };
            match frame {
                None => {
                    self.ended = true;
                    // A last event without its blank line: the client judges it.
                    let rest = self.held.split().freeze();
                    return Poll::Ready((!rest.is_empty()).then(|| Ok(Frame::data(rest))));
                }
                Some(Err(error)) if self.passing => {
                    self.ended = true;
                    return Poll::Ready(Some(Err(error)));
                }
                Some(Err(error)) => {
                    debug!(error = %error, "an upstream's stream was cut: ended with an error event");
                    metrics::counter!("gateway_streams_cut_total").increment(1);
                    self.ended = true;
                    // What was held is half an event: never sent.
                    self.held.clear();
                    let event = Bytes::from_static(CUT_EVENT.as_bytes());
                    return Poll::Ready(Some(Ok(Frame::data(event))));
                }
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => {
                        if let Some(events) = self.whole_events(data) {
                            return Poll::Ready(Some(Ok(Frame::data(events))));
                        }
                    }
                    // Trailers pass (an SSE answer has none).
                    Err(frame) => return Poll::Ready(Some(Ok(frame))),
                },
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended
    }

    fn size_hint(&self) -> SizeHint {
        // The error event may come on top of what the upstream said.
        SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::StreamBody;

    /// A body of `chunks`, then `cut` (an error) or its end.
    fn upstream(chunks: &[&'static str], cut: bool) -> Body {
        let mut frames: Vec<Result<Frame<Bytes>, BoxError>> = chunks
            .iter()
            .map(|c| Ok(Frame::data(Bytes::from_static(c.as_bytes()))))
            .collect();
        if cut {
            frames.push(Err("connection reset".into()));
        }
        StreamBody::new(futures_util::stream::iter(frames)).boxed_unsync()
    }

    /// Each frame the client gets, as text; an error as `!`.
    async fn frames(body: Body) -> Vec<String> {
        let mut body = std::pin::pin!(body);
        let mut out = Vec::new();
        while let Some(frame) = body.frame().await {
            out.push(match frame {
                Ok(frame) => String::from_utf8(frame.into_data().unwrap().to_vec()).unwrap(),
                Err(_) => "!".into(),
            });
        }
        out
    }

    const A: &str = "event: ping\ndata: {\"type\":\"ping\"}\n\n";

    #[tokio::test]
    async fn whole_events_pass_as_they_come_and_a_split_one_when_its_end_arrives() {
        let got = frames(ended_as_the_api_ends(upstream(
            &[A, "event: ping\nda", "ta: {}\n", "\n", A],
            false,
        )))
        .await;
        assert_eq!(got, [A, "event: ping\ndata: {}\n\n", A]);
        let crlf = "event: ping\r\ndata: {}\r\n\r\n";
        let got = frames(ended_as_the_api_ends(upstream(
            &["event: ping\r\n", "data: {}\r\n\r\n"],
            false,
        )))
        .await;
        assert_eq!(got, [crlf]);
    }

    #[tokio::test]
    async fn a_cut_mid_event_drops_the_half_and_ends_with_the_error_event() {
        let got = frames(ended_as_the_api_ends(upstream(
            &[
                A,
                "event: content_block_delta\ndata: {\"type\":\"content_bl",
            ],
            true,
        )))
        .await;
        assert_eq!(got, [A, CUT_EVENT]);
        // Cut at an event's end: the same ending.
        let got = frames(ended_as_the_api_ends(upstream(&[A], true))).await;
        assert_eq!(got, [A, CUT_EVENT]);
    }

    #[tokio::test]
    async fn a_last_event_without_its_blank_line_is_sent_at_the_end() {
        let got = frames(ended_as_the_api_ends(upstream(
            &[A, "event: ping\ndata: {}"],
            false,
        )))
        .await;
        assert_eq!(got, [A, "event: ping\ndata: {}"]);
    }

    #[tokio::test]
    async fn an_event_past_the_bound_passes_as_it_comes_and_its_cut_is_an_error() {
        let big: &'static str = Box::leak("x".repeat(HELD_MAX + 1).into_boxed_str());
        let got = frames(ended_as_the_api_ends(upstream(&[A, big, "more"], true))).await;
        assert_eq!(
            got.len(),
            4,
            "{:?}",
            got.iter().map(String::len).collect::<Vec<_>>()
        );
        assert_eq!(
            (got[0].as_str(), got[2].as_str(), got[3].as_str()),
            (A, "more", "!")
        );
    }
}
