//! A sans-IO decoder of the AWS event stream (`application/vnd.amazon.eventstream`), the
//! binary framing of Bedrock's `invoke-with-response-stream`.
//!
//! Each message is a prelude (total length `u32`, headers length `u32`, CRC32 of those eight
//! bytes), the headers, the payload, and a CRC32 of everything before it; integers are
//! big-endian. Bytes go in as they arrive ([`Decoder::push`]), whole messages come out
//! ([`Decoder::next_message`]): a message split across any number of chunks decodes the same.
//! The buffer holds at most one message of at most [`MAX_MESSAGE`] bytes; a longer length,
//! a bad checksum or malformed headers is an error after which the decoder yields nothing
//! more (a stream cannot be re-synchronised once a length is in doubt).

use bytes::{Buf, Bytes, BytesMut};

use super::codec::crc32;

/// The longest message accepted: the format's 16 MiB payload and 128 KiB headers, plus the
/// prelude and checksums.
pub(crate) const MAX_MESSAGE: usize = 16 * 1024 * 1024 + 128 * 1024 + 16;

/// Prelude (12 bytes) and message checksum (4 bytes).
const OVERHEAD: usize = 16;

/// A header value, by the format's type tags 0 to 9.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum HeaderValue {
    Bool(bool),
    Byte(i8),
    Short(i16),
    Int(i32),
    Long(i64),
    Bytes(Bytes),
    String(String),
    Timestamp(i64),
    Uuid([u8; 16]),
}

/// One decoded message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Message {
    pub(crate) headers: Vec<(String, HeaderValue)>,
    pub(crate) payload: Bytes,
}

impl Message {
    /// The value of string header `name` (`:message-type`, `:event-type`, ...).
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find_map(|(n, v)| match v {
            HeaderValue::String(s) if n == name => Some(s.as_str()),
            _ => None,
        })
    }
}

/// Why a stream could not be decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DecodeError {
    /// The prelude's checksum does not match its lengths.
    PreludeChecksum,
    /// The message's checksum does not match its bytes.
    MessageChecksum,
    /// A total length under 16 bytes, over [`MAX_MESSAGE`], or headers longer than it allows.
    Length(u32),
    /// A header that runs past its block, has an unknown type or a name or string that is
    /// not UTF-8.
    Header,
    /// The stream ended inside a message.
    Truncated,
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DecodeError::PreludeChecksum => f.write_str("event stream prelude checksum mismatch"),
            DecodeError::MessageChecksum => f.write_str("event stream message checksum mismatch"),
            DecodeError::Length(n) => write!(f, "event stream message length {n} out of bounds"),
            DecodeError::Header => f.write_str("malformed event stream header"),
            DecodeError::Truncated => f.write_str("event stream ended inside a message"),
        }
    }
}

/// The incremental decoder.
#[derive(Debug, Default)]
pub(crate) struct Decoder {
    buf: BytesMut,
    failed: bool,
}

impl Decoder {
    /// Appends bytes received from the stream; ignored once the decoder has failed.
    pub(crate) fn push(&mut self, data: &[u8]) {
        if !self.failed {
            self.buf.extend_from_slice(data);
        }
    }

    /// The next whole message, `None` when more bytes are needed (or after an error).
    pub(crate) fn next_message(&mut self) -> Option<Result<Message, DecodeError>> {
        if self.failed || self.buf.len() < 12 {
            return None;
        }
        let result = self.decode_one()?;
        if result.is_err() {
            self.failed = true;
            self.buf = BytesMut::new();
        }
        Some(result)
    }

    /// Called when the stream ends: an error if a partial message is left.
    pub(crate) fn finish(&mut self) -> Result<(), DecodeError> {
        if self.failed || self.buf.is_empty() {
            return Ok(());
        }
        self.failed = true;
        self.buf = BytesMut::new();
        Err(DecodeError::Truncated)
    }

    fn decode_one(&mut self) -> Option<Result<Message, DecodeError>> {
        let word = |at: usize| {
            u32::from_be_bytes([
                self.buf[at],
                self.buf[at + 1],
                self.buf[at + 2],
                self.buf[at + 3],
            ])
        };
        let (total, headers_len, prelude_crc) = (word(0), word(4), word(8));
        if crc32(&self.buf[..8]) != prelude_crc {
            return Some(Err(DecodeError::PreludeChecksum));
        }
        let total_len = total as usize;
        if !(OVERHEAD..=MAX_MESSAGE).contains(&total_len)
            || headers_len as usize > total_len - OVERHEAD
        {
            return Some(Err(DecodeError::Length(total)));
        }
        if self.buf.len() < total_len {
            return None;
        }
        let mut frame = self.buf.split_to(total_len).freeze();
        let body_end = total_len - 4;
        let message_crc = u32::from_be_bytes([
            frame[body_end],
            frame[body_end + 1],
            frame[body_end + 2],
            frame[body_end + 3],
        ]);
        if crc32(&frame[..body_end]) != message_crc {
            return Some(Err(DecodeError::MessageChecksum));
        }
        frame.truncate(body_end);
        frame.advance(12);
        let payload = frame.split_off(headers_len as usize);
        Some(parse_headers(frame).map(|headers| Message { headers, payload }))
    }
}

/// The headers block: name length `u8`, name, type tag `u8`, value.
fn parse_headers(mut block: Bytes) -> Result<Vec<(String, HeaderValue)>, DecodeError> {
    let mut headers = Vec::new();
    while block.has_remaining() {
        let name_len = usize::from(block.get_u8());
        let name = take_string(&mut block, name_len)?;
        if !block.has_remaining() {
            return Err(DecodeError::Header);
        }
        let value = match block.get_u8() {
            0 => HeaderValue::Bool(true),
            1 => HeaderValue::Bool(false),
            2 => HeaderValue::Byte(take(&mut block, 1)?.get_i8()),
            3 => HeaderValue::Short(take(&mut block, 2)?.get_i16()),
            4 => HeaderValue::Int(take(&mut block, 4)?.get_i32()),
            5 => HeaderValue::Long(take(&mut block, 8)?.get_i64()),
            6 => {
                let len = usize::from(take(&mut block, 2)?.get_u16());
                HeaderValue::Bytes(take(&mut block, len)?)
            }
            7 => {
                let len = usize::from(take(&mut block, 2)?.get_u16());
                HeaderValue::String(take_string(&mut block, len)?)
            }
            8 => HeaderValue::Timestamp(take(&mut block, 8)?.get_i64()),
            9 => {
                let mut uuid = [0u8; 16];
                take(&mut block, 16)?.copy_to_slice(&mut uuid);
                HeaderValue::Uuid(uuid)
            }
            _ => return Err(DecodeError::Header),
        };
        headers.push((name, value));
    }
    Ok(headers)
}

fn take(block: &mut Bytes, len: usize) -> Result<Bytes, DecodeError> {
    if block.remaining() < len {
        return Err(DecodeError::Header);
    }
    Ok(block.split_to(len))
}

fn take_string(block: &mut Bytes, len: usize) -> Result<String, DecodeError> {
    String::from_utf8(take(block, len)?.to_vec()).map_err(|_| DecodeError::Header)
}

/// Encodes one message with string headers: the frames the tests (and a mock) send.
#[cfg(test)]
pub(crate) fn encode(headers: &[(&str, &str)], payload: &[u8]) -> Vec<u8> {
    let mut block = Vec::new();
    for (name, value) in headers {
        block.push(name.len() as u8);
        block.extend_from_slice(name.as_bytes());
        block.push(7);
        block.extend_from_slice(&(value.len() as u16).to_be_bytes());
        block.extend_from_slice(value.as_bytes());
    }
    let total = (OVERHEAD + block.len() + payload.len()) as u32;
    let mut out = Vec::new();
    out.extend_from_slice(&total.to_be_bytes());
    out.extend_from_slice(&(block.len() as u32).to_be_bytes());
    out.extend_from_slice(&crc32(&out).to_be_bytes());
    out.extend_from_slice(&block);
    out.extend_from_slice(payload);
    out.extend_from_slice(&crc32(&out).to_be_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk_event(n: usize) -> Vec<u8> {
        encode(
            &[
                (":event-type", "chunk"),
                (":content-type", "application/json"),
                (":message-type", "event"),
            ],
            format!("{{\"bytes\":\"eyJ0eXBlIjoicGluZyJ9\",\"n\":{n}}}").as_bytes(),
        )
    }

    fn drain(decoder: &mut Decoder) -> Vec<Result<Message, DecodeError>> {
        std::iter::from_fn(|| decoder.next_message()).collect()
    }

    /// The frame with one string header (`content-type: application/json`) and the payload
    /// `{'foo':'bar'}` of AWS's event stream test vectors; its checksums are zlib's.
    #[test]
    fn decodes_the_published_example_frame() {
        let frame: &[u8] = &[
            0x00, 0x00, 0x00, 0x3D, 0x00, 0x00, 0x00, 0x20, 0x07, 0xFD, 0x83, 0x96, 0x0C, b'c',
            b'o', b'n', b't', b'e', b'n', b't', b'-', b't', b'y', b'p', b'e', 0x07, 0x00, 0x10,
            b'a', b'p', b'p', b'l', b'i', b'c', b'a', b't', b'i', b'o', b'n', b'/', b'j', b's',
            b'o', b'n', b'{', b'\'', b'f', b'o', b'o', b'\'', b':', b'\'', b'b', b'a', b'r', b'\'',
            b'}', 0x8D, 0x9C, 0x08, 0xB1,
        ];
        let mut decoder = Decoder::default();
        decoder.push(frame);
        let message = decoder.next_message().unwrap().unwrap();
        assert_eq!(message.header("content-type"), Some("application/json"));
        assert_eq!(&message.payload[..], b"{'foo':'bar'}");
        assert!(decoder.next_message().is_none());
        assert_eq!(decoder.finish(), Ok(()));
    }

    #[test]
    fn three_messages_split_at_every_byte_position_decode_the_same() {
        let stream: Vec<u8> = (0..3).flat_map(chunk_event).collect();
        let whole = {
            let mut decoder = Decoder::default();
            decoder.push(&stream);
            drain(&mut decoder)
        };
        assert_eq!(whole.len(), 3);
        for split in 0..=stream.len() {
            for second in split..=stream.len() {
                let mut decoder = Decoder::default();
                let mut got = Vec::new();
                for part in [&stream[..split], &stream[split..second], &stream[second..]] {
                    decoder.push(part);
                    got.extend(drain(&mut decoder));
                }
                assert_eq!(got, whole, "split at {split} and {second}");
                assert_eq!(decoder.finish(), Ok(()));
            }
        }
    }

    #[test]
    fn byte_by_byte_is_the_same_as_whole() {
        let stream: Vec<u8> = (0..4).flat_map(chunk_event).collect();
        let mut decoder = Decoder::default();
        let mut got = Vec::new();
        for byte in &stream {
            decoder.push(std::slice::from_ref(byte));
            got.extend(drain(&mut decoder));
        }
        assert_eq!(got.len(), 4);
        assert!(
            got.iter()
                .all(|m| m.as_ref().unwrap().header(":event-type") == Some("chunk"))
        );
    }

    #[test]
    fn a_bad_checksum_anywhere_is_an_error_and_the_end_of_the_stream() {
        let good = chunk_event(7);
        for at in 0..good.len() {
            let mut bad = good.clone();
            bad[at] ^= 0x40;
            let mut decoder = Decoder::default();
            decoder.push(&bad);
            decoder.push(&chunk_event(8));
            let got = drain(&mut decoder);
            // A flipped length may also leave the decoder waiting for more bytes; it never
            // yields a message whose bytes were changed.
            assert!(
                got.first().is_none_or(Result::is_err),
                "flipped byte {at}: {got:?}"
            );
            assert!(
                got.len() <= 1,
                "flipped byte {at}: decoded on after an error"
            );
        }
    }

    #[test]
    fn lengths_out_of_bounds_are_refused_without_buffering_them() {
        for (total, headers) in [
            (15u32, 0u32),
            (u32::MAX, 0),
            (20, 5),
            (MAX_MESSAGE as u32 + 1, 0),
        ] {
            let mut prelude = Vec::new();
            prelude.extend_from_slice(&total.to_be_bytes());
            prelude.extend_from_slice(&headers.to_be_bytes());
            prelude.extend_from_slice(&crc32(&prelude).to_be_bytes());
            let mut decoder = Decoder::default();
            decoder.push(&prelude);
            assert_eq!(
                decoder.next_message(),
                Some(Err(DecodeError::Length(total)))
            );
            decoder.push(&[0; 64]);
            assert!(decoder.next_message().is_none());
        }
    }

    #[test]
    fn a_stream_ending_inside_a_message_is_truncated() {
        let frame = chunk_event(1);
        let mut decoder = Decoder::default();
        decoder.push(&frame[..frame.len() - 1]);
        assert!(decoder.next_message().is_none());
        assert_eq!(decoder.finish(), Err(DecodeError::Truncated));
    }

    #[test]
    fn every_header_type_decodes() {
        let mut block = Vec::new();
        let mut put = |name: &str, tag: u8, value: &[u8]| {
            block.push(name.len() as u8);
            block.extend_from_slice(name.as_bytes());
            block.push(tag);
            block.extend_from_slice(value);
        };
        put("t", 0, &[]);
        put("f", 1, &[]);
        put("b", 2, &[0xff]);
        put("s", 3, &[0x01, 0x02]);
        put("i", 4, &[0, 0, 1, 0]);
        put("l", 5, &[0, 0, 0, 0, 0, 0, 0, 9]);
        put("y", 6, &[0, 2, 0xca, 0xfe]);
        put("z", 8, &[0, 0, 0, 0, 0, 0, 1, 0]);
        put("u", 9, &[7; 16]);
        let headers = parse_headers(Bytes::from(block)).unwrap();
        let values: Vec<HeaderValue> = headers.into_iter().map(|(_, v)| v).collect();
        assert_eq!(
            values,
            [
                HeaderValue::Bool(true),
                HeaderValue::Bool(false),
                HeaderValue::Byte(-1),
                HeaderValue::Short(0x0102),
                HeaderValue::Int(256),
                HeaderValue::Long(9),
                HeaderValue::Bytes(Bytes::from_static(&[0xca, 0xfe])),
                HeaderValue::Timestamp(256),
                HeaderValue::Uuid([7; 16]),
            ]
        );
        for bad in [
            &[1u8, b'a', 10][..],
            &[1, b'a', 7, 0, 9, b'x'],
            &[2, 0xff, 0xfe, 0],
        ] {
            assert_eq!(
                parse_headers(Bytes::copy_from_slice(bad)),
                Err(DecodeError::Header)
            );
        }
    }

    proptest::proptest! {
        /// Whatever bytes arrive, cut however, the decoder neither panics nor buffers more
        /// than one message's worth, and translating what it yields never panics either.
        #[test]
        fn any_bytes_in_any_pieces_never_panic(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..600),
            cuts in proptest::collection::vec(1usize..64, 1..20),
            splice in proptest::option::of(0usize..400),
        ) {
            let mut stream: Vec<u8> = (0..2).flat_map(chunk_event).collect();
            match splice {
                Some(at) => stream.splice(at.min(stream.len())..at.min(stream.len()), bytes),
                None => stream.splice(.., bytes),
            };
            let mut decoder = Decoder::default();
            let mut rest = &stream[..];
            for cut in cuts.iter().cycle() {
                if rest.is_empty() {
                    break;
                }
                let (piece, after) = rest.split_at((*cut).min(rest.len()));
                rest = after;
                decoder.push(piece);
                while let Some(message) = decoder.next_message() {
                    if let Ok(message) = message {
                        let _ = crate::upstream::answer::translate(&message);
                    }
                }
                proptest::prop_assert!(decoder.buf.len() <= MAX_MESSAGE + 64);
            }
            let _ = decoder.finish();
        }
    }
}
