//! Who may do what through the control socket (issue 34).
//!
//! Whoever can connect to the control socket (the daemon's user, root, and with
//! `--socket-group` the group's members) is a [`Caller`], known by the uid the kernel gives
//! for the connection (`SO_PEERCRED`). Three roles:
//!
//! | role | who | may |
//! |---|---|---|
//! | operator | root and the daemon's own user ([`Caller::privileged`]) | everything |
//! | owner | the user that created an endpoint ([`switchyard_pool::Endpoint::owner_uid`]) | act on that endpoint: delete, detach, attach, restart, upgrade, move, register or forget its VMM, create a migration's incoming endpoint for it |
//! | reader | every caller | read (boards, pools, endpoints, events, metrics, `sync`), create endpoints (its own) |
//!
//! Board operations (quarantine, unquarantine, drain, fault injection) change what every
//! tenant gets: the operator's alone. A refusal is 403 `forbidden`, checked before anything
//! is done. Endpoints of the configuration file, and those of a store written before owners
//! were recorded, are root's.
//!
//! **A VMM** (QEMU's QMP socket) is a door into a VM: the daemon, as root, unplugs and plugs
//! devices through it. So a user other than the operator registers only a QMP socket that is
//! its own: at registration the path must be a socket (not followed if it is a symbolic link)
//! whose owner is the caller; and since the path may be swapped afterwards, every time the
//! daemon connects to that VMM the process listening on the socket (`SO_PEERCRED` of the
//! connection, checked before a byte is read or written) must run as that user too. The
//! operator may register any path (even one not there yet), and its VMMs are not checked.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;
use std::time::Duration;

use axum::http::StatusCode;
use switchyard_control::{ApiError, Caller};

use super::super::Daemon;
use super::unknown_endpoint;
use super::views::VmmLink;

/// How long a connection to a VMM may take (QEMU starting) and its handshake.
const QMP_TIMEOUT: Duration = Duration::from_secs(10);

fn forbidden(message: String) -> ApiError {
    ApiError::new(StatusCode::FORBIDDEN, "forbidden", message)
}

/// A registered VMM, and whom the process behind its QMP socket must run as.
#[derive(Debug, Clone)]
pub(crate) struct RegisteredVmm {
    /// What was registered.
    pub link: VmmLink,
    /// The uid of the user that registered it, when that was not the operator: the QMP
    /// socket's peer must run as this user at every connection.
    pub qemu_uid: Option<u32>,
}

impl RegisteredVmm {
    /// `link`, registered by `caller`.
    pub(crate) fn new(link: VmmLink, caller: &Caller) -> Self {
        Self {
            link,
            qemu_uid: (!caller.privileged()).then_some(caller.uid),
        }
    }
}

/// `status` as `caller` may read it: an endpoint's migration token is a capability (whoever
/// holds it can pass a migration stream off as the endpoint's), shown only to the endpoint's
/// owner and the operator; everyone else reads the endpoint without it.
pub(super) fn for_caller(
    mut status: super::views::EndpointStatus,
    caller: &Caller,
) -> super::views::EndpointStatus {
    if !caller.privileged() && status.endpoint.owner_uid != caller.uid {
        status.endpoint.migration_token.clear();
    }
    status
}

/// Refuses a caller other than the operator to `what` (a board operation).
pub(super) fn operator_only(caller: &Caller, what: &str) -> Result<(), ApiError> {
    if caller.privileged() {
        return Ok(());
    }
    Err(forbidden(format!(
        "Only root or the daemon's own user may {what}: board operations change what every tenant gets (user {} may act on its own endpoints)",
        caller.uid
    )))
}

impl Daemon {
    /// Refuses a caller that is neither the operator nor endpoint `id`'s owner (an unknown
    /// endpoint is 404, for everyone).
    pub(super) fn owner_or_operator(&self, caller: &Caller, id: &str) -> Result<(), ApiError> {
        let owner = self
            .inventory()
            .endpoint(id)
            .map(|e| e.owner_uid)
            .ok_or_else(|| unknown_endpoint(id))?;
        if caller.privileged() || owner == caller.uid {
            return Ok(());
        }
        Err(forbidden(format!(
            "Endpoint \"{id}\" belongs to user {owner}: user {} may act only on its own endpoints (and read every one)",
            caller.uid
        )))
    }
}

/// Refuses the registration of a QMP socket at `qmp` by `caller` unless it is the caller's
/// own socket: not followed if a symbolic link, a socket, owned by the caller. The operator
/// may register any path.
pub(super) fn check_qmp_registration(caller: &Caller, qmp: &Path) -> Result<(), ApiError> {
    if caller.privileged() {
        return Ok(());
    }
    let uid = caller.uid;
    let meta = std::fs::symlink_metadata(qmp).map_err(|e| {
        forbidden(format!(
            "User {uid} may register only a QMP socket of its own, and {} cannot be inspected: {e}",
            qmp.display()
        ))
    })?;
    if !meta.file_type().is_socket() {
        return Err(forbidden(format!(
            "{} is not a socket (a symbolic link is not followed): user {uid} may register only a QMP socket of its own",
            qmp.display()
        )));
    }
    if meta.uid() != uid {
        return Err(forbidden(format!(
            "The QMP socket {} belongs to user {}, not to user {uid}: a user may register only its own VMM's QMP socket",
            qmp.display(),
            meta.uid()
        )));
    }
    Ok(())
}

/// A QMP connection to endpoint `endpoint`'s VMM. For a VMM a user other than the operator
/// registered, the process listening on the socket must run as that user (`SO_PEERCRED`),
/// checked before anything is said: 403 `forbidden` otherwise.
pub(super) fn qmp_of(
    endpoint: &str,
    vmm: &RegisteredVmm,
) -> Result<switchyard_qemu::Qmp, ApiError> {
    let link = &vmm.link;
    let unreachable =
        |e: &dyn std::error::Error| vmm_error(endpoint, link, "cannot reach the VMM", e);
    let stream = switchyard_qemu::Qmp::connect_stream(&link.qmp, QMP_TIMEOUT)
        .map_err(|e| unreachable(&e))?;
    if let Some(uid) = vmm.qemu_uid {
        let peer = rustix::net::sockopt::socket_peercred(&stream)
            .map_err(|e| unreachable(&std::io::Error::from(e)))?;
        let peer_uid = peer.uid.as_raw();
        if peer_uid != uid {
            tracing::warn!(
                endpoint,
                qmp = %link.qmp.display(),
                peer_uid,
                registered_by = uid,
                "refused a VMM run by another user than the one that registered it"
            );
            return Err(forbidden(format!(
                "Endpoint \"{endpoint}\": the process behind the QMP socket {} runs as user {peer_uid}, not as user {uid}, who registered it; nothing was sent to it",
                link.qmp.display()
            )));
        }
    }
    switchyard_qemu::Qmp::over(stream, &link.qmp, QMP_TIMEOUT).map_err(|e| unreachable(&e))
}

/// A failure of an endpoint's VMM (502).
pub(super) fn vmm_error(
    endpoint: &str,
    link: &VmmLink,
    what: &str,
    e: &dyn std::error::Error,
) -> ApiError {
    ApiError::new(
        StatusCode::BAD_GATEWAY,
        "vmm",
        format!(
            "Endpoint \"{endpoint}\": {what} through QMP at {}: {e}",
            link.qmp.display()
        ),
    )
}
