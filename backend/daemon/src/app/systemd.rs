//! Running under systemd: the directories a unit gives the daemon (`RuntimeDirectory=`,
//! `StateDirectory=`, `ConfigurationDirectory=`, passed as `$RUNTIME_DIRECTORY`,
//! `$STATE_DIRECTORY` and `$CONFIGURATION_DIRECTORY`) and readiness notifications
//! (`Type=notify`: `READY=1`, `STATUS=`, `STOPPING=1` on `$NOTIFY_SOCKET`).
//!
//! Where each directory comes from, first match wins: the command line (`--run-dir`,
//! `--state-dir`, `--config`), then systemd's variable, then the configuration's
//! `[daemon]` key, then the built-in default (`/run/switchyard`, `/var/lib/switchyard`, the
//! embedded configuration). A variable that names several directories (`A:B`, a unit with
//! several) counts by its first.

use std::ffi::OsString;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::path::{Path, PathBuf};

use super::{Daemon, DaemonError, DaemonOptions};

/// systemd's `RuntimeDirectory=`: the run directory (`control.sock`, `endpoints/`).
pub const RUNTIME_DIRECTORY: &str = "RUNTIME_DIRECTORY";
/// systemd's `StateDirectory=`: the state directory (`pool.redb`, `workers/`).
pub const STATE_DIRECTORY: &str = "STATE_DIRECTORY";
/// systemd's `ConfigurationDirectory=`: where `pool.toml` is looked for.
pub const CONFIGURATION_DIRECTORY: &str = "CONFIGURATION_DIRECTORY";
/// The configuration file's name in `$CONFIGURATION_DIRECTORY`.
pub const CONFIG_FILE: &str = "pool.toml";
/// systemd's notification socket (`Type=notify`).
pub const NOTIFY_SOCKET: &str = "NOTIFY_SOCKET";

/// The first directory a systemd directory variable names (`A:B`, a unit with several:
/// `A`), none when unset. A value that is not a list of absolute directories (empty,
/// relative, an empty entry) is refused: systemd sets absolute paths only, so it was set by
/// hand, and ignoring it would put the daemon's sockets or store somewhere it was not meant
/// to be.
fn first_dir(var: &'static str, value: Option<OsString>) -> Result<Option<PathBuf>, DaemonError> {
    let Some(value) = value else {
        return Ok(None);
    };
    let refused = || DaemonError::Environment {
        var,
        value: value.to_string_lossy().into_owned(),
    };
    let bytes = value.as_encoded_bytes();
    let mut dirs = bytes
        .split(|&b| b == b':')
        .map(|d| PathBuf::from(<std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(d)));
    let first = dirs.next().ok_or_else(refused)?;
    if !first.is_absolute() || dirs.any(|d| !d.is_absolute()) {
        return Err(refused());
    }
    Ok(Some(first))
}

impl DaemonOptions {
    /// Fills what the command line left unset from systemd's directory variables, read
    /// through `env` (`std::env::var_os` in the binary): the run directory from
    /// `$RUNTIME_DIRECTORY`, the state directory from `$STATE_DIRECTORY`, and the
    /// configuration from `$CONFIGURATION_DIRECTORY/pool.toml` when that file exists (a unit
    /// whose configuration file was removed runs the embedded default). Each directory
    /// taken is logged. A variable consulted that is set but is not a list of absolute
    /// directories (empty, relative) is an error ([`DaemonError::Environment`], exit
    /// status 2), never ignored.
    pub fn with_systemd_dirs(
        mut self,
        env: impl Fn(&str) -> Option<OsString>,
    ) -> Result<Self, DaemonError> {
        if self.run_dir.is_none()
            && let Some(dir) = first_dir(RUNTIME_DIRECTORY, env(RUNTIME_DIRECTORY))?
        {
            tracing::info!(run_dir = %dir.display(), "run directory from ${RUNTIME_DIRECTORY}");
            self.run_dir = Some(dir);
        }
        if self.state_dir.is_none()
            && let Some(dir) = first_dir(STATE_DIRECTORY, env(STATE_DIRECTORY))?
        {
            tracing::info!(state_dir = %dir.display(), "state directory from ${STATE_DIRECTORY}");
            self.state_dir = Some(dir);
        }
        if self.config.is_none()
            && let Some(dir) = first_dir(CONFIGURATION_DIRECTORY, env(CONFIGURATION_DIRECTORY))?
        {
            let file = dir.join(CONFIG_FILE);
            if std::fs::symlink_metadata(&file).is_ok() {
                tracing::info!(config = %file.display(), "configuration from ${CONFIGURATION_DIRECTORY}");
                self.config = Some(file);
            } else {
                tracing::info!(
                    "no {} in ${CONFIGURATION_DIRECTORY} ({}): the embedded default configuration",
                    CONFIG_FILE,
                    dir.display()
                );
            }
        }
        Ok(self)
    }
}

impl Daemon {
    /// A status line for the service manager: the endpoints served, those left alone.
    pub(super) fn serving_status(&self, control: &Path) -> String {
        let supervised = self.supervisor.list().len();
        let unsupervised = self.unsupervised().len();
        format!(
            "Endpoints: {supervised} served, {unsupervised} not supervised; control socket {}",
            control.display()
        )
    }
}

/// The service manager's notification socket, when the daemon runs as a `Type=notify`
/// service (`$NOTIFY_SOCKET`); without one every notification is a no-op.
#[derive(Debug)]
pub struct Notifier {
    target: Option<(UnixDatagram, SocketAddr)>,
}

impl Notifier {
    /// The socket `$NOTIFY_SOCKET` names (a path, or `@name` in the abstract namespace),
    /// read through `env`; a value that cannot be used is logged and ignored.
    pub fn from_env(env: impl Fn(&str) -> Option<OsString>) -> Self {
        let Some(value) = env(NOTIFY_SOCKET).filter(|v| !v.is_empty()) else {
            return Self { target: None };
        };
        match Self::connect(&value) {
            Ok(target) => Self {
                target: Some(target),
            },
            Err(e) => {
                tracing::warn!(
                    socket = %value.to_string_lossy(),
                    "cannot use ${NOTIFY_SOCKET}; the service manager is not told of readiness: {e}"
                );
                Self { target: None }
            }
        }
    }

    fn connect(value: &std::ffi::OsStr) -> std::io::Result<(UnixDatagram, SocketAddr)> {
        let bytes = value.as_encoded_bytes();
        let addr = match bytes.split_first() {
            Some((b'@', name)) => {
                use std::os::linux::net::SocketAddrExt;
                SocketAddr::from_abstract_name(name)?
            }
            Some((b'/', _)) => SocketAddr::from_pathname(Path::new(value))?,
            _ => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "neither an absolute path nor an abstract socket name (@NAME)",
                ));
            }
        };
        let socket = UnixDatagram::unbound()?;
        Ok((socket, addr))
    }

    /// Whether there is a service manager to notify.
    pub fn active(&self) -> bool {
        self.target.is_some()
    }

    /// Sends `state` (newline-separated `KEY=VALUE` assignments); a failure is logged.
    pub fn notify(&self, state: &str) {
        let Some((socket, addr)) = &self.target else {
            return;
        };
        if let Err(e) = socket.send_to_addr(state.as_bytes(), addr) {
            tracing::warn!(state, "cannot notify the service manager: {e}");
        }
    }

    /// `STATUS=`: one line for `systemctl status`.
    pub fn status(&self, status: &str) {
        self.notify(&format!("STATUS={}", one_line(status)));
    }

    /// `READY=1` with a status line: the control socket listens and every surviving
    /// worker has been adopted.
    pub fn ready(&self, status: &str) {
        self.notify(&format!("READY=1\nSTATUS={}", one_line(status)));
    }

    /// `STOPPING=1` with a status line.
    pub fn stopping(&self, status: &str) {
        self.notify(&format!("STOPPING=1\nSTATUS={}", one_line(status)));
    }
}

fn one_line(s: &str) -> String {
    s.replace('\n', " ")
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use super::*;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
        let vars: BTreeMap<String, OsString> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), OsString::from(v)))
            .collect();
        move |k| vars.get(k).cloned()
    }

    #[test]
    fn the_command_line_wins_over_systemds_directories() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join(CONFIG_FILE), "").expect("write");
        let conf = dir.path().to_str().expect("utf-8");
        let vars = [
            (RUNTIME_DIRECTORY, "/run/sy:/run/other"),
            (STATE_DIRECTORY, "/var/lib/sy"),
            (CONFIGURATION_DIRECTORY, conf),
        ];
        let o = DaemonOptions::default()
            .with_systemd_dirs(env(&vars))
            .expect("absolute directories");
        assert_eq!(
            o.run_dir,
            Some(PathBuf::from("/run/sy")),
            "the first of a list"
        );
        assert_eq!(o.state_dir, Some(PathBuf::from("/var/lib/sy")));
        assert_eq!(o.config, Some(dir.path().join(CONFIG_FILE)));

        let given = DaemonOptions {
            config: Some("/etc/mine.toml".into()),
            state_dir: Some("/srv/state".into()),
            run_dir: Some("/srv/run".into()),
            ..DaemonOptions::default()
        };
        let o = given
            .clone()
            .with_systemd_dirs(env(&vars))
            .expect("absolute directories");
        assert_eq!(
            (o.config, o.state_dir, o.run_dir),
            (given.config, given.state_dir, given.run_dir)
        );
    }

    #[test]
    fn a_directory_variable_that_is_not_absolute_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let conf = dir.path().to_str().expect("utf-8");
        // No configuration file in the directory: the embedded default.
        let o = DaemonOptions::default()
            .with_systemd_dirs(env(&[(CONFIGURATION_DIRECTORY, conf)]))
            .expect("an absolute directory");
        assert_eq!((o.config, o.state_dir, o.run_dir), (None, None, None));
        for (var, value) in [
            (RUNTIME_DIRECTORY, "relative/run"),
            (RUNTIME_DIRECTORY, ""),
            (RUNTIME_DIRECTORY, "/run/sy:relative"),
            (STATE_DIRECTORY, ""),
            (STATE_DIRECTORY, "state"),
            (CONFIGURATION_DIRECTORY, "etc/sy"),
        ] {
            let e = DaemonOptions::default()
                .with_systemd_dirs(env(&[(var, value)]))
                .expect_err(value);
            assert!(
                matches!(&e, DaemonError::Environment { var: v, value: got } if *v == var && got == value),
                "{var}={value:?}: {e:?}"
            );
            assert_eq!(e.exit_code(), 2);
            assert!(e.to_string().contains(&format!("${var}")), "{e}");
            // Not consulted (the command line gave the directory): not refused.
            let given = DaemonOptions {
                config: Some("/etc/mine.toml".into()),
                state_dir: Some("/srv/state".into()),
                run_dir: Some("/srv/run".into()),
                ..DaemonOptions::default()
            };
            given
                .with_systemd_dirs(env(&[(var, value)]))
                .expect("not consulted");
        }
    }

    #[test]
    fn notifications_reach_a_path_socket_and_an_abstract_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("notify");
        let receiver = UnixDatagram::bind(&path).expect("bind");
        receiver
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let n = Notifier::from_env(env(&[(NOTIFY_SOCKET, path.to_str().expect("utf-8"))]));
        assert!(n.active());
        n.ready("serving 2 endpoints\n(1 adopted)");
        let mut buf = [0u8; 256];
        let len = receiver.recv(&mut buf).expect("recv");
        assert_eq!(
            &buf[..len],
            b"READY=1\nSTATUS=serving 2 endpoints (1 adopted)"
        );

        use std::os::linux::net::SocketAddrExt;
        let name = format!("switchyard-notify-test-{}", std::process::id());
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).expect("addr");
        let receiver = UnixDatagram::bind_addr(&addr).expect("bind abstract");
        receiver
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let n = Notifier::from_env(env(&[(NOTIFY_SOCKET, &format!("@{name}"))]));
        n.stopping("stopping");
        let len = receiver.recv(&mut buf).expect("recv");
        assert_eq!(&buf[..len], b"STOPPING=1\nSTATUS=stopping");
    }

    #[test]
    fn without_a_usable_socket_notifications_are_no_ops() {
        for vars in [&[][..], &[(NOTIFY_SOCKET, "relative")][..]] {
            let n = Notifier::from_env(env(vars));
            assert!(!n.active());
            n.ready("nobody listens");
        }
    }
}
