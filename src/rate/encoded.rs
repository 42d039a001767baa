//! Reading an answer's usage whatever its `content-encoding`.
//!
//! The Messages API compresses its answers (JSON and SSE alike) when the client asks, and
//! the official SDKs ask (`Accept-Encoding: gzip, deflate`). A scanner fed the compressed
//! bytes finds no usage, so [`UsageReader`] decodes on the side: the body's bytes pass on
//! to the caller as the upstream sent them (no frame waits, nothing is re-encoded), and a
//! copy runs through a pure-Rust decoder (`gzip`, `deflate`, `br`) into the
//! [`UsageScanner`]. The decoder's state is boxed and exists only for a compressed answer;
//! an `identity` answer is scanned as before, allocation-free.
//!
//! An answer whose usage cannot be trusted says so ([`UsageReader::readable`] is false): an
//! encoding it does not know, bytes that do not decode, or more than [`MAX_DECODED`] bytes
//! decoded (a decompression bomb costs at most that much work). The caller then counts its
//! estimate, never 0.

use std::io::Write;

use bytes::Buf;
use http::HeaderMap;
use http::header::CONTENT_ENCODING;

use super::usage::UsageScanner;

/// The most bytes decoded from one answer; past it the answer is unreadable.
pub const MAX_DECODED: u64 = 256 << 20;

/// The brotli decoder's buffer.
const BUFFER: usize = 8 << 10;

/// The one encoding an answer's headers say it has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Coding {
    Identity,
    Gzip,
    Deflate,
    Brotli,
}

impl Coding {
    /// The encoding of an answer with these headers, or why it cannot be read.
    fn of(headers: &HeaderMap) -> Result<Coding, Unreadable> {
        let mut codings = headers
            .get_all(CONTENT_ENCODING)
            .iter()
            .flat_map(|value| value.to_str().unwrap_or("?").split(','))
            .map(|coding| coding.trim().to_ascii_lowercase())
            .filter(|coding| !coding.is_empty() && coding != "identity");
        match (codings.next().as_deref(), codings.next()) {
            (None, _) => Ok(Coding::Identity),
            (Some(_), Some(_)) => Err(Unreadable::MoreThanOneEncoding),
            (Some("gzip" | "x-gzip"), None) => Ok(Coding::Gzip),
            (Some("deflate"), None) => Ok(Coding::Deflate),
            (Some("br"), None) => Ok(Coding::Brotli),
            (Some(_), None) => Err(Unreadable::UnknownEncoding),
        }
    }
}

/// A zlib header's first byte: method 8 (deflate), a window of at most 32 KiB. HTTP's
/// `deflate` is zlib (RFC 9110), but some servers send raw deflate, told apart by it.
fn is_zlib(first: u8) -> bool {
    first & 0x0f == 8 && first >> 4 <= 7
}

/// The first `limit` decoded bytes of a body read whole (or its first part), by its
/// headers' encoding: what decodes before an error or the end of `bytes`. An identity body
/// is itself; one in an encoding it does not know is empty.
pub(crate) fn decoded_prefix<'a>(
    headers: &HeaderMap,
    bytes: &'a [u8],
    limit: usize,
) -> std::borrow::Cow<'a, [u8]> {
    use std::io::Read;
    let reader: Box<dyn Read + 'a> = match Coding::of(headers) {
        Ok(Coding::Identity) => return std::borrow::Cow::Borrowed(bytes),
        Ok(Coding::Gzip) => Box::new(flate2::read::GzDecoder::new(bytes)),
        Ok(Coding::Deflate) if bytes.first().copied().is_some_and(is_zlib) => {
            Box::new(flate2::read::ZlibDecoder::new(bytes))
        }
        Ok(Coding::Deflate) => Box::new(flate2::read::DeflateDecoder::new(bytes)),
        Ok(Coding::Brotli) => Box::new(brotli_decompressor::Decompressor::new(bytes, BUFFER)),
        Err(_) => return std::borrow::Cow::Borrowed(&[]),
    };
    let mut out = Vec::new();
    // What was read before an error stays in `out` (a cut body decodes as far as it goes).
    let _ = reader.take(limit as u64).read_to_end(&mut out);
    std::borrow::Cow::Owned(out)
}

/// Where decoded bytes go: the scanner, counted against [`MAX_DECODED`].
#[derive(Debug, Default)]
struct Sink<const FIELDS: usize> {
    scanner: UsageScanner<FIELDS>,
    decoded: u64,
}

impl<const FIELDS: usize> Write for Sink<FIELDS> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.decoded = self.decoded.saturating_add(bytes.len() as u64);
        if self.decoded > MAX_DECODED {
            return Err(std::io::Error::other("the answer decodes past the bound"));
        }
        self.scanner.feed(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The decoder an answer's encoding needs (boxed by the reader: one allocation, for a
/// compressed answer only).
// The variants differ in size, and the enum is boxed whole: boxing each would allocate twice.
#[allow(clippy::large_enum_variant)]
enum Decoder<const FIELDS: usize> {
    Gzip(flate2::write::GzDecoder<Sink<FIELDS>>),
    /// `deflate` before its first byte (see [`is_zlib`]).
    Deflate(Sink<FIELDS>),
    Zlib(flate2::write::ZlibDecoder<Sink<FIELDS>>),
    RawDeflate(flate2::write::DeflateDecoder<Sink<FIELDS>>),
    Brotli(brotli_decompressor::DecompressorWriter<Sink<FIELDS>>),
}

impl<const FIELDS: usize> Decoder<FIELDS> {
    fn sink(&self) -> &Sink<FIELDS> {
        match self {
            Decoder::Deflate(sink) => sink,
            Decoder::Gzip(d) => d.get_ref(),
            Decoder::Zlib(d) => d.get_ref(),
            Decoder::RawDeflate(d) => d.get_ref(),
            Decoder::Brotli(d) => d.get_ref(),
        }
    }

    /// Decodes `bytes` into the scanner, every decoded byte passed on before it returns.
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        if let Decoder::Deflate(sink) = self {
            let Some(&first) = bytes.first() else {
                return Ok(());
            };
            let sink = std::mem::take(sink);
            *self = match is_zlib(first) {
                true => Decoder::Zlib(flate2::write::ZlibDecoder::new(sink)),
                false => Decoder::RawDeflate(flate2::write::DeflateDecoder::new(sink)),
            };
        }
        match self {
            Decoder::Deflate(_) => Ok(()),
            Decoder::Gzip(d) => d.write_all(bytes).and_then(|()| d.flush()),
            Decoder::Zlib(d) => d.write_all(bytes).and_then(|()| d.flush()),
            Decoder::RawDeflate(d) => d.write_all(bytes).and_then(|()| d.flush()),
            Decoder::Brotli(d) => d.write_all(bytes).and_then(|()| d.flush()),
        }
    }
}

/// Why an answer's usage cannot be trusted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Unreadable {
    UnknownEncoding,
    MoreThanOneEncoding,
    DoesNotDecode,
    PastTheBound,
    TooManyPieces,
}

impl Unreadable {
    fn as_str(self) -> &'static str {
        match self {
            Unreadable::UnknownEncoding => "unknown_encoding",
            Unreadable::MoreThanOneEncoding => "more_than_one_encoding",
            Unreadable::DoesNotDecode => "does_not_decode",
            Unreadable::PastTheBound => "past_the_bound",
            Unreadable::TooManyPieces => "too_many_pieces",
        }
    }
}

/// Where a reader is: reading plain bytes, decoding, or given up (the usage seen kept).
enum State<const FIELDS: usize> {
    Plain(UsageScanner<FIELDS>),
    Decoding(Box<Decoder<FIELDS>>),
    Unreadable(UsageScanner<FIELDS>, Unreadable),
}

/// Finds an answer's token usage (as [`UsageScanner`] does) in its body's bytes as they
/// pass, whatever its `content-encoding`: `identity`, `gzip`, `deflate` or `br`.
///
/// A plain answer costs the scanner alone; a compressed one allocates its decoder once.
///
/// ```
/// use std::io::Write;
/// use fairgate::rate::UsageReader;
///
/// let answer = br#"{"usage":{"input_tokens":20,"output_tokens":512}}"#;
/// let mut gzip = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
/// gzip.write_all(answer).unwrap();
/// let compressed = gzip.finish().unwrap();
///
/// let mut headers = http::HeaderMap::new();
/// headers.insert("content-encoding", "gzip".parse().unwrap());
/// let mut usage: UsageReader = UsageReader::new(&headers);
/// for piece in compressed.chunks(7) {
///     usage.feed(&piece); // each frame as it passes
/// }
/// assert!(usage.readable());
/// assert_eq!(usage.usage().input_tokens(), Some(20));
/// assert_eq!(usage.usage().output_tokens(), Some(512));
/// ```
pub struct UsageReader<const FIELDS: usize = 4> {
    state: State<FIELDS>,
}

impl<const FIELDS: usize> UsageReader<FIELDS> {
    /// A reader for an answer with these headers (its `content-encoding`).
    pub fn new(headers: &HeaderMap) -> Self {
        let sink = Sink::default();
        let decoder = match Coding::of(headers) {
            Ok(Coding::Identity) => return Self::in_state(State::Plain(UsageScanner::default())),
            Ok(Coding::Gzip) => Decoder::Gzip(flate2::write::GzDecoder::new(sink)),
            Ok(Coding::Deflate) => Decoder::Deflate(sink),
            Ok(Coding::Brotli) => {
                Decoder::Brotli(brotli_decompressor::DecompressorWriter::new(sink, BUFFER))
            }
            Err(why) => return Self::in_state(State::Unreadable(UsageScanner::default(), why)),
        };
        Self::in_state(State::Decoding(Box::new(decoder)))
    }

    fn in_state(state: State<FIELDS>) -> Self {
        UsageReader { state }
    }

    /// Reads the next bytes of the body (a data frame, in as many pieces as it has).
    pub fn feed(&mut self, data: &impl Buf) {
        let mut slices = [std::io::IoSlice::new(&[]); 16];
        let n = data.chunks_vectored(&mut slices);
        let mut read = 0;
        for slice in &slices[..n] {
            match &mut self.state {
                State::Plain(scanner) => scanner.feed(slice),
                State::Decoding(decoder) => {
                    if decoder.write(slice).is_err() {
                        let sink = decoder.sink();
                        let why = match sink.decoded > MAX_DECODED {
                            true => Unreadable::PastTheBound,
                            false => Unreadable::DoesNotDecode,
                        };
                        self.state = State::Unreadable(sink.scanner, why);
                        return;
                    }
                }
                State::Unreadable(..) => return,
            }
            read += slice.len();
        }
        if read < data.remaining() {
            // More pieces than one look shows: what follows would not be contiguous.
            self.state = State::Unreadable(*self.usage(), Unreadable::TooManyPieces);
        }
    }

    /// The usage read so far.
    pub fn usage(&self) -> &UsageScanner<FIELDS> {
        match &self.state {
            State::Plain(scanner) | State::Unreadable(scanner, _) => scanner,
            State::Decoding(decoder) => &decoder.sink().scanner,
        }
    }

    /// Whether every byte fed so far was read: false for an encoding it does not know,
    /// bytes that do not decode, or an answer past [`MAX_DECODED`] decoded bytes. A usage
    /// seen before that stays readable in [`usage`](Self::usage).
    pub fn readable(&self) -> bool {
        !matches!(self.state, State::Unreadable(..))
    }

    /// Why the usage cannot be trusted, if it cannot, as a metric label would name it:
    /// `unknown_encoding`, `more_than_one_encoding`, `does_not_decode`, `past_the_bound`,
    /// `too_many_pieces`.
    pub fn unreadable_because(&self) -> Option<&'static str> {
        match self.state {
            State::Unreadable(_, why) => Some(why.as_str()),
            _ => None,
        }
    }
}

impl<const FIELDS: usize> std::fmt::Debug for UsageReader<FIELDS> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let encoding = match &self.state {
            State::Plain(_) => "identity",
            State::Decoding(decoder) => match **decoder {
                Decoder::Gzip(_) => "gzip",
                Decoder::Deflate(_) | Decoder::Zlib(_) | Decoder::RawDeflate(_) => "deflate",
                Decoder::Brotli(_) => "br",
            },
            State::Unreadable(..) => "unreadable",
        };
        f.debug_struct("UsageReader")
            .field("encoding", &encoding)
            .field("usage", self.usage())
            .field("unreadable", &self.unreadable_because())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MESSAGE: &[u8] = br#"{"id":"msg_1","usage":{"input_tokens":2000,"cache_read_input_tokens":30,"output_tokens":4000}}"#;

    fn headers(encoding: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_ENCODING, encoding.parse().unwrap());
        headers
    }

    fn gzip(bytes: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(bytes).unwrap();
        e.finish().unwrap()
    }

    fn zlib(bytes: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(bytes).unwrap();
        e.finish().unwrap()
    }

    fn raw_deflate(bytes: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::best());
        e.write_all(bytes).unwrap();
        e.finish().unwrap()
    }

    fn read(encoding: &str, body: &[u8], piece: usize) -> UsageReader {
        let mut reader = UsageReader::new(&headers(encoding));
        for chunk in body.chunks(piece) {
            reader.feed(&chunk);
        }
        reader
    }

    fn assert_message(reader: &UsageReader) {
        assert!(reader.readable(), "{reader:?}");
        assert_eq!(reader.usage().input_tokens(), Some(2000));
        assert_eq!(reader.usage().output_tokens(), Some(4000));
        assert_eq!(reader.usage().cache_read_input_tokens(), Some(30));
    }

    #[test]
    fn gzip_zlib_and_raw_deflate_answers_are_read_in_pieces_of_any_size() {
        for piece in [1, 2, 3, 7, 64, 4096] {
            assert_message(&read("gzip", &gzip(MESSAGE), piece));
            assert_message(&read("x-gzip", &gzip(MESSAGE), piece));
            assert_message(&read("deflate", &zlib(MESSAGE), piece));
            assert_message(&read("deflate", &raw_deflate(MESSAGE), piece));
            assert_message(&read("identity", MESSAGE, piece));
        }
        assert_message(&read("GZIP ", &gzip(MESSAGE), 5));
    }

    #[test]
    fn an_sse_stream_compressed_with_a_flush_per_event_is_read_event_by_event() {
        let events = [
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":12,\"output_tokens\":1}}}\n\n",
            "event: content_block_delta\ndata: {\"delta\":{\"text\":\"Hi\"}}\n\n",
            "event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":77}}\n\n",
        ];
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        let mut reader: UsageReader = UsageReader::new(&headers("gzip"));
        let mut sent = 0;
        for (i, event) in events.iter().enumerate() {
            encoder.write_all(event.as_bytes()).unwrap();
            encoder.flush().unwrap();
            let written = encoder.get_ref()[sent..].to_vec();
            sent += written.len();
            reader.feed(&&written[..]);
            // What a flushed event says is read before the next event is sent.
            if i == 0 {
                assert_eq!(reader.usage().input_tokens(), Some(12));
            }
        }
        assert_eq!(reader.usage().output_tokens(), Some(77));
        assert!(reader.readable());
    }

    #[test]
    fn a_brotli_answer_is_read() {
        // `MESSAGE` as one uncompressed meta-block (ISLAST=0, MNIBBLES=4, ISUNCOMPRESSED=1),
        // then an empty last meta-block: valid brotli any decoder must read.
        let mut body = Vec::new();
        let len = MESSAGE.len() - 1;
        // WBITS=16 ('0'), ISLAST=0, MNIBBLES=4 ('00'), MLEN-1 in 16 bits, ISUNCOMPRESSED=1.
        let bits: u64 = (len as u64) << 4 | 1 << 20;
        body.extend_from_slice(&bits.to_le_bytes()[..3]);
        body.extend_from_slice(MESSAGE);
        // ISLAST=1, ISLASTEMPTY=1.
        body.push(0b0000_0011);
        for piece in [1, 5, 4096] {
            assert_message(&read("br", &body, piece));
        }
    }

    #[test]
    fn an_unknown_encoding_or_corrupt_bytes_are_unreadable_never_a_panic() {
        let reader = read("zstd", MESSAGE, 16);
        assert!(!reader.readable());
        assert_eq!(reader.usage().input_tokens(), None);
        assert!(!read("gzip, br", MESSAGE, 16).readable());
        assert!(!read("gzip", MESSAGE, 16).readable());
        assert!(!read("br", b"\xff\xff\xff\xff garbage", 3).readable());
        let mut cut = gzip(MESSAGE);
        cut[15] ^= 0xff;
        assert!(!read("gzip", &cut, 8).readable());
    }

    #[test]
    fn a_prefix_of_a_compressed_body_is_decoded_as_far_as_it_goes() {
        let body = gzip(MESSAGE);
        assert_eq!(&*decoded_prefix(&headers("gzip"), &body, 1 << 20), MESSAGE);
        assert_eq!(
            &*decoded_prefix(&headers("gzip"), &body, 10),
            &MESSAGE[..10]
        );
        let cut = decoded_prefix(&headers("gzip"), &body[..body.len() - 12], 1 << 20);
        assert!(MESSAGE.starts_with(&cut), "{cut:?}");
        assert_eq!(
            &*decoded_prefix(&headers("deflate"), &zlib(MESSAGE), 1 << 20),
            MESSAGE
        );
        let raw = raw_deflate(MESSAGE);
        assert_eq!(
            &*decoded_prefix(&headers("deflate"), &raw, 1 << 20),
            MESSAGE
        );
        assert_eq!(&*decoded_prefix(&HeaderMap::new(), MESSAGE, 4), MESSAGE);
        assert!(decoded_prefix(&headers("zstd"), MESSAGE, 1 << 20).is_empty());
    }

    #[test]
    fn a_decompression_bomb_stops_at_the_bound() {
        let zeros = vec![b' '; 1 << 20];
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        for _ in 0..(MAX_DECODED >> 20) + 1 {
            e.write_all(&zeros).unwrap();
        }
        let bomb = e.finish().unwrap();
        assert!(bomb.len() < 1 << 20, "{} bytes", bomb.len());
        let reader = read("gzip", &bomb, 64 << 10);
        assert_eq!(reader.unreadable_because(), Some("past_the_bound"));
    }
}
