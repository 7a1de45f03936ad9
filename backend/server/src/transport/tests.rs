//! Tests of the transport: the framer alone, and connections on socket pairs.

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use switchyard_endpoint::send_all;
use switchyard_proto::{Command, Header};

use super::{Connection, Framer, MAX_FDS_PER_READ, TransportError};

fn msg(id: u16, body: &[u8]) -> Vec<u8> {
    let h = Header::command(id, Command::DmaMap, false, body.len()).expect("header");
    let mut v = zerocopy::IntoBytes::as_bytes(&h).to_vec();
    v.extend_from_slice(body);
    v
}

#[test]
fn pipelined_messages_are_split_and_fds_attributed() {
    let (a, b) = UnixStream::pair().expect("pair");
    let mut conn = Connection::new(b, 4096, Duration::ZERO);
    let f = memfd::MemfdOptions::default()
        .create("t")
        .expect("memfd")
        .into_file();
    // Message 1 without fds, then message 2 with one fd, then message 3 without.
    send_all(&a, &msg(1, &[0; 16]), &[]).expect("send 1");
    send_all(&a, &msg(2, &[1; 16]), &[f.as_fd()]).expect("send 2");
    send_all(&a, &msg(3, &[2; 16]), &[]).expect("send 3");
    let m1 = conn.recv().expect("m1");
    assert_eq!((m1.header.msg_id, m1.fds.len()), (1, 0));
    let m2 = conn.recv().expect("m2");
    assert_eq!((m2.header.msg_id, m2.fds.len()), (2, 1));
    assert_eq!(m2.body, &[1; 16]);
    let m3 = conn.recv().expect("m3");
    assert_eq!((m3.header.msg_id, m3.fds.len()), (3, 0));
    drop(a);
    assert!(matches!(conn.recv(), Err(TransportError::Closed)));
}

#[test]
fn message_split_across_reads_and_truncation() {
    let (a, b) = UnixStream::pair().expect("pair");
    let mut conn = Connection::new(b, 4096, Duration::from_micros(50));
    let m = msg(9, &[7; 100]);
    let t = std::thread::spawn(move || {
        send_all(&a, &m[..10], &[]).expect("part 1");
        std::thread::sleep(Duration::from_millis(20));
        send_all(&a, &m[10..], &[]).expect("part 2");
        send_all(&a, &m[..20], &[]).expect("truncated");
    });
    let got = conn.recv().expect("whole");
    assert_eq!(got.header.msg_id, 9);
    assert_eq!(got.body.len(), 100);
    t.join().expect("join");
    assert!(matches!(conn.recv(), Err(TransportError::Truncated)));
}

#[test]
fn truncated_descriptors_are_reported_with_their_message() {
    // Send more descriptors than the receiver's control buffer holds.
    let (a, b) = UnixStream::pair().expect("pair");
    let mut conn = Connection::new(b, 4096, Duration::ZERO);
    let f = memfd::MemfdOptions::default()
        .create("t")
        .expect("memfd")
        .into_file();
    let many: Vec<_> = (0..MAX_FDS_PER_READ + 8).map(|_| f.as_fd()).collect();
    send_all(&a, &msg(1, &[0; 16]), &many).expect("send");
    send_all(&a, &msg(2, &[0; 16]), &[f.as_fd()]).expect("send");
    let m1 = conn.recv().expect("m1");
    assert!(
        m1.fds_truncated,
        "the kernel dropped some: the message must say so"
    );
    let m2 = conn.recv().expect("m2");
    assert!(!m2.fds_truncated);
    assert_eq!(m2.fds.len(), 1);
}

#[test]
fn descriptors_of_the_wrong_kind_are_refused_before_anything_holds_them() {
    let (a, b) = UnixStream::pair().expect("pair");
    let mut conn = Connection::new(b, 4096, Duration::ZERO);
    let (sock, _peer) = UnixStream::pair().expect("pair");
    let evt = switchyard_device::irq::new_eventfd().expect("eventfd");
    let mem = memfd::MemfdOptions::default()
        .create("t")
        .expect("memfd")
        .into_file();
    // A socket, and an eventfd where memory goes: both refused (EINVAL).
    send_all(&a, &msg(1, &[0; 16]), &[sock.as_fd()]).expect("send 1");
    send_all(&a, &msg(2, &[0; 16]), &[evt.as_fd()]).expect("send 2");
    // A message that carries none legitimately.
    let h = Header::command(3, Command::DeviceGetInfo, false, 16).expect("header");
    let mut info = zerocopy::IntoBytes::as_bytes(&h).to_vec();
    info.extend_from_slice(&[0; 16]);
    send_all(&a, &info, &[mem.as_fd()]).expect("send 3");
    // Memory on a DMA_MAP: taken.
    send_all(&a, &msg(4, &[0; 16]), &[mem.as_fd()]).expect("send 4");
    for id in 1..=3 {
        let m = conn.recv().expect("refused message");
        assert_eq!(m.header.msg_id, id);
        assert_eq!(m.fds.len(), 0, "nothing of it is held");
        assert_eq!(m.fds_refused, Some(super::FdRefusal::Kind));
        assert_eq!(super::FdRefusal::Kind.errno(0), libc::EINVAL);
    }
    let m = conn.recv().expect("m4");
    assert_eq!((m.header.msg_id, m.fds.len(), m.fds_refused), (4, 1, None));
}

#[test]
fn oversized_header_is_rejected() {
    let (a, b) = UnixStream::pair().expect("pair");
    let mut conn = Connection::new(b, 64, Duration::ZERO);
    send_all(&a, &msg(1, &[0; 100]), &[]).expect("send");
    assert!(matches!(
        conn.recv(),
        Err(TransportError::BadHeader(Some(_), _))
    ));
}

// The framer alone: reads simulated by copying into `buffer_mut`.

fn feed(f: &mut Framer, bytes: &[u8], fds: Vec<OwnedFd>, truncated: bool) {
    let dst = f.buffer_mut();
    assert!(dst.len() >= bytes.len(), "room for the read");
    dst[..bytes.len()].copy_from_slice(bytes);
    f.filled(bytes.len(), fds, truncated);
}

fn fd() -> OwnedFd {
    memfd::MemfdOptions::default()
        .create("t")
        .expect("memfd")
        .into_file()
        .into()
}

#[test]
fn framer_joins_a_message_split_across_reads() {
    let mut f = Framer::new(4096);
    let m = msg(9, &[7; 100]);
    assert!(f.next_message().expect("frame").is_none(), "nothing yet");
    for chunk in [&m[..3], &m[3..16], &m[16..50]] {
        feed(&mut f, chunk, Vec::new(), false);
        assert!(f.next_message().expect("frame").is_none(), "incomplete");
        assert!(f.partial() > 0);
    }
    feed(&mut f, &m[50..], Vec::new(), false);
    let got = f.next_message().expect("frame").expect("whole message");
    assert_eq!((got.header.msg_id, got.body), (9, &[7u8; 100][..]));
    assert!(f.next_message().expect("frame").is_none());
    assert_eq!(f.partial(), 0, "between messages");
}

/// Every complete message, as (id, descriptor count, truncated), until more bytes are needed.
fn drain(f: &mut Framer) -> Vec<(u16, usize, bool)> {
    std::iter::from_fn(|| {
        f.next_message()
            .expect("frame")
            .map(|m| (m.header.msg_id, m.fds.len(), m.fds_truncated))
    })
    .collect()
}

#[test]
fn framer_gives_a_reads_fds_to_the_last_message_starting_in_it() {
    let mut f = Framer::new(4096);
    // One read: message 1 whole, message 2 whole (its sendmsg carried two fds).
    let mut read = msg(1, &[0; 8]);
    read.extend(msg(2, &[1; 8]));
    feed(&mut f, &read, vec![fd(), fd()], false);
    assert_eq!(drain(&mut f), [(1, 0, false), (2, 2, false)]);
    // Next read: message 3 without fds, and the start of message 4 with one fd.
    let m4 = msg(4, &[4; 32]);
    let mut read = msg(3, &[]);
    read.extend_from_slice(&m4[..20]);
    feed(&mut f, &read, vec![fd()], false);
    assert_eq!(drain(&mut f), [(3, 0, false)]);
    feed(&mut f, &m4[20..], Vec::new(), false);
    assert_eq!(drain(&mut f), [(4, 1, false)]);
}

#[test]
fn framer_reports_truncated_fds_with_their_message_only() {
    let mut f = Framer::new(4096);
    feed(&mut f, &msg(1, &[0; 16]), vec![fd()], true);
    assert_eq!(drain(&mut f), [(1, 1, true)]);
    feed(&mut f, &msg(2, &[0; 16]), vec![fd()], false);
    assert_eq!(drain(&mut f), [(2, 1, false)]);
    // Truncated with no descriptor at all (the process is out of files).
    feed(&mut f, &msg(3, &[]), Vec::new(), true);
    assert_eq!(drain(&mut f), [(3, 0, true)]);
}

#[test]
fn framer_drops_descriptors_left_unclaimed_by_a_later_read() {
    let mut f = Framer::new(4096);
    // Descriptors with an incomplete message, then another read with descriptors (a
    // broken peer): the first ones cannot be told apart and are dropped, not misattributed.
    let m1 = msg(1, &[0; 16]);
    feed(&mut f, &m1[..20], vec![fd(), fd()], false);
    assert!(drain(&mut f).is_empty());
    let mut read = m1[20..].to_vec();
    read.extend(msg(2, &[]));
    feed(&mut f, &read, vec![fd()], false);
    assert_eq!(drain(&mut f), [(1, 0, false), (2, 1, false)]);
}

#[test]
fn framer_compacts_to_fit_a_message_at_the_buffer_end() {
    let size = 256;
    let mut f = Framer::new(size);
    let first = msg(1, &[1; 150]);
    let second = msg(2, &[2; 200]);
    // The second message starts at byte 166: it only fits once the first is gone.
    let mut read = first.clone();
    read.extend_from_slice(&second[..40]);
    feed(&mut f, &read, vec![fd()], false);
    assert_eq!(
        f.next_message().expect("frame").expect("m1").header.msg_id,
        1
    );
    assert!(f.next_message().expect("frame").is_none());
    feed(&mut f, &second[40..], Vec::new(), false);
    let m2 = f.next_message().expect("frame").expect("m2");
    assert_eq!((m2.header.msg_id, m2.body.len()), (2, 200));
    assert_eq!(m2.fds.len(), 1, "its descriptors survive the compaction");
}

#[test]
fn framer_rejects_a_header_larger_than_the_limit() {
    let mut f = Framer::new(64);
    feed(&mut f, &msg(1, &[0; 100])[..64], Vec::new(), false);
    assert!(matches!(
        f.next_message(),
        Err(TransportError::BadHeader(Some(h), _)) if h.msg_id == 1
    ));
}

/// What a framer yields from here on: id, body, custody ids of its descriptors (as many
/// descriptors as ids), truncation.
fn drain_ids(f: &mut Framer) -> Vec<(u16, Vec<u8>, Vec<u64>, bool)> {
    std::iter::from_fn(|| {
        f.next_message().expect("frame").map(|m| {
            assert_eq!(m.fds.len(), m.fd_ids.len(), "a descriptor per id");
            (
                m.header.msg_id,
                m.body.to_vec(),
                m.fd_ids.clone(),
                m.fds_truncated,
            )
        })
    })
    .collect()
}

/// Three reads: message 1 alone with a descriptor; the end of nothing... (see the body).
fn scenario() -> Vec<(Vec<u8>, Vec<u64>)> {
    let m1 = msg(1, b"first");
    let m2 = msg(2, &[7u8; 100]);
    let m3 = msg(3, b"third");
    let m4 = msg(4, b"fourth, split across reads");
    let mut reads = vec![(m1, vec![100])];
    // Message 2 and the start of 3 in one read, with two descriptors (they belong to 3,
    // the last message starting in the read).
    let mut r2 = m2.clone();
    r2.extend_from_slice(&m3[..10]);
    reads.push((r2, vec![101, 102]));
    // The rest of 3 and the first half of 4.
    let mut r3 = m3[10..].to_vec();
    r3.extend_from_slice(&m4[..20]);
    reads.push((r3, vec![]));
    reads.push((m4[20..].to_vec(), vec![]));
    reads
}

fn feed_ids(f: &mut Framer, bytes: &[u8], ids: &[u64]) {
    let dst = f.buffer_mut();
    dst[..bytes.len()].copy_from_slice(bytes);
    let fds: Vec<OwnedFd> = ids.iter().map(|_| fd()).collect();
    f.filled_with_ids(bytes.len(), fds, ids, false);
}

/// Journals taken at every point of the stream (after each read, after each message
/// handed out) resume into a framer that yields exactly what the original yields from
/// that point, message in flight first.
#[test]
fn a_journal_resumes_the_stream_exactly_where_it_stopped() {
    let reads = scenario();
    // The reference: everything the stream yields.
    let mut reference = Framer::new(4096);
    let mut all = Vec::new();
    for (bytes, ids) in &reads {
        feed_ids(&mut reference, bytes, ids);
        all.extend(drain_ids(&mut reference));
    }
    assert_eq!(
        all.iter().map(|m| (m.0, m.2.clone())).collect::<Vec<_>>(),
        vec![
            (1, vec![100]),
            (2, vec![]),
            (3, vec![101, 102]),
            (4, vec![])
        ]
    );
    // As the server reads: every read is drained before the next. Stop after read r, in
    // the middle of its drain: j messages of it handed out, the j-th still in flight (or,
    // with j = 3, the drain finished and nothing in flight).
    for r in 0..reads.len() {
        for j in 0..=3 {
            let mut f = Framer::new(4096);
            let mut seen = Vec::new();
            let mut last_in_flight = false;
            for (n, (bytes, ids)) in reads[..=r].iter().enumerate() {
                feed_ids(&mut f, bytes, ids);
                let limit = if n == r { j } else { usize::MAX };
                let mut handed = 0;
                while handed < limit {
                    match f.next_message().expect("frame") {
                        Some(m) => {
                            seen.push((
                                m.header.msg_id,
                                m.body.to_vec(),
                                m.fd_ids.clone(),
                                m.fds_truncated,
                            ));
                            last_in_flight = true;
                            handed += 1;
                        }
                        None => {
                            last_in_flight = false;
                            break;
                        }
                    }
                }
            }
            let mut journal = Vec::new();
            f.journal(&mut journal);
            let mut resumed = Framer::resume(4096, &journal, |_| Some(fd())).expect("resume");
            // The message in flight (the last handed out) comes again, then the rest.
            let answered = seen.len() - usize::from(last_in_flight);
            let mut got: Vec<_> = seen[..answered].to_vec();
            got.extend(drain_ids(&mut resumed));
            for (bytes, ids) in &reads[r + 1..] {
                feed_ids(&mut resumed, bytes, ids);
                got.extend(drain_ids(&mut resumed));
            }
            assert_eq!(
                got, all,
                "stopped after read {r}, {j} messages into its drain"
            );
        }
    }
}

#[test]
fn a_journal_with_lost_descriptors_marks_their_message_truncated() {
    let reads = scenario();
    let mut f = Framer::new(4096);
    feed_ids(&mut f, &reads[0].0, &reads[0].1);
    let m = f.next_message().expect("frame").expect("message 1");
    assert_eq!(m.fd_ids, vec![100]);
    let mut journal = Vec::new();
    f.journal(&mut journal);
    let mut resumed = Framer::resume(4096, &journal, |_| None).expect("resume");
    let again = drain_ids(&mut resumed);
    assert_eq!(again.len(), 1);
    assert!(
        again[0].3,
        "refused as truncated, never reinterpreted without its fd"
    );
}

#[test]
fn malformed_journals_are_refused() {
    let mut f = Framer::new(4096);
    feed_ids(&mut f, &msg(1, b"x"), &[5]);
    let mut j = Vec::new();
    f.journal(&mut j);
    for cut in 0..j.len() {
        assert!(
            matches!(
                Framer::resume(4096, &j[..cut], |_| Some(fd())),
                Err(TransportError::Journal)
            ),
            "cut at {cut}"
        );
    }
    let mut longer = j.clone();
    longer.push(0);
    assert!(Framer::resume(4096, &longer, |_| Some(fd())).is_err());
    assert!(
        Framer::resume(16, &j, |_| Some(fd())).is_err(),
        "larger than the buffer"
    );
    assert!(Framer::resume(4096, &j, |_| Some(fd())).is_ok());
}

/// The receiving half of a process killed after it peeked a message: whether it had
/// journaled it (`journaled`) or not, the replacement's connection yields that message
/// exactly once, then the next.
fn killed_after_peek(journaled: bool) {
    let (mut client, server) = UnixStream::pair().expect("pair");
    switchyard_sys::sock::set_peek_offset(server.as_fd(), 0).expect("SO_PEEK_OFF");
    use std::io::Write;
    client.write_all(&msg(1, b"first")).expect("send");
    // The dead process: peeked, and (maybe) journaled, never consumed.
    let mut dead = Framer::new(4096);
    let got = switchyard_endpoint::peek(&server, dead.buffer_mut(), 8, false, drop).expect("peek");
    dead.filled(got.bytes, Vec::new(), false);
    dead.set_unconsumed(got.bytes);
    let mut journal = Vec::new();
    if journaled {
        dead.journal(&mut journal);
    } else {
        Framer::new(4096).journal(&mut journal);
    }
    // The replacement.
    let framer = Framer::resume(4096, &journal, |_| None).expect("resume");
    Connection::settle_peeked(&server, framer.unconsumed()).expect("settle");
    client.write_all(&msg(2, b"second")).expect("send");
    let mut conn = Connection::resumed(server, framer, Duration::ZERO);
    let ids: Vec<u16> = (0..2)
        .map(|_| conn.recv().expect("message").header.msg_id)
        .collect();
    assert_eq!(ids, vec![1, 2], "journaled: {journaled}");
}

#[test]
fn a_read_peeked_and_journaled_by_a_killed_process_is_not_read_again() {
    killed_after_peek(true);
}

#[test]
fn a_read_peeked_but_not_journaled_by_a_killed_process_is_read_again() {
    killed_after_peek(false);
}
