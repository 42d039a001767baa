//! `--record FILE`: the admitted traffic as JSON lines, for the simulator's `--replay`.
//!
//! One line per `POST /v1/messages` call that went through the admission stack, written
//! when the call ends (its answer's last byte sent, or the client gone):
//!
//! ```json
//! {"at_ms":1532,"tenant":"9f86d081884c7d65","tier":"premium","origin":"user","sla_ms":null,"est_input_tokens":27,"input_tokens":12,"output_tokens":7,"upstream_ms":41,"latency_ms":44,"status":200}
//! ```
//!
//! - `at_ms`: when the call entered the stack (its body read), ms after the recording began;
//! - `tenant`: the first 16 hex digits of the SHA-256 of the tenant's name (never a key or
//!   a name in clear);
//! - `tier`, `origin` (`user`, `scheduled`, `batch`), `sla_ms` (or null), and
//!   `est_input_tokens`: the call's `Job` as the stack saw it;
//! - `input_tokens`, `output_tokens`: the answer's own `usage` (a JSON answer's, or a
//!   stream's `message_start` / `message_delta`), null when it said none;
//! - `upstream_ms`: from the last dispatch to the upstream to the answer's last byte, null
//!   when the call was never dispatched (refused by the stack);
//! - `latency_ms`: from `at_ms` to the answer's last byte, what the client waited;
//! - `status`: the status the client got (`499` if it left before its answer began).
//!
//! The file is refused, before anything is written, if it is the keys file (the same file
//! by any path or link) or an existing non-empty file whose first line is not a recording
//! line: `--record` truncates, and a mistyped path must not cost a file. A new or empty
//! file, or an earlier recording, is taken.
//!
//! Writing never holds a call up: lines go through a bounded channel to a writer thread,
//! and a line that finds the channel full is dropped and counted
//! (`gateway_record_dropped_total`). The writer flushes whenever it has nothing waiting,
//! so the file is current within moments. The answer's body passes through untouched; the
//! usage is read from it as it passes by the library's `UsageReader` (decoded on the side
//! when the upstream compressed it).

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use fairgate::rate::UsageReader;
use fairgate::{BoxError, Job, Origin};
use http_body::{Frame, SizeHint};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::warn;

use crate::body::Body;

/// Lines waiting for the writer at most; past it a line is dropped and counted.
const QUEUE: usize = 4096;

/// The open recording: a channel to its writer thread and the moment it began.
pub(crate) struct Recorder {
    lines: mpsc::Sender<String>,
    epoch: Instant,
}

impl Recorder {
    /// Creates (or truncates) `path` and starts the writer thread; refuses the keys file
    /// (`keys`) and any other file that is not a recording (see [`check_target`]).
    pub(crate) fn start(path: &Path, keys: &Path) -> Result<Arc<Recorder>, String> {
        check_target(path, keys)?;
        let file = File::create(path).map_err(|e| format!("--record {}: {e}", path.display()))?;
        let (lines, mut queued) = mpsc::channel::<String>(QUEUE);
        let shown = path.display().to_string();
        std::thread::Builder::new()
            .name("record".into())
            .spawn(move || {
                let mut out = BufWriter::new(file);
                let mut failed = false;
                while let Some(line) = queued.blocking_recv() {
                    let mut written = out.write_all(line.as_bytes());
                    if queued.is_empty() {
                        written = written.and_then(|()| out.flush());
                    }
                    if let Err(e) = written
                        && !failed
                    {
                        failed = true;
                        warn!(file = %shown, error = %e, "--record: cannot write");
                    }
                }
                let _ = out.flush();
            })
            .map_err(|e| format!("--record: cannot start the writer: {e}"))?;
        Ok(Arc::new(Recorder {
            lines,
            epoch: Instant::now(),
        }))
    }

    /// A call entering the stack now.
    pub(crate) fn begin(self: &Arc<Self>) -> Trace {
        Trace {
            recorder: self.clone(),
            arrived: Instant::now(),
            probe: Probe::default(),
            written: false,
        }
    }

    fn write(&self, line: String) {
        if self.lines.try_send(line).is_err() {
            metrics::counter!("gateway_record_dropped_total").increment(1);
        }
    }
}

/// The keys of a recording line, in the order they are written.
const LINE_KEYS: [&str; 11] = [
    "at_ms",
    "tenant",
    "tier",
    "origin",
    "sla_ms",
    "est_input_tokens",
    "input_tokens",
    "output_tokens",
    "upstream_ms",
    "latency_ms",
    "status",
];

/// Whether `line` reads as a line [`Trace`] writes: a JSON object with its keys in its
/// order and a number for `status` last.
fn is_recording_line(line: &str) -> bool {
    let Some(mut rest) = line
        .trim_end()
        .strip_prefix('{')
        .and_then(|l| l.strip_suffix('}'))
    else {
        return false;
    };
    for (i, key) in LINE_KEYS.iter().enumerate() {
        let quoted = format!("\"{key}\":");
        let Some(at) = rest.find(&quoted) else {
            return false;
        };
        // The first key opens the object; every other follows a comma.
        if (i == 0 && at != 0) || (i > 0 && !rest[..at].ends_with(',')) {
            return false;
        }
        rest = &rest[at + quoted.len()..];
    }
    !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit())
}

/// The first line of a recording is never longer than this (a tier name is short).
const FIRST_LINE_MAX: usize = 4096;

/// Refuses `path` as `--record`'s file when it is the keys file (compared by device and
/// inode, so a symlink, a hard link or `./` spelling is caught too), or an existing
/// non-empty file whose first line is not a recording line. A new or empty file is fine.
pub(crate) fn check_target(path: &Path, keys: &Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let shown = path.display();
    let Ok(meta) = std::fs::metadata(path) else {
        return Ok(()); // not there: created
    };
    if let Ok(keys_meta) = std::fs::metadata(keys)
        && (meta.dev(), meta.ino()) == (keys_meta.dev(), keys_meta.ino())
    {
        return Err(format!(
            "--record {shown} is the keys file (--keys {}): recording would overwrite it",
            keys.display()
        ));
    }
    if !meta.is_file() || meta.len() == 0 {
        return Ok(()); // empty, or a device such as /dev/null
    }
    let mut head = Vec::with_capacity(FIRST_LINE_MAX);
    File::open(path)
        .and_then(|f| f.take(FIRST_LINE_MAX as u64).read_to_end(&mut head))
        .map_err(|e| format!("--record {shown}: {e}"))?;
    let first = head.split(|&b| b == b'\n').next().unwrap_or_default();
    if std::str::from_utf8(first).is_ok_and(is_recording_line) {
        return Ok(());
    }
    Err(format!(
        "--record {shown} exists and is not a recording (its first line is not one): \
         recording would overwrite it; give a new or empty file, or remove it"
    ))
}

/// What the stack tells about a call as it goes: its job, its last dispatch. Travels in
/// the request's extensions (a retried request's clone shares it).
#[derive(Clone, Default)]
pub(crate) struct Probe(Arc<Mutex<Seen>>);

#[derive(Default)]
struct Seen {
    job: Option<Job>,
    dispatched: Option<Instant>,
}

impl Probe {
    fn lock(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The job the stack admits the call with.
    pub(crate) fn job(&self, job: &Job) {
        self.lock().job = Some(job.clone());
    }

    /// The call is being sent to the upstream (again) now.
    pub(crate) fn dispatched(&self) {
        self.lock().dispatched = Some(Instant::now());
    }
}

/// One call being recorded: its line is written by [`Trace::finish`], or when it is
/// dropped unfinished (the client gone before its answer began) with status `499`.
pub(crate) struct Trace {
    recorder: Arc<Recorder>,
    arrived: Instant,
    probe: Probe,
    written: bool,
}

impl Trace {
    pub(crate) fn probe(&self) -> Probe {
        self.probe.clone()
    }

    /// Writes the call's line: it ended now, answered `status`, its usage as `usage` read.
    pub(crate) fn finish(mut self, status: u16, usage: Told) {
        self.write(status, usage);
    }

    fn write(&mut self, status: u16, (input, output): Told) {
        self.written = true;
        let now = Instant::now();
        let seen = self.probe.lock();
        // Every call that passed authentication has a job; without one there is no line.
        let Some(job) = &seen.job else { return };
        let ms = |since: Instant| now.saturating_duration_since(since).as_millis() as u64;
        let line = format!(
            "{{\"at_ms\":{},\"tenant\":\"{}\",\"tier\":{},\"origin\":\"{}\",\"sla_ms\":{},\
             \"est_input_tokens\":{},\"input_tokens\":{},\"output_tokens\":{},\
             \"upstream_ms\":{},\"latency_ms\":{},\"status\":{status}}}\n",
            self.arrived
                .saturating_duration_since(self.recorder.epoch)
                .as_millis(),
            tenant_hash(job.tenant().as_str()),
            job.tier()
                .map_or_else(|| "null".to_owned(), |t| json_string(t.as_str())),
            origin_name(job.origin()),
            or_null(job.sla().map(|d| d.as_millis() as u64)),
            job.cost(),
            or_null(input),
            or_null(output),
            or_null(seen.dispatched.map(ms)),
            ms(self.arrived),
        );
        drop(seen);
        self.recorder.write(line);
    }
}

impl Drop for Trace {
    fn drop(&mut self) {
        if !self.written {
            self.write(CLIENT_GONE, (None, None));
        }
    }
}

/// The status of a call whose client left before its answer began (nginx's number).
const CLIENT_GONE: u16 = 499;

/// The first 16 hex digits of the SHA-256 of `tenant`.
pub(crate) fn tenant_hash(tenant: &str) -> String {
    Sha256::digest(tenant.as_bytes())[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn origin_name(origin: Origin) -> &'static str {
    match origin {
        Origin::UserAction => "user",
        Origin::Scheduled => "scheduled",
        Origin::BatchJob => "batch",
    }
}

fn or_null(value: Option<u64>) -> String {
    value.map_or_else(|| "null".to_owned(), |v| v.to_string())
}

/// `text` as a JSON string, quoted and escaped.
pub(crate) fn json_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// What an answer's usage said: its input and output tokens, if it said them.
pub(crate) type Told = (Option<u64>, Option<u64>);

/// The client's response body, passed through untouched while its usage is read; the
/// call's line is written when it ends or is dropped (the client gone).
pub(crate) struct Recording {
    inner: Body,
    scan: UsageReader<2>,
    status: u16,
    trace: Option<Trace>,
}

impl Recording {
    /// `scan` reads the answer's usage (made from its headers: its `content-encoding`).
    pub(crate) fn new(
        inner: Body,
        (status, scan): (u16, UsageReader<2>),
        trace: Trace,
    ) -> Recording {
        Recording {
            inner,
            scan,
            status,
            trace: Some(trace),
        }
    }

    fn finish(&mut self) {
        if let Some(trace) = self.trace.take() {
            let usage = self.scan.usage();
            let told = (usage.input_tokens(), usage.output_tokens());
            trace.finish(self.status, (told.0.map(u64::from), told.1.map(u64::from)));
        }
    }
}

impl http_body::Body for Recording {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    let data = data.clone();
                    self.scan.feed(&data);
                }
            }
            Poll::Ready(None) => self.finish(),
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        self.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_that_finds_the_queue_full_is_dropped_and_counted() {
        use metrics_util::debugging::{DebugValue, DebuggingRecorder};
        let metrics = DebuggingRecorder::new();
        let snapshotter = metrics.snapshotter();
        let _guard = metrics::set_default_local_recorder(&metrics);
        // A writer that takes nothing: the queue holds one line.
        let (lines, mut queued) = mpsc::channel(1);
        let recorder = Recorder {
            lines,
            epoch: Instant::now(),
        };
        recorder.write("first\n".into());
        recorder.write("second\n".into());
        assert_eq!(queued.try_recv().as_deref(), Ok("first\n"));
        assert!(queued.try_recv().is_err(), "the second line was dropped");
        let dropped: Vec<DebugValue> = snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .filter(|(key, ..)| key.key().name() == "gateway_record_dropped_total")
            .map(|(.., value)| value)
            .collect();
        assert_eq!(dropped, [DebugValue::Counter(1)]);
    }

    #[test]
    fn a_call_whose_client_left_before_its_answer_is_written_as_499() {
        let (lines, mut queued) = mpsc::channel(4);
        let recorder = Arc::new(Recorder {
            lines,
            epoch: Instant::now(),
        });
        let trace = recorder.begin();
        trace.probe().job(
            &Job::new("team-a", Origin::Scheduled)
                .with_tier("pro")
                .with_cost(40),
        );
        drop(trace);
        let line = queued.try_recv().unwrap();
        let expected = format!(
            r#""tenant":"{}","tier":"pro","origin":"scheduled","sla_ms":null,"est_input_tokens":40,"input_tokens":null,"output_tokens":null,"upstream_ms":null,"#,
            tenant_hash("team-a")
        );
        assert!(line.contains(&expected), "{line}");
        assert!(line.ends_with(",\"status\":499}\n"), "{line}");
        // Without a job (never admitted), nothing is written.
        drop(recorder.begin());
        assert!(queued.try_recv().is_err());
    }

    #[test]
    fn the_lines_written_read_as_recording_lines_and_other_text_does_not() {
        let (lines, mut queued) = mpsc::channel(4);
        let recorder = Arc::new(Recorder {
            lines,
            epoch: Instant::now(),
        });
        let trace = recorder.begin();
        trace
            .probe()
            .job(&Job::new("t", Origin::UserAction).with_tier("pro"));
        trace.finish(200, (None, None));
        let line = queued.try_recv().unwrap();
        assert!(is_recording_line(&line), "{line}");
        for text in [
            "",
            "[[keys]]",
            "key = \"sk-x\"",
            "{}",
            "{\"status\":200}",
            &line.replace("\"status\":200", "\"status\":\"x\""),
            &line.replace("{\"at_ms\"", "{\"x\":1,\"at_ms\""),
        ] {
            assert!(!is_recording_line(text), "{text}");
        }
    }

    #[test]
    fn record_refuses_the_keys_file_and_a_file_that_is_not_a_recording() {
        let dir = std::env::temp_dir().join(format!("fairgate-record-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let keys = dir.join("keys.toml");
        std::fs::write(&keys, "[[keys]]\nkey = \"sk-x\"\n").unwrap();
        let err = check_target(&keys, &keys).unwrap_err();
        assert!(err.contains("is the keys file"), "{err}");
        let link = dir.join("link.jsonl");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&keys, &link).unwrap();
        assert!(
            check_target(&link, &keys)
                .unwrap_err()
                .contains("is the keys file")
        );
        let other = dir.join("notes.txt");
        std::fs::write(&other, "my notes\n").unwrap();
        assert!(
            check_target(&other, &keys)
                .unwrap_err()
                .contains("not a recording")
        );
        let empty = dir.join("empty.jsonl");
        std::fs::write(&empty, "").unwrap();
        assert_eq!(check_target(&empty, &keys), Ok(()));
        assert_eq!(check_target(&dir.join("new.jsonl"), &keys), Ok(()));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn tenants_are_hashed_and_strings_escaped() {
        assert_eq!(tenant_hash("team-premium").len(), 16);
        assert_ne!(tenant_hash("a"), tenant_hash("b"));
        assert_eq!(json_string("a\"b\\c\n"), r#""a\"b\\c\u000a""#);
    }
}
