//! Connections that came at the cap with no connection to close for them wait here for
//! their request's head, to be answered `529` with `retry-after` and closed; one still
//! silent after [`HEAD_WAIT`] is closed unanswered. When the pen is full, a newcomer asks
//! those that have waited [`SILENT_AFTER`] with nothing sent to go, which each does only
//! if its socket holds no byte unread: silent sockets do not stop the listener until they
//! time out (2,700 of them held a client's call 4.7 s; 0.93 s now), and no client whose
//! request has come is closed unanswered.

use std::collections::VecDeque;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::AbortHandle;
use tokio::time::Instant;

use super::{EVICTABLE_AFTER, MAX_HEAD};

/// Connections waiting at once at most (each a file for up to [`HEAD_WAIT`] and
/// [`LINGER`]).
const MAX_WAITING: usize = 256;

/// How long a connection at the cap waits for its request's head before its answer (an
/// HTTP client takes an answer that comes before its request for a broken connection);
/// one silent that long is closed unanswered.
const HEAD_WAIT: Duration = Duration::from_secs(1);

/// How long a connection must have waited with nothing sent before a full pen asks it to
/// go: as long as a connection never served must have been open before a newcomer may
/// close it. (At 100 ms, clients of a loaded machine connecting 600 at once were closed
/// before they had sent their request.)
const SILENT_AFTER: Duration = EVICTABLE_AFTER[0];

/// How long a full pen waits for a turn before asking again (the ones asked to go had
/// been heard after all, or none had been silent long enough).
const ASK_AGAIN_AFTER: Duration = Duration::from_millis(10);

/// How long a refused connection is kept after its answer, reading away what else its
/// client sent, so that its close is a FIN after the answer and not a reset that could
/// destroy it.
const LINGER: Duration = Duration::from_millis(500);

/// The body of the answer to a connection refused at the cap.
const AT_CAPACITY: &str = r#"{"type":"error","error":{"type":"overloaded_error","message":"the gateway has no connection free"}}"#;

/// The whole answer to a connection refused at the cap, marked as the gateway's other own
/// answers are (a `request-id`).
fn at_capacity() -> Vec<u8> {
    format!(
        "HTTP/1.1 529 Overloaded\r\ncontent-type: application/json\r\nretry-after: 1\r\n\
         request-id: {}\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{AT_CAPACITY}",
        crate::own_answer::next_request_id(),
        AT_CAPACITY.len()
    )
    .into_bytes()
}

/// The connections of one listener waiting at its cap.
pub(super) struct Pen {
    turns: Arc<Semaphore>,
    /// Oldest first.
    waiting: VecDeque<(AbortHandle, Arc<Waiting>)>,
}

/// What the pen and a waiting connection share.
struct Waiting {
    /// When it came.
    since: Instant,
    /// Its first bytes have come: it is not asked to go.
    heard: AtomicBool,
    /// Asked to go unless its socket holds a byte unread.
    go: Notify,
}

impl Pen {
    pub(super) fn new() -> Pen {
        Pen {
            turns: Arc::new(Semaphore::new(MAX_WAITING)),
            waiting: VecDeque::new(),
        }
    }

    /// Lets `tcp` wait for its refusal. When the pen is full, asks those that have waited
    /// [`SILENT_AFTER`] with nothing heard to go, and waits for a turn (asking again every
    /// [`ASK_AGAIN_AFTER`]: one heard after all keeps its turn).
    pub(super) async fn enter(&mut self, tcp: TcpStream) {
        // Each waits a second and a half at most: those done are at the front.
        while self
            .waiting
            .front()
            .is_some_and(|(task, _)| task.is_finished())
        {
            self.waiting.pop_front();
        }
        let turn = loop {
            if let Ok(turn) = self.turns.clone().try_acquire_owned() {
                break turn;
            }
            self.waiting.retain(|(task, waiting)| {
                let silent = !waiting.heard.load(Ordering::SeqCst)
                    && waiting.since.elapsed() >= SILENT_AFTER;
                if silent {
                    waiting.go.notify_one();
                }
                !silent && !task.is_finished()
            });
            let turn = self.turns.clone().acquire_owned();
            match tokio::time::timeout(ASK_AGAIN_AFTER, turn).await {
                Ok(Ok(turn)) => break turn,
                Ok(Err(_)) => return,
                Err(_) => {}
            }
        };
        let waiting = Arc::new(Waiting {
            since: Instant::now(),
            heard: AtomicBool::new(false),
            go: Notify::new(),
        });
        let task = tokio::spawn(refuse(tcp, waiting.clone(), turn));
        self.waiting.push_back((task.abort_handle(), waiting));
    }
}

/// Whether `tcp` holds bytes not read yet (the kernel's answer: the runtime may not have
/// seen them); not when its client closed it or it failed.
fn holds_bytes(tcp: &TcpStream) -> bool {
    use rustix::net::{RecvFlags, recv};
    matches!(
        recv(tcp, &mut [0u8; 1], RecvFlags::PEEK | RecvFlags::DONTWAIT),
        Ok((_, 1))
    )
}

/// Answers `tcp` [`at_capacity`] once its request's head has come (within [`HEAD_WAIT`],
/// or until it is asked to go while silent), and closes it after reading away what else
/// its client sent (within [`LINGER`]).
async fn refuse(mut tcp: TcpStream, waiting: Arc<Waiting>, _turn: OwnedSemaphorePermit) {
    let mut sink = [0u8; 4096];
    let mut head = Vec::new();
    let head_came = tokio::time::timeout(HEAD_WAIT, async {
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_HEAD {
            let read = tokio::select! {
                read = tcp.read(&mut sink) => read?,
                _ = waiting.go.notified(), if head.is_empty() => {
                    if !holds_bytes(&tcp) {
                        return Ok(false);
                    }
                    waiting.heard.store(true, Ordering::SeqCst);
                    continue;
                }
            };
            match read {
                0 => return Ok(false),
                n => head.extend_from_slice(&sink[..n]),
            }
            waiting.heard.store(true, Ordering::SeqCst);
        }
        Ok::<_, io::Error>(true)
    });
    if !matches!(head_came.await, Ok(Ok(true))) {
        return;
    }
    let linger = async {
        tcp.write_all(&at_capacity()).await?;
        tcp.shutdown().await?;
        let mut read = 0;
        while read < 64 * 1024 {
            match tcp.read(&mut sink).await? {
                0 => break,
                n => read += n,
            }
        }
        Ok::<_, io::Error>(())
    };
    let _ = tokio::time::timeout(LINGER, linger).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_socket_holds_bytes_once_its_peer_sent_some_and_not_once_they_are_read() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (mut server, _) = listener.accept().await.unwrap();
        assert!(!holds_bytes(&server), "nothing sent yet");
        client.write_all(b"POST").await.unwrap();
        server.readable().await.unwrap();
        assert!(holds_bytes(&server), "sent, not read");
        let mut read = [0u8; 4];
        server.read_exact(&mut read).await.unwrap();
        assert!(!holds_bytes(&server), "read");
        drop(client);
        server.readable().await.unwrap();
        assert!(!holds_bytes(&server), "closed by its peer");
    }

    #[test]
    fn the_answer_at_capacity_is_a_whole_http_response_with_its_own_request_id() {
        let bytes = at_capacity();
        let text = std::str::from_utf8(&bytes).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 529 "));
        let length: usize = head
            .lines()
            .find_map(|line| line.strip_prefix("content-length: "))
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(length, body.len());
        assert!(head.contains("\r\nretry-after: 1\r\n"));
        let id = |text: &str| {
            text.lines()
                .find_map(|line| line.strip_prefix("request-id: "))
                .map(str::to_owned)
        };
        let first = id(text).expect("a request-id");
        assert!(first.starts_with("req_fairgate_"), "{first}");
        let again = at_capacity();
        assert_ne!(id(std::str::from_utf8(&again).unwrap()), Some(first));
    }
}
