//! What decoding a protobuf message may allocate, checked on its bytes before decoding.
//!
//! prost builds every repeated field while it decodes, before any count check of ours can run,
//! and a decoded element is much larger than its encoding: an empty `Member` of a matchmaking
//! reply is 2 bytes on the wire and over 100 decoded, so 4 MiB of them became ~235 MB of
//! members; a state metadata response (32 MiB) could become ~537 MB of tensor descriptions, and a
//! DHT value (768 KiB) ~41 MB of entries. [`check`] walks the wire format first, without
//! allocating, and counts the occurrences of every field a [`Field`] list names, summed over
//! the whole message (every `addrs` of every member together, say). A count over its limit
//! is an error, so what prost allocates afterwards stays proportional to the limits each
//! decoder means (a group's members, a state's tensors, a value's subkeys), not to the bytes.
//!
//! Fields the list does not name are skipped (their bytes are bounded by the message size and
//! decode to at most their own length). Groups (wire types 3 and 4, deprecated, unused here)
//! are rejected. Nesting follows the list, so depth is bounded by it.

/// One field of a message, as [`check`] sees it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Field<'a> {
    /// The protobuf field number.
    pub number: u32,
    /// Most occurrences (elements, for a packed field) in the whole message.
    pub max: usize,
    /// Which counter the field uses (distinct fields need distinct slots; `< SLOTS`).
    pub slot: usize,
    /// How to look inside it.
    pub kind: Kind<'a>,
}

/// What a [`Field`] holds.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Kind<'a> {
    /// A message with these fields.
    Message(&'a [Field<'a>]),
    /// A repeated scalar (varint) field, packed or not: every element counts.
    Varints,
    /// Anything else (bytes, strings): each occurrence counts once.
    Opaque,
}

/// Counters available to one [`check`].
pub(crate) const SLOTS: usize = 8;

/// Why [`check`] refused a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum GuardError {
    /// A field occurs more often than its limit.
    #[error("field {field} occurs more than {max} times")]
    TooMany {
        /// The field number.
        field: u32,
        /// Its limit.
        max: usize,
    },
    /// The bytes are not a well-formed protobuf message.
    #[error("malformed protobuf: {0}")]
    Malformed(&'static str),
}

/// Checks that decoding `bytes` as a message with `fields` stays within every field's limit.
pub(crate) fn check(bytes: &[u8], fields: &[Field<'_>]) -> Result<(), GuardError> {
    let mut counts = [0usize; SLOTS];
    walk(bytes, fields, &mut counts)
}

fn walk(
    mut buf: &[u8],
    fields: &[Field<'_>],
    counts: &mut [usize; SLOTS],
) -> Result<(), GuardError> {
    while !buf.is_empty() {
        let key = varint(&mut buf)?;
        let number = u32::try_from(key >> 3).map_err(|_| GuardError::Malformed("field number"))?;
        let field = fields.iter().find(|f| f.number == number);
        match key & 7 {
            0 => {
                varint(&mut buf)?;
                if let Some(f) = field {
                    count(f, 1, counts)?;
                }
            }
            1 => skip(&mut buf, 8)?,
            5 => skip(&mut buf, 4)?,
            2 => {
                let len = usize::try_from(varint(&mut buf)?)
                    .map_err(|_| GuardError::Malformed("length"))?;
                let body = buf.get(..len).ok_or(GuardError::Malformed("truncated"))?;
                buf = &buf[len..];
                if let Some(f) = field {
                    match f.kind {
                        Kind::Message(inner) => {
                            count(f, 1, counts)?;
                            walk(body, inner, counts)?;
                        }
                        // Packed: one element per byte that ends a varint.
                        Kind::Varints => {
                            count(f, body.iter().filter(|b| **b & 0x80 == 0).count(), counts)?
                        }
                        Kind::Opaque => count(f, 1, counts)?,
                    }
                }
            }
            _ => return Err(GuardError::Malformed("wire type")),
        }
    }
    Ok(())
}

fn count(f: &Field<'_>, n: usize, counts: &mut [usize; SLOTS]) -> Result<(), GuardError> {
    let c = &mut counts[f.slot];
    *c = c.saturating_add(n);
    if *c > f.max {
        return Err(GuardError::TooMany {
            field: f.number,
            max: f.max,
        });
    }
    Ok(())
}

fn skip(buf: &mut &[u8], n: usize) -> Result<(), GuardError> {
    *buf = buf.get(n..).ok_or(GuardError::Malformed("truncated"))?;
    Ok(())
}

fn varint(buf: &mut &[u8]) -> Result<u64, GuardError> {
    let mut value = 0u64;
    for i in 0..10 {
        let (&b, rest) = buf
            .split_first()
            .ok_or(GuardError::Malformed("truncated varint"))?;
        *buf = rest;
        value |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err(GuardError::Malformed("varint too long"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message as _;

    /// A message with a repeated sub-message that has a repeated string and packed varints.
    #[derive(Clone, PartialEq, prost::Message)]
    struct Outer {
        #[prost(message, repeated, tag = "1")]
        items: Vec<Inner>,
        #[prost(bytes = "vec", tag = "2")]
        blob: Vec<u8>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    struct Inner {
        #[prost(string, repeated, tag = "1")]
        names: Vec<String>,
        #[prost(uint64, repeated, tag = "2")]
        dims: Vec<u64>,
        #[prost(fixed64, tag = "3")]
        fixed: u64,
    }

    const INNER: [Field<'static>; 2] = [
        Field {
            number: 1,
            max: 5,
            slot: 1,
            kind: Kind::Opaque,
        },
        Field {
            number: 2,
            max: 6,
            slot: 2,
            kind: Kind::Varints,
        },
    ];
    const OUTER: [Field<'static>; 1] = [Field {
        number: 1,
        max: 3,
        slot: 0,
        kind: Kind::Message(&INNER),
    }];

    fn item(names: usize, dims: usize) -> Inner {
        Inner {
            names: vec!["n".into(); names],
            dims: (0..dims as u64).map(|d| d * 1000).collect(),
            fixed: 7,
        }
    }

    #[test]
    fn counts_are_summed_over_the_whole_message() {
        let ok = Outer {
            items: vec![item(2, 3), item(3, 3), item(0, 0)],
            blob: vec![1; 100],
        };
        assert_eq!(check(&ok.encode_to_vec(), &OUTER), Ok(()));
        let too_many_items = Outer {
            items: vec![item(0, 0); 4],
            blob: vec![],
        };
        assert_eq!(
            check(&too_many_items.encode_to_vec(), &OUTER),
            Err(GuardError::TooMany { field: 1, max: 3 })
        );
        // Three names in each of two items: 6 > 5 in all, though each item is within it.
        let names = Outer {
            items: vec![item(3, 0), item(3, 0)],
            blob: vec![],
        };
        assert_eq!(
            check(&names.encode_to_vec(), &OUTER),
            Err(GuardError::TooMany { field: 1, max: 5 })
        );
        // Packed varints count per element, multi-byte ones once.
        let dims = Outer {
            items: vec![item(0, 4), item(0, 3)],
            blob: vec![],
        };
        assert_eq!(
            check(&dims.encode_to_vec(), &OUTER),
            Err(GuardError::TooMany { field: 2, max: 6 })
        );
    }

    #[test]
    fn malformed_bytes_are_errors_not_panics() {
        for bad in [&[0x0a, 0x05, 0x01][..], &[0x80], &[0x0b], &[0x09, 1, 2]] {
            assert!(matches!(check(bad, &OUTER), Err(GuardError::Malformed(_))));
        }
        assert_eq!(
            check(&[0xff; 11], &OUTER),
            Err(GuardError::Malformed("varint too long"))
        );
    }

    proptest::proptest! {
        /// On encoded messages, the guard passes exactly those within every limit.
        #[test]
        fn passes_exactly_the_messages_within_the_limits(
            shape in proptest::collection::vec((0usize..4, 0usize..5), 0..6),
        ) {
            let m = Outer {
                items: shape.iter().map(|&(names, dims)| item(names, dims)).collect(),
                blob: vec![],
            };
            let within = m.items.len() <= 3
                && m.items.iter().map(|i| i.names.len()).sum::<usize>() <= 5
                && m.items.iter().map(|i| i.dims.len()).sum::<usize>() <= 6;
            proptest::prop_assert_eq!(check(&m.encode_to_vec(), &OUTER).is_ok(), within);
        }

        /// Arbitrary bytes: an answer, never a panic; what passes and decodes is within limits.
        #[test]
        fn arbitrary_bytes_never_panic(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256),
        ) {
            if check(&bytes, &OUTER).is_ok()
                && let Ok(m) = Outer::decode(&bytes[..])
            {
                proptest::prop_assert!(m.items.len() <= 3);
            }
        }
    }
}
