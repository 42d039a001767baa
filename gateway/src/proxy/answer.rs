//! Answers relayed to the client through a bounded buffer, so that what a call holds of the
//! provider's capacity (its slot and window permit, its request body's bytes) is given back
//! at the upstream's last byte, not the client's.
//!
//! A task reads the upstream's answer as fast as the upstream sends it and queues its frames
//! for the client; each queued byte is held from the key holder's `--key-answer-buffer`
//! and the gateway's `--answer-buffer` until the client's connection takes it. When the
//! upstream is done, the upstream body (and with it every guard of the admission stack) is
//! dropped, so the slot is free while the client reads at its own pace.
//!
//! A client that stops reading cannot hold anything for long: once its holder's buffer is
//! full the relay waits, and when `--write-timeout` passes with nothing taken by the
//! client (while the upstream still sends, or after it is done), the connection is cut
//! ([`Hangup`]), dropping the buffer and, if it still runs, the upstream call. A client
//! that leaves drops the upstream call at once, as before.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use fairgate::BoxError;
use http_body::{Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::sync::{mpsc, watch};
use tracing::debug;

use crate::admission::holders::{Claim, Held};
use crate::body::Body;
use crate::server::Hangup;

/// A frame on its way to the client, with the buffer bytes it holds. Boxed: the channel
/// allocates room for 32 at a time, which unboxed is 3.7 KiB a stream.
type Queued = Box<(Result<Frame<Bytes>, BoxError>, Option<Held>)>;

/// Relays `upstream` to the client through the buffer of `claim`'s holder; `upstream_held`
/// (what the call holds until the upstream is done) is dropped with the upstream body.
/// With no `hangup` (a request that did not come through a connection), a client that
/// stops reading is not cut.
pub(crate) fn relay<H: Send + 'static>(
    upstream: Body,
    upstream_held: H,
    claim: Arc<Claim>,
    write_timeout: Duration,
    hangup: Option<Hangup>,
) -> Body {
    let (queue, queued) = mpsc::unbounded_channel();
    let (taken_tx, taken) = watch::channel(0u64);
    let pump = Pump {
        queue,
        taken,
        sent: 0,
        claim,
        write_timeout,
        hangup,
    };
    tokio::spawn(pump.run(upstream, upstream_held));
    Relayed {
        queued,
        taken: taken_tx,
        count: 0,
    }
    .boxed_unsync()
}

/// The upstream's side of a relay.
struct Pump {
    queue: mpsc::UnboundedSender<Queued>,
    /// Frames the client's side has taken.
    taken: watch::Receiver<u64>,
    /// Frames queued.
    sent: u64,
    claim: Arc<Claim>,
    write_timeout: Duration,
    hangup: Option<Hangup>,
}

impl Pump {
    async fn run<H>(mut self, mut upstream: Body, upstream_held: H) {
        loop {
            let frame = tokio::select! {
                biased;
                // The client left: the call is dropped now, as without a relay.
                () = self.queue.closed() => return,
                frame = upstream.frame() => frame,
            };
            let frame = match frame {
                None => break,
                Some(Err(error)) => {
                    let _ = self.queue.send(Box::new((Err(error), None)));
                    return;
                }
                Some(Ok(frame)) => frame,
            };
            let len = frame.data_ref().map_or(0, Bytes::len);
            let held = if len == 0 {
                None
            } else {
                // Boxed, as the wait at the end: the task's own future stays small (a
                // held stream keeps it), the waits take room only while they run.
                match Box::pin(self.hold(len)).await {
                    Some(held) => Some(held),
                    None => return self.cut("its buffer stayed full"),
                }
            };
            if self.queue.send(Box::new((Ok(frame), held))).is_err() {
                return;
            }
            self.sent += 1;
        }
        // The upstream is done: give back the slot, the window permit, the body's bytes.
        drop(upstream);
        drop(upstream_held);
        Box::pin(self.until_taken()).await;
    }

    /// `len` bytes of the buffer, waiting while the client takes frames; `None` when it
    /// took none for the write timeout.
    async fn hold(&mut self, len: usize) -> Option<Held> {
        let claim = self.claim.clone();
        let wait = claim.answer_bytes(len);
        tokio::pin!(wait);
        loop {
            self.taken.mark_unchanged();
            match tokio::time::timeout(self.write_timeout, &mut wait).await {
                Ok(held) => return Some(held),
                Err(_) if self.taken.has_changed().unwrap_or(false) => continue,
                Err(_) => return None,
            }
        }
    }

    /// Waits for the client to take every queued frame, or to leave; cuts its connection
    /// when it takes nothing for the write timeout.
    async fn until_taken(mut self) {
        loop {
            if *self.taken.borrow_and_update() >= self.sent {
                return;
            }
            match tokio::time::timeout(self.write_timeout, self.taken.changed()).await {
                Ok(Ok(())) => {}
                // The client's side is gone: its queue with it.
                Ok(Err(_)) => return,
                Err(_) => return self.cut("its answer went unread"),
            }
        }
    }

    fn cut(self, why: &'static str) {
        debug!(why, "a client stopped reading its answer: connection cut");
        metrics::counter!("gateway_answers_cut_total").increment(1);
        // The answer ends in an error, never as if whole: a client that reads on sees it cut.
        let _ = self
            .queue
            .send(Box::new((Err(format!("answer cut: {why}").into()), None)));
        if let Some(hangup) = &self.hangup {
            hangup.cut();
        }
    }
}

/// The client's side of a relay: the queued frames, in order.
struct Relayed {
    queued: mpsc::UnboundedReceiver<Queued>,
    taken: watch::Sender<u64>,
    count: u64,
}

impl http_body::Body for Relayed {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.queued.poll_recv(cx) {
            Poll::Ready(Some(queued)) => {
                let (frame, held) = *queued;
                // Handed to the connection: its buffer bytes go back.
                drop(held);
                self.count += 1;
                let count = self.count;
                self.taken.send_replace(count);
                Poll::Ready(Some(frame))
            }
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::holders::{HolderLimits, Holders};
    use fairgate::TenantId;
    use http_body_util::StreamBody;
    use std::sync::atomic::{AtomicBool, Ordering};

    struct Flag(Arc<AtomicBool>);
    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    fn holders(answer_bytes: usize) -> Holders {
        let limits = HolderLimits {
            requests: 8,
            body_bytes: 1 << 20,
            answer_bytes,
        };
        Holders::new(limits, 1 << 20, 1 << 20)
    }

    /// An upstream body of `frames` frames of `size` bytes, then its end.
    fn upstream(frames: usize, size: usize) -> Body {
        let frames = (0..frames).map(move |_| Ok(Frame::data(Bytes::from(vec![b'x'; size]))));
        StreamBody::new(futures_util::stream::iter(frames)).boxed_unsync()
    }

    #[tokio::test(start_paused = true)]
    async fn the_upstream_side_is_given_back_at_its_last_byte_while_the_client_reads_nothing() {
        let holders = holders(1 << 20);
        let claim = Arc::new(holders.begin(&TenantId::new("t")).unwrap());
        let released = Arc::new(AtomicBool::new(false));
        let body = relay(
            upstream(10, 1000),
            Flag(released.clone()),
            claim,
            Duration::from_secs(30),
            None,
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert!(
            released.load(Ordering::SeqCst),
            "the slot waits for the client"
        );
        assert_eq!(holders.answers_used(), 10_000);
        let read = body.collect().await.unwrap().to_bytes();
        assert_eq!(read.len(), 10_000);
        assert_eq!(holders.answers_used(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_buffer_holds_the_upstream_until_the_write_timeout_then_lets_it_go() {
        let holders = holders(4_000);
        let claim = Arc::new(holders.begin(&TenantId::new("t")).unwrap());
        let released = Arc::new(AtomicBool::new(false));
        let body = relay(
            upstream(10, 1000),
            Flag(released.clone()),
            claim,
            Duration::from_secs(5),
            None,
        );
        tokio::time::sleep(Duration::from_secs(4)).await;
        assert!(!released.load(Ordering::SeqCst));
        assert_eq!(holders.answers_used(), 4_000, "the key's buffer bounds it");
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(released.load(Ordering::SeqCst), "cut at the write timeout");
        let read = body.collect().await;
        assert!(
            read.is_err(),
            "a cut answer ends in an error, not as if whole"
        );
        assert_eq!(holders.answers_used(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_reading_slowly_is_never_cut() {
        let holders = holders(2_000);
        let claim = Arc::new(holders.begin(&TenantId::new("t")).unwrap());
        let mut body = relay(upstream(20, 1000), (), claim, Duration::from_secs(5), None);
        let mut read = 0;
        while let Some(frame) = body.frame().await {
            read += frame.unwrap().into_data().unwrap().len();
            tokio::time::sleep(Duration::from_secs(3)).await;
        }
        assert_eq!(read, 20_000);
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_leaves_drops_the_upstream_call() {
        let holders = holders(1 << 20);
        let claim = Arc::new(holders.begin(&TenantId::new("t")).unwrap());
        let released = Arc::new(AtomicBool::new(false));
        let endless = StreamBody::new(futures_util::stream::pending::<
            Result<Frame<Bytes>, BoxError>,
        >())
        .boxed_unsync();
        let body = relay(
            endless,
            Flag(released.clone()),
            claim,
            Duration::from_secs(5),
            None,
        );
        drop(body);
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert!(released.load(Ordering::SeqCst));
    }
}
