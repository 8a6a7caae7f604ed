//! What proxies say to each other: control messages (little-endian 64-bit words, a put's small
//! payload inline after them), and how a put's rows are cut into MPI messages, the same way on
//! both ends.

use crate::shmem::SignalOp;
use crate::shmem::control::POST_WORDS;

/// Payloads up to this size travel inside the control message, copied when the put is made (its
/// source is free at once); larger ones go as data messages straight from the source into the
/// peer's heap.
pub(crate) const INLINE_BYTES: usize = 16 * 1024;
/// Most bytes of one MPI data message (counts are 32-bit).
const PIECE_BYTES: usize = 1 << 30;

const PUT: u64 = 1;
const STATE: u64 = 2;
const FAIL: u64 = 3;
const BYE: u64 = 4;
const POST: u64 = 5;
const NO_SIGNAL: u64 = u64::MAX;
const PUT_WORDS: usize = 10;

/// A control message.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Message {
    /// Rows into the receiver's segment of heap `heap` (0: the world's; else the id of a group
    /// whose members are on several nodes, whose heap the receiver registered with its proxy),
    /// then a signal there: with the rows inline, or followed by data messages (see [`pieces`]).
    Put {
        heap: u64,
        dst_offset: usize,
        dst_stride: usize,
        rows: usize,
        row_bytes: usize,
        signal: Option<(usize, SignalOp)>,
        inline: Option<Vec<u8>>,
    },
    /// A rank's state (and runs entered), as its node's control block has it.
    State { rank: usize, state: u32, runs: u32 },
    /// A rank's failure, the first its node recorded.
    Fail { rank: usize, reason: String },
    /// The sender is leaving: nothing more will come from it.
    Bye,
    /// A rank's latest call as its record posts it (see `crossed`): the words of its node's
    /// control block, for the other nodes' waiters that look for calls that cross.
    Post { rank: usize, words: [u64; POST_WORDS] },
}

fn words(values: &[u64]) -> Vec<u8> {
    values.iter().flat_map(|w| w.to_le_bytes()).collect()
}

impl Message {
    pub(crate) fn encode(&self) -> Vec<u8> {
        match self {
            Message::Put { heap, dst_offset, dst_stride, rows, row_bytes, signal, inline } => {
                let (sig_offset, sig_kind, sig_value) = match signal {
                    None => (NO_SIGNAL, 0, 0),
                    Some((offset, SignalOp::Set(v))) => (*offset as u64, 0, *v),
                    Some((offset, SignalOp::Add(v))) => (*offset as u64, 1, *v),
                };
                let mut out = words(&[
                    PUT,
                    *dst_offset as u64,
                    *dst_stride as u64,
                    *rows as u64,
                    *row_bytes as u64,
                    sig_offset,
                    sig_kind,
                    sig_value,
                    u64::from(inline.is_some()),
                    *heap,
                ]);
                if let Some(payload) = inline {
                    out.extend_from_slice(payload);
                }
                out
            }
            Message::State { rank, state, runs } => {
                words(&[STATE, *rank as u64, u64::from(*state), u64::from(*runs)])
            }
            Message::Fail { rank, reason } => {
                let mut out = words(&[FAIL, *rank as u64]);
                out.extend_from_slice(reason.as_bytes());
                out
            }
            Message::Bye => words(&[BYE]),
            Message::Post { rank, words: post } => {
                let mut out = words(&[POST, *rank as u64]);
                out.extend(words(post));
                out
            }
        }
    }

    pub(crate) fn decode(bytes: &[u8]) -> Option<Message> {
        let word = |i: usize| -> Option<u64> {
            let b = bytes.get(i * 8..i * 8 + 8)?;
            Some(u64::from_le_bytes(b.try_into().ok()?))
        };
        match word(0)? {
            PUT => {
                let w: Vec<u64> = (0..PUT_WORDS).map(word).collect::<Option<_>>()?;
                let signal = match (w[5], w[6]) {
                    (NO_SIGNAL, _) => None,
                    (offset, 0) => Some((offset as usize, SignalOp::Set(w[7]))),
                    (offset, _) => Some((offset as usize, SignalOp::Add(w[7]))),
                };
                let inline = (w[8] != 0).then(|| bytes[PUT_WORDS * 8..].to_vec());
                Some(Message::Put {
                    heap: w[9],
                    dst_offset: w[1] as usize,
                    dst_stride: w[2] as usize,
                    rows: w[3] as usize,
                    row_bytes: w[4] as usize,
                    signal,
                    inline,
                })
            }
            STATE => Some(Message::State {
                rank: word(1)? as usize,
                state: word(2)? as u32,
                runs: word(3)? as u32,
            }),
            FAIL => Some(Message::Fail {
                rank: word(1)? as usize,
                reason: String::from_utf8_lossy(bytes.get(16..)?).into_owned(),
            }),
            BYE => Some(Message::Bye),
            POST => {
                let mut post = [0u64; POST_WORDS];
                for (i, w) in post.iter_mut().enumerate() {
                    *w = word(2 + i)?;
                }
                Some(Message::Post { rank: word(1)? as usize, words: post })
            }
            _ => None,
        }
    }
}

/// One MPI data message of a put: `rows` rows from row `first_row`, bytes `col..col + bytes` of
/// each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Piece {
    pub(crate) first_row: usize,
    pub(crate) rows: usize,
    pub(crate) col: usize,
    pub(crate) bytes: usize,
}

/// The data messages of a put of `rows` rows of `row_bytes` bytes: groups of whole rows of at
/// most a gibibyte, or pieces of single rows longer than that. Both ends compute the same list.
pub(crate) fn pieces(rows: usize, row_bytes: usize) -> Vec<Piece> {
    if rows == 0 || row_bytes == 0 {
        return Vec::new();
    }
    if row_bytes > PIECE_BYTES {
        return (0..rows)
            .flat_map(|row| {
                (0..row_bytes.div_ceil(PIECE_BYTES)).map(move |i| Piece {
                    first_row: row,
                    rows: 1,
                    col: i * PIECE_BYTES,
                    bytes: (row_bytes - i * PIECE_BYTES).min(PIECE_BYTES),
                })
            })
            .collect();
    }
    let per = (PIECE_BYTES / row_bytes).max(1);
    (0..rows.div_ceil(per))
        .map(|i| Piece {
            first_row: i * per,
            rows: (rows - i * per).min(per),
            col: 0,
            bytes: row_bytes,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip() {
        for m in [
            Message::Put {
                heap: 0x5eed_0001,
                dst_offset: 4096,
                dst_stride: 64,
                rows: 3,
                row_bytes: 12,
                signal: Some((128, SignalOp::Add(2))),
                inline: Some(vec![1, 2, 3]),
            },
            Message::Put {
                heap: 0,
                dst_offset: 0,
                dst_stride: 0,
                rows: 0,
                row_bytes: 0,
                signal: Some((64, SignalOp::Set(7))),
                inline: None,
            },
            Message::State { rank: 3, state: 2, runs: 9 },
            Message::Fail { rank: 1, reason: "rank 1 broke: é".into() },
            Message::Bye,
            Message::Post { rank: 2, words: [7, 1, 2, 3, 4, 5, 6, 7, 8, 9, u64::MAX] },
        ] {
            assert_eq!(Message::decode(&m.encode()), Some(m));
        }
        assert_eq!(Message::decode(&[9, 0, 0, 0, 0, 0, 0, 0]), None);
        assert_eq!(Message::decode(&[1, 0]), None);
    }

    #[test]
    fn pieces_cover_every_byte_once() {
        assert!(pieces(0, 8).is_empty());
        assert_eq!(pieces(5, 8), vec![Piece { first_row: 0, rows: 5, col: 0, bytes: 8 }]);
        let big = pieces(3, PIECE_BYTES / 2 + 1);
        assert_eq!(big.len(), 3);
        assert_eq!(big.iter().map(|p| p.rows).sum::<usize>(), 3);
        let long = pieces(2, PIECE_BYTES + 5);
        assert_eq!(long.len(), 4);
        assert_eq!(long[1], Piece { first_row: 0, rows: 1, col: PIECE_BYTES, bytes: 5 });
    }
}
