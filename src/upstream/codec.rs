//! The encodings Bedrock needs, from the crates made for them (`hmac`, `crc32fast`,
//! `base64`, over `sha2`), and the two that are AWS's own: lowercase hex and the URI
//! encoding of Signature Version 4. Each is checked below against its standard's vectors.

use base64::Engine as _;
use base64::engine::DecodePaddingMode;
use base64::engine::general_purpose::{GeneralPurpose, GeneralPurposeConfig, STANDARD};
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

/// Standard base64 (RFC 4648 §4) that decodes with or without its `=` padding.
const PADDING_OPTIONAL: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// HMAC-SHA256 of `message` under `key` (RFC 2104).
pub(crate) fn hmac_sha256(key: &[u8], message: &[u8]) -> [u8; 32] {
    let mut mac =
        <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes a key of any length");
    mac.update(message);
    mac.finalize().into_bytes().into()
}

/// SHA-256 of `data`, in lowercase hex.
pub(crate) fn sha256_hex(data: &[u8]) -> String {
    hex(&Sha256::digest(data))
}

/// `bytes` in lowercase hex.
pub(crate) fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
    out
}

/// CRC32 (IEEE, as zlib's `crc32`) of `data`.
pub(crate) fn crc32(data: &[u8]) -> u32 {
    crc32fast::hash(data)
}

/// Decodes standard base64 (RFC 4648 §4, `=` padding optional); `None` on any other byte.
pub(crate) fn base64_decode(text: &str) -> Option<Vec<u8>> {
    PADDING_OPTIONAL.decode(text).ok()
}

/// Percent-encodes every byte of `text` except the unreserved ones (`A-Z a-z 0-9 - _ . ~`),
/// and `/` too when `keep_slash`: AWS Signature Version 4's `UriEncode`.
pub(crate) fn uri_encode(text: &str, keep_slash: bool) -> String {
    let mut out = String::with_capacity(text.len());
    for &b in text.as_bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) || (keep_slash && b == b'/') {
            out.push(char::from(b));
        } else {
            out.push('%');
            out.push_str(&hex(&[b]).to_ascii_uppercase());
        }
    }
    out
}

/// Standard base64 with padding (RFC 4648 §4).
pub(crate) fn base64_encode(data: &[u8]) -> String {
    STANDARD.encode(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The test cases of RFC 4231 §4 (case 5 truncates the output and is left out).
    #[test]
    fn hmac_sha256_matches_rfc_4231() {
        let cases: [(Vec<u8>, &[u8], &str); 6] = [
            (
                vec![0x0b; 20],
                b"Hi There",
                "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7",
            ),
            (
                b"Jefe".to_vec(),
                b"what do ya want for nothing?",
                "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843",
            ),
            (
                vec![0xaa; 20],
                &[0xdd; 50],
                "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe",
            ),
            (
                (1..=25).collect(),
                &[0xcd; 50],
                "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b",
            ),
            (
                vec![0xaa; 131],
                b"Test Using Larger Than Block-Size Key - Hash Key First",
                "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54",
            ),
            (
                vec![0xaa; 131],
                b"This is a test using a larger than block-size key and a larger than \
                  block-size data. The key needs to be hashed before being used by the \
                  HMAC algorithm.",
                "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2",
            ),
        ];
        for (i, (key, data, expected)) in cases.iter().enumerate() {
            assert_eq!(hex(&hmac_sha256(key, data)), *expected, "RFC 4231 case {i}");
        }
    }

    #[test]
    fn sha256_of_nothing_is_the_well_known_digest() {
        assert_eq!(
            sha256_hex(b""),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }

    /// The check value of CRC-32/ISO-HDLC (zlib's), and two more computed by zlib.
    #[test]
    fn crc32_matches_zlib() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(crc32(b""), 0);
        assert_eq!(
            crc32(b"The quick brown fox jumps over the lazy dog"),
            0x414F_A339
        );
    }

    /// RFC 4648 §10's vectors, with and without their padding.
    #[test]
    fn base64_decodes_the_rfc_4648_vectors() {
        let vectors = [
            ("", ""),
            ("Zg==", "f"),
            ("Zm8=", "fo"),
            ("Zm9v", "foo"),
            ("Zm9vYg==", "foob"),
            ("Zm9vYmE=", "fooba"),
            ("Zm9vYmFy", "foobar"),
            ("Zm9vYmE", "fooba"),
        ];
        for (encoded, decoded) in vectors {
            assert_eq!(
                base64_decode(encoded).as_deref(),
                Some(decoded.as_bytes()),
                "{encoded}"
            );
        }
        assert_eq!(base64_decode("+/+/").unwrap(), [0xfb, 0xff, 0xbf]);
    }

    #[test]
    fn base64_decodes_what_it_encodes() {
        for len in 0..70 {
            let data: Vec<u8> = (0..len).map(|i| (i * 37 + 11) as u8).collect();
            assert_eq!(base64_decode(&base64_encode(&data)), Some(data));
        }
        assert_eq!(base64_encode(b"foob"), "Zm9vYg==");
    }

    #[test]
    fn base64_refuses_what_is_not_base64() {
        for bad in ["Zm9v!", "Z", "Zm9vY", "Zm 9v", "é"] {
            assert_eq!(base64_decode(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn uri_encoding_keeps_only_unreserved_bytes() {
        assert_eq!(
            uri_encode("anthropic.claude-3-5-sonnet-20240620-v1:0", false),
            "anthropic.claude-3-5-sonnet-20240620-v1%3A0"
        );
        assert_eq!(
            uri_encode("arn:aws:bedrock:us-east-1:1:inference-profile/us.x", false),
            "arn%3Aaws%3Abedrock%3Aus-east-1%3A1%3Ainference-profile%2Fus.x"
        );
        assert_eq!(uri_encode("/a b/%3A~", true), "/a%20b/%253A~");
        assert_eq!(uri_encode("ሴ", true), "%E1%88%B4");
    }
}
