//! The per-connection loop under the thread-per-connection server: receive a framed message
//! ([`Connection`]), hand it to the connection's [`Dispatcher`], send its reply with the
//! bounded send.

use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use switchyard_endpoint::{SendLimit, send_bounded};

use crate::client_dma::ClientDma;
use crate::dispatcher::{Dispatcher, Outcome, SocketClientDma};
use crate::framer::{Framer, TransportError};
use crate::transport::connection::Connection;
use crate::{Server, ServerError};

/// Sends the dispatcher's reply within the server's send limit, then releases it.
///
/// The message it answers leaves the receive journal (`conn.done()`) as the last step before
/// the send, never after it: with crash continuity, a process killed once the reply is on
/// its way must not have a replacement answer the message again (QEMU takes a reply to no
/// pending request as a corrupt stream). Whole replies or a dropped client, whenever the kill
/// lands:
/// - a reply without descriptors goes out of the reply area with `sendfile`, whose file
///   position says what left: a replacement sends the rest, or drops the client if it cannot
///   (`Server::run_resumed`);
/// - a reply with descriptors (REGION_INFO's: under 1 KiB) waits for room in the socket first,
///   with its request still in the journal (a kill then leaves the request to the
///   replacement), and then goes in one non-blocking `sendmsg`, which the kernel takes whole
///   or not at all. What remains is the few instructions from the journal's publish to that
///   syscall, where a kill loses the reply (it never tears it).
fn send(
    server: &Server,
    writer: &UnixStream,
    send_lock: &Mutex<()>,
    d: &mut Dispatcher,
    conn: &mut Connection,
) -> std::io::Result<()> {
    let _g = send_lock.lock().unwrap_or_else(|p| p.into_inner());
    let (out, out_fds) = d.reply();
    let fds: Vec<BorrowedFd<'_>> = out_fds.iter().map(|f| f.as_fd()).collect();
    let limit = SendLimit {
        timeout: server.config.send_timeout,
        abort: Some(server.stop.abort_fd()),
    };
    if tracing::enabled!(tracing::Level::TRACE)
        && let Ok(h) = switchyard_proto::Header::from_bytes(out.get(..16).unwrap_or(&[]))
    {
        tracing::trace!(msg_id = h.msg_id, cmd = h.cmd, "reply");
    }
    // With crash continuity, a reply without descriptors goes out of the black box's reply
    // area with `sendfile`, whose file position records exactly what left
    // (`Continuity::prepare_reply`).
    let through_area = match conn.continuity() {
        Some(c) if fds.is_empty() => c.prepare_reply(conn.framer(), out).then(|| c.clone()),
        _ => None,
    };
    if through_area.is_none() && !fds.is_empty() && conn.continuity().is_some() {
        switchyard_endpoint::wait_writable(writer, limit)?;
    }
    conn.done();
    let r = match through_area {
        Some(c) => c.send_reply(writer, server.config.send_timeout),
        None => send_bounded(writer, out, &fds, limit),
    };
    drop(fds);
    d.sent();
    r
}

/// A connection a replaced process was serving: its framer rebuilt from the receive journal
/// and the VERSION request it negotiated.
pub(crate) struct Resume {
    pub(crate) framer: Framer,
    pub(crate) version: Option<(u16, u16, Vec<u8>)>,
}

/// How a connection ended.
pub(crate) struct Ended {
    /// Whether it ended with an error.
    pub(crate) result: Result<(), ServerError>,
    /// The client's server→client DMA, if it negotiated: `Server::client_gone` closes it.
    pub(crate) client_dma: Option<Arc<ClientDma>>,
}

/// Serves `stream` until the client leaves, the stream cannot be framed any more or the
/// server stops. The client's DMA windows, eventfds and device state are left as they are:
/// the caller tears the client down (`Server::client_gone`).
pub(crate) fn serve_connection(
    server: &mut Server,
    stream: UnixStream,
    resume: Option<Resume>,
) -> Ended {
    let writer = match stream.try_clone() {
        Ok(w) => Arc::new(w),
        Err(e) => {
            return Ended {
                result: Err(ServerError::Accept(e)),
                client_dma: None,
            };
        }
    };
    let send_lock = Arc::new(Mutex::new(()));
    let mut d = Dispatcher::new(
        server.config.limits.clone(),
        Box::new(SocketClientDma {
            stream: writer.clone(),
            send_lock: send_lock.clone(),
            timeout: server.config.client_dma_timeout,
        }),
    );
    d.set_continuity(server.continuity.clone());
    d.set_dirty_log(server.config.dirty_log);
    d.set_mapped_migration(server.config.mapped_migration);
    server.slot.lock().connected = true;
    let mut conn = match resume {
        None => Connection::new(stream, d.limits().max_msg_size, server.config.poll_spin),
        Some(r) => {
            if let Err(e) = d.resume_session(&server.slot, r.version.as_ref()) {
                tracing::error!(error = %e, "cannot resume the session of the replaced process");
            }
            Connection::resumed(stream, r.framer, server.config.poll_spin)
        }
    };
    conn.set_continuity(server.continuity.clone());
    if server.continuity.is_some()
        && let Err(e) = rustix::net::sockopt::set_socket_timeout(
            &*writer,
            rustix::net::sockopt::Timeout::Send,
            Some(server.config.send_timeout),
        )
    {
        tracing::warn!(error = %e, "cannot bound reply sends (SO_SNDTIMEO)");
    }
    let result = loop {
        let mut request: Option<(u16, Instant)> = None;
        let outcome = match conn.recv() {
            Ok(msg) => {
                if !msg.header.is_reply() {
                    request = Some((msg.header.cmd, Instant::now()));
                }
                d.handle(&server.slot, msg)
            }
            Err(TransportError::Closed) => break Ok(()),
            Err(TransportError::BadHeader(hdr, e)) => d.unframeable(hdr, &e),
            Err(e) => {
                tracing::warn!(error = %e, "connection failed");
                break Ok(());
            }
        };
        match outcome {
            Outcome::Nothing => conn.done(),
            Outcome::Reply => {
                if let Err(e) = send(server, &writer, &send_lock, &mut d, &mut conn) {
                    tracing::warn!(error = %e, "cannot send a reply");
                    break Ok(());
                }
            }
            Outcome::ErrorReply => {
                if let Err(e) = send(server, &writer, &send_lock, &mut d, &mut conn) {
                    tracing::warn!(error = %e, "cannot send an error reply");
                    break Ok(());
                }
            }
            Outcome::Close { reply } => {
                if reply {
                    let _ = send(server, &writer, &send_lock, &mut d, &mut conn);
                }
                break Ok(());
            }
        }
        if let Some((cmd, t0)) = request {
            server.stats.record(cmd, t0.elapsed());
        }
    };
    Ended {
        result,
        client_dma: d.disconnect(),
    }
}
