//! Reading a success's token usage as its body streams to the caller (learned pacing's
//! correction, `correction.rs`, and the gateway's settlement read it).
//!
//! The answer says what a call really used:
//! `"usage":{"input_tokens":N,…,"output_tokens":M}` in a JSON message, and in a stream the
//! same fields in the `message_start` event (input, and a first output count) and in
//! `message_delta` events (the output count so far, cumulative). [`UsageScanner`] finds them
//! in the bytes as they pass — no buffering, no parsing of the JSON, no allocation: a few
//! bytes of state carry a match over from one frame to the next, wherever a frame splits
//! it. The largest value of each field wins (a stream's counts only grow). The prompt
//! cache's counts (`cache_creation_input_tokens`, `cache_read_input_tokens`, reported
//! beside `input_tokens`, not in it) are read the same way, for callers that charge them
//! (public as [`UsageScanner`](crate::rate::UsageScanner)).
//!
//! A value is taken only as JSON writes a number: digits after `"input_tokens"` or
//! `"output_tokens"`, a colon and optional whitespace, ended by whitespace, `,`, `}` or
//! `]`. Anything else there (a string, a sign, a fraction, an exponent) is not a usage. A
//! model's text cannot forge one: quotes inside a JSON string are escaped (`\"`), and the
//! needle starts and ends with a bare quote. Values are capped at [`MAX_TOKENS`].

/// The largest usage believed for one call; a larger value counts as this. The correction
/// itself is capped again at one minute of the learned limit (see `Rates::correct_usage`).
pub(crate) const MAX_TOKENS: u32 = 10_000_000;

/// The fields read, in the order of [`UsageScanner`]'s `seen`.
const NEEDLES: [&[u8]; 4] = [
    b"\"input_tokens\"",
    b"\"output_tokens\"",
    b"\"cache_creation_input_tokens\"",
    b"\"cache_read_input_tokens\"",
];

/// Where the scanner is in a `"…_tokens": N` pattern.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Step {
    /// Looking for a needle.
    #[default]
    Seek,
    /// After a needle: whitespace, then `:`.
    Colon,
    /// After the colon: whitespace, then the first digit.
    Value,
    /// In the digits.
    Digits,
}

/// Finds the largest `"input_tokens": N`, `"output_tokens": M` and the prompt cache's
/// `"cache_creation_input_tokens"` and `"cache_read_input_tokens"` in an answer's bytes (a
/// JSON message, or an SSE stream's events) fed in pieces of any size, wherever they split.
/// Fixed size; never allocates; never panics on any bytes. A value counts only as JSON
/// writes a whole number (capped at 10,000,000); a model's text cannot forge one.
///
/// `FIELDS` says how many of the four it reads, in that order: the default reads all four;
/// the library's own correction reads `UsageScanner<2>` (input and output), half the size.
///
/// ```
/// use fairgate::rate::UsageScanner;
///
/// let mut usage: UsageScanner = UsageScanner::default();
/// usage.feed(br#"{"usage":{"input_tokens":20,"cache_read_input_tok"#);
/// usage.feed(br#"ens":900,"output_tokens":512}}"#);
/// assert_eq!(usage.input_tokens(), Some(20));
/// assert_eq!(usage.cache_read_input_tokens(), Some(900));
/// assert_eq!(usage.output_tokens(), Some(512));
/// assert_eq!(usage.cache_creation_input_tokens(), None);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UsageScanner<const FIELDS: usize = 4> {
    /// Bytes of each needle matched so far.
    matched: [u8; FIELDS],
    step: Step,
    /// The needle whose value is being read.
    field: u8,
    /// The digits so far (saturated past [`MAX_TOKENS`]).
    value: u32,
    /// The largest value seen per field, [`UNSEEN`] for none (never a value: they are
    /// capped at [`MAX_TOKENS`]); plain `u32`s keep the scanner, which rides in every
    /// scanned response body, small.
    seen: [u32; FIELDS],
}

/// A field not seen yet.
const UNSEEN: u32 = u32::MAX;

impl<const FIELDS: usize> Default for UsageScanner<FIELDS> {
    fn default() -> Self {
        const { assert!(FIELDS >= 2 && FIELDS <= NEEDLES.len()) };
        UsageScanner {
            matched: [0; FIELDS],
            step: Step::Seek,
            field: 0,
            value: 0,
            seen: [UNSEEN; FIELDS],
        }
    }
}

impl<const FIELDS: usize> UsageScanner<FIELDS> {
    /// The largest `input_tokens` seen so far.
    pub fn input_tokens(&self) -> Option<u32> {
        self.get(0)
    }

    fn get(&self, field: usize) -> Option<u32> {
        Some(self.seen[field]).filter(|v| *v != UNSEEN)
    }

    /// The largest `output_tokens` seen so far.
    pub fn output_tokens(&self) -> Option<u32> {
        self.get(1)
    }

    /// Whether an input or output count was seen.
    pub fn saw_usage(&self) -> bool {
        self.seen[..2].iter().any(|v| *v != UNSEEN)
    }

    /// Reads the next bytes of the body.
    pub fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.step == Step::Seek && self.matched == [0; FIELDS] {
                // The common case, outside any pattern: skip to the next quote.
                match bytes.iter().position(|b| *b == b'"') {
                    Some(at) => bytes = &bytes[at..],
                    None => return,
                }
            }
            self.byte(bytes[0]);
            bytes = &bytes[1..];
        }
    }

    fn byte(&mut self, b: u8) {
        match self.step {
            Step::Seek => self.seek(b),
            Step::Colon => match b {
                b' ' | b'\t' | b'\r' | b'\n' => {}
                b':' => self.step = Step::Value,
                _ => self.restart(b),
            },
            Step::Value => match b {
                b' ' | b'\t' | b'\r' | b'\n' => {}
                b'0'..=b'9' => {
                    self.value = u32::from(b - b'0');
                    self.step = Step::Digits;
                }
                _ => self.restart(b),
            },
            Step::Digits => match b {
                b'0'..=b'9' => {
                    self.value = self
                        .value
                        .saturating_mul(10)
                        .saturating_add(u32::from(b - b'0'))
                        .min(MAX_TOKENS);
                }
                b' ' | b'\t' | b'\r' | b'\n' | b',' | b'}' | b']' => {
                    let seen = &mut self.seen[usize::from(self.field)];
                    *seen = match *seen {
                        UNSEEN => self.value,
                        v => v.max(self.value),
                    };
                    self.step = Step::Seek;
                }
                // A fraction, an exponent, a quote: not a token count.
                _ => self.restart(b),
            },
        }
    }

    /// Back to seeking, this byte included (it may open a needle).
    fn restart(&mut self, b: u8) {
        self.step = Step::Seek;
        self.seek(b);
    }

    fn seek(&mut self, b: u8) {
        for (i, needle) in NEEDLES[..FIELDS].iter().enumerate() {
            let at = usize::from(self.matched[i]);
            if needle[at] == b {
                if at + 1 == needle.len() {
                    self.matched = [0; FIELDS];
                    self.field = i as u8;
                    self.step = Step::Colon;
                    return;
                }
                self.matched[i] += 1;
            } else {
                // A quote appears in a needle only first and last, so a mismatched quote
                // can only open a new match.
                self.matched[i] = u8::from(b == b'"');
            }
        }
    }
}

impl UsageScanner<4> {
    /// The largest `cache_creation_input_tokens` seen so far (prompt cache writes).
    pub fn cache_creation_input_tokens(&self) -> Option<u32> {
        self.get(2)
    }

    /// The largest `cache_read_input_tokens` seen so far (prompt cache reads).
    pub fn cache_read_input_tokens(&self) -> Option<u32> {
        self.get(3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn scan(pieces: &[&[u8]]) -> (Option<u32>, Option<u32>) {
        let mut s = UsageScanner::<2>::default();
        for piece in pieces {
            s.feed(piece);
        }
        (s.input_tokens(), s.output_tokens())
    }

    /// The JSON message of Anthropic's Messages API (its documented example shape).
    const MESSAGE: &str = r#"{"id":"msg_013Zva2CMHLNnXjNJJKqJ2EF","type":"message","role":"assistant","model":"claude-sonnet-4-5","content":[{"type":"text","text":"Hi! My name is Claude."}],"stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":2095,"cache_creation_input_tokens":0,"cache_read_input_tokens":0,"output_tokens":503}}"#;

    /// A stream in the documented event format (`event:` / `data:` lines), with the counts
    /// of the documentation's example: input in `message_start`, output cumulative in
    /// `message_delta`.
    const STREAM: &str = concat!(
        "event: message_start\n",
        r#"data: {"type": "message_start", "message": {"id": "msg_1nZdL29xx5MUA1yADyHTEsnR8uuvGzszyY", "type": "message", "role": "assistant", "content": [], "model": "claude-sonnet-4-5", "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": 25, "output_tokens": 1}}}"#,
        "\n\n",
        "event: content_block_start\n",
        r#"data: {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}"#,
        "\n\n",
        "event: ping\n",
        r#"data: {"type": "ping"}"#,
        "\n\n",
        "event: content_block_delta\n",
        r#"data: {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hello"}}"#,
        "\n\n",
        "event: content_block_delta\n",
        r#"data: {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "!"}}"#,
        "\n\n",
        "event: content_block_stop\n",
        r#"data: {"type": "content_block_stop", "index": 0}"#,
        "\n\n",
        "event: message_delta\n",
        r#"data: {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence":null}, "usage": {"output_tokens": 15}}"#,
        "\n\n",
        "event: message_stop\n",
        r#"data: {"type": "message_stop"}"#,
        "\n\n",
    );

    #[test]
    fn a_json_message_gives_its_input_and_output_tokens() {
        assert_eq!(scan(&[MESSAGE.as_bytes()]), (Some(2095), Some(503)));
    }

    #[test]
    fn a_stream_gives_the_start_input_and_the_last_delta_output() {
        assert_eq!(scan(&[STREAM.as_bytes()]), (Some(25), Some(15)));
    }

    #[test]
    fn a_split_at_every_byte_offset_reads_the_same() {
        for body in [MESSAGE, STREAM] {
            let bytes = body.as_bytes();
            let whole = scan(&[bytes]);
            for at in 0..=bytes.len() {
                assert_eq!(scan(&[&bytes[..at], &bytes[at..]]), whole, "split at {at}");
            }
            // And one byte per frame.
            let bytes: Vec<&[u8]> = bytes.chunks(1).collect();
            assert_eq!(scan(&bytes), whole);
        }
    }

    #[test]
    fn whitespace_around_the_colon_is_allowed() {
        assert_eq!(
            scan(&[b"{\"input_tokens\" :\n\t 12 , \"output_tokens\":\r\n7}"]),
            (Some(12), Some(7))
        );
    }

    #[test]
    fn the_largest_output_count_wins() {
        assert_eq!(
            scan(&[
                br#"{"usage":{"output_tokens":40}}"#,
                br#"{"usage":{"output_tokens":9}}"#,
                br#"{"usage":{"output_tokens":41}}"#,
            ]),
            (None, Some(41))
        );
    }

    #[test]
    fn cache_counts_and_quoted_text_are_not_usage() {
        // Only the bare field names count; a model's text has its quotes escaped.
        let body = br#"{"cache_creation_input_tokens":900,"cache_read_input_tokens":800,"text":"\"input_tokens\":5 \"output_tokens\": 6"}"#;
        assert_eq!(scan(&[body]), (None, None));
    }

    #[test]
    fn cache_counts_are_read_apart_from_the_input_wherever_the_frames_split() {
        let body = br#"{"usage":{"input_tokens":12,"cache_creation_input_tokens":900,"cache_read_input_tokens":800,"output_tokens":7}}"#;
        for at in 0..=body.len() {
            let mut s: UsageScanner = UsageScanner::default();
            s.feed(&body[..at]);
            s.feed(&body[at..]);
            assert_eq!(
                (
                    s.input_tokens(),
                    s.cache_creation_input_tokens(),
                    s.cache_read_input_tokens(),
                    s.output_tokens()
                ),
                (Some(12), Some(900), Some(800), Some(7)),
                "split at {at}"
            );
        }
        // A cache count alone is no usage: the correction needs input or output.
        let mut s: UsageScanner = UsageScanner::default();
        s.feed(br#"{"cache_read_input_tokens":800}"#);
        assert!(!s.saw_usage());
    }

    #[test]
    fn garbage_values_are_not_usage() {
        for body in [
            r#"{"input_tokens":"12","output_tokens":-3}"#,
            r#"{"input_tokens":1.5,"output_tokens":2e9}"#,
            r#"{"input_tokens":null,"output_tokens":true}"#,
            r#"{"input_tokens":12"#, // the body ends in the number
            r#"{"input_tokens"12,"output_tokens"::4}"#,
            r#""input_tokens""output_tokens""#,
        ] {
            assert_eq!(scan(&[body.as_bytes()]), (None, None), "{body}");
        }
    }

    #[test]
    fn huge_values_are_capped() {
        let body =
            br#"{"input_tokens":99999999999999999999999999999999,"output_tokens":4294967296}"#;
        assert_eq!(scan(&[body]), (Some(MAX_TOKENS), Some(MAX_TOKENS)));
    }

    #[test]
    fn a_pattern_after_garbage_is_still_found() {
        assert_eq!(
            scan(&[br#""input_tokens":x "input_"input_tokens": 3}"#]),
            (Some(3), None)
        );
    }

    proptest! {
        #[test]
        fn any_bytes_in_any_pieces_never_panic(
            bytes in proptest::collection::vec(any::<u8>(), 0..512),
            cuts in proptest::collection::vec(any::<usize>(), 0..8),
        ) {
            let mut s: UsageScanner = UsageScanner::default();
            let mut rest = &bytes[..];
            for cut in cuts {
                let (piece, tail) = rest.split_at(cut % (rest.len() + 1));
                s.feed(piece);
                rest = tail;
            }
            s.feed(rest);
            prop_assert!(s.input_tokens().is_none_or(|v| v <= MAX_TOKENS));
            prop_assert!(s.output_tokens().is_none_or(|v| v <= MAX_TOKENS));
        }

        #[test]
        fn a_usage_among_noise_is_found_wherever_the_frames_split(
            noise in "[a-z{}\\[\\],: \"]{0,64}",
            input in 0u32..2_000_000,
            output in 0u32..200_000,
            cut in any::<usize>(),
        ) {
            // The noise is closed by a space and a brace so it cannot swallow the needle.
            let body = format!(r#"{noise} }}"usage":{{"input_tokens": {input},"output_tokens":{output}}}"#);
            let bytes = body.as_bytes();
            let at = cut % (bytes.len() + 1);
            prop_assert_eq!(scan(&[&bytes[..at], &bytes[at..]]), (Some(input), Some(output)));
        }
    }
}
